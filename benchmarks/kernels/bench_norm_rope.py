"""RMSNorm and the rotary embedding at GLM-5.3's shapes: the Triton kernels (one pass each, the
rotation in place inside its head) against the torch chains they replaced (the references, and
for the rope the concatenation that put the rotated half back into its head).

Rows: the MLA query's rope half (64 heads × 256, rope dims last), the shared rope key (a [T, 64]
slice of the fused kv projection), the indexer query (32 heads × 128, rope dims first), and
RMSNorm over the hidden state (6,144), the q LoRA (2,048) and the kv LoRA (512, a row-strided
split of the fused projection), at T = 1, 64 and 256 (decode steps) and 8,192 (a prefill step).
Kernels are timed as CUDA-graph replays, the torch chains eagerly; TB/s counts each op's bytes
(``*_cost``) against the copy bandwidth measured in the same process.

    PYTHONPATH=. python3 benchmarks/kernels/bench_norm_rope.py [--quick] [--json F]

Without CUDA it runs the Triton interpreter at a tiny size: a smoke run, not a measurement.
"""

from __future__ import annotations

import os
import time
from functools import partial

import torch

if not torch.cuda.is_available():  # before Triton is imported: the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.kernels.common import dump_json, parser, print_rows, row, time_ms, time_ms_graph
from vllm.kernels.hadamard import hadamard_transform, hadamard_transform_ref
from vllm.kernels.norm_rope import (
    apply_rope_cost,
    apply_rope_ref,
    rms_norm_cost,
    rms_norm_ref,
)

# (name, heads, head dim, rope dims, rope first); heads 0: a [T, rope] key
ROPES = (("mla q", 64, 256, 64, False), ("rope key", 0, 576, 64, False),
         ("indexer q", 32, 128, 64, True))  # fmt: skip
# (name, dim, row stride)
NORMS = (("hidden", 6144, 6144), ("q lora", 2048, 2624), ("kv lora", 512, 2624))
# (name, heads): the indexer's query and key, 128 dims a head
HADAMARDS = (("indexer q", 32), ("indexer k", 1))


def _angles(t, half, dev):
    a = torch.rand(t, half, device=dev) * 100
    return a.cos(), a.sin()


def _rope_case(t, heads, width, rope, first, dev):
    """(the rope view inside its tensor, the tensor) as the model holds them."""
    if heads == 0:
        base = torch.randn(t, width, device=dev, dtype=torch.bfloat16)
        return base[:, width - rope :], base
    base = torch.randn(t, heads, width, device=dev, dtype=torch.bfloat16)
    return (base[..., :rope] if first else base[..., width - rope :]), base


def _rope_old(base, x, cos, sin, rope, first):
    """The replaced torch chain: rotate out of place, then rebuild each head with a cat."""
    r = apply_rope_ref(x, cos, sin, True)
    if base.dim() == 2:
        return r
    rest = base[..., rope:] if first else base[..., : base.shape[-1] - rope]
    return torch.cat([r, rest] if first else [rest, r], -1)


def bench_cuda(ts):
    from vllm.kernels.triton.norm_rope import apply_rope, rms_norm

    rows = []
    for t in ts:
        for name, heads, width, rope, first in ROPES:
            x, base = _rope_case(t, heads, width, rope, first, "cuda")
            cos, sin = _angles(t, rope // 2, "cuda")
            want = apply_rope_ref(x, cos, sin, True)
            got = apply_rope(x, cos, sin, True)
            err = (got.float() - want.float()).abs().max().item()
            ms = time_ms_graph(lambda x=x, cos=cos, sin=sin: apply_rope(x, cos, sin, True, out=x))
            ref_ms = time_ms(partial(_rope_old, base, x, cos, sin, rope, first), rep_ms=100)
            flops, nbytes = apply_rope_cost(t, max(heads, 1), rope)
            shape = f"T={t} {name}"
            rows.append(row("rope", shape, ms, flops, nbytes, "bf16", ref_ms, f"max err {err:.3g}"))
        for name, dim, stride in NORMS:
            wide = torch.randn(t, stride, device="cuda", dtype=torch.bfloat16)
            x = wide[:, :dim]
            w = torch.rand(dim, device="cuda", dtype=torch.bfloat16) + 0.5
            err = (rms_norm(x, w, 1e-5).float() - rms_norm_ref(x, w, 1e-5).float()).abs().max()
            ms = time_ms_graph(lambda x=x, w=w: rms_norm(x, w, 1e-5))
            ref_ms = time_ms(lambda x=x, w=w: rms_norm_ref(x, w, 1e-5), rep_ms=100)
            flops, nbytes = rms_norm_cost(t, dim)
            note = f"max err {err.item():.3g}"
            rows.append(row("rms_norm", f"T={t} {name}", ms, flops, nbytes, "bf16", ref_ms, note))
        from vllm.kernels.triton.fp8_gemm import quant_per_token_group
        from vllm.kernels.triton.norm_rope import rms_norm_quant

        x = torch.randn(t, 6144, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(6144, device="cuda", dtype=torch.bfloat16) + 0.5
        ms = time_ms_graph(lambda x=x, w=w: rms_norm_quant(x, w, 1e-5))
        ref_ms = time_ms_graph(lambda x=x, w=w: quant_per_token_group(rms_norm(x, w, 1e-5), 128))
        flops, nbytes = rms_norm_cost(t, 6144)
        nbytes += t * 6144 + t * 48 * 4  # the e4m3 copy and its scales
        note = "against rms_norm then quant_per_token_group"
        rows.append(row("rms_norm_quant", f"T={t} hidden", ms, flops, nbytes, "bf16", ref_ms, note))
        for sg in (2, 4, 16, 64):  # groups per program against the served QUANT_SPLIT_G
            ms = time_ms_graph(lambda x=x, w=w, sg=sg: rms_norm_quant(x, w, 1e-5, split_g=sg))
            rows.append(row("rms_norm_quant", f"T={t} hidden split {sg}", ms, flops, nbytes,
                            "bf16", ref_ms, note))  # fmt: skip
        for name, heads in HADAMARDS:
            x = torch.randn(t, heads, 128, device="cuda", dtype=torch.bfloat16)
            err = (hadamard_transform(x).float() - hadamard_transform_ref(x).float()).abs().max()
            ms = time_ms_graph(lambda x=x: hadamard_transform(x))
            ref_ms = time_ms_graph(lambda x=x: hadamard_transform_ref(x))
            flops, nbytes = 2 * t * heads * 128 * 128, 2 * 2 * t * heads * 128
            note = f"max diff {err.item():.3g}"
            rows.append(row("hadamard", f"T={t} {name}", ms, flops, nbytes, "bf16", ref_ms, note))
        print_rows(rows[-len(ROPES) - len(NORMS) - len(HADAMARDS) - 1 :])
    return rows


def bench_cpu():
    """The interpreter at a tiny size: the script's smoke run (wall-clock times)."""
    from tests.kernels.conftest import _numpy_index_shim
    from vllm.kernels.triton.norm_rope import apply_rope, rms_norm

    _numpy_index_shim()
    print("# no CUDA: Triton interpreter, T=4; times are the interpreter's, not a measurement")
    for name, heads, width, rope, first in ROPES:
        x, _ = _rope_case(4, heads and 2, width if heads == 0 else rope + 16, rope, first, "cpu")
        x = x.float()
        cos, sin = _angles(4, rope // 2, "cpu")
        t0 = time.perf_counter()
        same = torch.allclose(apply_rope(x, cos, sin, True), apply_rope_ref(x, cos, sin, True))
        print(f"rope      {name:<10} {(time.perf_counter() - t0) * 1e3:8.1f} ms  equal {same}")
    for name, dim, _stride in NORMS:
        x, w = torch.randn(4, dim), torch.rand(dim) + 0.5
        t0 = time.perf_counter()
        same = torch.allclose(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), atol=1e-5)
        print(f"rms_norm  {name:<10} {(time.perf_counter() - t0) * 1e3:8.1f} ms  equal {same}")


def main():
    args = parser(__doc__).parse_args()
    if not torch.cuda.is_available():
        bench_cpu()
        return
    rows = bench_cuda((1, 64, 8192) if args.quick else (1, 64, 256, 8192))
    print("\n# summary")
    print_rows(rows)
    dump_json(rows, args.json)


if __name__ == "__main__":
    main()
