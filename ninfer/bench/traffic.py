"""The speed-of-light model: bytes a decode step must move and FLOPs a prefill step must do,
computed from a model's config and the stored format of each weight (docs/performance.md).

Weights are listed from the model class itself (built on the meta device), so the model and the
count cannot drift apart. MTP and vision weights are not read by a plain step and are left out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ninfer.quant import get_format

FormatOf = Callable[[str, tuple[int, ...]], str]


@dataclass(frozen=True, slots=True)
class WeightTensor:
    name: str  # logical name, e.g. text/layers.0.mlp.up_proj.weight
    shape: tuple[int, ...]
    format: str
    nbytes: int  # codes + scales in its format (plane alignment padding is not read)
    kind: str  # "dense" (read whole each step), "embedding" (one row per token), "expert"


@dataclass(frozen=True, slots=True)
class StepBytes:
    """Bytes one decode step moves, by component."""

    weights: int
    recurrent_state: int  # GDN state, read + write
    conv_state: int  # causal-conv window, read + write
    kv_read: int
    kv_write: int

    @property
    def total(self) -> int:
        return self.weights + self.recurrent_state + self.conv_state + self.kv_read + self.kv_write


def format_bytes(format_name: str, shape: tuple[int, ...]) -> int:
    return sum(spec.nbytes for spec in get_format(format_name).plane_specs(tuple(shape)))


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Experts a layer reads for `tokens` rows routed independently and uniformly (a random
    router's behaviour): E * (1 - (1 - k/E)^B); exactly k for one row."""
    if num_experts == 0 or tokens == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


class Traffic:
    """Bytes and FLOPs of one model (text component) with its weights in given formats."""

    def __init__(
        self,
        config: dict[str, Any],
        format_of: FormatOf,
        *,
        kv_itemsize: int = 2,
        conv_itemsize: int = 2,
        state_itemsize: int = 4,
    ) -> None:
        from ninfer.models.qwen3_5 import Qwen3_5Config, logical_name
        from ninfer.models.registry import model_class

        cls = model_class(config)
        self.config = Qwen3_5Config.from_hf(config, is_moe=cls.is_moe)
        with torch.device("meta"):
            model = cls(self.config, with_mtp=False, device="meta")
        self.weights: list[WeightTensor] = []
        for param_name, param in model.named_parameters():
            name = logical_name(param_name)
            shape = tuple(param.shape)
            fmt = format_of(name, shape)
            if param_name == "embed_tokens.weight":
                kind = "dense" if self.config.tie_word_embeddings else "embedding"
            elif ".mlp.experts." in param_name:
                kind = "expert"
            else:
                kind = "dense"
            self.weights.append(WeightTensor(name, shape, fmt, format_bytes(fmt, shape), kind))
        self.kv_itemsize = kv_itemsize
        self.conv_itemsize = conv_itemsize
        self.state_itemsize = state_itemsize
        c = self.config
        self.num_attention_layers = c.layer_types.count("full_attention")
        self.num_gdn_layers = c.layer_types.count("linear_attention")
        self.conv_dim = (
            2 * c.linear_num_key_heads * c.linear_key_head_dim
            + c.linear_num_value_heads * c.linear_value_head_dim
        )

    # ---- bytes -------------------------------------------------------------------------------

    def kv_bytes_per_token(self) -> int:
        c = self.config
        return self.num_attention_layers * 2 * c.num_kv_heads * c.head_dim * self.kv_itemsize

    def state_bytes_per_sequence(self) -> int:
        c = self.config
        per_layer = (
            c.linear_num_value_heads
            * c.linear_key_head_dim
            * c.linear_value_head_dim
            * self.state_itemsize
        )
        return self.num_gdn_layers * per_layer

    def conv_bytes_per_sequence(self) -> int:
        window = self.conv_dim * (self.config.conv_kernel - 1) * self.conv_itemsize
        return self.num_gdn_layers * window

    def weight_bytes(self, batch: int) -> float:
        """Weight bytes a decode step over `batch` sequences reads: every dense tensor once, one
        embedding row per sequence, the routed experts the batch is expected to touch."""
        c = self.config
        distinct = expected_distinct_experts(c.num_experts, c.num_experts_per_tok, batch)
        total = 0.0
        for w in self.weights:
            if w.kind == "dense":
                total += w.nbytes
            elif w.kind == "embedding":
                total += batch * w.nbytes / w.shape[0]
            else:
                total += w.nbytes * distinct / c.num_experts
        return total

    def decode_bytes(self, context_lens: Sequence[int]) -> StepBytes:
        """One decode step: each sequence has `context_lens[i]` tokens cached and adds one. It
        reads the weights, reads and writes its recurrent and conv state, reads the K/V of its
        context plus the new token and writes the new token's K/V."""
        batch = len(context_lens)
        kv = self.kv_bytes_per_token()
        return StepBytes(
            weights=round(self.weight_bytes(batch)),
            recurrent_state=2 * batch * self.state_bytes_per_sequence(),
            conv_state=2 * batch * self.conv_bytes_per_sequence(),
            kv_read=kv * sum(n + 1 for n in context_lens),
            kv_write=kv * batch,
        )

    # ---- FLOPs -------------------------------------------------------------------------------

    def matmul_params_per_token(self) -> float:
        """Weights one token multiplies with, head excluded: every matrix but the embedding, the
        head and the conv taps, with the routed experts at top-k of E."""
        c = self.config
        total = 0.0
        for w in self.weights:
            local = w.name.split("/", 1)[1]
            if len(w.shape) < 2 or local in ("embed_tokens.weight", "lm_head.weight"):
                continue
            if local.endswith("conv1d.weight"):
                continue
            count = 1
            for dim in w.shape:
                count *= dim
            if w.kind == "expert":
                count = count * c.num_experts_per_tok / c.num_experts
            total += count
        return total

    def prefill_flops(
        self,
        context_lens: Sequence[int],
        query_lens: Sequence[int],
        sampled: Sequence[bool],
    ) -> float:
        """One prefill step: sequence i adds `query_lens[i]` tokens after `context_lens[i]`
        cached ones; the head runs for the sampled rows only. Counts 2 FLOPs per multiply-add:
        the matmuls, causal attention over the cached prefix plus the chunk (QK and PV), the
        Gated DeltaNet recurrence (state decay, S^T k, rank-1 update, S^T q: ~7 dk dv per value
        head) and the conv taps."""
        c = self.config
        tokens = sum(query_lens)
        flops = 2.0 * self.matmul_params_per_token() * tokens
        flops += 2.0 * c.vocab_size * c.hidden_size * sum(1 for s in sampled if s)
        attended = sum(t * n + t * (t + 1) // 2 for n, t in zip(context_lens, query_lens))
        flops += self.num_attention_layers * 4.0 * c.num_heads * c.head_dim * attended
        gdn_per_token = (
            7 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
            + 2 * self.conv_dim * c.conv_kernel
        )
        flops += self.num_gdn_layers * float(gdn_per_token) * tokens
        return flops

    # ---- summaries ---------------------------------------------------------------------------

    def bytes_by_format(self) -> dict[str, int]:
        """Stored bytes of all text weights, per format."""
        out: dict[str, int] = {}
        for w in self.weights:
            out[w.format] = out.get(w.format, 0) + w.nbytes
        return out


# ---- which format each weight has ---------------------------------------------------------------

WEIGHT_CHOICES = ("bf16", "q8", "q4")


def profile_formats(config: dict[str, Any], weights: str) -> FormatOf:
    """The formats `ninfer convert` would store: `bf16` is the bf16 profile, `q4` the
    groupwise-int profile (q4_g64 linears, q6_g64 embedding and head, small linears bf16),
    `q8` that profile with every quantized tensor in q8_g32."""
    from ninfer.artifact.recipes import load_recipe

    if weights not in WEIGHT_CHOICES:
        raise ValueError(f"weights {weights!r} must be one of {', '.join(WEIGHT_CHOICES)}")
    text = config.get("text_config") or config
    recipe_name = "qwen3_5_moe" if "num_experts" in text else "qwen3_5"
    recipe = load_recipe(recipe_name)
    profile = "bf16" if weights == "bf16" else "groupwise-int"

    def format_of(name: str, shape: tuple[int, ...]) -> str:
        chosen = recipe.choose_format(name, shape, profile)
        if weights == "q8" and get_format(chosen).quantized:
            return "q8_g32_fp16"
        return chosen

    return format_of


def artifact_formats(artifact: Any) -> FormatOf:
    """The formats stored in an artifact (a tensor bound to parts takes its first part's)."""
    objects = {obj["id"]: obj for obj in artifact.root["objects"]}
    bindings = artifact.root["bindings"]

    def format_of(name: str, shape: tuple[int, ...]) -> str:
        binding = bindings[name]
        object_id = binding["object"] if "object" in binding else binding["parts"][0]["object"]
        return objects[object_id]["format"]

    return format_of
