"""Vocab-parallel embedding: each rank holds a contiguous block of vocabulary rows, looks up
the ids that fall in it (zeros for the others) and the ranks sum their rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.parallel.shard import Shard


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, shard: Shard) -> None:
        super().__init__()
        self.rows = shard.vocab_rows(vocab_size)
        self.shard = shard
        self.weight = nn.Parameter(torch.empty(len(self.rows), hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.rows.start
        outside = (local < 0) | (local >= len(self.rows))
        embedded = F.embedding(local.masked_fill(outside, 0), self.weight)
        embedded.masked_fill_(outside[:, None], 0)
        return self.shard.all_reduce(embedded)
