"""FP8 block-scaled linear (w8a8, 128x128 weight blocks, activations per token-group of 128) at
GLM-5.3's linears (``GLM_LINEARS`` of tests/kernels/test_fp8_gemm.py, with the fused q_a+kv_a), M
from decode to prefill.

Per shape: the Triton kernel as served (``vllm/kernels/triton/fp8_gemm.py``, quantisation included),
cuBLAS's block-scaled GEMM through ``torch._scaled_mm`` (sm_90; quantisation by the same Triton
kernel) and bf16 ``F.linear`` on the dequantised weight (the speed-up column's reference). At decode
sizes (M <= 64) also the Triton path before issue 35 (quantisation pass, GEMM, torch sum of the
split-K partials: ``fp8_gemm_triton_old``) and the served config with the other quantisation choice
(``..._fused`` / ``..._sep``: checks ``FUSED_QUANT_MAX_M``), and the GEMM alone on x quantised
beforehand (``fp8_gemm_prequant``: a fused producer's share), and both on a weight rotated over
copies that exceed the L2 twice (``..._cold``: as a model's layers read their weights; one weight of
a few MB replayed can be served from L2) beside a copy of the same bytes, launched the same way
(``copy_same_bytes_cold``: what one launch of that size reaches), and cuBLAS on the same rotation
(``fp8_gemm_cublas_cold``); their bytes are what any path must
move (weight and scales, x, y), the same for all, so ``roof`` is the share of the copy bandwidth and
compares their times; from M = 256 the cost model's bytes include the quantisation pass. M <= 256 is
timed as CUDA-graph replays (what decode runs; eager times there are the host's launch cost), larger
M eagerly. Peaks (copy bandwidth, bf16 and fp8 matmul) measured in this process. ``--sweep`` also
times other Triton tiles per shape (at decode sizes cold, on x quantised beforehand) and prints the
best per shape and M. The last table says, per M,
how cuBLAS compares with Triton over the shapes: it decides ``TRITON_MAX_M`` in
``vllm/kernels/fp8_gemm.py``.
"""

from __future__ import annotations

import math

import torch
import triton

from benchmarks.kernels.common import dump_json, parser, print_rows, row, time_ms, time_ms_graph
from tests.kernels.test_fp8_gemm import GLM_LINEARS, fp8_weight
from vllm.kernels import fp8_gemm
from vllm.kernels.fp8_gemm import fp8_block_linear_cost
from vllm.kernels.triton import fp8_gemm as tri
from vllm.kernels.triton.utils import resource_report
from vllm.model_executor.layers.linear import dequant_block_fp8

MS = [1, 16, 32, 64, 256, 4096, 8192]
DECODE_MAX_M = 64  # rows up to which the old and new decode paths are both timed
GRAPH_MAX_M = 256

# alternative tiles for --sweep, (block_m, block_n, num_warps, num_stages) with split-K from the
# table; decode sizes keep the table's block_m (one row tile: the weight is read once)
SWEEP_DECODE = [
    (bn, w, s) for bn in (32, 64, 128, 256) for w, s in ((4, 3), (4, 4), (4, 6), (8, 4))
]
SWEEP_LARGE = [(64, 128, 4, 4), (128, 128, 8, 4), (128, 64, 4, 4), (64, 256, 8, 3)]


def _time(fn, m: int) -> float:
    return time_ms_graph(fn) if m <= GRAPH_MAX_M else time_ms(fn)


def _num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _tiles(c: dict) -> str:
    split = f"split {c['split_k']}"
    if c["split_k"] > 1:
        split += " (kernel)" if c["reduce_in_kernel"] else " (torch)"
    quant = "fused" if c["fuse_quant"] else "sep"
    return (
        f"{c['block_m']}x{c['block_n']} w{c['num_warps']} s{c['num_stages']} {split} quant {quant}"
    )


def _with_split(c: dict, k: int, split: int) -> dict:
    nkb = math.ceil(k / 128)
    per = math.ceil(nkb / max(1, min(split, nkb)))
    return c | dict(split_k=math.ceil(nkb / per), k_blocks_per_split=per)


def _sweep_cfgs(m: int, n: int, k: int) -> list[dict]:
    """The other tiles of the sweep list (split-K recomputed for each); at decode sizes also the
    table's tile unsplit and with twice its split."""
    base = tri.gemm_config(m, n, k, 128, _num_sms())
    if m <= DECODE_MAX_M:
        tiles = [(base["block_m"], *t) for t in SWEEP_DECODE]
    else:
        tiles = SWEEP_LARGE
    cfgs = [tri.gemm_config(m, n, k, 128, _num_sms(), t) for t in tiles]
    if m <= DECODE_MAX_M:
        cfgs += [_with_split(base, k, 1), _with_split(base, k, 2 * base["split_k"])]
    uniq = []
    for c in cfgs:
        if c != base and c not in uniq:
            uniq.append(c)
    return uniq


def _flip_op(cfg: dict) -> str:
    return "fp8_gemm_triton_fused" if cfg["fuse_quant"] else "fp8_gemm_triton_sep"


def _decode_rows(x, wq, ws, m, shape, t_ms, bf16_ms) -> list[dict]:
    """The path before issue 35 and the served config with the other quantisation choice."""
    n, k = wq.shape
    flops, nbytes = fp8_block_linear_cost(m, n, k, quant_pass=False)
    cfg = tri.gemm_config(m, n, k, 128, _num_sms())
    old = cfg | dict(fuse_quant=False, reduce_in_kernel=False)
    flip = cfg | dict(fuse_quant=not cfg["fuse_quant"])
    rows = []
    for op, c in (("fp8_gemm_triton_old", old), (_flip_op(flip), flip)):
        ms = _time(lambda c=c: tri.fp8_block_gemm(x, wq, ws, (128, 128), c), m)
        note = f"served/this {t_ms / ms:.2f}; {_tiles(c)}; {resource_report('fp8_gemm')}"
        rows.append(row(op, shape, ms, flops, nbytes, "fp8", bf16_ms, note) | dict(cfg=_tiles(c)))
    return rows


def _rotation(wq, ws) -> tuple[list, int]:
    """Copies of the weight (and scales) together over twice the L2, and the launches per
    captured graph (at least one per copy)."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    copies = max(2, math.ceil(2 * l2 / (wq.numel() + ws.numel() * 4)))
    return [(wq, ws)] + [(wq.clone(), ws.clone()) for _ in range(copies - 1)], max(20, copies)


def _time_cold(fn, ws_all, launches) -> float:
    """``fn(w, s)`` timed with each captured call on the next copy of the weight."""
    turn = iter(range(1 << 30))
    return time_ms_graph(lambda: fn(*ws_all[next(turn) % len(ws_all)]), launches=launches)


def _cold_rows(x, ws_all, launches, xq, shape, t_ms, flops, nbytes, bf16_ms) -> list[dict]:
    """Decode sizes with the weight cold: each captured call on another copy of it, the copies
    together over twice the L2 (a model's layers each read their own weight; replaying one
    weight of a few MB can serve it from L2 and read high). Served path, GEMM alone, and a copy
    moving the same bytes."""
    wq = ws_all[0][0]
    copies = len(ws_all)
    rows = []
    for op, xquant in (("fp8_gemm_cold", None), ("fp8_gemm_prequant_cold", xq)):
        ms = _time_cold(lambda w, s, xquant=xquant: tri.fp8_block_gemm(x, w, s, x_quant=xquant),
                        ws_all, launches)  # fmt: skip
        note = f"served/this {t_ms / ms:.2f}; weight rotated over {copies} copies (> 2x L2)"
        rows.append(row(op, shape, ms, flops, nbytes, "fp8", bf16_ms, note))
    if fp8_gemm.cublas_supports(x, wq, (128, 128)):
        # cuBLAS on the same rotation (it quantises x itself: the served path above TRITON_MAX_M rows)
        try:
            ms = _time_cold(lambda w, s: fp8_gemm.fp8_block_linear_cublas(x, w, s), ws_all,
                            launches)  # fmt: skip
            note = f"served/this {t_ms / ms:.2f}; weight rotated over {copies} copies (> 2x L2)"
            rows.append(row("fp8_gemm_cublas_cold", shape, ms, flops, nbytes, "fp8", bf16_ms, note))
        except RuntimeError as e:
            print(f"# cublas cold {shape}: {str(e).splitlines()[0][:160]}")
    # a copy moving the same bytes (half read from the rotated copies, half written), launched
    # and replayed the same way: what one launch of a few MB reaches at all (H100: 77 % of the
    # large copy at 16 MB, 39 % at 3.6 MB). Not a ceiling for the large shapes: reads and writes
    # share the bus, and the GEMMs, which only read, beat it from ~70 MB
    half = nbytes // 2
    srcs = [w.view(-1).view(torch.uint8)[:half] for w, _ in ws_all]
    dst = torch.empty(half, dtype=torch.uint8, device=wq.device)
    turn = iter(range(1 << 30))
    c_ms = time_ms_graph(lambda: dst.copy_(srcs[next(turn) % copies]), launches=launches)
    of_copy = ", ".join(f"{r['op']} {c_ms / r['ms']:.1%}" for r in rows)
    note = f"same bytes copied, cold; GEMM time / this: {of_copy}"
    rows.append(row("copy_same_bytes_cold", shape, c_ms, 0, nbytes, "fp8", bf16_ms, note))
    return rows


def bench_m(name, wq, ws, w16, m: int, sweep: bool) -> list[dict]:
    n, k = wq.shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    shape = f"{name} M={m} N={n} K={k}"
    bf16_ms = _time(lambda: torch.nn.functional.linear(x, w16), m)
    cfg = tri.gemm_config(m, n, k, 128, _num_sms())
    decode = m <= DECODE_MAX_M
    flops, nbytes = fp8_block_linear_cost(m, n, k, quant_pass=not decode)
    t_ms = _time(lambda: tri.fp8_block_gemm(x, wq, ws), m)
    note = f"bf16 {bf16_ms:.4f} ms; {_tiles(cfg)}; {resource_report('fp8_gemm')}"
    rows = [
        row("fp8_gemm_triton", shape, t_ms, flops, nbytes, "fp8", bf16_ms, note)
        | dict(cfg=_tiles(cfg))
    ]
    if decode:
        rows += _decode_rows(x, wq, ws, m, shape, t_ms, bf16_ms)
        # the GEMM alone on x quantised beforehand: what a producer that quantises x itself (the
        # RMSNorm before q_a+kv_a, say) would leave of the served path
        xq = tri.quant_per_token_group(x, 128)
        p_ms = _time(lambda: tri.fp8_block_gemm(x, wq, ws, x_quant=xq), m)
        note = f"served/this {t_ms / p_ms:.2f}; GEMM alone, x quantised beforehand"
        rows.append(row("fp8_gemm_prequant", shape, p_ms, flops, nbytes, "fp8", bf16_ms, note))
        ws_all, launches = _rotation(wq, ws)
        rows += _cold_rows(x, ws_all, launches, xq, shape, t_ms, flops, nbytes, bf16_ms)
    if fp8_gemm.cublas_supports(x, wq, (128, 128)):
        c_bytes = fp8_block_linear_cost(m, n, k)[1]  # it runs the quantisation pass
        try:
            c_ms = _time(lambda: fp8_gemm.fp8_block_linear_cublas(x, wq, ws), m)
            note = f"bf16 {bf16_ms:.4f} ms; triton/cublas {t_ms / c_ms:.2f}"
            rows.append(row("fp8_gemm_cublas", shape, c_ms, flops, c_bytes, "fp8", bf16_ms, note))
        except RuntimeError as e:  # an unsupported layout or cuBLAS version: say which
            print(f"# cublas {shape}: {str(e).splitlines()[0][:160]}")
    nb16 = n * k * 2 + m * k * 2 + m * n * 2
    rows.append(row("bf16_linear", shape, bf16_ms, 2 * m * n * k, nb16, "bf16", bf16_ms))
    # at decode sizes the sweep times the GEMM alone (x quantised beforehand) on the cold
    # rotation, against the table's config the same way (fp8_gemm_prequant_cold); larger M as served
    ref_ms = next((r["ms"] for r in rows if r["op"] == "fp8_gemm_prequant_cold"), t_ms)
    for c in _sweep_cfgs(m, n, k) if sweep else []:
        try:
            if decode:
                s_ms = _time_cold(
                    lambda w, s, c=c: tri.fp8_block_gemm(x, w, s, (128, 128), c, x_quant=xq),
                    ws_all, launches,
                )  # fmt: skip
            else:
                s_ms = _time(lambda c=c: tri.fp8_block_gemm(x, wq, ws, (128, 128), c), m)
        except triton.runtime.errors.OutOfResources as e:  # a tile past this GPU's shared memory
            print(f"# sweep {shape} {_tiles(c)}: {str(e).splitlines()[0][:120]}")
            continue
        note = f"table {ref_ms:.4f} ms; {_tiles(c)}; {resource_report('fp8_gemm')}"
        rows.append(
            row("fp8_gemm_sweep", shape, s_ms, flops, nbytes, "fp8", bf16_ms, note)
            | dict(cfg=_tiles(c))
        )
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
            ratios.setdefault(_m_of(shape), []).append(t["fp8_gemm_triton"] / t["fp8_gemm_cublas"])
    if not ratios:
        print("# no cuBLAS block-scaled rows (needs sm_90 and torch's block-scaled _scaled_mm)")
        return
    print("# triton_ms / cublas_ms per M (geomean over shapes; > 1 means cuBLAS is faster)")
    for m, rs in sorted(ratios.items()):
        gm = math.exp(sum(math.log(r) for r in rs) / len(rs))
        print(f"#   M={m:<6d} {gm:6.2f}   (min {min(rs):.2f}, max {max(rs):.2f}, {len(rs)} shapes)")


def _m_of(shape: str) -> int:
    return int(shape.split("M=")[1].split()[0])


def _nk_of(shape: str) -> tuple[int, int]:
    return int(shape.split("N=")[1].split()[0]), int(shape.split("K=")[1].split()[0])


def decode_table(rows: list[dict]) -> None:
    """Old (quant + GEMM + torch sum) against new (as served) per shape and M: µs and % of the
    copy bandwidth on the bytes any path moves."""
    by = {}
    for r in rows:
        if r["op"].startswith("fp8_gemm_triton"):
            by.setdefault(r["shape"], {})[r["op"]] = r
    print("# decode: old = quant + GEMM + torch sum, new = as served (µs, % of copy bandwidth)")
    hdr = f"{'old µs':>8}{'new µs':>8}{'old %':>7}{'new %':>7}{'x':>6}"
    print(f"# {'shape':<36}{hdr}  served config with the other quantisation choice")
    for shape, t in by.items():
        if "fp8_gemm_triton_old" not in t:
            continue
        old, new = t["fp8_gemm_triton_old"], t["fp8_gemm_triton"]
        other = t.get("fp8_gemm_triton_fused") or t.get("fp8_gemm_triton_sep")
        alt = f"quant {other['cfg'].split()[-1]}: {other['ms'] * 1e3:.1f} µs" if other else ""
        print(
            f"# {shape:<36}{old['ms'] * 1e3:>8.1f}{new['ms'] * 1e3:>8.1f}{old['roofline']:>7.1%}"
            f"{new['roofline']:>7.1%}{old['ms'] / new['ms']:>6.2f}  {alt}"
        )


def best_tiles(rows: list[dict]) -> None:
    """--sweep: per shape and M, the fastest Triton config (table or swept); at decode sizes on
    cold weights and x quantised beforehand."""
    best, table = {}, {}
    for r in rows:  # decode sizes: the table's config cold on prequantised x, as the sweep ran
        if r["op"] == "fp8_gemm_prequant_cold" or (
            r["op"] == "fp8_gemm_triton" and _m_of(r["shape"]) > DECODE_MAX_M
        ):
            table[r["shape"]] = r | dict(cfg=_tiles(tri.gemm_config(
                _m_of(r["shape"]), *_nk_of(r["shape"]), 128, _num_sms())))  # fmt: skip
    for r in list(table.values()) + [r for r in rows if r["op"] == "fp8_gemm_sweep"]:
        if r["shape"] not in best or r["ms"] < best[r["shape"]]["ms"]:
            best[r["shape"]] = r
    print("# best Triton tile per shape and M (swept; table = gemm_config)")
    for shape, r in best.items():
        t = table[shape]
        print(
            f"# {shape:<36}{r['ms'] * 1e3:>8.1f} µs {r['roofline']:>6.1%}  {r['cfg']}"
            f"   (table {t['ms'] * 1e3:.1f} µs: {t['ms'] / r['ms']:.2f}x)"
        )


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--out", dest="json", help="same as --json")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="comma-separated M values")
    names = [name for name, _, _ in GLM_LINEARS]
    ap.add_argument("--shapes", help=f"comma-separated shape names out of {','.join(names)}")
    ap.add_argument(
        "--split",
        help="PROGRAMS,DEEP,WAVES: the table's split-K targets (gemm_config's "
        "SPLIT_PROGRAMS_PER_SM, SPLIT_DEEP_PROGRAMS_PER_SM, SPLIT_MAX_WAVES) instead of the "
        "served ones, to time another rule in the same call",
    )
    args = ap.parse_args()
    if args.split:
        p, d, w = args.split.split(",")
        tri.SPLIT_PROGRAMS_PER_SM, tri.SPLIT_DEEP_PROGRAMS_PER_SM = int(p), int(d)
        tri.SPLIT_MAX_WAVES = float(w)
    print(
        f"# split-K rule: {tri.SPLIT_PROGRAMS_PER_SM} programs per SM, "
        f"{tri.SPLIT_DEEP_PROGRAMS_PER_SM} for deep K under {tri.SPLIT_MAX_WAVES} waves"
    )
    ms = [int(v) for v in args.ms.split(",")]
    shapes = GLM_LINEARS[:3] if args.quick else GLM_LINEARS
    if args.shapes:
        wanted = args.shapes.split(",")
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            ap.error(f"--shapes: unknown {unknown}; known: {names}")
        shapes = [s for s in GLM_LINEARS if s[0] in wanted]
    rows = []
    for name, n, k in shapes:
        rows += bench(name, n, k, ms, args.sweep)
        torch.cuda.empty_cache()
    print_rows(rows)
    decode_table(rows)
    if args.sweep:
        best_tiles(rows)
    decision(rows)
    dump_json(rows, args.json)


if __name__ == "__main__":
    main()
