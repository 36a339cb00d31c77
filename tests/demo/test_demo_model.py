"""The shipped demo model (ninfer/assets/demo.ninfer): a sound artifact that holds exactly the
trained weights, whose logits are transformers' and whose greedy outputs stay the recorded ones.

reference.json is written by tools/train_demo/make_reference.py from the training run's HF
checkpoint (tensor hashes, transformers fp32 top-5 logits, our training-side MTP layer's logits)
and from the engine's greedy outputs, each checked against transformers' `generate` there."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

import ninfer
from ninfer.artifact.artifact import Artifact
from ninfer.engine.engine import shipped_model_path
from ninfer.engine.kv_pool import PAGE_SIZE, ModelCache
from ninfer.models.context import make_context
from ninfer.models.registry import load_model

REPO = Path(__file__).resolve().parents[2]
ARTIFACT = REPO / "ninfer/assets/demo.ninfer"
MANIFEST = REPO / "tools/train_demo/corpus_manifest.tsv.gz"
REFERENCE_PATH = Path(__file__).with_name("reference.json")
REPO_BUDGET_BYTES = 25_000_000


@cache
def reference() -> dict:
    return json.loads(REFERENCE_PATH.read_text())


@cache
def artifact() -> Artifact:
    return Artifact.open(ARTIFACT)


@cache
def our_model():
    return load_model(artifact(), dtype=torch.float32)


def logical_name(hf_name: str) -> str:
    if hf_name.startswith("mtp."):
        return "mtp/" + hf_name.removeprefix("mtp.")
    return "text/" + hf_name.removeprefix("model.")


def prefill(model, ids: list[int], mtp_ids: list[int] | None = None):
    """One sequence through our model in a single step: logits [T, V] (and MTP logits)."""
    cache_pool = ModelCache(model.cache_spec(), num_pages=-(-len(ids) // PAGE_SIZE), num_slots=1)
    slot = cache_pool.slots.allocate("seq")
    pages = cache_pool.pages.allocate("seq", cache_pool.num_pages)
    ctx = make_context(
        cache_pool,
        context_lens=[0],
        query_lens=[len(ids)],
        page_lists=[pages],
        state_slots=[slot],
    )
    positions = torch.arange(len(ids))
    with torch.no_grad():
        hidden = model(torch.tensor(ids), positions, ctx)
        logits = model.compute_logits(hidden)
        if mtp_ids is None:
            return logits
        mtp_hidden = model.mtp(torch.tensor(mtp_ids), hidden, positions, ctx)
        return logits, model.compute_logits(mtp_hidden)


def assert_matches_top5(ours: torch.Tensor, expected: dict, tolerance: float = 1e-4) -> None:
    """Our logits at the reference's top-5 ids equal its values (relative to the largest), and
    our argmax is its argmax wherever the reference is not a near-tie."""
    ids = torch.tensor(expected["ids"])
    values = torch.tensor(expected["logits"])
    assert ours.shape[0] == ids.shape[0]
    scale = values.abs().max()
    assert ((ours.gather(1, ids) - values).abs().max() / scale).item() <= tolerance
    clear = (values[:, 0] - values[:, 1]) > 1e-3
    assert torch.equal(ours.argmax(-1)[clear], ids[clear, 0])


def test_shipped_model_is_the_default_model():
    assert shipped_model_path() == ARTIFACT


def test_shipped_artifact_passes_inspect_verify():
    result = subprocess.run(
        [sys.executable, "-m", "ninfer", "inspect", str(ARTIFACT), "--verify"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "checksums match" in result.stdout


def test_repo_carries_at_most_25_mb_for_the_demo_model():
    files = [ARTIFACT, MANIFEST, REFERENCE_PATH, *sorted(REPO.glob("tools/train_demo/*"))]
    assert sum(f.stat().st_size for f in set(files) if f.is_file()) <= REPO_BUDGET_BYTES


def test_artifact_has_text_mtp_and_every_resource():
    art = artifact()
    assert set(art.components) == {"text", "mtp"}
    for role in ("tokenizer", "tokenizer_config", "chat_template", "generation_config"):
        assert art.resource(role), role
    config = art.config()
    assert config["mtp_num_hidden_layers"] == 1
    assert config["head_dim"] == 256 and config["linear_key_head_dim"] == 128
    assert config["layer_types"].count("full_attention") >= 2


def test_artifact_holds_the_trained_tensors_bit_for_bit():
    expected = reference()["checkpoint_tensors_sha256_bf16"]
    art = artifact()
    assert any(name.startswith("mtp.layers.0.") for name in expected)
    for hf_name, digest in expected.items():
        tensor = art.tensor(logical_name(hf_name)).to(torch.bfloat16).contiguous()
        actual = hashlib.sha256(tensor.view(torch.int16).numpy().tobytes()).hexdigest()
        assert actual == digest, hf_name
    ours = {n for n in art.names() if n.startswith(("text/", "mtp/"))}
    assert ours == {logical_name(n) for n in expected}


@pytest.mark.parametrize("prompt", ["tool_chat", "code"])
def test_logits_and_mtp_logits_equal_the_training_side_reference(prompt):
    case = reference()["transformers_fp32_top5"][prompt]
    ids = case["ids"]
    # MTP row t reads token t+1; the last row has none, so it gets a filler and is not compared.
    logits, mtp_logits = prefill(our_model(), ids, mtp_ids=ids[1:] + [0])
    assert_matches_top5(logits, case["main"])
    assert_matches_top5(mtp_logits[:-1], case["mtp"])


def test_logits_equal_transformers_on_the_artifact_weights():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    art = artifact()
    config = Qwen3_5TextConfig.from_dict(art.config())
    hf = Qwen3_5ForCausalLM(config).eval()
    state = {
        "model." + name.removeprefix("text/"): art.tensor(name, dtype=torch.float32)
        for name in art.names("text/")
    }
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    hf.tie_weights()
    ids = reference()["transformers_fp32_top5"]["tool_chat"]["ids"]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    ours = prefill(our_model(), ids)
    assert ((ours - expected).abs().max() / expected.abs().max()).item() <= 1e-4


@pytest.mark.parametrize("name", ["write_function", "tool_call", "explain_thinking", "code"])
def test_greedy_outputs_stay_the_golden_ones(name):
    golden = reference()["golden_greedy"][name]
    with ninfer.Engine(str(ARTIFACT), device="cpu", dtype="float32") as engine:
        params = ninfer.SamplingParams.greedy(max_tokens=reference()["golden_max_tokens"])
        out = engine.generate(golden["prompt_ids"], params)
    assert out.token_ids == golden["token_ids"]
    assert out.finish_reason == golden["finish_reason"]
