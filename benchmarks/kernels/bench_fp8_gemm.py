"""FP8 block-scaled linear (w8a8, 128x128 weight blocks, activations per token-group of 128) at
GLM-5.3's linears (``GLM_LINEARS`` of tests/kernels/test_fp8_gemm.py), M from decode to prefill.

Per shape: the Triton kernel (``vllm/kernels/triton/fp8_gemm.py``, quantisation included), cuBLAS's
block-scaled GEMM through ``torch._scaled_mm`` (sm_90; quantisation by the same Triton kernel) and
bf16 ``F.linear`` on the dequantised weight (the speed-up column's reference). M <= 256 is timed
as CUDA-graph replays (what decode runs; eager times there are the host's launch cost), larger M
eagerly. Roofline against the fp8 (bf16 for F.linear) matmul peak and the copy bandwidth measured
in this process. ``--sweep`` also times other Triton tiles per shape. The last table says, per M,
how cuBLAS compares with Triton over the shapes: it decides ``CUBLAS_MIN_M`` in
``vllm/kernels/fp8_gemm.py``.
"""

from __future__ import annotations

import math

import torch

from benchmarks.kernels.common import dump_json, parser, print_rows, row, time_ms, time_ms_graph
from tests.kernels.test_fp8_gemm import GLM_LINEARS, fp8_weight
from vllm.kernels import fp8_gemm
from vllm.kernels.fp8_gemm import fp8_block_linear_cost
from vllm.kernels.triton import fp8_gemm as tri
from vllm.kernels.triton.utils import resource_report
from vllm.model_executor.layers.linear import dequant_block_fp8

MS = [1, 16, 64, 256, 4096, 8192]
GRAPH_MAX_M = 256

# alternative tiles for --sweep: (block_m, block_n, num_warps, num_stages), split-K from the table
SWEEP_SMALL = [(16, 32, 4, 4), (16, 128, 4, 5), (32, 128, 4, 4), (64, 128, 4, 4)]
SWEEP_LARGE = [(64, 128, 4, 4), (128, 128, 8, 4), (128, 64, 4, 4), (64, 256, 8, 3)]


def _time(fn, m: int) -> float:
    return time_ms_graph(fn) if m <= GRAPH_MAX_M else time_ms(fn)


def _num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _tiles(c: dict) -> str:
    return (
        f"{c['block_m']}x{c['block_n']} w{c['num_warps']} s{c['num_stages']} split {c['split_k']}"
    )


def _sweep_cfgs(m: int, n: int, k: int) -> list[dict]:
    """The other tiles of the sweep list (split-K recomputed for each) and, for decode sizes, the
    table's tile without split-K."""
    base = tri.gemm_config(m, n, k, 128, _num_sms())
    cfgs = [
        tri.gemm_config(m, n, k, 128, _num_sms(), t)
        for t in (SWEEP_SMALL if m <= 64 else SWEEP_LARGE)
    ]
    if base["split_k"] > 1:
        cfgs.append(base | dict(split_k=1, k_blocks_per_split=math.ceil(k / 128)))
    return [c for c in cfgs if c != base]


def bench_m(name, wq, ws, w16, m: int, sweep: bool) -> list[dict]:
    n, k = wq.shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    shape = f"{name} M={m} N={n} K={k}"
    bf16_ms = _time(lambda: torch.nn.functional.linear(x, w16), m)
    flops, nbytes = fp8_block_linear_cost(m, n, k)
    cfg = tri.gemm_config(m, n, k, 128, _num_sms())
    t_ms = _time(lambda: tri.fp8_block_gemm(x, wq, ws), m)
    note = f"bf16 {bf16_ms:.4f} ms; {_tiles(cfg)}; {resource_report('fp8_gemm')}"
    rows = [row("fp8_gemm_triton", shape, t_ms, flops, nbytes, "fp8", bf16_ms, note)]
    if fp8_gemm.cublas_supports(x, wq, (128, 128)):
        try:
            c_ms = _time(lambda: fp8_gemm.fp8_block_linear_cublas(x, wq, ws), m)
            note = f"bf16 {bf16_ms:.4f} ms; triton/cublas {t_ms / c_ms:.2f}"
            rows.append(row("fp8_gemm_cublas", shape, c_ms, flops, nbytes, "fp8", bf16_ms, note))
        except RuntimeError as e:  # an unsupported layout or cuBLAS version: say which
            print(f"# cublas {shape}: {str(e).splitlines()[0][:160]}")
    nb16 = n * k * 2 + m * k * 2 + m * n * 2
    rows.append(row("bf16_linear", shape, bf16_ms, 2 * m * n * k, nb16, "bf16", bf16_ms))
    for c in _sweep_cfgs(m, n, k) if sweep else []:
        s_ms = _time(lambda c=c: tri.fp8_block_gemm(x, wq, ws, (128, 128), c), m)
        note = f"table {t_ms:.4f} ms; {_tiles(c)}; {resource_report('fp8_gemm')}"
        rows.append(row("fp8_gemm_sweep", shape, s_ms, flops, nbytes, "fp8", bf16_ms, note))
    return rows


def bench(name: str, n: int, k: int, ms: list[int], sweep: bool) -> list[dict]:
    wq, ws = fp8_weight(n, k, device="cuda")
    w16 = dequant_block_fp8(wq, ws, (128, 128), torch.bfloat16)
    return [r for m in ms for r in bench_m(name, wq, ws, w16, m, sweep)]


def decision(rows: list[dict]) -> None:
    """Per M: geometric mean over the shapes of triton_ms / cublas_ms (> 1: cuBLAS faster)."""
    by = {}
    for r in rows:
        if r["op"] in ("fp8_gemm_triton", "fp8_gemm_cublas"):
            by.setdefault(r["shape"], {})[r["op"]] = r["ms"]
    ratios = {}
    for shape, t in by.items():
        if len(t) == 2:
            m = int(shape.split("M=")[1].split()[0])
            ratios.setdefault(m, []).append(t["fp8_gemm_triton"] / t["fp8_gemm_cublas"])
    if not ratios:
        print("# no cuBLAS block-scaled rows (needs sm_90 and torch's block-scaled _scaled_mm)")
        return
    print("# triton_ms / cublas_ms per M (geomean over shapes; > 1 means cuBLAS is faster)")
    for m, rs in sorted(ratios.items()):
        gm = math.exp(sum(math.log(r) for r in rs) / len(rs))
        print(f"#   M={m:<6d} {gm:6.2f}   (min {min(rs):.2f}, max {max(rs):.2f}, {len(rs)} shapes)")


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--out", dest="json", help="same as --json")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="comma-separated M values")
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    shapes = GLM_LINEARS[:3] if args.quick else GLM_LINEARS
    rows = []
    for name, n, k in shapes:
        rows += bench(name, n, k, ms, args.sweep)
        torch.cuda.empty_cache()
    print_rows(rows)
    decision(rows)
    dump_json(rows, args.json)


if __name__ == "__main__":
    main()
