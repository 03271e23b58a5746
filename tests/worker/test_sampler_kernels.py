"""The sampler's kernels against their references (``vllm.kernels.sampling``): top-k / top-p
(``top_k_top_p_ref``, a stable sort) and Gumbel-max sampling (``gumbel_sample_ref``, the [B, V]
uniforms of ``uniform_noise``).

Top-k is exact. Top-p sums probabilities in another order than the reference's cumsum, so a token
whose mass-before is within fp32 rounding of top_p may go either way: every other token must
match bit for bit (``_check``: a differing token is allowed only when its mass-before, in fp64,
lies within 1e-5 of top_p). Gumbel sampling must give the very tokens of the torch formula.

CPU: the Triton interpreter at V of a few hundred to 2000, with small lists / bins to force the
refinement passes and the dense fallback (the kernel's ``stats`` say which path a row took).
GPU: V = 154,880, B = 256, mixed rows, and a CUDA-graph capture.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import interp  # noqa: F401  (fixture; sets TRITON_INTERPRET on CPU)
from vllm.kernels.sampling import gumbel_sample_ref, top_k_top_p_ref, uniform_noise

TOL = 1e-5  # mass-before this close to top_p: either outcome is right


def _check(x, k, p, got) -> int:
    """Asserts got matches the reference but for tokens at top-p's boundary: those whose
    mass-before (fp64) is within TOL of top_p, plus the reference's own fp32 error there (its
    cumsum on CPU is sequential: ~1e-4 off at V = 154,880); returns how many such tokens
    differ."""
    ref = top_k_top_p_ref(x, k, p)
    same = ((got == ref) | (got.isinf() & ref.isinf())).cpu()
    kept = ~got.isinf().cpu()
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert torch.equal(got.cpu()[kept].view(torch.int32), x.cpu()[kept].view(torch.int32))
    flips = 0
    v = x.shape[1]
    for r in (~same.all(1)).nonzero().flatten().tolist():
        kr = int(k[r]) if k is not None else 0
        pr = float(p[r]) if p is not None else 1.0
        xs, order = x[r].sort(descending=True, stable=True)
        if 0 < kr < v:
            xs[kr:] = float("-inf")
        before = {}
        for dt in (torch.float32, torch.float64):  # as the reference computes it, and exactly
            probs = torch.softmax(xs.to(dt), 0)
            before[dt] = (probs.cumsum(0) - probs).double().cpu()
        err = (before[torch.float32] - before[torch.float64]).abs()
        diff = ~same[r][order.cpu()]
        near = (before[torch.float64] - pr).abs() < TOL + err
        assert pr < 1 and bool((near | ~diff).all()), (
            f"row {r} (k={kr}, p={pr}): sorted positions {diff.nonzero().flatten()[:8].tolist()} "
            f"differ, mass before {before[torch.float64][diff][:4].tolist()}"
        )
        flips += int(diff.sum())
    return flips


def _logits(b, v, g, kind):
    x = torch.randn(b, v, generator=g)
    if kind == "flat":
        x *= 0.3
    elif kind == "peaked":  # a few dozen tokens well above the rest, as LLM logits
        x *= 2.0
        x[:, torch.randperm(v, generator=g)[:30]] += 8 + 3 * torch.rand(30, generator=g)
    elif kind == "ties":  # coarse values, +-0, -inf (bans, grammar)
        x = (x * 4).round() / 4
        x[x == 0] = torch.where(torch.rand(int((x == 0).sum()), generator=g) < 0.5, 0.0, -0.0)
        x[torch.rand(b, v, generator=g) < 0.2] = float("-inf")
    return x


MIXED_K = [0, 1, 5, 50, 0, 20, 0, 3]
MIXED_P = [0.9, 1.0, 0.95, 0.8, 0.5, 1.0, 0.99, 0.3]


# ---- CPU: Triton interpreter, tiny shapes ------------------------------------------------------
@pytest.mark.parametrize("kind", ["normal", "ties"])
def test_top_k_top_p_interpreter(interp, kind):  # noqa: F811
    """Mixed rows (top-k, top-p, both, neither) against the reference; V not a multiple of the
    block; blocks of 256 so that the first pass's window moves."""
    mod = interp("top_k_top_p")
    g = torch.Generator().manual_seed(len(kind))
    x = _logits(8, 700, g, kind)
    k, p = torch.tensor(MIXED_K), torch.tensor(MIXED_P)
    _check(x, k, p, mod.top_k_top_p(x, k, p, block=256, tile=256))


def test_top_k_top_p_interpreter_one_filter(interp):  # noqa: F811
    """Top-k alone and top-p alone (the other filter None), peaked rows."""
    mod = interp("top_k_top_p")
    x = _logits(4, 500, torch.Generator().manual_seed(9), "peaked")
    k, p = torch.tensor(MIXED_K[:4]), torch.tensor(MIXED_P[:4])
    _check(x, None, p, mod.top_k_top_p(x, None, p, block=512, tile=512))
    _check(x, k, None, mod.top_k_top_p(x, k, None, block=512, tile=512))


def test_top_k_top_p_interpreter_refine_and_dense(interp):  # noqa: F811
    """A list of 48 entries: flat rows need refinement passes (top-k's bracket, top-p's with and
    without top-k), and rows whose cut stays among too many tokens (mass ties; top-p's cut
    inside top-k's bracket) take the dense path; all exact."""
    mod = interp("top_k_top_p")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(7, 600, generator=g)
    x[4] = (x[4] * 2).round() / 2  # a few values, hundreds of tokens each
    x[6] *= 0.05
    k = torch.tensor([0, 0, 200, 0, 0, 400, 550])
    p = torch.tensor([0.9, 0.5, 1.0, 0.99, 0.7, 0.8, 0.95])
    stats = torch.zeros(7, 3, dtype=torch.int32)
    _check(x, k, p, mod.top_k_top_p(x, k, p, cap=48, block=512, tile=1024, stats=stats))
    refined = [0, 1, 2, 3, 5]
    assert stats[refined, 0].min() >= 1 and stats[refined, 2].max() == 0, stats
    assert stats[4, 2] == 1 and stats[6, 2] == 1, stats  # dense


def test_top_k_top_p_interpreter_corner_rows(interp):  # noqa: F811
    """A row of -inf; one finite token; ties at the maximum (top-k 1 and top-p keep the lowest
    index); top_p <= 0 (the best token only); top-k beyond the finite tokens; -0.0 / +0.0;
    logits beyond 2^21 (dense); top_p 1 and top_k 0 rows untouched."""
    mod = interp("top_k_top_p")
    v = 300
    x = torch.randn(10, v, generator=torch.Generator().manual_seed(3))
    x[0] = float("-inf")
    x[1] = float("-inf")
    x[1, 123] = -5.0
    x[2, [7, 40, 299]] = 9.0
    x[3, [7, 40]] = 9.0
    x[5, 10:] = float("-inf")
    x[6, ::2] = 0.0
    x[6, 1::2] = -0.0
    x[7] *= 1e7
    k = torch.tensor([5, 3, 1, 0, 0, 50, 7, 20, 0, 0])
    p = torch.tensor([0.9, 0.5, 1.0, 0.3, -1.0, 0.9, 0.6, 0.9, 1.0, 1.0])
    got = mod.top_k_top_p(x, k, p, block=128, tile=512)
    _check(x, k, p, got)
    assert torch.isinf(got[0]).all() and got[1, 123] == -5.0
    assert torch.isfinite(got[2]).nonzero().flatten().tolist() == [7]
    assert torch.isfinite(got[3]).nonzero().flatten().tolist() == [7]
    assert torch.isfinite(got[4]).sum() == 1
    assert torch.equal(got[8:], x[8:])


def test_top_k_top_p_interpreter_boundary_ties(interp):  # noqa: F811
    """Adversarial: many tokens tied exactly at top-p's boundary. Only tokens whose mass-before
    is within fp32 rounding of top_p may differ from the reference's cumsum, and few do."""
    mod = interp("top_k_top_p")
    b, v = 8, 400
    x = torch.zeros(b, v)
    x[:, :4] = torch.tensor([3.0, 2.0, 2.0, 1.0])
    # top_p exactly at a multiple of the tied tokens' probability above the best ones
    probs = torch.softmax(x[0].double(), 0)
    q = float(probs[-1])
    p = torch.tensor([float(probs[:4].sum()) + q * j for j in (1, 7, 50, 123, 200, 301, 333, 350)])
    flips = _check(x, None, p.float(), mod.top_k_top_p(x, None, p.float(), block=512, tile=512))
    assert flips <= b  # at most the one boundary token per row


def test_top_k_top_p_dispatch_cpu_is_the_reference():
    from vllm.kernels.sampling import top_k_top_p

    x = torch.randn(3, 50)
    k, p = torch.tensor([0, 4, 0]), torch.tensor([1.0, 0.9, 0.6])
    assert torch.equal(top_k_top_p(x, k, p), top_k_top_p_ref(x, k, p))
    assert torch.equal(top_k_top_p(x, None, None), x)


def test_top_k_top_p_ref_ties_by_index_and_top_p_one_untouched():
    x = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0], [0.5, 0.5, 0.5, 0.5, 0.5]])
    out = top_k_top_p_ref(x, torch.tensor([2, 0]), torch.tensor([1.0, 0.5]))
    assert torch.isfinite(out[0]).tolist() == [False, True, True, False, False]
    assert torch.isfinite(out[1]).tolist() == [True, True, True, False, False]
    x = torch.randn(4, 3000) * 5  # fp32 cumsum reaches 1.0 before the end: top_p 1 drops none
    assert torch.equal(top_k_top_p_ref(x, None, torch.ones(4)), x)


def test_gumbel_uniforms_bit_identical(interp):  # noqa: F811
    """The kernel's uniform for (seed, position, token) is uniform_noise's, bit for bit
    (negative and 64-bit seeds, positions past 2^32, the clamp below 1)."""
    seeds = torch.tensor([0, 11, -1, 2**62 + 12345, -(2**40) - 7, 7919])
    pos = torch.tensor([0, 45, 3, 2**33 + 5, 17, 1])
    v = 1500
    out = interp("gumbel").uniforms(seeds, pos, v)
    ref = uniform_noise(seeds, pos, v)
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))
    assert out[1].max() < 1.0  # seed 11 at position 45 hits the clamp (test_sampler.py)


def test_gumbel_sample_interpreter(interp):  # noqa: F811
    """The sampled tokens of the torch formula: temperature 0 rows (argmax), rows of -inf and
    rows filtered to a few tokens, a V not a multiple of the chunk, several chunks per row."""
    mod = interp("gumbel")
    g = torch.Generator().manual_seed(5)
    b, v = 12, 2500
    x = torch.randn(b, v, generator=g) * 3
    x[2] = float("-inf")
    x[3, :] = float("-inf")
    x[3, [5, 2400]] = 0.0
    x[4, torch.rand(v, generator=g) < 0.95] = float("-inf")
    temp = torch.rand(b, generator=g) + 0.1
    temp[[0, 6]] = 0.0
    seeds = torch.randint(-(2**62), 2**62, (b,), generator=g)
    pos = torch.randint(0, 2**40, (b,), generator=g)
    got = mod.gumbel_sample(x, temp, seeds, pos, chunk=1024, block=256)
    assert torch.equal(got, gumbel_sample_ref(x, temp, seeds, pos))


# ---- GPU: the model's vocabulary, a decode batch -----------------------------------------------
V_GLM = 154880


def _gpu_batch(b, kind, seed):
    g = torch.Generator().manual_seed(seed)
    x = _logits(b, V_GLM, g, kind)
    k = torch.tensor(MIXED_K * (b // len(MIXED_K)))
    p = torch.tensor(MIXED_P * (b // len(MIXED_P)))
    return x.cuda(), k.cuda(), p.cuda()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["normal", "flat", "peaked", "ties"])
def test_top_k_top_p_gpu(kind):
    """B = 256, V = 154,880: mixed rows, top-p 0.95 with and without top-k 50 among them."""
    from vllm.kernels.sampling import top_k_top_p
    from vllm.kernels.triton import top_k_top_p as mod

    x, k, p = _gpu_batch(256, kind, seed=len(kind))
    k[::5], p[::5] = 50, 0.95
    stats = torch.zeros(256, 3, dtype=torch.int32, device="cuda")
    got = mod.top_k_top_p(x, k, p, stats=stats)
    _check(x, k, p, got)
    assert torch.equal(top_k_top_p(x, k, p), got)  # the op dispatches to the kernel
    _check(x, None, p, mod.top_k_top_p(x, None, p))
    _check(x, k, None, mod.top_k_top_p(x, k, None))
    if kind != "ties":  # the fast path: listed rows, not the dense fallback
        assert stats[:, 2].sum() == 0, stats[stats[:, 2] == 1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gumbel_sample_gpu():
    from vllm.kernels.sampling import gumbel_sample, top_k_top_p

    x, k, p = _gpu_batch(256, "peaked", seed=1)
    temp = torch.rand(256, device="cuda") + 0.5
    temp[::7] = 0
    seeds = torch.randint(-(2**62), 2**62, (256,), device="cuda")
    pos = torch.randint(0, 2**20, (256,), device="cuda")
    for logits in (x, top_k_top_p(x, k, p)):
        assert torch.equal(
            gumbel_sample(logits, temp, seeds, pos), gumbel_sample_ref(logits, temp, seeds, pos)
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampling_kernels_cuda_graph():
    """Both ops captured in a CUDA graph (no host sync, no data-dependent shape), replayed on new
    inputs, give the eager results."""
    from vllm.kernels.sampling import gumbel_sample, top_k_top_p

    x, k, p = _gpu_batch(64, "normal", seed=2)
    temp = torch.ones(64, device="cuda")
    seeds = torch.arange(64, device="cuda")
    pos = torch.zeros(64, dtype=torch.int64, device="cuda")
    top_k_top_p(x, k, p), gumbel_sample(x, temp, seeds, pos)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gumbel_sample(top_k_top_p(x, k, p), temp, seeds, pos)
    x2, k2, p2 = _gpu_batch(64, "peaked", seed=3)
    x.copy_(x2), k.copy_(k2), p.copy_(p2), pos.add_(17)
    graph.replay()
    assert torch.equal(out, gumbel_sample(top_k_top_p(x, k, p), temp, seeds, pos))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sample_on_cuda_matches_cpu_with_filters():
    """The sampler end to end: top-k / top-p / min-p rows on CUDA (kernels) and on CPU
    (references) draw the same tokens (rows clear of top-p's rounding boundary)."""
    from vllm.worker.gpu.sampler import SamplingBatch, sample

    g = torch.Generator().manual_seed(4)
    b, v = 64, 20000
    x = _logits(b, v, g, "peaked")
    kw = dict(
        temperature=torch.rand(b, generator=g) + 0.3,
        top_k=torch.tensor(MIXED_K * 8),
        top_p=torch.tensor(MIXED_P * 8),
        min_p=torch.zeros(b),
        seeds=torch.arange(b, dtype=torch.int64) * 31,
        positions=torch.arange(b, dtype=torch.int64) + 9,
    )
    flags = dict(all_greedy=False, any_top_k=True, any_top_p=True, any_min_p=False,
                 max_logprobs=-1)  # fmt: skip
    cpu, _ = sample(x, SamplingBatch(**kw, **flags))
    gpu, _ = sample(x.cuda(), SamplingBatch(**{a: t.cuda() for a, t in kw.items()}, **flags))
    assert torch.equal(gpu.cpu(), cpu)


# ---- CPU: the kernels built for sm_90a (ptxas), in a child process ------------------------------
_BUILD = """
import json
from tools.aot_sm90 import ptxas
from tools.aot_triton_sm90 import compile_kernel
from vllm.kernels.triton import gumbel, top_k_top_p as tkp

types = dict(x_ptr="*fp32", out_ptr="*fp32", k_ptr="*i64", p_ptr="*fp32", hist_ptr="*i32",
             list_ptr="*i64", stats_ptr="*i32", V="i32", stride_x="i32", stride_o="i32")
div16 = [n for n, t in types.items() if t.startswith("*")] + ["V", "stride_x", "stride_o"]
out = {}
for has in [(1, 1, 0), (0, 1, 0), (1, 0, 0), (1, 1, 1)]:
    meta = tkp.launch_config() | dict(zip(("HAS_K", "HAS_P", "HAS_STATS"), map(bool, has)))
    rep = ptxas(compile_kernel(tkp._top_k_top_p_kernel, types, meta, div16), sass=False)
    out[str(has)] = [rep["registers"], rep["spill_stores"]]
gt = dict(x_ptr="*fp32", temp_ptr="*fp32", seed_ptr="*i64", pos_ptr="*i64", best_ptr="*i64",
          V="i32", stride_x="i32")
meta = dict(CHUNK=8192, BLOCK=1024, USE_LIBDEVICE=True, num_warps=4)
rep = ptxas(compile_kernel(gumbel._gumbel_argmax_kernel, gt, meta), sass=False)
out["gumbel"] = [rep["registers"], rep["spill_stores"]]
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the GPU tests compile the kernels")
def test_sampling_kernels_build_for_sm90():
    """The interpreter does not type-check kernels as the compiler does: build both for sm_90a
    (every top-k / top-p variant the op launches) and hold the launch to two programs per SM
    (<= 128 registers with 8 warps)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    r = subprocess.run([sys.executable, "-c", _BUILD], capture_output=True, text=True, env=env,
                       cwd=root, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    reps = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(regs <= 128 for regs, _ in reps.values()), reps
