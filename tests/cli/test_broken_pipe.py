"""A reader that leaves early (`ninfer inspect X | head`) ends the command quietly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "ninfer" / "assets" / "demo.ninfer"


def test_closed_stdout_ends_without_a_traceback():
    proc = subprocess.Popen(
        [sys.executable, "-m", "ninfer", "inspect", str(DEMO), "--objects"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.readline()
    proc.stdout.close()  # like `head -1`
    stderr = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert "Traceback" not in stderr
    assert proc.returncode in (0, 141)
