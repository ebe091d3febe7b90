"""Many small filenames on rank dst: the columnar catalog, re-sent frames on resume, conflicts named per frame."""

import json

import pytest
import torch

import tdgather
from tdgather.format.names import INDEX_NAME
from tdgather.storage.writer import DatasetWriter
from tdgather.tools.launch import run_local_world

from . import cases


def _frames(names: list[str], idx: list[int], fill: float = 0.0) -> dict:
    return {
        n: tdgather.Frames(frame_idx=torch.tensor([i]), frames=torch.full((1, 4), fill + i), batch_size=[1])
        for n, i in zip(names, idx, strict=True)
    }


def test_the_index_lists_every_segment_of_many_filenames_written_over_several_calls(tmp_path):
    w = DatasetWriter(tmp_path / "ds", max_shard_bytes=4096)
    names = [f"img_{i:05d}.jpg" for i in range(3000)]
    w.write(_frames(names, [0] * 3000))
    w.write(_frames(names[::2], [1] * 1500))  # every other filename gets a second frame, in later shards
    w.write({"ragged.mp4": tdgather.Frames(frame_idx=torch.tensor([0, 2]), frames=torch.ones(2, 4), batch_size=[2])})
    w.commit()
    index = json.loads((tmp_path / "ds" / INDEX_NAME).read_text())
    files = index["files"]
    assert list(files) == sorted(files) and len(files) == index["metadata"]["num_filenames"] == 3001
    assert files["img_00000.jpg"]["frames"] == 2 and len(files["img_00000.jpg"]["segments"]) == 2
    assert files["img_00001.jpg"]["frames"] == 1 and len(files["img_00001.jpg"]["segments"]) == 1
    assert len(index["shards"]) > 3
    ds = tdgather.open(tmp_path / "ds")
    assert ds["img_00002.jpg"].frame_idx.tolist() == [0, 1]
    assert torch.equal(ds["img_00002.jpg"].frames, torch.tensor([[0.0] * 4, [1.0] * 4]))
    assert ds["ragged.mp4"].frame_idx.tolist() == [0, 2]


def _failed_run(path, names: list[str]) -> None:
    w = DatasetWriter(path, max_shard_bytes=2048)
    for i in range(0, len(names), 500):
        w.write(_frames(names[i : i + 500], [0] * len(names[i : i + 500])))
    w.abort(RuntimeError("planned"))


def test_a_resumed_run_drops_every_resent_frame_and_keeps_the_new_ones(tmp_path):
    names = [f"img_{i:05d}.jpg" for i in range(2000)]
    _failed_run(tmp_path / "ds", names)
    w = DatasetWriter(tmp_path / "ds", resume=True, max_shard_bytes=2048)
    w.write({**_frames(names, [0] * 2000), **_frames(["new.jpg"], [5])})
    w.commit()
    assert w.duplicates.dropped == w.duplicates.exact == 2000
    ds = tdgather.open(tmp_path / "ds")
    assert len(ds) == 2001 and ds.metadata["total_frames"] == 2001 and ds["new.jpg"].frame_idx.tolist() == [5]


def test_a_resent_frame_that_differs_names_the_earlier_attempt(tmp_path):
    names = [f"img_{i:05d}.jpg" for i in range(1200)]
    _failed_run(tmp_path / "ds", names)
    w = DatasetWriter(tmp_path / "ds", resume=True, duplicates="exact")
    again = _frames(names, [0] * 1200)
    again["img_00700.jpg"] = _frames(["img_00700.jpg"], [0], fill=0.5)["img_00700.jpg"]
    with pytest.raises(
        tdgather.DuplicateFrameError,
        match=r"'img_00700.jpg', frame_idx 0: an earlier attempt of this run and later rank 1 sent values that "
        r"differ \(the first copy was written to shard-\d+.safetensors",
    ):
        w.write(again, {n: {1} for n in again})
    w.abort()


@pytest.mark.world
def test_a_conflict_across_spills_names_the_rank_of_each_copy(tmp_path):
    out = run_local_world(cases.case_conflict_across_spills, 3, str(tmp_path / "ds"), timeout=120)
    assert out[0]["type"] == "DuplicateFrameError", out[0]
    assert "'x.jpg', frame_idx 0: rank 2 and later rank 1 sent values that differ" in out[0]["message"]


@pytest.mark.world
def test_a_gather_conflict_names_the_rank_of_each_copy():
    out = run_local_world(cases.case_gather_conflict_names_each_copy, 3, timeout=120)
    assert "'x.jpg', frame_idx 0: ranks 0 and 2 sent values that differ" in out[0]["message"], out


def test_a_filename_written_in_three_calls_lists_its_segments_in_the_order_written(tmp_path):
    w = DatasetWriter(tmp_path / "ds")
    for i in (3, 1, 2):
        w.write(_frames(["a.jpg", f"other_{i}.jpg"], [i, 0]))
    w.commit()
    segments = json.loads((tmp_path / "ds" / INDEX_NAME).read_text())["files"]["a.jpg"]["segments"]
    assert [s["shard"] for s in segments] == sorted(s["shard"] for s in segments) and len(segments) == 3
    assert tdgather.open(tmp_path / "ds")["a.jpg"].frame_idx.tolist() == [1, 2, 3]
