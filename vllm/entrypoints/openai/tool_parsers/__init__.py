"""Tool-call parsers (`--enable-auto-tool-choice --tool-call-parser NAME`): find the tool calls a
model writes in its own markup in the generated text, as OpenAI ``tool_calls``, streamed as
upstream vLLM's parsers stream them. They see detokenized text only (the content part, after the
reasoning parser). Request validation and response bodies live in `chat_utils.py` and
`chat_output.py`; calls forced by ``tool_choice`` are decoded as JSON (`structured.py`)."""

from __future__ import annotations

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser, merge_deltas
from vllm.entrypoints.openai.tool_parsers.glm4 import Glm4ToolParser

# --tool-call-parser NAME -> parser class (upstream's names: glm45 for GLM-4.5/4.6, glm47 for
# GLM-4.7 and 5.x; one parser reads both formats)
TOOL_PARSERS: dict[str, type[ToolParser]] = {"glm45": Glm4ToolParser, "glm47": Glm4ToolParser}

__all__ = ["TOOL_PARSERS", "Glm4ToolParser", "ToolParser", "merge_deltas"]
