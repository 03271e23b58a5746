"""Triton kernels compiled before they are needed, and compiles that happen anyway reported.

Triton compiles a kernel at its first launch for each *specialisation*: the constexprs, the launch
options, the arguments' types, and for every integer or pointer argument not marked
``do_not_specialize`` whether it is 1 or a multiple of 16. Inside a server a first launch is a
stall of the whole step (0.2–1 s per variant on a host CPU), felt by every request in it. So the
kernels whose variants follow a request's context (the indexer's top-k) list them
(``*_compile_plan``), a worker compiles the list at start-up (:func:`precompile`, without
launching anything: no memory, no state), and :class:`CompileWatch` logs every compile that still
happens while serving, with its kernel, its constexprs and its time.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from vllm.utils import logger

Launch = tuple  # (kernel, args, kwargs); a tensor argument may be given as its torch dtype
_OPTIONS = frozenset(("num_warps", "num_stages", "num_ctas", "maxnreg"))


def _dns(kernel, attr: str) -> set:
    v = getattr(kernel, attr, None)
    if v is None:  # the interpreter's kernels keep the decorator's arguments
        v = getattr(kernel, "kwargs", {}).get(attr)
    return set(v or ())


def jit_key(kernel, args: tuple, kwargs: dict) -> tuple:
    """The specialisation Triton's launcher keys its compiled kernels on, for a launch with these
    arguments (computed as its binder computes it, on any device): one entry per parameter —
    ``("constexpr", value)``, or the argument's type and its class ("D": a multiple of 16, or a
    16-byte aligned pointer; ints equal to 1 become constexprs) unless the parameter is not
    specialised — then the launch options."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import MockTensor

    fn = kernel.fn
    dns, dns_align = (
        _dns(kernel, "do_not_specialize"),
        _dns(kernel, "do_not_specialize_on_alignment"),
    )
    params = list(inspect.signature(fn).parameters.items())
    if len(args) > len(params):
        raise TypeError(f"{fn.__name__}: {len(args)} arguments for {len(params)} parameters")
    spec = []
    for i, (name, p) in enumerate(params):
        if i < len(args):
            v = args[i]
        elif name in kwargs:
            v = kwargs[name]
        elif p.default is not inspect.Parameter.empty:
            v = p.default
        else:
            raise TypeError(f"{fn.__name__}: no value for {name}")
        if "constexpr" in str(p.annotation):
            spec.append(("constexpr", v))
            continue
        specialize = not (i in dns or name in dns)
        align = not (i in dns_align or name in dns_align)
        v = MockTensor.wrap_dtype(v)
        spec.append(tuple(native_specialize_impl(BaseBackend, v, False, specialize, align)))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k in _OPTIONS))
    return fn.__name__, tuple(spec), options


def unique_launches(launches: Iterable[Launch]) -> list[Launch]:
    """One launch per distinct :func:`jit_key` (per kernel variant)."""
    out: dict[tuple, Launch] = {}
    for kernel, args, kwargs in launches:
        out.setdefault(jit_key(kernel, args, kwargs), (kernel, args, kwargs))
    return list(out.values())


def precompile(launches: Iterable[Launch], workers: int | None = None) -> tuple[int, float]:
    """Compile every distinct variant among ``launches`` for the current CUDA device without
    launching it (``kernel.warmup``), on ``workers`` threads where Triton compiles asynchronously
    (Triton's disk cache makes later start-ups cheap). Returns (variants, seconds)."""
    todo = unique_launches(launches)
    if not todo or not torch.cuda.is_available():
        return 0, 0.0
    t0 = time.perf_counter()
    workers = workers or min(8, os.cpu_count() or 1)
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # an older Triton: one after the other
        AsyncCompileMode = None
    if AsyncCompileMode is not None and workers > 1:
        try:
            with ThreadPoolExecutor(workers) as pool, AsyncCompileMode(pool):
                for kernel, args, kwargs in todo:
                    kernel.warmup(*args, grid=(1,), **kwargs)
            return len(todo), time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - compiled again below, one after the other
            logger.warning("parallel Triton compile failed (%s); compiling one by one", e)
    for kernel, args, kwargs in todo:  # variants already compiled are found in the cache
        kernel.warmup(*args, grid=(1,), **kwargs)
    return len(todo), time.perf_counter() - t0


class CompileWatch:
    """Counts (and logs) the Triton compiles that happen after :meth:`start`: a server's warm-up
    should have compiled everything, so each one is a stall inside a request. Chains any hooks
    already installed; :meth:`stop` restores them."""

    def __init__(self):
        self.compiles: list[tuple[str, float]] = []  # (kernel and constexprs, seconds)
        self._t0: dict[str, float] = {}
        self._prev = None
        self.active = False

    def start(self) -> CompileWatch:
        try:
            from triton import knobs
        except ImportError:
            return self
        rt = knobs.runtime
        self._prev = (rt.jit_cache_hook, rt.jit_post_compile_hook)
        prev_pre, prev_post = self._prev

        def pre(**kw):
            self._t0[kw["key"]] = time.perf_counter()
            return prev_pre(**kw) if prev_pre is not None else None

        def post(**kw):
            t = time.perf_counter() - self._t0.pop(kw["key"], time.perf_counter())
            if not kw.get("is_manual_warmup"):
                self._record(kw["fn"], kw["compile"], t)
            return prev_post(**kw) if prev_post is not None else None

        rt.jit_cache_hook, rt.jit_post_compile_hook = pre, post
        self.active = True
        return self

    def _record(self, fn, info, seconds: float) -> None:
        consts = {}
        try:
            names = list(fn.jit_function.arg_names)
            consts = {names[k[0]]: v for k, v in (info.get("constants") or {}).items()}
        except Exception:  # noqa: BLE001 - the report is best effort; the count is what matters
            pass
        what = f"{fn.name}{consts}"
        self.compiles.append((what, seconds))
        logger.warning(
            "Triton compiled %s while serving (%.2f s inside a step): a shape the start-up "
            "warm-up did not cover",
            what,
            seconds,
        )

    def stop(self) -> None:
        if not self.active:
            return
        from triton import knobs

        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._prev
        self.active = False
