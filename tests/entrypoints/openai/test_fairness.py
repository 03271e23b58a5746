"""A short request is not held behind a long prompt's prefill (a live `vllm serve`, CPU)."""

from __future__ import annotations

import json
import threading
import time

import requests

from tests.utils import RemoteServer

MODEL = "tiny-glm-5.3"
BUDGET = 512  # --max-num-batched-tokens: a 12K-token prompt takes ~24 steps


def _first_token_at(url: str, prompt: list[int], out: dict, key: str) -> None:
    """Stream a completion; record when its first token arrived (monotonic seconds)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True, "ignore_eos": True}
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                if json.loads(line[6:])["choices"][0]["text"] is not None:
                    out.setdefault(key, time.monotonic())


def test_short_prompt_first_token_during_long_prefill(tiny_ckpt):
    """Bound: the short prompt is admitted at the first step after it arrives and computed in that
    step, so its first token comes within two step times, while the long prefill goes on."""
    with RemoteServer(
        [tiny_ckpt, "--served-model-name", MODEL, "--max-num-batched-tokens", str(BUDGET)]
    ) as s:
        long_prompt = [(7 * i) % 1000 + 3 for i in range(12000)]
        got: dict = {}
        t0 = time.monotonic()
        th = threading.Thread(target=_first_token_at, args=(s.url, long_prompt, got, "long"))
        th.start()
        while not _running(s.url):  # the long prefill is under way
            time.sleep(0.05)
        time.sleep(0.5)
        sent = time.monotonic()
        _first_token_at(s.url, [11, 12, 13, 14], got, "short")
        th.join()
        assert got["short"] < got["long"], "the short request waited for the whole prefill"
        steps = len(long_prompt) / BUDGET
        print(
            f"short first token {got['short'] - sent:.2f} s after sending; long prefill "
            f"{got['long'] - t0:.1f} s (~{(got['long'] - t0) / steps:.2f} s a step)"
        )


def _running(url: str) -> bool:
    text = requests.get(url + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.split()[-1]) > 0
    return False
