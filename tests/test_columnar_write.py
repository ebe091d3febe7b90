"""A gathered group's rows are written as runs, not a piece a filename; the index's JSON a chunk at a time.

Both are only speed (`tdgather.storage.shards`, `tdgather.storage.catalog`): the bytes must be what
one piece a filename, and one ``json.dumps`` of the whole ``files`` object, give.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import tdgather
from tdgather.storage.writer import DatasetWriter


def preds(n: int) -> dict[str, list]:
    """``n`` filenames (non-ASCII, quotes), one to three frames each, a fixed leaf, a ragged one and a JSON one."""
    return {
        f'imé_{i:05d}"q.jpg': [
            (t, {"x": torch.full((3,), float(i * 10 + t)), "boxes": torch.ones(t % 3, 4) * i, "label": f"c{i % 7}"})
            for t in range(i % 3 + 1)
        ]
        for i in range(n)
    }


def shard_tensors(path) -> dict[str, torch.Tensor]:
    ds = tdgather.open(path)
    out = {}
    for shard in sorted(ds.index["shards"]):
        with safe_open(str(path / shard), "pt") as f:
            out.update({f"{shard[:11]}/{k}": f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


@pytest.mark.parametrize("n", [1, 7, 5001, 12000])
def test_a_gathered_group_writes_the_bytes_one_piece_a_filename_writes(tmp_path, n):
    gathered = tdgather.gather(preds(n))
    per_file = {name: gathered[name] for name in gathered}  # `Frames` a filename: no group to take runs of
    for name, frames in (("runs", gathered), ("per_file", per_file)):
        w = DatasetWriter(tmp_path / name, max_shard_bytes=40_000)
        w.write(frames)
        assert "".join(w.catalog.json_chunks()) == json.dumps(w.files, ensure_ascii=False)
        w.commit({})
    a, b = shard_tensors(tmp_path / "runs"), shard_tensors(tmp_path / "per_file")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    ds = tdgather.open(tmp_path / "runs")
    name = sorted(ds)[-1]
    assert torch.equal(ds[name].frames["x"], gathered[name].frames["x"]) and len(ds) == n
