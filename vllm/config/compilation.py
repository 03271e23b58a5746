"""`--compilation-config`: which steps run as CUDA graphs (upstream vLLM's keys and values).

Two kinds of graphs, captured at start-up:

- *full* graphs of decode-only steps (one query token per request, or 1 + k with MTP), for a set
  of batch sizes (``cudagraph_capture_sizes``): a step of B requests replays the graph of the
  smallest captured size >= B with the extra rows padded (they write no KV, their outputs are
  dropped); ``worker/gpu/cudagraph.py``.
- *piecewise* graphs of every other forward (prompt chunks, mixed steps' chunks, decode batches
  past the largest full size), for a set of token counts (``piecewise_capture_sizes``, this
  engine's key: upstream captures both kinds at the same sizes, but its full sizes count tokens
  and ours count requests): the forward is captured in pieces between the attention layers,
  which run eagerly between replays (they read the step's metadata); ``worker/gpu/piecewise.py``.

``FULL_AND_PIECEWISE`` (upstream's default) uses both; ``FULL_DECODE_ONLY`` only the full graphs
(everything else eager); ``PIECEWISE`` only the piecewise ones (decode steps too); ``FULL`` (full
graphs of mixed batches) is refused by name. ``--enforce-eager`` (or ``"cudagraph_mode":
"NONE"``) runs every step eagerly; so does a CPU run, unless the flag is given: then the same
static-buffer paths run there without capture.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.config.flags import parse_json_flag

MODES = ("NONE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", "PIECEWISE")
_REFUSED = {
    "FULL": "full graphs of mixed prefill/decode batches are not implemented (FULL_AND_PIECEWISE "
    "captures their non-attention work piecewise)",
}
PIECEWISE_DEFAULT_MAX = 8192
_KEYS = (
    "cudagraph_mode",
    "cudagraph_capture_sizes",
    "max_cudagraph_capture_size",
    "piecewise_capture_sizes",
)


def default_capture_sizes(max_size: int) -> list[int]:
    """Upstream's default list: 1, 2, 4, then every 8 up to 256, then every 16, up to max_size."""
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, max_size + 1, 16))
    return [s for s in sizes if s <= max_size] or [max_size]


def default_piecewise_sizes(max_tokens: int) -> list[int]:
    """Token counts for piecewise graphs: 16, 32, 64, then 2^k and 1.5·2^k (a chunk is padded
    by at most a third) up to ``max_tokens``, which is always one of them."""
    sizes, s = [16, 32, 64], 64
    while s < max_tokens:
        sizes += [s * 3 // 2, 2 * s]
        s *= 2
    return sorted({x for x in sizes if x < max_tokens} | {max_tokens})


def _int_list(raw: dict, key: str) -> list[int] | None:
    sizes = raw.get(key)
    if sizes is not None and (
        not isinstance(sizes, list)
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes)
    ):
        raise ValueError(
            f"--compilation-config {key} must be a list of integers >= 1, got {sizes!r}"
        )
    return sizes


@dataclass(frozen=True)
class CompilationConfig:
    cudagraph_mode: str = "FULL_AND_PIECEWISE"
    cudagraph_capture_sizes: tuple[int, ...] = ()  # ascending; empty unless full graphs are on
    piecewise_capture_sizes: tuple[int, ...] = ()  # ascending token counts; empty: none

    @property
    def use_cudagraph(self) -> bool:
        """Full decode graphs are on."""
        return bool(self.cudagraph_capture_sizes)

    @property
    def use_piecewise(self) -> bool:
        return bool(self.piecewise_capture_sizes)

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
    def from_json(
        cls,
        value,
        *,
        enforce_eager: bool,
        max_num_seqs: int,
        max_num_batched_tokens: int | None = None,
    ) -> CompilationConfig:
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
        sizes = _int_list(raw, "cudagraph_capture_sizes")
        if sizes is None:
            sizes = default_capture_sizes(max(1, min(top, max_num_seqs)))
        # a decode step has at most max_num_seqs requests: larger graphs would never replay
        sizes = sorted({s for s in sizes if s <= min(top, max_num_seqs)})
        if raw.get("cudagraph_capture_sizes") is not None and not sizes:
            raise ValueError(
                "--compilation-config cudagraph_capture_sizes: no size <= "
                f"min(max_cudagraph_capture_size, --max-num-seqs) = {min(top, max_num_seqs)}"
            )
        # a forward runs at most max_num_batched_tokens tokens; by default the pieces stop at
        # PIECEWISE_DEFAULT_MAX (their static buffers and pool hold that many tokens' activations;
        # longer chunks are compute-bound: eager costs them little)
        most = max(1, max_num_batched_tokens or max_num_seqs)
        pw = _int_list(raw, "piecewise_capture_sizes")
        if pw is None:
            pw = default_piecewise_sizes(min(most, PIECEWISE_DEFAULT_MAX))
        pw = sorted({s for s in pw if s <= most})
        if raw.get("piecewise_capture_sizes") is not None and not pw:
            raise ValueError(
                f"--compilation-config piecewise_capture_sizes: no size <= "
                f"--max-num-batched-tokens = {most}"
            )
        full = mode in ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
        piecewise = mode in ("PIECEWISE", "FULL_AND_PIECEWISE")
        return cls(
            cudagraph_mode=mode,
            cudagraph_capture_sizes=tuple(sizes) if full else (),
            piecewise_capture_sizes=tuple(pw) if piecewise else (),
        )
