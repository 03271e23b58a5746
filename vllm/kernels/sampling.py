"""Sampling ops over [B, V] logits: top-k / top-p filtering and Gumbel-max sampling.

Both are per-step costs that scale with the vocabulary (V = 154,880 for GLM): the sort-based
filter and the [B, V] int64 noise hash took milliseconds at B = 256. CUDA tensors run the Triton
kernels (``vllm/kernels/triton/top_k_top_p.py``, ``gumbel.py``); CPU tensors the references, which
define the semantics. Neither syncs with the host nor has data-dependent shapes (CUDA-graph safe).
"""

from __future__ import annotations

import torch

from vllm.kernels import kernel_module

_M32 = 0xFFFFFFFF


def top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Top-k then top-p filtering: logits [B, V] fp32 (temperature already applied; -inf entries
    allowed: bans, grammar masks, min-p), top_k [B] int (<= 0 or >= V: off), top_p [B] fp32
    (>= 1: off) -> a new [B, V] fp32 tensor, dropped tokens -inf, kept ones unchanged (bits
    included), in vocabulary order. ``None`` turns a filter off for every row.

    Order the row's tokens by (value descending, index ascending), -0.0 tied with +0.0 (a stable
    descending sort). Top-k keeps the first k in that order. Top-p then takes probabilities as the
    softmax over the top-k survivors and keeps a token iff the probability mass strictly before it
    in that order is < top_p. The first token is always kept. Rows with both filters off are
    returned unchanged. NaN and +inf logits are not supported.

    The kernel sums masses in another order than the reference's cumsum: a token whose mass
    before it is within fp32 rounding (~1e-6 of the row's mass) of top_p may go either way;
    everything else, and top-k always, is exact.
    """
    if top_k is None and top_p is None:
        return logits.clone()
    fast = kernel_module("triton.top_k_top_p", logits)
    if fast is not None:
        return fast.top_k_top_p(logits, top_k, top_p)
    return top_k_top_p_ref(logits, top_k, top_p)


def top_k_top_p_ref(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """:func:`top_k_top_p` by a stable sort of every row (ties in index order)."""
    v = logits.shape[1]
    sorted_x, order = logits.sort(dim=-1, descending=True, stable=True)
    drop = torch.zeros_like(sorted_x, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, v).unsqueeze(1)
        drop |= torch.arange(v, device=logits.device).unsqueeze(0) >= k
    if top_p is not None:
        probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        p = top_p.unsqueeze(1)
        drop |= (before >= p) & (p < 1)
    drop[:, 0] = False  # always keep the best token
    return logits.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))


def top_k_top_p_cost(num_rows: int, vocab: int) -> tuple[int, int]:
    """(flops, bytes) of the kernel: the row read twice (statistics, then the masked write) and
    written once; the candidate lists are small and L2-resident."""
    return 0, 3 * num_rows * vocab * 4


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser on int64 tensors (constants < 2^31: products never overflow)."""
    h = ((h >> 16) ^ h) * 0x45D9F3B & _M32
    h = ((h >> 16) ^ h) * 0x45D9F3B & _M32
    return (h >> 16) ^ h


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B] seeds, [B] positions -> [B, vocab] uniforms in (0, 1), a pure function of the inputs."""
    s = (seeds ^ (seeds >> 32)) & _M32
    b = _mix32(_mix32(s) ^ (positions & _M32))
    v = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = _mix32(b.unsqueeze(1) ^ v.unsqueeze(0))
    # fp32 rounds the top 128 of 2^32 values up to 1.0, whose Gumbel noise is +inf: a masked
    # token (-inf) would then win the argmax as NaN; the largest fp32 below 1 keeps u in (0, 1)
    return (h.double() + 0.5).div_(2.0**32).float().clamp_(max=1.0 - 2.0**-24)


def gumbel_sample(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Gumbel-max sampling: logits [B, V] fp32 (temperature already applied), temperature [B]
    fp32, seeds [B] int64, positions [B] int64 -> [B] int64: argmax(logits + G) for rows with
    temperature > 0, where G = -log(-log(u)) and u = ``uniform_noise(seeds, positions, V)``
    (bit for bit), and argmax(logits) for the others; ties go to the lowest index."""
    fast = kernel_module("triton.gumbel", logits)
    if fast is not None:
        return fast.gumbel_sample(logits, temperature, seeds, positions)
    return gumbel_sample_ref(logits, temperature, seeds, positions)


def gumbel_sample_ref(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """:func:`gumbel_sample` from the [B, V] uniforms."""
    u = uniform_noise(seeds, positions, logits.shape[1])
    gumbel = -torch.log(-torch.log(u))
    noisy = (logits + gumbel).argmax(dim=-1)
    return torch.where(temperature > 0, noisy, logits.argmax(dim=-1))


def gumbel_sample_cost(num_rows: int, vocab: int) -> tuple[int, int]:
    """(flops, bytes): the row read once; ~60 integer and float operations per token (hash,
    two logs), which is what bounds the kernel when no row is filtered."""
    return 60 * num_rows * vocab, num_rows * vocab * 4
