"""Random tiny Qwen3.5 models from transformers (the reference), converted to `.ninfer` by our
converter, and a runner that drives our model through pages and state slots."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import (
    DynamicCache,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)

from ninfer.artifact.artifact import Artifact
from ninfer.artifact.convert import convert
from ninfer.engine.kv_pool import PAGE_SIZE, ModelCache
from ninfer.models.context import make_context
from ninfer.models.layers.linear import FusedLinear, GroupwiseLinear
from ninfer.models.registry import load_model
from ninfer.quant import get_format

VOCAB = 96

# name -> HF config kwargs: layer patterns, GQA ratios, odd head sizes, tied/untied, MoE top-k
TINY_CONFIGS: dict[str, dict] = {
    "dense_3gdn_1attn_gqa2": dict(
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        intermediate_size=48,
        tie_word_embeddings=False,
    ),
    "dense_attn_first_gqa6_odd_dims_tied": dict(
        layer_types=["full_attention", "linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=6,
        num_key_value_heads=1,
        head_dim=20,  # rotary over int(20 * 0.25) = 5 dims -> 3 frequencies
        linear_num_key_heads=1,
        linear_num_value_heads=3,
        linear_key_head_dim=12,
        linear_value_head_dim=10,
        intermediate_size=40,
        tie_word_embeddings=True,
    ),
    "moe_top2_mha_untied": dict(
        moe=True,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=24,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=10,
        linear_value_head_dim=12,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e6,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 2, 2],
        },
    ),
    "moe_top3_gqa3_tied": dict(
        moe=True,
        layer_types=["full_attention", "linear_attention"],
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=5,
        num_experts_per_tok=3,
        moe_intermediate_size=12,
        shared_expert_intermediate_size=20,
        tie_word_embeddings=True,
    ),
}


def make_hf_model(name: str, seed: int = 0, hidden_size: int = 32):
    """A random HF model (fp32, eval). Every parameter is randomised, norms included, so the
    (1 + w) and plain-w conventions are both exercised."""
    kwargs = dict(TINY_CONFIGS[name])
    is_moe = kwargs.pop("moe", False)
    kwargs.update(
        vocab_size=VOCAB, hidden_size=hidden_size, num_hidden_layers=len(kwargs["layer_types"])
    )
    config_class = Qwen3_5MoeTextConfig if is_moe else Qwen3_5TextConfig
    model_class = Qwen3_5MoeForCausalLM if is_moe else Qwen3_5ForCausalLM
    config = config_class(**kwargs)
    # the default grouped_mm experts reject these tiny bf16 shapes on CPU; eager is the same maths
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("linear_attn.norm.weight"):
                param.uniform_(0.8, 1.2)
            elif "norm" in param_name:
                param.normal_(0.0, 0.1)
            elif param_name.endswith(("A_log", "dt_bias")):
                param.normal_(0.0, 0.5)
            elif param.dim() >= 2:
                param.normal_(0.0, 1.0 / param.shape[-1] ** 0.5)
    return model


def hf_in_dtype(hf_model, dtype: torch.dtype):
    """A copy of the HF model in `dtype` as `from_pretrained(dtype=...)` would give it: the
    parameters cast, the rotary inverse frequencies left in fp32 (`.to()` would round them)."""
    converted = copy.deepcopy(hf_model).to(dtype)
    rotary = converted.model.rotary_emb
    rotary.inv_freq = hf_model.model.rotary_emb.inv_freq.clone()
    rotary.original_inv_freq = hf_model.model.rotary_emb.original_inv_freq.clone()
    return converted


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """Reference logits [T, V] (fp32) of one whole sequence."""
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def hf_logits_in_steps(hf_model, token_ids: list[int], steps: list[int]) -> torch.Tensor:
    """Reference logits [T, V] of one sequence fed to transformers in pieces of `steps` tokens
    through its own cache (a 1-token piece takes its decode path), the schedule ours ran."""
    cache = DynamicCache(config=hf_model.config)
    pieces, start = [], 0
    with torch.no_grad():
        for size in steps:
            ids = torch.tensor([token_ids[start : start + size]])
            pieces.append(hf_model(ids, past_key_values=cache, use_cache=True).logits[0].float())
            start += size
    return torch.cat(pieces)


def convert_to_artifact(hf_model, directory: Path, weights: str = "fp32") -> Artifact:
    """Save the HF model as a checkpoint and convert it with our converter."""
    checkpoint = directory / "hf"
    hf_model.save_pretrained(checkpoint)
    recipe = "qwen3_5_moe" if "moe" in hf_model.config.model_type else "qwen3_5"
    out = directory / f"model-{weights}.ninfer"
    convert(checkpoint, recipe, out, weights=weights, on_warning=lambda _: None, progress=False)
    return Artifact.open(out)


def load_ours(artifact: Artifact, dtype: torch.dtype):
    return load_model(artifact, artifact.config(), dtype=dtype)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|."""
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


class Runner:
    """Drives our model through pages and state slots like the engine will: each sequence owns
    one state slot and enough pages for its tokens; a step feeds new tokens of some sequences."""

    def __init__(self, model, num_pages: int = 32, num_slots: int = 4) -> None:
        self.model = model
        self.cache = ModelCache(model.cache_spec(), num_pages, num_slots, dtype=model.dtype)
        self.pages: dict[str, list[int]] = {}
        self.slots: dict[str, int] = {}
        self.lengths: dict[str, int] = {}

    def add(self, seq: str) -> None:
        self.slots[seq] = self.cache.slots.allocate(seq)
        self.pages[seq] = []
        self.lengths[seq] = 0

    def step(self, new_tokens: dict[str, list[int]], mtp_ids: dict[str, list[int]] | None = None):
        """Feeds each sequence's new tokens in one flat batch; returns per-sequence logits, and
        with `mtp_ids` also the MTP logits (fed the main hidden states and those ids). The main
        hidden states of the step are left in `self.hidden`."""
        seqs = list(new_tokens)
        for seq in seqs:
            needed = -(-(self.lengths[seq] + len(new_tokens[seq])) // PAGE_SIZE)
            self.pages[seq] += self.cache.pages.allocate(seq, needed - len(self.pages[seq]))
        ctx = make_context(
            self.cache,
            context_lens=[self.lengths[s] for s in seqs],
            query_lens=[len(new_tokens[s]) for s in seqs],
            page_lists=[self.pages[s] for s in seqs],
            state_slots=[self.slots[s] for s in seqs],
        )
        ids = torch.tensor([t for s in seqs for t in new_tokens[s]])
        positions = torch.tensor(
            [p for s in seqs for p in range(self.lengths[s], self.lengths[s] + len(new_tokens[s]))]
        )
        hidden = self.model(ids, positions, ctx)
        logits = self.model.compute_logits(hidden)
        mtp_logits = None
        if mtp_ids is not None:
            next_ids = torch.tensor([t for s in seqs for t in mtp_ids[s]])
            with torch.no_grad():
                mtp_hidden = self.model.mtp(next_ids, hidden, positions, ctx)
            mtp_logits = self.model.compute_logits(mtp_hidden)
        for seq in seqs:
            self.lengths[seq] += len(new_tokens[seq])
        bounds = ctx.query_start.tolist()
        split = lambda x: {s: x[bounds[i] : bounds[i + 1]] for i, s in enumerate(seqs)}
        self.cache.check_integrity()
        self.hidden = split(hidden)
        return split(logits) if mtp_logits is None else (split(logits), split(mtp_logits))


def keep_linears_in_q4(model: torch.nn.Module, reference: torch.nn.Module | None = None) -> None:
    """The decoder's fused and output linears kept in q4 as on the GPU (`GroupwiseLinear`);
    `reference`, the same model loaded again, gets their dequantized weights, so the two
    compute the same products."""
    q4 = get_format("q4_g64_fp16")
    pairs = zip(model.modules(), (reference or model).modules())
    for module, twin in list(pairs):
        for name, child in list(module.named_children()):
            source = getattr(twin, name)
            if isinstance(child, FusedLinear):
                encoded = q4.encode(source.linear.weight.float())
                child.linear = GroupwiseLinear(encoded)
                target = source.linear
            elif isinstance(child, torch.nn.Linear) and name in ("o_proj", "out_proj", "down_proj"):
                encoded = q4.encode(source.weight.float())
                setattr(module, name, GroupwiseLinear(encoded))
                target = source
            else:
                continue
            if reference is not None:
                target.weight.data = encoded.decode(target.weight.dtype)
