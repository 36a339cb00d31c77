"""`--config FILE.toml` for `convert`, `inspect` and `bench`, and one file shared by several
commands: each takes the keys it knows and skips those only other commands know."""

from __future__ import annotations

from pathlib import Path

import pytest

from ninfer.cli.bench import BenchSettings
from ninfer.cli.config import settings_from
from ninfer.cli.convert import ConvertSettings
from ninfer.cli.inspect import InspectSettings
from ninfer.cli.main import build_parser, main
from ninfer.cli.run import RunSettings
from ninfer.errors import ConfigError
from ninfer.serve.settings import ServeSettings

DEMO = Path(__file__).resolve().parents[2] / "ninfer" / "assets" / "demo.ninfer"
SETTINGS = {
    "bench": BenchSettings,
    "convert": ConvertSettings,
    "inspect": InspectSettings,
    "run": RunSettings,
    "serve": ServeSettings,
}


def settings(command: str, config: Path | None, *argv: str):
    line = [command, *argv] + (["--config", str(config)] if config else [])
    if command == "run":
        line += ["--prompt", "hi"]
    return settings_from(SETTINGS[command], build_parser().parse_args(line), command)


def toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ninfer.toml"
    path.write_text(text)
    return path


def test_convert_takes_its_required_values_from_the_file_and_flags_win(tmp_path):
    config = toml(
        tmp_path,
        '[convert]\nmodel = "hf"\nrecipe = "qwen3_5"\nout = "a.ninfer"\n'
        'weights = "fp32"\nmax-file-bytes = "1e6"\nresource = ["chat_template=t.jinja"]\n',
    )
    s = settings("convert", config)
    assert (s.model, s.recipe, s.out, s.weights) == ("hf", "qwen3_5", "a.ninfer", "fp32")
    assert s.max_file_bytes == 1_000_000 and s.resource == ["chat_template=t.jinja"]
    s = settings("convert", config, "--weights", "groupwise-int", "--out", "b.ninfer")
    assert (s.weights, s.out, s.recipe) == ("groupwise-int", "b.ninfer", "qwen3_5")


def test_convert_defaults_are_unchanged_and_required_flags_are_still_required(capsys):
    s = settings("convert", None)
    assert (s.weights, s.components, s.name, s.resource) == ("bf16", None, None, [])
    assert s.max_file_bytes == 32_000_000_000
    assert main(["convert", "--recipe", "qwen3_5"]) == 1
    assert "required: --model, --out" in capsys.readouterr().err


def test_inspect_reads_its_file_and_switches_from_the_config(tmp_path, capsys):
    config = toml(tmp_path, f'[inspect]\nfile = "{DEMO}"\nbindings = true\n')
    s = settings("inspect", config, "--verify")
    assert (s.file, s.bindings, s.verify, s.objects) == (str(DEMO), True, True, False)
    assert settings("inspect", config, "other.ninfer").file == "other.ninfer"
    assert main(["inspect", "--config", str(config)]) == 0
    assert " -> " in capsys.readouterr().out


def test_inspect_without_a_file_is_an_error(capsys):
    assert main(["inspect"]) == 1
    assert "required: FILE" in capsys.readouterr().err


def test_bench_takes_lists_and_counts_from_the_file_and_flags_win(tmp_path):
    config = toml(
        tmp_path,
        '[bench]\nshape = "tiny"\nprompts = [512, 64]\nprompt_gens = [[6, 3]]\n'
        'concurrency = [1, 2]\nrepetitions = 2\noutput = "json"\n',
    )
    s = settings("bench", config)
    assert (s.shape, s.prompts, s.prompt_gens, s.concurrency) == (
        "tiny",
        [512, 64],
        [(6, 3)],
        [1, 2],
    )
    assert (s.repetitions, s.output, s.weights, s.warmup) == (2, "json", "q4", 1)
    s = settings("bench", config, "-p", "8", "-p", "16,32", "-r", "1", "--concurrency", "4")
    assert (s.prompts, s.repetitions, s.concurrency) == ([8, 16, 32], 1, [4])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[bench]\noutput = "xml"\n', "output = 'xml': choose from table, json"),
        ("[bench]\nconcurrency = [0]\n", "give positive integers"),
        ("[bench]\nprompt_gens = [[1, 2, 3]]\n", "-pg takes PROMPT,GEN"),
        ('[convert]\nweights = "q4"\n', "weights = 'q4': choose from bf16"),
        ("[convert]\nmax-file-bytes = 0\n", "max-file-bytes: not a positive whole byte count"),
        ("[convert]\nmax-file-bytes = 1e999\n", "byte count"),
        # the flags' types: a wrong one is named, not taken for another value or a crash
        ("[run]\nmax_tokens = 2.5\n", "max_tokens = 2.5: must be an integer"),
        ('[run]\ngreedy = "false"\n', "greedy = 'false': must be true or false"),
        ('[run]\ntemperature = "hot"\n', "temperature = 'hot': must be a number"),
        ("[run]\nmax_tokens = true\n", "max_tokens = True: must be an integer"),
        ("[run]\nstop = [1]\n", "stop = \\[1\\]: must be a string or a list of strings"),
        ('[run]\nstop_token_id = "5,x"\n', "not a comma-separated list of integers"),
        ('[bench]\nrepetitions = "1"\n', "repetitions = '1': must be an integer"),
        ("[inspect]\nfile = [5]\n", "file = \\[5\\]: must be a string"),
    ],
)
def test_file_values_are_checked_like_the_flags(tmp_path, text, message):
    command = text[1 : text.index("]")]
    with pytest.raises(ConfigError, match=message):
        settings(command, toml(tmp_path, text))


def test_a_lone_value_of_a_list_setting_is_a_list_of_one(tmp_path):
    """`stop = "```python"` is one stop string, not one per character."""
    config = toml(tmp_path, '[run]\nstop = "```python"\nstop_token_id = 7\ntemperature = 1\n')
    s = settings("run", config)
    assert (s.stop, s.stop_token_id, s.temperature) == (["```python"], [7], 1.0)
    assert settings("bench", toml(tmp_path, '[bench]\npeer = "hf"\n')).peer == ["hf"]


def test_one_file_serves_every_command_each_skipping_the_others_keys(tmp_path):
    config = toml(
        tmp_path,
        'device = "cpu"\nport = 9000\nmax-context = 1024\nrepetitions = 5\nobjects = true\n'
        'recipe = "qwen3_5"\n[run]\nmax_tokens = 16\n',
    )
    run = settings("run", config)
    assert (run.device, run.max_context, run.max_tokens) == ("cpu", 1024, 16)
    serve = settings("serve", config)
    assert (serve.device, serve.port, serve.max_context) == ("cpu", 9000, 1024)
    bench = settings("bench", config)
    assert (bench.device, bench.repetitions) == ("cpu", 5)
    assert settings("inspect", config).objects is True
    assert settings("convert", config).recipe == "qwen3_5"


@pytest.mark.parametrize("command", sorted(SETTINGS))
def test_a_top_level_key_no_command_knows_is_an_error_naming_the_known_keys(tmp_path, command):
    config = toml(tmp_path, "prot = 1\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) in .*: prot \(known: [a-z]"):
        settings(command, config)


def test_a_key_in_a_commands_table_must_be_that_commands(tmp_path):
    config = toml(tmp_path, "[run]\nport = 9000\n")
    with pytest.raises(ConfigError, match=r"in \[run\] of .*: port \(known: "):
        settings("run", config)
    assert settings("serve", config).port == 8080  # another command's table is not read


def test_a_table_that_is_not_a_command_is_an_error(tmp_path):
    config = toml(tmp_path, "[srve]\nport = 9000\n")
    with pytest.raises(ConfigError, match=r"\[srve\] .*bench, convert, inspect, run, serve"):
        settings("serve", config)


def test_a_byte_count_past_the_floats_is_refused_not_an_overflow():
    import argparse

    from ninfer.cli.convert import _byte_count

    with pytest.raises(argparse.ArgumentTypeError, match="not a positive whole byte count"):
        _byte_count("1e999")


def test_a_config_that_is_a_directory_or_not_utf8_is_one_error(tmp_path):
    (tmp_path / "folder.toml").mkdir()
    with pytest.raises(ConfigError, match="is a directory"):
        settings("bench", tmp_path / "folder.toml")
    (tmp_path / "latin1.toml").write_bytes(b'stop = ["\xe9"]\n')
    with pytest.raises(ConfigError, match="not valid TOML"):
        settings("run", tmp_path / "latin1.toml")


def test_the_gdn_state_dtype_reaches_each_commands_engine(tmp_path):
    """`gdn-state-dtype` from the flag or a shared file: serve, run and bench take it."""
    from ninfer.cli.run import _engine_config
    from ninfer.serve.server import engine_config

    config = toml(tmp_path, 'gdn-state-dtype = "bfloat16"\n')
    assert engine_config(settings("serve", config)).gdn_state_dtype == "bfloat16"
    assert _engine_config(settings("run", config)).gdn_state_dtype == "bfloat16"
    assert settings("bench", config).gdn_state_dtype == "bfloat16"
    assert settings("run", None, "--gdn-state-dtype", "bfloat16").gdn_state_dtype == "bfloat16"
    assert settings("serve", None).gdn_state_dtype == "float32"
    with pytest.raises(ConfigError, match="gdn_state_dtype"):
        engine_config(settings("serve", None, "--gdn-state-dtype", "fp16"))
