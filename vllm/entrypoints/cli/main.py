"""`vllm` — the command line.

vllm serve [MODEL] [flags]        OpenAI-compatible server (MODEL defaults to the built-in tiny GLM-5.3)
vllm tiny-checkpoint DIR [--fp8] [--slice]  write the built-in tiny checkpoint (or the
                                  GLM-5.3-shaped slice) as an HF folder, FP8 block-quantised or not
vllm plan [MODEL] [flags]         capacity / cost model of a deployment
"""

from __future__ import annotations

import argparse
import sys


def _serve_parser(sub) -> None:
    from vllm.entrypoints.openai.cli_args import add_serve_args

    p = sub.add_parser(
        "serve",
        help="start the OpenAI-compatible server",
        description="Serve a GLM-5.3-family checkpoint over the OpenAI API.",
    )
    add_serve_args(p)
    p.set_defaults(func=_serve)


def _serve(args) -> int:
    from vllm.entrypoints.openai.api_server import run_server

    if args.model_flag:
        args.model = args.model_flag
    return run_server(args)


def _tiny_parser(sub) -> None:
    p = sub.add_parser(
        "tiny-checkpoint", help="write the built-in tiny GLM-5.3-architecture checkpoint"
    )
    p.add_argument("output", help="folder to write (config.json, safetensors, tokenizer)")
    p.add_argument(
        "--fp8", action="store_true", help="store linear weights as FP8 e4m3 with 128x128 scales"
    )
    p.add_argument(
        "--slice",
        action="store_true",
        help="the GLM-5.3-shaped slice instead (real attention and indexer dimensions, hidden "
        "1024, 4 layers, 4 experts; for GPU tests and benchmarks)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_tiny)


def _tiny(args) -> int:
    from vllm.model_executor.tiny import write_slice_checkpoint, write_tiny_checkpoint

    write = write_slice_checkpoint if args.slice else write_tiny_checkpoint
    path = write(args.output, fp8=args.fp8, seed=args.seed)
    what = "GLM-5.3-shaped slice" if args.slice else "tiny GLM-5.3"
    print(f"wrote {what} checkpoint{' (FP8)' if args.fp8 else ''} to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm", description="vLLM-shaped engine for sparse-MLA GLM-5.3 models"
    )
    parser.add_argument("--version", action="store_true")
    sub = parser.add_subparsers(dest="command")
    _serve_parser(sub)
    _tiny_parser(sub)
    from vllm.entrypoints.cli import plan

    plan.add_parser(sub)
    try:
        from vllm.entrypoints.cli import bench
    except ImportError:
        bench = None
    if bench is not None:
        bench.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from vllm import __version__

        print(__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
