"""`save`: frames gathered on one rank, written as a dataset in one call (the sink's call order, in one go)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..core.frames import Frames
from ..core.metadata import USER_KEY, user_metadata
from ..errors import UnsupportedValueError
from .sink import SinkFactory
from .writer import DEFAULT_SHARD_BYTES, DatasetWriter

__all__ = ["save"]


def save(
    frames: Mapping[str, Frames],
    path: str | os.PathLike,
    *,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    metadata: Mapping[str, Any] | None = None,
    sink: SinkFactory | None = None,
    storage_options: dict | None = None,
    append: bool = False,
) -> Path | str:
    """Write gathered frames as a dataset directory (see the module docstring).

    Args:
        frames: ``{filename: Frames}``, as `tdgather.api.gather` returns on rank ``dst``.
        path: the dataset directory to create, or an object store URL (``s3://bucket/prefix``, any
            fsspec URL: see docs/object-storage.md).
        overwrite: replace an existing tdgather dataset (atomically: the old one stays whole until the
            swap). A directory that is not a tdgather dataset is refused, even with this.
        max_shard_bytes: start a new shard when a shard would grow past this; one filename
            never spans shards in one call.
        metadata: your JSON values (numpy scalars are converted), stored in the index as
            ``metadata["user"]``, beside tdgather's own keys (a `tdgather.Gathered`'s duplicate counts).
        sink: makes the `tdgather.storage.sink.Sink` that writes (called with `DatasetWriter`'s
            keywords); default `DatasetWriter`.
        storage_options: for an object store URL, the filesystem's options (fsspec's).
        append: add these frames to the dataset at ``path`` (created if absent) as a new snapshot,
            beside other jobs' (docs/many-jobs.md): a frame the dataset already holds is kept
            once, the first committed copy.

    Returns:
        The dataset directory (or URL).

    Raises:
        UnsupportedValueError: (a TypeError) ``frames`` is not gathered frames: the raw
            ``{filename: (frame_idx, value)}`` dict, a `tdgather.FrameStore`, None (a rank other
            than ``dst``), ...; gather them first: ``tdgather.save(tdgather.gather(predictions), path)``.
    """
    _check_save_input(frames)
    meta: dict[str, Any] = {USER_KEY: user_metadata(metadata)}
    stats = getattr(frames, "stats", None)  # a Gathered: its duplicate counts go in the index too
    if stats is not None:
        meta.update(duplicates_dropped=stats.duplicates.dropped, duplicates=stats.duplicates.to_json())
    options: dict[str, Any] = {"storage_options": storage_options} if storage_options else {}
    if append:
        options["append"] = True
    writer = (sink or DatasetWriter)(path, overwrite=overwrite, max_shard_bytes=max_shard_bytes, **options)
    try:
        writer.write(frames)
        return writer.commit(meta)
    except BaseException:
        writer.discard()  # the caller still holds the frames: leave nothing half-written
        raise


_SAVE_FIX = "gather them first: tdgather.save(tdgather.gather(predictions), path)"
_SAVE_WANT = (
    "expected gathered frames: a tdgather.Gathered (what tdgather.gather returns on rank dst) or a dict "
    "{filename: tdgather.Frames}"
)


def _check_save_input(frames: Any) -> None:
    """Refuse, before anything is created on disk, what `save` cannot write, with the fix.

    The raw predictions are refused, not gathered here: `tdgather.api.gather` is where duplicates,
    ``ragged=`` and the receiving rank are decided, and with torch.distributed initialised a
    gather inside ``save`` would be a collective call only some ranks make.
    """
    from ..core.framestore import FrameStore  # here: the store is not needed to write

    if frames is None:
        raise UnsupportedValueError(
            f"save(): {_SAVE_WANT}, got None; tdgather.gather returns the frames on rank dst only (None on the "
            "other ranks): call save() where the result is not None"
        )
    if isinstance(frames, FrameStore):
        raise UnsupportedValueError(f"save(): {_SAVE_WANT}, got a tdgather.FrameStore (not gathered); {_SAVE_FIX}")
    if not isinstance(frames, Mapping):
        raise UnsupportedValueError(f"save(): {_SAVE_WANT}, got {type(frames).__name__}")
    if getattr(frames, "groups", None) is not None or not isinstance(frames, dict):
        return  # a Gathered, an opened Dataset: its values are Frames
    for name, f in frames.items():
        if not (hasattr(f, "frames") and hasattr(f, "frame_idx")):
            raw = isinstance(f, tuple | list)
            form = " (the {filename: (frame_idx, value)} form that tdgather.gather takes)" if raw else ""
            raise UnsupportedValueError(
                f"save(): {_SAVE_WANT}, got a dict whose filename {name!r:.200} holds {type(f).__name__}{form}; "
                f"{_SAVE_FIX}"
            )
