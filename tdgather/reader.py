"""Stage 6, the reader: a lazy ``Mapping[str, Frames]`` over a saved dataset.

Reading one filename opens its shard(s) with ``safetensors.safe_open`` and
slices only that filename's rows; segments written at different times are
merged by ``frame_idx``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .errors import OutputError
from .frames import Frames, Layout, rebuild
from .sink import FORMAT, INCOMPLETE_NAME, INDEX_NAME

__all__ = ["Dataset", "open_dataset", "read_segment"]


class Dataset(Mapping[str, Frames]):
    """A saved dataset; ``ds[filename]`` reads that filename's frames from disk.

    Attributes:
        path: the dataset directory.
        index: the parsed ``tdgather.index.json``.
        metadata: totals and user metadata; for an incomplete dataset, ``metadata["failure"]``.
    """

    def __init__(self, path: str | os.PathLike, incomplete: bool = False) -> None:
        self.path = Path(path)
        partial = self.path.with_name(self.path.name + ".partial")
        if incomplete:
            if not self.path.name.endswith(".partial"):
                self.path = partial
            index_path = self.path / INCOMPLETE_NAME
            if not index_path.is_file():
                raise OutputError(
                    f"{str(self.path)!r} holds no {INCOMPLETE_NAME}: no failed run recorded what it saved there"
                )
        else:
            index_path = self.path / INDEX_NAME
        if not index_path.is_file():
            hint = ""
            if (partial / INCOMPLETE_NAME).exists():
                hint = (
                    f"; a failed run saved frames in {str(partial)!r}: tdgather.open(path, incomplete=True) "
                    "reads them (tdgather inspect --incomplete PATH lists them)"
                )
            elif (partial / INDEX_NAME).exists():
                hint = f"; {str(partial)!r} holds a complete dataset whose move into place was interrupted"
            elif partial.exists():
                hint = f"; {str(partial)!r} holds shards of an interrupted run"
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
        segment = self._files[name]["segments"][0]
        return Layout.from_json(self.index["shards"][segment["shard"]]["groups"][segment["group"]])

    def num_frames(self, name: str) -> int:
        """Frames stored for a filename, without reading data."""
        return self._files[name]["frames"]

    def __getitem__(self, name: str) -> Frames:
        entry = self._files[name]
        layout = self.layout(name)
        pieces = [read_segment(self.path, segment, layout) for segment in entry["segments"]]
        idx, tensors, json_values = pieces[0]
        if len(pieces) > 1:  # segments written at different times: merge them by frame_idx
            order = torch.argsort(torch.cat([p[0] for p in pieces]))
            idx = torch.cat([p[0] for p in pieces])[order]
            tensors = [torch.cat([p[1][j] for p in pieces])[order] for j in range(len(layout.leaves))]
            rows = order.tolist()
            json_values = [[v for p in pieces for v in p[2][j]] for j in range(len(layout.nontensor))]
            json_values = [[values[r] for r in rows] for values in json_values]
        count = idx.numel()
        return Frames(frame_idx=idx, frames=rebuild(layout, count, tensors, json_values), batch_size=[count])


def read_segment(root: Path, segment: dict, layout: Layout) -> tuple[torch.Tensor, list, list]:
    """Read one segment's ``(frame_idx, tensor leaves, JSON leaves)``, touching only its rows."""
    key, lo = segment["group"], segment["start"]
    hi = lo + segment["frames"]
    with safe_open(Path(root) / segment["shard"], framework="pt") as f:
        idx = f.get_slice(f"{key}.frame_idx")[lo:hi]
        tensors = [f.get_slice(f"{key}.leaf{j}")[lo:hi] for j in range(len(layout.leaves))]
        json_values = []
        for j in range(len(layout.nontensor)):
            start, end = f.get_slice(f"{key}.json{j}.offsets")[lo : hi + 1][[0, -1]].tolist()
            blob = f.get_slice(f"{key}.json{j}")[start:end]
            json_values.append([json.loads(line) for line in blob.numpy().tobytes().splitlines()])
    return idx, tensors, json_values


def open_dataset(path: str | os.PathLike, *, incomplete: bool = False) -> Dataset:
    """Open a saved dataset lazily; raises OutputError when it is incomplete.

    With ``incomplete=True``, open instead what a failed run saved in ``<path>.partial``
    (the frames committed before the failure, listed in ``tdgather.incomplete.json``).
    """
    return Dataset(path, incomplete)
