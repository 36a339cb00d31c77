"""The demo model's corpus: the Python sources and documentation already installed on the machine
(standard library and site-packages), walked in sorted order, filtered, deduplicated by content
hash and split into train / held-out by that hash, so the same machine always yields the same
corpus. The manifest (one line per kept file) records exactly what went in."""

from __future__ import annotations

import gzip
import hashlib
import os
import site
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing import Pool
from pathlib import Path

SOURCE_SUFFIXES = (".py", ".pyi")
DOC_SUFFIXES = (".md", ".rst")
SKIP_DIRS = {"__pycache__", ".git", "site-packages", "dist-packages", "node_modules"}
MIN_BYTES = 256
MAX_BYTES = 256 * 1024
MAX_LINE = 2000
MAX_LONG_LINE_FRACTION = 0.02
LONG_LINE = 200
HELD_OUT_PER_MILLE = 10


@dataclass(slots=True, frozen=True)
class Document:
    label: str  # "<root>/<path inside it>", the name the manifest uses
    sha256: str  # of the normalised text
    text: str
    held_out: bool

    @property
    def kind(self) -> str:
        return "source" if self.label.endswith(SOURCE_SUFFIXES) else "doc"


def hash_fraction(digest: str) -> float:
    """A number in [0, 1) fixed by a hex digest: the basis of every deterministic choice here."""
    return int(digest[:12], 16) / float(1 << 48)


def source_roots() -> list[tuple[str, Path]]:
    """(label, directory) for the standard library and each site-packages directory."""
    roots: list[tuple[str, Path]] = []
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    roots.append(("stdlib", stdlib))
    site_dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    site_dirs += site.getsitepackages()
    seen = {stdlib.resolve()}
    for index, directory in enumerate(sorted(set(site_dirs))):
        path = Path(directory)
        if path.is_dir() and path.resolve() not in seen:
            seen.add(path.resolve())
            roots.append((f"site{index}" if index else "site", path))
    return roots


def _wanted(name: str) -> bool:
    return name.endswith(SOURCE_SUFFIXES + DOC_SUFFIXES) or name == "METADATA"


def list_files(
    roots: Iterable[tuple[str, Path]], exclude: Iterable[Path] = ()
) -> list[tuple[str, Path]]:
    """(label, path) of every candidate file, sorted by label."""
    excluded = [p.resolve() for p in exclude]
    found: list[tuple[str, Path]] = []
    for label, root in roots:
        for directory, dirnames, filenames in os.walk(root):
            here = Path(directory)
            if any(here.resolve().is_relative_to(e) for e in excluded):
                dirnames[:] = []
                continue
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            for name in sorted(filenames):
                if not _wanted(name):
                    continue
                if name == "METADATA" and not here.name.endswith(".dist-info"):
                    continue
                path = here / name
                found.append((f"{label}/{path.relative_to(root).as_posix()}", path))
    found.sort(key=lambda item: item[0])
    return found


def clean_text(raw: bytes, label: str) -> str | None:
    """The file's text with normalised line ends, or None when it is not useful prose or code."""
    if not MIN_BYTES <= len(raw) <= MAX_BYTES or b"\x00" in raw:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if label.endswith("METADATA"):
        # The long description (the package's README) follows the first blank line.
        _, _, text = text.partition("\n\n")
        if len(text) < MIN_BYTES:
            return None
    lines = text.split("\n")
    if max(len(line) for line in lines) > MAX_LINE:
        return None
    if sum(len(line) > LONG_LINE for line in lines) > MAX_LONG_LINE_FRACTION * len(lines):
        return None
    return text.strip("\n") + "\n"


def _load(item: tuple[str, str]) -> tuple[str, str, str] | None:
    label, path = item
    try:
        raw = Path(path).read_bytes()
    except OSError:
        return None
    text = clean_text(raw, label)
    if text is None:
        return None
    return label, hashlib.sha256(text.encode()).hexdigest(), text


def build_corpus(
    files: list[tuple[str, Path]], max_bytes: int | None = None, workers: int = 8
) -> list[Document]:
    """Read, filter and deduplicate `files` (first label wins); keep a hash-chosen subset when the
    total would exceed `max_bytes`."""
    items = [(label, str(path)) for label, path in files]
    with Pool(workers) as pool:
        loaded = pool.map(_load, items, chunksize=256)
    seen: set[str] = set()
    unique: list[tuple[str, str, str]] = []
    for entry in loaded:
        if entry is None or entry[1] in seen:
            continue
        seen.add(entry[1])
        unique.append(entry)
    total = sum(len(text) for _, _, text in unique)
    keep_fraction = 1.0 if not max_bytes or total <= max_bytes else max_bytes / total
    return [
        Document(
            label=label,
            sha256=digest,
            text=text,
            held_out=int(digest[12:20], 16) % 1000 < HELD_OUT_PER_MILLE,
        )
        for label, digest, text in unique
        if hash_fraction(digest) < keep_fraction
    ]


def write_manifest(documents: list[Document], path: Path) -> str:
    """A gzip TSV: label, bytes, sha256, split. Returns the sha256 of its uncompressed text, the
    corpus's identity."""
    lines = ["label\tbytes\tsha256\tsplit"]
    for doc in documents:
        split = "heldout" if doc.held_out else "train"
        lines.append(f"{doc.label}\t{len(doc.text.encode())}\t{doc.sha256}\t{split}")
    body = ("\n".join(lines) + "\n").encode()
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as out:
        out.write(body)
    return hashlib.sha256(body).hexdigest()
