"""MTP speculative decoding under the parallel layouts: every configuration's greedy tokens with
drafts equal the single-rank run without drafts (the CPU parity matrix of issue 36). Drafting runs
its first pass with the target step's PCP/DCP split, its later passes through the planner's decode
sharding, and, under DP + EP, an idle replica runs the same passes on padding."""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams

pytestmark = [pytest.mark.distributed]

PROMPTS = [list(range(7 + 3 * i, 7 + 3 * i + n)) for i, n in enumerate((5, 40, 130, 33))]
MAX_TOKENS = [3, 24, 17, 12]
KW = dict(max_num_batched_tokens=64, max_num_seqs=8)
SPEC = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def aligned_ckpt(tmp_path_factory) -> str:
    from vllm.model_executor.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(
        str(tmp_path_factory.mktemp("aligned") / "tiny-mtp"), mtp_aligned=True
    )


def _greedy(ckpt, prompts=PROMPTS, max_tokens=MAX_TOKENS, **kw):
    m = LLM(ckpt, **KW, **kw)
    try:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        outs = m.generate([{"prompt_token_ids": p} for p in prompts], params)
        accepted = sum(
            s.spec_decoding.num_accepted_tokens for s in m.stats_history if s.spec_decoding
        )
        return [o.outputs[0].token_ids for o in outs], accepted
    finally:
        m.shutdown()


@pytest.fixture(scope="module")
def reference(aligned_ckpt):
    return _greedy(aligned_ckpt)[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "layout",
    [
        dict(tensor_parallel_size=2),
        dict(prefill_context_parallel_size=2, decode_context_parallel_size=2),
        dict(tensor_parallel_size=2, decode_context_parallel_size=2, dcp_comm_backend="a2a"),
        dict(data_parallel_size=2, enable_expert_parallel=True),
    ],
    ids=["tp2", "pcp2xdcp2", "dcp2-a2a", "dp2-ep2"],
)
def test_parallel_drafts_match_single_rank(aligned_ckpt, reference, layout):
    got, accepted = _greedy(aligned_ckpt, speculative_config=SPEC, **layout)
    assert got == reference
    assert accepted > 0


@pytest.mark.timeout(300)
def test_dp_ep_idle_replica_keeps_step(aligned_ckpt):
    """One request on two DP replicas: the idle one runs the drafting passes on padding so the
    EP collectives of the MTP layer's MoE stay matched."""
    ref = _greedy(aligned_ckpt, PROMPTS[2:3], [20])[0]
    got, _ = _greedy(
        aligned_ckpt,
        PROMPTS[2:3],
        [20],
        speculative_config=SPEC,
        data_parallel_size=2,
        enable_expert_parallel=True,
    )
    assert got == ref
