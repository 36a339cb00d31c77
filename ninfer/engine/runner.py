"""Runs one scheduled step: flat input ids and positions plus a `ForwardContext`, the model
forward, logits for the rows that end a sequence's step, and the sampler. The only place where
the engine touches tensors; one host sync per step (the sampled ids)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer.engine.kv_pool import ModelCache
from ninfer.engine.request import TokenLogprob
from ninfer.engine.sampler import Sampler, SampleRow
from ninfer.engine.scheduler import ScheduledBatch
from ninfer.models.context import make_context


@dataclass(slots=True)
class StepResult:
    """Host-side result: one token (and its logprobs when asked) per sampled sequence, in the
    order of the batch's sampled rows."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: ModelCache, sampler: Sampler) -> None:
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.device = cache.k[0].device if cache.k else model.device

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepResult:
        input_ids: list[int] = []
        positions: list[int] = []
        for seq, n in zip(batch.seqs, batch.query_lens):
            start = seq.num_cached
            if batch.is_decode:
                input_ids.append(seq.output_ids[-1])
            else:
                input_ids += seq.prompt_ids[start : start + n]
            positions += range(start, start + n)
        ctx = make_context(
            self.cache,
            context_lens=[seq.num_cached for seq in batch.seqs],
            query_lens=batch.query_lens,
            page_lists=[seq.pages for seq in batch.seqs],
            state_slots=[seq.state_slot for seq in batch.seqs],
            device=self.device,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, pos, ctx)

        rows: list[int] = []
        sample_rows: list[SampleRow] = []
        end = 0
        for seq, n, sampled in zip(batch.seqs, batch.query_lens, batch.sampled):
            end += n
            if sampled:
                rows.append(end - 1)
                sample_rows.append(
                    SampleRow(seq.request.params, seq.seed, len(seq.output_ids), seq.state_slot)
                )
        if not rows:
            return StepResult([], [])
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        out = self.sampler.sample(logits, sample_rows)
        token_ids = out.token_ids.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        if out.logprobs is not None:
            chosen = out.logprobs.tolist()
            top_ids = out.top_ids.tolist() if out.top_ids is not None else None
            top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
            for i, row in enumerate(sample_rows):
                n_top = row.params.logprobs
                if n_top is None:
                    continue
                top = ()
                if n_top and top_ids is not None and top_lps is not None:
                    top = tuple(zip(top_ids[i][:n_top], top_lps[i][:n_top]))
                logprobs[i] = TokenLogprob(token_ids[i], chosen[i], top)
        return StepResult(token_ids, logprobs)
