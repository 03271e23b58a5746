"""MLA cache reads: gather a prefill's context rows by slot and dequantise them (fp8_ds_mla
656-byte rows or bf16 ``auto`` 1152-byte rows, to bf16 [S, 576] as the prefill reads them), whole
pages in random block order as a request's block table gives them. Memory-bound: bytes are the
rows read plus the output written. Against the torch reference (``read_mla_cache_ref``, ~10 eager
ops) in the same process; graph replays (``time_ms_graph``), the eager call time in the note."""

from __future__ import annotations

import torch

from benchmarks.kernels.common import dump_json, parser, print_rows, row, time_ms, time_ms_graph
from vllm.kernels.kv_cache import read_mla_cache_ref
from vllm.kernels.triton.kv_read import read_mla_cache
from vllm.kv_cache_interface import KVCacheLayout

SLOTS = 1 << 20
CONTEXTS = [2048, 8192, 65536]


def bench(s: int, cache_dtype: str) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    layout = KVCacheLayout(cache_dtype, torch.bfloat16, 512, 64, 128)
    nb = SLOTS // 64
    cache = layout.allocate_mla(nb, "cuda")
    if layout.is_fp8:  # finite e4m3 bytes and positive scales: the rows must decode to numbers
        cache.random_(0, 120, generator=g)
    else:
        cache.normal_(generator=g)
    blocks = torch.randperm(nb, device="cuda", generator=g)[: s // 64]
    slots = (blocks.unsqueeze(1) * 64 + torch.arange(64, device="cuda")).flatten()
    fn = lambda: read_mla_cache(cache, slots, layout, torch.bfloat16)
    ref = lambda: read_mla_cache_ref(cache, slots, layout, torch.bfloat16)
    assert torch.equal(fn(), ref())
    nbytes = s * (layout.mla_bytes_per_token + 2 * layout.mla_dim)
    eager_ms = time_ms(fn)
    return row(f"kv_read_{cache_dtype}", f"S={s} -> bf16 [S, 576]", time_ms_graph(fn), 0.0, nbytes,
               "bf16", time_ms(ref), f"graph replay; eager call {eager_ms:.4f} ms")  # fmt: skip


def main():
    args = parser(__doc__).parse_args()
    contexts = CONTEXTS[1:2] if args.quick else CONTEXTS
    rows = [bench(s, d) for d in ("fp8_ds_mla", "auto") for s in contexts]
    print_rows(rows)
    dump_json(rows, args.json)


if __name__ == "__main__":
    main()
