"""`request_x_splits` asks every kernel that writes an integer GEMV's input to write x's codes
beside it (`kernels/x_split.py`), and nothing else: with the decoder linears kept in q4 (as
on the GPU), both norms of every layer, each attention output gate, each GDN gated norm and
each SwiGLU product are asked for q4 codes; with dense linears (the CPU path), none is."""

from __future__ import annotations

import torch
from tiny_qwen import convert_to_artifact, keep_linears_in_q4, load_ours, make_hf_model
from torch import nn

from ninfer.kernels.x_split import SplitRequest
from ninfer.models.layers.attention import Attention
from ninfer.models.layers.gated_deltanet import GatedDeltaNet
from ninfer.models.layers.mlp import MLP
from ninfer.models.qwen3_5 import request_x_splits
from ninfer.quant import get_format

Q4 = get_format("q4_g64_fp16")


def producers(model: nn.Module) -> list[tuple[str, SplitRequest | None]]:
    found = []
    for layer in model.layers:
        found += [("input norm", layer.input_layernorm.split_request)]
        found += [("post-attention norm", layer.post_attention_layernorm.split_request)]
    for module in model.modules():
        if isinstance(module, Attention):
            found.append(("output gate", module.o_split))
        elif isinstance(module, GatedDeltaNet):
            found.append(("gated norm", module.norm.split_request))
        elif isinstance(module, MLP):
            found.append(("swiglu", module.down_split))
    return found


def test_every_producer_of_a_q4_input_is_asked_for_q4_codes(tmp_path):
    artifact = convert_to_artifact(make_hf_model("dense_3gdn_1attn_gqa2"), tmp_path)
    model = load_ours(artifact, torch.float32)
    assert all(request is None for _, request in producers(model))  # dense linears: none
    keep_linears_in_q4(model)
    asked = request_x_splits(model)
    found = producers(model)
    assert asked == len(found) == 4 * len(model.layers)  # two norms, the mixer, the SwiGLU
    assert {request for _, request in found} == {SplitRequest(4, 64, 1)}
