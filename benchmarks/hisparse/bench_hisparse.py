"""HiSparse decode attention against all-in-HBM, on one GPU, at GLM-5.3 attention shapes.

    python benchmarks/hisparse/bench_hisparse.py                       # 32K and 128K, B=64
    python benchmarks/hisparse/bench_hisparse.py --million             # + one 1,048,576-token request

One IndexShare group = 1 full layer + 3 shared layers (GLM-5.3 has 21 such groups, ~78 layers).
Per decode step and group: the indexer (paged FP8 logits over the whole context + top-k; identical
in both modes, keys stay on the GPU), then for each of the 4 layers sparse MLA decode over 2048
rows (fp8_ds_mla). All-in-HBM reads every row in place. HiSparse keeps only each request's tail
page on the GPU: the resolver maps the top-k to hot-buffer rows (2×topk per request), copying
misses from the pinned host pool for all 4 layers (zero-copy reads). The benchmark sets the
locality: each step keeps a fraction h of the previous step's positions (h = target hit rate) and
draws the rest at random. Ceilings measured in the same run: HBM copy, and host→device for random
656-byte rows (zero-copy gather) and for a pinned bulk copy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from vllm.attention.kv_cache import KVCacheLayout  # noqa: E402
from vllm.attention.ops import dispatch  # noqa: E402
from vllm.config.arch import GLM_5_3, ModelArch  # noqa: E402
from vllm.hisparse.resolver import apply_copies, resolve  # noqa: E402
from vllm.hisparse.worker import device_view  # noqa: E402

TOPK, H, BS, LAYERS = 2048, 64, 64, 4


def _time(fn, dev, reps):
    for _ in range(2):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def host_ceilings(dev, layout):
    if dev.type != "cuda":
        return {}
    n = 1 << 20
    host = torch.empty((n, layout.mla_bytes_per_token), dtype=torch.uint8, pin_memory=True)
    view = device_view(host, dev)
    idx = torch.randint(0, n, (1 << 17,), device=dev)
    out = torch.empty((1 << 17, layout.mla_bytes_per_token), dtype=torch.uint8, device=dev)
    ms = _time(lambda: torch.index_select(view, 0, idx, out=out), dev, 10)
    zc = out.numel() / (ms * 1e-3) / 1e9
    bulk_h = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    bulk_d = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    ms = _time(lambda: bulk_d.copy_(bulk_h, non_blocking=True), dev, 5)
    return {"zero_copy_rows_GBps": zc, "pinned_bulk_GBps": (1 << 30) / (ms * 1e-3) / 1e9}


class Setup:
    def __init__(self, b, ctx, dev, layout):
        self.b, self.ctx, self.dev, self.layout = b, ctx, dev, layout
        pages = -(-ctx // BS)
        self.pages = pages
        g = torch.Generator(device=dev).manual_seed(0)
        row = layout.mla_bytes_per_token
        # HBM copy of every row (all-in-HBM mode) for one layer, reused for the 4 layers' reads
        self.hbm = torch.randint(0, 255, (b * pages + 1, BS, row), dtype=torch.uint8, device=dev, generator=g)
        self.hbm.view(-1, row)[:, 512:528] = 0  # finite scales
        self.page_table_hbm = torch.arange(b * pages, device=dev, dtype=torch.int32).view(b, pages)
        # HiSparse: GPU holds the hot buffers (2 blocks·TOPK/64 per request) + tail pages
        self.hot_rows = 2 * TOPK
        hot_blocks = self.hot_rows // BS
        n_gpu = b * (hot_blocks + 1) + 1
        self.gpu = [torch.zeros((n_gpu, BS, row), dtype=torch.uint8, device=dev) for _ in range(LAYERS)]
        self.trash = (n_gpu - 1) * BS
        pin = dev.type == "cuda"
        self.host = [torch.zeros((b * pages, BS, row), dtype=torch.uint8, pin_memory=pin) for _ in range(LAYERS)]
        for h in self.host:
            h.view(-1, row)[:, :512].random_(0, 120)
        self.host_dev = [device_view(h, dev) for h in self.host]
        self.page_table_hs = torch.full((b, pages), -1, dtype=torch.int32, device=dev)
        self.page_table_hs[:, -1] = torch.arange(b, device=dev, dtype=torch.int32) * (hot_blocks + 1) + hot_blocks
        self.host_table = torch.arange(b * pages, device=dev).view(b, pages)
        self.hot_slots = ((torch.arange(b, device=dev) * (hot_blocks + 1)).unsqueeze(1) * BS
                          + torch.arange(self.hot_rows, device=dev))
        self.hot_pos = torch.full((b, self.hot_rows + 1), -1, dtype=torch.int64, device=dev)
        self.hot_lru = torch.zeros((b, self.hot_rows + 1), dtype=torch.int64, device=dev)
        # indexer: FP8 keys of the whole context on the GPU
        self.idx_cache = layout.allocate_indexer(b * pages, dev)
        self.idx_cache.view(-1)[:].random_(0, 120)
        self.q = torch.randn(b, H, 576, device=dev, dtype=torch.bfloat16, generator=g) * 0.05
        self.iq = torch.randn(b, 32, 128, device=dev, generator=g).to(torch.float8_e4m3fn)
        self.iqs = torch.rand(b, 32, device=dev, generator=g)
        self.iw = torch.randn(b, 32, device=dev, generator=g)
        self.pos = torch.stack([torch.randperm(ctx, device=dev, generator=g)[:TOPK] for _ in range(b)])
        self.step = 0

    def advance(self, keep: float):
        """Next step's top-k: keep a fraction of the previous positions, draw the rest."""
        g = torch.Generator(device=self.dev).manual_seed(self.step)
        n_new = int(round((1 - keep) * TOPK))
        fresh = torch.randint(0, self.ctx - BS, (self.b, n_new), device=self.dev, generator=g)
        self.pos = torch.cat([self.pos[:, n_new:], fresh], dim=1)
        self.step += 1

    def indexer(self):
        ctx = torch.full((self.b,), self.ctx, device=self.dev)
        logits = dispatch.indexer_logits_paged(self.iq, self.iqs, self.iw, self.idx_cache, self.layout,
                                               self.page_table_hbm, torch.arange(self.b, device=self.dev), ctx,
                                               self.ctx)
        return dispatch.indexer_topk(logits, ctx, TOPK)

    def attend_hbm(self):
        slots = self.page_table_hbm.gather(1, (self.pos // BS)).long() * BS + self.pos % BS
        for _ in range(LAYERS):
            dispatch.sparse_mla_decode(self.q, self.hbm, slots, self.layout, 0.0625)

    def attend_hisparse(self):
        res = resolve(self.pos, torch.arange(self.b, device=self.dev), self.page_table_hs, self.host_table,
                      self.hot_slots, self.hot_pos, self.hot_lru, self.step, self.trash, BS)
        apply_copies(res, self.gpu, self.host_dev)
        for i in range(LAYERS):
            dispatch.sparse_mla_decode(self.q, self.gpu[i], res.slots, self.layout, 0.0625)
        return res


def run(b, ctx, hit_rates, dev, layout, reps):
    s = Setup(b, ctx, dev, layout)
    t_idx = _time(s.indexer, dev, reps)
    t_hbm = _time(s.attend_hbm, dev, reps)
    rows = []
    for h in hit_rates:
        for _ in range(3):  # settle the hot buffers at this locality
            s.advance(h)
            s.attend_hisparse()
        misses = []

        def step(h=h, misses=misses):
            s.advance(h)
            misses.append(s.attend_hisparse().num_miss)

        t_hs = _time(step, dev, reps)
        miss = float(torch.stack(misses[-reps:]).float().mean())
        moved = miss * LAYERS * layout.mla_bytes_per_token
        rows.append({"batch": b, "context": ctx, "target_hit": h, "hit": 1 - miss / (b * TOPK),
                     "hbm_ms": t_idx + t_hbm, "hisparse_ms": t_idx + t_hs, "ratio": (t_idx + t_hs) / (t_idx + t_hbm),
                     "h2d_MB_per_step": moved / 1e6, "h2d_GBps": moved / (t_hs * 1e-3) / 1e9,
                     "indexer_ms": t_idx})
    return rows, s


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--hit-rates", type=float, nargs="+", default=[0.5, 0.9, 0.99])
    ap.add_argument("--million", action="store_true", help="also one 1,048,576-token request")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    layout = KVCacheLayout.from_arch(ModelArch.from_dict(GLM_5_3), "fp8_ds_mla", torch.bfloat16)
    ceil = host_ceilings(dev, layout)
    if dev.type == "cuda":
        from benchmarks.kernels.common import measure_peaks

        p = measure_peaks()
        ceil["hbm_copy_TBps"] = p.copy_tbps
    print("ceilings:", {k: round(v, 2) for k, v in ceil.items()})
    rows = []
    for ctx in args.contexts:
        rows += run(args.batch, ctx, args.hit_rates, dev, layout, args.reps)[0]
    if args.million:
        r, s = run(1, 1 << 20, [0.9], dev, layout, args.reps)
        host_gib = sum(h.nbytes for h in s.host) / 2**30
        for x in r:
            x["host_pool_GiB_4_layers"] = host_gib
            x["host_pool_GiB_glm53"] = (1 << 20) * 54728 / 2**30
            x["tok_s_glm53_attention"] = 1e3 / (x["hisparse_ms"] * 21)  # 21 IndexShare groups
        rows += r
    print(f"decode attention per IndexShare group (1 full + 3 shared layers), fp8_ds_mla, top-k {TOPK}, {dev}")
    print(f"{'B':>3} {'ctx':>8} {'hit':>6} {'HBM ms':>8} {'HiSp ms':>8} {'ratio':>6} {'H2D MB':>8} {'GB/s':>7}")
    for r in rows:
        print(f"{r['batch']:>3} {r['context']:>8} {r['hit']:>6.3f} {r['hbm_ms']:>8.3f} {r['hisparse_ms']:>8.3f}"
              f" {r['ratio']:>6.2f} {r['h2d_MB_per_step']:>8.2f} {r['h2d_GBps']:>7.2f}")
    for r in rows:
        if "tok_s_glm53_attention" in r:
            print(f"1M-token request: {r['hisparse_ms']:.2f} ms per group step -> ~{r['tok_s_glm53_attention']:.1f} "
                  f"tok/s for GLM-5.3's 21 groups (attention only); host pool {r['host_pool_GiB_4_layers']:.2f} GiB "
                  f"for 4 layers here, {r['host_pool_GiB_glm53']:.1f} GiB for the whole model")
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps({"bench": "hisparse", "device": str(dev), **ceil, **r}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
