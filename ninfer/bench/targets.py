"""The engines a bench run times. `NinferTarget` drives an `EngineCore` step by step (scheduler,
runner, sampler: everything a served request pays for) and times each step, and on CUDA the
device work of each decode step; `HFTarget` runs transformers on the same shape as the peer row.
Both return the same `StepRecord`s."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.profiler import record_function

from ninfer.bench.cases import BenchCase, StepRecord
from ninfer.engine.config import EngineConfig
from ninfer.engine.kv_pool import PAGE_SIZE
from ninfer.engine.request import GenerationRequest, SamplingParams


def random_prompts(case: BenchCase, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (case.concurrency, case.prompt_tokens), generator=generator)
    return ids.tolist()


def random_weights(
    config: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random tensors for every text weight of `config`, by logical name, made on `device`
    (matrices ~ N(0, 1/K), so activations stay in range through real depths; 1-D weights small)."""
    from ninfer.models.qwen3_5 import Qwen3_5Config, logical_name
    from ninfer.models.registry import model_class

    cls = model_class(config)
    parsed = Qwen3_5Config.from_hf(config, is_moe=cls.is_moe)
    with torch.device("meta"):
        skeleton = cls(parsed, with_mtp=False, device="meta")
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, param in skeleton.named_parameters():
        value = torch.empty(param.shape, device=device, dtype=dtype)
        if name.endswith(("A_log", "dt_bias")):
            value.normal_(0.0, 0.5, generator=generator)
        elif param.dim() >= 2 and not name.endswith("conv1d.weight"):
            value.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)
        else:
            value.normal_(0.0, 0.1, generator=generator)
        tensors[logical_name(name)] = value
    return tensors


def random_model(
    config: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    format_of=None,
    shard=None,
):
    """The model on random weights. With `format_of` (logical name, shape -> stored format)
    and where the model runs quantized linears (CUDA, half precision), every matrix stored in
    a GEMV format, the stacked [E, N, K] MoE experts included, is encoded on the device and
    kept encoded, as loading an artifact would (a stacked tensor is encoded as its E * N rows,
    the planes an artifact stores for it; formats the loader widens, q5/q6, are encoded too). With a `shard`, this rank's slice of the same
    weights (every rank draws all of them from one seed)."""
    from ninfer.models.layers.linear import GEMV_FORMATS, WIDENED_FORMATS
    from ninfer.models.qwen3_5 import runs_quantized
    from ninfer.models.registry import load_model
    from ninfer.models.weights import StateDictSource
    from ninfer.parallel.shard import Shard
    from ninfer.quant import get_format

    shard = shard or Shard()
    tensors = random_weights(config, device, dtype, seed)
    encoded = {}
    if format_of is not None and runs_quantized(device, dtype):
        for name in list(tensors):
            if tensors[name].dim() < 2:
                continue
            chosen = format_of(name, tuple(tensors[name].shape))
            if chosen in GEMV_FORMATS | WIDENED_FORMATS:
                encoded[name] = get_format(chosen).encode(tensors.pop(name), rows_per_slab=4096)
    source = StateDictSource(tensors, encoded)
    return load_model(source, config, device=device, dtype=dtype, shard=shard)


@dataclass(frozen=True, slots=True)
class RandomModel:
    """Random weights in a named shape as the model source of every tensor-parallel rank
    (`ninfer.parallel.launch.ModelSource`): each rank draws the whole model from the seed on
    its own device and keeps its slice, encoded where the formats keep it encoded."""

    config: dict[str, Any]
    seed: int = 0
    weights: str = "bf16"  # the stored formats they stand for (bench --weights)

    def hf_config(self) -> dict[str, Any]:
        return self.config

    def load(self, device: torch.device, dtype: torch.dtype, shard) -> torch.nn.Module:
        from ninfer.bench.traffic import profile_formats

        format_of = profile_formats(self.config, self.weights)
        return random_model(self.config, device, dtype, self.seed, format_of, shard=shard)

    def frontend(self) -> tuple[Any, tuple[int, ...]]:
        return None, ()  # no eos ids: every request runs its full length


def executed_formats(model: torch.nn.Module) -> str:
    """How the model's linears and experts execute: the dense dtype, plus the formats kept
    encoded."""
    from ninfer.models.layers.linear import GroupwiseLinear
    from ninfer.models.layers.moe import GroupwiseExperts

    dense = str(next(model.parameters()).dtype).removeprefix("torch.")
    kept = (GroupwiseLinear, GroupwiseExperts)
    formats = {m.format for m in model.modules() if isinstance(m, kept)}
    # and those read as stored at one row beside their widened form (`GroupwiseLinear.one_row`)
    formats |= {m.one_row_format for m in model.modules() if getattr(m, "one_row_format", None)}
    encoded = sorted(formats)
    return "+".join([dense, *encoded])


@dataclass(frozen=True, slots=True)
class RankSplit:
    """A bench over tensor-parallel ranks: every rank loads its slice of `source`."""

    source: Any  # ninfer.parallel.launch.ModelSource
    ranks: int
    expert_parallel: bool
    device: torch.device
    dtype: torch.dtype


# The profiler range each step of a profiled run is recorded in, by whether it is a decode step.
STEP_LABELS = {False: "ninfer.bench.prefill_step", True: "ninfer.bench.decode_step"}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class NinferTarget:
    """Our engine over a loaded model; pools sized for the largest case."""

    name = "ninfer"

    def __init__(
        self,
        model,
        cases: list[BenchCase],
        prefill_chunk: int,
        cuda_graph: bool = True,
        idle_prefill_chunk: int | None = None,
        parallel: RankSplit | None = None,
        overlap: bool = True,
        gdn_state_dtype: str = "float32",
    ) -> None:
        """`model` is the loaded model; or, with `parallel`, None: each rank (this process is
        rank 0) loads its slice of `parallel.source` (ninfer/parallel/launch.py)."""
        from ninfer.engine.engine import build_core

        longest = max(c.prompt_tokens + c.decode_steps + 1 for c in cases)
        lanes = max(c.concurrency for c in cases)
        config = EngineConfig(
            max_context=longest,
            max_concurrency=lanes,
            max_pending_requests=0,
            kv_capacity=-(-longest // PAGE_SIZE) * PAGE_SIZE * lanes,  # whole pages per lane
            prefill_chunk=prefill_chunk,
            idle_prefill_chunk=idle_prefill_chunk,
            cuda_graph=cuda_graph,
            overlap=overlap,
            gdn_state_dtype=gdn_state_dtype,
        )
        if parallel is None:
            self.core = build_core(model, config)  # no eos ids: every request runs its length
        else:
            from ninfer.parallel.launch import load_parallel_core

            config = replace(
                config,
                device=str(parallel.device),
                dtype=str(parallel.dtype).removeprefix("torch."),
                tensor_parallel=parallel.ranks,
                expert_parallel=parallel.expert_parallel,
            )
            self.core = load_parallel_core(parallel.source, config)
            self.name = f"ninfer-tp{parallel.ranks}"
        self.model = self.core.runner.model
        self.recorder = _RecordingRunner(self.core.runner)
        self.core.runner = self.recorder
        self.device = self.model.device
        self.vocab_size = self.model.config.vocab_size

    def close(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do on one rank)."""
        self.recorder.runner.close()

    def run_case(self, case: BenchCase, seed: int) -> list[StepRecord]:
        core = self.core
        # max_tokens counts the token the prefill samples; then one per decode step
        params = SamplingParams.greedy(max_tokens=case.decode_steps + 1, ignore_eos=True)
        for ids in random_prompts(case, self.vocab_size, seed):
            core.add(GenerationRequest(ids, params, detokenize=False), lambda event: None)
        records: list[StepRecord] = []
        _sync(self.device)
        carried = 0.0  # a call that only launched a step: its time goes to the step's record
        while core.has_work:
            self.recorder.last = None
            start = time.perf_counter()
            ran = core.step()
            seconds = time.perf_counter() - start + carried  # ends on a host sync (token ids)
            carried = 0.0
            if ran and self.recorder.last is None:
                carried = seconds
            elif ran:
                batch = self.recorder.last
                records.append(
                    StepRecord(
                        is_decode=batch.is_decode,
                        context_lens=batch.context_lens,
                        query_lens=tuple(batch.query_lens),
                        sampled=tuple(batch.sampled),
                        seconds=seconds,
                        device_seconds=self.recorder.device_seconds() if batch.is_decode else None,
                    )
                )
        core.check_integrity()
        return records

    @contextmanager
    def profiling(self) -> Iterator[None]:
        """Within: decode steps run eagerly, without the captured graphs (a replay is one opaque
        launch to a profiler), and each step is a profiler range named by `STEP_LABELS`."""
        runner = self.recorder.runner
        graphs, runner.graphs = runner.graphs, None
        self.recorder.label_steps = True
        try:
            yield
        finally:
            runner.graphs = graphs
            self.recorder.label_steps = False


@dataclass(slots=True)
class _BatchShape:
    is_decode: bool
    context_lens: tuple[int, ...]
    query_lens: list[int]
    sampled: list[bool]


@dataclass(slots=True)
class _LaunchRecord:
    shape: _BatchShape
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None
    started: bool = False  # whether the step recorded each event
    ended: bool = False


class _RecordingRunner:
    """The engine's runner, noting the shape of each batch it launches (sequences' cached
    lengths are read before the step advances them) and, when a step is read back, which one
    it was (`last`). On CUDA it brackets each step's device work with two events on the
    current stream: `start` just before the first device work (the forward's entry; for a
    graph replay, again once the inputs are staged, so the host's filling and copying of them
    counts as host time), `end` once the sampler has queued its work. The step's own host sync
    on the sampled ids completes both, so reading them afterwards waits for nothing; the hooks
    add only the events' record calls. With `label_steps` (profiled runs only) each launch is
    also a named profiler range."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.last: _BatchShape | None = None
        self.label_steps = False
        self._cuda = runner.device.type == "cuda"
        self._current: _LaunchRecord | None = None  # the launch in progress
        self._launched: dict[int, _LaunchRecord] = {}
        self._last_record: _LaunchRecord | None = None
        if self._cuda:
            self._hook(runner)

    def _hook(self, runner) -> None:
        forward, sample = runner.forward, runner.sampler.sample

        def record_start() -> None:
            if self._current is not None and self._current.events is not None:
                self._current.events[0].record()
                self._current.started = True

        def timed_forward(inputs):
            record_start()
            return forward(inputs)

        def timed_sample(logits, rows):
            out = sample(logits, rows)
            if self._current is not None and self._current.events is not None:
                self._current.events[1].record()
                self._current.ended = True
            return out

        runner.forward = timed_forward
        runner.sampler.sample = timed_sample
        if runner.graphs is not None:
            stage = runner.graphs.stage

            def timed_stage(inputs, size):
                stage(inputs, size)
                record_start()  # re-recorded: the replay is the first device work left

            runner.graphs.stage = timed_stage

    def launch(self, batch, **kwargs):
        shape = _BatchShape(
            batch.is_decode,
            tuple(seq.num_cached for seq in batch.seqs),
            batch.query_lens,
            batch.sampled,
        )
        events = None
        if self._cuda:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        self._current = _LaunchRecord(shape, events)
        try:
            if self.label_steps:
                with record_function(STEP_LABELS[batch.is_decode]):
                    launched = self.runner.launch(batch, **kwargs)
            else:
                launched = self.runner.launch(batch, **kwargs)
        finally:
            record, self._current = self._current, None
        self._launched[id(launched)] = record
        return launched

    def collect(self, launched):
        result = self.runner.collect(launched)
        self._last_record = self._launched.pop(id(launched))
        self.last = self._last_record.shape
        return result

    def run(self, batch):
        return self.collect(self.launch(batch))

    def device_seconds(self) -> float | None:
        """Seconds from the last read-back step's start event to its end event; None off CUDA
        or when the step did not sample."""
        record = self._last_record
        if record is None or record.events is None or not (record.started and record.ended):
            return None
        start, end = record.events
        return start.elapsed_time(end) / 1e3

    def __getattr__(self, name: str):
        return getattr(self.runner, name)  # everything else (close, ...) is the runner's


class HFTarget:
    """transformers' model class on the same config, random bf16 weights, its own cache:
    a prefill forward over the [C, P] batch, then greedy decode steps one token at a time."""

    name = "hf"

    def __init__(self, config: dict[str, Any], device: torch.device, dtype: torch.dtype) -> None:
        import transformers

        text = dict(config.get("text_config") or config)
        is_moe = "num_experts" in text
        config_class = (
            transformers.Qwen3_5MoeTextConfig if is_moe else transformers.Qwen3_5TextConfig
        )
        model_class = (
            transformers.Qwen3_5MoeForCausalLM if is_moe else transformers.Qwen3_5ForCausalLM
        )
        fields = {k: v for k, v in text.items() if k not in ("model_type", "architectures")}
        hf_config = config_class(**fields)
        if device.type == "cpu":
            hf_config._experts_implementation = "eager"  # grouped_mm needs CUDA
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                self.model = model_class(hf_config).eval()
        finally:
            torch.set_default_dtype(default_dtype)
        self.device = device
        self.vocab_size = hf_config.vocab_size

    @torch.inference_mode()
    def run_case(self, case: BenchCase, seed: int) -> list[StepRecord]:
        from transformers import DynamicCache

        ids = torch.tensor(random_prompts(case, self.vocab_size, seed), device=self.device)
        batch, prompt = ids.shape
        cache = DynamicCache(config=self.model.config)
        records = []
        _sync(self.device)
        start = time.perf_counter()
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        token.cpu()
        records.append(
            StepRecord(
                False,
                (0,) * batch,
                (prompt,) * batch,
                (True,) * batch,
                time.perf_counter() - start,
            )
        )
        for step in range(case.decode_steps):
            start = time.perf_counter()
            out = self.model(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            token.cpu()
            records.append(
                StepRecord(
                    True,
                    (prompt + step,) * batch,
                    (1,) * batch,
                    (True,) * batch,
                    time.perf_counter() - start,
                )
            )
        return records
