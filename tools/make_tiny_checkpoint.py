"""Write a small random Qwen3.5 checkpoint directory the way Hugging Face ships them: weights
from transformers' `save_pretrained`, optionally `mtp.*` tensors in the released naming, the
released multimodal key layout (`model.language_model.*` plus a stand-in `model.visual.*`
tensor), and a byte-level tokenizer with the Qwen special tokens and a chat template.

    python tools/make_tiny_checkpoint.py OUT_DIR [--moe] [--mtp] [--tie] [--multimodal] ...

Tests import `make_tiny_checkpoint` from here (see tests/helpers.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def _byte_symbols() -> list[str]:
    """The printable stand-in character of each byte used by byte-level BPE vocabularies."""
    printable = (
        set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    )
    symbols, extra = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


def write_tokenizer(out_dir: Path) -> dict[str, int]:
    """A byte-level tokenizer (ids 0-255 are bytes, then the special tokens); returns special ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {symbol: i for i, symbol in enumerate(_byte_symbols())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    tokenizer.save(str(out_dir / "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "model_max_length": 32768,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return ids


def _text_config(
    moe: bool, layers: int, hidden: int, vocab: int, experts: int, tie: bool, interval: int
):
    import transformers

    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=hidden // 4,
        linear_value_head_dim=hidden // 4,
        linear_conv_kernel_dim=4,
        full_attention_interval=interval,
        max_position_embeddings=4096,
        tie_word_embeddings=tie,
    )
    if moe:
        return transformers.Qwen3_5MoeTextConfig(
            moe_intermediate_size=hidden // 2,
            shared_expert_intermediate_size=hidden // 2,
            num_experts=experts,
            num_experts_per_tok=min(2, experts),
            **common,
        )
    return transformers.Qwen3_5TextConfig(intermediate_size=2 * hidden, **common)


def _model_class(moe: bool):
    import transformers

    return transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM


def _perturb(model, seed: int) -> None:
    """Give 1-D parameters (norms, A_log, dt_bias) random values too, so a test that reads them
    back or compares outputs cannot pass by accident on all-zero or all-one vectors."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn(param.shape, generator=generator))


def _mtp_tensors(text_config, moe: bool, seed: int) -> dict:
    """`mtp.*` tensors in the released naming: the fc stem, three norms and one full-attention
    decoder layer (per-expert keys for MoE), drawn from a fresh one-layer model."""
    import torch

    config = text_config.__class__(
        **{**text_config.to_dict(), "num_hidden_layers": 1, "layer_types": ["full_attention"]}
    )
    torch.manual_seed(seed + 2)
    donor = _model_class(moe)(config)
    _perturb(donor, seed + 2)
    hidden = text_config.hidden_size
    out = {
        "mtp.fc.weight": torch.randn(hidden, 2 * hidden) * 0.02,
        "mtp.pre_fc_norm_embedding.weight": torch.randn(hidden) * 0.1,
        "mtp.pre_fc_norm_hidden.weight": torch.randn(hidden) * 0.1,
        "mtp.norm.weight": torch.randn(hidden) * 0.1,
    }
    for name, value in donor.model.layers[0].state_dict().items():
        if name == "mlp.experts.gate_up_proj":
            inter = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = value[e, :inter].clone()
                out[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = value[e, inter:].clone()
        elif name == "mlp.experts.down_proj":
            for e in range(value.shape[0]):
                out[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = value[e].clone()
        else:
            out[f"mtp.layers.0.{name}"] = value.clone()
    return out


def make_tiny_checkpoint(
    out_dir: str | Path,
    *,
    moe: bool = False,
    mtp: bool = False,
    tie: bool = False,
    multimodal: bool = False,
    layers: int = 4,
    hidden: int = 64,
    vocab: int = 512,
    experts: int = 4,
    full_attention_interval: int = 2,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    tokenizer: bool = True,
) -> Path:
    """Write the checkpoint into `out_dir` (created; must be empty) and return its path."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    transformers.utils.logging.disable_progress_bar()
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise SystemExit(f"{out_dir}: not empty; choose a new directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    text_config = _text_config(moe, layers, hidden, vocab, experts, tie, full_attention_interval)
    model = _model_class(moe)(text_config)
    _perturb(model, seed)
    model = model.to(getattr(torch, dtype))
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **save_kwargs)

    index_path = out_dir / "model.safetensors.index.json"
    if index_path.exists():
        weight_map = json.loads(index_path.read_text())["weight_map"]
    else:
        weight_map = {key: "model.safetensors" for key in load_file(out_dir / "model.safetensors")}
    extra = {}
    if mtp:
        extra.update(
            {
                k: v.to(getattr(torch, dtype))
                for k, v in _mtp_tensors(text_config, moe, seed).items()
            }
        )
    if multimodal:
        for shard in sorted(set(weight_map.values())):
            tensors = load_file(out_dir / shard)
            renamed = {
                ("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v
                for k, v in tensors.items()
            }
            save_file(renamed, out_dir / shard, metadata={"format": "pt"})
        weight_map = {
            ("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): f
            for k, f in weight_map.items()
        }
        extra["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 4, 4).to(
            getattr(torch, dtype)
        )
        config = json.loads((out_dir / "config.json").read_text())
        text_dict = {
            k: v for k, v in config.items() if k not in ("architectures", "transformers_version")
        }
        wrapper = {
            "architectures": [
                "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
            ],
            "model_type": "qwen3_5_moe" if moe else "qwen3_5",
            "text_config": text_dict,
            "vision_config": {"depth": 1, "hidden_size": 8, "out_hidden_size": hidden},
            "tie_word_embeddings": tie,
            "transformers_version": config.get("transformers_version"),
        }
        (out_dir / "config.json").write_text(json.dumps(wrapper, indent=2) + "\n")
    if mtp:
        config = json.loads((out_dir / "config.json").read_text())
        target = config.get("text_config", config)
        target["mtp_num_hidden_layers"] = 1
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if extra:
        save_file(extra, out_dir / "model-extra.safetensors", metadata={"format": "pt"})
        weight_map.update({k: "model-extra.safetensors" for k in extra})
    if extra or multimodal or index_path.exists():
        total = sum(
            t.numel() * t.element_size()
            for shard in sorted(set(weight_map.values()))
            for t in load_file(out_dir / shard).values()
        )
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        index_path.write_text(json.dumps(index, indent=2) + "\n")

    if tokenizer:
        if vocab < 256 + len(SPECIAL_TOKENS):
            raise SystemExit(
                f"--vocab {vocab} is too small for the byte-level tokenizer (needs {256 + len(SPECIAL_TOKENS)})"
            )
        ids = write_tokenizer(out_dir)
        generation = {
            "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
            "pad_token_id": ids["<|endoftext|>"],
            "do_sample": True,
            "temperature": 0.6,
            "top_p": 0.95,
            "top_k": 20,
        }
        (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", metavar="OUT_DIR")
    parser.add_argument("--moe", action="store_true", help="qwen3_5_moe instead of dense qwen3_5")
    parser.add_argument("--mtp", action="store_true", help="add mtp.* tensors (released naming)")
    parser.add_argument("--tie", action="store_true", help="tie the LM head to the embeddings")
    parser.add_argument(
        "--multimodal",
        action="store_true",
        help="released layout: model.language_model.* + model.visual.*",
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--full-attention-interval", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--max-shard-size", default=None, help="shard the weights, e.g. 200KB")
    parser.add_argument("--no-tokenizer", action="store_true", help="write weights and config only")
    args = parser.parse_args(argv)
    path = make_tiny_checkpoint(
        args.out_dir,
        moe=args.moe,
        mtp=args.mtp,
        tie=args.tie,
        multimodal=args.multimodal,
        layers=args.layers,
        hidden=args.hidden,
        vocab=args.vocab,
        experts=args.experts,
        full_attention_interval=args.full_attention_interval,
        seed=args.seed,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        tokenizer=not args.no_tokenizer,
    )
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
