"""Projections that read one input run as one linear after loading (`fuse_projections`):
GDN qkv+z and b+a, attention q+k+v, MLP and shared-expert gate+up. On the CPU reference path
the fused model gives the unfused model's logits bit for bit (dense and MoE, with MTP, fp32
and bf16); stacked encoded weights give each weight's product; weights that cannot be stacked
stay apart; the originals are freed; with tensor parallelism each rank stacks its own slices."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from tiny_qwen import Runner
from torch import nn

from ninfer.artifact.artifact import Artifact
from ninfer.models import qwen3_5
from ninfer.models.layers.attention import Attention
from ninfer.models.layers.gated_deltanet import GatedDeltaNet
from ninfer.models.layers.linear import (
    GEMV_MAX_ROWS,
    FusedLinear,
    GroupwiseLinear,
    fuse_into,
    fuse_linears,
)
from ninfer.models.layers.mlp import MLP
from ninfer.models.registry import load_model
from ninfer.parallel.shard import Shard
from ninfer.quant import get_format

FUSED = {
    GatedDeltaNet: {
        "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
        "in_proj_ba": ("in_proj_b", "in_proj_a"),
    },
    Attention: {"qkv_proj": ("q_proj", "k_proj", "v_proj")},
    MLP: {"gate_up_proj": ("gate_proj", "up_proj")},
}


def load(path, dtype=torch.float32, shard=None):
    artifact = Artifact.open(path)
    return load_model(artifact, artifact.config(), dtype=dtype, shard=shard)


def run(model) -> list[torch.Tensor]:
    """Two sequences: prefill in two chunks, then batched single-token decodes; main and MTP
    logits of every step."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (80,), generator=gen).tolist()
    runner = Runner(model)
    runner.add("a")
    runner.add("b")
    outputs = []
    for begin, end in [(0, 40), (40, 70)] + [(t, t + 1) for t in range(70, 75)]:
        new = {"a": ids[begin:end], "b": ids[begin + 1 : end + 1]}
        following = {"a": ids[begin + 1 : end + 1], "b": ids[begin + 2 : end + 2]}
        logits, mtp_logits = runner.step(new, mtp_ids=following)
        outputs += [logits["a"], logits["b"], mtp_logits["a"], mtp_logits["b"]]
    return outputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_fused_model_gives_the_unfused_logits_bit_for_bit(tiny_artifact, monkeypatch, moe, dtype):
    _, path = tiny_artifact(weights="fp32", mtp=True, moe=moe)
    fused = load(path, dtype)
    monkeypatch.setattr(qwen3_5, "fuse_projections", lambda model: [])
    unfused = load(path, dtype)
    assert not any(isinstance(m, FusedLinear) for m in unfused.modules())
    layers = [m for m in fused.modules() if type(m) in FUSED]
    assert len(layers) == 2 * (len(fused.layers) + 1)  # mixer and MLP of each layer and MTP's
    for layer in layers:
        for name, parts in FUSED[type(layer)].items():
            assert isinstance(getattr(layer, name), FusedLinear)
            assert not any(hasattr(layer, part) for part in parts)
    assert all(torch.equal(a, b) for a, b in zip(run(fused), run(unfused), strict=True))


def test_each_rank_stacks_its_own_slices(tiny_artifact):
    """Tensor parallel rank 1 of 2: the parts take this rank's sizes and slices."""
    _, path = tiny_artifact(weights="fp32")
    shard = Shard(rank=1, world=2)
    model = load(path, shard=shard)
    artifact = Artifact.open(path)
    config = model.config

    def local(name: str) -> torch.Tensor:
        full = artifact.tensor(f"text/{name}", torch.float32)
        return shard.slice_parameter(name, full, config)

    gdn, attn, mlp = model.layers[0].linear_attn, model.layers[1].self_attn, model.layers[0].mlp
    assert gdn.in_proj_qkvz.split_sizes == (gdn.conv_dim, gdn.value_dim)
    assert gdn.in_proj_ba.split_sizes == (gdn.num_value_heads, gdn.num_value_heads)
    assert gdn.num_value_heads == config.linear_num_value_heads // 2
    kv_rows = attn.num_kv_heads * attn.head_dim
    assert attn.qkv_proj.split_sizes == (2 * attn.num_heads * attn.head_dim, kv_rows, kv_rows)
    assert mlp.gate_up_proj.split_sizes == (config.intermediate_size // 2,) * 2
    expected = {
        gdn.in_proj_qkvz: ["layers.0.linear_attn.in_proj_qkv", "layers.0.linear_attn.in_proj_z"],
        gdn.in_proj_ba: ["layers.0.linear_attn.in_proj_b", "layers.0.linear_attn.in_proj_a"],
        attn.qkv_proj: [f"layers.1.self_attn.{p}_proj" for p in "qkv"],
        mlp.gate_up_proj: ["layers.0.mlp.gate_proj", "layers.0.mlp.up_proj"],
    }
    for fused, names in expected.items():
        stacked = torch.cat([local(f"{name}.weight") for name in names])
        assert torch.equal(fused.linear.weight, stacked)


def encoded_linears(formats: list[str], sizes: list[int], k: int) -> list[GroupwiseLinear]:
    return [
        GroupwiseLinear(get_format(fmt).encode(torch.randn(n, k) * k**-0.5))
        for fmt, n in zip(formats, sizes)
    ]


@pytest.mark.parametrize("format_name", ["q4_g64_fp16", "q8_g32_fp16"])
@pytest.mark.parametrize("rows", [1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 40])
def test_stacked_encoded_linears_give_each_ones_product(format_name, rows):
    """Planes stacked by rows are the encoded stacked weight; on the CPU reference path (GEMV
    sizes and prefill sizes) each output equals its own linear's bit for bit."""
    linears = encoded_linears([format_name] * 3, [40, 24, 24], 200)
    x = torch.randn(rows, 200)
    expected = [linear(x) for linear in linears]
    fused = fuse_linears(linears)
    assert isinstance(fused.linear, GroupwiseLinear) and fused.linear.format == format_name
    assert fused.linear.shape == (88, 200)
    stacked = torch.cat([linear.encoded.decode() for linear in linears])
    assert torch.equal(fused.linear.encoded.decode(), stacked)
    outputs = fused(x)
    assert all(torch.equal(out, ref) for out, ref in zip(outputs, expected, strict=True))


def test_stacked_dense_linears_give_each_ones_product():
    linears = [nn.Linear(64, n, bias=False) for n in (48, 4, 4)]
    x = torch.randn(5, 64)
    fused = fuse_linears(linears)
    assert torch.equal(fused.linear.weight, torch.cat([linear.weight for linear in linears]))
    outputs = fused(x)
    assert all(torch.equal(out, F.linear(x, lin.weight)) for out, lin in zip(outputs, linears))


def test_linears_that_cannot_be_stacked_stay_apart():
    q4_and_q8 = encoded_linears(["q4_g64_fp16", "q8_g32_fp16"], [32, 32], 128)
    encoded_and_dense = [
        *encoded_linears(["q4_g64_fp16"], [32], 128),
        nn.Linear(128, 32, bias=False),
    ]
    two_dtypes = [
        nn.Linear(128, 8, bias=False),
        nn.Linear(128, 8, bias=False, dtype=torch.bfloat16),
    ]
    with_bias = [nn.Linear(128, 8), nn.Linear(128, 8)]
    for linears in (q4_and_q8, encoded_and_dense, two_dtypes, with_bias):
        assert fuse_linears(linears) is None
    mlp = MLP(128, 32)
    mlp.gate_proj, mlp.up_proj = encoded_and_dense
    x = torch.randn(3, 128)
    before = mlp(x)
    assert mlp.fuse_projections() == []
    assert mlp.gate_up_proj is None and torch.equal(mlp(x), before)


def test_fusing_drops_the_original_weights():
    mlp = MLP(64, 32)
    originals = [weakref.ref(mlp.gate_proj.weight), weakref.ref(mlp.up_proj.weight)]
    assert fuse_into(mlp, "gate_up_proj", ("gate_proj", "up_proj"))
    gc.collect()
    assert all(ref() is None for ref in originals)
    assert [name for name, _ in mlp.named_parameters()] == [
        "down_proj.weight",
        "gate_up_proj.linear.weight",
    ]
