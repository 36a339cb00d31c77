"""Next-token selection for a whole batch in a fixed number of tensor operations.

Every knob (temperature, top-k, top-p, min-p, penalties, logit bias, logprobs) is a per-row
tensor, so the device work does not grow with per-row Python. Randomness is counter-based
rather than drawn from a stateful generator: the noise for token v of a request's n-th output
is a hash of (seed, n, v). A request therefore samples the same tokens from the same seed
whatever else shares its batch, and no generator state has to be stored, forked or restored
(which also keeps replay and speculative verification simple later).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ninfer.engine.request import SamplingParams

_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # odd 27-bit multiplier: products of 32-bit values stay below 2**63
_GOLDEN = 0x9E3779B1
# Beyond this many candidates a full sort is cheaper than top-k.
_TOPK_FAST_PATH = 1024


def _mix32(x: torch.Tensor | int) -> torch.Tensor | int:
    """A 32-bit integer avalanche hash on values in [0, 2**32), for tensors (int64) or ints."""
    x = ((x >> 16) ^ x) * _MIX & _MASK32
    x = ((x >> 16) ^ x) * _MIX & _MASK32
    return (x >> 16) ^ x


def row_key(seed: int, step: int) -> int:
    """The 32-bit noise key of one request's `step`-th sampled token."""
    seed &= (1 << 64) - 1
    key = _mix32((seed & _MASK32) ^ _mix32((seed >> 32) ^ 0x5BD1E995))
    return int(_mix32(key ^ _mix32(step & _MASK32) ^ 0x27D4EB2F))


def uniform_noise(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """U(0, 1) noise, fp32, for each (row key [B], token id [B, K]) pair; never 0 or 1."""
    h = _mix32((token_ids.to(torch.int64) * _GOLDEN & _MASK32) ^ keys[:, None])
    h = _mix32(h ^ (keys[:, None] >> 7))
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def to_device(values: list, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A small host list as a tensor on `device` without waiting for the device: through
    pinned memory, so the copy queues behind the step's forward like any kernel. (A copy from
    pageable memory blocks the host until the device has finished the forward, and every
    sampler kernel after it was then launched onto an idle device.)"""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(slots=True)
class SampleRow:
    """One row of a sampling batch: its parameters, noise key and penalty lane."""

    params: SamplingParams
    seed: int
    step: int  # index of the token being sampled among the request's outputs
    lane: int


@dataclass(slots=True)
class SampleOutput:
    """Device tensors; the caller moves them to the host once per step."""

    token_ids: torch.Tensor  # int64 [B]
    logprobs: torch.Tensor | None = None  # fp32 [B], the chosen token's
    top_ids: torch.Tensor | None = None  # int64 [B, n]
    top_logprobs: torch.Tensor | None = None  # fp32 [B, n]


class Sampler:
    """Samples one token per logits row. Keeps, per lane, how often each token has been
    generated, for presence and frequency penalties."""

    def __init__(self, vocab_size: int, num_lanes: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.output_counts = torch.zeros(num_lanes, vocab_size, dtype=torch.int32, device=device)

    def reset_lane(self, lane: int) -> None:
        self.output_counts[lane].zero_()

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleOutput:
        """Pick a token for each row of `logits` (fp32 [B, V]); records it for penalties."""
        assert logits.shape[0] == len(rows)
        device = logits.device
        params = [r.params for r in rows]
        lanes = to_device([r.lane for r in rows], device, torch.int64)
        raw = logits[:, : self.vocab_size].float()

        out = SampleOutput(token_ids=torch.empty(0))
        max_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        if max_logprobs is not None:
            logp = torch.log_softmax(raw, dim=-1)

        scores = self._apply_bias_and_penalties(raw, params, lanes)
        token_ids = self._choose(scores, rows)

        if max_logprobs is not None:
            out.logprobs = logp.gather(1, token_ids[:, None]).squeeze(1)
            if max_logprobs > 0:
                out.top_logprobs, out.top_ids = torch.topk(logp, max_logprobs, dim=-1)
        # one scatter-add over the flat counts: on CUDA, index_put_ with accumulate sorts its
        # indices first (several kernels and ~0.2 ms of host time per step on the GPU machine)
        self.output_counts.view(-1).index_add_(
            0, lanes * self.vocab_size + token_ids, torch.ones_like(token_ids, dtype=torch.int32)
        )
        out.token_ids = token_ids
        return out

    def _apply_bias_and_penalties(
        self, raw: torch.Tensor, params: Sequence[SamplingParams], lanes: torch.Tensor
    ) -> torch.Tensor:
        scores = raw
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        for i, p in enumerate(params):
            if p.logit_bias:
                bias_rows += [i] * len(p.logit_bias)
                bias_ids += list(p.logit_bias.keys())
                bias_values += list(p.logit_bias.values())
        if bias_rows:
            scores = scores.clone()
            index = (
                to_device(bias_rows, raw.device, torch.int64),
                to_device(bias_ids, raw.device, torch.int64),
            )
            scores.index_put_(
                index, to_device(bias_values, raw.device, torch.float32), accumulate=True
            )
        if any(p.uses_penalties for p in params):
            counts = self.output_counts.index_select(0, lanes).float()
            presence = self._column([p.presence_penalty for p in params], raw.device)
            frequency = self._column([p.frequency_penalty for p in params], raw.device)
            scores = scores - frequency * counts - presence * (counts > 0).float()
        return scores

    @staticmethod
    def _column(values: list[float], device: torch.device) -> torch.Tensor:
        return to_device(values, device, torch.float32)[:, None]

    def _choose(self, scores: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        params = [r.params for r in rows]
        greedy_ids = scores.argmax(dim=-1)
        if all(p.is_greedy for p in params):
            return greedy_ids
        device = scores.device
        vocab = scores.shape[-1]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        kmax = max(top_k)
        if kmax <= _TOPK_FAST_PATH:
            cand_scores, cand_ids = torch.topk(scores, kmax, dim=-1)
        else:
            cand_scores, cand_ids = torch.sort(scores, dim=-1, descending=True)

        temperature = self._column(
            [p.temperature if not p.is_greedy else 1.0 for p in params], device
        )
        cand_scores = cand_scores / temperature
        rank = torch.arange(cand_scores.shape[-1], device=device)[None, :]
        removed = rank >= to_device(top_k, device, torch.int64)[:, None]
        cand_scores = cand_scores.masked_fill(removed, float("-inf"))
        probs = torch.softmax(cand_scores, dim=-1)

        top_p = [p.top_p for p in params]
        if any(v < 1.0 for v in top_p):
            top_p_col = self._column(top_p, device)
            mass_before = torch.cumsum(probs, dim=-1) - probs
            removed |= (mass_before > top_p_col) & (top_p_col < 1.0)
        min_p = [p.min_p for p in params]
        if any(v > 0.0 for v in min_p):
            removed |= probs < self._column(min_p, device) * probs[:, :1]
        cand_scores = cand_scores.masked_fill(removed, float("-inf"))

        keys = to_device([row_key(r.seed, r.step) for r in rows], device, torch.int64)
        noise = uniform_noise(keys, cand_ids)
        gumbel = -torch.log(-torch.log(noise))
        picked = (cand_scores + gumbel).argmax(dim=-1, keepdim=True)
        sampled_ids = cand_ids.gather(1, picked).squeeze(1)
        greedy_rows = to_device([p.is_greedy for p in params], device, torch.bool)
        return torch.where(greedy_rows, greedy_ids, sampled_ids)
