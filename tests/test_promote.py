"""Variable-length leaves found without ``ragged=``: in a batch, across batches, across ranks, after a spill."""

from __future__ import annotations

import re

import pytest
import torch

import tdgather
from tdgather import ShapeMismatchError
from tdgather.core.frames import Layout, Leaf
from tdgather.core.promote import common_layout, schema, varying
from tdgather.storage.writer import DatasetWriter
from tdgather.tools.launch import WorldError, run_local_world

from . import promote_cases as pc

RAGGED = "{boxes: float32[*, 4], feat: float32[8], scores: float32[*]}"


def _det(n: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "boxes": torch.rand(n, 4, generator=g),
        "scores": torch.rand(n, generator=g),
        "feat": torch.rand(8, generator=g),
    }


def test_only_a_first_dim_or_raggedness_may_differ():
    def lay(*leaves):
        return Layout("tree", None, tuple(Leaf(p, torch.float32, s, r) for p, s, r in leaves))

    a = lay((("boxes",), (3, 4), False), (("feat",), (8,), False))
    assert varying(a, lay((("boxes",), (5, 4), False), (("feat",), (8,), False))) == {("boxes",)}
    assert varying(a, lay((("boxes",), (4,), True), (("feat",), (8,), False))) == {("boxes",)}
    assert common_layout(a, lay((("boxes",), (0, 4), False), (("feat",), (9,), False))).describe() == (
        "{boxes: float32[*, 4], feat: float32[*]}"
    )
    for other in (
        lay((("boxes",), (3, 5), False), (("feat",), (8,), False)),  # a later dim
        lay((("boxes",), (3, 4), False)),  # a key less
        lay((("box",), (3, 4), False), (("feat",), (8,), False)),  # another key
        Layout("tree", None, (Leaf(("boxes",), torch.float64, (3, 4)), Leaf(("feat",), torch.float32, (8,)))),
    ):
        assert varying(a, other) is None and common_layout(a, other) is None
    scalar = Layout("tensor", None, (Leaf((), torch.float32, ()),))
    assert varying(scalar, Layout("tensor", None, (Leaf((), torch.float32, (2,)),))) is None  # a scalar has no rows
    crops = Layout("tree", None, (Leaf(("x",), torch.float32, (3, 4)),), batch_dims=(3,))
    plain = Layout("tree", None, (Leaf(("x",), torch.float32, (3, 4)),))  # batch [B], not [B, 3]: another type
    assert varying(crops, plain) is None and common_layout(crops, plain) is None
    assert [t.describe() for t in schema([crops, plain])] == [
        "{x: float32[3, 4]}",
        "{x: float32[3, 4]} with batch dims [3]",
    ]
    five = Layout("tree", None, (Leaf(("x",), torch.float32, (5, 4)),), batch_dims=(5,))  # crops that vary: ragged
    assert common_layout(crops, five) == Layout("tree", None, (Leaf(("x",), torch.float32, (4,), True),))


@pytest.mark.parametrize("form", ["update", "list", "model"])
def test_one_rank_whose_counts_vary_after_equal_batches_needs_no_declaration(form):
    store = tdgather.FrameStore()
    pc.give(store, pc.mine(0, 1), 1, form)
    out = tdgather.gather(store)
    for name in pc.NAMES:
        boxes = out[name].frames["boxes"]
        assert boxes.is_nested, name
        assert [t.shape[0] for t in boxes.unbind()] == [pc.count(name, i, 1) for i in range(pc.FRAMES)]


def test_a_first_dim_that_changes_at_the_second_add_of_a_filename_makes_it_ragged(tmp_path):
    store = tdgather.FrameStore()
    store.add(["v.mp4"] * 2, [0, 1], {"boxes": torch.ones(2, 7, 4), "scores": torch.ones(2, 7)})  # 7 boxes each
    store.add(["v.mp4"], [2], [{"boxes": torch.zeros(3, 4), "scores": torch.zeros(3)}])
    store.update({"v.mp4": (3, {"boxes": torch.full((0, 4), 2.0), "scores": torch.zeros(0)})})
    got = tdgather.gather(store)["v.mp4"]
    assert [t.shape[0] for t in got.frames["boxes"].unbind()] == [7, 7, 3, 0]
    ds = tdgather.open(tdgather.save(tdgather.gather(store), tmp_path / "ds"))
    assert ds.index["version"] == 8 and ds.layout("v.mp4").describe() == "{boxes: float32[*, 4], scores: float32[*]}"
    assert ds.lengths("v.mp4")["boxes"].tolist() == [7, 7, 3, 0]


def test_a_plain_tensor_whose_first_dim_changes_is_ragged_too():
    out = tdgather.gather({"tok.txt": [(0, torch.arange(3)), (1, torch.arange(5))]})  # a captioner's tokens
    assert [t.tolist() for t in out["tok.txt"].frames.unbind()] == [[0, 1, 2], [0, 1, 2, 3, 4]]


def test_ragged_false_keeps_every_leaf_fixed_and_refuses_a_change_where_it_comes():
    store = tdgather.FrameStore()
    store.add(["v"], [0], [{"boxes": torch.ones(3, 4)}], ragged=False)
    with pytest.raises(
        ShapeMismatchError,
        match=r"frames on rank 0 have \{boxes: float32\[3, 4\]\} and \{boxes: float32\[2, 4\]\}.*ragged=False",
    ):
        store.add(["v"], [1], [{"boxes": torch.ones(2, 4)}])
    with pytest.raises(ShapeMismatchError, match=r"ragged=False"):
        tdgather.gather({"v": [(0, torch.ones(3)), (1, torch.ones(2))]}, ragged=False)
    with pytest.raises(ValueError, match=r"ragged: expected None .* or False"):
        tdgather.Collector("x", ragged=True)


def test_frames_written_fixed_then_ragged_read_back_as_one_column(tmp_path):
    """A writer's later segments of a filename may differ in a first dim: the index joins them."""
    w = DatasetWriter(tmp_path / "ds")
    w.write(tdgather.gather({"v": [(i, _det(2, i)) for i in range(3)]}))  # 2 boxes each: stored fixed
    w.write(tdgather.gather({"v": [(i, _det(i % 3, i)) for i in range(3, 6)]}))  # stored ragged
    w.write(tdgather.gather({"v": [(i, _det(5, i)) for i in (6, 7)]}))  # stored fixed, 5 boxes
    w.write(tdgather.gather({"v": [(0, _det(2, 0)), (1, _det(2, 1))]}))  # copies, compared with the first shard
    ds = tdgather.open(w.commit())
    assert w.duplicates.dropped == 2
    got = ds["v"]
    assert [t.shape[0] for t in got.frames["boxes"].unbind()] == [2, 2, 2, 0, 1, 2, 5, 5]
    for i, b in enumerate(got.frames["boxes"].unbind()):
        assert torch.equal(b, _det(b.shape[0], i)["boxes"])
    boxes = [g["leaves"][0] for s in ds.index["shards"].values() for g in s["groups"].values()]
    assert sorted((b["shape"], b.get("ragged", False)) for b in boxes) == [
        ([2, 4], False),
        ([4], True),
        ([5, 4], False),
    ]
    assert ds.layout("v").describe() == RAGGED
    frames = ds.per_frame()
    assert [tuple(frames[k]["frames"]["boxes"].shape) for k in range(len(frames))][2:5] == [(2, 4), (0, 4), (1, 4)]


def test_a_copy_written_fixed_is_compared_with_a_later_ragged_one_and_a_conflict_named(tmp_path):
    w = DatasetWriter(tmp_path / "ds", duplicates="exact")
    w.write(tdgather.gather({"v": [(0, _det(2, 0)), (1, _det(2, 1))]}))
    w.write(tdgather.gather({"v": [(1, _det(2, 1)), (2, _det(3, 2))]}))  # an exact copy of frame 1: dropped
    with pytest.raises(tdgather.DuplicateFrameError, match=r"'v'.*frame_idx 0"):
        w.write(tdgather.gather({"v": [(0, _det(1, 0)), (3, _det(4, 3))]}))  # frame 0 again, with 1 box
    assert w.duplicates.dropped == 1


def test_an_old_reader_is_told_the_version_and_version_5_indexes_still_read(tmp_path):
    out = tdgather.save(tdgather.gather({"a": [(0, torch.ones(2))]}), tmp_path / "ds")
    assert tdgather.open(out).index["version"] == 8  # 6's rules, with each shard's CRC-32 and the schema
    import json

    index = json.loads((out / "tdgather.index.json").read_text())
    index.pop("schema")  # what tdgather wrote before: no schema (7, 6), one layout per filename (5): still read
    for version in (7, 5):
        index["version"] = version
        (out / "tdgather.index.json").write_text(json.dumps(index))
        ds = tdgather.open(out)
        assert ds["a"].frames.tolist() == [[1.0, 1.0]] and [t.describe() for t in ds.schema] == ["float32[2]"]


@pytest.mark.world
@pytest.mark.parametrize("form", ["update", "list", "model"])
def test_gather_finds_counts_that_vary_across_ranks(form):
    out = run_local_world(pc.case_gather, 2, form, timeout=120)[0]
    assert out["files"] == sorted(pc.NAMES) and out["types"] == [True] and out["checked"] == len(pc.NAMES)


@pytest.mark.world
@pytest.mark.parametrize("form, budget", [("model", 1 << 30), ("update", 1 << 16), ("list", 1 << 16)])
def test_collector_with_no_ragged_declaration_and_spills_before_counts_vary(tmp_path, form, budget):
    """With a 64 KiB budget and 1 KiB shards, rank dst writes shards during the loop: late.mp4 as fixed first, ragged
    later (small spills alone are gathered into one shard)."""
    shard = 1 << 10 if budget < 1 << 20 else 1 << 30
    out = run_local_world(pc.case_collector, 3, str(tmp_path / "ds"), form, budget, 4096, None, shard, timeout=180)[0]
    assert out["files"] == len(pc.NAMES) and out["version"] == 8
    if budget < 1 << 20:
        assert out["shards"] > 2
        assert "{boxes: float32[2, 4], feat: float32[8], scores: float32[2]}" not in out["stored"]  # joined


@pytest.mark.world
def test_resume_of_a_run_whose_first_attempt_wrote_the_leaf_fixed(tmp_path):
    out = run_local_world(pc.case_resume, 2, str(tmp_path / "ds"), timeout=180)[0]
    assert out["first"] == "{boxes: float32[2, 4], feat: float32[8], scores: float32[2]}"  # attempt 1: fixed
    assert out["attempts"] == 2 and out["dups"] == pc.FRAMES // 2  # late.mp4's first half, sent again


@pytest.mark.world
def test_many_writers_where_one_writer_saw_only_equal_counts(tmp_path):
    out = run_local_world(pc.case_collector, 4, str(tmp_path / "ds"), "model", 1 << 30, None, 2, timeout=180)[0]
    assert out["files"] == len(pc.NAMES) and out["version"] == 8


@pytest.mark.world
@pytest.mark.parametrize("where", ["rank", "dst"])
def test_ragged_false_refuses_a_changing_first_dim_on_the_rank_that_can_know(tmp_path, where):
    try:
        out = run_local_world(pc.case_fixed, 2, str(tmp_path / "ds"), where, timeout=120)
    except WorldError as e:
        out = e.results
    assert "ragged=False" in out[0]["msg"] and "ragged=False" in out[1]["msg"], out
    if where == "rank":  # each rank meets it in its own add, or hears first of the other's (which is first is chance)
        assert all(x["type"] in ("ShapeMismatchError", "PeerError") for x in out), out
        own = [x for x in out if x["type"] == "ShapeMismatchError"]
        assert own and all(re.search(r"frames on rank [01] have", x["msg"]) for x in own), out
    else:  # each rank saw one count: rank dst finds it, naming both ranks; rank 1 is told to fix what ranks sent
        assert out[0]["type"] == "ShapeMismatchError", out
        assert re.search(r"rank 0 sent .* but rank 1 sent", out[0]["msg"]), out
        assert out[1]["type"] == "PeerError" and "fix what they send and rerun" in out[1]["msg"], out
    failure = tdgather.open(tmp_path / "ds", incomplete=True).metadata["failure"]
    assert failure["type"] == "ShapeMismatchError" or "ShapeMismatchError" in failure["message"], failure


def test_ragged_false_refuses_a_batch_whose_frames_differ_too():
    store = tdgather.FrameStore()
    with pytest.raises(ShapeMismatchError, match=r"declared fixed \(ragged=False\), but \['boxes'\] vary"):
        store.add(["v", "v"], [0, 1], [{"boxes": torch.ones(3, 4)}, {"boxes": torch.ones(2, 4)}], ragged=False)
    assert len(store) == 0


def test_ragged_false_on_gather_checks_a_store_that_holds_frames_already():
    """A store filled without the declaration: gather(store, ragged=False) refuses what varies, losing nothing."""
    store = tdgather.FrameStore()
    store.add(["clip.mp4"] * 2, [0, 1], torch.rand(2, 3, 4))
    store.add(["clip.mp4"] * 5, [2, 3, 4, 5, 6], torch.rand(5, 2, 4))
    with pytest.raises(
        ShapeMismatchError, match=r"'clip.mp4': frames on rank 0 have float32\[3, 4\] and float32\[2, 4\]"
    ):
        tdgather.gather(store, ragged=False)
    assert [len(f) for f in tdgather.gather(store).values()] == [7]  # nothing was lost: without the declaration
    varies = tdgather.FrameStore()
    varies.add(["q.mp4"] * 2, [0, 1], [{"boxes": torch.ones(3, 4)}, {"boxes": torch.ones(2, 4)}])
    with pytest.raises(ShapeMismatchError, match=r"'q.mp4' on rank 0: every leaf is declared fixed"):
        tdgather.gather(varies, ragged=False)


def test_a_collector_takes_ragged_false_for_the_whole_run_only(tmp_path):
    with tdgather.Collector(tmp_path / "a", progress=False) as col:
        with pytest.raises(ValueError, match=r"Collector\(path, ragged=False\)"):
            col.add(["v"], [0], torch.ones(1, 3), ragged=False)
        col.add(["v"], [0], torch.ones(1, 3))
    with tdgather.Collector(tmp_path / "b", ragged=False, progress=False) as col:
        col.add(["v"], [0], torch.ones(1, 3), ragged=False)  # the same declaration: fine
    assert len(tdgather.open(tmp_path / "b")["v"]) == 1


def test_a_list_batch_of_filenames_whose_layouts_differ_is_split_by_filename():
    """Different filenames may differ (a batch of two videos of other sizes); one filename's frames may not."""
    store = tdgather.FrameStore()
    masks = [
        torch.zeros(2, 6, 5, dtype=torch.bool),
        torch.ones(1, 7, 5, dtype=torch.bool),
        torch.zeros(3, 6, 5, dtype=torch.bool),
    ]
    store.add(["a.mp4", "b.mp4", "a.mp4"], [0, 0, 1], [{"masks": m} for m in masks])
    out = tdgather.gather(store)
    assert [t.shape for t in out["a.mp4"].frames["masks"].unbind()] == [(2, 6, 5), (3, 6, 5)]
    b = out["b.mp4"].frames["masks"]  # ragged too: a leaf name has one type (its H differs from a's: fine)
    assert b.is_nested and [t.shape for t in b.unbind()] == [(1, 7, 5)]
    with pytest.raises(ShapeMismatchError, match=r"filename 'a.mp4', frame_idx 3: add\(\) frames: frame 1 of the list"):
        store.add(["a.mp4", "b.mp4", "a.mp4"], [2, 1, 3], [{"masks": m} for m in (masks[0], masks[1], masks[1])])
    with pytest.raises(ShapeMismatchError, match=r"filename 'c.mp4', frame_idx 1: add\(\) frames: frame 1"):
        store.add(["c.mp4", "c.mp4"], [0, 1], [{"masks": masks[0]}, {"masks": masks[1]}])
    assert len(store) == 3  # nothing of a refused batch was kept


def test_a_dotted_key_and_a_nested_path_are_two_leaves():
    """``{"a.b": x}`` varies, ``{"a": {"b": y}}`` is always [5, 4]: only the first is made ragged."""
    got = tdgather.gather({f"f{k}.mp4": (0, {"a.b": torch.rand(k, 4), "a": {"b": torch.rand(5, 4)}}) for k in (2, 3)})
    frames = got["f2.mp4"].frames
    assert frames["a.b"].is_nested and not frames["a", "b"].is_nested and frames["a", "b"].shape == (1, 5, 4)
