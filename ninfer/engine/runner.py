"""Runs one scheduled step: flat input ids and positions plus a `ForwardContext`, the model
forward, logits for the rows that end a sequence's step, and the sampler. The only place where
the engine touches tensors; one host sync per step (the sampled ids). Decode steps replay a
captured CUDA graph when the engine captured them (graphs.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer.engine.graphs import DecodeGraphs
from ninfer.engine.kv_pool import ModelCache
from ninfer.engine.request import TokenLogprob
from ninfer.engine.sampler import SampleOutput, Sampler, SampleRow, to_device
from ninfer.engine.scheduler import ScheduledBatch
from ninfer.models.context import make_context


@dataclass(slots=True)
class StepInputs:
    """The host-side inputs of one forward: all a rank needs to run it (tensor-parallel
    workers receive exactly this from rank 0)."""

    input_ids: list[int]
    positions: list[int]
    context_lens: list[int]
    query_lens: list[int]
    page_lists: list[list[int]]
    state_slots: list[int]
    logit_rows: list[int]  # flat token rows whose logits are sampled
    # the ids as a device tensor instead (a step launched before the step that sampled them
    # was read back: `input_ids` then holds placeholders)
    device_ids: torch.Tensor | None = None


@dataclass(slots=True)
class LaunchedStep:
    """A step whose device work is queued: its batch, the sampler's device output (fed to a
    step launched after it) and that output's copy on the host, filled once `ready` has
    passed (None off CUDA: the copy is then already made), read by `ModelRunner.collect`."""

    batch: ScheduledBatch
    out: SampleOutput | None
    host: SampleOutput | None
    ready: torch.cuda.Event | None
    top_counts: list[int | None]  # per sampled row, the top logprobs asked for


def _copy_to_host(out: SampleOutput | None) -> tuple[SampleOutput | None, torch.cuda.Event | None]:
    """The sampler's output copied to pinned host memory behind the step's work, and the event
    that marks the copy done (CUDA); on the CPU the output itself."""
    if out is None or out.token_ids.device.type != "cuda":
        return out, None

    def pinned(tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor, non_blocking=True)

    host = SampleOutput(
        pinned(out.token_ids), pinned(out.logprobs), pinned(out.top_ids), pinned(out.top_logprobs)
    )
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


@dataclass(slots=True)
class StepResult:
    """Host-side result: one token (and its logprobs when asked) per sampled sequence, in the
    order of the batch's sampled rows."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class ModelRunner:
    graphs: DecodeGraphs | None = None  # decode steps replay these when set (CUDA only)
    # `launch` may feed a step the device output of one in flight (no tensor-parallel
    # workers that need the ids on the host)
    steps_ahead = True

    def __init__(self, model: torch.nn.Module, cache: ModelCache, sampler: Sampler) -> None:
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.device = cache.k[0].device if cache.k else model.device

    def capture_graphs(self, max_context: int, sizes: list[int]) -> None:
        """Capture the decode graphs (the cache must have been built with `scratch=True`)."""
        graphs = DecodeGraphs(self.model, self.cache, max_context=max_context, sizes=sizes)
        graphs.capture()
        self.graphs = graphs

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepResult:
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(
        self, batch: ScheduledBatch, after: LaunchedStep | None = None, done: int = 0
    ) -> LaunchedStep:
        """Queue the batch's forward and sampling without waiting for the device. With `after`
        (a decode step not yet collected, whose sampled tokens this decode batch feeds), the
        input ids are taken from its device output, and `done` more tokens than each request
        has recorded count as sampled (the noise keys of seeded sampling)."""
        input_ids: list[int] = []
        positions: list[int] = []
        for seq, n in zip(batch.seqs, batch.query_lens):
            start = seq.num_cached
            if batch.is_decode:
                input_ids.append(seq.output_ids[-1] if after is None else 0)
            else:
                input_ids += seq.prompt_ids[start : start + n]
            positions += range(start, start + n)
        rows: list[int] = []
        sample_rows: list[SampleRow] = []
        end = 0
        for seq, n, sampled in zip(batch.seqs, batch.query_lens, batch.sampled):
            end += n
            if sampled:
                rows.append(end - 1)
                step = len(seq.output_ids) + done
                sample_rows.append(SampleRow(seq.request.params, seq.seed, step, seq.state_slot))
        inputs = StepInputs(
            input_ids,
            positions,
            context_lens=[seq.num_cached for seq in batch.seqs],
            query_lens=list(batch.query_lens),
            page_lists=[seq.pages for seq in batch.seqs],
            state_slots=[seq.state_slot for seq in batch.seqs],
            logit_rows=rows,
            device_ids=None if after is None else self._fed_ids(batch, after),
        )
        logits = self.forward(inputs)
        out = None if logits is None else self.sampler.sample(logits, sample_rows)
        host, ready = _copy_to_host(out)
        return LaunchedStep(batch, out, host, ready, [row.params.logprobs for row in sample_rows])

    def _fed_ids(self, batch: ScheduledBatch, after: LaunchedStep) -> torch.Tensor:
        """The tokens `after` sampled for `batch`'s sequences, in `batch`'s order (a device
        gather where some of `after`'s sequences have left)."""
        sampled = [seq for seq, s in zip(after.batch.seqs, after.batch.sampled) if s]
        if sampled == batch.seqs:
            return after.out.token_ids
        row_of = {id(seq): i for i, seq in enumerate(sampled)}
        index = to_device([row_of[id(seq)] for seq in batch.seqs], self.device, torch.int64)
        return after.out.token_ids.index_select(0, index)

    def collect(self, launched: LaunchedStep) -> StepResult:
        """Wait for a launched step and read its tokens: the step's one host sync, on its own
        copy to the host (a read of the device tensors would also wait for every step
        launched after it)."""
        out = launched.host
        if out is None:
            return StepResult([], [])
        if launched.ready is not None:
            launched.ready.synchronize()
        token_ids = out.token_ids.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(token_ids)
        if out.logprobs is not None:
            chosen = out.logprobs.tolist()
            top_ids = out.top_ids.tolist() if out.top_ids is not None else None
            top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
            for i, n_top in enumerate(launched.top_counts):
                if n_top is None:
                    continue
                top = ()
                if n_top and top_ids is not None and top_lps is not None:
                    top = tuple(zip(top_ids[i][:n_top], top_lps[i][:n_top]))
                logprobs[i] = TokenLogprob(token_ids[i], chosen[i], top)
        return StepResult(token_ids, logprobs)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """The model forward over one step; logits of `inputs.logit_rows` (None when there are
        none, or on a tensor-parallel worker)."""
        size = self.graphs.size_for(inputs) if self.graphs is not None else None
        if size is not None:
            logits = self.graphs.run(inputs, size)
            if logits is None or not inputs.logit_rows:
                return None
            if inputs.logit_rows == list(range(logits.shape[0])):
                return logits
            index = torch.tensor(inputs.logit_rows, dtype=torch.int64, device=self.device)
            return logits.index_select(0, index)
        ctx = make_context(
            self.cache,
            context_lens=inputs.context_lens,
            query_lens=inputs.query_lens,
            page_lists=inputs.page_lists,
            state_slots=inputs.state_slots,
            device=self.device,
        )
        ids = inputs.device_ids
        if ids is None:
            ids = torch.tensor(inputs.input_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(inputs.positions, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, pos, ctx)
        if not inputs.logit_rows:
            return None
        index = torch.tensor(inputs.logit_rows, dtype=torch.int64, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, index))

    def close(self) -> None:
        """Release what the runner holds beyond the model (tensor-parallel workers)."""
