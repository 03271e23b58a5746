"""--stream-interval (upstream's flag): streamed responses carry the first token at once, then a
chunk every N tokens, and the rest with the finish; text and tokens equal the unstreamed answer."""

from __future__ import annotations

import openai
import pytest

from tests.utils import RemoteServer
from vllm.core.messages import EngineCoreOutput
from vllm.engine.output_processor import OutputProcessor, RequestState
from vllm.sampling_params import RequestOutputKind, SamplingParams

MODEL = "tiny-glm-5.3"


def _emitted(interval: int, steps: list[int], finish_at_end: bool = True) -> list[int]:
    """Token counts of the outputs emitted for engine outputs of ``steps`` tokens each (a step
    of MTP brings several)."""
    proc = OutputProcessor(interval)
    params = SamplingParams(max_tokens=100, detokenize=False)
    params.output_kind = RequestOutputKind.DELTA
    st = RequestState("r", None, (1, 2, 3), params, None)
    out, tok = [], 10
    for i, n in enumerate(steps):
        last = finish_at_end and i == len(steps) - 1
        eo = EngineCoreOutput(
            "r", list(range(tok, tok + n)), finish_reason="length" if last else None
        )
        tok += n
        ro, _ = proc.process(st, eo)
        if ro is not None:
            out.append(len(ro.outputs[0].token_ids))
    return out


def test_chunks_follow_the_interval():
    assert _emitted(1, [1] * 6) == [1] * 6
    assert _emitted(4, [1] * 15) == [1, 4, 4, 4, 2]
    assert _emitted(4, [1] * 13) == [1, 4, 4, 4]  # the finish comes with the last chunk
    # several tokens a step (MTP): held until at least N, then all of them
    assert _emitted(4, [1, 3, 2, 3, 1]) == [1, 5, 4]
    assert _emitted(3, [2, 1, 1, 1]) == [2, 3]


@pytest.fixture(scope="module")
def client(tiny_ckpt):
    with RemoteServer([tiny_ckpt, "--served-model-name", MODEL, "--stream-interval", "4"]) as s:
        yield openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)


def test_completion_stream_in_chunks_of_the_interval(client):
    kw = dict(model=MODEL, prompt="Streaming test", max_tokens=15, temperature=0, logprobs=0)
    full = client.completions.create(**kw).choices[0]
    chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
    assert [len(c.choices[0].logprobs.tokens) for c in chunks] == [1, 4, 4, 4, 2]
    assert "".join(c.choices[0].text for c in chunks) == full.text
    assert sum((c.choices[0].logprobs.tokens for c in chunks), []) == full.logprobs.tokens
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_stream_in_chunks_of_the_interval(client):
    kw = dict(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=10, temperature=0
    )
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, logprobs=True, **kw))
    sizes = [
        len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs
    ]
    assert sizes == [1, 4, 4, 1]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full


def test_bad_interval_is_refused(tiny_ckpt):
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="--stream-interval must be >= 1"):
        EngineArgs(model=tiny_ckpt, stream_interval=0).create_engine_config()
