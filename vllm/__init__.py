"""A vLLM-shaped engine serving sparse-MLA GLM-5.3 models: PCP, DCP, FP8 KV, HiSparse."""

from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name):
    if name == "LLM":  # heavy import (torch, zmq): only on demand
        from vllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
