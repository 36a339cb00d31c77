"""The body of each rank of the shared test world: every tensor-parallel case runs on a
subgroup of the first N ranks of one spawned gloo world, so the processes start once."""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import greedy_tokens

from ninfer.engine.config import EngineConfig
from ninfer.parallel.launch import ArtifactModel, ParallelGroup, load_rank

TIMEOUT = timedelta(seconds=60)


def engine_config(world: int, expert_parallel: bool) -> EngineConfig:
    return EngineConfig(
        max_context=256,
        max_concurrency=2,  # three prompts: the third is admitted into a reused state slot
        prefill_chunk=16,
        device="cpu",
        dtype="float32",
        tensor_parallel=world,
        expert_parallel=expert_parallel,
    )


def run_cases(rank: int, world: int, init_method: str, cases: list[dict], out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world, timeout=TIMEOUT
    )
    for case in cases:
        size = case["world"]
        ranks = list(range(size))
        device_group = dist.new_group(ranks, timeout=TIMEOUT)
        control_group = dist.new_group(ranks, timeout=TIMEOUT)
        if rank < size:
            group = ParallelGroup(rank, size, device_group, control_group)
            config = engine_config(size, case["expert_parallel"])
            loaded = load_rank(
                ArtifactModel(Path(case["path"])), config, group, torch.device("cpu"), torch.float32
            )
            if rank == 0:
                tokens = greedy_tokens(loaded, case["prompts"], case["max_tokens"])
                loaded.runner.close()
                loaded.check_integrity()
                Path(out_dir, f"{case['name']}.json").write_text(json.dumps(tokens))
            else:
                loaded.serve()
        dist.barrier()
    dist.destroy_process_group()


def load_with_little_memory(rank: int, world: int, init_method: str, path: str, out_dir: str):
    """Load a rank of the model while the host's free memory (as `host_available_bytes`
    reads it) is 1.5 times one rank's K/V pool and state slots: room for one rank, not for
    `world`. Writes what `load_rank` raised, or "loaded", to `out_dir`/<rank>.txt."""
    from ninfer.engine import engine
    from ninfer.errors import ConfigError
    from ninfer.parallel.shard import Shard

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world, timeout=TIMEOUT
    )
    device_group = dist.new_group(list(range(world)), timeout=TIMEOUT)
    control_group = dist.new_group(list(range(world)), timeout=TIMEOUT)
    group = ParallelGroup(rank, world, device_group, control_group)
    config = engine_config(world, False)
    source = ArtifactModel(Path(path))
    shard = source.load(torch.device("cpu"), torch.float32, Shard(rank, world, False, device_group))
    page_bytes = shard.cache_spec().page_bytes(torch.float32)
    pages = engine.pool_pages(config, page_bytes, torch.device("cpu"))
    kv_bytes, slot_bytes = engine.cache_bytes(config, shard, pages, False)
    engine.host_available_bytes = lambda: int(1.5 * (kv_bytes + slot_bytes))
    try:
        load_rank(source, config, group, torch.device("cpu"), torch.float32)
        outcome = "loaded"
    except ConfigError as error:
        outcome = str(error)
    Path(out_dir, f"{rank}.txt").write_text(outcome)
    dist.destroy_process_group()


def echo_steps(rank: int, init_method: str, steps: list, out_path: str) -> None:
    """Rank 0 sends `steps` ((StepInputs fields, fresh slots) pairs) over a `StepChannel`,
    then stop; rank 1 writes what it received to `out_path` as JSON."""
    from ninfer.engine.runner import StepInputs
    from ninfer.parallel.channel import StepChannel

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    channel = StepChannel(dist.new_group([0, 1], backend="gloo"))
    if rank == 0:
        for fields, fresh in steps:
            channel.send(StepInputs(*fields), fresh)
        channel.send_stop()
    else:
        received = []
        while (step := channel.receive()) is not None:
            inputs, fresh = step
            fields = [f.name for f in dataclasses.fields(inputs) if f.name != "device_ids"]
            received.append([[getattr(inputs, name) for name in fields], fresh])
        Path(out_path).write_text(json.dumps(received))
    dist.destroy_process_group()
