"""Request bodies of the OpenAI-compatible API, with vLLM's extra sampling fields.

Unknown fields are accepted and ignored (clients and routers send many, and upstream ignores them
too, e.g. ``user``); fields of upstream's API that this server does not implement are refused by
name (`check_unsupported`); fields we do accept are validated, and a bad value is a 400 with a
message.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    best_of: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    logit_bias: dict[str, float] | None = None  # token id (a string in JSON) -> bias
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    response_format: dict | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    structured_outputs: dict | None = None  # upstream's: json, regex, choice, grammar, ...
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    user: str | None = None
    # P/D disaggregation (a router's): {"do_remote_decode": true} to a prefill engine, the
    # prefill response's params to the decode engine
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    # checked in chat_utils.check_tools: [{"type": "function", "function": {"name", ...}}] and
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True


# Fields of upstream vLLM's request bodies that this server does not implement, with the values
# that mean "not used": any other value is a 400 naming the field, never silently ignored. Only
# undeclared fields are checked, so a field declared above (implemented) is never refused here.
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "suffix": (None,),
    "echo": (None, False),  # chat; completions declare and serve it
    "use_beam_search": (None, False),
    "truncate_prompt_tokens": (None,),
    "logits_processors": (None,),
    "prompt_embeds": (None,),
    "priority": (None, 0),
    "cache_salt": (None,),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
}


def check_unsupported(req: BaseModel) -> None:
    """Raise ValueError naming the first field in UNSUPPORTED_FIELDS that the request sets."""
    for name, value in (req.model_extra or {}).items():
        neutral = UNSUPPORTED_FIELDS.get(name)
        if neutral is not None and value not in neutral:
            raise ValueError(f"{name} is not supported by this server")


def error_body(
    message: str, err_type: str = "BadRequestError", code: int = 400, param: str | None = None
) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
