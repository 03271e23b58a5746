"""Quick diagnostics of the CUDA FP8 sparse-MLA kernel against the fp32 reference (GPU).

Prints, per case, ‖out − ref‖/‖ref‖ and max |lse − ref|: lse depends only on QK and the softmax,
out also on PV, so the pair says which half is off. Cases: random rows; one valid row per token
(out = that row's values: checks PV's operand layout alone); few heads; tokens cut between the
CTAs (``ctas``: the grid's size; the pieces are merged in the kernel)."""

from __future__ import annotations

import math
import sys

import torch

from vllm.attention.kv_cache import KVCacheLayout, read_mla_cache_ref, write_mla_cache_ref
from vllm.attention.ops.sparse_mla import sparse_mla_ref
from vllm.kernels.sparse_mla_cuda import compile_cubin, ptxas_resources, sparse_mla_fp8_cuda


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def case(name, t, h, k, nb=32, one_row=False, ctas=None, seed=0, row_exp=None, tile_exp=None):
    """row_exp / tile_exp (lo, hi): latent rows (or their 128-value tiles) scaled by 2^U[lo, hi)."""
    g = torch.Generator().manual_seed(seed)
    layout = KVCacheLayout("fp8_ds_mla", torch.bfloat16, 512, 64, 64)
    n = nb * 64
    cache = layout.allocate_mla(nb, "cpu")
    kv_c = torch.randn(n, 512, generator=g)
    if row_exp:
        kv_c *= torch.exp2(torch.randint(*row_exp, (n, 1), generator=g).float())
    if tile_exp:
        e = torch.randint(*tile_exp, (n, 4), generator=g).float()
        kv_c *= torch.exp2(e).repeat_interleave(128, dim=1)
    write_mla_cache_ref(cache, kv_c, torch.randn(n, 64, generator=g), torch.arange(n), layout)
    cache = cache.cuda()
    slots = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    if one_row:
        keep = slots[:, 5].clone()
        slots[:] = -1
        slots[:, 5] = keep
    slots = slots.cuda()
    q = torch.randn(t, h, 576, generator=g).to(torch.bfloat16).cuda()
    scale = 1 / math.sqrt(256)
    po, pl = sparse_mla_fp8_cuda(q, cache.view(-1, 656), slots, scale, torch.float32, ctas)
    torch.cuda.synchronize()
    o, lse = po[0], pl[0]
    ro, rl = sparse_mla_ref(q.float(), cache, slots, layout, scale)
    fin = rl.isfinite()
    dl = (lse[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
    extra = ""
    if one_row:
        want = read_mla_cache_ref(cache, slots[:, 5], layout)[:, None, :512]
        extra = f" exact={torch.equal(o, want.to(torch.bfloat16).float().expand_as(o))}"
    # lse: absolute 2e-2, or relative 2^-9 (bf16 operands) where the scores are large
    tol_l = max(2e-2, 2**-9 * rl[fin].abs().max().item()) if fin.any() else 2e-2
    ok = rel(o, ro) < 1e-2 and dl < tol_l and not o.isnan().any()
    print(f"{name:28s} rel(out)={rel(o, ro):.2e} max|dlse|={dl:.2e} nan={o.isnan().any().item()}"
          f"{extra} {'OK' if ok else 'FAIL'}", flush=True)  # fmt: skip
    return ok


def main():
    from vllm.kernels import sparse_mla_cuda

    results = []
    for spec in sys.argv[1:] or [""]:  # build variants: 'NAME=V,...' (the .cu's -D knobs)
        sparse_mla_cuda.DEFINES = sparse_mla_cuda.parse_defines(spec)
        flags = tuple(f"-D{k}={v}" for k, v in sorted(sparse_mla_cuda.DEFINES.items()))
        print(f"variant [{spec}]", ptxas_resources(compile_cubin(flags)[1]))
        results += run_cases()
    sys.exit(0 if all(results) else 1)


def run_cases():
    return [
        case("t1 h64 k64 one-row", 1, 64, 64, one_row=True),
        case("t1 h64 k64", 1, 64, 64),
        case("t3 h64 k2048", 3, 64, 2048),
        case("t5 h16 k700", 5, 16, 700),
        case("t9 h64 k2048 ctas=4", 9, 64, 2048, ctas=4),
        case("t9 h64 k2048 ctas=13", 9, 64, 2048, ctas=13),
        case("t2 h64 k2048 ctas=7", 2, 64, 2048, ctas=7),
        case("t64 h64 k2048", 64, 64, 2048),
        case("t300 h64 k2048", 300, 64, 2048),
        case("t3 h64 k700 ctas=5", 3, 64, 700, ctas=5),
        # scales that leave the f16 PV's range: the moving E and the exact fallback
        case("t4 h64 k2048 rows 2^-20..2^5", 4, 64, 2048, row_exp=(-20, 6), seed=1),
        case("t4 h64 k2048 rows 2^-3..2^3", 4, 64, 2048, row_exp=(-3, 4), seed=2),
        case("t4 h64 k2048 tiles 2^-16..2^0", 4, 64, 2048, tile_exp=(-16, 1), seed=3),
        case("t2 h64 k64 one-row tiles", 2, 64, 64, one_row=True, tile_exp=(-16, 1), seed=4),
    ]


if __name__ == "__main__":
    main()
