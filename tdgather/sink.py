"""Stage 5, the sink: sharded safetensors plus a JSON index, atomic and durable.

Layout of a dataset directory (documented in the README)::

    out/epoch_3/
        shard-00000.safetensors       # valid safetensors: readable with safetensors alone
        shard-00001.safetensors
        tdgather.index.json           # written last: its presence means "complete"

In a shard, the frames of every filename of one layout ("group" ``g<k>``) are
stored back to back, filenames in sorted order: ``g<k>.frame_idx`` (int64
``[N]``), one tensor per leaf ``g<k>.leaf<j>`` (``[N, ...]``), and for JSON
leaves ``g<k>.json<j>`` (UTF-8 JSON lines, uint8) with ``g<k>.json<j>.offsets``
(int64 ``[N+1]`` byte offsets). The index maps each filename to its shard,
group, first row and frame count, so reading one filename reads only its rows.

Writes go to a staging directory ``<name>.partial`` beside the target. Every
file is written to a temporary name, fsynced, renamed, and the directory
fsynced; the index comes last; then the staging directory is renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ._dtypes import SAFETENSORS_CODE
from .errors import OutputError
from .frames import Frames, Layout, flatten

__all__ = ["DEFAULT_SHARD_BYTES", "FORMAT", "INDEX_NAME", "check_output", "save", "write_safetensors"]

FORMAT = "tdgather"
INDEX_NAME = "tdgather.index.json"
DEFAULT_SHARD_BYTES = 1 << 30


def check_output(path: str | os.PathLike, overwrite: bool) -> Path:
    """Refuse an output directory that cannot be used, before any work; return it.

    The target must be absent, an empty directory, or (with ``overwrite=True``) an
    existing dataset. Its parent must be creatable and writable.
    """
    target = Path(path)
    staging = _staging(target)
    if target.exists() and not target.is_dir():
        raise OutputError(f"output {str(target)!r}: expected a directory, got a file; choose another path")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise OutputError(
            f"output {str(target)!r} exists and is not empty; pass overwrite=True to replace it atomically, "
            "or choose another path"
        )
    if staging.exists() and not overwrite:
        raise OutputError(
            f"{str(staging)!r} holds shards left by an interrupted run (no index, so incomplete); remove it, "
            "or pass overwrite=True to replace it"
        )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"output {str(target)!r}: cannot create its parent directory ({e}); fix the path") from e
    if not os.access(target.parent, os.W_OK | os.X_OK):
        raise OutputError(f"output {str(target)!r}: its parent directory is not writable; choose a writable path")
    return target


def save(
    frames: Mapping[str, Frames],
    path: str | os.PathLike,
    *,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write gathered frames as a dataset directory (see the module docstring).

    Args:
        frames: ``{filename: Frames}``, as `tdgather.gather` returns on rank ``dst``.
        path: the dataset directory to create.
        overwrite: replace an existing dataset (atomically: the old one stays whole until the swap).
        max_shard_bytes: start a new shard when a shard would grow past this; one filename
            never spans shards.
        metadata: extra JSON values stored in the index under ``"metadata"``.

    Returns:
        The dataset directory.
    """
    target = check_output(path, overwrite)
    staging = _staging(target)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    shards: list[list[tuple[str, Layout, Frames, list, list]]] = [[]]
    size = 0
    for name in sorted(frames):
        f = frames[name]
        count = f.frame_idx.numel()
        layout, tensors, json_values = flatten(f.frames, count, f"filename {name!r}")
        nbytes = count * (layout.frame_nbytes + 8)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, layout, f, tensors, json_values))
        size += nbytes
    index: dict[str, Any] = {"format": FORMAT, "version": 1, "metadata": {}, "shards": {}, "files": {}}
    total_frames = total_bytes = 0
    for k, shard in enumerate(s for s in shards if s):
        shard_name = f"shard-{k:05d}.safetensors"
        groups, entries = _shard_tensors(shard, shard_name, index["files"])
        write_safetensors(staging / shard_name, entries, {"format": FORMAT, "groups": json.dumps(groups)})
        frames_in = sum(f.frame_idx.numel() for _, _, f, _, _ in shard)
        bytes_in = sum(f.frame_idx.numel() * lay.frame_nbytes for _, lay, f, _, _ in shard)
        index["shards"][shard_name] = {"frames": frames_in, "bytes": bytes_in, "groups": groups}
        total_frames += frames_in
        total_bytes += bytes_in
    index["metadata"] = {
        **(metadata or {}),
        "total_frames": total_frames,
        "total_bytes": total_bytes,
        "num_filenames": len(index["files"]),
    }
    _write_atomic(staging / INDEX_NAME, [json.dumps(index, ensure_ascii=False, allow_nan=False).encode()])
    _publish(staging, target, overwrite)
    return target


def _shard_tensors(shard: list, shard_name: str, files: dict) -> tuple[dict, list]:
    by_layout: dict[Layout, list] = {}
    for item in shard:
        by_layout.setdefault(item[1], []).append(item)
    groups, entries = {}, []
    for g, (layout, items) in enumerate(by_layout.items()):
        key = f"g{g}"
        groups[key] = layout.to_json()
        row = 0
        for name, _, f, _, _ in items:
            files[name] = {"shard": shard_name, "group": key, "start": row, "frames": f.frame_idx.numel()}
            row += f.frame_idx.numel()
        entries.append((f"{key}.frame_idx", torch.int64, (row,), [f.frame_idx for _, _, f, _, _ in items]))
        for j, leaf in enumerate(layout.leaves):
            entries.append((f"{key}.leaf{j}", leaf.dtype, (row, *leaf.shape), [t[j] for _, _, _, t, _ in items]))
        for j in range(len(layout.nontensor)):
            lines = [
                json.dumps(v, ensure_ascii=False, allow_nan=False).encode() + b"\n"
                for _, _, _, _, js in items
                for v in js[j]
            ]
            offsets = torch.tensor([0, *map(len, lines)], dtype=torch.int64).cumsum(0)
            blob = (
                torch.frombuffer(bytearray(b"".join(lines)), dtype=torch.uint8)
                if lines
                else torch.empty(0, dtype=torch.uint8)
            )
            entries.append((f"{key}.json{j}", torch.uint8, (blob.numel(),), [blob]))
            entries.append((f"{key}.json{j}.offsets", torch.int64, (row + 1,), [offsets]))
    return groups, entries


def write_safetensors(
    path: Path, entries: list[tuple[str, torch.dtype, tuple, list]], metadata: dict[str, str]
) -> None:
    """Write a safetensors file atomically, streaming each tensor from its pieces (no staging copy).

    Args:
        path: the final file name; a temporary name beside it is written first.
        entries: ``(name, dtype, shape, pieces)``; the pieces, concatenated on dim 0, make the tensor.
        metadata: str -> str, stored as ``__metadata__``.
    """
    entries = sorted(entries, key=lambda e: -e[1].itemsize)  # keeps every tensor aligned to its itemsize
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, _ in entries:
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        header[name] = {
            "dtype": SAFETENSORS_CODE[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)

    def chunks():
        yield struct.pack("<Q", len(raw)) + raw
        for _, _, _, pieces in entries:
            for piece in pieces:
                if piece.numel():
                    yield memoryview(piece.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())

    _write_atomic(path, chunks())


def _write_atomic(path: Path, chunks: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            for chunk in chunks:
                fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"writing {str(path)!r} failed ({e}); files already committed stay valid") from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _staging(target: Path) -> Path:
    return target.with_name(target.name + ".partial")


def _publish(staging: Path, target: Path, overwrite: bool) -> None:
    """Move a complete staging directory into place; an old dataset is swapped out, then removed."""
    old = None
    if target.exists() and any(target.iterdir()):
        if not overwrite:
            raise OutputError(f"output {str(target)!r} appeared while writing; pass overwrite=True to replace it")
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.rename(target, old)
    os.replace(staging, target)
    _fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old)
