"""Rank 0 -> workers: each step's `StepInputs` (and the state slots handed out since the last
step, which the workers zero as rank 0's allocator did) packed into int64 values and
broadcast over a gloo group on CPU. Rank 0 owns scheduling and sampling; the workers only run
the same forward.

A step is one broadcast of `FIRST` values: the count, then the values (a decode step of up to
64 sequences fits); only a longer step sends the rest in a second broadcast. Rank 0 does not
wait for its broadcasts: it queues them and goes on to run its own share of the step, and
waits for them only before the next send. A gloo round trip on the host is of the order of a
tenth of a millisecond, and each one rank 0 waited for lengthened its step by that much.
A count of -1 tells the workers to stop."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ninfer.engine.runner import StepInputs

STOP = -1
# int64 values in every step's first broadcast, the count included (16 KiB)
FIRST = 2048


def pack(inputs: StepInputs, fresh_slots: list[int]) -> list[int]:
    """A step's inputs as one flat list of ints (`unpack` reads it back)."""
    header = [
        len(inputs.input_ids),
        len(inputs.query_lens),
        len(inputs.logit_rows),
        len(fresh_slots),
    ]
    values = header + inputs.input_ids + inputs.positions + inputs.context_lens
    values += inputs.query_lens + inputs.state_slots
    values += [len(pages) for pages in inputs.page_lists]
    for pages in inputs.page_lists:
        values += pages
    return values + inputs.logit_rows + fresh_slots


def unpack(values: list[int]) -> tuple[StepInputs, list[int]]:
    tokens, seqs, rows, fresh = values[:4]
    at = 4

    def take(n: int) -> list[int]:
        nonlocal at
        at += n
        return values[at - n : at]

    input_ids, positions = take(tokens), take(tokens)
    context_lens, query_lens, state_slots = take(seqs), take(seqs), take(seqs)
    page_lists = [take(n) for n in take(seqs)]
    inputs = StepInputs(
        input_ids, positions, context_lens, query_lens, page_lists, state_slots, take(rows)
    )
    return inputs, take(fresh)


class StepChannel:
    def __init__(self, group) -> None:
        self.group = group  # gloo group, long timeout: workers wait here while rank 0 is idle
        self._in_flight: list[tuple[object, torch.Tensor]] = []  # rank 0's unfinished sends

    def _broadcast(self, tensor: torch.Tensor, wait: bool = True) -> None:
        work = dist.broadcast(tensor, group=self.group, group_src=0, async_op=not wait)
        if not wait:
            self._in_flight.append((work, tensor))  # the tensor must live until it is sent

    def _finish_sends(self) -> None:
        for work, _ in self._in_flight:
            work.wait()
        self._in_flight.clear()

    def send(self, inputs: StepInputs, fresh_slots: list[int]) -> None:
        self._finish_sends()
        values = pack(inputs, fresh_slots)
        first = torch.zeros(FIRST, dtype=torch.int64)
        head = values[: FIRST - 1]
        first[0] = len(values)
        first[1 : 1 + len(head)] = torch.tensor(head, dtype=torch.int64)
        self._broadcast(first, wait=False)
        if len(values) > len(head):
            self._broadcast(torch.tensor(values[len(head) :], dtype=torch.int64), wait=False)

    def send_stop(self) -> None:
        self._finish_sends()
        first = torch.zeros(FIRST, dtype=torch.int64)
        first[0] = STOP
        self._broadcast(first)

    def receive(self) -> tuple[StepInputs, list[int]] | None:
        """The next step from rank 0, or None when it says stop."""
        first = torch.empty(FIRST, dtype=torch.int64)
        self._broadcast(first)
        count = int(first[0])
        if count == STOP:
            return None
        values = first[1 : 1 + min(count, FIRST - 1)].tolist()
        if count > FIRST - 1:
            rest = torch.empty(count - (FIRST - 1), dtype=torch.int64)
            self._broadcast(rest)
            values += rest.tolist()
        return unpack(values)
