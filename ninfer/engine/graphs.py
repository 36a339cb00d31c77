"""CUDA graphs for decode steps: the whole decode forward plus the logits, captured at engine
start for each batch size in `capture_sizes`, replayed with the step's inputs copied into
static buffers. The sampler stays outside (its work depends on each request's settings).

A batch runs on the smallest captured size that holds it; the rows past the batch (padding)
decode token 0 at position 0 into the pools' scratch page and scratch slot
(`ModelCache(scratch=True)`), and their logits are never read. Every row of a decode forward
is independent of the others, so padding cannot change a real row's result. The attention
split is sized at capture for `max_context` (a host int), so a replay never needs a host value
that depends on the batch. Graph capture needs every kernel on the path to be free of host syncs:
the Triton kernels in half precision are (fp32 runs some torch references, so graphs are used
in bf16/fp16 only).

Each size is captured as a few graphs that split the decoder layers (`SEGMENT_STARTS`) and are
launched back to back. Launching a graph costs the host about 0.3 us per kernel, 0.3 ms for a
27B step of ~1100 kernels, and the device starts a graph only once its launch returns: one
whole-step graph left the device idle that long every step. A first piece of one layer starts
within microseconds, and the host launches each next piece while the device runs the ones
before it: no piece is more than three times as long as all before it, while the device takes
10-25 times longer to run a kernel than the host takes to launch it."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ninfer.engine.kv_pool import PAGE_SIZE, ModelCache
from ninfer.models.context import ForwardContext

if TYPE_CHECKING:
    from ninfer.engine.runner import StepInputs

log = logging.getLogger("ninfer.engine")

GRAPH_DTYPES = (torch.bfloat16, torch.float16)
# A decode step's graphs begin at these decoder layers (and at the first).
SEGMENT_STARTS = (1, 4, 16)


def capture_sizes(max_concurrency: int) -> list[int]:
    """Batch sizes captured at start: every size up to `max_concurrency`, so no decode step
    pays for padding rows."""
    return list(range(1, max_concurrency + 1))


def graph_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds `num_seqs` rows; None when none does."""
    fitting = [s for s in sizes if s >= num_seqs]
    return min(fitting) if fitting and num_seqs > 0 else None


@dataclass(slots=True)
class DecodeBuffers:
    """The inputs of one decode forward of up to `max_rows` rows, as flat tensors: a pinned
    host copy is filled each step, then copied into the device copy the graphs read."""

    input_ids: torch.Tensor  # int64 [R]
    positions: torch.Tensor  # int64 [R]
    kv_write_slots: torch.Tensor  # int64 [R]
    context_lens: torch.Tensor  # int32 [R]
    seq_lens: torch.Tensor  # int32 [R]
    state_slots: torch.Tensor  # int32 [R]
    page_table: torch.Tensor  # int32 [R, max_pages]

    @classmethod
    def allocate(
        cls, max_rows: int, max_pages: int, device: torch.device | str, pin: bool = False
    ) -> DecodeBuffers:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)

        return cls(
            input_ids=zeros(max_rows, dtype=torch.int64),
            positions=zeros(max_rows, dtype=torch.int64),
            kv_write_slots=zeros(max_rows, dtype=torch.int64),
            context_lens=zeros(max_rows, dtype=torch.int32),
            seq_lens=zeros(max_rows, dtype=torch.int32),
            state_slots=zeros(max_rows, dtype=torch.int32),
            page_table=zeros(max_rows, max_pages, dtype=torch.int32),
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (
            self.input_ids,
            self.positions,
            self.kv_write_slots,
            self.context_lens,
            self.seq_lens,
            self.state_slots,
            self.page_table,
        )

    def copy_rows_from(self, host: DecodeBuffers, rows: int) -> None:
        """Copy the first `rows` rows of `host` in (asynchronously from pinned memory: `host`
        must not be filled again until the device has run the copy; `DecodeGraphs.stage`)."""
        for dst, src in zip(self.tensors(), host.tensors()):
            dst[:rows].copy_(src[:rows], non_blocking=True)


def fill_decode_rows(
    buffers: DecodeBuffers, inputs: StepInputs, rows: int, scratch_page: int, scratch_slot: int
) -> None:
    """Write a decode step's inputs into the first `rows` rows of host `buffers`: the batch's
    sequences first, then padding rows that decode token 0 at position 0 into the scratch page
    and slot."""
    num_seqs = len(inputs.query_lens)
    max_pages = buffers.page_table.shape[1]
    if num_seqs > rows:
        raise ValueError(f"{num_seqs} sequences do not fit a graph of {rows} rows")
    if any(q != 1 for q in inputs.query_lens):
        raise ValueError("a graph runs decode steps only (one new token per sequence)")
    # Written through numpy views of the host tensors: a torch op per field and per page list
    # took 70 us of host time per step at one row and 209 us at eight (2-core development
    # machine); this takes 18 and 54 us.
    table = buffers.page_table.numpy()
    table[:rows] = -1
    for i, (pages, context) in enumerate(zip(inputs.page_lists, inputs.context_lens)):
        if len(pages) > max_pages or len(pages) * PAGE_SIZE <= context:
            raise ValueError(
                f"sequence {i}: {len(pages)} pages for {context + 1} tokens (graph holds "
                f"{max_pages} pages)"
            )
        table[i, : len(pages)] = pages
    table[num_seqs:rows, 0] = scratch_page
    contexts = np.asarray(inputs.context_lens, dtype=np.int64)
    write_slots = [
        pages[c // PAGE_SIZE] * PAGE_SIZE + c % PAGE_SIZE
        for pages, c in zip(inputs.page_lists, inputs.context_lens)
    ]
    for field, values, pad in (
        (buffers.input_ids, inputs.input_ids, 0),
        (buffers.positions, inputs.positions, 0),
        (buffers.context_lens, contexts, 0),
        (buffers.seq_lens, contexts + 1, 1),
        (buffers.state_slots, inputs.state_slots, scratch_slot),
        (buffers.kv_write_slots, write_slots, scratch_page * PAGE_SIZE),
    ):
        array = field.numpy()
        array[:num_seqs] = values
        array[num_seqs:rows] = pad


def graph_memory_bytes(
    config, max_concurrency: int, max_context: int, encoded_experts: bool = False
) -> int:
    """What the captured graphs may keep in their memory pool: the largest decode forward's
    activations, logits and kernel workspaces (a bound, counted before the K/V pool is sized).
    Dense MoE experts gather each token's expert weights; encoded ones only hold the
    (token, choice) pairs' activations."""
    rows = max_concurrency
    widest = max(
        config.hidden_size * 4,  # q_proj packs query and gate
        config.num_heads * config.head_dim * 2,
        config.intermediate_size or 0,
        2 * config.linear_num_key_heads * config.linear_key_head_dim
        + config.linear_num_value_heads * config.linear_value_head_dim,
    )
    activations = rows * widest * 4 * 16
    logits = rows * config.vocab_size * 4 * 3
    max_pages = math.ceil(max_context / PAGE_SIZE)
    attention = rows * config.num_heads * max_pages * (config.head_dim + 2) * 4
    experts = 0
    if config.is_moe and encoded_experts:
        pairs = rows * (config.num_experts_per_tok + 1)  # and the stacked shared expert's
        experts = pairs * (3 * config.moe_intermediate_size + 2 * config.hidden_size) * 2 * 2
    elif config.is_moe:
        experts = rows * 3 * config.moe_intermediate_size * config.hidden_size * 2 * 2
    return (256 << 20) + activations + logits + attention + experts


class DecodeGraphs:
    """The captured decode graphs of one model and cache, and their static buffers."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: ModelCache,
        *,
        max_context: int,
        sizes: Sequence[int],
    ) -> None:
        if cache.scratch_page is None or cache.scratch_slot is None:
            raise ValueError("CUDA graphs need a cache with a scratch page and slot")
        self.model = model
        self.cache = cache
        self.sizes = sorted(set(sizes))
        self.max_context = max_context
        self.max_pages = math.ceil(max_context / PAGE_SIZE)
        device = model.device
        rows = self.sizes[-1]
        # Two pinned host copies, used in turn: a step's copy to the device is queued behind
        # the work before it, and with overlapped steps (EngineCore.step) the next step is
        # staged while that work may still run; the copy two steps back has been read by then
        # (the step before the next was read back).
        pin = device.type == "cuda"
        self.hosts = [DecodeBuffers.allocate(rows, self.max_pages, "cpu", pin=pin) for _ in "ab"]
        self._turn = 0
        self.static = DecodeBuffers.allocate(rows, self.max_pages, device)
        self.query_start = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.logits: dict[int, torch.Tensor | None] = {}  # None on a tensor-parallel worker

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every size, largest first, in one shared memory pool. All rows
        are padding meanwhile, so capture writes only the scratch page and slot."""
        from ninfer.engine.runner import StepInputs

        rows = self.sizes[-1]
        self.stage(StepInputs([], [], [], [], [], [], []), rows)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        free_before = torch.cuda.mem_get_info()[0]
        for size in reversed(self.sizes):
            self.forward_static(size)  # compiles the kernels outside the capture
            torch.cuda.synchronize()
            self.graphs[size], self.logits[size] = self._capture_segments(size, pool)
        torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info()[0]
        log.info(
            "captured %d decode graphs (sizes 1..%d), %.1f MiB",
            len(self.graphs),
            rows,
            used / 2**20,
        )

    def _capture_segments(
        self, size: int, pool
    ) -> tuple[list[torch.cuda.CUDAGraph], torch.Tensor | None]:
        """`forward_static(size)` captured as one graph per segment: a pre-hook on each
        segment's first decoder layer ends the running capture and begins the next, all in one
        memory pool, so the tensors one piece hands to the next stay where they are."""
        layers = getattr(self.model, "layers", ())
        starts = [layers[i] for i in SEGMENT_STARTS if i < len(layers)]
        graphs = [torch.cuda.CUDAGraph() for _ in range(len(starts) + 1)]
        index = 0
        capturing = False

        def next_segment(module, args) -> None:
            nonlocal index, capturing
            if index + 1 == len(graphs):
                raise RuntimeError("a decoder layer that starts a decode graph ran twice")
            graphs[index].capture_end()
            capturing = False
            index += 1
            graphs[index].capture_begin(pool=pool)
            capturing = True

        stream = torch.cuda.Stream(self.model.device)
        stream.wait_stream(torch.cuda.current_stream())
        handles = [layer.register_forward_pre_hook(next_segment) for layer in starts]
        try:
            with torch.cuda.stream(stream):
                graphs[0].capture_begin(pool=pool)
                capturing = True
                logits = self.forward_static(size)
                graphs[index].capture_end()
                capturing = False
        except BaseException:
            if capturing:  # end the capture, or the stream stays unusable for what follows
                try:
                    graphs[index].capture_end()
                except RuntimeError:
                    pass
            raise
        finally:
            for handle in handles:
                handle.remove()
        torch.cuda.current_stream().wait_stream(stream)
        if index + 1 != len(graphs):
            raise RuntimeError(
                f"decode graphs: {len(graphs) - 1 - index} decoder layers that start a piece "
                "did not run in the forward"
            )
        return graphs, logits

    def stage(self, inputs: StepInputs, size: int) -> None:
        """Put a decode step's inputs, padded to `size` rows, into the static buffers."""
        host = self.hosts[self._turn]
        self._turn ^= 1
        fill_decode_rows(host, inputs, size, self.cache.scratch_page, self.cache.scratch_slot)
        self.static.copy_rows_from(host, size)
        if inputs.device_ids is not None:  # the ids a step still in flight samples
            self.static.input_ids[: len(inputs.device_ids)].copy_(inputs.device_ids)

    def forward_static(self, size: int) -> torch.Tensor | None:
        """The decode forward over the first `size` rows of the static buffers, then the
        logits of every row (None on a tensor-parallel worker): what each graph captures."""
        s = self.static
        ctx = ForwardContext(
            is_decode=True,
            query_start=self.query_start[: size + 1],
            context_lens=s.context_lens[:size],
            seq_lens=s.seq_lens[:size],
            page_table=s.page_table[:size],
            kv_write_slots=s.kv_write_slots[:size],
            state_slots=s.state_slots[:size],
            cache=self.cache,
            max_query_len=1,
            max_seq_len=self.max_context,
        )
        hidden = self.model(s.input_ids[:size], s.positions[:size], ctx)
        return self.model.compute_logits(hidden)

    def release(self) -> None:
        """Destroy the captured graphs now. A tensor-parallel rank must, before it destroys its
        process group: the NCCL kernels captured in them hold the communicator, and tearing it
        down under live graphs does not return."""
        torch.cuda.synchronize()
        for pieces in self.graphs.values():
            for graph in pieces:
                graph.reset()
        self.graphs.clear()
        self.logits.clear()

    def size_for(self, inputs: StepInputs) -> int | None:
        """The graph that runs `inputs`, or None (not a decode step, or too many sequences)."""
        if not inputs.query_lens or any(q != 1 for q in inputs.query_lens):
            return None
        return graph_size(len(inputs.query_lens), self.sizes)

    def run(self, inputs: StepInputs, size: int) -> torch.Tensor | None:
        """Replay the graph of `size` on `inputs`; fp32 logits of every sequence [B, V] (a
        view of the graph's output, valid until the next replay), None on a tensor-parallel
        worker (rank 0 gathers the logits)."""
        self.stage(inputs, size)
        for graph in self.graphs[size]:
            graph.replay()
        logits = self.logits[size]
        return None if logits is None else logits[: len(inputs.query_lens)]
