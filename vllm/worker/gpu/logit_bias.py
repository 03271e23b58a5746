"""Per-request edits of the logits before the penalties: allowed_token_ids, logit_bias, bad_words.

allowed_token_ids and logit_bias are fixed for a request: their token ids (and biases) go to the
device once, when the request enters a slot, and each step concatenates the rows that use them.
bad_words depend on the outputs so far; the host already learns every sampled token from the
step's one device→host copy, so it keeps each such request's outputs and lists the banned ids
(shipped with min_tokens' bans). Rows that use none of these cost nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm.core.messages import SamplingOptions

H2D = Callable[[np.ndarray], torch.Tensor]


def apply_allowed(logits: torch.Tensor, allowed: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """allowed = (restricted [B] bool, rows [K], ids [K]): in a restricted row every token but
    its (row, id) pairs goes to -inf."""
    restricted, rows, ids = allowed
    blocked = restricted.unsqueeze(1).expand_as(logits).clone()
    blocked.index_put_((rows, ids), torch.zeros((), dtype=torch.bool, device=logits.device))
    return logits.masked_fill(blocked, float("-inf"))


def apply_logit_bias(logits: torch.Tensor, bias: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """bias = (rows [K], ids [K], values [K] fp32), (row, id) pairs distinct: added to the logits."""
    rows, ids, vals = bias
    return logits.index_put((rows, ids), vals, accumulate=True)


class LogitBiasState:
    def __init__(self, max_num_reqs: int, device: torch.device):
        n, self.device = max_num_reqs, device
        # host flags: which slots use each edit (a batch without any skips it at once)
        self.allowed_on = np.zeros(n, dtype=bool)
        self.bias_on = np.zeros(n, dtype=bool)
        self.bad_words_on = np.zeros(n, dtype=bool)
        self.allowed: list[torch.Tensor | None] = [None] * n  # [K] int64 on the device
        self.bias: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n  # ids, values
        self.bad_words: list[list[list[int]]] = [[] for _ in range(n)]
        self.outputs: list[list[int]] = [[] for _ in range(n)]  # only slots with bad_words
        self.num_on = 0  # slots using any of the three (none: a step skips them all at once)

    def add(
        self, slot: int, sp: SamplingOptions, token_ids: np.ndarray, num_prompt: int, h2d=None
    ) -> None:
        """A request entered ``slot``. ``h2d``: the runner's pinned staging (a pageable copy
        would wait for the stream)."""

        def dev(x, dtype):
            arr = np.asarray(x, dtype=dtype)
            return h2d(arr) if h2d is not None else torch.from_numpy(arr).to(self.device)

        self.allowed[slot] = dev(sp.allowed_token_ids, np.int64) if sp.allowed_token_ids else None
        b = sp.logit_bias
        self.bias[slot] = (dev(list(b), np.int64), dev(list(b.values()), np.float32)) if b else None
        self.bad_words[slot] = list(sp.bad_words_token_ids or [])
        self.outputs[slot] = token_ids[num_prompt:].tolist() if self.bad_words[slot] else []
        self.num_on -= self._on(slot)
        self.allowed_on[slot] = self.allowed[slot] is not None
        self.bias_on[slot] = b is not None and len(b) > 0
        self.bad_words_on[slot] = bool(self.bad_words[slot])
        self.num_on += self._on(slot)

    def _on(self, slot: int) -> bool:
        return bool(self.allowed_on[slot] or self.bias_on[slot] or self.bad_words_on[slot])

    def remove(self, slot: int) -> None:
        self.num_on -= self._on(slot)
        self.allowed[slot] = self.bias[slot] = None
        self.bad_words[slot], self.outputs[slot] = [], []
        self.allowed_on[slot] = self.bias_on[slot] = self.bad_words_on[slot] = False

    def record(self, slot: int, token: int) -> None:
        """The slot's request sampled ``token`` (called for every output, kept if bad_words)."""
        if self.bad_words_on[slot]:
            self.outputs[slot].append(token)

    def gather_allowed(self, slots: np.ndarray, h2d: H2D) -> tuple[torch.Tensor, ...] | None:
        restricted = self.allowed_on[slots]
        if not restricted.any():
            return None
        rows = np.nonzero(restricted)[0].tolist()
        r, ids = self._concat(rows, [self.allowed[slots[i]] for i in rows], h2d)
        return h2d(restricted), r, ids

    def gather_bias(self, slots: np.ndarray, h2d: H2D) -> tuple[torch.Tensor, ...] | None:
        rows = np.nonzero(self.bias_on[slots])[0].tolist()
        if not rows:
            return None
        r, ids = self._concat(rows, [self.bias[slots[i]][0] for i in rows], h2d)
        return r, ids, torch.cat([self.bias[slots[i]][1] for i in rows])

    def bad_word_bans(self, slots: np.ndarray) -> tuple[list[int], list[int]]:
        """(batch rows, token ids) to ban: a bad word's last token wherever the outputs so far
        end with the rest of the word (always, for a one-token word)."""
        rows: list[int] = []
        ids: list[int] = []
        for i in np.nonzero(self.bad_words_on[slots])[0].tolist():
            s = slots[i]
            out = self.outputs[s]
            for w in self.bad_words[s]:
                k = len(w) - 1
                if k <= len(out) and (k == 0 or out[-k:] == w[:-1]):
                    rows.append(i)
                    ids.append(w[-1])
        return rows, ids

    @staticmethod
    def _concat(rows: list[int], parts: list[torch.Tensor], h2d: H2D):
        """Batch row of each element and the elements of per-row device tensors, concatenated
        (lengths are host metadata: no sync)."""
        lens = np.array([p.numel() for p in parts], dtype=np.int64)
        r = torch.repeat_interleave(
            h2d(np.asarray(rows, dtype=np.int64)), h2d(lens), output_size=int(lens.sum())
        )
        return r, torch.cat(parts)
