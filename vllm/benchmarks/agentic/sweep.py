"""`vllm bench agentic`: server configurations x concurrency levels, each level a fresh server
driven by the real AgentX harness; results as JSON, CSV and a Pareto PNG.

    vllm bench agentic --config plain='vllm serve' \
        --config pcp2dcp2='vllm serve -pcp 2 -dcp 2 --enable-expert-parallel' \
        --concurrency 1,2,4,8 --duration 60 --output-dir out/agentic

A level whose server does not come up, whose harness fails, or with more than 10 % failed requests
is reported in its row (`status`, `message`) and the sweep goes on; the exit code is then 1.
Bad input (a missing trace folder, an unparsable serve command, no harness) stops the run before
any server starts, with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone

from vllm.benchmarks import BenchmarkError
from vllm.benchmarks.agentic import harness, results, traces
from vllm.benchmarks.agentic.server import (
    ServeConfig,
    ServerError,
    ServerProcess,
    parse_serve_config,
)

DEFAULT_MOONCAKE = "benchmarks/agentic/data/mooncake_conversation_head.jsonl"


def add_cli_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server configurations")
    g.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME=COMMAND",
        help="a named configuration: a 'vllm serve ...' command line without --port/--host "
        "(repeatable; default: plain='vllm serve')",
    )
    g.add_argument(
        "--config-file",
        help='JSON list of {"name", "command", "num_gpus"} objects (or a {name: command} map)',
    )
    g.add_argument(
        "--num-gpus",
        type=int,
        default=None,
        help="GPUs per configuration for per-GPU throughput (default: the ranks each command "
        "starts, DP x PP x PCP x TP)",
    )
    g.add_argument(
        "--server-timeout", type=float, default=600.0, help="seconds to wait for /health"
    )

    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=["agentx", "mooncake"], default="agentx")
    w.add_argument(
        "--trace-dir", help="replay these weka_trace session files instead of synthesising"
    )
    w.add_argument(
        "--shape",
        choices=sorted(traces.SHAPES),
        default=None,
        help="synthetic session shape (default: agentx on CUDA, cpu otherwise)",
    )
    w.add_argument("--sessions", type=int, default=16, help="synthetic sessions (default 16)")
    w.add_argument("--token-scale", type=float, default=1.0, help="x input lengths of the shape")
    w.add_argument(
        "--output-scale", type=float, default=None, help="x output lengths (default: token scale)"
    )
    w.add_argument("--turn-scale", type=float, default=1.0, help="x turns per session")
    w.add_argument("--time-scale", type=float, default=1.0, help="x think times")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument(
        "--mooncake-trace", default=None, help=f"Mooncake JSONL (default: {DEFAULT_MOONCAKE})"
    )
    w.add_argument("--mooncake-requests", type=int, default=400, help="first N requests of it")
    w.add_argument(
        "--mooncake-block-size",
        type=int,
        default=64,
        help="tokens per 512-token Mooncake block after scaling (default 64, one engine KV block)",
    )
    w.add_argument(
        "--synth-only", action="store_true", help="write the traces, print their statistics, stop"
    )

    h = p.add_argument_group("harness")
    h.add_argument(
        "--concurrency", default="1,2,4,8", help="comma-separated levels (default 1,2,4,8)"
    )
    h.add_argument("--duration", type=float, default=60.0, help="profiled seconds per level")
    h.add_argument(
        "--warmup-requests-per-lane",
        type=int,
        default=None,
        help="harness warm-up (default: its own, 10)",
    )
    h.add_argument(
        "--agentx-bin", default=None, help=f"agentx executable (or ${harness.AGENTX_BIN_ENV})"
    )
    h.add_argument(
        "--tokenizer", default=None, help="tokenizer folder (default: the served model's folder)"
    )
    h.add_argument(
        "--harness-arg",
        action="append",
        default=[],
        help="extra argument for agentx profile (repeatable)",
    )
    h.add_argument("--max-error-rate", type=float, default=0.10)
    p.add_argument("--output-dir", default=None, help="default: agentic-results/<UTC time>")


def _configs(args) -> list[ServeConfig]:
    specs: list[tuple[str, str, int | None]] = []
    if args.config_file:
        try:
            with open(args.config_file) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise BenchmarkError(f"--config-file {args.config_file!r}: {e}") from None
        items = data.items() if isinstance(data, dict) else [(None, d) for d in data]
        for name, d in items:
            if isinstance(d, str):
                specs.append((name, d, args.num_gpus))
            elif isinstance(d, dict) and "name" in d and "command" in d:
                specs.append((d["name"], d["command"], d.get("num_gpus", args.num_gpus)))
            else:
                raise BenchmarkError(f"--config-file: bad entry {d!r}")
    for i, spec in enumerate(args.config):
        name, sep, cmd = spec.partition("=")
        if not sep or not cmd.strip().startswith("vllm"):
            name, cmd = f"config{i}", spec
        specs.append((name.strip(), cmd, args.num_gpus))
    if not specs:
        specs = [("plain", "vllm serve", args.num_gpus)]
    names = [s[0] for s in specs]
    if len(set(names)) != len(names):
        raise BenchmarkError(f"configuration names must be unique, got {names}")
    return [parse_serve_config(n, c, g) for n, c, g in specs]


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchmarkError(f"--concurrency {text!r}: expected e.g. 1,2,4,8") from None
    if not levels or min(levels) < 1:
        raise BenchmarkError(f"--concurrency {text!r}: levels must be >= 1")
    return levels


def _prepare_workload(args, out_dir: str) -> tuple[harness.Workload, dict]:
    if args.workload == "mooncake":
        src = args.mooncake_trace or str(harness.repo_root() / DEFAULT_MOONCAKE)
        dst = os.path.join(out_dir, "traces", "mooncake.jsonl")
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        n = traces.scale_mooncake(
            src, dst, max_requests=args.mooncake_requests, block_to=args.mooncake_block_size
        )
        info = {
            "kind": "mooncake",
            "source": src,
            "requests": n,
            "block_size": args.mooncake_block_size,
        }
        return harness.Workload("mooncake", dst, args.mooncake_block_size), info
    if args.trace_dir:
        if not os.path.isdir(args.trace_dir):
            raise BenchmarkError(f"--trace-dir {args.trace_dir!r}: no such folder")
        sessions = traces.load_sessions(args.trace_dir)
        if not sessions:
            raise BenchmarkError(f"--trace-dir {args.trace_dir!r}: no *.json session files in it")
        info = {"kind": "agentx", "trace_dir": os.path.abspath(args.trace_dir)}
        trace_dir = args.trace_dir
    else:
        shape_name = args.shape or _default_shape()
        shape = traces.get_shape(shape_name).scaled(
            tokens=args.token_scale,
            outputs=args.output_scale,
            turns=args.turn_scale,
            time=args.time_scale,
        )
        trace_dir = os.path.join(out_dir, "traces")
        traces.synthesize(trace_dir, shape, args.sessions, seed=args.seed)
        sessions = traces.load_sessions(trace_dir)
        info = {
            "kind": "agentx",
            "shape": shape_name,
            "seed": args.seed,
            "trace_shape": vars_of(shape),
        }
        info["scales"] = {
            "tokens": args.token_scale,
            "outputs": args.output_scale,
            "turns": args.turn_scale,
            "time": args.time_scale,
        }
    info["summary"] = traces.summarize(sessions)
    return harness.Workload("agentx", os.path.abspath(trace_dir)), info


def vars_of(shape) -> dict:
    import dataclasses

    return dataclasses.asdict(shape)


def _default_shape() -> str:
    import torch

    return "agentx" if torch.cuda.is_available() else "cpu"


def _tokenizer_dir(args, cfg: ServeConfig) -> str:
    if args.tokenizer:
        return args.tokenizer
    if cfg.tokenizer:
        return cfg.tokenizer
    from vllm.engine.arg_utils import EngineArgs

    try:
        return EngineArgs(model=cfg.model).resolve_model_path()
    except ValueError as e:
        raise BenchmarkError(f"configuration {cfg.name!r}: {e}") from None


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=12"],
            cwd=harness.repo_root(),
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    info = {"host": platform.node(), "cpu": cpu, "cpu_count": os.cpu_count(), "gpus": []}
    try:
        import torch

        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    return info


class Progress:
    """One status line (redrawn on a terminal, printed every 15 s otherwise) plus event lines."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.monotonic()
        self._last = 0.0
        self._drawn = False

    def _clock(self) -> str:
        s = int(time.monotonic() - self.t0)
        return f"{s // 60:02d}:{s % 60:02d}"

    def event(self, msg: str) -> None:
        if self._drawn:
            self.stream.write("\r\033[K")
            self._drawn = False
        self.stream.write(f"[{self._clock()}] {msg}\n")
        self.stream.flush()

    def status(self, msg: str) -> None:
        now = time.monotonic()
        if self.tty:
            self.stream.write(f"\r\033[K[{self._clock()}] {msg}")
            self._drawn = True
        elif now - self._last >= 15.0:
            self.stream.write(f"[{self._clock()}] {msg}\n")
            self._last = now
        self.stream.flush()


class _Sweep:
    def __init__(self, args, configs, levels, workload, agentx, out_dir, meta):
        self.args, self.configs, self.levels = args, configs, levels
        self.workload, self.agentx, self.out_dir, self.meta = workload, agentx, out_dir, meta
        self.hf_home = os.path.join(out_dir, "hf_home")
        self.env = harness.harness_env(self.hf_home)
        self.progress = Progress()
        self.rows: list[dict] = []
        self._tokenizers: dict[str, str] = {}

    def tokenizer(self, cfg: ServeConfig) -> str:
        path = _tokenizer_dir(self.args, cfg)
        if path not in self._tokenizers:
            name = os.path.basename(os.path.normpath(path))
            self._tokenizers[path] = harness.prepare_tokenizer(path, self.hf_home, name)
        return self._tokenizers[path]

    def run(self) -> list[dict]:
        total = len(self.configs) * len(self.levels)
        for cfg in self.configs:
            tok = self.tokenizer(cfg)
            for c in self.levels:
                tag = f"[{len(self.rows) + 1}/{total}] {cfg.name} c{c}"
                row = self.run_level(cfg, c, tok, tag)
                self.rows.append(row)
                self.write()
                if row["status"] == "ok":
                    self.progress.event(
                        f"{tag}: {row['requests']} requests, {row['throughput_per_gpu']:.1f} tok/s/GPU, "
                        f"P90 interactivity {_fmt(row['interactivity_p90'])} tok/s/user, "
                        f"TTFT p50 {_fmt(row['ttft_median_ms'])} ms, cache hit {_pct(row['prefix_cache_hit_rate'])}"
                        f" (with the host tier {_pct(row['total_prefix_hit_rate'])})"
                    )
                else:
                    self.progress.event(f"{tag}: FAILED ({row['status']}): {row['message']}")
        return self.rows

    def run_level(self, cfg: ServeConfig, c: int, tok: str, tag: str) -> dict:
        level_dir = os.path.join(self.out_dir, cfg.name, f"c{c}")
        os.makedirs(level_dir, exist_ok=True)
        artifact_dir = os.path.join(level_dir, "agentx")
        row = {
            "config": cfg.name,
            "concurrency": c,
            "num_gpus": cfg.num_gpus,
            "status": "ok",
            "message": "",
        }
        row["artifact_dir"] = os.path.relpath(level_dir, self.out_dir)
        server = ServerProcess(cfg, os.path.join(level_dir, "server.log"))
        self.progress.status(f"{tag}: starting server ({cfg.command})")
        try:
            try:
                row["server_startup_s"] = server.start(self.args.server_timeout)
            except ServerError as e:
                row.update(status="server_failed", message=f"{e} (log: {server.log_path})")
                return row
            before = server.metrics()
            cmd = harness.build_command(
                self.agentx,
                url=server.url,
                model=server.served_model(),
                tokenizer=tok,
                workload=self.workload,
                concurrency=c,
                duration=self.args.duration,
                artifact_dir=artifact_dir,
                seed=self.args.seed,
                warmup_per_lane=self.args.warmup_requests_per_lane,
                allow_wrap=self._num_sessions() < c,
                extra=self.args.harness_arg,
            )
            dur = self.args.duration

            def show(p: harness.HarnessProgress) -> None:
                s = time.monotonic() - p.phase_t0
                of = f"/{dur:.0f}" if p.phase == "profiling" else ""
                self.progress.status(
                    f"{tag}: {p.phase} {s:.0f}{of} s, done={p.done} err={p.errors}"
                )

            rc, prog = harness.run_harness(
                cmd,
                self.env,
                os.path.join(level_dir, "harness.log"),
                show,
                timeout=self.args.duration * 2 + self.args.server_timeout + 900,
            )
            alive = server.proc.poll() is None
            after = server.metrics() if alive else {}
        except (OSError, ValueError, KeyError) as e:  # /v1/models or /metrics unreadable
            row.update(status="harness_failed", message=f"{type(e).__name__}: {e}")
            return row
        finally:
            server.stop()
        records = harness.read_records(artifact_dir)
        row.update(
            results.level_metrics(
                records,
                before,
                after,
                harness.read_profiling_server_metrics(artifact_dir),
                cfg.num_gpus,
            )
        )
        notes = [] if alive else [f"server died during the run: {server.log_tail(1)}"]
        if not records:
            row["status"] = "harness_failed"
            notes.insert(
                0, f"agentx exited with code {rc} without profiled requests: {prog.error_hint()}"
            )
        elif row["error_rate"] > self.args.max_error_rate:
            row["status"] = "too_many_errors"
            first = next((r["error"] for r in records if r.get("error")), {})
            notes.insert(
                0,
                f"{row['errors']}/{row['requests']} requests failed "
                f"({row['error_rate']:.0%} > {self.args.max_error_rate:.0%}): "
                f"{str(first.get('message', first))[:200]}",
            )
        elif rc != 0:
            notes.append(f"agentx exited with code {rc}: {prog.error_hint()}")
        row["message"] = "; ".join(notes)
        return row

    def _num_sessions(self) -> int:
        if self.workload.kind != "agentx":
            return 1 << 30
        return len([f for f in os.listdir(self.workload.input_path) if f.endswith(".json")])

    def write(self) -> None:
        results.write_json(os.path.join(self.out_dir, "results.json"), self.meta, self.rows)
        results.write_csv(os.path.join(self.out_dir, "results.csv"), self.rows)


def _fmt(v, nd: int = 1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def print_table(rows: list[dict], stream=None) -> None:
    stream = stream or sys.stdout
    head = (
        "config",
        "c",
        "status",
        "req",
        "err",
        "tok/s/GPU",
        "intvty p90",
        "TTFT p50",
        "TTFT p90",
        "ITL mean",
        "cache hit",
        "+host hit",
    )
    lines = [head]
    for r in rows:
        lines.append(
            (
                r["config"],
                str(r["concurrency"]),
                r["status"],
                str(r.get("requests", "-")),
                str(r.get("errors", "-")),
                _fmt(r.get("throughput_per_gpu")),
                _fmt(r.get("interactivity_p90"), 2),
                _fmt(r.get("ttft_median_ms"), 0),
                _fmt(r.get("ttft_p90_ms"), 0),
                _fmt(r.get("itl_mean_ms"), 1),
                _pct(r.get("prefix_cache_hit_rate")),
                _pct(
                    r.get("total_prefix_hit_rate")
                    if r.get("external_prefix_cache_hit_rate")
                    else None
                ),
            )
        )
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    for ln in lines:
        stream.write(
            "  ".join(
                x.rjust(w) if i > 2 else x.ljust(w)
                for i, (x, w) in enumerate(zip(ln, widths, strict=False))
            )
            + "\n"
        )


def main(args: argparse.Namespace) -> int:
    configs = _configs(args)
    levels = _levels(args.concurrency)
    if args.duration <= 0:
        raise BenchmarkError("--duration must be > 0")
    stamp = datetime.now(timezone.utc)
    out_dir = os.path.abspath(
        args.output_dir or os.path.join("agentic-results", stamp.strftime("%Y%m%d-%H%M%S"))
    )
    os.makedirs(out_dir, exist_ok=True)
    workload, info = _prepare_workload(args, out_dir)
    print(f"workload: {json.dumps(info.get('summary', info))}", file=sys.stderr)
    if args.synth_only:
        print(json.dumps(info, indent=2))
        return 0
    agentx = harness.find_agentx(args.agentx_bin)
    meta = {
        "date": stamp.isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "machine": _machine(),
        "command": "vllm " + shlex.join(sys.argv[1:]),
        "agentx": agentx,
        "agentx_version": _agentx_version(agentx),
        "workload": info,
        "configs": [
            {"name": c.name, "command": c.command, "num_gpus": c.num_gpus} for c in configs
        ],
        "concurrency": levels,
        "duration_s": args.duration,
    }
    # SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C, so the level's server and harness stop.
    signal.signal(signal.SIGTERM, _interrupt)
    sweep = _Sweep(args, configs, levels, workload, agentx, out_dir, meta)
    sweep.progress.event(
        f"{len(configs)} configuration(s) x {len(levels)} level(s), {args.duration:g} s each -> {out_dir}"
    )
    rows = sweep.run()
    title = f"{info['kind']} workload, {_machine_label(meta['machine'])}, {meta['git_commit']}"
    png = os.path.join(out_dir, "pareto.png")
    if not results.plot_pareto(png, rows, title):
        print("warning: matplotlib is not installed; no pareto.png", file=sys.stderr)
    print_table(rows)
    print(f"results: {out_dir}/results.json, results.csv, pareto.png")
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        what = "all levels" if len(failed) == len(rows) else f"{len(failed)} of {len(rows)} levels"
        print(f"error: {what} failed:", file=sys.stderr)
        for r in failed:
            print(
                f"  {r['config']} c{r['concurrency']}: {r['status']}: {r['message']}",
                file=sys.stderr,
            )
        return 1
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _agentx_version(agentx: str) -> str:
    try:
        out = subprocess.run([agentx, "--version"], capture_output=True, text=True, timeout=120)
        return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def _machine_label(m: dict) -> str:
    return f"{len(m['gpus'])}x {m['gpus'][0]}" if m["gpus"] else f"{m['cpu_count']}-core CPU"
