"""The MTP layer equals a reference written here from its equations (research/models.md §2.5):
    h' = fc([RMSNorm_e(embed(x_{t+1})) ; RMSNorm_h(h_t)])
    one full-attention decoder layer (own K/V), RMSNorm_mtp, the shared head.
Our MTP runs through pages (prefill in two chunks, then decodes). Checkpoints come from the
shared tiny-checkpoint helper with `mtp.*` tensors, converted by our converter (fp32)."""

import pytest
import torch
import torch.nn.functional as F
from tiny_qwen import Runner, rel_err

from ninfer.artifact.artifact import Artifact
from ninfer.models.registry import load_model


def norm(x, w, eps):
    """(1 + w) RMSNorm."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def rope(x, positions, rot, theta):
    """Half-split RoPE on the first `rot` dims of x [T, heads, d]."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rot, 2).float() / rot)
    angles = positions[:, None].float() * inv_freq
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    first, second = x[..., : rot // 2], x[..., rot // 2 : rot]
    rotated = torch.cat([-second, first], -1)
    return torch.cat([x[..., :rot] * cos[:, None] + rotated * sin[:, None], x[..., rot:]], -1)


def swiglu(x, gate, up, down):
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def mtp_reference(tensor, config, next_ids, hidden):
    eps = config["rms_norm_eps"]
    nh, nkv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    rope_params = config["rope_parameters"]
    rot = int(d * rope_params["partial_rotary_factor"])
    T = hidden.shape[0]
    positions = torch.arange(T)

    def w(name):
        return tensor("mtp/" + name)

    embedded = tensor("text/embed_tokens.weight")[next_ids]
    x = (
        torch.cat(
            [
                norm(embedded, w("pre_fc_norm_embedding.weight"), eps),
                norm(hidden, w("pre_fc_norm_hidden.weight"), eps),
            ],
            -1,
        )
        @ w("fc.weight").T
    )

    # gated attention: per head [query | gate], q/k norm, partial RoPE, GQA, sigmoid gate
    p = "layers.0.self_attn."
    a = norm(x, w("layers.0.input_layernorm.weight"), eps)
    qg = (a @ w(p + "q_proj.weight").T).view(T, nh, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(T, nh * d)
    k = (a @ w(p + "k_proj.weight").T).view(T, nkv, d)
    v = (a @ w(p + "v_proj.weight").T).view(T, nkv, d)
    q = rope(norm(q, w(p + "q_norm.weight"), eps), positions, rot, rope_params["rope_theta"])
    k = rope(norm(k, w(p + "k_norm.weight"), eps), positions, rot, rope_params["rope_theta"])
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, nh * d)
    x = x + (attn * torch.sigmoid(gate)) @ w(p + "o_proj.weight").T

    m = norm(x, w("layers.0.post_attention_layernorm.weight"), eps)
    p = "layers.0.mlp."
    if "num_experts" in config:  # softmax, top-k, renormalise; plus the gated shared expert
        probs = (m @ w(p + "gate.weight").T).softmax(-1)
        top, chosen = probs.topk(config["num_experts_per_tok"], -1)
        top = top / top.sum(-1, keepdim=True)
        gate_up, down = w(p + "experts.gate_up_proj"), w(p + "experts.down_proj")
        inter = down.shape[-1]
        routed = torch.zeros_like(m)
        for t in range(T):
            for weight, e in zip(top[t], chosen[t]):
                g, u = gate_up[e, :inter], gate_up[e, inter:]
                routed[t] += weight * swiglu(m[t : t + 1], g, u, down[e])[0]
        shared = swiglu(
            m,
            w(p + "shared_expert.gate_proj.weight"),
            w(p + "shared_expert.up_proj.weight"),
            w(p + "shared_expert.down_proj.weight"),
        )
        mlp = routed + torch.sigmoid(m @ w(p + "shared_expert_gate.weight").T) * shared
    else:
        mlp = swiglu(
            m, w(p + "gate_proj.weight"), w(p + "up_proj.weight"), w(p + "down_proj.weight")
        )
    x = norm(x + mlp, w("norm.weight"), eps)
    head = (
        "text/lm_head.weight" if not config["tie_word_embeddings"] else "text/embed_tokens.weight"
    )
    return x @ tensor(head).T


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_mtp_layer_matches_its_equations(tiny_artifact, moe):
    _, path = tiny_artifact(weights="fp32", mtp=True, moe=moe)
    artifact = Artifact.open(path)
    config = artifact.config()
    model = load_model(artifact, config, dtype=torch.float32)
    assert model.mtp is not None

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config["vocab_size"], (75,), generator=gen).tolist()
    next_ids = ids[1:] + [7]  # the MTP at position t is fed token t+1
    runner = Runner(model)
    runner.add("a")
    hidden, mtp_logits = [], []
    for begin, end in [(0, 40), (40, 70)] + [(t, t + 1) for t in range(70, 75)]:
        _, mtp = runner.step({"a": ids[begin:end]}, mtp_ids={"a": next_ids[begin:end]})
        mtp_logits.append(mtp["a"])
        hidden.append(runner.hidden["a"])

    def tensor(name):
        return artifact.tensor(name, torch.float32)

    expected = mtp_reference(tensor, config, torch.tensor(next_ids), torch.cat(hidden))
    assert rel_err(torch.cat(mtp_logits), expected) <= 1e-4
