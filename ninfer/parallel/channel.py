"""Rank 0 -> workers: each step's `StepInputs` (and the state slots handed out since the last
step, which the workers zero as rank 0's allocator did) packed into one int64 tensor and
broadcast over a gloo group on CPU. Rank 0 owns scheduling and sampling; the workers only run
the same forward. A length of -1 tells the workers to stop."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ninfer.engine.runner import StepInputs

STOP = -1


class StepChannel:
    def __init__(self, group) -> None:
        self.group = group  # gloo group, long timeout: workers wait here while rank 0 is idle

    def _broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, group=self.group, group_src=0)

    def send(self, inputs: StepInputs, fresh_slots: list[int]) -> None:
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
        values += inputs.logit_rows + fresh_slots
        payload = torch.tensor(values, dtype=torch.int64)
        self._broadcast(torch.tensor([payload.numel()], dtype=torch.int64))
        self._broadcast(payload)

    def send_stop(self) -> None:
        self._broadcast(torch.tensor([STOP], dtype=torch.int64))

    def receive(self) -> tuple[StepInputs, list[int]] | None:
        """The next step from rank 0, or None when it says stop."""
        length = torch.empty(1, dtype=torch.int64)
        self._broadcast(length)
        if length.item() == STOP:
            return None
        payload = torch.empty(int(length.item()), dtype=torch.int64)
        self._broadcast(payload)
        values = payload.tolist()
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
