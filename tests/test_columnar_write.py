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
from tdgather.storage.catalog import Catalog
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


def files_by_dicts(catalog: Catalog) -> dict[str, dict]:
    """The index's ``files`` object built the slow way: a dict a filename, from `Catalog.segments`."""
    out = {}
    for name in sorted(catalog.ids):
        segs = [{k: seg[k] for k in ("shard", "group", "start", "frames")} for seg in catalog.segments(name)]
        if segs:
            out[name] = {"frames": sum(seg["frames"] for seg in segs), "segments": segs}
    return out


def test_the_files_json_is_what_json_dumps_writes_for_any_filename_and_segments():
    layout = tdgather.gather({"a": [(0, torch.zeros(2))]}).groups[0].layout
    names = ['q"uote', "back\\slash", "new\nline", "\x01ctl", "é ü", "日本.mp4", "\u2028sep", "x" * 300]
    cat = Catalog()
    for k, name in enumerate(names):  # one segment each; every other one a second segment in another shard
        cat.add(name, layout, {"shard": "s0", "group": "g0", "start": k, "frames": 1}, torch.tensor([0]), (0, 0), 0)
        if k % 2:
            seg = {"shard": f"s{k}", "group": "g1", "start": 0, "frames": 2}
            cat.add(name, layout, seg, torch.tensor([1, 2]), (1, 2), 1)
    assert "".join(cat.json_chunks()) == json.dumps(files_by_dicts(cat), ensure_ascii=False)
    cat.drop_shards({"s0", "s3"})  # the odd ones keep their second segment, but "\x01ctl" (s3): none left
    got = json.loads("".join(cat.json_chunks()))
    assert got == files_by_dicts(cat) and sorted(got) == sorted(names[1::2][:1] + names[5::2])
    assert got["back\\slash"]["frames"] == 2 and cat.num_files() == 3 and cat.max_frames() == 2


@pytest.mark.parametrize("n", [1, 7, 5001, 12000])
def test_a_gathered_group_writes_the_bytes_one_piece_a_filename_writes(tmp_path, n):
    gathered = tdgather.gather(preds(n))
    per_file = {name: gathered[name] for name in gathered}  # `Frames` a filename: no group to take runs of
    for name, frames in (("runs", gathered), ("per_file", per_file)):
        w = DatasetWriter(tmp_path / name, max_shard_bytes=40_000)
        w.write(frames)
        assert "".join(w.catalog.json_chunks()) == json.dumps(files_by_dicts(w.catalog), ensure_ascii=False)
        w.commit({})
    a, b = shard_tensors(tmp_path / "runs"), shard_tensors(tmp_path / "per_file")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    ds = tdgather.open(tmp_path / "runs")
    name = sorted(ds)[-1]
    assert torch.equal(ds[name].frames["x"], gathered[name].frames["x"]) and len(ds) == n
