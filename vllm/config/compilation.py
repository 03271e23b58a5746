"""`--compilation-config`: which steps run as CUDA graphs (upstream vLLM's keys and values).

This engine captures *full* CUDA graphs of decode-only steps (one query token per request, no
prefill chunk in the batch) at start-up, for a set of batch sizes; a step of B requests replays the
graph of the smallest captured size >= B with the extra rows padded (they write no KV and their
outputs are dropped). Steps with a prefill chunk, or more requests than the largest size, run
eagerly. Upstream's piecewise capture of mixed batches is not implemented: ``FULL_AND_PIECEWISE``
(upstream's default) and ``FULL_DECODE_ONLY`` both mean "full graphs for decode, eager otherwise";
``PIECEWISE`` and ``FULL`` (which would capture mixed batches) are refused by name.
``--enforce-eager`` (or ``"cudagraph_mode": "NONE"``) runs every step eagerly; so does a CPU run,
unless the flag is given: then the same static-buffer decode path runs there without capture.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.config.flags import parse_json_flag

MODES = ("NONE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
_REFUSED = {
    "PIECEWISE": "piecewise capture of mixed prefill/decode batches is not implemented",
    "FULL": "full graphs of mixed prefill/decode batches are not implemented",
}
_KEYS = ("cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size")


def default_capture_sizes(max_size: int) -> list[int]:
    """Upstream's default list: 1, 2, 4, then every 8 up to 256, then every 16, up to max_size."""
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, max_size + 1, 16))
    return [s for s in sizes if s <= max_size] or [max_size]


@dataclass(frozen=True)
class CompilationConfig:
    cudagraph_mode: str = "FULL_AND_PIECEWISE"
    cudagraph_capture_sizes: tuple[int, ...] = ()  # ascending; empty when mode is NONE

    @property
    def use_cudagraph(self) -> bool:
        return self.cudagraph_mode != "NONE" and bool(self.cudagraph_capture_sizes)

    @property
    def max_capture_size(self) -> int:
        return self.cudagraph_capture_sizes[-1] if self.cudagraph_capture_sizes else 0

    def padded_size(self, num_reqs: int) -> int | None:
        """The captured size a decode batch of ``num_reqs`` replays (None: it runs eagerly)."""
        for s in self.cudagraph_capture_sizes:
            if s >= num_reqs:
                return s
        return None

    @classmethod
    def from_json(cls, value, *, enforce_eager: bool, max_num_seqs: int) -> CompilationConfig:
        raw = parse_json_flag(value, "--compilation-config")
        unknown = set(raw) - set(_KEYS)
        if unknown:
            raise ValueError(
                f"--compilation-config: unknown keys {sorted(unknown)} (known: {list(_KEYS)})"
            )
        mode = raw.get("cudagraph_mode", cls.cudagraph_mode)
        if not isinstance(mode, str) or mode.upper() not in MODES:
            why = _REFUSED.get(str(mode).upper(), f"choose one of {list(MODES)}")
            raise ValueError(f"--compilation-config cudagraph_mode {mode!r}: {why}")
        mode = "NONE" if enforce_eager else mode.upper()
        top = raw.get("max_cudagraph_capture_size", max(1, max_num_seqs))
        if isinstance(top, bool) or not isinstance(top, int) or top < 1:
            raise ValueError(
                f"--compilation-config max_cudagraph_capture_size must be an integer >= 1, "
                f"got {top!r}"
            )
        sizes = raw.get("cudagraph_capture_sizes")
        if sizes is None:
            sizes = default_capture_sizes(max(1, min(top, max_num_seqs)))
        elif not isinstance(sizes, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes
        ):
            raise ValueError(
                f"--compilation-config cudagraph_capture_sizes must be a list of integers >= 1, "
                f"got {sizes!r}"
            )
        # a decode step has at most max_num_seqs requests: larger graphs would never replay
        sizes = sorted({s for s in sizes if s <= min(top, max_num_seqs)})
        if raw.get("cudagraph_capture_sizes") is not None and not sizes:
            raise ValueError(
                "--compilation-config cudagraph_capture_sizes: no size <= "
                f"min(max_cudagraph_capture_size, --max-num-seqs) = {min(top, max_num_seqs)}"
            )
        return cls(
            cudagraph_mode=mode, cudagraph_capture_sizes=tuple(sizes) if mode != "NONE" else ()
        )
