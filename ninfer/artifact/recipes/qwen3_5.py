"""Built-in recipe for dense Qwen3.5 (`qwen3_5`, any size), text-only (`model.*`) or released
multimodal (`model.language_model.*`) layout, with the `mtp.*` head. `Qwen3_5Recipe` also serves
the MoE variant (qwen3_5_moe.py), which differs only in the MLP of each layer."""

from __future__ import annotations

import re

from ninfer.artifact.checkpoint import Checkpoint
from ninfer.artifact.recipes import PROFILES, ConversionPlan, TensorPlan
from ninfer.errors import ConversionError

KNOWN_COMPONENTS = ("text", "mtp", "vision")
TEXT_PREFIXES = ("model.language_model.", "model.")
VISION_PREFIX = "model.visual."

GDN_NAMES = (
    "linear_attn.in_proj_qkv.weight",
    "linear_attn.in_proj_z.weight",
    "linear_attn.in_proj_b.weight",
    "linear_attn.in_proj_a.weight",
    "linear_attn.conv1d.weight",
    "linear_attn.dt_bias",
    "linear_attn.A_log",
    "linear_attn.norm.weight",
    "linear_attn.out_proj.weight",
)
ATTENTION_NAMES = tuple(
    f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
)
DENSE_MLP_NAMES = tuple(f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj"))
MOE_MLP_NAMES = (
    "mlp.gate.weight",
    "mlp.shared_expert.gate_proj.weight",
    "mlp.shared_expert.up_proj.weight",
    "mlp.shared_expert.down_proj.weight",
    "mlp.shared_expert_gate.weight",
)
# kept in higher precision in the groupwise-int profile: small, and sensitive to error
BF16_LINEARS = (
    "linear_attn.in_proj_a.weight",
    "linear_attn.in_proj_b.weight",
    "mlp.gate.weight",
    "mlp.shared_expert_gate.weight",
)
FP32_PARAMS = ("linear_attn.A_log", "linear_attn.dt_bias")


class Qwen3_5Recipe:
    def __init__(self, name: str, model_types: tuple[str, ...], moe: bool):
        self.name = name
        self.model_types = model_types
        self.moe = moe

    # formats -----------------------------------------------------------------------------------

    def choose_format(self, name: str, shape: tuple[int, ...], profile: str) -> str:
        """The stored format of logical tensor `name` under a weight profile."""
        component, local = name.split("/", 1)
        if local.endswith(FP32_PARAMS) or profile == "fp32":
            return "fp32"
        if profile == "bf16":
            return "bf16"
        is_matrix = len(shape) >= 2 and not local.endswith("conv1d.weight")
        if not is_matrix or local.endswith(BF16_LINEARS):
            return "bf16"
        if local in ("embed_tokens.weight", "lm_head.weight"):
            return "q6_g64_fp16"
        if component == "mtp":
            return "q8_g32_fp16"
        return "q4_g64_fp16"

    # planning ----------------------------------------------------------------------------------

    def plan(
        self, checkpoint: Checkpoint, components: set[str] | None, profile: str
    ) -> ConversionPlan:
        if profile not in PROFILES:
            raise ConversionError(
                f"unknown weight profile {profile!r} (known: {', '.join(PROFILES)})"
            )
        config = checkpoint.config
        model_type = config.get("model_type")
        if model_type not in self.model_types:
            raise ConversionError(
                f"{checkpoint.dir / 'config.json'}: model_type {model_type!r} is not supported by recipe "
                f"{self.name} (supports {', '.join(self.model_types)})"
            )
        text_config = config.get("text_config", config)
        keys = checkpoint.keys()
        has_mtp = any(k.startswith("mtp.") for k in keys)
        if components is None:
            components = {"text", "mtp"} if has_mtp else {"text"}
        for component in components:
            if component not in KNOWN_COMPONENTS:
                raise ConversionError(
                    f"unknown component {component!r} (known: {', '.join(KNOWN_COMPONENTS)})"
                )
        if "vision" in components:
            raise ConversionError(f"recipe {self.name} does not convert the vision component yet")
        if "text" not in components:
            raise ConversionError("--components must include text")

        text_prefix = next(
            (p for p in TEXT_PREFIXES if any(k.startswith(p + "embed_tokens.") for k in keys)), None
        )
        if text_prefix is None:
            raise ConversionError(
                f"{checkpoint.dir}: checkpoint has no tensor 'model.embed_tokens.weight' "
                "(nor 'model.language_model.embed_tokens.weight')"
            )

        builder = _PlanBuilder(self, checkpoint, profile, text_config)
        builder.add("text/embed_tokens.weight", text_prefix + "embed_tokens.weight")
        for i, layer_type in enumerate(_layer_types(text_config)):
            builder.add_layer(f"text/layers.{i}.", f"{text_prefix}layers.{i}.", layer_type)
        builder.add("text/norm.weight", text_prefix + "norm.weight")
        tied = bool(
            config.get("tie_word_embeddings", text_config.get("tie_word_embeddings", False))
        )
        if not tied:
            builder.add("text/lm_head.weight", "lm_head.weight")
        plan_components: dict[str, dict] = {"text": {"config": config}}

        if "mtp" in components:
            if not has_mtp:
                raise ConversionError(
                    f"{checkpoint.dir}: --components mtp, but the checkpoint has no tensor 'mtp.fc.weight'"
                )
            for local in (
                "fc.weight",
                "pre_fc_norm_embedding.weight",
                "pre_fc_norm_hidden.weight",
                "norm.weight",
            ):
                builder.add(f"mtp/{local}", f"mtp.{local}")
            for j in range(_mtp_layers(text_config, keys)):
                builder.add_layer(f"mtp/layers.{j}.", f"mtp.layers.{j}.", "full_attention")
            plan_components["mtp"] = {"config": config, "target": "text"}

        plan = ConversionPlan(plan_components, builder.tensors)
        unused = [k for k in keys if k not in builder.used]
        reasons = {
            "vision tensors (vision component not converted)": lambda k: k.startswith(
                VISION_PREFIX
            ),
            "mtp tensors (mtp component not requested)": lambda k: k.startswith("mtp."),
            "lm_head.weight (embeddings are tied)": lambda k: tied and k == "lm_head.weight",
        }
        for reason, matches in reasons.items():
            count = sum(1 for k in unused if matches(k))
            if count:
                plan.skipped[reason] = count
            unused = [k for k in unused if not matches(k)]
        if unused:
            plan.warnings.append(
                f"{len(unused)} checkpoint tensors are not used by recipe {self.name}, e.g. {unused[0]!r}"
            )
        return plan


class _PlanBuilder:
    def __init__(
        self, recipe: Qwen3_5Recipe, checkpoint: Checkpoint, profile: str, text_config: dict
    ):
        self.recipe = recipe
        self.checkpoint = checkpoint
        self.profile = profile
        self.text_config = text_config
        self.tensors: list[TensorPlan] = []
        self.used: set[str] = set()

    def _require(self, key: str) -> None:
        if not self.checkpoint.has(key):
            raise ConversionError(f"{self.checkpoint.dir}: checkpoint has no tensor {key!r}")
        self.used.add(key)

    def _append(
        self, name: str, sources: tuple[str, ...], shape: tuple[int, ...], combine: str
    ) -> None:
        fmt = self.recipe.choose_format(name, shape, self.profile)
        self.tensors.append(TensorPlan(name, sources, shape, fmt, combine))

    def add(self, name: str, key: str) -> None:
        self._require(key)
        self._append(name, (key,), self.checkpoint.shape(key), "single")

    def add_layer(self, name_prefix: str, key_prefix: str, layer_type: str) -> None:
        names = ["input_layernorm.weight", "post_attention_layernorm.weight"]
        if layer_type == "linear_attention":
            names += GDN_NAMES
        elif layer_type == "full_attention":
            names += ATTENTION_NAMES
        else:
            raise ConversionError(
                f"layer {key_prefix}: unknown layer type {layer_type!r} in config.json"
            )
        names += MOE_MLP_NAMES if self.recipe.moe else DENSE_MLP_NAMES
        for local in names:
            self.add(name_prefix + local, key_prefix + local)
        if self.recipe.moe:
            self._add_experts(name_prefix + "mlp.experts.", key_prefix + "mlp.experts.")

    def _add_experts(self, name_prefix: str, key_prefix: str) -> None:
        if self.checkpoint.has(key_prefix + "gate_up_proj"):
            self.add(name_prefix + "gate_up_proj", key_prefix + "gate_up_proj")
            self.add(name_prefix + "down_proj", key_prefix + "down_proj")
            return
        num_experts = self.text_config.get("num_experts")
        if not num_experts:
            raise ConversionError("config.json has no num_experts")
        gate_up, down = [], []
        for e in range(num_experts):
            gate_up += [f"{key_prefix}{e}.gate_proj.weight", f"{key_prefix}{e}.up_proj.weight"]
            down.append(f"{key_prefix}{e}.down_proj.weight")
        for key in gate_up + down:
            self._require(key)
        gate_shape, up_shape = self.checkpoint.shape(gate_up[0]), self.checkpoint.shape(gate_up[1])
        stacked = (num_experts, gate_shape[0] + up_shape[0], gate_shape[1])
        self._append(name_prefix + "gate_up_proj", tuple(gate_up), stacked, "stack_pairs")
        down_shape = (num_experts, *self.checkpoint.shape(down[0]))
        self._append(name_prefix + "down_proj", tuple(down), down_shape, "stack")


def _layer_types(text_config: dict) -> list[str]:
    n = text_config.get("num_hidden_layers")
    if not isinstance(n, int):
        raise ConversionError("config.json has no num_hidden_layers")
    layer_types = text_config.get("layer_types")
    if layer_types is None:
        interval = text_config.get("full_attention_interval", 4)
        layer_types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)
        ]
    if len(layer_types) != n:
        raise ConversionError(
            f"config.json: layer_types has {len(layer_types)} entries for {n} layers"
        )
    return list(layer_types)


def _mtp_layers(text_config: dict, keys: list[str]) -> int:
    configured = text_config.get("mtp_num_hidden_layers")
    if configured:
        return int(configured)
    found = {int(m.group(1)) for k in keys if (m := re.match(r"mtp\.layers\.(\d+)\.", k))}
    return max(found) + 1 if found else 0


RECIPE = Qwen3_5Recipe("qwen3_5", ("qwen3_5", "qwen3_5_text"), moe=False)
