"""The `.ninfer` v3 container at the byte level: header, JSON root, payload split over an entry
file and `.part-NNNN` continuation files, per-object xxh64 checksums. Reading memory-maps every
file (copy-on-write, so tensors are writable views that never touch the file); writing plans all
offsets up front, streams the payload object by object into temporary files and renames them
into place only when everything is written. docs/artifact-format.md is the specification."""

from __future__ import annotations

import json
import mmap
import os
import struct
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from ninfer.errors import ArtifactError
from ninfer.quant import get_format
from ninfer.quant.formats import align_up

ENTRY_MAGIC = b"NINFER\x00\x03"
PART_MAGIC = b"NINPRT\x00\x03"
MAGIC_PREFIXES = {b"NINFER\x00": "entry", b"NINPRT\x00": "part"}
VERSION = 3
HEADER_BYTES = 32
PAYLOAD_ALIGN = 4096
TENSOR_ALIGN = 256
PART_PAYLOAD_START = 4096
DEFAULT_MAX_FILE_BYTES = 32_000_000_000
# the required members of the root JSON and their JSON types
ROOT_TYPES = {"components": dict, "objects": list, "bindings": dict, "uses": dict, "files": list}
RESOURCE_ENCODING = "raw_bytes_v1"
CHECKSUM_PREFIX = "xxh64:"
_PLACEHOLDER_CHECKSUM = CHECKSUM_PREFIX + "0" * 16


def part_path(entry: Path, index: int) -> Path:
    return entry.with_name(f"{entry.name}.part-{index:04d}")


def checksum_of(chunks: Iterable[Any]) -> str:
    h = xxhash.xxh64()
    for chunk in chunks:
        h.update(chunk)
    return CHECKSUM_PREFIX + h.hexdigest()


def _dump_json(root: dict) -> bytes:
    return json.dumps(root, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


# --------------------------------------------------------------------------------------- writing


@dataclass(slots=True)
class ObjectPlan:
    """An object the writer will store: a tensor (shape/format/layout) or a raw-bytes resource."""

    id: str
    kind: str
    nbytes: int
    shape: tuple[int, ...] = ()
    format: str = ""
    layout: str = ""

    @classmethod
    def tensor(cls, object_id: str, shape: Iterable[int], format_name: str) -> ObjectPlan:
        fmt = get_format(format_name)
        shape = tuple(int(d) for d in shape)
        return cls(object_id, "tensor", fmt.encoded_nbytes(shape), shape, fmt.name, fmt.layout)

    @classmethod
    def resource(cls, object_id: str, nbytes: int) -> ObjectPlan:
        return cls(object_id, "resource", int(nbytes))

    def to_json(self, offset: int, checksum: str) -> dict:
        if self.kind == "tensor":
            return {
                "id": self.id,
                "kind": "tensor",
                "shape": list(self.shape),
                "format": self.format,
                "layout": self.layout,
                "offset": offset,
                "bytes": self.nbytes,
                "checksum": checksum,
            }
        return {
            "id": self.id,
            "kind": "resource",
            "encoding": RESOURCE_ENCODING,
            "offset": offset,
            "bytes": self.nbytes,
            "checksum": checksum,
        }


def plan_layout(
    objects: list[ObjectPlan], entry_capacity: int, part_capacity: int
) -> tuple[list[int], list[int]]:
    """Logical payload offsets of the objects and the payload size of each file.

    An object that would cross the end of the current file starts a new file instead (at a
    256-byte boundary, so its alignment survives), unless it is larger than a part: then it is
    allowed to span files, and the reader joins its pieces. Capacities are rounded down to a
    multiple of 256, so every file's share of the payload starts 256-byte aligned even when an
    object spans files and `--max-file-bytes` is not a round number."""
    entry_capacity -= entry_capacity % TENSOR_ALIGN
    part_capacity -= part_capacity % TENSOR_ALIGN
    offsets: list[int] = []
    starts = [0]
    capacity = entry_capacity
    pos = 0
    for obj in objects:
        offset = align_up(pos, TENSOR_ALIGN if obj.kind == "tensor" else 1)
        file_end = starts[-1] + capacity
        if offset + obj.nbytes > file_end:
            fresh = align_up(pos, TENSOR_ALIGN)
            if obj.nbytes <= part_capacity and fresh <= file_end:
                starts.append(fresh)
                capacity = part_capacity
                offset = fresh
            else:
                while offset + obj.nbytes > starts[-1] + capacity:
                    starts.append(starts[-1] + capacity)
                    capacity = part_capacity
        offsets.append(offset)
        pos = offset + obj.nbytes
    ends = starts[1:] + [pos]
    return offsets, [end - start for start, end in zip(starts, ends)]


class ContainerWriter:
    """Writes one container. Give it every object up front, then `write` each in plan order and
    `finish`. Nothing appears under the final names unless `finish` succeeds; `abort` (also run
    when the `with` block exits without `finish`) removes the temporary files."""

    def __init__(
        self,
        path: str | os.PathLike,
        objects: list[ObjectPlan],
        *,
        components: dict,
        bindings: dict,
        uses: dict | None = None,
        metadata: dict | None = None,
        provenance: dict | None = None,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        artifact_id: bytes | None = None,
    ):
        self.path = Path(path)
        self.objects = list(objects)
        ids = [o.id for o in self.objects]
        if len(set(ids)) != len(ids):
            raise ArtifactError(f"{self.path}: duplicate object ids")
        if max_file_bytes <= PART_PAYLOAD_START + TENSOR_ALIGN:
            raise ArtifactError(f"--max-file-bytes must exceed {PART_PAYLOAD_START + TENSOR_ALIGN}")
        self.max_file_bytes = int(max_file_bytes)
        self.artifact_id = artifact_id or uuid.uuid4().bytes
        self.root_base = {
            "components": components,
            "bindings": bindings,
            "uses": uses or {},
            "metadata": metadata or {},
            "provenance": provenance or {},
        }
        self._check_free(self.path)
        self._layout()
        self._checksums: dict[str, str] = {}
        self._next = 0
        self._pos = 0
        self._handle: Any = None
        self._temp_paths: list[Path] = []
        self._file_index = -1
        self._file_written = 0
        self._finished = False
        self._moved: list[Path] = []
        self._open_next_file()

    # planning ----------------------------------------------------------------------------------

    def final_paths(self) -> list[Path]:
        return [self.path] + [part_path(self.path, i) for i in range(1, len(self.file_sizes))]

    @staticmethod
    def _check_free(path: Path) -> None:
        if path.exists():
            raise ArtifactError(f"{path}: already exists; refusing to overwrite")
        stray = sorted(path.parent.glob(f"{path.name}.part-*")) if path.parent.exists() else []
        if stray:
            raise ArtifactError(f"{stray[0]}: already exists; refusing to overwrite")

    def _root(self, checksums: dict[str, str]) -> dict:
        files = [
            {"path": None if i == 0 else part_path(self.path, i).name, "payload_bytes": size}
            for i, size in enumerate(self.file_sizes)
        ]
        objects = [
            o.to_json(off, checksums.get(o.id, _PLACEHOLDER_CHECKSUM))
            for o, off in zip(self.objects, self.offsets)
        ]
        return {**self.root_base, "objects": objects, "files": files}

    def _layout(self) -> None:
        payload_start = PAYLOAD_ALIGN
        for _ in range(16):
            entry_capacity = self.max_file_bytes - payload_start
            if entry_capacity < 0:
                raise ArtifactError(
                    f"{self.path}: --max-file-bytes {self.max_file_bytes} is smaller than the header ({payload_start} bytes)"
                )
            self.offsets, self.file_sizes = plan_layout(
                self.objects, entry_capacity, self.max_file_bytes - PART_PAYLOAD_START
            )
            json_bytes = len(_dump_json(self._root({})))
            needed = align_up(HEADER_BYTES + json_bytes, PAYLOAD_ALIGN)
            if needed <= payload_start:
                self.payload_start = payload_start
                self.json_bytes = json_bytes
                return
            payload_start = needed
        raise ArtifactError(f"{self.path}: could not settle the container layout")

    # streaming ---------------------------------------------------------------------------------

    def _close_current(self) -> None:
        if self._handle is not None:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()
            self._handle = None

    def _open_next_file(self) -> None:
        self._close_current()
        self._file_index += 1
        final = self.final_paths()[self._file_index]
        temp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
        self._temp_paths.append(temp)
        handle = open(temp, "wb")  # noqa: SIM115  (closed in _close_current / abort)
        self._handle = handle
        if self._file_index == 0:
            root = _dump_json(self._root({}))
            handle.write(ENTRY_MAGIC + struct.pack("<Q", len(root)) + self.artifact_id)
            handle.write(root)
            handle.write(b"\0" * (self.payload_start - HEADER_BYTES - len(root)))
        else:
            header = PART_MAGIC + struct.pack("<Q", self._file_index) + self.artifact_id
            handle.write(header + b"\0" * (PART_PAYLOAD_START - len(header)))
        self._file_written = 0

    def _emit(self, data: memoryview) -> None:
        while len(data):
            room = self.file_sizes[self._file_index] - self._file_written
            if room == 0:
                self._open_next_file()
                continue
            piece = data[:room]
            self._handle.write(piece)
            self._file_written += len(piece)
            self._pos += len(piece)
            data = data[len(piece) :]

    def _pad_to(self, offset: int) -> None:
        while self._pos < offset:
            self._emit(memoryview(bytes(min(offset - self._pos, 1 << 20))))

    def write(self, object_id: str, data: Any) -> None:
        """Store the next planned object. `data` is bytes-like or a uint8 torch tensor."""
        if self._next >= len(self.objects) or self.objects[self._next].id != object_id:
            expected = self.objects[self._next].id if self._next < len(self.objects) else "nothing"
            raise ArtifactError(f"{self.path}: wrote object {object_id!r}, expected {expected!r}")
        plan = self.objects[self._next]
        if isinstance(data, torch.Tensor):
            data = data.contiguous().reshape(-1).view(torch.uint8).numpy()
        view = memoryview(data).cast("B")
        if len(view) != plan.nbytes:
            raise ArtifactError(
                f"{self.path}: object {object_id!r} has {len(view)} bytes, planned {plan.nbytes}"
            )
        self._pad_to(self.offsets[self._next])
        self._checksums[object_id] = checksum_of([view])
        self._emit(view)
        self._next += 1

    def finish(self) -> list[Path]:
        """Seal the container and move every file to its final name; returns those names."""
        if self._next != len(self.objects):
            raise ArtifactError(
                f"{self.path}: {len(self.objects) - self._next} planned objects were not written"
            )
        while self._file_index < len(self.file_sizes) - 1:
            self._open_next_file()
        root = _dump_json(self._root(self._checksums))
        if len(root) != self.json_bytes:
            raise ArtifactError(f"{self.path}: header JSON changed size while sealing")
        self._close_current()
        with open(self._temp_paths[0], "r+b") as entry:
            entry.seek(HEADER_BYTES)
            entry.write(root)
        finals = self.final_paths()
        # Parts first, the entry last: a reader never finds an entry whose parts are missing.
        order = list(range(1, len(finals))) + [0]
        for i in order:
            move_no_overwrite(self._temp_paths[i], finals[i])
            self._moved.append(finals[i])
        self._finished = True
        return finals

    def abort(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        for path in self._temp_paths + self._moved:
            path.unlink(missing_ok=True)

    def __enter__(self) -> ContainerWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._finished:
            self.abort()


def move_no_overwrite(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`, failing (ArtifactError) rather than replacing an existing `dst`."""
    try:
        os.link(src, dst)
    except FileExistsError:
        raise ArtifactError(f"{dst}: already exists; refusing to overwrite") from None
    except OSError:
        if dst.exists():
            raise ArtifactError(f"{dst}: already exists; refusing to overwrite") from None
        os.replace(src, dst)
        return
    src.unlink()


# --------------------------------------------------------------------------------------- reading


@dataclass(slots=True)
class _MappedFile:
    path: Path
    data: torch.Tensor  # uint8 view of the whole file (copy-on-write mapping)
    view: memoryview  # the same bytes, for hashing without copies
    payload_start: int
    payload_bytes: int
    logical_start: int


@dataclass(slots=True)
class Container:
    """An opened container: the root JSON plus mappings of every file."""

    path: Path
    artifact_id: bytes
    root: dict
    files: list[_MappedFile]
    objects: dict[str, dict] = field(default_factory=dict)

    @property
    def payload_bytes(self) -> int:
        return sum(f.payload_bytes for f in self.files)

    @classmethod
    def open(cls, path: str | os.PathLike) -> Container:
        path = Path(path)
        data, view = _map(path)
        size = len(view)
        if size < HEADER_BYTES:
            raise ArtifactError(f"{path}: truncated: {size} bytes, shorter than the 32-byte header")
        magic = bytes(view[:8])
        _check_magic(path, magic, ENTRY_MAGIC)
        (json_bytes,) = struct.unpack("<Q", view[8:16])
        artifact_id = bytes(view[16:32])
        if HEADER_BYTES + json_bytes > size:
            raise ArtifactError(
                f"{path}: truncated: the header announces {json_bytes} JSON bytes but the file has {size} bytes"
            )
        try:
            root = json.loads(bytes(view[HEADER_BYTES : HEADER_BYTES + json_bytes]).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ArtifactError(f"{path}: the header JSON is invalid ({exc})") from None
        if not isinstance(root, dict):
            raise ArtifactError(f"{path}: the header JSON is not an object")
        for key, kind in ROOT_TYPES.items():
            if key not in root:
                raise ArtifactError(f"{path}: the header JSON has no {key!r}")
            if not isinstance(root[key], kind):
                raise ArtifactError(
                    f"{path}: the header JSON's {key!r} is not a JSON {'object' if kind is dict else 'array'}"
                )
        if "text" not in root["components"]:
            raise ArtifactError(f"{path}: the container has no 'text' component")
        payload_start = align_up(HEADER_BYTES + json_bytes, PAYLOAD_ALIGN)
        files_json = root["files"]
        if (
            not files_json
            or not isinstance(files_json[0], dict)
            or files_json[0].get("path") is not None
        ):
            raise ArtifactError(f"{path}: 'files' must list the entry file (path null) first")
        expected = payload_start + _payload_bytes(path, 0, files_json[0])
        if size != expected:
            what = "truncated" if size < expected else "has trailing bytes"
            raise ArtifactError(f"{path}: {what}: expected {expected} bytes, found {size}")
        files = [_MappedFile(path, data, view, payload_start, expected - payload_start, 0)]
        logical = files[0].payload_bytes
        for index, entry in enumerate(files_json[1:], start=1):
            files.append(_open_part(path, index, entry, artifact_id, logical))
            logical += files[-1].payload_bytes
        container = cls(path, artifact_id, root, files)
        container._index_objects()
        return container

    def _index_objects(self) -> None:
        total = self.payload_bytes
        for obj in self.root["objects"]:
            object_id = obj.get("id") if isinstance(obj, dict) else None
            if not isinstance(object_id, str) or object_id in self.objects:
                raise ArtifactError(f"{self.path}: object id {object_id!r} is missing or repeated")
            try:
                self._check_object(object_id, obj, total)
            except (KeyError, TypeError, ValueError) as exc:
                raise ArtifactError(
                    f"{self.path}: object {object_id}: malformed entry ({type(exc).__name__}: {exc})"
                ) from None
            self.objects[object_id] = obj

    def _check_object(self, object_id: str, obj: dict, total: int) -> None:
        """Raise ArtifactError for an entry that is well-formed but wrong; KeyError, TypeError or
        ValueError for one that is malformed (a member missing or of the wrong type)."""
        offset, nbytes = int(obj["offset"]), int(obj["bytes"])
        if offset < 0 or nbytes < 0 or offset + nbytes > total:
            raise ArtifactError(
                f"{self.path}: object {object_id}: bytes [{offset}, {offset + nbytes}) lie outside the payload ({total} bytes)"
            )
        kind = obj.get("kind")
        if kind == "tensor":
            try:
                fmt = get_format(obj["format"])
            except KeyError as exc:
                raise ArtifactError(f"{self.path}: object {object_id}: {exc.args[0]}") from None
            if offset % TENSOR_ALIGN:
                raise ArtifactError(
                    f"{self.path}: object {object_id}: offset {offset} is not 256-byte aligned"
                )
            if obj.get("layout") != fmt.layout:
                raise ArtifactError(
                    f"{self.path}: object {object_id}: layout {obj.get('layout')!r} does not match format {fmt.name} ({fmt.layout})"
                )
            shape = obj["shape"]
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ArtifactError(f"{self.path}: object {object_id}: bad shape {shape!r}")
            want = fmt.encoded_nbytes(tuple(shape))
            if nbytes != want:
                raise ArtifactError(
                    f"{self.path}: object {object_id}: {nbytes} bytes, but {fmt.name} {obj['shape']} needs {want}"
                )
        elif kind == "resource":
            if obj.get("encoding") != RESOURCE_ENCODING:
                raise ArtifactError(
                    f"{self.path}: object {object_id}: unknown encoding {obj.get('encoding')!r}"
                )
        else:
            raise ArtifactError(f"{self.path}: object {object_id}: unknown kind {kind!r}")

    def object(self, object_id: str) -> dict:
        try:
            return self.objects[object_id]
        except KeyError:
            raise ArtifactError(f"{self.path}: no object {object_id!r}") from None

    def _pieces(self, offset: int, nbytes: int) -> list[tuple[_MappedFile, int, int]]:
        """(file, start, end) byte ranges inside the files covering logical [offset, offset+nbytes)."""
        pieces = []
        end = offset + nbytes
        for f in self.files:
            lo = max(offset, f.logical_start)
            hi = min(end, f.logical_start + f.payload_bytes)
            if lo < hi:
                base = f.payload_start - f.logical_start
                pieces.append((f, base + lo, base + hi))
        return pieces

    def object_bytes(self, object_id: str) -> torch.Tensor:
        """The object's bytes as uint8: a view of the mapping, or a joined copy if it spans files."""
        obj = self.object(object_id)
        pieces = self._pieces(int(obj["offset"]), int(obj["bytes"]))
        if not pieces:
            return torch.empty(0, dtype=torch.uint8)
        if len(pieces) == 1:
            f, lo, hi = pieces[0]
            return f.data[lo:hi]
        return torch.cat([f.data[lo:hi] for f, lo, hi in pieces])

    def verify_object(self, object_id: str) -> None:
        obj = self.object(object_id)
        stored = obj.get("checksum")
        if stored is None:
            return
        pieces = self._pieces(int(obj["offset"]), int(obj["bytes"]))
        actual = checksum_of(f.view[lo:hi] for f, lo, hi in pieces)
        if actual != stored:
            raise ArtifactError(
                f"{self.path}: object {object_id}: checksum mismatch (stored {stored}, computed {actual})"
            )

    def verify(self) -> int:
        for object_id in self.objects:
            self.verify_object(object_id)
        return len(self.objects)


def _map(path: Path) -> tuple[torch.Tensor, memoryview]:
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size == 0:
                return torch.empty(0, dtype=torch.uint8), memoryview(b"")
            mapping = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY)
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ArtifactError(f"{path}: is a directory, not a .ninfer file") from None
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{path}: cannot be read ({exc})") from None
    return torch.frombuffer(mapping, dtype=torch.uint8), memoryview(mapping)


def _check_magic(path: Path, magic: bytes, expected: bytes) -> None:
    if magic == expected:
        return
    if magic[:7] == expected[:7]:
        raise ArtifactError(
            f"{path}: container version {magic[7]} is not supported (this ninfer reads version {VERSION})"
        )
    kind = MAGIC_PREFIXES.get(magic[:7])
    if kind is not None:
        raise ArtifactError(f"{path}: is a .ninfer {kind} file, not the expected kind")
    raise ArtifactError(f"{path}: not a .ninfer file (magic {magic!r})")


def _payload_bytes(entry: Path, index: int, spec: object) -> int:
    """`payload_bytes` of entry `index` of the root's `files` list, checked."""
    size = spec.get("payload_bytes") if isinstance(spec, dict) else None
    if not isinstance(size, int) or size < 0:
        raise ArtifactError(f"{entry}: file {index} has no valid 'payload_bytes' ({size!r})")
    return size


def _open_part(
    entry: Path, index: int, spec: object, artifact_id: bytes, logical: int
) -> _MappedFile:
    payload = _payload_bytes(entry, index, spec)
    name = spec.get("path")
    if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
        raise ArtifactError(f"{entry}: file {index} has an invalid path {name!r}")
    path = entry.with_name(name)
    if not path.exists():
        raise ArtifactError(f"{path}: missing part {index} of {entry.name}")
    data, view = _map(path)
    if len(view) < HEADER_BYTES:
        raise ArtifactError(f"{path}: truncated part: {len(view)} bytes")
    _check_magic(path, bytes(view[:8]), PART_MAGIC)
    (part_index,) = struct.unpack("<Q", view[8:16])
    if part_index != index:
        raise ArtifactError(f"{path}: is part {part_index}, expected part {index}")
    if bytes(view[16:32]) != artifact_id:
        raise ArtifactError(f"{path}: belongs to another artifact (artifact id differs)")
    if len(view) != PART_PAYLOAD_START + payload:
        what = (
            "truncated part"
            if len(view) < PART_PAYLOAD_START + payload
            else "part has trailing bytes"
        )
        raise ArtifactError(
            f"{path}: {what}: expected {PART_PAYLOAD_START + payload} bytes, found {len(view)}"
        )
    return _MappedFile(path, data, view, PART_PAYLOAD_START, payload, logical)
