"""Offline inference with the `LLM` class.

    python examples/offline_inference.py            # the built-in tiny checkpoint, on CPU or GPU
    python examples/offline_inference.py /models/GLM-5.3-FP8 --kv-cache-dtype fp8_ds_mla

With no model, `LLM()` writes the built-in tiny GLM-5.3-architecture checkpoint once under
`$VLLM_CACHE_ROOT` (default `~/.cache/vllm/tiny-glm-5.3`) and loads it. Its weights are random, so
the text is gibberish; the scheduler, kernels and parallel paths are the real ones.
"""

from __future__ import annotations

import argparse

from vllm import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Sparse attention reads only",
    "def fibonacci(n):",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=None, help="HF checkpoint folder (default: tiny)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_ds_mla"])
    args = p.parse_args()

    # LLM(**kwargs) takes the `vllm serve` flags under their Python names (docs/flags.md), e.g.
    # prefill_context_parallel_size=8, decode_context_parallel_size=8, enable_expert_parallel=True.
    llm = LLM(args.model, kv_cache_dtype=args.kv_cache_dtype)
    try:
        # Greedy: the same tokens on every run. One SamplingParams for all prompts (or one each).
        greedy = SamplingParams(temperature=0.0, max_tokens=16)
        for out in llm.generate(PROMPTS, greedy):
            c = out.outputs[0]
            print(f"{out.prompt!r} -> {c.text!r} ({len(c.token_ids)} tokens, {c.finish_reason})")

        # Sampling: n completions per prompt, with a per-request seed for reproducibility.
        sampled = SamplingParams(n=2, temperature=0.8, top_p=0.95, seed=1234, max_tokens=8)
        (out,) = llm.generate(PROMPTS[:1], sampled)
        for c in out.outputs:
            print(f"  sample {c.index}: {c.text!r}")

        # Chat: the checkpoint's chat template turns messages into one prompt.
        messages = [{"role": "user", "content": "Say hi in three words."}]
        (out,) = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=12))
        print(f"chat -> {out.outputs[0].text!r}")
    finally:
        llm.shutdown()  # stops the engine-core and worker processes


if __name__ == "__main__":  # the engine starts processes (spawn): the guard is required
    main()
