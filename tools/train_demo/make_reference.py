"""Records what tests/demo checks the shipped demo model against, from the HF checkpoint the
training run wrote (which the repo does not keep: it would double the model's size):

- the sha256 of every checkpoint tensor (bf16 bytes), so a test can prove the artifact holds the
  trained weights bit for bit;
- transformers' fp32 CPU logits (top 5 per position) on two prompts, and our training-side MTP
  layer's logits on the same hidden states;
- golden greedy outputs of ninfer's engine on a few prompts, each checked here against
  transformers' greedy `generate` before it is written.

    python tools/train_demo/make_reference.py CHECKPOINT_DIR [--artifact ninfer/assets/demo.ninfer]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

import chat_data  # noqa: E402
from mtp import MultiTokenPredictor  # noqa: E402

TOP_K = 5
GOLDEN_TOKENS = 40

CODE_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
LOGIT_PROMPTS = {
    "tool_chat": {
        "messages": [
            {"role": "user", "content": "Find the function `urljoin` and tell me what it does."}
        ],
        "tools": chat_data.TOOLS,
        "enable_thinking": False,
    },
    "code": CODE_PROMPT,
}
GOLDEN_PROMPTS = {
    "write_function": {
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
    "tool_call": LOGIT_PROMPTS["tool_chat"],
    "explain_thinking": {
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
    "code": CODE_PROMPT,
}


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bf16 bytes (exact for bf16 values stored in any wider float)."""
    data = tensor.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=False)
    text = chat_data.Renderer().render(
        prompt["messages"], prompt["tools"], True, enable_thinking=prompt["enable_thinking"]
    )
    return tokenizer.encode(text, add_special_tokens=False)


def top_k(logits: torch.Tensor) -> dict:
    values, ids = logits.topk(TOP_K, dim=-1)
    return {"ids": ids.tolist(), "logits": [[round(v, 5) for v in row] for row in values.tolist()]}


@torch.no_grad()
def transformers_reference(model, mtp, ids: list[int]) -> dict:
    tokens = torch.tensor([ids])
    hidden = model.model(input_ids=tokens, use_cache=False).last_hidden_state
    logits = model.lm_head(hidden)[0]
    # MTP row t reads h_t and token t+1, at position t.
    length = len(ids) - 1
    positions = torch.arange(length).view(1, 1, -1).expand(3, 1, -1)
    rope = model.model.rotary_emb(hidden, positions)
    next_embeddings = model.model.embed_tokens(tokens[:, 1:])
    mtp_logits = model.lm_head(mtp(next_embeddings, hidden[:, :length], rope))[0]
    return {"ids": ids, "main": top_k(logits), "mtp": top_k(mtp_logits)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--artifact", type=Path, default=REPO / "ninfer/assets/demo.ninfer")
    parser.add_argument("--out", type=Path, default=REPO / "tests/demo/reference.json")
    args = parser.parse_args()

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ninfer

    state = load_file(args.checkpoint / "model.safetensors")
    tensors = {name: tensor_sha256(t) for name, t in sorted(state.items())}

    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    mtp = MultiTokenPredictor(model.config).eval()
    mtp.load_state_dict(
        {k.removeprefix("mtp."): v.float() for k, v in state.items() if k.startswith("mtp.")}
    )
    logits = {
        name: transformers_reference(model, mtp, prompt_ids(tokenizer, prompt))
        for name, prompt in LOGIT_PROMPTS.items()
    }

    golden = {}
    with ninfer.Engine(str(args.artifact), device="cpu", dtype="float32") as engine:
        for name, prompt in GOLDEN_PROMPTS.items():
            ids = prompt_ids(tokenizer, prompt)
            ours = engine.generate(ids, ninfer.SamplingParams.greedy(max_tokens=GOLDEN_TOKENS))
            theirs = model.generate(
                torch.tensor([ids]),
                max_new_tokens=GOLDEN_TOKENS,
                do_sample=False,
                eos_token_id=model.generation_config.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )[0, len(ids) :].tolist()
            # ninfer withholds the stop token from token_ids only if it says so; compare the
            # common prefix length explicitly and fail loudly on any divergence.
            assert theirs[: len(ours.token_ids)] == ours.token_ids, (name, ours.token_ids, theirs)
            golden[name] = {
                "prompt_ids": ids,
                "token_ids": ours.token_ids,
                "text": tokenizer.decode(ours.token_ids),
                "finish_reason": ours.finish_reason,
            }
            print(f"{name}: {ours.finish_reason} {tokenizer.decode(ours.token_ids)!r}")

    reference = {
        "checkpoint_tensors_sha256_bf16": tensors,
        "transformers_fp32_top5": logits,
        "golden_greedy": golden,
        "golden_max_tokens": GOLDEN_TOKENS,
    }
    args.out.write_text(json.dumps(reference, separators=(",", ":")) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
