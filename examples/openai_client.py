"""The `openai` Python client against a running `vllm serve`.

    vllm serve &                                   # the built-in tiny checkpoint on 127.0.0.1:8000
    python examples/openai_client.py               # or --base-url http://HOST:PORT/v1 --api-key KEY

Completions and chat completions, each without and with streaming. The model name is the one the
server reports (`/v1/models`): `tiny-glm-5.3` for the built-in checkpoint, else the checkpoint
path or `--served-model-name`.
"""

from __future__ import annotations

import argparse
import os

from openai import OpenAI


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    # Only checked when the server runs with --api-key; the client needs some value regardless.
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY", "EMPTY"))
    args = p.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    print(f"model: {model}")

    # Completions, whole response. temperature 0 = greedy.
    r = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=16, temperature=0.0
    )
    print(f"completion: {r.choices[0].text!r} (finish: {r.choices[0].finish_reason})")
    print(
        f"  usage: {r.usage.prompt_tokens} prompt + {r.usage.completion_tokens} completion tokens"
    )

    # Completions, streamed as server-sent events: one chunk per detokenised piece.
    print("completion, streamed: ", end="", flush=True)
    stream = client.completions.create(
        model=model, prompt="Sparse attention reads only", max_tokens=16, stream=True
    )
    for chunk in stream:
        print(chunk.choices[0].text, end="", flush=True)
    print()

    # Chat completions: the server applies the checkpoint's chat template.
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three prime numbers."},
    ]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=16, seed=7)
    print(f"chat: {r.choices[0].message.content!r}")

    # Chat, streamed; include_usage adds a last chunk with the token counts and no choices.
    print("chat, streamed: ", end="", flush=True)
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage is not None:
            print(f"\n  usage: {chunk.usage.completion_tokens} completion tokens", end="")
    print()


if __name__ == "__main__":
    main()
