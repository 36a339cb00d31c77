"""Qwen3.5 text models, dense (`qwen3_5`) and MoE (`qwen3_5_moe`): a stack of Gated-DeltaNet and
gated-attention decoder layers with (1 + w) RMSNorms, optionally followed by the MTP layer.
The two architectures differ only in the MLP of each layer.

Parameter names inside the module are the logical tensor names without their component
(`layers.3.self_attn.q_proj.weight` is `text/layers.3.self_attn.q_proj.weight`; `mtp.fc.weight`
is `mtp/fc.weight`), so loading is a walk over `named_parameters()`.

After the weights are in place, `fuse_projections` runs the projections that read one input
as one linear each (GDN qkv+z and b+a, attention q+k+v, MLP gate+up), so a decode step
launches fewer, larger kernels; on the CPU reference path the outputs stay bit for bit the
unfused ones (`FusedLinear`).

Tensor parallelism: a `Shard` (ninfer/parallel/shard.py) given at load says which heads, rows
and experts this rank holds; layers are built with the rank's local sizes, each decoder block
sums its row-parallel output over the ranks once, and the default `Shard()` is one whole rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.engine.kv_pool import CacheSpec
from ninfer.errors import ModelConfigError, UnsupportedModelError
from ninfer.kernels.dispatch import norm_folds_fit, takes_norm_folds
from ninfer.kernels.norm_fold import NormAfter, NormedRows
from ninfer.kernels.x_split import INT_MAX_ROWS, SplitRequest
from ninfer.models.context import ForwardContext
from ninfer.models.layers.attention import Attention
from ninfer.models.layers.gated_deltanet import GatedDeltaNet
from ninfer.models.layers.linear import FusedLinear, GroupwiseLinear, quantize_linears
from ninfer.models.layers.mlp import MLP
from ninfer.models.layers.moe import (
    GATHERED_MAX_TOKENS,
    GroupwiseExperts,
    SparseMoE,
    quantize_experts,
)
from ninfer.models.layers.norms import RMSNorm
from ninfer.models.layers.rotary import RotaryEmbedding
from ninfer.models.weights import WeightSource
from ninfer.parallel.shard import Shard

# Decode-sized steps fold the decoder norms into their neighbouring products where the model
# allows (`DecoderLayer.folds_norms`); False runs every norm as its own launch.
NORM_FOLDS = True


@dataclass(slots=True)
class Qwen3_5Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: list[str]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: list[int]
    tie_word_embeddings: bool
    intermediate_size: int = 0  # dense MLP
    is_moe: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @classmethod
    def from_hf(cls, config: dict[str, Any], *, is_moe: bool) -> Qwen3_5Config:
        """Read an HF config.json dict (top level or multimodal with a nested `text_config`);
        a missing or unreadable field is a `ModelConfigError` naming it."""
        try:
            return cls._from_hf(config, is_moe=is_moe)
        except KeyError as exc:
            raise ModelConfigError(f"the model config has no {exc.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError, ArithmeticError) as exc:
            raise ModelConfigError(f"the model config cannot be read: {exc}") from None

    @classmethod
    def _from_hf(cls, config: dict[str, Any], *, is_moe: bool) -> Qwen3_5Config:
        text = config.get("text_config") or config
        tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        num_layers = text["num_hidden_layers"]
        layer_types = text.get("layer_types") or [
            "full_attention"
            if (i + 1) % text.get("full_attention_interval", 4) == 0
            else "linear_attention"
            for i in range(num_layers)
        ]
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
            raise UnsupportedModelError(f"unsupported rope_type {rope.get('rope_type')!r}")
        unknown = set(layer_types) - {"full_attention", "linear_attention"}
        if unknown:
            raise UnsupportedModelError(f"unsupported layer types {sorted(unknown)}")
        chosen, experts = text.get("num_experts_per_tok", 0), text.get("num_experts", 0)
        if is_moe and not 0 < chosen <= experts:
            raise ModelConfigError(
                f"num_experts_per_tok {chosen!r} is not between 1 and num_experts {experts!r}"
            )
        num_heads = text["num_attention_heads"]
        return cls(
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            num_layers=num_layers,
            layer_types=list(layer_types),
            num_heads=num_heads,
            num_kv_heads=text.get("num_key_value_heads", num_heads),
            head_dim=text.get("head_dim") or text["hidden_size"] // num_heads,
            linear_num_key_heads=text["linear_num_key_heads"],
            linear_num_value_heads=text["linear_num_value_heads"],
            linear_key_head_dim=text["linear_key_head_dim"],
            linear_value_head_dim=text["linear_value_head_dim"],
            conv_kernel=text.get("linear_conv_kernel_dim", 4),
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", text.get("rope_theta", 10000.0)),
            partial_rotary_factor=rope.get(
                "partial_rotary_factor", text.get("partial_rotary_factor", 0.25)
            ),
            mrope_section=list(rope.get("mrope_section", [11, 11, 10])),
            tie_word_embeddings=bool(tie),
            intermediate_size=text.get("intermediate_size", 0) if not is_moe else 0,
            is_moe=is_moe,
            num_experts=text.get("num_experts", 0) if is_moe else 0,
            num_experts_per_tok=text.get("num_experts_per_tok", 0) if is_moe else 0,
            moe_intermediate_size=text.get("moe_intermediate_size", 0) if is_moe else 0,
            shared_expert_intermediate_size=(
                text.get("shared_expert_intermediate_size", 0) if is_moe else 0
            ),
        )


class DecoderLayer(nn.Module):
    """Pre-norm residual block: h += mixer(norm(h)); h += mlp(norm(h)), each add fused into the
    norm after it. `config` holds this rank's local sizes; the mixer and MLP outputs are
    partial sums over the ranks."""

    def __init__(
        self, config: Qwen3_5Config, layer_type: str, cache_index: int, shard: Shard
    ) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.shard = shard
        c = config
        if layer_type == "full_attention":
            self.self_attn = Attention(
                c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, cache_index
            )
        else:
            self.linear_attn = GatedDeltaNet(
                c.hidden_size,
                c.linear_num_key_heads,
                c.linear_num_value_heads,
                c.linear_key_head_dim,
                c.linear_value_head_dim,
                c.conv_kernel,
                c.rms_norm_eps,
                cache_index,
            )
        if c.is_moe:
            self.mlp = SparseMoE(
                c.hidden_size,
                c.num_experts,
                c.num_experts_per_tok,
                c.moe_intermediate_size,
                c.shared_expert_intermediate_size,
                shard.experts(c.num_experts),
            )
        else:
            self.mlp = MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor | NormedRows,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext,
        fold: bool = False,
        next_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor | NormedRows, torch.Tensor]:
        """The residual stream is `hidden + residual` (`hidden` alone when residual is None, as
        for the first layer). Returns (mlp output, stream before it): each add is left to the
        norm that reads its sum, which writes the sum in the same pass (one launch less per
        add on the GPU; on the CPU the same add, in the same order, so the same bits).

        With `fold` each norm runs in the epilogue of the product before it instead
        (`kernels/norm_fold.py`): the post-attention norm in the mixer's out projection and,
        given `next_norm` (the next layer's input norm), that one in the MLP's down, which
        then returns (that norm's rows, the stream). `hidden` may then arrive as this layer's
        input norm already applied (`NormedRows`), with `residual` the stream."""
        if isinstance(hidden, NormedRows):
            normed = hidden
        elif residual is None:
            residual = hidden
            normed = self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        after_mixer = after_mlp = None
        if fold:
            after_mixer = _norm_after(residual, self.post_attention_layernorm)
        if self.layer_type == "full_attention":
            mixed = self.self_attn(normed, cos, sin, ctx, after_mixer)
        else:
            mixed = self.linear_attn(normed, ctx, after_mixer)
        if after_mixer is not None:
            normed, residual = mixed
            if next_norm is not None:
                after_mlp = _norm_after(residual, next_norm)
            out = self.mlp(normed, after_mlp)
            return out if after_mlp is not None else (out, residual)
        mixed = self.shard.all_reduce(mixed)
        if isinstance(self.mlp, SparseMoE):
            fused = self.mlp.norm_and_forward(mixed, residual, self.post_attention_layernorm)
            if fused is not None:
                return self.shard.all_reduce(fused[0]), fused[1]
        normed, residual = self.post_attention_layernorm(mixed, residual)
        return self.shard.all_reduce(self.mlp(normed)), residual

    def folds_norms(self) -> bool:
        """Whether folding this layer's norms into its products (`forward`'s `fold`) puts each
        on a kernel that takes it: one rank, a dense MLP, the products on either side of each
        norm kept encoded, stacked (the attention's q|k|v, the GDN in projection, the MLP's
        gate|up) and of a format and width the folding kernel reads (`norm_folds_fit`), the
        GDN b|a weight stacked dense (its kernel computes the product)."""
        if self.shard.world > 1 or not isinstance(self.mlp, MLP):
            return False
        if self.layer_type == "full_attention":
            mixer = self.self_attn
            ends = [mixer.qkv_proj, mixer.o_proj]
        else:
            mixer = self.linear_attn
            ba = mixer.in_proj_ba
            if ba is None or type(ba.linear) is not nn.Linear:
                return False
            ends = [mixer.in_proj_qkvz, mixer.out_proj]
        ends += [self.mlp.gate_up_proj, self.mlp.down_proj]
        weights = []
        for linear in ends:
            if isinstance(linear, FusedLinear):
                linear = linear.linear
            if not isinstance(linear, GroupwiseLinear) or linear.one_row is not None:
                return False
            weights.append(linear.encoded)
        return norm_folds_fit(weights)


def _norm_after(residual: torch.Tensor, norm: RMSNorm) -> NormAfter:
    return NormAfter(residual, norm.weight, norm.eps)


class MultiTokenPredictor(nn.Module):
    """The MTP layer: h' = fc([norm_e(embed(x_{t+1})) ; norm_h(h_t)]), one full-attention
    decoder layer with its own K/V (the last attention layer of the cache), then its own norm.
    `h_t` is the main model's hidden state after its final norm; logits go through the shared
    head (`model.compute_logits`)."""

    def __init__(
        self,
        config: Qwen3_5Config,
        cache_index: int,
        parent: Qwen3_5ForCausalLM,
        shard: Shard,
    ):
        super().__init__()
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, config.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(config, "full_attention", cache_index, shard)])
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self._parent = (parent,)  # a tuple, so the parent is not registered as a submodule

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        parent = self._parent[0]
        embedded = parent.embed_tokens(input_ids)
        joined = torch.cat(
            [self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], dim=-1
        )
        x = self.fc(joined)
        cos, sin = parent.rotary.cos_sin(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, ctx)
        return self.norm(x, residual)[0]


class Qwen3_5ForCausalLM(nn.Module):
    """Dense or MoE Qwen3.5 text model over flat varlen batches (see `ForwardContext`)."""

    is_moe = False

    def __init__(
        self,
        config: Qwen3_5Config,
        *,
        with_mtp: bool,
        device: torch.device | str = "cpu",
        shard: Shard | None = None,
    ) -> None:
        super().__init__()
        self.config = config  # global sizes; `local_config` holds this rank's
        self.shard = shard = shard or Shard()
        self.local_config = local = shard.local_config(config)
        c = config
        if shard.world > 1:
            from ninfer.parallel.embedding import VocabParallelEmbedding

            self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, shard)
        else:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        layers, attention_count, gdn_count = [], 0, 0
        for layer_type in c.layer_types:
            if layer_type == "full_attention":
                layers.append(DecoderLayer(local, layer_type, attention_count, shard))
                attention_count += 1
            else:
                layers.append(DecoderLayer(local, layer_type, gdn_count, shard))
                gdn_count += 1
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if not c.tie_word_embeddings:
            head_rows = len(shard.vocab_rows(c.vocab_size))
            self.lm_head = nn.Linear(c.hidden_size, head_rows, bias=False)
        self.mtp = MultiTokenPredictor(local, attention_count, self, shard) if with_mtp else None
        self.rotary = RotaryEmbedding(
            c.head_dim, c.partial_rotary_factor, c.rope_theta, c.mrope_section, device
        )
        self._num_attention_layers = attention_count + (1 if with_mtp else 0)
        self._num_gdn_layers = gdn_count
        # whether decode-sized steps fold the decoder norms into the products beside them
        # (`DecoderLayer.folds_norms`, decided once the weights are loaded and stacked)
        self.fold_norms = False

    @classmethod
    def from_source(
        cls,
        source: WeightSource,
        config: dict[str, Any],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        shard: Shard | None = None,
    ) -> Qwen3_5ForCausalLM:
        """Build on the meta device, then fill every parameter from `source` by logical name
        (with a `shard`, only this rank's slice of each tensor is kept)."""
        parsed = Qwen3_5Config.from_hf(config, is_moe=cls.is_moe)
        with_mtp = source.has("mtp/fc.weight")
        shape_of = getattr(source, "shape", None)
        if shape_of is not None:
            cls.check_shapes(
                parsed, with_mtp, lambda name: shape_of(name) if source.has(name) else None
            )
        with torch.device("meta"):
            model = cls(parsed, with_mtp=with_mtp, device=device, shard=shard)
        if runs_quantized(torch.device(device), dtype):
            part_of = None
            if model.shard.world > 1:

                def part_of(name: str, encoded):
                    return model.shard.slice_encoded(name, encoded, parsed)

            quantize_linears(model, source, torch.device(device), logical_name, part_of)
            quantize_experts(model, source, torch.device(device), logical_name)
        state = {
            name: model.shard.slice_parameter(
                name, source.tensor(logical_name(name), dtype=dtype), parsed
            ).to(device=device, dtype=dtype)
            for name, _ in model.named_parameters()
        }
        model.load_state_dict(state, assign=True, strict=True)
        del state
        for param in model.parameters():
            param.requires_grad_(False)
        fuse_projections(model)
        request_x_splits(model)
        model.fold_norms = all(layer.folds_norms() for layer in model.layers)
        if torch.device(device).type == "cuda":
            # the unfused weights' blocks stay cached, and the K/V pool is sized from free memory
            torch.cuda.empty_cache()
        return model.eval()

    @classmethod
    def check_shapes(
        cls,
        config: Qwen3_5Config,
        with_mtp: bool,
        stored_shape: Callable[[str], tuple[int, ...] | None],
    ) -> None:
        """A `ModelConfigError` unless every parameter of the model `config` makes has a tensor
        of its shape (`stored_shape` by logical name, None where there is none): what loading
        would otherwise fail on after reading the weights, with a traceback."""
        with torch.device("meta"):
            model = cls(config, with_mtp=with_mtp)
        problems = []
        for name, param in model.named_parameters():
            logical = logical_name(name)
            stored = stored_shape(logical)
            if stored is None:
                problems.append(f"no tensor {logical}")
            elif tuple(stored) != tuple(param.shape):
                problems.append(
                    f"{logical} is {list(stored)}, the config makes it {list(param.shape)}"
                )
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise ModelConfigError(
                f"the model config and the tensors disagree: {'; '.join(problems[:3])}{more}"
            )

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def cache_spec(self) -> CacheSpec:
        """This rank's cache shapes (its KV heads and GDN heads)."""
        c = self.local_config
        key_dim = c.linear_num_key_heads * c.linear_key_head_dim
        return CacheSpec(
            num_attention_layers=self._num_attention_layers,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            num_gdn_layers=self._num_gdn_layers,
            gdn_heads=c.linear_num_value_heads,
            gdn_key_dim=c.linear_key_head_dim,
            gdn_value_dim=c.linear_value_head_dim,
            conv_dim=2 * key_dim + c.linear_num_value_heads * c.linear_value_head_dim,
            conv_kernel=c.conv_kernel,
        )

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """input_ids, positions: [T] (positions may be [3, T] for M-RoPE). Returns the hidden
        states after the final norm, [T, H]."""
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        residual = None
        # decoder norms in their neighbouring products (`DecoderLayer.forward`), but the
        # first layer's input norm (no product before it) and the final norm (its output is
        # also the MTP's input)
        fold = NORM_FOLDS and self.fold_norms and takes_norm_folds(hidden)
        for index, layer in enumerate(self.layers):
            last = index + 1 == len(self.layers)
            next_norm = None if last or not fold else self.layers[index + 1].input_layernorm
            hidden, residual = layer(hidden, residual, cos, sin, ctx, fold, next_norm)
        return self.norm(hidden, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 [N, V]; with tensor parallelism the whole rows exist on rank 0 only (None on
        the other ranks, which still take part in the gather)."""
        if self.config.tie_word_embeddings:
            logits = F.linear(hidden, self.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        return self.shard.gather_logits(logits.float(), self.config.vocab_size)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    is_moe = True


def runs_quantized(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linears and MoE experts stored in a group-wise int format stay encoded (GPU
    kernels in half precision; with tensor parallelism each rank keeps its part encoded where
    the part is whole groups, `Shard.slice_encoded`); elsewhere they are dequantized at load,
    the exact reference path."""
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def fuse_projections(model: nn.Module) -> list[str]:
    """Stack the projections of every layer that read one input into one linear each, where
    their weights allow (both dense in one dtype, or both kept encoded in one format; this
    rank's slices with tensor parallelism), and a MoE block's shared expert with its routed
    experts where all are kept encoded alike (`SparseMoE.stack_shared_expert`). Runs after
    loading: the weights load by their own names. Returns the fused modules' names."""
    fused = []
    for name, module in list(model.named_modules()):
        if isinstance(module, (GatedDeltaNet, Attention, MLP, SparseMoE)):
            fused += [f"{name}.{child}" for child in module.fuse_projections()]
    for name, module in list(model.named_modules()):
        if isinstance(module, SparseMoE) and module.stack_shared_expert():
            fused.append(f"{name}.experts")  # the shared expert stacked with the routed ones
    return fused


def _split_request(consumer: nn.Module | None, max_rows: int = INT_MAX_ROWS) -> SplitRequest | None:
    """The split a linear (or the routed experts' gate_up) that runs the integer GEMV wants
    written beside its input; None for any other consumer."""
    if isinstance(consumer, FusedLinear):
        consumer = consumer.linear
    if isinstance(consumer, GroupwiseLinear):
        return SplitRequest.for_format(consumer.split_format, max_rows)
    if isinstance(consumer, GroupwiseExperts):
        return SplitRequest.for_format(consumer.stored_as["gate_up_proj"][0], max_rows)
    return None


def request_x_splits(model: nn.Module) -> int:
    """Ask every kernel that writes an integer GEMV's input to write x's codes beside it
    (`kernels/x_split.py`): the decoder layers' two norms, the attention output gate, the GDN
    gated norm and the SwiGLU products. Runs after `fuse_projections`, on the final linears.
    Returns how many producers were asked."""
    asked = 0

    def ask(producer: nn.Module, attr: str, request: SplitRequest | None) -> None:
        nonlocal asked
        setattr(producer, attr, request)
        asked += request is not None

    for module in model.modules():
        if isinstance(module, Attention):
            ask(module, "o_split", _split_request(module.o_proj))
        elif isinstance(module, GatedDeltaNet):
            ask(module.norm, "split_request", _split_request(module.out_proj))
        elif isinstance(module, MLP):
            ask(module, "down_split", _split_request(module.down_proj))
        elif isinstance(module, GroupwiseExperts):
            down = SplitRequest.for_format(module.stored_as["down_proj"][0], 1 << 30)
            ask(module, "down_split", down)
        elif isinstance(module, DecoderLayer):
            if module.layer_type == "full_attention":
                attn = module.self_attn
                first = attn.qkv_proj if attn.qkv_proj is not None else attn.q_proj
            else:
                gdn = module.linear_attn
                first = gdn.in_proj_qkvz if gdn.in_proj_qkvz is not None else gdn.in_proj_qkv
            ask(module.input_layernorm, "split_request", _split_request(first))
            if isinstance(module.mlp, SparseMoE):
                experts = _split_request(module.mlp.experts, GATHERED_MAX_TOKENS)
                ask(module.post_attention_layernorm, "split_request", experts)
            else:
                mlp = module.mlp
                gate_up = mlp.gate_up_proj if mlp.gate_up_proj is not None else mlp.gate_proj
                ask(module.post_attention_layernorm, "split_request", _split_request(gate_up))
    return asked


def logical_name(param_name: str) -> str:
    """Module parameter name -> logical tensor name (`<component>/<name>`)."""
    if param_name.startswith("mtp."):
        return "mtp/" + param_name.removeprefix("mtp.")
    return "text/" + param_name
