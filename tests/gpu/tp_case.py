"""One tensor-parallel engine run for tests/gpu/test_parallel_gpu.py, in a process of its own
(each run starts and ends its own NCCL world): greedy tokens of every prompt and the logits
each token was chosen from, saved with torch.save.

    python tests/gpu/tp_case.py MODEL OUT --world N [--expert-parallel] [--dtype D]
        [--no-cuda-graph]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from helpers import greedy_tokens

from ninfer.engine.config import EngineConfig
from ninfer.engine.engine import load_core

PROMPTS = [list(range(3, 43)), [7, 8, 9], [100, 200, 300, 400, 5, 6]]
MAX_TOKENS = 12


def record(core) -> dict[str, list[torch.Tensor]]:
    """Wrap the core's runner so that every sampled row's logits are kept, by request id:
    the logits a launch computes are kept with it until the step is read back (a step may be
    launched before the one before it is read back)."""
    runner = core.runner
    forward, launch, collect = runner.forward, runner.launch, runner.collect
    logits_by_request: dict[str, list[torch.Tensor]] = {}
    computed: list[torch.Tensor | None] = [None]
    launched_logits: dict[int, torch.Tensor | None] = {}

    def recording_forward(inputs):
        logits = forward(inputs)
        computed[0] = None if logits is None else logits.float().cpu()
        return logits

    def recording_launch(batch, **kwargs):
        computed[0] = None
        launched = launch(batch, **kwargs)
        launched_logits[id(launched)] = computed[0]
        return launched

    def recording_collect(launched):
        result = collect(launched)
        logits = launched_logits.pop(id(launched))
        batch = launched.batch
        ids = [seq.request.request_id for seq, s in zip(batch.seqs, batch.sampled) if s]
        if logits is not None:
            for row, request_id in enumerate(ids):
                logits_by_request.setdefault(request_id, []).append(logits[row])
        return result

    runner.forward = recording_forward
    runner.launch, runner.collect = recording_launch, recording_collect
    return logits_by_request


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--expert-parallel", action="store_true")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--no-cuda-graph", action="store_true")
    args = parser.parse_args()
    config = EngineConfig(
        max_context=256,
        max_concurrency=2,  # three prompts: the third is admitted into a reused state slot
        prefill_chunk=16,
        device="cuda",
        dtype=args.dtype,
        tensor_parallel=args.world,
        expert_parallel=args.expert_parallel,
        cuda_graph=not args.no_cuda_graph,
    )
    core = load_core(args.model, config)
    graphs = core.runner.graphs is not None
    logits = record(core)
    tokens = {f"r{i}": t for i, t in enumerate(greedy_tokens(core, PROMPTS, MAX_TOKENS))}
    core.check_integrity()
    core.runner.close()
    torch.save({"tokens": tokens, "logits": logits, "graphs": graphs}, args.out)


if __name__ == "__main__":
    main()
