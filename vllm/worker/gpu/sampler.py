"""Device-side sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

The order is upstream vLLM's: the grammar bitmask of structured outputs; logprobs of the logits
so far (upstream's default ``raw_logprobs``); then
allowed_token_ids, bans (bad_words, min_tokens), logit_bias, penalties; greedy takes the argmax
of those; random rows then apply temperature, min-p, top-k and top-p, and sample.

Randomness is counter-based: the uniform for (request seed, position, token) is a hash of the
three (``uniform_noise``), so a seeded request samples the same tokens whatever else is in the
batch, and nothing is drawn from a stateful generator. Sampling is Gumbel-max over the filtered
distribution. Top-k / top-p and the Gumbel-max are ops of ``vllm.kernels.sampling`` (Triton
kernels on CUDA: no sort of the vocabulary, no [B, V] noise tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.kernels.sampling import gumbel_sample, top_k_top_p
from vllm.structured_output.bitmask import apply_token_bitmask
from vllm.worker.gpu.logit_bias import apply_allowed, apply_logit_bias
from vllm.worker.gpu.penalties import Penalties, apply_penalties


@dataclass
class SamplingBatch:
    """Per-row sampling parameters, gathered from the persistent request state for this step
    (the six tensors are None when ``all_greedy``: the argmax reads none of them)."""

    temperature: torch.Tensor | None  # [B] fp32, 0 = greedy
    top_k: torch.Tensor | None  # [B] int64, 0 = off
    top_p: torch.Tensor | None  # [B] fp32, 1 = off
    min_p: torch.Tensor | None  # [B] fp32, 0 = off
    seeds: torch.Tensor | None  # [B] int64
    positions: torch.Tensor | None  # [B] int64, position of the token being sampled
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


def sample(logits: torch.Tensor, sb: SamplingBatch, argmax: torch.Tensor | None = None):
    """logits [B, V] fp32 -> sampled [B] int64, and (logprob [B], rank [B], top ids [B, n],
    top logprobs [B, n]) of the raw distribution if any row asked for logprobs. ``argmax``
    [B]: the logits' argmax if already computed (a replayed graph's), a greedy batch's tokens
    when nothing edits its logits."""
    given = logits
    if sb.grammar is not None:  # structured outputs: before everything, as upstream
        logits = apply_token_bitmask(logits.clone(), sb.grammar)
    raw = logits
    logits = process_logits(logits, sb)
    if sb.all_greedy:
        sampled = argmax if argmax is not None and logits is given else logits.argmax(dim=-1)
    else:
        # greedy rows are divided by 1 and keep their first maximum through every filter, so
        # gumbel_sample's plain argmax for them is the argmax of the logits
        x = logits / torch.where(sb.temperature > 0, sb.temperature, 1.0).unsqueeze(1)
        if sb.any_min_p:
            x = apply_min_p(x, sb.min_p)
        if sb.any_top_k or sb.any_top_p:
            top_k = sb.top_k if sb.any_top_k else None
            x = top_k_top_p(x, top_k, sb.top_p if sb.any_top_p else None)
        sampled = gumbel_sample(x, sb.temperature, sb.seeds, sb.positions)
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


def prompt_logprobs(logits: torch.Tensor, next_ids: torch.Tensor, n: int):
    """logits [N, V] for prompt positions, next_ids [N] the actual next prompt tokens ->
    (logprob [N], rank [N], top ids [N, n], top logprobs [N, n])."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
    rank = (logprobs > chosen.unsqueeze(1)).sum(-1) + 1
    top = logprobs.topk(max(n, 1), dim=-1)
    return chosen, rank, top.indices[:, :n], top.values[:, :n]
