"""Top-k selection: the same set as topk_ref in every row (ties to the lowest positions, the
same −1 count, padding last; the order within a row is unspecified), including ties, −0.0, −inf
scores, limits shorter than k, limit 0, rows longer than one chunk, and every path of the kernel
(sampled pivot, whole row as candidates, the whole-row fallback when the pivot misses)."""

from __future__ import annotations

import pytest
import torch

from vllm.kernels.indexer import topk_ref


def _logits(t, s, g, ties=True, dist="normal"):
    """Scores: normal, or a distribution that is hard for the interpolation probes of the k-th
    search (heavy tails, a narrow cluster, a point mass with a few outliers, a log-uniform
    spread over many binades)."""
    if dist == "cauchy":
        x = torch.distributions.Cauchy(0.0, 1.0).sample((t, s))
    elif dist == "narrow":
        x = 1.0 + torch.rand(t, s, generator=g) * 1e-6
    elif dist == "point":
        x = torch.full((t, s), 0.5)
        x[torch.rand(t, s, generator=g) < 0.05] = 3.0
        x.view(-1)[torch.randperm(t * s, generator=g)[: t * 3]] = 1e30
    elif dist == "logspread":
        x = torch.exp(torch.rand(t, s, generator=g) * 160 - 80)
    elif dist == "runs":  # runs of 8 adjacent scores nearly equal: the pivot's samples correlate
        x = torch.randn(t, -(-s // 8), generator=g).repeat_interleave(8, dim=1)[:, :s]
        x = x + 1e-3 * torch.randn(t, s, generator=g)
    else:
        x = torch.randn(t, s, generator=g)
    if ties:  # coarse values: many exact ties, zeros of both signs, a few −inf
        x = (x * 4).round() / 4
        x[x == 0] = torch.where(torch.rand(int((x == 0).sum()), generator=g) < 0.5, 0.0, -0.0)
        x[torch.rand(t, s, generator=g) < 0.01] = float("-inf")
    return x


def _as_set(idx: torch.Tensor) -> torch.Tensor:
    """Each row's positions in ascending order, −1 padding last."""
    big = torch.iinfo(torch.int32).max
    srt = torch.where(idx < 0, big, idx).sort(dim=1).values
    return torch.where(srt == big, -1, srt)


def _check(mod, t, s, topk, device, seed, ties=True, limits=None, dist="normal", **kw):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the Cauchy sampler draws from the global generator
    logits = _logits(t, s, g, ties, dist)
    if limits is None:
        limits = torch.randint(0, s + 3, (t,), generator=g)
        limits[0] = s
        if t > 1:
            limits[1] = 0
    logits, limits = logits.to(device), limits.to(device)
    got = mod.indexer_topk(logits, limits, topk, **kw)
    ref = topk_ref(logits, limits, topk)
    assert got.dtype == torch.int32 and got.shape == (t, topk)
    n = limits.cpu().clamp(0, min(s, topk))
    assert torch.equal(got.cpu() >= 0, torch.arange(topk) < n[:, None])  # winners, then −1
    assert torch.equal(_as_set(got.cpu()), _as_set(ref.cpu()))


# ---- CPU: Triton interpreter, tiny shapes ----------------------------------------------------
# z=2: the sampled pivot usually lands in [k, cap] candidates (and a few rows miss); z=-9: the
# pivot is the sample's maximum, too few candidates, every long row falls back; z=99: the sample's
# minimum, too many; cap=512: every row fits in its candidate list (no sample); rows2: two rows
# per collect program (the second prefetched), a row count not a multiple of it; regs1: the
# select holds 32 keys in registers and reads the others again; noprefetch: each row's chunk is
# loaded in its own iteration
@pytest.mark.parametrize(
    "kw",
    [
        dict(z=2.0),
        dict(z=-9.0),
        dict(z=99.0),
        dict(cap=512),
        dict(z=2.0, rows_per_program=2),
        dict(cap=512, select_regs=1),
        dict(z=2.0, rows_per_program=2, prefetch=False),
        dict(z=2.0, sample_run=1),
        dict(z=2.0, sample_run=4),
    ],
    ids=["z2", "few", "many", "all", "rows2", "regs1", "rows2-noprefetch", "run1", "run4"],
)
@pytest.mark.parametrize("t,s,topk,chunk", [(5, 300, 16, 64), (3, 40, 8, 32), (4, 129, 7, 64)])
def test_topk_interpreter(interp, t, s, topk, chunk, kw):
    kw = dict(cap=4 * topk if topk > 7 else 32, sample_stride=4) | kw
    _check(interp("topk"), t, s, topk, "cpu", seed=s, chunk=chunk, num_warps=1, select_warps=1,
           block=32, **kw)  # fmt: skip


def test_topk_interpreter_distinct_scores(interp):
    _check(interp("topk"), 3, 200, 16, "cpu", seed=9, ties=False, chunk=64, num_warps=1,
           select_warps=1, sample_stride=4, cap=64, z=2.0, block=64, rows_per_program=3)  # fmt: skip


def test_topk_interpreter_select_tiles(interp):
    """Whole rows as candidates (cap >= S) with k = 100: the select's bisection and output scan
    run over several tiles re-read from memory beyond its 32 register-held keys."""
    _check(interp("topk"), 3, 500, 100, "cpu", seed=5, chunk=128, num_warps=1, select_warps=1,
           cap=512, select_regs=1)  # fmt: skip


@pytest.mark.parametrize("dist", ["cauchy", "narrow", "point", "logspread", "runs"])
def test_topk_interpreter_score_distributions(interp, dist):
    """The k-th search (interpolation probes with bisection steps) on skewed score
    distributions, in the pivot sample and in the candidate list."""
    _check(interp("topk"), 4, 600, 24, "cpu", seed=11, ties=False, dist=dist, chunk=128,
           num_warps=1, select_warps=1, sample_stride=4, cap=128, z=3.0, block=64)  # fmt: skip


def test_topk_interpreter_k_above_columns(interp):
    _check(interp("topk"), 3, 40, 64, "cpu", seed=4, chunk=32, num_warps=1, select_warps=1)


# ---- GPU ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize(
    "t,s,topk", [(7, 1000, 2048), (64, 131072, 2048), (300, 5000, 2048), (16, 70000, 100)]
)
@pytest.mark.parametrize("ties", [True, False])
@pytest.mark.parametrize("z", [6.0, -9.0])  # -9: every long row takes the whole-row fallback
def test_topk_gpu(t, s, topk, ties, z):
    from vllm.kernels.triton import topk as mod

    _check(mod, t, s, topk, "cuda", seed=t + s, ties=ties, z=z)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kw",
    [
        dict(chunk=1024, num_warps=4),
        dict(chunk=4096, num_warps=16),
        dict(rows_per_program=1),
        dict(rows_per_program=16),
        dict(select_warps=2),
        dict(select_warps=8),
        dict(select_regs=1),  # 128 keys in registers, the rest re-read
        dict(sample_stride=128, cap=16384),
        dict(prefetch=False),
        dict(prefetch=False, collect_maxnreg=64),
        dict(collect_maxnreg=80),
        dict(sample_run=1),  # one score per sampled sector, as before the runs
        dict(sample_run=4),
        dict(sample_run=8, sample_stride=64),
    ],
)
def test_topk_gpu_configs(kw):
    from vllm.kernels.triton import topk as mod

    _check(mod, 300, 40000, 2048, "cuda", seed=3, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dist", ["cauchy", "narrow", "point", "logspread", "runs"])
def test_topk_gpu_score_distributions(dist):
    from vllm.kernels.triton import topk as mod

    _check(mod, 64, 50000, 2048, "cuda", seed=5, ties=False, dist=dist)


@pytest.mark.gpu
@pytest.mark.parametrize("s", [32768, 131072])
def test_topk_gpu_causal_chunk(s):
    from vllm.kernels.triton import topk as mod

    t = 1024  # the last rows of an 8192-token prefill chunk, causal limits
    _check(mod, t, s, 2048, "cuda", seed=s, ties=False, limits=torch.arange(s - t + 1, s + 1))


@pytest.mark.gpu
@pytest.mark.parametrize("s", [32768, 65536])
@pytest.mark.parametrize("widen", [True, False])
def test_topk_gpu_correlated_runs_keep_the_fast_path(s, widen, monkeypatch):
    """Scores nearly equal in runs of 8 (the pivot samples runs of 8 adjacent scores): the runs'
    counts vary ~8x more than independent samples' would. The margin widened by that design
    effect keeps every row on the fast path (>= k candidates; the cap is raised so the upper
    tail, ~3.7 standard deviations under the default cap, cannot flake); with the widening
    switched off (the control), the binomial margin is z ≈ 1.8 of the real spread and ~4 % of
    the rows get fewer than k candidates (the whole-row fallback). Exact either way."""
    from vllm.kernels.triton import topk as mod

    if not widen:
        monkeypatch.setattr(mod, "DEFF_REDO", 1e30)
    g = torch.Generator().manual_seed(s)
    t = 1024
    logits = _logits(t, s, g, ties=False, dist="runs").cuda()
    limit = torch.full((t,), s, device="cuda")
    out, stages, count = mod.topk_stages(logits, limit, 2048, cap=16384)
    for launch in stages:
        launch()
    short = int((count < 2048).sum())
    assert int((count > 16384).sum()) == 0
    if widen:
        assert short == 0
    else:
        assert short >= 5  # ~40 expected
    assert torch.equal(_as_set(out.cpu()), _as_set(topk_ref(logits, limit, 2048).cpu()))


@pytest.mark.gpu
def test_topk_gpu_one_million():
    from vllm.kernels.triton import topk as mod

    _check(mod, 2, 1 << 20, 2048, "cuda", seed=1, ties=False,
           limits=torch.tensor([1 << 20, 777_777]))  # fmt: skip


@pytest.mark.parametrize(
    "kw,msg",
    [(dict(sample_run=3), "sample_run must be a power of two"),
     (dict(sample_run=0), "sample_run must be a power of two"),
     (dict(cap=3000), "cap 3000 must be a power of two"),
     (dict(cap=1024), "cap 1024 must be a power of two >= topk")],
)  # fmt: skip
def test_topk_launch_config_rejects_bad_tuning(kw, msg):
    from vllm.kernels.triton.topk import topk_launch_config

    with pytest.raises(ValueError, match=msg):
        topk_launch_config(8, 40000, 2048, **kw)


def test_topk_launch_config_defaults():
    """The defaults the benchmarks measured: runs of 8, one score in 32, 2 pivot warps for a
    1024-score sample (32K columns), the sample capped at 16K scores for 1M columns."""
    from vllm.kernels.triton.topk import MAX_SAMPLE, topk_launch_config

    cfg = topk_launch_config(8192, 32768, 2048)
    assert (cfg["pivot"]["RUN"], cfg["pivot"]["SAMPLE_STRIDE"]) == (8, 32)
    assert (cfg["pivot"]["SAMPLE_PAD"], cfg["pivot"]["num_warps"]) == (1024, 2)
    assert cfg["cap"] == 8192 and cfg["collect"]["maxnreg"] == 64
    big = topk_launch_config(64, 1 << 20, 2048)
    assert big["pivot"]["SAMPLE_PAD"] == MAX_SAMPLE and big["pivot"]["num_warps"] == 16
    old = topk_launch_config(8192, 131072, 2048, sample_run=1)
    assert (old["pivot"]["SAMPLE_STRIDE"], old["pivot"]["num_warps"]) == (64, 4)
