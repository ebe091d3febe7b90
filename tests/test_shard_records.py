"""A shard's record read back column by column (`read_record`), and several writers' shards combined by it.

The coordinator of several writers reads their shards' records, not their word: a record edited by
hand is refused, naming its segment, and shards that hold copies of one another's filenames (or a
record of another run) go through the general path, which resolves or refuses them.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import tdgather
from tdgather import Frames
from tdgather.errors import DatasetError
from tdgather.storage.shardrecord import read_record
from tdgather.storage.store import LocalStore
from tdgather.storage.writer import DatasetWriter


def one_frame_each(names: list[str], value: float) -> dict[str, Frames]:
    return {n: Frames(torch.tensor([0]), torch.full((1, 3), value + k)) for k, n in enumerate(names)}


def two_writers(path):
    first = DatasetWriter(path, writer=0)
    second = DatasetWriter(path, writer=1, joins=(first.run, first.attempt))
    return first, second


def combined(first: DatasetWriter, second: DatasetWriter) -> tdgather.DuplicateCounts:
    report = second.report()
    second.commit()
    dups = first.combine({1: report})
    first.commit()
    return dups


def test_writers_of_distinct_filenames_combine_into_one_dataset(tmp_path):
    first, second = two_writers(tmp_path / "ds")
    first.write(one_frame_each(["a.jpg", "c.jpg"], 0))
    second.write(one_frame_each(["b.jpg", "d.jpg"], 10))
    second.write(one_frame_each(["e.jpg"], 20))
    assert combined(first, second).dropped == 0
    ds = tdgather.open(tmp_path / "ds")
    assert sorted(ds) == ["a.jpg", "b.jpg", "c.jpg", "d.jpg", "e.jpg"]
    assert [ds[n].frames[0, 0].item() for n in sorted(ds)] == [0, 10, 1, 11, 20]
    assert ds.verify() == 3  # every shard's content checked against the index's checksums


def test_a_filename_in_both_writers_is_resolved_as_a_copy(tmp_path):
    first, second = two_writers(tmp_path / "ds")
    mine = one_frame_each(["a.jpg", "b.jpg"], 0)
    first.write(mine)
    second.write({"b.jpg": mine["b.jpg"], **one_frame_each(["c.jpg"], 5)})  # b: the same frame again
    dups = combined(first, second)
    ds = tdgather.open(tmp_path / "ds")
    assert dups.dropped == 1 and sorted(ds) == ["a.jpg", "b.jpg", "c.jpg"]
    assert ds.num_frames("b.jpg") == 1 and ds["b.jpg"].frames[0, 0].item() == 1


def test_a_filename_in_two_shards_of_one_writer_keeps_both_segments(tmp_path):
    first, second = two_writers(tmp_path / "ds")
    first.write(one_frame_each(["a.jpg"], 0))
    second.write({"v.mp4": Frames(torch.tensor([0, 1]), torch.zeros(2, 3))})
    second.write({"v.mp4": Frames(torch.tensor([2]), torch.ones(1, 3))})
    combined(first, second)
    ds = tdgather.open(tmp_path / "ds")
    assert ds["v.mp4"].frame_idx.tolist() == [0, 1, 2] and ds["v.mp4"].frames[:, 0].tolist() == [0, 0, 1]


def test_a_writer_of_another_run_is_refused(tmp_path):
    first = DatasetWriter(tmp_path / "ds", writer=0)
    other = DatasetWriter(tmp_path / "ds", writer=1, joins=("another-run", 1))
    first.write(one_frame_each(["a.jpg"], 0))
    other.write(one_frame_each(["b.jpg"], 0))
    report = other.report()
    other.commit()
    with pytest.raises(DatasetError, match="one run"):
        first.combine({1: report})


def rewrite_record(path, edit) -> None:
    """The shard at ``path`` written again with its segments record changed by ``edit`` (by hand, as it were)."""
    with safe_open(str(path), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    segments = json.loads(meta["segments"])
    edit(segments)
    save_file(tensors, str(path), {**meta, "segments": json.dumps(segments)})


def set_item(i: int, k: int, value):
    def edit(segments):
        segments[i][k] = value

    return edit


@pytest.mark.parametrize(
    "edit, field",
    [
        (set_item(1, 3, True), r"segments\[1\]\[3\]"),  # a bool is not a frame count
        (set_item(1, 2, 1.0), r"segments\[1\]\[2\]"),  # nor a float a row
        (set_item(0, 0, 7), r"segments\[0\]\[0\]"),  # a filename that is not a string
        (set_item(1, 1, "g9"), r"segments\[1\]"),  # a group the shard does not hold
        (set_item(1, 2, 2), r"segments\[1\]"),  # rows skipped
        (set_item(2, 3, 0), r"segments\b"),  # rows no segment covers
        (lambda s: s[1].pop(), r"segments\[1\]"),  # three items
        (lambda s: s.append(["z.jpg", "g0", 4, 0]), r"segments\[3\]"),  # past the rows
        (lambda s: s.insert(1, ["ghost.jpg", "g0", 1, 0]), r"segments\[1\]\[3\].*at least 1 frame"),  # empty
        (set_item(2, 0, "b.jpg"), r"segments\[2\].*segments\[1\] holds 'b.jpg'"),  # a filename twice in g0
    ],
)
def test_a_record_edited_by_hand_is_refused_naming_its_segment(tmp_path, edit, field):
    w = DatasetWriter(tmp_path / "ds")
    w.write(one_frame_each(["a.jpg", "b.jpg", "c.jpg"], 0))
    w.commit()
    store = LocalStore(tmp_path / "ds")
    (name,) = w.shards
    assert read_record(store, name).filenames == ["a.jpg", "b.jpg", "c.jpg"]
    rewrite_record(tmp_path / "ds" / name, edit)
    with pytest.raises(DatasetError, match=field):
        read_record(store, name)


def test_a_record_that_leaves_out_a_group_is_refused(tmp_path):
    w = DatasetWriter(tmp_path / "ds")
    w.write(one_frame_each(["a.jpg", "b.jpg"], 0) | {"c.jpg": Frames(torch.tensor([0]), torch.zeros(1, 4))})
    w.commit()
    (name,) = w.shards
    rewrite_record(tmp_path / "ds" / name, lambda s: s.__setitem__(slice(None), [x for x in s if x[1] == "g0"]))
    with pytest.raises(DatasetError, match="segments that cover every row"):
        read_record(LocalStore(tmp_path / "ds"), name)


@pytest.mark.parametrize("attempt", ["01", "\u0661", "0", "-1", "1.0", ""])
def test_an_attempt_not_written_as_tdgather_writes_one_is_refused(tmp_path, attempt):
    w = DatasetWriter(tmp_path / "ds")
    w.write(one_frame_each(["a.jpg"], 0))
    w.commit()
    (name,) = w.shards
    path = tmp_path / "ds" / name
    with safe_open(str(path), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(path), {**meta, "attempt": attempt})
    with pytest.raises(DatasetError, match="__metadata__.attempt"):
        read_record(LocalStore(tmp_path / "ds"), name)
