"""KV cache writes: quantise + scatter N new rows into a 1M-slot cache at random distinct slots
(fp8_ds_mla 656-byte rows, bf16 ``auto`` 1152-byte rows, FP8 indexer keys 132 bytes).
Memory-bound; the floor is 60 % of the measured copy bandwidth.

The time of a row is the GPU's per call, from 20 calls captured in a CUDA graph and replayed
(:func:`benchmarks.kernels.common.time_ms_graph`): these kernels take 10-100 µs, and timed one
eager call at a time a 20-µs kernel measures the host's launch instead. The note gives the eager
per-call time too."""

from __future__ import annotations

import torch

from benchmarks.kernels.common import dump_json, parser, print_rows, row, time_ms, time_ms_graph
from vllm.kernels.kv_cache import kv_write_cost, write_indexer_cache_ref, write_mla_cache_ref
from vllm.kernels.triton import kv_write
from vllm.kernels.triton.kv_write import write_indexer_cache, write_mla_cache
from vllm.kv_cache_interface import KVCacheLayout

SLOTS = 1 << 20
SHAPES = [16384, 131072]


def bench(n, what, tag="", paged=False):
    """paged=False: n distinct slots drawn at random (decode-like scatter, the worst case);
    paged=True: n/64 whole pages in random block order (what a prefill chunk's slot mapping is)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    cache_dtype = "auto" if what == "mla_auto" else "fp8_ds_mla"
    layout = KVCacheLayout(cache_dtype, torch.bfloat16, 512, 64, 128)
    nb = SLOTS // 64
    if paged:
        blocks = torch.randperm(nb, device="cuda", generator=g)[: n // 64]
        slots = (blocks.unsqueeze(1) * 64 + torch.arange(64, device="cuda")).flatten()
        tag += " paged"
    else:
        slots = torch.randperm(SLOTS, device="cuda", generator=g)[:n]
    kv_c = torch.randn(n, 512, device="cuda", generator=g).to(torch.bfloat16)
    k_pe = torch.randn(n, 64, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(n, 128, device="cuda", generator=g).to(torch.bfloat16)
    if what == "indexer":
        cache = layout.allocate_indexer(nb, "cuda")
        fn = lambda: write_indexer_cache(cache, k, slots, layout)
        ref = lambda: write_indexer_cache_ref(cache, k, slots, layout)
        flops, nbytes = kv_write_cost(n, 256, 132)
    else:
        cache = layout.allocate_mla(nb, "cuda")
        fn = lambda: write_mla_cache(cache, kv_c, k_pe, slots, layout)
        ref = lambda: write_mla_cache_ref(cache, kv_c, k_pe, slots, layout)
        flops, nbytes = kv_write_cost(n, 1152, layout.mla_bytes_per_token)
    eager_ms = time_ms(fn)
    ms = time_ms_graph(fn)
    ref_ms = time_ms(ref, rep_ms=100)
    return row(f"kv_write_{what}", f"N={n} into {SLOTS} slots{tag}", ms, flops, nbytes, "bf16", ref_ms,
               f"graph replay; eager call {eager_ms:.4f} ms")  # fmt: skip


def main():
    ap = parser(__doc__)
    ap.add_argument(
        "--sweep-caches",
        nargs="+",
        default=["mla_fp8", "indexer"],
        choices=["mla_fp8", "indexer"],
        help="the writers --sweep tunes",
    )
    args = ap.parse_args()
    shapes = SHAPES[:1] if args.quick else SHAPES
    rows = [bench(n, w) for w in ("mla_fp8", "mla_auto", "indexer") for n in shapes]
    rows += [bench(n, w, paged=True) for w in ("mla_fp8", "mla_auto", "indexer") for n in shapes]
    if args.sweep:  # (rows per program, warps) of the FP8 writers
        default = dict(kv_write.TUNE)
        for what in args.sweep_caches:
            for block_r in (4, 8, 16, 32):
                for warps in (1, 2, 4, 8):
                    kv_write.TUNE[what] = (block_r, warps)
                    for paged in (False, True):
                        rows += [
                            bench(n, what, f" BR{block_r} w{warps}", paged) for n in shapes[-1:]
                        ]
            kv_write.TUNE[what] = default[what]
    print_rows(rows)
    dump_json(rows, args.json)


if __name__ == "__main__":
    main()
