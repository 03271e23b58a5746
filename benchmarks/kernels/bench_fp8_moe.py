"""FP8 routed experts (``vllm/kernels/triton/moe_grouped_fp8.py``: e4m3 experts with 128x128 block
scales, activations per token-group of 128) against the bf16 path at GLM-5.3's expert shape
(H 6144, I 2048, top-8 of 256).

Shapes: prefill, 8K tokens with all 256 experts local (TP-only layout); decode, 64/128/256
tokens with the 32 local experts of one EP8 rank. The bf16 reference column is what
``fused_experts`` runs for bf16 experts at that size (the dense form for T <= 64, else the bf16
grouped kernel); every size is timed as CUDA-graph replays (GPU time), the CUTLASS path's eager time
beside it. Bytes: each chosen
expert's weights once plus the activations (``fused_experts_fp8_cost``); the roofline uses the
fp8 matmul peak and the copy bandwidth measured in this process. ``--sweep`` also times other row
tiles, warp counts and down-projection column tiles.
"""

from __future__ import annotations

from functools import partial

import torch

from benchmarks.kernels.common import dump_json, parser, print_rows, row, time_ms, time_ms_graph
from vllm import _custom_ops as ops
from vllm.kernels import moe_cutlass
from vllm.kernels.fp8_gemm import FP8_DTYPE
from vllm.kernels.moe import fused_experts, fused_experts_cost, fused_experts_fp8_cost
from vllm.kernels.triton import moe_grouped_fp8 as fp8
from vllm.kernels.triton.utils import resource_report
from vllm.model_executor.layers.linear import dequant_block_fp8

H, INTER, K, E_TOTAL = 6144, 2048, 8, 256
GRAPH_MAX_T = 256
SWEEP = [
    dict(block_m=16, num_warps=4, num_stages=4),
    dict(block_m=16, num_warps=4, num_stages=4, block_n=64),
    dict(block_m=32, num_warps=4, num_stages=4),
    dict(block_m=64, num_warps=4, num_stages=3),
    dict(block_m=64, num_warps=8, num_stages=3),
    dict(block_m=64, num_warps=8, num_stages=3, block_n=64),
    dict(block_m=64, num_warps=8, num_stages=4),
    dict(block_m=64, num_warps=4, num_stages=4),
    dict(block_m=64, num_warps=4, num_stages=2),  # 80 KB of stages: two programs per SM
    dict(block_m=128, num_warps=8, num_stages=3),
    dict(block_m=128, num_warps=8, num_stages=4),
    dict(block_m=128, num_warps=8, num_stages=2),
]


def _experts(e_loc: int, g: torch.Generator):
    """Random e4m3 experts with block scales (W entries ~ 1/sqrt(fan-in)) and their bf16
    dequantisation (the bf16 path's weights)."""
    gi, gh = INTER // 128, H // 128
    q13 = torch.empty(e_loc, 2 * INTER, H, dtype=FP8_DTYPE, device="cuda")
    q2 = torch.empty(e_loc, H, INTER, dtype=FP8_DTYPE, device="cuda")
    for e in range(e_loc):  # one expert at a time: the fp32 temporaries stay small
        q13[e] = (torch.randn(2 * INTER, H, device="cuda", generator=g) * 64).clamp(-448, 448)
        q2[e] = (torch.randn(H, INTER, device="cuda", generator=g) * 64).clamp(-448, 448)
    s13 = (torch.rand(e_loc, 2 * gi, gh, device="cuda", generator=g) + 0.5) / (64 * H**0.5)
    s2 = (torch.rand(e_loc, gh, gi, device="cuda", generator=g) + 0.5) / (64 * INTER**0.5)
    w13 = torch.empty(e_loc, 2 * INTER, H, dtype=torch.bfloat16, device="cuda")
    w2 = torch.empty(e_loc, H, INTER, dtype=torch.bfloat16, device="cuda")
    for e in range(e_loc):
        w13[e] = dequant_block_fp8(q13[e], s13[e], (128, 128), torch.bfloat16)
        w2[e] = dequant_block_fp8(q2[e], s2[e], (128, 128), torch.bfloat16)
    return q13, q2, s13, s2, w13, w2


def bench(t: int, e_loc: int, sweep: bool, experts) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(t)
    q13, q2, s13, s2, w13, w2 = experts
    x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.rand(t, E_TOTAL, device="cuda", generator=g).topk(K, dim=-1).indices
    w = torch.rand(t, K, device="cuda", generator=g)
    local = ids < e_loc  # offset 0: this rank owns experts [0, e_loc)
    hit, valid = int(torch.unique(ids[local]).numel()), int(local.sum())
    # prefill sizes: two calls a replay (the host's launches are not the GPU's time: an eager
    # prefill's host runs layers ahead of the GPU at these sizes); eager times in the CUTLASS note
    timer = time_ms_graph if t <= GRAPH_MAX_T else partial(time_ms_graph, launches=2)
    shape = f"T={t} E_loc={e_loc} hit={hit}"
    bf16_ms = timer(lambda: fused_experts(x, w13, w2, ids, w, 0))
    f16, b16 = fused_experts_cost(t, K, e_loc, H, INTER, valid, hit)
    rows = [row("moe_bf16_fused", shape, bf16_ms, f16, b16, "bf16", bf16_ms, f"{valid} pairs")]
    flops, nbytes = fused_experts_fp8_cost(t, K, e_loc, H, INTER, valid, hit)
    args = (x, q13, q2, ids, w, 0, s13, s2)
    table = fp8._config(t * K, e_loc, E_TOTAL)  # as the model calls it: E_TOTAL routed experts
    ms = timer(lambda: fp8.experts_grouped_fp8(*args, num_experts=E_TOTAL))
    res = f"{resource_report('moe_fp8_gate_up')} | {resource_report('moe_fp8_down')}"
    note = f"bf16 {bf16_ms:.3f} ms; block_m {table['block_m']} w{table['num_warps']}; {res}"
    rows.append(row("moe_fp8_grouped", shape, ms, flops, nbytes, "fp8", bf16_ms, note))
    # the same tiles with the other choice of K-loop masks (EVEN_MAX_BLOCK_M), in the same process
    even = table["block_m"] <= fp8.EVEN_MAX_BLOCK_M
    m_ms = timer(lambda: fp8.experts_grouped_fp8(*args, table | {"even": not even}))
    note = f"table/this {ms / m_ms:.3f}; {resource_report('moe_fp8_gate_up')}"
    op = "moe_fp8_masked" if even else "moe_fp8_unmasked"
    rows.append(row(op, shape, m_ms, flops, nbytes, "fp8", bf16_ms, note))
    rows += _cutlass_rows(t, e_loc, args, shape, timer, ms, bf16_ms, flops, nbytes)
    keys = ("block_m", "num_warps", "num_stages", "block_n")
    same = lambda c: all(c.get(k) == table.get(k) for k in keys)
    for cfg in SWEEP if sweep else []:
        if same(cfg):
            continue
        s_ms = timer(lambda cfg=cfg: fp8.experts_grouped_fp8(*args, cfg))
        note = f"table {ms:.3f} ms; {cfg}"
        rows.append(row("moe_fp8_sweep", shape, s_ms, flops, nbytes, "fp8", bf16_ms, note))
    return rows


def _cutlass_rows(t, e_loc, args, shape, timer, triton_ms, bf16_ms, flops, nbytes) -> list[dict]:
    """The CUTLASS grouped path (``vllm/kernels/moe_cutlass.py``) at prefill sizes: whole experts
    (with its largest difference from the Triton path's output), each GEMM and each glue kernel
    alone."""
    x, q13, q2, ids = args[:4]
    why = moe_cutlass.unavailable(x, q13, q2)
    if t < 1024 or why:
        return (
            [] if t < 1024 else [row("moe_fp8_cutlass", shape, float("nan"), 0, 0, "fp8", 0, why)]
        )
    want = fp8.experts_grouped_fp8(*args, num_experts=E_TOTAL).float()
    try:
        got = moe_cutlass.experts_cutlass_fp8(*args).float()
    except RuntimeError as e:  # a kernel that cannot run this shape: say so, keep the other rows
        return [row("moe_fp8_cutlass", shape, float("nan"), 0, 0, "fp8", 0, str(e)[:200])]
    err = ((got - want).abs().max() / want.abs().max()).item()
    c_ms = timer(lambda: moe_cutlass.experts_cutlass_fp8(*args))
    e_ms = time_ms(lambda: moe_cutlass.experts_cutlass_fp8(*args))
    note = f"triton/this {triton_ms / c_ms:.2f}; eager {e_ms:.3f} ms; max |diff| / max |triton| {err:.1e}"
    rows = [row("moe_fp8_cutlass", shape, c_ms, flops, nbytes, "fp8", bf16_ms, note)]
    # the two GEMMs alone, on the sorted rows of this batch
    _, _, offsets, _ = moe_cutlass.sort_pairs(ids, 0, e_loc)
    p = ids.numel()
    inter = q13.shape[1] // 2
    for name, w, s, n, k in (
        ("gemm1", q13, args[6], 2 * inter, H),
        ("gemm2", q2, args[7], H, inter),
    ):
        a = torch.randn(p, k, device="cuda").clamp(-4, 4).to(FP8_DTYPE)
        sa = torch.rand(k // 128 * p, device="cuda") + 0.5
        sw = s.transpose(1, 2).contiguous()
        out = torch.empty(p, n, dtype=torch.bfloat16, device="cuda")
        g_ms = timer(
            lambda a=a, sa=sa, w=w, sw=sw, out=out: ops.moe_grouped_fp8_gemm(
                a, sa, w, sw, offsets, out
            )
        )
        rows.append(row(f"moe_cutlass_{name}", f"P={p} N={n} K={k}", g_ms, 2.0 * p * n * k,
                        p * k + e_loc * n * k + 2 * p * n, "fp8", None, ""))  # fmt: skip
    return rows + _glue_rows(x, ids, args[4], e_loc, inter, timer)


def _glue_rows(x, ids, w, e_loc, inter, timer) -> list[dict]:
    """The path's bandwidth-bound kernels alone, each against the copy bandwidth on its bytes;
    x's quantisation into the sorted rows against the two launches it replaced (quantiser, then
    gather), timed in the same process."""
    from vllm.kernels.fp8_gemm import per_token_group_quant_fp8
    from vllm.kernels.triton import activation, moe_sorted

    t, h = x.shape
    k = ids.shape[1]
    order, pos, offsets, grp = moe_cutlass.sort_pairs(ids, 0, e_loc)
    n = offsets[e_loc:]
    p = ids.numel()
    shape = f"T={t} P={p} H={h}"
    ref_ms = timer(lambda: moe_cutlass.sort_pairs_ref(ids, 0, e_loc))
    sort_ms = timer(lambda: moe_cutlass.sort_pairs(ids, 0, e_loc))
    rows = [
        row("moe_glue_sort_pairs", shape, sort_ms, 0, 8 * p * 5, "fp8", ref_ms,
            f"counting sort, 3 launches; speedup over torch's sort + counts ({ref_ms:.3f} ms)"),
    ]  # fmt: skip
    # x read once, [P, H] e4m3 and its scales written
    q_bytes = 2 * t * h + p * h + 4 * p * h // 128
    two = lambda: moe_sorted.gather_quantised_rows(  # noqa: E731
        *per_token_group_quant_fp8(x), order // k, grp, offsets, n
    )
    two_ms = timer(two)
    one_ms = timer(lambda: moe_sorted.quantise_sorted_rows(x, pos, grp, offsets, n))
    rows += [
        row("moe_glue_quant_gather", shape, two_ms, 0, q_bytes + 2 * (t * h + 4 * t * h // 128),
            "fp8", None, "x quantised, then gathered (two launches)"),
        row("moe_glue_quant_sorted", shape, one_ms, 0, q_bytes, "fp8", two_ms,
            "x quantised into the sorted rows (one launch); speedup over the two"),
    ]  # fmt: skip
    gu = torch.randn(p, 2 * inter, device=x.device, dtype=x.dtype)
    s_ms = timer(
        lambda: activation.silu_and_mul_quant(
            gu, 128, store_h=False, n_rows=n, groups=(grp, offsets)
        )
    )
    s_bytes = 4 * p * inter + p * inter + 4 * p * inter // 128
    rows.append(row("moe_glue_silu_quant", f"P={p} I={inter}", s_ms, 0, s_bytes, "fp8", None,
                    "SiLU·up quantised, scales group-major"))  # fmt: skip
    d = torch.randn(p, h, device=x.device, dtype=x.dtype)
    c_ms = timer(lambda: moe_sorted.combine_sorted(d, pos, ids, w, 0, e_loc, x.dtype))
    rows.append(row("moe_glue_combine", shape, c_ms, 0, 2 * p * h + 2 * t * h, "fp8", None,
                    "pairs' rows weighted and summed per token"))  # fmt: skip
    return rows


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--out", dest="json", help="same as --json")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    decode = [64] if args.quick else [64, 128, 256]
    experts = _experts(32, g)
    rows += [r for t in decode for r in bench(t, 32, args.sweep, experts)]
    del experts
    torch.cuda.empty_cache()
    if not args.quick:  # 256 experts: 9.7 GB in e4m3 and 19.3 GB in bf16
        experts = _experts(256, g)
        for t in (2048, 8192):
            rows += bench(t, 256, args.sweep, experts)
    print_rows(rows)
    dump_json(rows, args.json)


if __name__ == "__main__":
    main()
