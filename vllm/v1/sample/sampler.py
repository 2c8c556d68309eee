"""`Sampler`: logits -> next tokens (and logprobs), vectorised over the batch."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from vllm._custom_ops import native_ops
from vllm.v1.outputs import LogprobsLists
from vllm.v1.sample.metadata import Penalties, SamplingMetadata


class SamplerOutput(NamedTuple):
    sampled_token_ids: torch.Tensor  # [n] int64
    logprobs: LogprobsLists | None


class Sampler(nn.Module):
    """Order: allowed_token_ids and min_tokens masks, penalties, temperature,
    top-k/top-p/min-p, then inverse-CDF sampling with one uniform per row, drawn from each
    seeded request's own generator (unseeded rows share one draw from the global
    generator). Logprobs are those of the raw model output.

    Logits come in the model dtype. An all-greedy step without logprobs, min_tokens or
    penalties only takes the argmax, of the logits as they are: on CPU by the native
    kernel (64 x 49152 bfloat16 logits, 2 threads: ~0.2 ms, against ~3.3 ms for torch's
    upcast + float32 argmax; torch's own bfloat16 argmax is slower still), elsewhere after
    an upcast to float32. Upcasting is exact, so the token is the same either way.
    """

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if (metadata.all_greedy and metadata.max_num_logprobs is None
                and not metadata.min_tokens_blocked and not metadata.allowed_token_ids
                and metadata.penalties is None):
            return SamplerOutput(greedy_tokens(logits), None)
        num_logprobs = metadata.max_num_logprobs
        raw_logprobs = None
        if num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)
        sampled = self.sample(process_logits(logits, metadata), metadata)
        logprobs = None
        if raw_logprobs is not None and num_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, num_logprobs)
        return SamplerOutput(sampled, logprobs)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        if metadata.all_greedy:
            return greedy
        probs = sampling_probs(logits, metadata)
        random = inverse_cdf_sample(probs, draw_uniforms(probs.shape[0], metadata.generators))
        if metadata.all_random:
            return random
        return torch.where(metadata.temperature > 0, random, greedy)


def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """allowed_token_ids and min_tokens masks, then penalties, on a float32 copy (the
    caller's logits stay untouched)."""
    model_logits, logits = logits, logits.float()  # a copy unless already float32
    if (metadata.min_tokens_blocked or metadata.allowed_token_ids) and logits is model_logits:
        logits = logits.clone()
    for row, allowed in metadata.allowed_token_ids.items():
        kept = logits[row, allowed]
        logits[row] = float("-inf")
        logits[row, allowed] = kept
    for row, token_ids in metadata.min_tokens_blocked.items():
        logits[row, token_ids] = float("-inf")
    if metadata.penalties is not None:
        logits = apply_penalties(logits, metadata.penalties)
    return logits


def sampling_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution random rows sample from: temperature (greedy rows at 1), top-k,
    top-p, softmax, min-p. Rows are not renormalised after min-p."""
    temperature = torch.where(metadata.temperature > 0, metadata.temperature, 1.0)
    logits = logits / temperature[:, None]
    logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    if metadata.min_p is not None:
        max_p = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < metadata.min_p[:, None] * max_p, 0.0)
    return probs


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the vocabulary of each row [n, vocab] -> [n] int64 (first maximum)."""
    if (logits.dim() == 2 and logits.stride(-1) == 1
            and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        ops = native_ops(logits.device)
        if ops is not None:
            return ops.argmax_rows(logits)
    return logits.float().argmax(dim=-1)


def draw_uniforms(num_rows: int, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One U[0, 1) per row: seeded rows from their own generator (so a request's draws do
    not depend on its neighbours), the others in one call on the global generator."""
    if not generators:
        return torch.rand(num_rows)
    u = torch.empty(num_rows)
    unseeded = [row for row in range(num_rows) if row not in generators]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded))
    for row, generator in generators.items():
        u[row] = torch.rand(1, generator=generator, device=generator.device).item()
    return u


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row i picks the first token whose cumulative probability exceeds u[i] * total.

    Example: probs [0.2, 0.0, 0.5, 0.3] -> cdf [0.2, 0.2, 0.7, 1.0]; u 0.1 -> token 0,
    u 0.2 -> token 2 (the zero-probability token 1 is never picked), u 0.95 -> token 3.
    Rows need not sum to 1 (top-k/top-p/min-p zeroed some); scaling u by the row total
    does the renormalisation. A product rounding up to the total is clamped to the last
    token with probability > 0 (the first index where the cdf reaches its total).
    """
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    picked = torch.searchsorted(cdf, u.to(cdf.device, cdf.dtype)[:, None] * total, right=True)
    last = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(picked, last).squeeze(-1)


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens (divide positive logits, multiply
    negative ones); presence and frequency penalties over output tokens (OpenAI's)."""
    counts = penalties.output_token_counts
    seen = penalties.prompt_token_mask | (counts > 0)
    rep = penalties.repetition[:, None].expand_as(logits)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - penalties.frequency[:, None] * counts
    return logits - penalties.presence[:, None] * (counts > 0)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    if top_k is None and top_p is None:
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        # The k-th largest value is at ascending index vocab - k.
        kth = sorted_logits.gather(-1, (vocab - top_k.clamp(1, vocab))[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - top_p[:, None])
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, k: int) -> LogprobsLists:
    """Row i: [sampled token, top-k tokens...] with their logprobs, and the sampled rank."""
    sampled_lp = logprobs.gather(-1, sampled[:, None])
    ranks = (logprobs > sampled_lp).sum(dim=-1) + 1
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
        token_ids = torch.cat([sampled[:, None], top_ids], dim=1)
        values = torch.cat([sampled_lp, top_lp], dim=1)
    else:
        token_ids, values = sampled[:, None], sampled_lp
    return LogprobsLists(token_ids.tolist(), values.tolist(), ranks.tolist())
