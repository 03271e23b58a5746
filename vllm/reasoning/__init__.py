"""Reasoning parsers (`--reasoning-parser`): split a chat completion's generated text into
``reasoning_content`` and ``content``, streamed or whole, working on detokenized text (markup such
as ``<think>`` may be ordinary text to the tokenizer, and a streamed delta may cut a tag
anywhere). Tool calls are parsed afterwards, from the content part only; that and the response
bodies belong to `entrypoints/openai`, not here."""

from __future__ import annotations

from vllm.reasoning.abs_reasoning_parsers import ReasoningParser
from vllm.reasoning.glm45 import Glm45ReasoningParser

# --reasoning-parser NAME -> parser class (upstream vLLM's names)
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {"glm45": Glm45ReasoningParser}

__all__ = ["REASONING_PARSERS", "Glm45ReasoningParser", "ReasoningParser"]
