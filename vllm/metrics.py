"""Prometheus metrics with upstream vLLM's `vllm:` names, kept by the front end."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LAT = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)


class Metrics:
    def __init__(
        self, model_name: str, num_spec_tokens: int = 0, synthetic_length: float | None = None
    ):
        self.registry = CollectorRegistry()
        r, lab = self.registry, ["model_name"]
        self.running = Gauge(
            "vllm:num_requests_running", "Requests in model execution batches", lab, registry=r
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting to be processed", lab, registry=r
        )
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage, 1 = 100%", lab, registry=r
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prefill tokens processed", lab, registry=r
        )
        self.gen_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens processed", lab, registry=r
        )
        self.pc_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix-cache queries, in tokens", lab, registry=r
        )
        self.pc_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix-cache hits, in tokens", lab, registry=r
        )
        self.preemptions = Counter(
            "vllm:num_preemptions", "Cumulative preemptions", lab, registry=r
        )
        self.success = Counter(
            "vllm:request_success", "Finished requests", lab + ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token", lab, buckets=_LAT, registry=r
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency", lab, buckets=_LAT, registry=r
        )
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Time per output token",
            lab,
            buckets=_LAT,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency",
            lab,
            buckets=_LAT,
            registry=r,
        )
        self.kv_transfer = {  # KV connector counters (P/D, CPU offload), summed over ranks
            k: Counter(f"vllm:{k}", doc, lab, registry=r)
            for k, doc in (
                ("kv_transfer_recv_bytes", "KV bytes received from remote engines"),
                ("kv_transfer_num_loads", "Remote KV loads completed"),
                ("kv_transfer_num_failed_loads", "Remote KV loads failed"),
                # upstream's names: tokens looked up in / found in a connector's cache
                ("external_prefix_cache_queries", "External prefix-cache queries, in tokens"),
                ("external_prefix_cache_hits", "External prefix-cache hits, in tokens"),
                ("kv_offload_stored_blocks", "KV blocks copied to the CPU offload tier"),
                ("kv_offload_evicted_blocks", "KV blocks evicted from the CPU offload tier"),
                ("kv_offload_store_bytes", "KV bytes copied to the CPU offload tier, all ranks"),
                ("kv_offload_load_bytes", "KV bytes copied back from the CPU offload tier"),
                ("kv_offload_num_loads", "Prefix loads from the CPU offload tier, all ranks"),
            )
        }
        self.extra: dict[str, Gauge] = {}
        self.name = model_name
        self.spec = None
        if num_spec_tokens:
            self.spec = self._spec_counters(num_spec_tokens)
        if synthetic_length is not None:  # ours: marks benchmark figures as synthetic
            Gauge(
                "vllm:spec_decode_synthetic_acceptance_length",
                "Fixed mean acceptance length of the synthetic mode (benchmarks only)",
                ["model_name"],
                registry=self.registry,
            ).labels(model_name).set(synthetic_length)
        for g in (self.running, self.waiting, self.kv_usage):
            g.labels(model_name).set(0)
        # every series exported from start-up, at 0 (a labelled series appears only once its
        # labels are used; a scraper should not have to tell "absent" from "zero")
        for m in (self.prompt_tokens, self.gen_tokens, self.pc_queries, self.pc_hits,
                  self.preemptions, self.ttft, self.itl, self.tpot, self.e2e,
                  *self.kv_transfer.values()):  # fmt: skip
            m.labels(model_name)
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels(model_name, reason)

    def _spec_counters(self, k: int) -> tuple[Counter, ...]:
        """Speculative decoding, with upstream's names (a draft: one request's proposed tokens
        in one step; accepted tokens exclude the bonus token)."""
        r, lab, n = self.registry, ["model_name"], self.name
        out = (
            Counter("vllm:spec_decode_num_drafts", "Drafts verified", lab, registry=r),
            Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens", lab, registry=r),
            Counter(
                "vllm:spec_decode_num_accepted_tokens", "Accepted draft tokens", lab, registry=r
            ),
            Counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted draft tokens by position in the draft",
                lab + ["position"],
                registry=r,
            ),
        )
        for c in out[:3]:
            c.labels(n)
        for pos in range(k):
            out[3].labels(n, str(pos))
        return out

    def record_stats(self, s) -> None:
        n = self.name
        sd = getattr(s, "spec_decoding", None)
        if sd is not None and self.spec is not None:
            drafts, tokens, accepted, per_pos = self.spec
            drafts.labels(n).inc(sd.num_drafts)
            tokens.labels(n).inc(sd.num_draft_tokens)
            accepted.labels(n).inc(sd.num_accepted_tokens)
            for pos, v in enumerate(sd.num_accepted_tokens_per_pos):
                per_pos.labels(n, str(pos)).inc(v)
        self.running.labels(n).set(s.num_running)
        self.waiting.labels(n).set(s.num_waiting)
        self.kv_usage.labels(n).set(s.kv_cache_usage)
        if s.prefix_cache_queries:
            self.pc_queries.labels(n).inc(s.prefix_cache_queries)
        if s.prefix_cache_hits:
            self.pc_hits.labels(n).inc(s.prefix_cache_hits)
        if s.num_preemptions:
            self.preemptions.labels(n).inc(s.num_preemptions)
        for k, v in (getattr(s, "kv_transfer", None) or {}).items():
            if k in self.kv_transfer and v:
                self.kv_transfer[k].labels(n).inc(v)
        for k, v in (s.extra or {}).items():
            if k not in self.extra:
                self.extra[k] = Gauge(f"vllm:{k}", k, ["model_name"], registry=self.registry)
            self.extra[k].labels(n).set(v)

    def record_arrival(self, st) -> None:
        st.arrival = time.monotonic()

    def record_finished(self, st) -> None:
        n = self.name
        self.prompt_tokens.labels(n).inc(len(st.prompt_token_ids))
        self.gen_tokens.labels(n).inc(len(st.output_ids))
        self.success.labels(n, st.finish_reason or "abort").inc()
        now = time.monotonic()
        self.e2e.labels(n).observe(now - st.arrival)
        if st.first_token_time is not None:
            self.ttft.labels(n).observe(st.first_token_time - st.arrival)
            k = len(st.output_ids)
            if k > 1 and st.last_token_time is not None:
                per = (st.last_token_time - st.first_token_time) / (k - 1)
                self.tpot.labels(n).observe(per)
        for x in st.itls:
            self.itl.labels(n).observe(x)

    def render(self) -> bytes:
        return generate_latest(self.registry)
