"""The GPU machine's check script (tools/gpu/check.sh) runs every GPU test file: each
tests/gpu/test_*.py is named in one of its groups, so a new file cannot be left out."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_gpu_test_file_is_in_a_check_group():
    script = (ROOT / "tools" / "gpu" / "check.sh").read_text()
    files = sorted(
        p.relative_to(ROOT).as_posix() for p in (ROOT / "tests" / "gpu").glob("test_*.py")
    )
    assert files
    assert [f for f in files if f not in script] == []
