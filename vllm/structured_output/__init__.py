"""Structured outputs: a request's output constrained by a grammar (JSON schema, any JSON object,
regex, a choice of strings, EBNF), as upstream's ``SamplingParams.structured_outputs``.

The front end checks the constraint (:meth:`StructuredOutputsParams.validate`, a 400 when bad);
the engine core compiles it with xgrammar off the step loop and keeps one matcher per request
(:mod:`vllm.structured_output.manager`); each step the scheduler sends the bitmask of allowed
tokens for the rows that sample, and the sampler masks the logits on the device
(:func:`vllm.structured_output.bitmask.apply_token_bitmask`).
"""

from vllm.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
