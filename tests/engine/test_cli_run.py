"""`ninfer run`: greedy ids equal transformers' `generate` on random tiny checkpoints; the answer
goes to stdout and everything else to stderr."""

from __future__ import annotations

import json

import pytest
import torch

from ninfer.cli.main import main
from ninfer.engine.engine import ASSETS_DIR

PROMPT_IDS = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["run", *argv, "--device", "cpu", "--dtype", "float32"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def hf_greedy(checkpoint, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    output = model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False
    )
    return output[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize(
    "options",
    [{}, {"moe": True}, {"tie": True, "full_attention_interval": 4}],
    ids=["dense", "moe", "tied"],
)
def test_greedy_ids_equal_transformers_generate(tiny_artifact, capsys, options):
    checkpoint, artifact = tiny_artifact(weights="fp32", **options)
    code, out, err = run_cli(
        capsys,
        str(artifact),
        "--prompt-ids",
        ",".join(map(str, PROMPT_IDS)),
        "--greedy",
        "--max-tokens",
        "16",
        "--prefill-chunk",
        "5",
        "--print-token-ids",
    )
    assert code == 0
    ours = [int(t) for t in out.strip().splitlines()[-1].split(",")]
    assert ours == hf_greedy(checkpoint, PROMPT_IDS, 16)
    assert "finish:" in err and "decode" in err


def test_prompt_is_rendered_and_the_answer_alone_is_on_stdout(artifact_path, capsys):
    code, out, err = run_cli(
        capsys, str(artifact_path), "--prompt", "hi", "--greedy", "--max-tokens", "6"
    )
    assert code == 0
    assert "loading" not in out and "finish" not in out
    assert "loading" in err and "prefill" in err and "tok/s" in err
    assert out.endswith("\n")


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "content",
        ),
        ([{"role": "user", "content": 5}], "'content' must be text"),
        ([{"role": "user"}], "'content' must be text"),
        (["hi"], "not an object with a string 'role'"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [1]}, "'tools'"),
    ],
)
def test_messages_the_template_would_drop_are_one_line_errors(
    artifact_path, capsys, tmp_path, messages, message
):
    path = tmp_path / "messages.json"
    path.write_text(json.dumps(messages))
    code, _, err = run_cli(capsys, str(artifact_path), "--messages", str(path), "--max-tokens", "2")
    assert code == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"ninfer run: error: --messages {path}") and message in last


def test_text_parts_are_text(artifact_path, capsys, tmp_path):
    path = tmp_path / "messages.json"
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": " there"}]
    path.write_text(json.dumps([{"role": "user", "content": parts}]))
    code, _, _ = run_cli(capsys, str(artifact_path), "--messages", str(path), "--max-tokens", "2")
    assert code == 0


def test_stop_token_id_ends_the_output_and_is_reported(artifact_path, capsys):
    code, out, _ = run_cli(
        capsys,
        str(artifact_path),
        "--prompt-ids",
        "1,2,3",
        "--greedy",
        "--max-tokens",
        "30",
        "--print-token-ids",
    )
    ids = [int(t) for t in out.strip().splitlines()[-1].split(",")]
    stop_id = ids[3]
    code, out, err = run_cli(
        capsys,
        str(artifact_path),
        "--prompt-ids",
        "1,2,3",
        "--greedy",
        "--max-tokens",
        "30",
        "--stop-token-id",
        str(stop_id),
        "--print-token-ids",
    )
    assert [int(t) for t in out.strip().splitlines()[-1].split(",")] == ids[
        : ids.index(stop_id) + 1
    ]
    assert f"finish: stop ({stop_id})" in err


def test_ids_only_artifact_needs_prompt_ids(tiny_artifact, capsys):
    _, artifact = tiny_artifact(weights="fp32", tokenizer=False)
    code, _, err = run_cli(capsys, str(artifact), "--prompt", "hi")
    assert code == 1 and "--prompt-ids" in err and len(err.strip().splitlines()) <= 3
    code, out, _ = run_cli(
        capsys, str(artifact), "--prompt-ids", "1,2", "--max-tokens", "3", "--print-token-ids"
    )
    assert code == 0 and len(out.strip().split(",")) == 3


def test_limits_are_one_line_errors(artifact_path, capsys):
    code, _, err = run_cli(
        capsys,
        str(artifact_path),
        "--prompt-ids",
        "1,2,3",
        "--max-context",
        "8",
        "--max-tokens",
        "6",
    )
    assert code == 1
    assert err.strip().splitlines()[-1].startswith("ninfer run: error: prompt (3 tokens)")


@pytest.mark.skipif(any(ASSETS_DIR.glob("*.ninfer")), reason="the shipped model exists")
def test_without_model_and_shipped_model_a_clear_error(capsys):
    code, _, err = run_cli(capsys, "--prompt", "hi")
    assert code == 1
    assert (
        err.strip()
        == f"ninfer run: error: no model given and no shipped model in {ASSETS_DIR}; pass a .ninfer file"
    )
