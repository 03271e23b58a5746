"""HiSparse decode against all-in-HBM, on one GPU, at GLM-5.3 shapes.

    python benchmarks/hisparse/bench_hisparse.py                       # 32K and 128K, B=64
    python benchmarks/hisparse/bench_hisparse.py --million             # + one 1,048,576-token request

One IndexShare group = 1 full layer + 3 shared layers (GLM-5.3 has 21 such groups, ~78 layers).
Two measurements per configuration, both modes doing identical work except for the KV access:

* attention only: the indexer (paged FP8 logits over the whole context + top-k; identical in
  both modes, keys stay on the GPU), then sparse MLA decode over 2048 rows (fp8_ds_mla) on each
  of the 4 layers;
* decode step: the same, with each layer's other work at GLM-5.3 dimensions around its attention
  (q/kv projections and absorption, output projection, router, shared expert, and the routed
  experts of one rank of an EP8 deployment serving B tokens per rank: 32 of the 256 experts,
  B·8/8 token-expert pairs, 1.2 GB of FP8 expert weights per layer, modelled as 16 bf16 experts
  of the same bytes; the indexer's projections on the full layer).

All-in-HBM reads every row in place. HiSparse keeps only each request's tail page on the GPU:
the resolver (`hisparse_resolve`: one kernel on CUDA) maps the top-k to hot-buffer rows
(2×topk per request), copying misses from the pinned host pool with zero-copy reads: the full
layer's rows at once, the 3 shared layers' rows on a side stream (`resolver.prefetch`), each
shared layer waiting for its own rows only — as the engine does. The benchmark sets the locality:
each step keeps a fraction h of the previous step's positions (h = target hit rate) and draws the
rest at random; the positions of every timed step are drawn before timing. Ceilings measured in
the same run: HBM copy, and host→device for random 656-byte rows (zero-copy gather) and for a
pinned bulk copy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from vllm.config.arch import GLM_5_3, ModelArch  # noqa: E402
from vllm.hisparse.resolver import apply_copies, prefetch  # noqa: E402
from vllm.hisparse.worker import device_view  # noqa: E402
from vllm.kernels.hisparse_resolve import hisparse_resolve  # noqa: E402
from vllm.kernels.indexer import indexer_logits_paged, indexer_topk  # noqa: E402
from vllm.kernels.sparse_mla import sparse_mla_decode  # noqa: E402
from vllm.kv_cache_interface import KVCacheLayout  # noqa: E402

TOPK, H, BS, LAYERS = 2048, 64, 64, 4


def _time(fn, dev, reps, warmup=2):
    for _ in range(warmup):
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
        # all-in-HBM mode: every row of every layer on the GPU (one cache per layer, so no layer
        # reads another's rows from L2)
        self.hbm = []
        for _ in range(LAYERS):
            c = torch.randint(
                0, 255, (b * pages + 1, BS, row), dtype=torch.uint8, device=dev, generator=g
            )
            c.view(-1, row)[:, 512:528] = 0  # finite scales
            self.hbm.append(c)
        self.page_table_hbm = torch.arange(b * pages, device=dev, dtype=torch.int32).view(b, pages)
        # HiSparse: GPU holds the hot buffers (2 blocks·TOPK/64 per request) + tail pages
        self.hot_rows = 2 * TOPK
        hot_blocks = self.hot_rows // BS
        n_gpu = b * (hot_blocks + 1) + 1
        self.gpu = [
            torch.zeros((n_gpu, BS, row), dtype=torch.uint8, device=dev) for _ in range(LAYERS)
        ]
        self.trash = (n_gpu - 1) * BS
        pin = dev.type == "cuda"
        self.host = [
            torch.zeros((b * pages, BS, row), dtype=torch.uint8, pin_memory=pin)
            for _ in range(LAYERS)
        ]
        for h in self.host:  # random e4m3 values (drawn on the GPU: a CPU fill of 20+ GB is slow)
            tmp = torch.zeros(h.shape, dtype=torch.uint8, device=dev)
            tmp.view(-1, row)[:, :512].random_(0, 120, generator=g)
            h.copy_(tmp)
            del tmp
        self.host_dev = [device_view(h, dev) for h in self.host]
        self.page_table_hs = torch.full((b, pages), -1, dtype=torch.int32, device=dev)
        self.page_table_hs[:, -1] = (
            torch.arange(b, device=dev, dtype=torch.int32) * (hot_blocks + 1) + hot_blocks
        )
        self.host_table = torch.arange(b * pages, device=dev).view(b, pages)
        self.hot_slots = (torch.arange(b, device=dev) * (hot_blocks + 1)).unsqueeze(
            1
        ) * BS + torch.arange(self.hot_rows, device=dev)
        self.hot_pos = torch.full((b, self.hot_rows + 1), -1, dtype=torch.int64, device=dev)
        self.hot_lru = torch.zeros((b, self.hot_rows + 1), dtype=torch.int64, device=dev)
        # indexer: FP8 keys of the whole context on the GPU
        self.idx_cache = layout.allocate_indexer(b * pages, dev)
        self.idx_cache.view(-1)[:].random_(0, 120)
        self.q = torch.randn(b, H, 576, device=dev, dtype=torch.bfloat16, generator=g) * 0.05
        self.iq = torch.randn(b, 32, 128, device=dev, generator=g).to(torch.float8_e4m3fn)
        self.iqs = torch.rand(b, 32, device=dev, generator=g)
        self.iw = torch.randn(b, 32, device=dev, generator=g)
        self.pos = torch.stack(
            [torch.randperm(ctx, device=dev, generator=g)[:TOPK] for _ in range(b)]
        )
        self.step = 0

        self.copy_stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self.dense = None

    def draw(self, keep: float, n: int):
        """The positions of the next n steps: each keeps a fraction of the previous step's."""
        g = torch.Generator(device=self.dev).manual_seed(self.step + 1000)
        n_new = int(round((1 - keep) * TOPK))
        out, pos = [], self.pos
        for _ in range(n):
            # fresh positions outside the kept ones (a top-k list never repeats a position):
            # random scores, the kept positions pushed last, the first n_new taken
            kept = pos[:, n_new:]
            score = torch.rand(self.b, self.ctx, device=self.dev, generator=g)
            score.scatter_(1, kept, 2.0)
            fresh = score.topk(n_new, dim=1, largest=False).indices
            pos = torch.cat([kept, fresh], dim=1)
            out.append(pos)
        self.pos = pos
        return out

    def indexer(self):
        ctx = torch.full((self.b,), self.ctx, device=self.dev)
        logits = indexer_logits_paged(
            self.iq,
            self.iqs,
            self.iw,
            self.idx_cache,
            self.layout,
            self.page_table_hbm,
            torch.arange(self.b, device=self.dev),
            ctx,
            self.ctx,
        )
        return indexer_topk(logits, ctx, TOPK)

    def group_hbm(self, dense: bool):
        if dense:
            self.dense.indexer_proj()
        self.indexer()
        slots = self.page_table_hbm.gather(1, (self.pos // BS)).long() * BS + self.pos % BS
        for i in range(LAYERS):
            if dense:
                self.dense.pre()
            sparse_mla_decode(self.q, self.hbm[i], slots, self.layout, 0.0625)
            if dense:
                self.dense.post()

    def group_hisparse(self, dense: bool):
        if dense:
            self.dense.indexer_proj()
        self.indexer()
        self.step += 1
        res = hisparse_resolve(
            self.pos,
            torch.arange(self.b, device=self.dev),
            self.page_table_hs,
            self.host_table,
            self.hot_slots,
            self.hot_pos,
            self.hot_lru,
            self.step,
            self.trash,
            BS,
        )
        apply_copies(res, self.gpu[:1], self.host_dev[:1])
        events = [None] + prefetch(res, self.gpu[1:], self.host_dev[1:], self.copy_stream)
        for i in range(LAYERS):
            if dense:
                self.dense.pre()
            if events[i] is not None:
                torch.cuda.current_stream(self.dev).wait_event(events[i])
            sparse_mla_decode(self.q, self.gpu[i], res.slots, self.layout, 0.0625)
            if dense:
                self.dense.post()
        return res


class DenseLayer:
    """A decoder layer's non-attention work at GLM-5.3 dimensions, bf16 weights (one set, reused
    by every layer: 1.6 GB, far above L2, so each layer reads it from HBM again)."""

    def __init__(self, b, dev, experts_local=32, expert_bytes=1, topk_experts=8, ep=8):
        a = ModelArch.from_dict(GLM_5_3)
        d, hq = a.hidden_size, a.num_attention_heads
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        g = torch.Generator(device=dev).manual_seed(1)

        def w(*shape):
            return torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=g) * 0.02

        self.x = w(b, d)
        self.wq_a, self.wq_b = w(d, a.q_lora_rank), w(a.q_lora_rank, hq * qk)
        self.wkv_a = w(d, a.kv_lora_rank + a.qk_rope_head_dim)
        self.w_uk = w(hq, a.qk_nope_head_dim, a.kv_lora_rank)
        self.w_uv = w(hq, a.kv_lora_rank, a.v_head_dim)
        self.wo = w(hq * a.v_head_dim, d)
        self.o = w(b, hq, a.kv_lora_rank)
        self.router = w(d, a.n_routed_experts)
        inter = a.moe_intermediate_size
        self.shared13, self.shared2 = w(d, 2 * inter), w(inter, d)
        # routed experts of one EP rank: b·topk/ep·ep = b·topk pairs over experts_local experts;
        # FP8 bytes modelled as fewer bf16 experts with the same bytes and the same pairs
        e = max(1, experts_local * expert_bytes // 2)
        m = max(1, b * topk_experts // e)
        self.ex = w(e, m, d)
        self.e13, self.e2 = w(e, d, 2 * inter), w(e, inter, d)
        self.iq_b = w(a.q_lora_rank, a.index_n_heads * a.index_head_dim)
        self.ik = w(d, a.index_head_dim + a.index_n_heads)
        self.hq, self.qk, self.nope = hq, qk, a.qk_nope_head_dim
        self.weight_bytes = sum(
            t.nbytes
            for t in (
                self.wq_a,
                self.wq_b,
                self.wkv_a,
                self.w_uk,
                self.w_uv,
                self.wo,
                self.router,
                self.shared13,
                self.shared2,
                self.e13,
                self.e2,
            )
        )

    def indexer_proj(self):
        cq = self.x @ self.wq_a
        return cq @ self.iq_b, self.x @ self.ik

    def pre(self):
        q = (self.x @ self.wq_a) @ self.wq_b
        q = q.view(-1, self.hq, self.qk)[..., : self.nope].transpose(0, 1)
        torch.bmm(q, self.w_uk)
        return self.x @ self.wkv_a

    def post(self):
        v = (
            torch.bmm(self.o.transpose(0, 1), self.w_uv)
            .transpose(0, 1)
            .reshape(self.x.shape[0], -1)
        )
        h = v @ self.wo
        h @ self.router
        torch.nn.functional.silu((h @ self.shared13)[:, : self.shared2.shape[0]]) @ self.shared2
        y = torch.bmm(self.ex, self.e13)[..., : self.e2.shape[1]]
        return torch.bmm(torch.nn.functional.silu(y), self.e2)


def run(b, ctx, hit_rates, dev, layout, reps, dense_modes=(False, True)):
    s = Setup(b, ctx, dev, layout)
    rows = []
    for dense in dense_modes:
        if dense and s.dense is None:
            s.dense = DenseLayer(b, dev)
        t_hbm = _time(lambda dense=dense: s.group_hbm(dense), dev, reps)
        for h in hit_rates:
            for pos in s.draw(h, 3):  # settle the hot buffers at this locality
                s.pos = pos
                s.group_hisparse(dense)
            steps = iter(s.draw(h, reps + 2))
            misses = []

            def step(dense=dense, misses=misses, steps=steps):
                s.pos = next(steps)
                misses.append(s.group_hisparse(dense).num_miss)

            t_hs = _time(step, dev, reps)
            miss = float(torch.stack(misses[-reps:]).float().mean())
            moved = miss * LAYERS * layout.mla_bytes_per_token
            rows.append(
                {
                    "batch": b,
                    "context": ctx,
                    "mode": "decode step" if dense else "attention",
                    "target_hit": h,
                    "hit": 1 - miss / (b * TOPK),
                    "hbm_ms": t_hbm,
                    "hisparse_ms": t_hs,
                    "ratio": t_hs / t_hbm,
                    "h2d_MB_per_step": moved / 1e6,
                    "h2d_GBps": moved / (t_hs * 1e-3) / 1e9,
                }
            )
            print("row:", json.dumps(rows[-1]), flush=True)
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
        r, s = run(1, 1 << 20, [0.9], dev, layout, args.reps, dense_modes=(False,))
        host_gib = sum(h.nbytes for h in s.host) / 2**30
        for x in r:
            x["host_pool_GiB_4_layers"] = host_gib
            x["host_pool_GiB_glm53"] = (1 << 20) * 54728 / 2**30
            x["tok_s_glm53_attention"] = 1e3 / (x["hisparse_ms"] * 21)  # 21 IndexShare groups
        rows += r
    print(f"per IndexShare group (1 full + 3 shared layers), fp8_ds_mla, top-k {TOPK}, {dev}")
    print(
        f"{'mode':>12} {'B':>3} {'ctx':>8} {'hit':>6} {'HBM ms':>8} {'HiSp ms':>8} {'ratio':>6} {'H2D MB':>8}"
        f" {'GB/s':>7}"
    )
    for r in rows:
        print(
            f"{r['mode']:>12} {r['batch']:>3} {r['context']:>8} {r['hit']:>6.3f} {r['hbm_ms']:>8.3f}"
            f" {r['hisparse_ms']:>8.3f}"
            f" {r['ratio']:>6.2f} {r['h2d_MB_per_step']:>8.2f} {r['h2d_GBps']:>7.2f}"
        )
    for r in rows:
        if "tok_s_glm53_attention" in r:
            print(
                f"1M-token request: {r['hisparse_ms']:.2f} ms per group step -> ~{r['tok_s_glm53_attention']:.1f} "
                f"tok/s for GLM-5.3's 21 groups (attention only); host pool {r['host_pool_GiB_4_layers']:.2f} GiB "
                f"for 4 layers here, {r['host_pool_GiB_glm53']:.1f} GiB for the whole model"
            )
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps({"bench": "hisparse", "device": str(dev), **ceil, **r}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
