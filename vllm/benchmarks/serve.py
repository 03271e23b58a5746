"""`vllm bench serve`: single-turn load against a running server, upstream vLLM's metric names.

    vllm serve &
    vllm bench serve --random-input-len 256 --random-output-len 32 --num-prompts 64 \
        --max-concurrency 8 --ignore-eos --json

Prompts are random token ids (`--dataset-name random`, lengths drawn from
[len * (1 - ratio), len * (1 + ratio)]; `fixed` forces ratio 0), sent to /v1/completions with
streaming. Arrivals follow `--request-rate` (gamma with `--burstiness`, Poisson at 1; inf sends
everything at once) under `--max-concurrency`. Each request runs in a worker thread with the
stdlib HTTP client, so the benchmark adds no dependency to the engine.

Metrics are named as upstream's `vllm bench serve`: request_throughput, output_throughput,
total_token_throughput, {mean,median,std,pNN}_{ttft,tpot,itl,e2el}_ms, ...; TPOT is
(latency - TTFT) / (output tokens - 1), ITL the gaps between streamed chunks.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime

from vllm.benchmarks import BenchmarkError

_MAX_WORKERS = 512
_METRIC_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="server URL (default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer folder (default: the model's folder)"
    )
    p.add_argument("--dataset-name", choices=["random", "fixed"], default="random")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-prefix-len", type=int, default=0, help="shared prefix tokens")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    p.add_argument("--metric-percentiles", default="99")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.add_argument(
        "--save-result", action="store_true", help="also write the result (with per-request lists)"
    )
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename", default=None)


@dataclass
class RequestOutput:
    prompt_len: int
    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)
    error: str = ""


def _sample_requests(args, vocab: list[int]) -> list[tuple[list[int], int]]:
    ratio = 0.0 if args.dataset_name == "fixed" else args.random_range_ratio
    if not 0.0 <= ratio < 1.0:
        raise BenchmarkError("--random-range-ratio must be in [0, 1)")
    if args.random_input_len < 1 or args.random_output_len < 1 or args.num_prompts < 1:
        raise BenchmarkError("--random-input-len, --random-output-len, --num-prompts must be >= 1")
    rng = random.Random(args.seed)

    def draw(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - ratio)), int(n * (1 + ratio))))

    prefix = [rng.choice(vocab) for _ in range(args.random_prefix_len)]
    return [
        (
            prefix + [rng.choice(vocab) for _ in range(draw(args.random_input_len))],
            draw(args.random_output_len),
        )
        for _ in range(args.num_prompts)
    ]


def _vocab(tokenizer_dir: str) -> list[int]:
    from tokenizers import Tokenizer

    path = os.path.join(tokenizer_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise BenchmarkError(f"tokenizer {tokenizer_dir!r}: no tokenizer.json (pass --tokenizer)")
    tok = Tokenizer.from_file(path)
    special = (
        set(tok.get_added_tokens_decoder()) if hasattr(tok, "get_added_tokens_decoder") else set()
    )
    return [i for i in range(tok.get_vocab_size()) if i not in special]


def _get_json(base: urllib.parse.SplitResult, path: str) -> dict:
    conn = http.client.HTTPConnection(base.hostname, base.port or 80, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return json.loads(resp.read())
    finally:
        conn.close()


_SPEC = "vllm:spec_decode_"


def _spec_counters(base: urllib.parse.SplitResult) -> dict[str, float]:
    """The server's speculative-decoding counters (empty without --speculative-config):
    drafts, draft tokens, accepted tokens, accepted per position, the synthetic mode's length."""
    conn = http.client.HTTPConnection(base.hostname, base.port or 80, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    except (OSError, http.client.HTTPException):
        return {}
    finally:
        conn.close()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(_SPEC):
            continue
        name, _, value = line.rpartition(" ")
        key = name[len(_SPEC) :].split("{")[0]
        if key.endswith("_created"):  # the client library's creation timestamps
            continue
        key = key.removesuffix("_total")
        if key == "num_accepted_tokens_per_pos":
            key += "/" + name.split('position="')[1].split('"')[0]
        out[key] = out.get(key, 0.0) + float(value)  # summed over DP replicas' series
    return out


def _spec_result(before: dict, after: dict) -> dict:
    """Acceptance over the run, upstream's fields: rate (accepted / drafted tokens), length
    (1 + accepted / drafts: tokens a verification step emits), per-position rates."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    drafts, tokens = d.get("num_drafts", 0.0), d.get("num_draft_tokens", 0.0)
    if not drafts:
        return {}
    accepted = d.get("num_accepted_tokens", 0.0)
    per_pos = sorted(
        (int(k.split("/")[1]), v) for k, v in d.items() if k.startswith("num_accepted_tokens_per")
    )
    r = {
        "spec_decode_acceptance_rate": 100.0 * accepted / tokens if tokens else 0.0,
        "spec_decode_acceptance_length": 1.0 + accepted / drafts,
        "spec_decode_num_drafts": int(drafts),
        "spec_decode_draft_tokens": int(tokens),
        "spec_decode_accepted_tokens": int(accepted),
        "spec_decode_per_position_acceptance_rate": [v / drafts for _, v in per_pos],
    }
    if after.get("synthetic_acceptance_length"):
        r["spec_decode_synthetic_acceptance_length"] = after["synthetic_acceptance_length"]
    return r


def _send(base, path: str, body: dict, out: RequestOutput, timeout: float) -> None:
    conn = http.client.HTTPConnection(base.hostname, base.port or 80, timeout=timeout)
    st = time.perf_counter()
    try:
        conn.request(
            "POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}"
            return
        last = st
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("choices"):
                now = time.perf_counter()
                if not out.chunk_times:
                    out.ttft = now - st
                else:
                    out.itl.append(now - last)
                out.chunk_times.append(now)
                last = now
            if usage := chunk.get("usage"):
                out.output_tokens = usage.get("completion_tokens") or 0
        out.latency = time.perf_counter() - st
        out.output_tokens = out.output_tokens or len(out.chunk_times)
        out.success = bool(out.chunk_times)
        if not out.success:
            out.error = "stream ended without tokens"
    except (OSError, http.client.HTTPException, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def run(args) -> dict:
    base = urllib.parse.urlsplit(args.base_url or f"http://{args.host}:{args.port}")
    if base.scheme != "http" or not base.hostname:
        raise BenchmarkError(f"--base-url {args.base_url!r}: expected http://HOST:PORT")
    if not args.endpoint.endswith("/completions") or "chat" in args.endpoint:
        raise BenchmarkError("--endpoint: only /v1/completions (token-id prompts) is supported")
    try:
        models = _get_json(base, "/v1/models")["data"]
    except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
        raise BenchmarkError(f"no server at {base.geturl()}: {e}") from None
    model = args.model or models[0]["id"]
    tok_dir = args.tokenizer or next((m.get("root") for m in models if m["id"] == model), None)
    if not tok_dir or not os.path.isdir(tok_dir):
        raise BenchmarkError("cannot find the model's tokenizer locally: pass --tokenizer DIR")
    requests = _sample_requests(args, _vocab(tok_dir))
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    selected = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    if bad := [m for m in selected if m not in _METRIC_TITLES]:
        raise BenchmarkError(
            f"--percentile-metrics: unknown {bad} (choose from ttft,tpot,itl,e2el)"
        )

    rng = random.Random(args.seed)
    outputs = [RequestOutput(len(p)) for p, _ in requests]
    lock = threading.Lock()
    in_flight = [0, 0]  # now, peak

    def task(i: int) -> None:
        prompt, max_tokens = requests[i]
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": args.ignore_eos,
        }
        with lock:
            in_flight[0] += 1
            in_flight[1] = max(in_flight)
        try:
            _send(base, args.endpoint, body, outputs[i], args.request_timeout)
        finally:
            with lock:
                in_flight[0] -= 1

    workers = min(args.max_concurrency or _MAX_WORKERS, _MAX_WORKERS, len(requests))
    spec_before = _spec_counters(base)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for i in range(len(requests)):
            pool.submit(task, i)
            if args.request_rate != float("inf") and i + 1 < len(requests):
                theta = 1.0 / (args.request_rate * args.burstiness)
                time.sleep(rng.gammavariate(args.burstiness, theta))
    duration = time.perf_counter() - t0
    result = _metrics(outputs, duration, selected, percentiles, t0)
    if spec_before:
        result.update(_spec_result(spec_before, _spec_counters(base)))
    result.update(
        date=datetime.now().strftime("%Y%m%d-%H%M%S"),
        backend="vllm",
        model_id=model,
        tokenizer_id=tok_dir,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate if args.request_rate != float("inf") else "inf",
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
    )
    return result


def _metrics(outs: list[RequestOutput], duration: float, selected, percentiles, t0: float) -> dict:
    ok = [o for o in outs if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    series = {
        "ttft": [o.ttft for o in ok],
        "tpot": [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1],
        "itl": [x for o in ok for x in o.itl],
        "e2el": [o.latency for o in ok],
    }
    buckets: dict[int, int] = {}
    for o in ok:
        for t in o.chunk_times:
            buckets[int(t - t0)] = buckets.get(int(t - t0), 0) + 1
    r = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(outs) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_output_tokens_per_s": max(buckets.values(), default=0),
    }
    for m in selected:
        xs = [1000.0 * x for x in series[m]]
        r[f"mean_{m}_ms"] = statistics.fmean(xs) if xs else 0.0
        r[f"median_{m}_ms"] = statistics.median(xs) if xs else 0.0
        r[f"std_{m}_ms"] = statistics.pstdev(xs) if xs else 0.0
        for p in percentiles:
            r[f"p{p:g}_{m}_ms"] = _percentile(xs, p)
    r["errors"] = [o.error for o in outs if not o.success]
    r["_series"] = {
        "input_lens": [o.prompt_len for o in outs],
        "output_lens": [o.output_tokens for o in outs],
    }
    r["_series"].update(ttfts=[o.ttft for o in outs], itls=[o.itl for o in outs])
    return r


def _percentile(xs: list[float], p: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    pos = (len(s) - 1) * p / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def print_result(r: dict, selected, percentiles, stream=None) -> None:
    w = (stream or sys.stdout).write
    w("{s:{c}^50}\n".format(s=" Serving Benchmark Result ", c="="))
    rows = [
        ("Successful requests:", r["completed"]),
        ("Failed requests:", r["failed"]),
        ("Maximum request concurrency:", r["max_concurrency"]),
        ("Benchmark duration (s):", r["duration"]),
        ("Total input tokens:", r["total_input_tokens"]),
        ("Total generated tokens:", r["total_output_tokens"]),
        ("Request throughput (req/s):", r["request_throughput"]),
        ("Output token throughput (tok/s):", r["output_throughput"]),
        ("Peak output token throughput (tok/s):", r["max_output_tokens_per_s"]),
        ("Total Token throughput (tok/s):", r["total_token_throughput"]),
    ]
    for label, v in rows:
        w(f"{label:<40} {v:<10.2f}\n" if isinstance(v, float) else f"{label:<40} {v!s:<10}\n")
    for m in selected:
        title, short = _METRIC_TITLES[m]
        w("{s:{c}^50}\n".format(s=title, c="-"))
        w(f"{'Mean ' + short + ' (ms):':<40} {r[f'mean_{m}_ms']:<10.2f}\n")
        w(f"{'Median ' + short + ' (ms):':<40} {r[f'median_{m}_ms']:<10.2f}\n")
        for p in percentiles:
            w(f"{f'P{p:g} {short} (ms):':<40} {r[f'p{p:g}_{m}_ms']:<10.2f}\n")
    if "spec_decode_acceptance_length" in r:
        w("{s:{c}^50}\n".format(s="Speculative Decoding", c="-"))
        synth = r.get("spec_decode_synthetic_acceptance_length")
        if synth:
            w(f"SYNTHETIC acceptance (fixed mean length {synth:.2f}): not the model's drafts\n")
        w(f"{'Acceptance rate (%):':<40} {r['spec_decode_acceptance_rate']:<10.2f}\n")
        w(f"{'Acceptance length:':<40} {r['spec_decode_acceptance_length']:<10.2f}\n")
        w(f"{'Drafts:':<40} {r['spec_decode_num_drafts']:<10}\n")
        w(f"{'Draft tokens:':<40} {r['spec_decode_draft_tokens']:<10}\n")
        w(f"{'Accepted tokens:':<40} {r['spec_decode_accepted_tokens']:<10}\n")
        rates = ", ".join(f"{x:.2f}" for x in r["spec_decode_per_position_acceptance_rate"])
        w(f"{'Per-position acceptance rate:':<40} {rates}\n")
    w("=" * 50 + "\n")


def main(args: argparse.Namespace) -> int:
    r = run(args)
    series = r.pop("_series")
    selected = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    if args.save_result:
        name = args.result_filename or f"vllm-{r['request_rate']}qps-{r['date']}.json"
        path = os.path.join(args.result_dir, name)
        os.makedirs(args.result_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump({**r, **series}, f, indent=2)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print_result(r, selected, percentiles)
    if r["completed"] == 0:
        first = r["errors"][0] if r["errors"] else "no request completed"
        print(f"error: every request failed: {first}", file=sys.stderr)
        return 1
    return 0
