"""CPU KV offload on one device: reload of a GLM-5.3-shaped prefix against recomputing it.

The caches are GLM-5.3's with fp8_ds_mla, every layer: 78 MLA layers + the MTP layer (656
B/token each) and the indexer keys of the 21 "full" layers + MTP (132 B/token): 101 tensors,
54,728 B/token. ``--tokens`` (32K) worth of 64-token blocks, random bytes, are copied by the
engine's ``HostKVStore`` (the offload tier's worker half) into pinned host slots (store, D2H) and
back (reload, H2D; timed until its returned event), the blocks in order (one copy per tensor) and
in a random device order (``--scatter``: one copy per block and tensor, the worst case). Next to
them, the ceiling measured in the same run: one contiguous pinned copy of the same bytes each way.
Times are CUDA events around the side-stream work (perf_counter on the CPU, where the ceiling is a
plain tensor copy); each is the median of ``--repeats`` after a warm-up. Every timed store and
reload is checked byte for byte against the original blocks (the destination is zeroed first);
a mismatch exits 1.

Recompute: the prefill of the same tokens, in chunks of ``--chunk`` (2048, the engine's default
max_num_batched_tokens), through the GLM-5.3-shaped slice the other benchmarks use (real attention
and indexer shapes; hidden 1024, 2 of 4 experts of 256; random bf16 weights, fp32 on the CPU) with
``--slice-layers`` layers, each layer timed with events around it. The projection to 78 layers +
MTP takes, for each GLM-5.3 layer, the mean time of the slice's layers of its kind (dense or MoE,
indexer full or shared; the MTP layer as an MoE layer with an indexer), plus the slice's time
outside its layers once; the logits of the last token are left out. The slice's narrower
projections and experts make it a lower bound of GLM-5.3's recompute on this device.

    python benchmarks/kv_transfer/bench_offload_reload.py                  # 32K tokens, CUDA
    python benchmarks/kv_transfer/bench_offload_reload.py --tokens 256 --device cpu --no-recompute
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from vllm.config.arch import GLM_5_3, ModelArch  # noqa: E402
from vllm.distributed.kv_transfer.offload_store import HostKVStore, coalesce  # noqa: E402
from vllm.kv_cache_interface import KVCacheLayout, cdiv, kv_bytes_per_token  # noqa: E402

FLOOR = 0.70  # the floor: reload at >= 70 % of the pinned-copy ceiling


class VerificationError(RuntimeError):
    pass


# ---- timing ----------------------------------------------------------------------------------
def elapsed_s(dev: torch.device, fn: Callable[[], None]) -> float:
    """Device time of the work ``fn`` issues on the current stream (which must end by waiting for
    any side stream it used); wall time on the CPU, where every copy is synchronous."""
    if dev.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    torch.cuda.synchronize(dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def median_s(dev, fn, repeats: int, prepare=None, check=None) -> float:
    """Median over ``repeats`` runs after one warm-up; ``prepare`` and ``check`` run untimed
    around every run (the warm-up's too)."""
    times = []
    for r in range(repeats + 1):
        if prepare is not None:
            prepare()
        t = elapsed_s(dev, fn)
        if check is not None:
            check()
        if r:
            times.append(t)
    return statistics.median(times)


# ---- the caches and their copies -------------------------------------------------------------
def glm_caches(num_blocks: int, dev: torch.device) -> tuple[list, int]:
    """Every GLM-5.3 layer's fp8_ds_mla caches, random bytes: [(mla, indexer or None)] in cache
    order (main layers, then MTP) and the bytes one token takes across them."""
    arch = ModelArch.from_dict(GLM_5_3)
    lay = KVCacheLayout.from_arch(arch, "fp8_ds_mla", torch.bfloat16)
    full = set(arch.full_layers)
    has_idx = [i in full for i in range(arch.num_hidden_layers)]
    has_idx += [True] * arch.num_nextn_predict_layers
    caches = []
    for idx in has_idx:
        pair = (
            lay.allocate_mla(num_blocks, dev),
            lay.allocate_indexer(num_blocks, dev) if idx else None,
        )
        for t in pair:
            if t is not None:
                t.random_(0, 256)
        caches.append(pair)
    return caches, kv_bytes_per_token(arch, "fp8_ds_mla")


def pinned_ceiling(nbytes: int, dev: torch.device, repeats: int) -> tuple[float, float]:
    """Seconds of one contiguous copy of ``nbytes``: pinned host -> device and back."""
    cuda = dev.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda).fill_(1)
    devbuf = torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(2)
    h2d = median_s(dev, lambda: devbuf.copy_(host, non_blocking=cuda), repeats)
    d2h = median_s(dev, lambda: host.copy_(devbuf, non_blocking=cuda), repeats)
    return h2d, d2h


class Copier:
    """The store and reload timings of one prefix through ``HostKVStore``, each checked."""

    def __init__(self, kv: HostKVStore, ref: list[torch.Tensor], dev: torch.device, repeats: int):
        self.kv, self.ref, self.dev, self.repeats = kv, ref, dev, repeats
        self.n = ref[0].shape[0]

    def _wait_side(self, handle=None) -> None:
        if self.dev.type == "cuda":
            cur = torch.cuda.current_stream(self.dev)
            if handle is not None:
                cur.wait_event(handle)
            else:
                cur.wait_stream(self.kv.stream)

    def reload_s(self, blocks: torch.Tensor) -> float:
        """Host slot i -> device block ``blocks[i]``; the blocks are zeroed before each run and
        must hold the original block i after it."""
        pairs = [(int(b), s) for s, b in enumerate(blocks.tolist())]
        idx = blocks.to(self.dev)

        def prepare():
            for t in self.kv.dev:
                t.index_fill_(0, idx, 0)

        def check():
            for k, (t, r) in enumerate(zip(self.kv.dev, self.ref, strict=True)):
                if not torch.equal(t.index_select(0, idx), r):
                    raise VerificationError(f"reload: cache tensor {k} differs from the original")

        return median_s(
            self.dev, lambda: self._wait_side(self.kv.load(pairs)), self.repeats, prepare, check
        )

    def store_s(self, blocks: torch.Tensor) -> float:
        """Device block ``blocks[i]`` (holding original block i) -> host slot i; the slots are
        zeroed before each run and must hold the original block i after it."""
        pairs = [(int(b), s) for s, b in enumerate(blocks.tolist())]

        def prepare():
            for h in self.kv.host:
                h[: self.n].zero_()

        def check():
            self.kv.synchronize()
            for k, (h, r) in enumerate(zip(self.kv.host, self.ref, strict=True)):
                if not torch.equal(h[: self.n].to(self.dev), r):
                    raise VerificationError(f"store: cache tensor {k} differs from the original")

        def run():
            self.kv.store(pairs)
            self._wait_side()

        return median_s(self.dev, run, self.repeats, prepare, check)


def offload_figures(args, dev: torch.device) -> dict:
    n = cdiv(args.tokens, 64)
    num_blocks = n + max(n // 8, 8)  # spare blocks: the scattered order draws from all of them
    caches, per_token = glm_caches(num_blocks, dev)
    kv = HostKVStore(n, dev)
    kv.register(caches)
    if kv.bytes_per_block != per_token * 64:
        raise AssertionError(f"{kv.bytes_per_block} B/block != 64 x {per_token} B/token")
    ref = [t[:n].clone() for t in kv.dev]
    nbytes = n * kv.bytes_per_block
    h2d_ceil, d2h_ceil = pinned_ceiling(nbytes, dev, args.repeats)
    cp = Copier(kv, ref, dev, args.repeats)
    g = torch.Generator().manual_seed(args.seed)
    contiguous = torch.arange(n)
    scattered = torch.randperm(num_blocks, generator=g)[:n]
    rows = {"ceiling_h2d": (h2d_ceil, 1), "ceiling_d2h": (d2h_ceil, 1)}
    # the store fills the host slots the reloads read: contiguous first, then scattered
    for name, blocks in (("contiguous", contiguous), ("scattered", scattered)):
        if name == "scattered" and not args.scatter:
            continue
        copies = len(coalesce([(int(b), s) for s, b in enumerate(blocks.tolist())])) * len(kv.dev)
        if name == "contiguous":
            rows["store_contiguous"] = (cp.store_s(blocks), copies)
        rows[f"reload_{name}"] = (cp.reload_s(blocks), copies)
        if name == "scattered":
            rows["store_scattered"] = (cp.store_s(blocks), copies)
    return {
        "tokens": args.tokens,
        "blocks": n,
        "cache_tensors": len(kv.dev),
        "bytes_per_token": per_token,
        "bytes": nbytes,
        "ceiling": "pinned copy" if dev.type == "cuda" else "plain copy",
        "rows": {
            k: {
                "ms": s * 1e3,
                "gbps": nbytes / s / 1e9,
                "copies": c,
                "of_ceiling": (h2d_ceil if "h2d" in k or "reload" in k else d2h_ceil) / s,
            }
            for k, (s, c) in rows.items()
        },
    }


# ---- recompute -------------------------------------------------------------------------------
def recompute_figures(args, dev: torch.device) -> dict:
    """Chunked prefill of ``--tokens`` through the GLM-5.3 slice, each decoder layer timed, and
    the projection to GLM-5.3's 78 layers + MTP (see the module docstring)."""
    from vllm.model_executor.model_loader import build_model
    from vllm.model_executor.simple_forward import SimpleKV
    from vllm.model_executor.tiny import slice_config, tiny_state_dict, write_checkpoint

    cfg = slice_config(num_hidden_layers=args.slice_layers)
    with tempfile.TemporaryDirectory(prefix="glm-slice-") as d:
        write_checkpoint(d, cfg, tiny_state_dict(cfg, seed=3), tokenizer=False)
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        model = build_model(d, dtype=dtype, device=dev)
    layers = list(model.model.layers)
    marks: list[list] = [[] for _ in layers]  # per layer: (start, end) of every call
    clock = _Clock(dev)
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: marks[i].append([clock.mark()]))
        layer.register_forward_hook(lambda m, a, o, i=i: marks[i][-1].append(clock.mark()))
    ids = torch.randint(3, 1000, (args.tokens,), generator=torch.Generator().manual_seed(1)).to(dev)
    passes = []  # (total, per layer) of each timed pass
    for r in range(args.recompute_repeats + 1):  # the first pass compiles
        kv = SimpleKV(model, "fp8_ds_mla", args.tokens, 1, dev)
        for m in marks:
            m.clear()
        t0 = clock.mark()
        with torch.no_grad():
            for a in range(0, args.tokens, args.chunk):
                cnt = min(args.chunk, args.tokens - a)
                meta, pos = kv.metadata([(0, a, cnt)], [False])
                model(ids[a : a + cnt], pos, meta)
        total = clock.since(t0)
        per_layer = [sum(clock.between(s, e) for s, e in m) for m in marks]
        if r:
            passes.append((total, per_layer))
        del kv
    total = statistics.median(p[0] for p in passes)
    per_layer = [statistics.median(p[1][i] for p in passes) for i in range(len(layers))]
    kinds = [_kind(layer.self_attn.attn.has_indexer, layer.is_moe) for layer in layers]
    return {
        "slice_layers": args.slice_layers,
        "slice_kinds": kinds,
        "chunk": args.chunk,
        "slice_ms": total * 1e3,
        "slice_layer_ms": [t * 1e3 for t in per_layer],
        **project(total, per_layer, kinds),
        "slice_width": (
            f"hidden {cfg['hidden_size']}, {cfg['num_experts_per_tok']} of "
            f"{cfg['n_routed_experts']} experts of {cfg['moe_intermediate_size']}, "
            f"{str(dtype).removeprefix('torch.')} (GLM-5.3: "
            f"{GLM_5_3['hidden_size']}, {GLM_5_3['num_experts_per_tok']} of "
            f"{GLM_5_3['n_routed_experts']} of {GLM_5_3['moe_intermediate_size']}, FP8)"
        ),
    }


def project(total: float, per_layer: list[float], kinds: list[str]) -> dict:
    """GLM-5.3's 78 layers + MTP, each at the mean slice time of its kind, plus the slice's time
    outside its layers (embedding, final norm) once."""
    arch = ModelArch.from_dict(GLM_5_3)
    glm_kinds = [_kind(t == "full", arch.is_moe_layer(i)) for i, t in enumerate(arch.indexer_types)]
    glm_kinds += [_kind(True, True)] * arch.num_nextn_predict_layers
    by_kind = {
        k: statistics.mean(t for t, kk in zip(per_layer, kinds, strict=True) if kk == k)
        for k in set(kinds)
    }
    missing = sorted({k for k in glm_kinds if k not in by_kind})
    fallback = statistics.mean(per_layer)  # a kind the slice lacks: the mean of its layers
    other = max(total - sum(per_layer), 0.0)
    projected = other + sum(by_kind.get(k, fallback) for k in glm_kinds)
    return {
        "slice_other_ms": other * 1e3,
        "projected_layers": len(glm_kinds),
        "kinds_missing_from_slice": missing,
        "projected_ms": projected * 1e3,
    }


def _kind(has_indexer: bool, is_moe: bool) -> str:
    return f"{'moe' if is_moe else 'dense'}+{'full' if has_indexer else 'shared'}"


class _Clock:
    """Marks on the current stream (CUDA events) or the host clock (CPU)."""

    def __init__(self, dev: torch.device):
        self.cuda = dev.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def between(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def since(self, a) -> float:
        b = self.mark()
        if self.cuda:
            b.synchronize()
        return self.between(a, b)


# ---- report ----------------------------------------------------------------------------------
def table(off: dict, rec: dict | None) -> list[str]:
    r = off["rows"]
    lines = [
        f"{off['tokens']}-token GLM-5.3 prefix: {off['blocks']} blocks x {off['cache_tensors']} "
        f"cache tensors, {off['bytes_per_token']:,} B/token, {off['bytes'] / 1e9:.3f} GB",
        f"{'':24}{'copies':>8}{'ms':>10}{'GB/s':>9}{'of ceiling':>12}",
    ]
    kind = "pinned" if off["ceiling"] == "pinned copy" else "plain"
    for key, label, d in (
        ("ceiling_h2d", f"ceiling H2D ({kind})", "h2d"),
        ("ceiling_d2h", f"ceiling D2H ({kind})", "d2h"),
        ("reload_contiguous", "reload contiguous", "h2d"),
        ("reload_scattered", "reload scattered", "h2d"),
        ("store_contiguous", "store contiguous", "d2h"),
        ("store_scattered", "store scattered", "d2h"),
    ):
        if key not in r:
            continue
        x = r[key]
        frac = x["of_ceiling"]
        note = (
            f"  (floor {FLOOR:.0%}: {'met' if frac >= FLOOR else 'NOT met'})"
            if key.startswith("reload")
            else ""
        )
        lines.append(
            f"{label:24}{x['copies']:>8}{x['ms']:>10.2f}{x['gbps']:>9.2f}{frac:>11.1%} "
            f"{d.upper()}{note}"
        )
    if rec is not None:
        faster = ", ".join(
            f"{k} {rec['projected_ms'] / r[f'reload_{k}']['ms']:.1f}x"
            for k in ("contiguous", "scattered")
            if f"reload_{k}" in r
        )
        lines.append(
            f"{'recompute (projected)':24}{'':>8}{rec['projected_ms']:>10.2f}{'':>9}{'':>12}"
            f"  reload faster: {faster}"
        )
    return lines


def describe_recompute(rec: dict, tokens: int) -> list[str]:
    kinds = ", ".join(
        f"{k} {t:.2f} ms" for k, t in zip(rec["slice_kinds"], rec["slice_layer_ms"], strict=True)
    )
    lines = [
        f"recompute: {rec['slice_layers']}-layer GLM-5.3 slice, {tokens} tokens in chunks of "
        f"{rec['chunk']}: {rec['slice_ms']:.2f} ms (layers: {kinds}; outside them "
        f"{rec['slice_other_ms']:.2f} ms)",
        f"  projected to {rec['projected_layers']} layers (78 + MTP), each at its kind's slice "
        f"time: {rec['projected_ms']:.2f} ms, a lower bound: the slice is narrower "
        f"({rec['slice_width']})",
    ]
    if rec["kinds_missing_from_slice"]:
        lines.append(
            f"  kinds the slice lacks, at its mean layer: {rec['kinds_missing_from_slice']}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per copy (after a warm-up)")
    ap.add_argument(
        "--scatter",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also a random device block order (no coalescing: the worst case)",
    )
    ap.add_argument("--no-recompute", dest="recompute", action="store_false")
    ap.add_argument("--slice-layers", type=int, default=4)
    ap.add_argument(
        "--chunk", type=int, default=2048, help="prefill chunk (max_num_batched_tokens)"
    )
    ap.add_argument("--recompute-repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, metavar="PATH", help="write the figures here")
    args = ap.parse_args(argv)
    counts = ("tokens", "repeats", "chunk", "slice_layers", "recompute_repeats")
    for c in counts:
        if getattr(args, c) < 1:
            ap.error(f"--{c.replace('_', '-')} must be >= 1")
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}", flush=True)
    try:
        off = offload_figures(args, dev)
    except VerificationError as e:
        print(f"verification: FAILED: {e}", flush=True)
        return 1
    print("verification: passed (every timed store and reload equal to the original bytes)")
    print("copies:", json.dumps(off["rows"]), flush=True)  # kept should the recompute fail
    rec = None
    if args.recompute:
        rec = recompute_figures(args, dev)
        print("\n".join(describe_recompute(rec, args.tokens)))
    if args.json:
        head = {"bench": "offload_reload", "device": name, "args": vars(args), "floor": FLOOR}
        with open(args.json, "w") as f:
            json.dump({**head, **off, "recompute": rec}, f, indent=1)
    print("\n".join(table(off, rec)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
