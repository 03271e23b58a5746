"""Persistent per-request state, one row ("slot") per live request.

Device tensors hold what the step needs every time (block table, last sampled token, sampling
parameters); host arrays hold what only the CPU needs (known token ids for prefill chunks, counts).
Per-step inputs gather from here through `idx_mapping` (the slot of each batch row). The state of
penalties and of per-request logit edits lives in their own files (`penalties.py`,
`logit_bias.py`), one object each here.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm.core.messages import NewRequestData
from vllm.worker.gpu.logit_bias import LogitBiasState
from vllm.worker.gpu.penalties import PenaltiesState


class RequestStates:
    def __init__(
        self,
        max_num_reqs: int,
        max_blocks_per_req: int,
        device: torch.device,
        vocab_size: int,
        num_spec_tokens: int = 0,
    ):
        self.max_num_reqs, self.max_blocks = max_num_reqs, max_blocks_per_req
        self.device = device
        self.free_slots = list(range(max_num_reqs - 1, -1, -1))
        self.slot_of: dict[str, int] = {}
        self.version = 0  # bumped by every add and remove (what a cached step plan checks)
        n = max_num_reqs
        # host
        self.token_ids: list[np.ndarray | None] = [None] * n
        self.num_known = np.zeros(n, dtype=np.int64)
        self.num_prompt = np.zeros(n, dtype=np.int64)
        self.num_generated = np.zeros(n, dtype=np.int64)  # output tokens so far (min_tokens)
        self.num_sampled = np.zeros(n, dtype=np.int64)  # tokens this worker sampled since admission
        self.num_blocks = np.zeros(n, dtype=np.int64)
        self.min_tokens = np.zeros(n, dtype=np.int64)
        self.logprobs = np.full(n, -1, dtype=np.int64)
        self.prompt_logprobs = np.full(n, -1, dtype=np.int64)
        self.greedy = np.ones(n, dtype=bool)
        self.top_k_on = np.zeros(n, dtype=bool)
        self.top_p_on = np.zeros(n, dtype=bool)
        self.min_p_on = np.zeros(n, dtype=bool)
        self.spec_ok = np.zeros(n, dtype=bool)  # verifies drafted tokens (position-independent)
        self.stop_ids: list[list[int]] = [[] for _ in range(n)]
        # device
        # one spare row past the slots (both tables): where a CUDA graph's padding rows point
        self.block_table = torch.zeros(n + 1, max_blocks_per_req, dtype=torch.int32, device=device)
        # the next step's device-side input tokens: the last sampled token, then the tokens the
        # drafter proposed after it (--speculative-config), verified by the next step
        self.next_tokens = torch.zeros(n + 1, 1 + num_spec_tokens, dtype=torch.int64, device=device)
        self.last_sampled = self.next_tokens[:, 0]  # a view: writes land in next_tokens
        self.draft_tokens = self.next_tokens[:, 1:]
        self.temperature = torch.zeros(n, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(n, dtype=torch.int64, device=device)
        self.top_p = torch.ones(n, dtype=torch.float32, device=device)
        self.min_p = torch.zeros(n, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(n, dtype=torch.int64, device=device)
        self.penalties = PenaltiesState(n, vocab_size, device)
        self.logit_bias = LogitBiasState(n, device)

    def _h2d(self, arr: np.ndarray, h2d) -> torch.Tensor:
        """A host array on the device: through ``h2d`` (the runner's pinned staging, which
        neither blocks nor synchronises) when given, else a plain copy (tests, tools)."""
        return h2d(arr) if h2d is not None else torch.from_numpy(arr).to(self.device)

    def add(self, r: NewRequestData, eos_ids: list[int], h2d=None) -> int:
        self.version += 1
        if not self.free_slots:
            raise RuntimeError("no free request slot (max_num_seqs exceeded)")
        if len(r.block_ids) > self.max_blocks:
            raise RuntimeError(
                f"request {r.req_id} needs {len(r.block_ids)} blocks > {self.max_blocks}"
            )
        s = self.free_slots.pop()
        self.slot_of[r.req_id] = s
        t = r.token_ids
        toks = (
            np.frombuffer(t, dtype=np.int32).astype(np.int64)
            if isinstance(t, bytes)
            else np.asarray(t, dtype=np.int64)
        )
        self.token_ids[s] = toks
        self.num_known[s] = len(toks)
        self.num_prompt[s] = r.num_prompt_tokens
        self.num_generated[s] = len(toks) - r.num_prompt_tokens
        self.num_sampled[s] = 0
        sp = r.sampling
        self.min_tokens[s] = sp.min_tokens
        self.logprobs[s] = -1 if sp.logprobs is None else sp.logprobs
        self.prompt_logprobs[s] = -1 if sp.prompt_logprobs is None else sp.prompt_logprobs
        self.greedy[s] = sp.temperature == 0.0
        self.top_k_on[s], self.top_p_on[s], self.min_p_on[s] = (
            sp.top_k > 0,
            sp.top_p < 1.0,
            sp.min_p > 0,
        )
        self.spec_ok[s] = sp.position_independent
        self.stop_ids[s] = ([] if sp.ignore_eos else list(eos_ids)) + list(sp.stop_token_ids)
        self.num_blocks[s] = len(r.block_ids)
        # from the staging arena: a copy from pageable memory would synchronise the stream, and
        # under --async-scheduling the previous step is still running there
        self.block_table[s, : len(r.block_ids)] = self._h2d(
            np.asarray(r.block_ids, dtype=np.int32), h2d
        )
        # fill_ launches a kernel with the value as its argument; `t[s] = x` copies x from
        # pageable host memory, which waits for the stream (the previous step, when pipelined)
        self.temperature[s].fill_(sp.temperature)
        self.top_k[s].fill_(sp.top_k)
        self.top_p[s].fill_(sp.top_p)
        self.min_p[s].fill_(sp.min_p)
        self.seeds[s].fill_(sp.seed)
        self.penalties.add(s, sp, toks, r.num_prompt_tokens, h2d)
        self.logit_bias.add(s, sp, toks, r.num_prompt_tokens, h2d)
        return s

    def remove(self, req_id: str) -> None:
        s = self.slot_of.pop(req_id, None)
        if s is None:
            return
        self.version += 1
        self.token_ids[s] = None
        self.num_blocks[s] = 0
        self.prompt_logprobs[s] = -1  # free slots want none: one max() tells if any row does
        self.logit_bias.remove(s)
        self.free_slots.append(s)

    def append_blocks(self, updates: list[tuple[str, list[int]]], h2d=None) -> None:
        """One scatter for every request's new block ids (indices through ``h2d``, as in
        :meth:`add`)."""
        rows, cols, vals = [], [], []
        for rid, ids in updates:
            if not ids:
                continue
            s = self.slot_of[rid]
            start = int(self.num_blocks[s])
            if start + len(ids) > self.max_blocks:
                raise RuntimeError(f"request {rid} exceeds {self.max_blocks} blocks")
            rows += [s] * len(ids)
            cols += range(start, start + len(ids))
            vals += ids
            self.num_blocks[s] = start + len(ids)
        if rows:
            idx = (
                self._h2d(np.asarray(rows, dtype=np.int64), h2d),
                self._h2d(np.asarray(cols, dtype=np.int64), h2d),
            )
            self.block_table.index_put_(idx, self._h2d(np.asarray(vals, dtype=np.int32), h2d))
