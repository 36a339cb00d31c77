"""Converting tiny random Qwen3.5 checkpoints written by transformers' save_pretrained: every
checkpoint tensor must decode back under its logical name, in every layout and profile; bad
input gives one clear ConversionError and leaves no file behind."""

import json
import re

import pytest
import torch
from helpers import load_checkpoint_tensors
from safetensors.torch import load_file, save_file

from ninfer.artifact import Artifact
from ninfer.artifact.convert import convert, report_path
from ninfer.cli.main import main as cli_main
from ninfer.errors import ConversionError
from ninfer.quant import get_format


def logical_name(key: str) -> str:
    if key.startswith("mtp."):
        return "mtp/" + key[len("mtp.") :]
    if key == "lm_head.weight":
        return "text/lm_head.weight"
    return "text/" + re.sub(r"^model\.(language_model\.)?", "", key)


def expected_tensors(checkpoint_dir) -> dict[str, torch.Tensor]:
    """Logical name -> source tensor, stacking per-expert keys the way the recipe must."""
    source = {
        k: v
        for k, v in load_checkpoint_tensors(checkpoint_dir).items()
        if not k.startswith("model.visual.")
    }
    expected, experts = {}, {}
    for key, value in source.items():
        match = re.match(r"(.*mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", key)
        if match:
            experts.setdefault(logical_name(match.group(1)), {}).setdefault(match.group(3), {})[
                int(match.group(2))
            ] = value
        else:
            expected[logical_name(key)] = value
    for prefix, parts in experts.items():
        n = len(parts["down_proj"])
        expected[prefix + "gate_up_proj"] = torch.stack(
            [torch.cat([parts["gate_proj"][e], parts["up_proj"][e]]) for e in range(n)]
        )
        expected[prefix + "down_proj"] = torch.stack([parts["down_proj"][e] for e in range(n)])
    return expected


def assert_decodes_back(artifact: Artifact, expected: dict[str, torch.Tensor]):
    assert sorted(artifact.names()) == sorted(expected)
    for name, source in expected.items():
        fmt_name = artifact.container.object(name)["format"]
        reference = get_format(fmt_name).encode(source).decode(torch.float32)
        assert torch.equal(artifact.tensor(name, torch.float32), reference), name


CASES = {
    "dense-untied-bf16": dict(options=dict(), weights="bf16"),
    "dense-tied-mtp-multimodal-fp32": dict(
        options=dict(tie=True, mtp=True, multimodal=True, hidden=32, layers=2), weights="fp32"
    ),
    "dense-sharded-groupwise": dict(
        options=dict(layers=5, hidden=128, max_shard_size="100KB"), weights="groupwise-int"
    ),
    "moe-mtp-multimodal-groupwise": dict(
        options=dict(moe=True, mtp=True, multimodal=True), weights="groupwise-int"
    ),
    "moe-tied-bf16-source-bf16": dict(
        options=dict(moe=True, tie=True, dtype="bfloat16", layers=3, experts=3), weights="bf16"
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_checkpoint_tensor_decodes_back(tiny_artifact, case):
    spec = CASES[case]
    checkpoint, out = tiny_artifact(weights=spec["weights"], **spec["options"])
    artifact = Artifact.open(out, verify=True)
    expected = expected_tensors(checkpoint)
    assert_decodes_back(artifact, expected)
    options = spec["options"]
    assert artifact.has("text/lm_head.weight") != bool(options.get("tie"))
    assert ("mtp" in artifact.components) == bool(options.get("mtp"))
    assert artifact.config() == json.loads((checkpoint / "config.json").read_text())
    for role, name in [
        ("tokenizer", "tokenizer.json"),
        ("chat_template", "chat_template.jinja"),
        ("generation_config", "generation_config.json"),
    ]:
        assert artifact.resource(role) == (checkpoint / name).read_bytes()
    report = json.loads(report_path(out).read_text())
    assert len(report["tensors"]) == len(expected) and report["weights"] == spec["weights"]
    if options.get("multimodal"):
        assert report["skipped"] == {"vision tensors (vision component not converted)": 1}


def test_groupwise_profile_assigns_formats_by_role(tiny_artifact):
    _, out = tiny_artifact(weights="groupwise-int", moe=True, mtp=True)
    formats = {obj["id"]: obj.get("format") for obj in Artifact.open(out).root["objects"]}
    assert formats["text/embed_tokens.weight"] == formats["text/lm_head.weight"] == "q6_g64_fp16"
    assert formats["text/layers.0.linear_attn.in_proj_qkv.weight"] == "q4_g64_fp16"
    assert formats["text/layers.0.mlp.experts.gate_up_proj"] == "q4_g64_fp16"
    assert formats["text/layers.0.linear_attn.in_proj_a.weight"] == "bf16"
    assert formats["text/layers.0.mlp.gate.weight"] == "bf16"
    assert formats["text/layers.0.linear_attn.conv1d.weight"] == "bf16"
    assert formats["text/layers.0.input_layernorm.weight"] == "bf16"
    assert (
        formats["text/layers.0.linear_attn.A_log"]
        == formats["text/layers.0.linear_attn.dt_bias"]
        == "fp32"
    )
    assert (
        formats["mtp/fc.weight"] == formats["mtp/layers.0.self_attn.q_proj.weight"] == "q8_g32_fp16"
    )
    assert formats["mtp/norm.weight"] == "bf16"


def test_already_fused_expert_keys_convert_like_per_expert_keys(tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint(moe=True, layers=2, tokenizer=False)
    expected = expected_tensors(checkpoint)
    shard = checkpoint / "model.safetensors"
    tensors = load_file(shard)
    fused = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for i in range(2):
        fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = expected[
            f"text/layers.{i}.mlp.experts.gate_up_proj"
        ]
        fused[f"model.layers.{i}.mlp.experts.down_proj"] = expected[
            f"text/layers.{i}.mlp.experts.down_proj"
        ]
    save_file(fused, shard, metadata={"format": "pt"})
    out = tmp_path / "fused.ninfer"
    convert(checkpoint, "qwen3_5_moe", out, weights="fp32", on_warning=lambda _: None)
    assert_decodes_back(Artifact.open(out), expected)


def test_shards_without_an_index_are_found_from_their_headers(tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint(max_shard_size="50KB", tokenizer=False, layers=2)
    (checkpoint / "model.safetensors.index.json").unlink()
    out = tmp_path / "noindex.ninfer"
    convert(checkpoint, "qwen3_5", out, weights="fp32", on_warning=lambda _: None)
    assert_decodes_back(Artifact.open(out), expected_tensors(checkpoint))


def test_checkpoint_without_tokenizer_becomes_ids_only_with_a_warning(tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint(tokenizer=False, vocab=128, layers=2)
    warnings = []
    out = tmp_path / "ids.ninfer"
    report = convert(checkpoint, "qwen3_5", out, on_warning=warnings.append)
    assert len(warnings) == 1 and "ids-only" in warnings[0]
    assert report["warnings"] == warnings
    artifact = Artifact.open(out)
    assert artifact.resource("tokenizer") is None and artifact.resource("chat_template") is None


def test_multi_part_conversion_with_tiny_max_file_bytes(tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint(moe=True, mtp=True, tokenizer=False, vocab=256)
    out = tmp_path / "parts.ninfer"
    report = convert(
        checkpoint,
        "qwen3_5_moe",
        out,
        weights="fp32",
        max_file_bytes=65536,
        on_warning=lambda _: None,
    )
    assert len(report["files"]) > 5
    assert all(f["bytes"] <= 65536 for f in report["files"])
    assert_decodes_back(Artifact.open(out, verify=True), expected_tensors(checkpoint))


def test_cli_convert_with_components_name_and_resource_override(tiny_checkpoint, tmp_path, capsys):
    checkpoint = tiny_checkpoint(mtp=True, layers=2)
    template = tmp_path / "other.jinja"
    template.write_text("{{ messages }}")
    out = tmp_path / "cli.ninfer"
    argv = [
        "convert",
        "--model",
        str(checkpoint),
        "--recipe",
        "qwen3_5",
        "--out",
        str(out),
        "--components",
        "text",
    ]
    argv += ["--name", "tiny-demo", "--resource", f"chat_template={template}"]
    assert cli_main(argv) == 0
    assert "wrote" in capsys.readouterr().out
    artifact = Artifact.open(out)
    assert artifact.components == ["text"] and not artifact.names("mtp/")
    assert artifact.metadata["name"] == "tiny-demo"
    assert artifact.resource("chat_template") == b"{{ messages }}"
    assert (
        json.loads(report_path(out).read_text())["skipped"][
            "mtp tensors (mtp component not requested)"
        ]
        > 0
    )


def test_recipe_from_a_python_file(tiny_checkpoint, tmp_path):
    recipe = tmp_path / "all_fp8.py"
    recipe.write_text(
        "from ninfer.artifact.recipes.qwen3_5 import Qwen3_5Recipe\n\n"
        "class AllFp8(Qwen3_5Recipe):\n"
        "    def choose_format(self, name, shape, profile):\n"
        "        return 'fp8_e4m3fn_row_bf16' if len(shape) == 2 else 'fp32'\n\n"
        "RECIPE = AllFp8('all_fp8', ('qwen3_5_text',), moe=False)\n"
    )
    checkpoint = tiny_checkpoint(tokenizer=False, layers=2)
    out = tmp_path / "fp8.ninfer"
    report = convert(checkpoint, str(recipe), out, on_warning=lambda _: None)
    assert report["recipe"] == "all_fp8"
    artifact = Artifact.open(out)
    assert artifact.container.object("text/embed_tokens.weight")["format"] == "fp8_e4m3fn_row_bf16"
    assert_decodes_back(artifact, expected_tensors(checkpoint))


def edit_config(checkpoint, **changes):
    """Set (or, with None, remove) keys of the checkpoint's config, in its text part where it
    has one."""
    path = checkpoint / "config.json"
    config = json.loads(path.read_text())
    target = config.get("text_config", config)
    for key, value in changes.items():
        if value is None:
            target.pop(key, None)
        else:
            target[key] = value
    path.write_text(json.dumps(config))


def drop_key(checkpoint, key):
    shard = checkpoint / "model.safetensors"
    tensors = load_file(shard)
    del tensors[key]
    save_file(tensors, shard, metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("recipe", "prepare", "message"),
    [
        ("qwen9", None, "unknown recipe 'qwen9'"),
        ("qwen3_5_moe", None, "model_type 'qwen3_5_text' is not supported by recipe qwen3_5_moe"),
        ("missing.py", None, "missing.py: recipe file not found"),
        (
            "qwen3_5",
            lambda c: drop_key(c, "model.layers.1.self_attn.q_norm.weight"),
            "checkpoint has no tensor 'model.layers.1.self_attn.q_norm.weight'",
        ),
        ("qwen3_5", lambda c: (c / "config.json").unlink(), "config.json: missing"),
        ("qwen3_5", lambda c: (c / "config.json").write_text("{"), "config.json: invalid JSON"),
        ("qwen3_5", lambda c: (c / "config.json").write_text("[1, 2]"), "not a JSON object"),
        ("qwen3_5", lambda c: edit_config(c, layer_types=5), "cannot read this checkpoint"),
        (
            "qwen3_5",
            lambda c: edit_config(c, layer_types=None, full_attention_interval=0),
            "cannot read this checkpoint",
        ),
        (
            "qwen3_5",
            lambda c: edit_config(c, vocab_size=1000),
            "disagree: text/embed_tokens.weight is [128, 64], the config makes it [1000, 64]",
        ),
        (
            "qwen3_5",
            lambda c: edit_config(c, linear_num_key_heads=None),
            "the model config has no 'linear_num_key_heads'",
        ),
    ],
)
def test_bad_input_gives_one_line_error_and_no_output(
    tiny_checkpoint, tmp_path, capsys, recipe, prepare, message
):
    checkpoint = tiny_checkpoint(tokenizer=False, vocab=128, layers=2)
    if prepare:
        prepare(checkpoint)
    capsys.readouterr()
    out = tmp_path / "out" / "bad.ninfer"
    out.parent.mkdir()
    with pytest.raises(ConversionError, match=re.escape(message)):
        convert(checkpoint, recipe, out, on_warning=lambda _: None)
    assert (
        cli_main(["convert", "--model", str(checkpoint), "--recipe", recipe, "--out", str(out)])
        == 1
    )
    err = capsys.readouterr().err
    assert (
        err.startswith("ninfer convert: error:") and err.count("\n") == 1 and "Traceback" not in err
    )
    assert list(out.parent.iterdir()) == []


def test_a_checkpoint_file_that_is_a_directory_is_one_line(tiny_checkpoint, tmp_path, capsys):
    """The system's error for a path the command reads (here `tokenizer.json`), on one line."""
    checkpoint = tiny_checkpoint(tokenizer=False, vocab=128, layers=2)
    (checkpoint / "tokenizer.json").mkdir()
    out = tmp_path / "x.ninfer"
    capsys.readouterr()
    argv = ["convert", "--model", str(checkpoint), "--recipe", "qwen3_5", "--out", str(out)]
    assert cli_main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("ninfer convert: error:") and err.count("\n") == 1
    assert "tokenizer.json" in err and "Traceback" not in err


def test_failure_while_writing_removes_entry_parts_and_report(tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint(tokenizer=False, vocab=128, layers=2)
    shard = checkpoint / "model.safetensors"
    tensors = load_file(shard)
    tensors["lm_head.weight"][3, 5] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    out = tmp_path / "out" / "bad.ninfer"
    out.parent.mkdir()
    # lm_head is the last tensor written, so the entry and some parts already exist when it fails
    with pytest.raises(ConversionError, match="tensor text/lm_head.weight .*inf or nan"):
        convert(
            checkpoint,
            "qwen3_5",
            out,
            weights="groupwise-int",
            max_file_bytes=20000,
            on_warning=lambda _: None,
        )
    assert list(out.parent.iterdir()) == []


def test_existing_output_is_never_overwritten(tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint(tokenizer=False, vocab=128, layers=2)
    out = tmp_path / "taken.ninfer"
    out.write_bytes(b"keep me")
    with pytest.raises(ConversionError, match="taken.ninfer: already exists"):
        convert(checkpoint, "qwen3_5", out, on_warning=lambda _: None)
    assert out.read_bytes() == b"keep me"
    out.unlink()
    stray = tmp_path / "taken.ninfer.part-0001"
    stray.write_bytes(b"old part")
    with pytest.raises(Exception, match="already exists"):
        convert(checkpoint, "qwen3_5", out, on_warning=lambda _: None)
    assert stray.read_bytes() == b"old part" and not out.exists()


def test_components_mtp_without_mtp_tensors_is_an_error(tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint(tokenizer=False, vocab=128, layers=2)
    with pytest.raises(ConversionError, match="no tensor 'mtp.fc.weight'"):
        convert(checkpoint, "qwen3_5", tmp_path / "x.ninfer", components={"text", "mtp"})


def test_a_recipe_path_that_is_not_python_is_refused(tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint(tokenizer=False, vocab=128, layers=2)
    with pytest.raises(ConversionError, match=r"a recipe file is a Python file \(\.py\)"):
        convert(checkpoint, str(checkpoint / "config.json"), tmp_path / "x.ninfer")


@pytest.mark.parametrize(
    ("role", "text", "message"),
    [
        ("tokenizer", '{"x": 1', "the tokenizer files cannot be read"),
        ("chat_template", "{% for %}", "chat template does not compile"),
        ("tokenizer_config", "[1", "the tokenizer files cannot be read"),
    ],
)
def test_tokenizer_files_the_engine_cannot_read_are_refused(
    tiny_checkpoint, tmp_path, role, text, message
):
    checkpoint = tiny_checkpoint(layers=2)
    bad = tmp_path / "bad"
    bad.write_text(text)
    out = tmp_path / "out" / "bad.ninfer"
    out.parent.mkdir()
    with pytest.raises(ConversionError, match=re.escape(message)):
        convert(checkpoint, "qwen3_5", out, resources={role: bad}, on_warning=lambda _: None)
    assert list(out.parent.iterdir()) == []


def test_an_artifact_whose_config_and_tensors_disagree_is_one_line_at_run(
    tiny_checkpoint, tmp_path, monkeypatch, capsys
):
    """An artifact written by another converter (here: this one with its checks off) whose
    config disagrees with its tensors, or whose tokenizer cannot be read, stops the load with
    one line naming the problem, before any weight is read."""
    from ninfer.artifact import convert as convert_module
    from ninfer.engine.engine import load_frontend
    from ninfer.errors import ArtifactError, ModelConfigError
    from ninfer.models.registry import load_model

    monkeypatch.setattr(convert_module, "_check_model", lambda plan: None)
    monkeypatch.setattr(convert_module, "_check_text_side", lambda resources: None)
    checkpoint = tiny_checkpoint(layers=2)
    edit_config(checkpoint, intermediate_size=4096)
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{")
    out = tmp_path / "bad.ninfer"
    convert(checkpoint, "qwen3_5", out, resources={"tokenizer": bad}, on_warning=lambda _: None)
    artifact = Artifact.open(out)
    with pytest.raises(ModelConfigError, match=r"mlp.gate_proj.weight is \[\d+, 64\], the"):
        load_model(artifact)
    with pytest.raises(ArtifactError, match="tokenizer files cannot be read"):
        load_frontend(artifact)
    capsys.readouterr()
    assert cli_main(["run", str(out), "--prompt", "hi", "--max-tokens", "1"]) == 1
    err = capsys.readouterr().err
    assert "ninfer run: error: the model config and the tensors disagree" in err
    assert "Traceback" not in err and err.strip().count("\n") <= 1
