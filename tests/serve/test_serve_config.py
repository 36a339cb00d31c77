"""`ninfer serve` settings: flags, `--config FILE.toml` with the same keys, flags win."""

from __future__ import annotations

import pytest

from ninfer.cli.config import settings_from
from ninfer.cli.main import build_parser
from ninfer.errors import ConfigError
from ninfer.serve.settings import ServeSettings


def settings(argv: list[str]) -> ServeSettings:
    args = build_parser().parse_args(["serve", *argv])
    return settings_from(ServeSettings, args, "serve")


def test_defaults_are_upstreams_loopback_and_port():
    s = settings([])
    assert (s.host, s.port, s.max_request_mib, s.default_max_tokens) == (
        "127.0.0.1",
        8080,
        384,
        8192,
    )
    assert s.is_loopback and s.api_key is None and s.temperature is None


def test_config_file_sets_keys_and_flags_win(tmp_path):
    config = tmp_path / "serve.toml"
    config.write_text(
        "port = 9000\nmax-context = 2048\nno_thinking = true\n"
        '[serve]\ntemperature = 0.3\nmodel-id = "from-file"\n'
    )
    s = settings(["--config", str(config), "--port", "9100", "--model-id", "from-flag"])
    assert s.port == 9100 and s.model_id == "from-flag"
    assert s.max_context == 2048 and s.no_thinking is True and s.temperature == 0.3


def test_unknown_config_keys_are_reported(tmp_path):
    config = tmp_path / "serve.toml"
    config.write_text("prot = 1\n")
    with pytest.raises(ConfigError, match="prot"):
        settings(["--config", str(config)])


@pytest.mark.parametrize(
    "argv",
    [["--port", "0"], ["--temperature", "3"], ["--kv-capacity", "lots"], ["--model-id", " "]],
)
def test_out_of_range_settings_are_refused(argv):
    with pytest.raises(ConfigError):
        settings(argv)


def test_api_key_file_is_read_and_excludes_api_key(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("abc\n")
    assert settings(["--api-key-file", str(key_file)]).resolved_api_key() == "abc"
    with pytest.raises(ConfigError):
        settings(["--api-key", "x", "--api-key-file", str(key_file)])


def test_serve_command_does_not_import_the_server_stack_until_it_runs():
    import subprocess
    import sys

    code = "import sys, ninfer.cli.main as m; m.build_parser(); print('fastapi' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
