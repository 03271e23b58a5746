"""The arguments of `vllm serve`: the model, the engine's flags, the server's flags. Shared by the
command line and the benchmark runners that validate a serve command before launching it."""

from __future__ import annotations

import argparse

from vllm.engine.arg_utils import DEFAULT_MODEL, add_engine_args


def add_serve_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from vllm.entrypoints.openai.api_server import add_server_args

    p.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        help=f"HF checkpoint folder (default: {DEFAULT_MODEL}, the built-in tiny checkpoint)",
    )
    p.add_argument("--model", dest="model_flag", default=None, help="same as the positional MODEL")
    add_engine_args(p)
    add_server_args(p)
    return p


def make_serve_parser(prog: str = "vllm serve") -> argparse.ArgumentParser:
    """A standalone parser of `vllm serve`'s arguments (everything after `serve`)."""
    return add_serve_args(argparse.ArgumentParser(prog=prog))
