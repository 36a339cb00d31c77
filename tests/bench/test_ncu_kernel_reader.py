"""`tools/gpu/ncu_kernel.py read`: the per-instruction samples of an Nsight Compute source page
(CSV), on a page written here with the columns ncu writes."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "gpu" / "ncu_kernel.py"


def _tool():
    spec = importlib.util.spec_from_file_location("ncu_kernel", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_read_prints_the_sampled_instructions_and_the_sums(tmp_path, capsys):
    header = [
        "Address",
        "Source",
        "Warp Stall Sampling (All Samples)",
        "Instructions Executed",
        "stall_long_sb",
        "stall_wait",
        "stall_long_sb (Not Issued)",
    ]
    rows = [
        ["0x0", "LDG.E.128 R4, desc[UR4][R2.64]", "1", "8", "0", "1", "0"],
        ["0x10", "IMAD.U32 R5, R4, 0x10000, RZ", "40", "8", "37", "3", "37"],
        ["0x20", "REDUX.MAX.S32 UR6, R5", "", "1", "", "", ""],
    ]
    page = tmp_path / "page.csv"
    with page.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Kernel Name", "_kernel"])
        writer.writerow(header)
        writer.writerows(rows)
    _tool().read(page, at_least=5)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2  # the one instruction at five samples or more, then the sums
    assert "IMAD.U32" in lines[0] and "long_sb 37, wait 3" in lines[0]
    assert lines[1] == "instructions executed 17, samples 41: long_sb 37, wait 4"
