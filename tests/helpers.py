"""Shared test helpers: tiny random Hugging Face checkpoints (written by transformers'
save_pretrained through tools/make_tiny_checkpoint.py) and their conversion to `.ninfer`."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def _load_tool():
    name = "ninfer_tools_make_tiny_checkpoint"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, REPO_ROOT / "tools" / "make_tiny_checkpoint.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def make_tiny_checkpoint(out_dir: str | Path, **options) -> Path:
    """A tiny random Qwen3.5 checkpoint directory. Options: moe, mtp, tie, multimodal, layers,
    hidden, vocab, experts, full_attention_interval, seed, dtype, max_shard_size, tokenizer."""
    return _load_tool().make_tiny_checkpoint(out_dir, **options)


def convert_tiny(
    tmp_path: Path, *, weights: str = "bf16", components=None, max_file_bytes=None, **options
):
    """Make a tiny checkpoint under tmp_path and convert it; returns (checkpoint_dir, artifact_path)."""
    from ninfer.artifact.convert import convert

    checkpoint = make_tiny_checkpoint(tmp_path / "hf", **options)
    out = tmp_path / "model.ninfer"
    kwargs = {"max_file_bytes": max_file_bytes} if max_file_bytes else {}
    recipe = "qwen3_5_moe" if options.get("moe") else "qwen3_5"
    convert(
        checkpoint,
        recipe,
        out,
        weights=weights,
        components=components,
        on_warning=lambda _: None,
        **kwargs,
    )
    return checkpoint, out


def load_checkpoint_tensors(checkpoint_dir: Path) -> dict:
    """Every tensor of a checkpoint directory, by its checkpoint key."""
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def ninfer_process(*args: str, **kwargs) -> subprocess.Popen:
    """`python -m ninfer ARGS` as a child process (text mode, unbuffered)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "ninfer", *args], env=env, text=True, **kwargs)


def _spawned_rank(parent_pid: int) -> int:
    children = Path(f"/proc/{parent_pid}/task/{parent_pid}/children").read_text().split()
    for pid in children:
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return int(pid)
    raise AssertionError(f"no spawned rank among {children}")


def kill_a_rank_mid_run(run_args: list[str]) -> tuple[int, str, float]:
    """Start `ninfer RUN_ARGS` (a tensor-parallel run long enough to outlast this), SIGKILL
    its spawned rank 1 once the model has loaded, and return (exit code, stderr after the
    kill, seconds from the kill to the exit)."""
    import pytest

    process = ninfer_process(*run_args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for line in process.stderr:
            if line.startswith("loaded in"):
                break
        else:
            pytest.fail("the run ended before loading")
        os.kill(_spawned_rank(process.pid), signal.SIGKILL)
        started = time.monotonic()
        _, err = process.communicate(timeout=60)
        return process.returncode, err, time.monotonic() - started
    finally:
        process.kill()


def greedy_tokens(core, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Run every prompt to `max_tokens` greedy tokens through an `EngineCore`, all at once
    (request ids r0, r1, ...)."""
    from ninfer.engine.request import GenerationRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        outputs[f"r{i}"] = []
        core.add(
            GenerationRequest(prompt, params, request_id=f"r{i}", detokenize=False),
            lambda event: outputs[event.request_id].extend(event.token_ids),
        )
    while core.has_work:
        core.step()
    return [outputs[f"r{i}"] for i in range(len(prompts))]
