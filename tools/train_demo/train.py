"""Trains ninfer's demo model end to end on one machine: corpus -> tokenizer -> qwen3_5 text model
with one MTP layer -> HF-style checkpoint, metrics and sample completions.

    python tools/train_demo/train.py --out OUT_DIR            # the GPU run (defaults)
    python tools/train_demo/train.py --out /tmp/x --smoke     # minutes on a CPU, tiny corpus

transformers' Qwen3_5ForCausalLM is the training vehicle (with its torch Gated DeltaNet, see
use_torch_reference_gdn); the MTP layer is ours (mtp.py). docs/demo-model.md has the recipe and
the results."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

import bpe  # noqa: E402
import chat_data  # noqa: E402
import corpus  # noqa: E402

START = time.time()
LOG_FILE = None


def log(message: str) -> None:
    line = f"[{time.time() - START:7.1f}s] {message}"
    print(line, flush=True)
    if LOG_FILE is not None:
        with open(LOG_FILE, "a") as f:
            f.write(line + "\n")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="where results and the checkpoint go")
    p.add_argument("--work", type=Path, default=Path("/tmp/ninfer-demo-work"))
    p.add_argument("--smoke", action="store_true", help="tiny corpus and model shapes, few steps")
    p.add_argument("--root", action="append", default=[], help="LABEL=DIR corpus roots")
    p.add_argument("--max-corpus-mb", type=float, default=400)
    p.add_argument("--tokenizer-sample-mb", type=float, default=40)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--full-attention-interval", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=640)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=100_000, help="upper bound; time usually ends it")
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--chat-fraction", type=float, default=0.15)
    p.add_argument(
        "--deadline-min",
        type=float,
        default=8.9,
        help="wall-clock minutes from start by which everything must be written; training's "
        "cosine schedule runs over whatever time is left before it, less --reserve-s",
    )
    p.add_argument("--reserve-s", type=float, default=100, help="time kept for the final steps")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-windows", type=int, default=128)
    p.add_argument("--sample-tokens", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    args = p.parse_args()
    if args.smoke:
        args.max_corpus_mb = min(args.max_corpus_mb, 6)
        args.tokenizer_sample_mb = min(args.tokenizer_sample_mb, 4)
        args.vocab_size = min(args.vocab_size, 2048)
        args.layers, args.intermediate, args.hidden = 4, 128, 64
        args.full_attention_interval = 2
        args.seq_len, args.batch = 128, 4
        args.steps, args.warmup, args.eval_every = min(args.steps, 6), 2, 3
        args.reserve_s = 0
        args.eval_windows, args.sample_tokens = 4, 12
    return args


# ------------------------------------------------------------------------------------ environment
def gdn_kernels() -> dict[str, str]:
    """Which implementation transformers bound for each Gated DeltaNet / conv function."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    found = {}
    for name in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d_fn"):
        fn = getattr(m, f"torch_{name}", None) or getattr(m, name, None)
        impl = "torch fallback"
        for cell in getattr(fn, "__closure__", None) or ():
            target = cell.cell_contents
            module = getattr(target, "__module__", "") or ""
            if callable(target) and not module.startswith("transformers"):
                impl = f"{module}.{getattr(target, '__name__', '?')}"
        found[name] = impl
    return found


def use_torch_reference_gdn() -> None:
    """fla 0.6 refuses its chunked Gated DeltaNet backward under Triton < 3.7.1 on Hopper (wrong
    gradients there, its issue #640), and the GPU machine's Triton is 3.6. The whole run therefore
    uses transformers' torch reference of the same rule (chunked, with a triangular solve), for
    training and for the final evaluation alike: fla's forward would need a minute of autotuning
    for a few evaluation batches."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    bound = m.torch_chunk_gated_delta_rule
    m.torch_chunk_gated_delta_rule = getattr(bound, "__wrapped__", bound)


def environment() -> dict:
    import tokenizers
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "gdn_kernels": gdn_kernels(),
    }
    try:
        import fla

        env["fla"] = getattr(fla, "__version__", "?")
    except ImportError:
        env["fla"] = None
    return env


# ------------------------------------------------------------------------------------ data
def make_corpus(args) -> tuple[list[corpus.Document], dict]:
    exclude = [args.work, args.out]
    if args.root:
        roots = [(r.split("=", 1)[0], Path(r.split("=", 1)[1])) for r in args.root]
    else:
        # The installed packages only: not this repository, nor wheels carried in for the run.
        roots = corpus.source_roots()
        exclude += [REPO, Path("/tmp/site")]
    files = corpus.list_files(roots, exclude=[e for e in exclude if e.exists()])
    log(f"{len(files)} candidate files, {sum(p.stat().st_size for _, p in files) / 2**20:.0f} MiB")
    docs = corpus.build_corpus(files, int(args.max_corpus_mb * 2**20), workers=args.workers)
    manifest_sha = corpus.write_manifest(docs, args.out / "corpus_manifest.tsv.gz")
    stats = {
        "roots": {label: str(path) for label, path in roots},
        "candidate_files": len(files),
        "files": len(docs),
        "held_out_files": sum(d.held_out for d in docs),
        "bytes": sum(len(d.text.encode()) for d in docs),
        "source_files": sum(d.kind == "source" for d in docs),
        "manifest_sha256": manifest_sha,
    }
    return docs, stats


def make_chat(args, docs: list[corpus.Document]) -> tuple[list[str], list[str]]:
    def jobs(held_out: bool):
        return [
            (d.label, d.sha256, d.text)
            for d in docs
            if d.kind == "source" and d.label.endswith(".py") and d.held_out == held_out
        ]

    with Pool(args.workers) as pool:
        train = [
            s for group in pool.map(chat_data.samples_for_file, jobs(False), 64) for s in group
        ]
        held = [s for group in pool.map(chat_data.samples_for_file, jobs(True), 16) for s in group]
    return train, held


def make_tokenizer(args, docs: list[corpus.Document], chat: list[str]):
    budget = args.tokenizer_sample_mb * 2**20
    total = sum(len(d.text) for d in docs if not d.held_out)
    fraction = min(1.0, budget / max(total, 1))

    def picked(digest: str) -> bool:
        return (
            corpus.hash_fraction(hashlib.sha256(b"tokenizer" + digest.encode()).hexdigest())
            < fraction
        )

    texts = [d.text for d in docs if not d.held_out and picked(d.sha256)]
    texts += chat[: max(1, int(len(chat) * fraction))]
    return bpe.train_tokenizer(texts, args.vocab_size), sum(map(len, texts))


def encode_stream(tokenizer, texts: list[str], eot: int, chunk: int = 4096) -> np.ndarray:
    """All texts' ids, each followed by <|endoftext|>, as one int32 array."""
    parts = []
    for i in range(0, len(texts), chunk):
        for enc in tokenizer.encode_batch_fast(texts[i : i + chunk], add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=np.int32))
            parts.append(np.asarray([eot], dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


# ------------------------------------------------------------------------------------ model
def model_config(args, tokenizer):
    from transformers import Qwen3_5TextConfig

    layer_types = [
        "full_attention" if (i + 1) % args.full_attention_interval == 0 else "linear_attention"
        for i in range(args.layers)
    ]
    return Qwen3_5TextConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=256,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layer_types=layer_types,
        max_position_embeddings=8192,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.token_to_id("<|im_end|>"),
        pad_token_id=None,
        initializer_range=0.02,
    )


def build_model(config, device):
    from mtp import MultiTokenPredictor
    from transformers import Qwen3_5ForCausalLM

    config._attn_implementation = "sdpa"
    model = Qwen3_5ForCausalLM(config).to(device)
    mtp = MultiTokenPredictor(config).to(device)
    assert model.lm_head.weight is model.model.embed_tokens.weight, "embeddings must be tied"
    return model, mtp


def forward_losses(model, mtp, tokens: torch.Tensor, with_predictions: bool = False):
    """tokens [B, T+2]. Main loss on x_{1..T}, MTP loss on x_{2..T+1}."""
    batch, width = tokens.shape
    length = width - 2
    inputs = tokens[:, :length]
    hidden = model.model(input_ids=inputs, use_cache=False).last_hidden_state
    logits = model.lm_head(hidden).float()
    main = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        tokens[:, 1 : length + 1].reshape(-1),
        reduction="none",
    ).view(batch, length)
    positions = torch.arange(length, device=tokens.device).view(1, 1, -1).expand(3, batch, -1)
    rope = model.model.rotary_emb(hidden, positions)
    next_embeddings = model.model.embed_tokens(tokens[:, 1 : length + 1])
    mtp_logits = model.lm_head(mtp(next_embeddings, hidden, rope)).float()
    draft = F.cross_entropy(
        mtp_logits.reshape(-1, mtp_logits.shape[-1]),
        tokens[:, 2 : length + 2].reshape(-1),
        reduction="none",
    ).view(batch, length)
    if not with_predictions:
        return main.mean(), draft.mean()
    return main, draft, logits.argmax(-1), mtp_logits.argmax(-1)


def windows(stream: torch.Tensor, starts: torch.Tensor, width: int) -> torch.Tensor:
    return stream[starts[:, None] + torch.arange(width, device=stream.device)[None, :]].long()


@torch.no_grad()
def evaluate(model, mtp, stream: torch.Tensor, args, byte_lengths: torch.Tensor, count: int):
    """Fixed, non-overlapping windows from the start of a held-out stream."""
    width = args.seq_len + 2
    count = min(count, max(0, len(stream) - 1) // width)
    if count == 0:
        return None
    model.eval()
    mtp.eval()
    sums = dict(nats=0.0, mtp_nats=0.0, tokens=0, bytes=0, top1=0, mtp_top1=0, agree=0, pairs=0)
    for first in range(0, count, args.batch):
        starts = torch.arange(first, min(count, first + args.batch), device=stream.device) * width
        tokens = windows(stream, starts, width)
        with torch.autocast(tokens.device.type, torch.bfloat16, enabled=tokens.is_cuda):
            main, draft, main_pred, mtp_pred = forward_losses(model, mtp, tokens, True)
        targets, next_targets = tokens[:, 1:-1], tokens[:, 2:]
        sums["nats"] += main.sum().item()
        sums["mtp_nats"] += draft.sum().item()
        sums["tokens"] += main.numel()
        sums["bytes"] += byte_lengths[targets].sum().item()
        sums["top1"] += (main_pred == targets).sum().item()
        sums["mtp_top1"] += (mtp_pred == next_targets).sum().item()
        # Greedy acceptance: the draft for t+2 equals what the main model then predicts there.
        sums["agree"] += (mtp_pred[:, :-1] == main_pred[:, 1:]).sum().item()
        sums["pairs"] += mtp_pred[:, :-1].numel()
    model.train()
    mtp.train()
    n = sums["tokens"]
    return {
        "loss": sums["nats"] / n,
        "perplexity": math.exp(sums["nats"] / n),
        "bits_per_byte": sums["nats"] / math.log(2) / max(sums["bytes"], 1),
        "top1": sums["top1"] / n,
        "mtp_loss": sums["mtp_nats"] / n,
        "mtp_top1": sums["mtp_top1"] / n,
        "mtp_agreement": sums["agree"] / sums["pairs"],
        "tokens": n,
    }


def learning_rate(step: int, progress: float, args) -> float:
    """Linear warmup over steps, then cosine to `min_lr_ratio` over `progress` in [0, 1]."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    floor = args.min_lr_ratio
    return args.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(args, model, mtp, streams, byte_lengths, device) -> dict:
    params = list(model.parameters()) + list(mtp.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=fused,
    )
    generator = torch.Generator(device=device).manual_seed(args.seed)
    width = args.seq_len + 2
    chat_rows = round(args.batch * args.chat_fraction) if len(streams["chat"]) > width else 0
    text_rows = args.batch - chat_rows
    history = []
    started = time.time()
    # The schedule's progress is the larger of steps done and time used, so a run always ends
    # decayed and on time whatever the machine's throughput.
    budget = max(1.0, START + args.deadline_min * 60 - args.reserve_s - started)
    log(f"training for at most {args.steps} steps or {budget:.0f} s")
    tokens_seen = 0
    step = 0
    for step in range(args.steps):
        progress = max(step / args.steps, (time.time() - started) / budget)
        if progress >= 1.0:
            break
        lr = learning_rate(step, progress, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(
            0, len(streams["text"]) - width, (text_rows,), device=device, generator=generator
        )
        rows = [windows(streams["text"], starts, width)]
        if chat_rows:
            starts = torch.randint(
                0, len(streams["chat"]) - width, (chat_rows,), device=device, generator=generator
            )
            rows.append(windows(streams["chat"], starts, width))
        tokens = torch.cat(rows)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            main, draft = forward_losses(model, mtp, tokens)
            loss = main + args.mtp_weight * draft
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        tokens_seen += args.batch * args.seq_len
        last = step == args.steps - 1 or (time.time() - started) / budget >= 1.0
        if step % 25 == 0 or last:
            elapsed = time.time() - started
            log(
                f"step {step:5d} lr {lr:.2e} loss {main.item():.4f} mtp {draft.item():.4f} "
                f"gnorm {grad_norm.item():.2f} tok/s {tokens_seen / elapsed:,.0f}"
            )
        if (step and step % args.eval_every == 0) or last:
            val = evaluate(model, mtp, streams["held_text"], args, byte_lengths, 16)
            entry = {
                "step": step,
                "tokens": tokens_seen,
                "train_loss": main.item(),
                "train_mtp_loss": draft.item(),
                "seconds": round(time.time() - started, 1),
            }
            if val:
                entry.update(val_loss=val["loss"], val_mtp_loss=val["mtp_loss"])
                log(f"  eval step {step}: val loss {val['loss']:.4f} mtp {val['mtp_loss']:.4f}")
            history.append(entry)
        if last:
            break
    seconds = time.time() - started
    return {
        "steps": step + 1,
        "planned_steps": args.steps,
        "tokens": tokens_seen,
        "seconds": round(seconds, 1),
        "tokens_per_second": round(tokens_seen / seconds),
        "history": history,
    }


# ------------------------------------------------------------------------------------ checkpoint
# PreTrainedConfig bookkeeping that says nothing about this model.
GENERIC_CONFIG_KEYS = (
    "_name_or_path",
    "_attn_implementation_autoset",
    "id2label",
    "label2id",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "output_attentions",
    "output_hidden_states",
    "problem_type",
    "return_dict",
)


def save_checkpoint(directory: Path, model, mtp, config, tokenizer, args) -> None:
    from safetensors.torch import save_file
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        state[name] = tensor.detach().to(torch.bfloat16).contiguous().cpu()
    for name, tensor in mtp.state_dict().items():
        state[f"mtp.{name}"] = tensor.detach().to(torch.bfloat16).contiguous().cpu()
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})

    config_dict = config.to_dict()
    config_dict["architectures"] = ["Qwen3_5ForCausalLM"]
    config_dict["dtype"] = "bfloat16"
    config_dict["mtp_num_hidden_layers"] = 1
    config_dict["mtp_use_dedicated_embeddings"] = False
    for generic in GENERIC_CONFIG_KEYS:
        config_dict.pop(generic, None)
    (directory / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")

    im_end, eot = tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")
    generation = {
        "eos_token_id": [im_end, eot],
        "pad_token_id": eot,
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
    }
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=config.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    wrapped.save_pretrained(directory)
    # The template lives in its own file (transformers reads chat_template.jinja).
    shutil.copyfile(chat_data.TEMPLATE_PATH, directory / "chat_template.jinja")
    tok_config_path = directory / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config.pop("chat_template", None)
    tok_config_path.write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")


def load_checkpoint(directory: Path, device):
    """The saved checkpoint as the shipped weights (bf16 values) in fp32, MTP included."""
    from mtp import MultiTokenPredictor
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="sdpa"
    ).to(device)
    mtp = MultiTokenPredictor(model.config).to(device)
    state = load_file(directory / "model.safetensors")
    mtp_state = {
        k.removeprefix("mtp."): v.float() for k, v in state.items() if k.startswith("mtp.")
    }
    mtp.load_state_dict(mtp_state)
    for name, tensor in model.state_dict().items():
        saved = state.get(
            name, state.get("model.embed_tokens.weight") if name == "lm_head.weight" else None
        )
        assert saved is not None and torch.equal(tensor.cpu(), saved.float()), name
    return model.eval(), mtp.eval()


SAMPLE_PROMPTS = [
    {
        "title": "docstring to function (thinking off)",
        "messages": [
            {
                "role": "user",
                "content": "Write a Python function `is_palindrome(text)`.\n\n"
                "Return True when text reads the same forwards and backwards.",
            }
        ],
        "tools": None,
        "enable_thinking": False,
    },
    {
        "title": "tool call (thinking off)",
        "messages": [
            {"role": "user", "content": "Find the function `urljoin` and tell me what it does."}
        ],
        "tools": chat_data.TOOLS,
        "enable_thinking": False,
    },
    {
        "title": "explain code (thinking on)",
        "messages": [
            {
                "role": "user",
                "content": "What does this function do?\n\n```python\ndef clamp(value, low, high):\n"
                "    if value < low:\n        return low\n    if value > high:\n"
                "        return high\n    return value\n```",
            }
        ],
        "tools": None,
        "enable_thinking": True,
    },
]


@torch.no_grad()
def sample_completions(model, tokenizer, max_new_tokens: int, device) -> list[dict]:
    renderer = chat_data.Renderer()
    stop = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    out = []
    for prompt in SAMPLE_PROMPTS:
        text = renderer.render(
            prompt["messages"], prompt["tools"], True, enable_thinking=prompt["enable_thinking"]
        )
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False).ids], device=device)
        generated = model.generate(
            ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=stop,
            pad_token_id=stop[1],
        )
        new = generated[0, ids.shape[1] :].tolist()
        out.append(
            {
                "title": prompt["title"],
                "prompt": text,
                "completion": tokenizer.decode(new, skip_special_tokens=False),
                "completion_ids": new,
            }
        )
    return out


# ------------------------------------------------------------------------------------ main
def main() -> None:
    global LOG_FILE
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    LOG_FILE = args.out / "train.log"
    LOG_FILE.write_text("")
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    metrics: dict = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "environment": environment(),
    }
    log(f"environment {json.dumps(metrics['environment'])}")

    docs, metrics["corpus"] = make_corpus(args)
    log(f"corpus {json.dumps(metrics['corpus'])}")
    chat_train, chat_held = make_chat(args, docs)
    log(f"chat samples: {len(chat_train)} train, {len(chat_held)} held out")

    tokenizer, sample_chars = make_tokenizer(args, docs, chat_train)
    log(f"tokenizer: {tokenizer.get_vocab_size()} ids, trained on {sample_chars / 2**20:.1f} MiB")
    assert tokenizer.get_vocab_size() == args.vocab_size, tokenizer.get_vocab_size()
    eot = tokenizer.token_to_id("<|endoftext|>")

    arrays = {
        "text": encode_stream(tokenizer, [d.text for d in docs if not d.held_out], eot),
        "chat": encode_stream(tokenizer, chat_train, eot),
        "held_text": encode_stream(tokenizer, [d.text for d in docs if d.held_out], eot),
        "held_chat": encode_stream(tokenizer, chat_held, eot),
    }
    train_bytes = sum(len(d.text.encode()) for d in docs if not d.held_out)
    metrics["tokens"] = {k: int(len(v)) for k, v in arrays.items()}
    metrics["tokens"]["train_bytes_per_token"] = round(train_bytes / max(1, len(arrays["text"])), 3)
    log(f"tokens {json.dumps(metrics['tokens'])}")
    streams = {k: torch.from_numpy(v).to(device) for k, v in arrays.items()}
    byte_lengths = torch.tensor(bpe.token_byte_lengths(tokenizer, args.vocab_size), device=device)

    config = model_config(args, tokenizer)
    model, mtp = build_model(config, device)
    main_params = sum(p.numel() for p in model.parameters())
    mtp_params = sum(p.numel() for p in mtp.parameters())
    metrics["parameters"] = {
        "main": main_params,
        "mtp": mtp_params,
        "total": main_params + mtp_params,
    }
    log(f"parameters {json.dumps(metrics['parameters'])}")

    use_torch_reference_gdn()
    metrics["environment"]["gdn_used"] = gdn_kernels()["chunk_gated_delta_rule"]
    metrics["training"] = train(args, model, mtp, streams, byte_lengths, device)

    # The checkpoint goes out first, so a failure in what follows loses no training.
    checkpoint = args.work / "checkpoint"
    if checkpoint.exists():
        shutil.rmtree(checkpoint)
    save_checkpoint(checkpoint, model, mtp, config, tokenizer, args)
    archive = args.work / "checkpoint.tar"
    subprocess.run(["tar", "-cf", str(archive), "-C", str(args.work), "checkpoint"], check=True)
    subprocess.run(
        ["split", "-b", "15M", "-d", str(archive), str(args.out / "checkpoint.tar.part")],
        check=True,
    )
    metrics_path = args.out / "metrics.json"
    metrics_path.write_text(json.dumps(metrics, indent=2) + "\n")
    log(f"checkpoint {archive.stat().st_size / 2**20:.1f} MiB written to {args.out}")

    del model, mtp
    try:
        model, mtp = load_checkpoint(checkpoint, device)
        log("checkpoint reloaded")
        final = {}
        for name in ("held_text", "held_chat"):
            final[name] = evaluate(model, mtp, streams[name], args, byte_lengths, args.eval_windows)
            log(f"final {name}: {json.dumps(final[name])}")
        metrics["final_eval_bf16_weights"] = final
        metrics_path.write_text(json.dumps(metrics, indent=2) + "\n")
        metrics["samples"] = sample_completions(model, tokenizer, args.sample_tokens, device)
        for sample in metrics["samples"]:
            log(f"sample [{sample['title']}]:\n{sample['completion']}")
    except Exception as exc:  # keep what was measured so far
        metrics["final_error"] = repr(exc)
        log(f"final evaluation failed: {exc!r}")
    metrics_path.write_text(json.dumps(metrics, indent=2) + "\n")
    log("done")


if __name__ == "__main__":
    main()
