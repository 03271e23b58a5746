"""Time to the first decode token after prefill ends: P/D handoff over NIXL against local prefill.

Starts two `vllm serve` engines on 127.0.0.1 joined by real NIXL (UCX loopback, DRAM on the CPU):
a prefill engine (`kv_role: kv_producer`) and a decode engine (`kv_consumer`; with ``--hisparse``
a HiSparse one, which receives into its host pool). For every prompt length and repetition, with
a fresh random token-id prompt each time:

1. prefill: ``POST /v1/completions`` to the prefill engine with ``max_tokens: 1`` and
   ``kv_transfer_params: {"do_remote_decode": true}`` (what vllm-router sends) -> prefill latency
   and the returned ``kv_transfer_params``;
2. handoff: the same prompt, streamed, to the decode engine with those params -> the time to its
   first token = the time to the first decode token after prefill ends (the NIXL pull, the last
   prompt token's forward, the first sample, HTTP both ways). ``vllm:kv_transfer_recv_bytes_total``
   on its /metrics before and after gives the bytes moved, (prompt tokens - 1) x KV bytes/token;
   bytes / that time is the implied GB/s of the whole handoff;
3. local: the same prompt, streamed, to the decode engine with no params -> its local-prefill
   TTFT. Its greedy text must equal the handoff's.

The table shows medians over ``--repeats`` and local/handoff = local TTFT / TTFT after prefill;
next to it, the DRAM copy ceiling measured in the same run (a torch copy of 1 GiB, as
bench_nixl_transfer.py), so the GB/s has a reference. Every engine runs with
``--no-enable-prefix-caching`` so that step 3 recomputes the prompt step 2 received; each
request's ``cached_tokens`` is recorded (0 for steps 1 and 3; step 2 reports the received
tokens). ``--prefix-caching`` keeps the engines' default, and step 3 then gets a prompt of its own
whose text is not compared. A warm-up round (handshake, first-step costs) runs before the timed
ones. Both engines prefill every prompt, so the run time follows the prefill's, superlinear in
the prompt length on the CPU: the defaults take ~2-3 minutes on 2 cores. Servers' output goes to
``--log-dir`` (a temporary folder unless given); every server is stopped on exit, Ctrl-C and
errors included.

    python benchmarks/kv_transfer/bench_pd_ttft.py                     # tiny model, 1K/2K/4K
    python benchmarks/kv_transfer/bench_pd_ttft.py --tokens 1024 4096 16384   # ~10 min on 2 cores
    python benchmarks/kv_transfer/bench_pd_ttft.py --hisparse --json out.json
    python benchmarks/kv_transfer/bench_pd_ttft.py --slice --tokens 1024 4096
    python benchmarks/kv_transfer/bench_pd_ttft.py --slice --engine-args \
        '--gpu-memory-utilization 0.4'                                 # both engines on one GPU
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import socket
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from vllm.benchmarks.agentic.server import (  # noqa: E402
    ServeConfig,
    ServerError,
    ServerProcess,
)

RECV_BYTES = "vllm:kv_transfer_recv_bytes_total"
FAILED_LOADS = "vllm:kv_transfer_num_failed_loads_total"
WARMUP_TOKENS = 100


class BenchError(RuntimeError):
    """A request failed or the handoff did not do what it should (text, bytes, a failed load)."""


# ---- engines ---------------------------------------------------------------------------------
def side_channel_port() -> int:
    """A free port for a NIXL side channel, below Linux's ephemeral range (32768-60999): there
    the OS hands ports to outgoing connections, which could take it before the engine binds it."""
    for _ in range(100):
        port = random.randint(20000, 32767)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise BenchError("no free port in 20000-32767 for a NIXL side channel")


def engine_args(args, model: str, role: str) -> list[str]:
    kv = {
        "kv_connector": "NixlConnector",
        "kv_role": role,
        "side_channel_port": side_channel_port(),
    }
    # cached_tokens in usage: the proof that no prefill hit a prefix cache
    out = [model, "--kv-transfer-config", json.dumps(kv), "--enable-prompt-tokens-details"]
    if not args.prefix_caching:
        out.append("--no-enable-prefix-caching")
    if role == "kv_consumer" and args.hisparse:
        hs = {"hisparse_config": {"host_pool_gib": args.host_pool_gib}}
        out += ["--attention-config", json.dumps(hs)]
    return out + shlex.split(args.engine_args)


def make_engines(args, model: str, log_dir: str) -> dict[str, ServerProcess]:
    return {
        name: ServerProcess(
            ServeConfig(name, tuple(engine_args(args, model, role))),
            os.path.join(log_dir, f"{name}.log"),
        )
        for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer"))
    }


def start_engines(servers: dict[str, ServerProcess], timeout: float) -> None:
    """Starts them in parallel. Each thread spawns its server at once and then polls /health,
    which ends as soon as the caller stops that server (the caller's ``finally`` does, on an
    error or Ctrl-C), so none is left running."""
    pool = ThreadPoolExecutor(len(servers))
    try:
        futs = [pool.submit(s.start, timeout) for s in servers.values()]
        for f in futs:
            f.result()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


# ---- requests --------------------------------------------------------------------------------
def _post(url: str, body: dict, timeout: float):
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        raise BenchError(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')}") from None


def prefill(server: ServerProcess, model: str, prompt: list[int], timeout: float) -> dict:
    """Non-streamed ``max_tokens: 1`` request with ``do_remote_decode``; latency and params."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    t0 = time.perf_counter()
    with _post(server.url + "/v1/completions", body, timeout) as r:
        resp = json.loads(r.read())
    dt = time.perf_counter() - t0
    params = resp.get("kv_transfer_params")
    if not params or not params.get("do_remote_prefill"):
        raise BenchError(f"the prefill engine returned no usable kv_transfer_params: {resp}")
    cached = resp["usage"]["prompt_tokens_details"]["cached_tokens"]
    return {"ms": dt * 1e3, "params": params, "cached_tokens": cached}


def stream(
    server: ServerProcess, model: str, prompt: list[int], max_tokens: int, timeout: float,
    kv_transfer_params: dict | None = None,
) -> dict:  # fmt: skip
    """Streamed greedy completion: time to the first chunk carrying a token, the text, usage."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    with _post(server.url + "/v1/completions", body, timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise BenchError(f"{server.config.name}: {chunk['error']}")
            if chunk.get("choices"):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(chunk["choices"][0]["text"])
            usage = chunk.get("usage") or usage
    if ttft is None or usage is None:
        raise BenchError(f"{server.config.name}: the stream ended without a token or usage")
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {"ttft_ms": ttft * 1e3, "text": "".join(text), "cached_tokens": cached,
            "completion_tokens": usage["completion_tokens"]}  # fmt: skip


# ---- one measurement -------------------------------------------------------------------------
def measure(args, servers, model: str, n: int, rng: random.Random, vocab: int) -> dict:
    """Steps 1-3 for one fresh prompt of n tokens."""
    prompt = [rng.randrange(20, vocab) for _ in range(n)]
    p, d = servers["prefill"], servers["decode"]
    pre = prefill(p, model, prompt, args.request_timeout)
    before = d.metrics()
    hand = stream(d, model, prompt, args.max_tokens, args.request_timeout, pre["params"])
    after = d.metrics()
    moved = after.get(RECV_BYTES, 0.0) - before.get(RECV_BYTES, 0.0)
    if after.get(FAILED_LOADS, 0.0) > before.get(FAILED_LOADS, 0.0):
        raise BenchError(f"{n} tokens: the decode engine's KV load failed (it recomputed)")
    if moved <= 0:
        raise BenchError(f"{n} tokens: the decode engine received no KV bytes")
    local_prompt = prompt
    if args.prefix_caching:  # the decode engine now holds this prompt's blocks
        local_prompt = [rng.randrange(20, vocab) for _ in range(n)]
    local = stream(d, model, local_prompt, args.max_tokens, args.request_timeout)
    return {
        "prompt_tokens": n,
        "bytes": int(moved),
        "prefill_ms": pre["ms"],
        "handoff_ttft_ms": hand["ttft_ms"],
        "handoff_gbps": moved / (hand["ttft_ms"] / 1e3) / 1e9,
        "local_ttft_ms": local["ttft_ms"],
        "cached_tokens": {
            "prefill": pre["cached_tokens"],
            "handoff": hand["cached_tokens"],
            "local": local["cached_tokens"],
        },
        "handoff_text": hand["text"],
        "local_text": local["text"],
        "texts_compared": local_prompt is prompt,
    }


# ---- reference and report --------------------------------------------------------------------
def copy_ceiling_gbps(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best DRAM copy rate of ``num_bytes`` (bytes copied per second, one direction)."""
    a = torch.empty(num_bytes, dtype=torch.uint8).random_()
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best / 1e9


def summarize(n: int, reps: list[dict]) -> dict:
    med = lambda k: statistics.median(r[k] for r in reps)  # noqa: E731
    row = {k: med(k) for k in ("prefill_ms", "handoff_ttft_ms", "handoff_gbps", "local_ttft_ms")}
    row["prompt_tokens"] = n
    row["bytes"] = reps[0]["bytes"]
    row["bytes_per_token"] = row["bytes"] / (n - 1)
    row["bytes_equal_over_repeats"] = all(r["bytes"] == reps[0]["bytes"] for r in reps)
    row["local_over_handoff"] = row["local_ttft_ms"] / row["handoff_ttft_ms"]
    row["texts_equal"] = all(
        r["handoff_text"] == r["local_text"] for r in reps if r["texts_compared"]
    )
    row["repeats"] = reps
    return row


def print_table(rows: list[dict], ceiling: float, decode_kind: str) -> None:
    print(f"decode engine: {decode_kind}; DRAM copy ceiling (torch, 1 GiB): {ceiling:.2f} GB/s")
    hdr = (f"{'tokens':>7} {'KV MB':>8} {'prefill ms':>10} {'TTFT after prefill ms':>21} "
           f"{'GB/s':>6} {'local TTFT ms':>13} {'local/handoff':>13} {'same text':>9}")  # fmt: skip
    print(hdr)
    for r in rows:
        print(
            f"{r['prompt_tokens']:>7} {r['bytes'] / 1e6:8.2f} {r['prefill_ms']:10.1f} "
            f"{r['handoff_ttft_ms']:21.1f} {r['handoff_gbps']:6.3f} {r['local_ttft_ms']:13.1f} "
            f"{r['local_over_handoff']:13.2f} {'yes' if r['texts_equal'] else 'NO':>9}"
        )


# ---- main ------------------------------------------------------------------------------------
def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: built-in tiny)")
    ap.add_argument("--slice", action="store_true", help="the GLM-5.3-shaped slice checkpoint")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens decoded per request")
    ap.add_argument("--hisparse", action="store_true", help="a HiSparse decode engine")
    ap.add_argument("--host-pool-gib", type=float, default=1.0, help="HiSparse host pool")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="keep the engines' prefix cache on (step 3 then uses its own prompt)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--engine-args",
        default="",
        help="more `vllm serve` flags for both engines, e.g. '--gpu-memory-utilization 0.4' to "
        "share one GPU",
    )
    ap.add_argument("--json", metavar="OUT", default=None)
    ap.add_argument("--log-dir", default=None, help="servers' logs (default: a temporary folder)")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    if args.model and args.slice:
        ap.error("--model and --slice exclude each other")
    if min(args.tokens) < 2:
        ap.error("--tokens: a prompt needs at least 2 tokens (the decode engine computes the last)")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    return args


def resolve_model(args, tmp: str) -> str:
    from vllm.model_executor.tiny import ensure_tiny_checkpoint, write_slice_checkpoint

    if args.model:
        return args.model
    if args.slice:
        return write_slice_checkpoint(os.path.join(tmp, "slice"))
    return ensure_tiny_checkpoint()


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through the finally that stops the servers


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_exit)
    with tempfile.TemporaryDirectory(prefix="bench_pd_ttft_") as tmp:
        log_dir = args.log_dir or tmp
        os.makedirs(log_dir, exist_ok=True)
        model = resolve_model(args, tmp)
        with open(os.path.join(model, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        ceiling = copy_ceiling_gbps()
        servers = make_engines(args, model, log_dir)
        try:
            start_engines(servers, args.startup_timeout)
            rows = run(args, servers, vocab)
        except (ServerError, BenchError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            for name, s in servers.items():
                print(f"--- {name} log tail ---\n{s.log_tail(30)}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("interrupted: stopping the servers", file=sys.stderr)
            return 130
        finally:
            for s in servers.values():
                s.stop()
    kind = "HiSparse" if args.hisparse else "plain"
    print_table(rows, ceiling, kind)
    if args.json:
        rec = {"model": args.model or ("slice" if args.slice else "tiny"), "decode": kind,
               "prefix_caching": args.prefix_caching, "max_tokens": args.max_tokens,
               "repeats": args.repeats, "copy_ceiling_gbps": ceiling, "rows": rows,
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": sys.argv}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(rec, f, indent=1)
    bad = [r["prompt_tokens"] for r in rows if not r["texts_equal"]]
    if bad:
        print(f"FAILED: the handoff's greedy text differs from local prefill's at {bad} tokens")
    return 1 if bad else 0


def run(args, servers, vocab: int) -> list[dict]:
    model = servers["prefill"].served_model()
    rng = random.Random(args.seed)
    measure(args, servers, model, WARMUP_TOKENS, rng, vocab)  # handshake and first-step costs
    rows = []
    for n in args.tokens:
        reps = [measure(args, servers, model, n, rng, vocab) for _ in range(args.repeats)]
        rows.append(summarize(n, reps))
        print(f"  {n} tokens done", file=sys.stderr, flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
