"""The v3 container: layout and header bytes, zero-copy reads, multi-part files, checksums,
and every malformed-input case giving one ArtifactError that names the file or object."""

import json
import struct

import pytest
import torch

from ninfer.artifact import Artifact
from ninfer.artifact.container import (
    ENTRY_MAGIC,
    PART_MAGIC,
    Container,
    ContainerWriter,
    ObjectPlan,
    align_up,
)
from ninfer.cli.main import main as cli_main
from ninfer.errors import ArtifactError
from ninfer.quant import get_format

ARTIFACT_ID = bytes(range(16))


def sample_tensors():
    torch.manual_seed(0)
    return {
        "text/embed_tokens.weight": (torch.randn(40, 96), "q6_g64_fp16"),
        "text/layers.0.mlp.gate_proj.weight": (torch.randn(24, 64), "q4_g64_fp16"),
        "text/layers.0.input_layernorm.weight": (torch.randn(64), "bf16"),
        "text/layers.0.linear_attn.A_log": (torch.randn(4), "fp32"),
        "text/layers.0.mlp.experts.gate_up_proj": (torch.randn(3, 8, 32), "q8_g32_fp16"),
        "text/lm_head.weight": (torch.randn(40, 64), "fp8_e4m3fn_row_bf16"),
        "text/positions": (torch.arange(10, dtype=torch.int32), "int32"),
    }


def write_container(
    path, tensors=None, resources=None, max_file_bytes=32_000_000_000, bindings=None
):
    tensors = sample_tensors() if tensors is None else tensors
    resources = {"tokenizer": b'{"model": {}}'} if resources is None else resources
    objects = [ObjectPlan.resource(f"resources/text/{r}", len(b)) for r, b in resources.items()]
    objects += [ObjectPlan.tensor(n, t.shape, f) for n, (t, f) in tensors.items()]
    components = {
        "text": {
            "config": {"model_type": "qwen3_5_text", "hidden_size": 64},
            "resources": {r: f"resources/text/{r}" for r in resources},
        }
    }
    with ContainerWriter(
        path,
        objects,
        components=components,
        bindings=bindings or {n: {"object": n} for n in tensors},
        metadata={"name": "sample"},
        max_file_bytes=max_file_bytes,
        artifact_id=ARTIFACT_ID,
    ) as writer:
        for role, data in resources.items():
            writer.write(f"resources/text/{role}", data)
        for name, (tensor, fmt_name) in tensors.items():
            fmt = get_format(fmt_name)
            writer.write(name, fmt.to_bytes(fmt.encode(tensor)))
        return writer.finish()


def expected_decode(tensor, fmt_name):
    return get_format(fmt_name).encode(tensor).decode()


def rewrite_root(path, mutate):
    """Rewrite an entry file's JSON root (keeping its payload) after `mutate(root)`."""
    raw = path.read_bytes()
    (json_bytes,) = struct.unpack("<Q", raw[8:16])
    root = json.loads(raw[32 : 32 + json_bytes])
    payload = raw[align_up(32 + json_bytes, 4096) :]
    mutate(root)
    new_json = json.dumps(root).encode()
    start = align_up(32 + len(new_json), 4096)
    header = raw[:8] + struct.pack("<Q", len(new_json)) + raw[16:32] + new_json
    path.write_bytes(header + b"\0" * (start - len(header)) + payload)


def test_header_payload_and_tensor_offsets_follow_the_v3_layout(tmp_path):
    path = tmp_path / "a.ninfer"
    write_container(path)
    raw = path.read_bytes()
    assert raw[:8] == ENTRY_MAGIC == b"NINFER\x00\x03"
    (json_bytes,) = struct.unpack("<Q", raw[8:16])
    assert raw[16:32] == ARTIFACT_ID
    root = json.loads(raw[32 : 32 + json_bytes])
    assert set(root) == {
        "components",
        "objects",
        "bindings",
        "uses",
        "files",
        "metadata",
        "provenance",
    }
    payload_start = align_up(32 + json_bytes, 4096)
    assert len(raw) == payload_start + root["files"][0]["payload_bytes"]
    assert root["files"] == [{"path": None, "payload_bytes": root["files"][0]["payload_bytes"]}]
    for obj in root["objects"]:
        assert obj["checksum"].startswith("xxh64:") and len(obj["checksum"]) == 22
        if obj["kind"] == "tensor":
            assert obj["offset"] % 256 == 0
        else:
            assert obj["encoding"] == "raw_bytes_v1"


def test_every_tensor_reads_back_and_plain_ones_are_views_of_the_mapping(tmp_path):
    path = tmp_path / "a.ninfer"
    write_container(path)
    artifact = Artifact.open(path, verify=True)
    for name, (tensor, fmt_name) in sample_tensors().items():
        got = artifact.tensor(name)
        assert torch.equal(got, expected_decode(tensor, fmt_name)), name
    mapping = artifact.container.files[0].data
    base, end = mapping.data_ptr(), mapping.data_ptr() + mapping.numel()
    for name in (
        "text/layers.0.input_layernorm.weight",
        "text/layers.0.linear_attn.A_log",
        "text/positions",
    ):
        view = artifact.tensor(name)
        assert base <= view.data_ptr() < end, name
    assert artifact.tensor("text/layers.0.input_layernorm.weight").dtype == torch.bfloat16
    assert (
        artifact.tensor("text/layers.0.input_layernorm.weight", torch.float32).dtype
        == torch.float32
    )
    assert artifact.tensor("text/embed_tokens.weight").dtype == torch.float32
    assert artifact.tensor("text/embed_tokens.weight", torch.bfloat16).dtype == torch.bfloat16


def test_encoded_hands_out_the_stored_planes(tmp_path):
    path = tmp_path / "a.ninfer"
    write_container(path)
    artifact = Artifact.open(path)
    encoded = artifact.encoded("text/layers.0.mlp.gate_proj.weight")
    assert encoded.format == "q4_g64_fp16" and encoded.layout == "row_groups_v1"
    assert (
        encoded.planes["codes"].shape == (24, 32)
        and encoded.planes["scales"].dtype == torch.float16
    )
    tensor, _ = sample_tensors()["text/layers.0.mlp.gate_proj.weight"]
    reference = get_format("q4_g64_fp16").encode(tensor)
    assert torch.equal(encoded.planes["codes"], reference.planes["codes"])


def test_names_has_config_and_resources(tmp_path):
    path = tmp_path / "a.ninfer"
    write_container(path)
    artifact = Artifact.open(path)
    assert artifact.names("text/layers.0.") == sorted(
        n for n in sample_tensors() if n.startswith("text/layers.0.")
    )
    assert artifact.has("text/lm_head.weight") and not artifact.has("text/nope")
    assert artifact.config() == {"model_type": "qwen3_5_text", "hidden_size": 64}
    assert artifact.resource("tokenizer") == b'{"model": {}}'
    assert artifact.resource("chat_template") is None
    with pytest.raises(ArtifactError, match="no tensor named 'text/nope'"):
        artifact.tensor("text/nope")
    with pytest.raises(ArtifactError, match="no component 'vision'"):
        artifact.config("vision")


def test_binding_to_element_ranges_of_a_parent_object(tmp_path):
    parent = torch.randn(6, 32)
    tensors = {"text/fused": (parent, "fp32")}
    bindings = {
        "text/top": {"parts": [{"object": "text/fused", "range": [0, 64]}], "shape": [2, 32]},
        "text/rest": {"parts": [{"object": "text/fused", "range": [64, 192]}], "shape": [4, 32]},
    }
    path = tmp_path / "a.ninfer"
    write_container(path, tensors=tensors, bindings=bindings)
    artifact = Artifact.open(path)
    assert torch.equal(artifact.tensor("text/top"), parent[:2])
    assert torch.equal(artifact.tensor("text/rest"), parent[2:])


@pytest.mark.parametrize("max_file_bytes", [8192 + 512, 9000, 12288])
def test_multi_part_container_splits_files_and_reads_back(tmp_path, max_file_bytes):
    path = tmp_path / "a.ninfer"
    files = write_container(path, max_file_bytes=max_file_bytes)
    assert len(files) > 1
    assert [f.name for f in files[1:]] == [f"a.ninfer.part-{i:04d}" for i in range(1, len(files))]
    for index, part in enumerate(files[1:], start=1):
        raw = part.read_bytes()
        assert raw[:8] == PART_MAGIC and struct.unpack("<Q", raw[8:16])[0] == index
        assert raw[16:32] == ARTIFACT_ID
    assert all(f.stat().st_size <= max_file_bytes for f in files)
    artifact = Artifact.open(path, verify=True)
    assert len(artifact.container.files) == len(files)
    for name, (tensor, fmt_name) in sample_tensors().items():
        assert torch.equal(artifact.tensor(name), expected_decode(tensor, fmt_name)), name


@pytest.mark.parametrize("max_file_bytes", [8192 + 4096, 8192 + 4096 + 1])
def test_object_larger_than_a_part_spans_files(tmp_path, max_file_bytes):
    tensors = {
        "text/big": (torch.randn(64, 64), "fp32"),  # 16 KiB, more than one part can hold
        "text/after": (torch.randn(5, 7), "fp32"),
        "text/last": (torch.randn(4, 64), "bf16"),
    }
    path = tmp_path / "a.ninfer"
    files = write_container(path, tensors=tensors, max_file_bytes=max_file_bytes)
    assert len(files) >= 3 and all(f.stat().st_size <= max_file_bytes for f in files)
    artifact = Artifact.open(path, verify=True)
    # whatever the file size limit, every file's share of the payload starts 256-byte aligned,
    # so the objects after the spanning one are still aligned views of their file
    assert all(f.logical_start % 256 == 0 for f in artifact.container.files)
    for name, (tensor, fmt_name) in tensors.items():
        assert torch.equal(artifact.tensor(name), expected_decode(tensor, fmt_name)), name


def test_checksum_mismatch_is_caught_by_verify_and_names_the_object(tmp_path):
    path = tmp_path / "a.ninfer"
    write_container(path)
    container = Container.open(path)
    obj = container.object("text/lm_head.weight")
    offset = container.files[0].payload_start + obj["offset"] + 3
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))
    Artifact.open(path)  # sizes are intact: opening without verification succeeds
    with pytest.raises(ArtifactError, match="object text/lm_head.weight: checksum mismatch"):
        Artifact.open(path, verify=True)
    assert cli_main(["inspect", str(path), "--verify"]) == 1


def corrupt_magic(path):
    raw = bytearray(path.read_bytes())
    raw[:8] = b"GGUF\x00\x00\x00\x03"
    path.write_bytes(bytes(raw))


def corrupt_version(path):
    raw = bytearray(path.read_bytes())
    raw[7] = 2
    path.write_bytes(bytes(raw))


def truncate_entry(path):
    path.write_bytes(path.read_bytes()[:-100])


def truncate_header(path):
    path.write_bytes(path.read_bytes()[:20])


def bad_json(path):
    raw = bytearray(path.read_bytes())
    raw[32] = ord("!")
    path.write_bytes(bytes(raw))


def object_out_of_range(path):
    rewrite_root(
        path, lambda root: root["objects"][-1].update(offset=root["objects"][-1]["offset"] + 10**6)
    )


def wrong_object_size(path):
    rewrite_root(
        path, lambda root: root["objects"][-1].update(bytes=root["objects"][-1]["bytes"] - 4)
    )


def unknown_format(path):
    rewrite_root(path, lambda root: root["objects"][-1].update(format="nvfp9"))


def missing_components(path):
    rewrite_root(path, lambda root: root.pop("components"))


def object_without_shape(path):
    rewrite_root(path, lambda root: root["objects"][-1].pop("shape"))


def file_without_payload_bytes(path):
    rewrite_root(path, lambda root: root["files"][0].pop("payload_bytes"))


def components_not_an_object(path):
    rewrite_root(path, lambda root: root.update(components=["text"]))


def binding_without_object(path):
    rewrite_root(path, lambda root: root["bindings"].update({"text/positions": {"parts": 3}}))


BAD_ENTRIES = [
    (corrupt_magic, "not a .ninfer file"),
    (corrupt_version, "container version 2 is not supported"),
    (truncate_entry, "truncated: expected"),
    (truncate_header, "truncated: 20 bytes"),
    (bad_json, "header JSON is invalid"),
    (object_out_of_range, "object text/positions: bytes .* lie outside the payload"),
    (wrong_object_size, "object text/positions: 36 bytes, but int32 \\[10\\] needs 40"),
    (unknown_format, "object text/positions: unknown weight format 'nvfp9'"),
    (missing_components, "header JSON has no 'components'"),
    (object_without_shape, "object text/positions: malformed entry \\(KeyError: 'shape'\\)"),
    (file_without_payload_bytes, "file 0 has no valid 'payload_bytes'"),
    (components_not_an_object, "header JSON's 'components' is not a JSON object"),
    (binding_without_object, "binding text/positions is malformed or names no object"),
]


@pytest.mark.parametrize(
    ("damage", "message"), BAD_ENTRIES, ids=[d.__name__ for d, _ in BAD_ENTRIES]
)
def test_malformed_entry_file_gives_one_clear_error(tmp_path, capsys, damage, message):
    path = tmp_path / "a.ninfer"
    write_container(path)
    damage(path)
    with pytest.raises(ArtifactError, match=message) as info:
        Artifact.open(path)
    assert str(path) in str(info.value)
    assert cli_main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "Traceback" not in err and err.startswith("ninfer inspect: error:")
    )


def test_missing_file_is_reported_by_name(tmp_path):
    with pytest.raises(ArtifactError, match="nothing.ninfer: no such file"):
        Artifact.open(tmp_path / "nothing.ninfer")


def test_missing_truncated_and_foreign_parts_are_reported(tmp_path):
    path = tmp_path / "a.ninfer"
    files = write_container(path, max_file_bytes=12288)
    part = files[1]
    good = part.read_bytes()

    part.write_bytes(good[:-10])
    with pytest.raises(ArtifactError, match=f"{part}: truncated part"):
        Artifact.open(path)

    part.write_bytes(good[:16] + bytes(16) + good[32:])
    with pytest.raises(ArtifactError, match="belongs to another artifact"):
        Artifact.open(path)

    part.write_bytes(b"NINFER\x00\x03" + good[8:])
    with pytest.raises(ArtifactError, match="not the expected kind"):
        Artifact.open(path)

    part.unlink()
    with pytest.raises(ArtifactError, match=f"{part}: missing part 1 of a.ninfer"):
        Artifact.open(path)


def test_writer_refuses_to_overwrite_and_leaves_nothing_on_failure(tmp_path):
    path = tmp_path / "a.ninfer"
    path.write_bytes(b"precious")
    with pytest.raises(ArtifactError, match="already exists"):
        write_container(path)
    assert path.read_bytes() == b"precious"

    other = tmp_path / "b.ninfer"
    objects = [
        ObjectPlan.tensor("text/x", (64, 64), "fp32"),
        ObjectPlan.tensor("text/y", (8,), "fp32"),
    ]
    with pytest.raises(RuntimeError, match="interrupted"):
        with ContainerWriter(
            other, objects, components={"text": {}}, bindings={}, max_file_bytes=9000
        ) as writer:
            writer.write("text/x", torch.zeros(64, 64).view(torch.uint8).reshape(-1))
            raise RuntimeError("interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ninfer"]


def test_writer_rejects_objects_out_of_plan_order_or_size(tmp_path):
    objects = [ObjectPlan.tensor("text/x", (4,), "fp32"), ObjectPlan.tensor("text/y", (4,), "fp32")]
    with ContainerWriter(
        tmp_path / "c.ninfer", objects, components={"text": {}}, bindings={}
    ) as writer:
        with pytest.raises(ArtifactError, match="expected 'text/x'"):
            writer.write("text/y", bytes(16))
        with pytest.raises(ArtifactError, match="has 8 bytes, planned 16"):
            writer.write("text/x", bytes(8))
        with pytest.raises(ArtifactError, match="1 planned objects were not written"):
            writer.write("text/x", bytes(16))
            writer.finish()
    assert list(tmp_path.iterdir()) == []


def test_inspect_prints_summary_objects_bindings_and_json(tmp_path, capsys):
    path = tmp_path / "a.ninfer"
    write_container(path)
    assert cli_main(["inspect", str(path), "--objects", "--bindings", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "component  text: qwen3_5_text" in out
    assert "q6_g64_fp16" in out and "text/lm_head.weight -> text/lm_head.weight" in out
    assert "verified 8 objects" in out
    assert cli_main(["inspect", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["metadata"] == {"name": "sample"}
    # with --json, stdout stays one JSON document whatever else is asked
    argv = ["inspect", str(path), "--json", "--objects", "--bindings", "--verify"]
    assert cli_main(argv) == 0
    printed = capsys.readouterr()
    assert json.loads(printed.out)["metadata"] == {"name": "sample"}
    assert "verified 8 objects" in printed.err
