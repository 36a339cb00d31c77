"""`ninfer bench` names the commit it runs: the repository's HEAD in a checkout, and the
archived commit in a tree unpacked from `git archive`, which has no .git of its own (the
GPU machine runs such trees from inside another checkout)."""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from ninfer.bench import run

ROOT = Path(run.__file__).resolve().parents[2]
needs_checkout = pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout"
)


def git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, check=True)
    return done.stdout.decode().strip()


@needs_checkout
def test_a_checkout_names_its_head():
    head = git("rev-parse", "--short", "HEAD")
    clean = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD"]).returncode == 0
    assert run._commit() == (head if clean else f"{head}-dirty")


@pytest.mark.skipif(shutil.which("git") is None, reason="no git")
def test_a_checkout_with_changed_tracked_files_is_marked_dirty(tmp_path, monkeypatch):
    """Untracked files leave the name as it is; a tracked file changed from HEAD marks it."""
    monkeypatch.setattr(run, "ARCHIVE_COMMIT", tmp_path / "no-stamp")
    env = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a.txt").write_text("one\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", "a.txt"], check=True)
    subprocess.run(["git", "-C", str(tmp_path), *env, "commit", "-qm", "one"], check=True)
    head = subprocess.run(
        ["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (tmp_path / "b.txt").write_text("untracked\n")
    assert run._commit(tmp_path) == head
    (tmp_path / "a.txt").write_text("two\n")
    assert run._commit(tmp_path) == f"{head}-dirty"
    assert run._commit(tmp_path / "b.txt") is None  # not a directory git can run in


def test_an_unpacked_archive_names_the_commit_written_into_it(tmp_path, monkeypatch):
    stamp = tmp_path / "ARCHIVE_COMMIT"
    stamp.write_text("abc1234\n")
    monkeypatch.setattr(run, "ARCHIVE_COMMIT", stamp)
    assert run._commit() == "abc1234"


@needs_checkout
def test_git_archive_writes_its_commit_into_the_stamp():
    path = "ninfer/bench/ARCHIVE_COMMIT"
    data = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "HEAD", path], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        stamp = archive.extractfile(path).read().decode().strip()
    assert stamp and git("rev-parse", "HEAD").startswith(stamp)
