"""Stage 6, the reader: a lazy ``Mapping[str, Frames]`` over a saved dataset.

Reading one filename opens its shard with ``safetensors.safe_open`` and slices
only that filename's rows.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from safetensors import safe_open

from .errors import OutputError
from .frames import Frames, Layout, rebuild
from .sink import FORMAT, INDEX_NAME

__all__ = ["Dataset", "open_dataset"]


class Dataset(Mapping[str, Frames]):
    """A saved dataset; ``ds[filename]`` reads that filename's frames from disk.

    Attributes:
        path: the dataset directory.
        index: the parsed ``tdgather.index.json``.
        metadata: totals and user metadata.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        index_path = self.path / INDEX_NAME
        if not index_path.is_file():
            partial = self.path.with_name(self.path.name + ".partial")
            hint = f"; {str(partial)!r} holds shards of an interrupted run" if partial.exists() else ""
            raise OutputError(f"{str(self.path)!r} is not a complete tdgather dataset: no {INDEX_NAME}{hint}")
        self.index: dict[str, Any] = json.loads(index_path.read_text(encoding="utf-8"))
        if self.index.get("format") != FORMAT:
            raise OutputError(f"{str(index_path)!r}: expected format {FORMAT!r}, got {self.index.get('format')!r}")
        self.metadata: dict[str, Any] = self.index["metadata"]
        self._files: dict[str, dict] = self.index["files"]

    def __len__(self) -> int:
        return len(self._files)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __contains__(self, name: object) -> bool:
        return name in self._files

    def layout(self, name: str) -> Layout:
        """The layout (structure, dtypes, per-frame shapes) of a filename, without reading data."""
        entry = self._files[name]
        return Layout.from_json(self.index["shards"][entry["shard"]]["groups"][entry["group"]])

    def num_frames(self, name: str) -> int:
        """Frames stored for a filename, without reading data."""
        return self._files[name]["frames"]

    def __getitem__(self, name: str) -> Frames:
        entry = self._files[name]
        layout = self.layout(name)
        key, lo, count = entry["group"], entry["start"], entry["frames"]
        hi = lo + count
        with safe_open(self.path / entry["shard"], framework="pt") as f:
            idx = f.get_slice(f"{key}.frame_idx")[lo:hi]
            tensors = [f.get_slice(f"{key}.leaf{j}")[lo:hi] for j in range(len(layout.leaves))]
            values = []
            for j in range(len(layout.nontensor)):
                start, end = f.get_slice(f"{key}.json{j}.offsets")[lo : hi + 1][[0, -1]].tolist()
                blob = f.get_slice(f"{key}.json{j}")[start:end]
                values.append([json.loads(line) for line in blob.numpy().tobytes().splitlines()])
        return Frames(frame_idx=idx, frames=rebuild(layout, count, tensors, values), batch_size=[count])


def open_dataset(path: str | os.PathLike) -> Dataset:
    """Open a saved dataset lazily; raises OutputError when it is incomplete."""
    return Dataset(path)
