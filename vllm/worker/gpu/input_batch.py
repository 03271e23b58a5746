"""Per-step inputs, built from the scheduler output and the persistent state with array ops.

Batch row b is request `req_ids[b]` in slot `idx_mapping[b]`, with `num_scheduled[b]` tokens at
positions `start[b] ..`. Token ids the worker already knows (prompt, or prompt+outputs after a
preemption) come from the host; a token past them is the one this worker sampled last step, or,
with speculative decoding, one of the tokens drafted after it, and is read on the device from
`next_tokens` — no host round trip for decode inputs. A decode row of 1 + d tokens verifies d
drafted tokens (`num_drafts`) and samples a token at each of its positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm.core.messages import SchedulerOutput
from vllm.worker.gpu.states import RequestStates


@dataclass
class StepInputs:
    req_ids: list[str]
    idx_np: np.ndarray  # [B] slot per batch row (host; `idx_mapping` on the device)
    start: np.ndarray  # [B] first position of this step's tokens
    num_scheduled: np.ndarray  # [B]
    query_start_loc: np.ndarray  # [B+1]
    seq_lens: np.ndarray  # [B] start + num_scheduled
    is_prefill: np.ndarray  # [B] bool: the chunk holds known (not freshly sampled) tokens
    sample_rows: np.ndarray  # batch rows that produce a token this step
    num_drafts: np.ndarray  # [B] drafted tokens each row verifies (decode rows of 1 + d tokens)
    positions_np: np.ndarray  # [T] int64, position of each token (host)
    # the device token inputs (input_ids [T], positions [T] int64, token_req [T]: batch row of
    # each token), built at first use: a replayed CUDA graph derives its own from idx_mapping,
    # start and num_drafts, so a decode step that replays copies and launches none of them
    device_tokens: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    build_device_tokens: Callable[[], tuple[torch.Tensor, ...]] | None = field(
        default=None, repr=False
    )
    # idx_np on the device, copied at first use (a replayed graph's own input row holds it)
    idx_mapping_d: torch.Tensor | None = None
    h2d: Callable[[np.ndarray], torch.Tensor] | None = field(default=None, repr=False)

    @property
    def idx_mapping(self) -> torch.Tensor:
        if self.idx_mapping_d is None:
            self.idx_mapping_d = self.h2d(self.idx_np)
        return self.idx_mapping_d

    def _tokens(self) -> tuple[torch.Tensor, ...]:
        if self.device_tokens is None:
            self.device_tokens = self.build_device_tokens()
            self.build_device_tokens = None
        return self.device_tokens

    @property
    def input_ids(self) -> torch.Tensor:
        return self._tokens()[0]

    @property
    def positions(self) -> torch.Tensor:
        return self._tokens()[1]

    @property
    def token_req(self) -> torch.Tensor:
        return self._tokens()[2]

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    def rows(self, lo: int, hi: int) -> StepInputs:
        """Batch rows [lo, hi) and their tokens as a step of their own (views of the device
        tensors; the token rows renumbered from 0)."""
        t0, t1 = int(self.query_start_loc[lo]), int(self.query_start_loc[hi])
        sr = self.sample_rows
        return StepInputs(
            req_ids=self.req_ids[lo:hi],
            idx_np=self.idx_np[lo:hi],
            idx_mapping_d=None if self.idx_mapping_d is None else self.idx_mapping_d[lo:hi],
            h2d=self.h2d,
            start=self.start[lo:hi],
            num_scheduled=self.num_scheduled[lo:hi],
            query_start_loc=self.query_start_loc[lo : hi + 1] - t0,
            seq_lens=self.seq_lens[lo:hi],
            is_prefill=self.is_prefill[lo:hi],
            sample_rows=sr[(sr >= lo) & (sr < hi)] - lo,
            num_drafts=self.num_drafts[lo:hi],
            positions_np=self.positions_np[t0:t1],
            device_tokens=(
                self.input_ids[t0:t1],
                self.positions[t0:t1],
                self.token_req[t0:t1] - lo if lo else self.token_req[t0:t1],
            ),
        )


def build_step_inputs(
    so: SchedulerOutput,
    st: RequestStates,
    device: torch.device,
    start_of: dict[str, int],
    staging=None,
) -> StepInputs:
    req_ids = list(so.num_scheduled_tokens)
    b = len(req_ids)
    idx = np.fromiter(map(st.slot_of.__getitem__, req_ids), dtype=np.int64, count=b)
    n = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=b)
    start = np.fromiter(map(start_of.__getitem__, req_ids), dtype=np.int64, count=b)
    known = st.num_known[idx]
    t = int(n.sum())
    if t == b:  # one token a row (decode): no per-token expansion
        qsl = np.arange(b + 1, dtype=np.int64)
        token_req, positions = qsl[:-1], start
    else:
        qsl = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(n, out=qsl[1:])
        token_req = np.repeat(np.arange(b), n)
        positions = np.repeat(start, n) + (np.arange(t) - np.repeat(qsl[:-1], n))
    ids = np.full(t, -1, dtype=np.int64)
    for r in np.nonzero(start < known)[0]:  # rows with host-known tokens (prefill chunks)
        hi = min(start[r] + n[r], known[r])
        ids[qsl[r] : qsl[r] + hi - start[r]] = st.token_ids[idx[r]][start[r] : hi]
    seq_lens = start + n
    # a row samples once its chunk reaches the newest token (known + what this worker sampled)
    sample_rows = np.nonzero(seq_lens >= known + st.num_sampled[idx])[0]
    h2d = staging.to_device if staging is not None else (lambda a: torch.from_numpy(a).to(device))
    num_drafts = np.where(start < known, 0, n - 1)
    # device-side tokens: row-major index into next_tokens [slot, 1 + k] (the last sampled token
    # at offset 0 of a decode row, the drafts after it)
    next_tokens = st.next_tokens

    def device_tokens():
        width = next_tokens.shape[1]
        flat = idx[token_req] * width + np.minimum(positions - start[token_req], width - 1)
        if (ids < 0).all():  # decode rows only: every token from the device
            input_ids = next_tokens.view(-1)[h2d(flat)]
        else:
            ids_d = h2d(np.where(ids >= 0, ids, -1 - flat))
            dev = next_tokens.view(-1)[(-1 - ids_d).clamp_min(0)]
            input_ids = torch.where(ids_d >= 0, ids_d, dev)
        return input_ids, h2d(positions), h2d(token_req)

    return StepInputs(
        req_ids=req_ids,
        idx_np=idx,
        h2d=h2d,
        start=start,
        num_scheduled=n,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        is_prefill=start < known,
        sample_rows=sample_rows,
        num_drafts=num_drafts,
        positions_np=positions,
        build_device_tokens=device_tokens,
    )
