"""`vllm serve` with the seed's parallel flags, through the real OpenAI client."""

from __future__ import annotations

import openai
import pytest

from tests.utils import RemoteServer

pytestmark = pytest.mark.distributed

PROMPT = list(range(40, 140))


def _greedy(args) -> list[str]:
    with RemoteServer(args) as s:
        c = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        outs = []
        for p in (PROMPT, PROMPT[:7], "A text prompt that goes through the tokenizer"):
            r = c.completions.create(
                model=c.models.list().data[0].id,
                prompt=p,
                max_tokens=20,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            outs.append(r.choices[0].text)
        return outs


@pytest.mark.timeout(400)
def test_seed_flags_serve_same_greedy_text(tiny_ckpt):
    ref = _greedy([tiny_ckpt])
    assert (
        _greedy(
            [
                tiny_ckpt,
                "-pcp",
                "2",
                "-dcp",
                "2",
                "--dcp-comm-backend",
                "ag_rs",
                "--enable-expert-parallel",
            ]
        )
        == ref
    )
    assert _greedy([tiny_ckpt, "--data-parallel-size", "2", "--enable-expert-parallel"]) == ref
