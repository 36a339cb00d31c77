"""tools/train_demo/train.py runs end to end on a CPU (toy shapes, this repository as the corpus)
and writes everything the demo model is made from."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_smoke_run_writes_checkpoint_manifest_and_metrics(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools/train_demo/train.py"),
            "--smoke",
            "--out",
            str(out),
            "--work",
            str(tmp_path / "work"),
            "--root",
            f"ninfer={REPO / 'ninfer'}",
            "--workers",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["training"]["steps"] >= 1
    assert metrics["parameters"]["mtp"] > 0
    with gzip.open(out / "corpus_manifest.tsv.gz", "rt") as manifest:
        lines = manifest.read().splitlines()
    assert lines[0] == "label\tbytes\tsha256\tsplit"
    assert len(lines) - 1 == metrics["corpus"]["files"]
    archive = tmp_path / "checkpoint.tar"
    archive.write_bytes(b"".join(p.read_bytes() for p in sorted(out.glob("checkpoint.tar.part*"))))
    with tarfile.open(archive) as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    } <= names
