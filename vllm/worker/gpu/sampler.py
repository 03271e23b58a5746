"""Device-side sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

The order is upstream vLLM's: the grammar bitmask of structured outputs; logprobs of the logits
so far (upstream's default ``raw_logprobs``); then
allowed_token_ids, bans (bad_words, min_tokens), logit_bias, penalties; greedy takes the argmax
of those; random rows then apply temperature, min-p, top-k and top-p, and sample.

Randomness is counter-based: the uniform for (request seed, position, token) is a hash of the
three, so a seeded request samples the same tokens whatever else is in the batch, and nothing is
drawn from a stateful generator. Sampling is Gumbel-max over the filtered distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.structured_output.bitmask import apply_token_bitmask
from vllm.worker.gpu.logit_bias import apply_allowed, apply_logit_bias
from vllm.worker.gpu.penalties import Penalties, apply_penalties

_M32 = 0xFFFFFFFF


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


@dataclass
class SamplingBatch:
    """Per-row sampling parameters, gathered from the persistent request state for this step."""

    temperature: torch.Tensor  # [B] fp32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] fp32, 1 = off
    min_p: torch.Tensor  # [B] fp32, 0 = off
    seeds: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64, position of the token being sampled
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_logprobs: int  # -1 = no row wants logprobs; else the largest top-n asked (may be 0)
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, ids): min_tokens, bad_words
    allowed: tuple[torch.Tensor, ...] | None = None  # (restricted [B], rows, ids): apply_allowed
    bias: tuple[torch.Tensor, ...] | None = None  # (rows, ids, values): apply_logit_bias
    penalties: Penalties | None = None
    grammar: torch.Tensor | None = None  # [B, ceil(V/32)] int32 allowed-token bits (-1: any)


def process_logits(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """The edits that can change the argmax: logits [B, V] fp32 -> [B, V] (a new tensor)."""
    if sb.allowed is not None:
        logits = apply_allowed(logits, sb.allowed)
    if sb.banned is not None:
        # a device fill, not a copy from the host (torch.tensor(..., device=) would wait on it)
        logits = logits.index_put(sb.banned, torch.full((), float("-inf"), device=logits.device))
    if sb.bias is not None:
        logits = apply_logit_bias(logits, sb.bias)
    if sb.penalties is not None:
        logits = apply_penalties(logits, sb.penalties)
    return logits


def sample(logits: torch.Tensor, sb: SamplingBatch):
    """logits [B, V] fp32 -> sampled [B] int64, and (logprob [B], rank [B], top ids [B, n],
    top logprobs [B, n]) of the raw distribution if any row asked for logprobs."""
    if sb.grammar is not None:  # structured outputs: before everything, as upstream
        logits = apply_token_bitmask(logits.clone(), sb.grammar)
    raw = logits
    logits = process_logits(logits, sb)
    greedy = logits.argmax(dim=-1)
    if sb.all_greedy:
        sampled = greedy
    else:
        x = logits / torch.where(sb.temperature > 0, sb.temperature, 1.0).unsqueeze(1)
        if sb.any_min_p:
            x = apply_min_p(x, sb.min_p)
        if sb.any_top_k or sb.any_top_p:
            x = _top_k_top_p(x, sb)
        u = uniform_noise(sb.seeds, sb.positions, x.shape[1])
        gumbel = -torch.log(-torch.log(u))
        sampled = torch.where(sb.temperature > 0, (x + gumbel).argmax(dim=-1), greedy)
    lp = None
    if sb.max_logprobs >= 0:
        logprobs = torch.log_softmax(raw, dim=-1)
        chosen = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
        rank = (logprobs > chosen.unsqueeze(1)).sum(-1) + 1
        top = logprobs.topk(max(sb.max_logprobs, 1), dim=-1)
        lp = (chosen, rank, top.indices, top.values)
    return sampled, lp


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """x [B, V] (after temperature), min_p [B]: tokens whose probability is below min_p times
    the row's largest go to -inf (min_p 0: the row is unchanged)."""
    probs = torch.softmax(x, dim=-1)
    keep = probs >= min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return x.masked_fill(~keep, float("-inf"))


def _top_k_top_p(x: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    sorted_x, order = x.sort(dim=-1, descending=True)
    v = x.shape[1]
    ar = torch.arange(v, device=x.device).unsqueeze(0)
    drop = torch.zeros_like(sorted_x, dtype=torch.bool)
    if sb.any_top_k:
        k = torch.where(sb.top_k > 0, sb.top_k, v).unsqueeze(1)
        drop |= ar >= k
    if sb.any_top_p:
        probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        drop |= before >= sb.top_p.unsqueeze(1)
    drop[:, 0] = False  # always keep the best token
    return x.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))


def prompt_logprobs(logits: torch.Tensor, next_ids: torch.Tensor, n: int):
    """logits [N, V] for prompt positions, next_ids [N] the actual next prompt tokens ->
    (logprob [N], rank [N], top ids [N, n], top logprobs [N, n])."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
    rank = (logprobs > chosen.unsqueeze(1)).sum(-1) + 1
    top = logprobs.topk(max(n, 1), dim=-1)
    return chosen, rank, top.indices[:, :n], top.values[:, :n]
