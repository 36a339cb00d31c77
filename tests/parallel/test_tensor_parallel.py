"""Tensor and expert parallelism on CPU with gloo: every split gives the same greedy tokens as
one process on tiny random fp32 models (dense and MoE), and the launch path fails fast and
clearly when a rank dies or the model cannot be split."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers import convert_tiny, greedy_tokens, kill_a_rank_mid_run, ninfer_process
from rank_cases import engine_config, load_with_little_memory, run_cases

from ninfer.engine.engine import load_core
from ninfer.errors import ConfigError
from ninfer.models.qwen3_5 import Qwen3_5Config
from ninfer.parallel.shard import Shard

# tiny models: 4 query / 2 KV heads, GDN 2 key / 4 value heads, MLP 128, 4 experts of 32
PROMPTS = [list(range(3, 43)), [7, 8, 9], [100, 200, 300, 400, 5, 6]]
MAX_TOKENS = 6
CASES = [  # (name, model, ranks, expert parallel)
    ("dense-tp2", "dense", 2, False),
    ("dense-tp4", "dense", 4, False),  # KV heads and GDN key heads replicated in pairs
    ("moe-tp2", "moe", 2, False),
    ("moe-ep2", "moe", 2, True),
    ("moe-ep4", "moe", 4, True),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel-models")
    paths = {}
    # without a tokenizer there is no end-of-sequence id: a run lasts its max_tokens
    for name, options in (("dense", {"tokenizer": False}), ("moe", {"moe": True})):
        (root / name).mkdir()
        paths[name] = convert_tiny(root / name, weights="fp32", **options)[1]
    return paths


@pytest.fixture(scope="module")
def single_process_tokens(models):
    return {
        name: greedy_tokens(load_core(path, engine_config(1, False)), PROMPTS, MAX_TOKENS)
        for name, path in models.items()
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def parallel_tokens(models, tmp_path_factory):
    """Greedy tokens of every case, from one spawned world of four gloo ranks."""
    out_dir = tmp_path_factory.mktemp("parallel-out")
    cases = [
        {
            "name": name,
            "path": str(models[model]),
            "world": world,
            "expert_parallel": ep,
            "prompts": PROMPTS,
            "max_tokens": MAX_TOKENS,
        }
        for name, model, world, ep in CASES
    ]
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    mp.start_processes(
        run_cases, args=(4, init_method, cases, str(out_dir)), nprocs=4, start_method="spawn"
    )
    return {name: json.loads((out_dir / f"{name}.json").read_text()) for name, *_ in CASES}


@pytest.mark.parametrize("name, model, world, expert_parallel", CASES)
def test_split_model_gives_the_single_process_greedy_tokens(
    name, model, world, expert_parallel, single_process_tokens, parallel_tokens
):
    assert parallel_tokens[name] == single_process_tokens[model]


def _tiny_config(**changes) -> Qwen3_5Config:
    fields = dict(
        vocab_size=500,
        hidden_size=64,
        num_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        conv_kernel=4,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        partial_rotary_factor=0.25,
        mrope_section=[11, 11, 10],
        tie_word_embeddings=False,
        intermediate_size=128,
    )
    return Qwen3_5Config(**{**fields, **changes})


def test_kv_heads_are_replicated_when_fewer_than_ranks():
    config = _tiny_config()
    kv_of_rank = [
        Shard(rank, 4).grouped_heads(config.num_heads, config.num_kv_heads, "heads")[1]
        for rank in range(4)
    ]
    assert kv_of_rank == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    local = Shard(3, 4).local_config(config)
    assert (local.num_heads, local.num_kv_heads) == (1, 1)
    assert (local.linear_num_value_heads, local.linear_num_key_heads) == (1, 1)


def test_vocab_rows_are_padded_to_equal_blocks():
    config = _tiny_config()  # 500 rows over 3 ranks: blocks of 167, the last one padded
    head = torch.randn(500, 64)
    parts = [Shard(rank, 3).slice_parameter("lm_head.weight", head, config) for rank in range(3)]
    assert [p.shape[0] for p in parts] == [167, 167, 167]
    assert torch.equal(torch.cat(parts)[:500], head)
    assert not parts[2][166:].any()


def test_gdn_channels_keep_the_local_query_key_and_value_heads():
    config = _tiny_config()
    qkv = torch.arange(2 * 32 + 64, dtype=torch.float32)[:, None].expand(-1, 64)
    part = Shard(1, 2).slice_parameter("layers.0.linear_attn.in_proj_qkv.weight", qkv, config)
    expected = [*range(16, 32), *range(48, 64), *range(64 + 32, 64 + 64)]
    assert part[:, 0].tolist() == expected


def test_a_split_the_heads_do_not_allow_is_refused():
    with pytest.raises(ConfigError, match="num_attention_heads"):
        Shard(0, 3).local_config(_tiny_config())


def _run_args(path: Path, max_tokens: int, *extra: str) -> list[str]:
    prompt = ",".join(str(t) for t in PROMPTS[0])
    return [
        "run",
        str(path),
        "--prompt-ids",
        prompt,
        "--greedy",
        "--max-tokens",
        str(max_tokens),
        "--device",
        "cpu",
        "--max-context",
        "2048",
        *extra,
    ]


def test_cli_run_with_two_ranks_prints_the_single_process_tokens(models, single_process_tokens):
    args = _run_args(models["dense"], MAX_TOKENS, "--print-token-ids", "--tensor-parallel", "2")
    process = ninfer_process(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    printed = [int(t) for t in out.strip().splitlines()[-1].split(",")]
    assert printed == single_process_tokens["dense"][0]


def test_a_killed_rank_ends_the_run_with_a_clear_error(models):
    returncode, err, seconds = kill_a_rank_mid_run(
        _run_args(models["dense"], 2000, "--tensor-parallel", "2")
    )
    assert seconds < 30
    assert returncode != 0
    assert "error: tensor-parallel rank 1" in err and "SIGKILL" in err, err


def test_the_ranks_on_a_host_check_their_caches_together(models, tmp_path):
    """CPU ranks allocate their K/V pools and state slots in one host's memory: with room
    for one rank's and not two, both ranks refuse, naming the two together."""
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    mp.start_processes(
        load_with_little_memory,
        args=(2, init_method, str(models["dense"]), str(tmp_path)),
        nprocs=2,
        start_method="spawn",
    )
    for rank in range(2):
        outcome = (tmp_path / f"{rank}.txt").read_text()
        assert "of each of the 2 ranks on this host" in outcome, outcome
        assert "do not fit in" in outcome and "lower max_context" in outcome


def test_the_step_channel_carries_short_and_long_steps(tmp_path):
    """A decode-sized step fits the first broadcast; a long prefill step (more values than
    FIRST) sends the rest in a second; the worker reads both back exactly, then the stop."""
    from rank_cases import echo_steps

    from ninfer.parallel.channel import FIRST

    decode = [[5, 6], [10, 20], [10, 20], [1, 1], [[0], [1, 2]], [0, 1], [0, 1]], []
    tokens = list(range(FIRST + 100))
    prefill = (
        [
            tokens,
            list(range(len(tokens))),
            [0],
            [len(tokens)],
            [list(range(len(tokens) // 64 + 1))],
            [3],
            [len(tokens) - 1],
        ],
        [3],
    )
    steps = [decode, prefill, decode]
    out = tmp_path / "received.json"
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    mp.start_processes(
        echo_steps, args=(init_method, steps, str(out)), nprocs=2, start_method="spawn"
    )
    assert json.loads(out.read_text()) == [[list(fields), fresh] for fields, fresh in steps]


@pytest.fixture(scope="module")
def quantized_artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel-q4")
    return convert_tiny(root, weights="groupwise-int", hidden=256, tokenizer=False)[1]


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_keeps_its_part_of_an_encoded_weight_encoded(quantized_artifact, world):
    """Every linear stored in a GEMV format: the part `slice_encoded` cuts from the planes
    decodes to exactly the part `slice_parameter` cuts from the decoded weight, for every
    rank; and `quantize_linears` on a rank's model keeps those parts encoded."""
    from ninfer.artifact import Artifact
    from ninfer.models.layers.linear import GEMV_FORMATS, GroupwiseLinear, quantize_linears
    from ninfer.models.qwen3_5 import logical_name
    from ninfer.models.registry import model_class

    artifact = Artifact.open(quantized_artifact)
    hf_config = artifact.config()
    cls = model_class(hf_config)
    parsed = Qwen3_5Config.from_hf(hf_config, is_moe=cls.is_moe)
    checked = set()
    for rank in range(world):
        shard = Shard(rank, world)
        with torch.device("meta"):
            model = cls(parsed, with_mtp=False, device="meta", shard=shard)
        linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        for name in linears:
            try:
                encoded = artifact.encoded(logical_name(f"{name}.weight"))
            except KeyError:
                continue
            if encoded.format not in GEMV_FORMATS:
                continue
            part = shard.slice_encoded(f"{name}.weight", encoded, parsed)
            expected = shard.slice_parameter(f"{name}.weight", encoded.decode(), parsed)
            assert part is not None, name
            assert torch.equal(part.decode(), expected), name
            checked.add(name.split(".")[-1])

        def part_of(name, encoded, shard=shard):
            return shard.slice_encoded(name, encoded, parsed)

        kept = quantize_linears(model, artifact, torch.device("cpu"), logical_name, part_of)
        assert kept and all(isinstance(model.get_submodule(n), GroupwiseLinear) for n in kept)
    # row-split (q, k, v, GDN channels, MLP in) and column-split (o, GDN out, MLP down) alike
    assert {"q_proj", "o_proj", "in_proj_qkv", "out_proj", "up_proj", "down_proj"} <= checked


def test_columns_not_on_whole_groups_are_left_to_the_dense_slice():
    from ninfer.quant import get_format

    config = _tiny_config()  # o_proj's 64 columns over 2 ranks: 32 each, half a q4 group
    encoded = get_format("q4_g64_fp16").encode(torch.randn(64, 64))
    assert Shard(0, 2).slice_encoded("layers.1.self_attn.o_proj.weight", encoded, config) is None
    rows = Shard(1, 2).slice_encoded("layers.1.mlp.up_proj.weight", encoded, config)
    assert rows is not None and torch.equal(rows.decode(), encoded.decode()[32:])


def test_a_vocabulary_block_past_the_end_is_all_padding():
    config = _tiny_config(vocab_size=9)  # 8 ranks, blocks of 2: ranks 5..7 hold no real row
    head = torch.randn(9, 64)
    parts = [Shard(rank, 8).slice_parameter("lm_head.weight", head, config) for rank in range(8)]
    assert [p.shape[0] for p in parts] == [2] * 8
    assert torch.equal(torch.cat(parts)[:9], head) and not torch.cat(parts)[9:].any()
