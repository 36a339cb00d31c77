"""Starting a tensor-parallel engine: one process per rank, either spawned by ninfer itself
(rank 0 is the calling process; ranks 1..N-1 are `torch.multiprocessing` spawn children) or
started by torchrun (every rank runs the same command; ranks other than 0 turn into workers
inside `Engine` construction and exit when rank 0 closes).

Every rank loads the model from the same source (a `.ninfer` file, `ArtifactModel`; or the
bench's random weights) and keeps its own slice (`Shard`); the pools are sized per rank and all
ranks agree on the smallest page count. On CUDA in half precision every rank captures the same
decode graphs, the model's collectives inside them, in the same order. Rank 0 returns an
`EngineCore` whose runner broadcasts each step to the workers (`ParallelRunner`); each worker
then runs the same forward, replaying its own graph where rank 0 replays one.

A rank that dies must not leave the others hanging: rank 0 watches its spawned workers and ends
the whole process with an error as soon as one exits unasked (`RankWatchdog`), workers exit
when rank 0 goes away, and every model collective has a timeout.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.connection
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ninfer.engine.config import EngineConfig
from ninfer.engine.core import EngineCore
from ninfer.engine.kv_pool import ModelCache, StateSlotAllocator
from ninfer.engine.runner import ModelRunner, StepInputs
from ninfer.errors import ConfigError
from ninfer.parallel.channel import StepChannel
from ninfer.parallel.shard import Shard

log = logging.getLogger("ninfer.parallel")

# NVLink multicast (NVLS / symmetric-memory multicast) stays off on every rank
NCCL_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# a model collective that waits longer than this fails (a rank is stuck or gone)
COLLECTIVE_TIMEOUT_S = float(os.environ.get("NINFER_COLLECTIVE_TIMEOUT_S", "300"))
# the step channel waits as long as rank 0 has nothing to run
IDLE_TIMEOUT = timedelta(days=365)
RANK_FAILED_EXIT = 1


@dataclass(slots=True)
class ParallelGroup:
    """The ranks of one model: `device_group` carries the model's collectives (NCCL on GPU,
    gloo on CPU, bounded timeout), `control_group` the step channel (gloo on CPU)."""

    rank: int
    world: int
    device_group: Any
    control_group: Any


def set_collective_env() -> None:
    os.environ.update(NCCL_ENV)


def init_group(rank: int, world: int, init_method: str, device: torch.device) -> ParallelGroup:
    set_collective_env()
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        device_id=device if device.type == "cuda" else None,
    )
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return ParallelGroup(rank, world, dist.group.WORLD, control)


def rank_device(config: EngineConfig, local_rank: int) -> tuple[torch.device, torch.dtype]:
    from ninfer.engine.engine import resolve_device

    device, dtype = resolve_device(config)
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"tensor-parallel rank {local_rank} needs GPU {local_rank}; "
                f"{torch.cuda.device_count()} present"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device, dtype


# ---- what every rank loads -----------------------------------------------------------------


class ModelSource(Protocol):
    """Where every rank's model comes from; pickled to the spawned ranks."""

    def hf_config(self) -> dict[str, Any]: ...

    def load(self, device: torch.device, dtype: torch.dtype, shard: Shard) -> torch.nn.Module:
        """This rank's slice of the model."""
        ...

    def frontend(self) -> tuple[Any, tuple[int, ...]]:
        """Rank 0's chat frontend (None without a tokenizer) and stop token ids."""
        ...


@dataclass(frozen=True, slots=True)
class ArtifactModel:
    """A `.ninfer` file: every rank opens (mmaps) it and reads only its slice."""

    path: Path

    def hf_config(self) -> dict[str, Any]:
        from ninfer.artifact import Artifact

        return Artifact.open(self.path).config()

    def load(self, device: torch.device, dtype: torch.dtype, shard: Shard) -> torch.nn.Module:
        from ninfer.artifact import Artifact
        from ninfer.models.registry import load_model

        artifact = Artifact.open(self.path)
        return load_model(artifact, artifact.config(), device=device, dtype=dtype, shard=shard)

    def frontend(self) -> tuple[Any, tuple[int, ...]]:
        from ninfer.artifact import Artifact
        from ninfer.engine.engine import load_frontend

        return load_frontend(Artifact.open(self.path))


# ---- one rank ------------------------------------------------------------------------------


class HandedOutSlots(StateSlotAllocator):
    """Rank 0's slot allocator: remembers the slots it hands out (and so zeroes) until the next
    step tells the workers to zero them too."""

    def __init__(self, num_slots: int, tensors) -> None:
        super().__init__(num_slots, tensors)
        self.handed_out: list[int] = []

    def allocate(self, owner) -> int:
        slot = super().allocate(owner)
        self.handed_out.append(slot)
        return slot

    def take_handed_out(self) -> list[int]:
        slots, self.handed_out = self.handed_out, []
        return slots


class ParallelRunner(ModelRunner):
    """Rank 0's runner: sends each step to the workers, then runs its own share of it."""

    steps_ahead = False  # the workers take a step's ids from the host

    def __init__(self, model, cache, sampler, channel: StepChannel, on_close=None) -> None:
        super().__init__(model, cache, sampler)
        self.channel = channel
        self._on_close = on_close
        self._closed = False

    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        self.channel.send(inputs, self.cache.slots.take_handed_out())
        return super().forward(inputs)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.channel.send_stop()
        except Exception as exc:  # a worker already gone: the watchdog reports it
            log.warning("could not stop the tensor-parallel workers: %r", exc)
        release_graphs(self)
        if self._on_close is not None:
            self._on_close()


def release_graphs(runner: ModelRunner) -> None:
    """Destroy a rank's decode graphs before its process group (DecodeGraphs.release)."""
    if runner.graphs is not None:
        runner.graphs.release()
        runner.graphs = None


class Worker:
    """A rank > 0: runs every step rank 0 sends until it says stop."""

    def __init__(self, model, cache: ModelCache, channel: StepChannel) -> None:
        self.runner = ModelRunner(model, cache, sampler=None)
        self.cache = cache
        self.channel = channel

    def serve(self) -> None:
        slot_tensors = [*self.cache.gdn_state, *self.cache.conv_window]
        while (step := self.channel.receive()) is not None:
            inputs, fresh_slots = step
            for slot in fresh_slots:
                for tensor in slot_tensors:
                    tensor[slot].zero_()
            self.runner.forward(inputs)
        release_graphs(self.runner)


def load_rank(
    source: ModelSource,
    config: EngineConfig,
    group: ParallelGroup,
    device: torch.device,
    dtype: torch.dtype,
    on_close=None,
) -> EngineCore | Worker:
    """Load this rank's slice of the model and its pools; rank 0 gets the engine core."""
    from ninfer.engine.engine import (
        build_core,
        cache_bytes,
        cache_reserve_bytes,
        check_host_cache,
        host_available_bytes,
        model_cache,
        pool_pages,
        uses_cuda_graphs,
        warm_up_kernels,
    )
    from ninfer.engine.graphs import capture_sizes

    shard = Shard(group.rank, group.world, config.expert_parallel, group.device_group)
    model = source.load(device, dtype, shard)
    spec = model.cache_spec()
    graphs = uses_cuda_graphs(config, model)
    reserve = cache_reserve_bytes(config, model, graphs)
    pages = torch.tensor([pool_pages(config, spec.page_bytes(dtype), device, reserve)])
    dist.all_reduce(pages, op=dist.ReduceOp.MIN, group=group.control_group)
    num_pages = int(pages.item())
    if device.type == "cpu":
        # The ranks on this host allocate their caches side by side: every rank checks them
        # together against the least free memory any of them reads, so all agree
        available = host_available_bytes()
        least = torch.tensor([-1 if available is None else available], dtype=torch.int64)
        dist.all_reduce(least, op=dist.ReduceOp.MIN, group=group.control_group)
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", group.world))
        kv_bytes, slot_bytes = cache_bytes(config, model, num_pages, graphs)
        known = int(least.item()) if least.item() >= 0 else None
        check_host_cache(num_pages, kv_bytes, slot_bytes, known, ranks)
    channel = StepChannel(group.control_group)
    if group.rank != 0:
        if device.type == "cuda":
            warm_up_kernels(model)
        cache = model_cache(config, model, num_pages, graphs)
        worker = Worker(model, cache, channel)
        if graphs:  # the same sizes in the same order as rank 0's build_core
            worker.runner.capture_graphs(config.max_context, capture_sizes(config.max_concurrency))
        return worker
    frontend, eos = source.frontend()
    core = build_core(model, config, frontend=frontend, eos_token_ids=eos, num_pages=num_pages)
    cache = core.cache
    cache.slots = HandedOutSlots(cache.num_slots, [*cache.gdn_state, *cache.conv_window])
    runner = ParallelRunner(model, cache, core.sampler, channel, on_close)
    runner.graphs = core.runner.graphs
    core.runner = runner
    return core


def check_shardable(source: ModelSource, config: EngineConfig) -> None:
    """Refuse a split the model's shapes do not allow before any process is started."""
    from ninfer.models.qwen3_5 import Qwen3_5Config
    from ninfer.models.registry import model_class

    hf_config = source.hf_config()
    parsed = Qwen3_5Config.from_hf(hf_config, is_moe=model_class(hf_config).is_moe)
    if config.expert_parallel and not parsed.is_moe:
        raise ConfigError("--expert-parallel needs a MoE model")
    for rank in range(config.tensor_parallel):
        shard = Shard(rank, config.tensor_parallel, config.expert_parallel)
        shard.local_config(parsed)
        if parsed.is_moe:
            shard.experts(parsed.num_experts)


# ---- starting the ranks --------------------------------------------------------------------


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def load_parallel_core(source: ModelSource | Path, config: EngineConfig) -> EngineCore:
    """Rank 0's engine core over `config.tensor_parallel` ranks (spawned here or by torchrun);
    a path is a `.ninfer` file."""
    if isinstance(source, Path):
        source = ArtifactModel(source)
    check_shardable(source, config)
    if under_torchrun():
        return _torchrun_rank(source, config)
    return _spawn_ranks(source, config)


def _torchrun_rank(source: ModelSource, config: EngineConfig) -> EngineCore:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != config.tensor_parallel:
        raise ConfigError(
            f"torchrun started {world} processes but --tensor-parallel is {config.tensor_parallel}"
        )
    device, dtype = rank_device(config, int(os.environ.get("LOCAL_RANK", rank)))
    group = init_group(rank, world, "env://", device)
    loaded = load_rank(source, config, group, device, dtype, on_close=dist.destroy_process_group)
    if isinstance(loaded, EngineCore):
        return loaded
    _serve_worker(loaded, rank)
    dist.destroy_process_group()
    raise SystemExit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_ranks(source: ModelSource, config: EngineConfig) -> EngineCore:
    import torch.multiprocessing as mp

    set_collective_env()
    world = config.tensor_parallel
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    context = mp.get_context("spawn")
    workers = [
        context.Process(
            target=_worker_main,
            args=(rank, world, init_method, source, dataclasses.asdict(config), os.getpid()),
            name=f"ninfer-rank{rank}",
            daemon=True,
        )
        for rank in range(1, world)
    ]
    for process in workers:
        process.start()
    watchdog = RankWatchdog(workers)
    try:
        device, dtype = rank_device(config, 0)
        _share_cores(device, world)
        group = init_group(0, world, init_method, device)
        core = load_rank(source, config, group, device, dtype, on_close=watchdog.stop)
    except BaseException:
        watchdog.stop(graceful=False)
        raise
    assert isinstance(core, EngineCore)
    return core


def _worker_main(
    rank: int,
    world: int,
    init_method: str,
    source: ModelSource,
    config_fields: dict[str, Any],
    parent_pid: int,
) -> None:
    _exit_with_parent(parent_pid, rank)
    config = EngineConfig(**config_fields)
    device, dtype = rank_device(config, rank)
    _share_cores(device, world)
    try:
        group = init_group(rank, world, init_method, device)
        worker = load_rank(source, config, group, device, dtype)
    except Exception as exc:
        print(f"ninfer: tensor-parallel rank {rank} failed to load: {exc}", file=sys.stderr)
        os._exit(RANK_FAILED_EXIT)
    assert isinstance(worker, Worker)
    _serve_worker(worker, rank)
    dist.destroy_process_group()


def _share_cores(device: torch.device, world: int) -> None:
    """On CPU the ranks split the cores; more threads than cores makes every collective wait
    for a descheduled peer."""
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))


def _serve_worker(worker: Worker, rank: int) -> None:
    try:
        worker.serve()
    except Exception as exc:  # rank 0 or a peer went away mid-step
        print(f"ninfer: tensor-parallel rank {rank} stopped: {exc}", file=sys.stderr, flush=True)
        os._exit(RANK_FAILED_EXIT)


def _exit_with_parent(parent_pid: int, rank: int) -> None:
    """A spawned worker whose rank 0 is gone has nothing left to do."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        print(f"ninfer: tensor-parallel rank {rank}: rank 0 is gone", file=sys.stderr, flush=True)
        os._exit(RANK_FAILED_EXIT)

    threading.Thread(target=watch, name="ninfer-parent-watch", daemon=True).start()


class RankWatchdog:
    """Rank 0's watch over its spawned workers: one that exits while the engine runs ends
    this process with a clear error (a server or a CLI run cannot go on with a missing rank,
    and its collectives would otherwise wait for it)."""

    def __init__(self, workers) -> None:
        self.workers = workers
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name="ninfer-rank-watchdog", daemon=True
        )
        self._thread.start()

    def _watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.workers, start=1)}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._stopping.is_set():
            return
        rank, process = sentinels[ready[0]]
        process.join(timeout=1)
        print(
            f"ninfer: error: tensor-parallel rank {rank} (pid {process.pid}) exited with "
            f"{_describe_exit(process.exitcode)}; stopping all ranks",
            file=sys.stderr,
            flush=True,
        )
        self._kill_all()
        os._exit(RANK_FAILED_EXIT)

    def _kill_all(self) -> None:
        for process in self.workers:
            if process.is_alive():
                process.kill()

    def stop(self, graceful: bool = True) -> None:
        """The engine is closing: let the workers finish (they were told to stop)."""
        self._stopping.set()
        deadline = time.monotonic() + (10.0 if graceful else 0.0)
        for process in self.workers:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill_all()
        if dist.is_initialized():
            dist.destroy_process_group()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "an unknown status"
    if code < 0:
        import signal

        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
