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
from tdgather.core.flatten import flatten
from tdgather.core.merge import Merged
from tdgather.core.plan import Group
from tdgather.format.limits import SHARD_HEADER_MAX, segment_record_bytes
from tdgather.storage.catalog import Catalog
from tdgather.storage.shards import Item, Slice, fill, whole_files
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


def item(name: str, idx: list[int], rank) -> Item:
    """An item of ``name``'s frames ``idx`` (float32 ``[2]`` each), all from ``rank`` (or one rank per row)."""
    layout = tdgather.gather({"a": [(0, torch.zeros(2))]}).groups[0].layout
    runs = (idx[0], idx[-1]) if idx == list(range(idx[0], idx[-1] + 1)) else None
    return Item.of(name, layout, torch.tensor(idx), [torch.zeros(len(idx), 2)], [], runs, rank)


def recorded_both_ways(shards: list[list[Item]]) -> tuple[Catalog, Catalog]:
    """``shards`` recorded by `Catalog.add_shard`, and one `Catalog.add` an item."""
    by_pass, by_add = Catalog(), Catalog()
    for k, shard in enumerate(shards):
        segments = [("g0", row, it.n) for row, it in enumerate(shard)]
        by_pass.add_shard(f"s{k}", shard, segments)
        for it, (group, start, frames) in zip(shard, segments, strict=True):
            seg = {"shard": f"s{k}", "group": group, "start": start, "frames": frames}
            by_add.add(it.name, it.layout, seg, it.idx, it.runs, it.rank)
    assert "".join(by_pass.json_chunks()) == "".join(by_add.json_chunks())
    for name in by_add.ids:
        assert torch.equal(by_pass.written(name), by_add.written(name)) and by_pass.ranks(name) == by_add.ranks(name)
    return by_pass, by_add


def test_a_shard_recorded_in_one_pass_is_what_one_add_an_item_records():
    first = [item("old.mp4", [0], 0), item("other.mp4", [0, 1], 1)]
    second = [  # new names (one run, one sender), a name held, a name twice, gaps, rows from several ranks
        item("a.mp4", [0], 0),
        item("old.mp4", [1, 2], 1),
        item("b.mp4", [0, 1, 2], 1),
        item("b.mp4", [5], 0),
        item("c.mp4", [0, 2], 0),
        item("d.mp4", [0, 1], torch.tensor([0, 1], dtype=torch.int32)),
        item("e.mp4", [3], 2),
    ]
    by_pass, _ = recorded_both_ways([first, second])
    assert by_pass.files()["b.mp4"]["frames"] == 4 and by_pass.ranks("d.mp4") == [0, 1]
    assert by_pass.num_files() == 7 and by_pass.max_frames() == 4


@pytest.mark.parametrize(
    "shards",
    [
        [[("a", [0]), ("b", [0])], [("c", [0]), ("a", [1])]],  # a name held by an earlier shard
        [[("a", [0]), ("b", [0]), ("b", [1, 2])]],  # a name twice in one shard
        [[("a", [0])], [("b", [0, 1])], [("b", [2])]],  # a name again, in a shard of its own
    ],
)
def test_shards_of_whole_runs_from_one_rank_each_record_every_segment(shards):
    """Shards where every item is one run from one sender, but a name is not new: no segment is lost."""
    by_pass, _ = recorded_both_ways([[item(name, idx, 0) for name, idx in shard] for shard in shards])
    frames = {name: sum(len(idx) for s in shards for n, idx in s if n == name) for s in shards for name, _ in s}
    assert {name: e["frames"] for name, e in by_pass.files().items()} == frames


def test_what_earlier_attempts_saved_loads_as_listed():
    fixed = tdgather.gather({"a": [(0, torch.zeros(2))]}).groups[0].layout
    other = tdgather.gather({"a": [(0, torch.zeros(3))]}).groups[0].layout

    def seg(shard: str, start: int, frames: int, group: str = "g0") -> dict:
        return {"shard": shard, "group": group, "start": start, "frames": frames}

    files = {  # one segment and one run (taken by columns); no runs recorded; several runs; several segments
        "a.mp4": {"segments": [seg("s0", 0, 2)]},
        "b.mp4": {"segments": [seg("s1", 4, 1, "g1")]},
        "c.mp4": {"segments": [seg("s0", 2, 3)]},
        "d.mp4": {"segments": [seg("s0", 5, 1), seg("s1", 0, 2)]},
        "held.mp4": {"segments": [seg("s2", 0, 1)]},
    }
    layouts = {"a.mp4": fixed, "b.mp4": other, "c.mp4": fixed, "d.mp4": fixed, "held.mp4": fixed}
    written = {
        "a.mp4": torch.tensor([[0, 1]]),
        "c.mp4": torch.tensor([[0, 0], [4, 5]]),
        "d.mp4": torch.tensor([[0, 2]]),
        "held.mp4": torch.tensor([[7, 7]]),
    }
    cat = Catalog()
    cat.add("held.mp4", fixed, seg("s9", 0, 1), torch.tensor([3]), (3, 3), 0)  # already in this catalog
    cat.load(files, layouts, written)
    want = {
        name: {"frames": sum(s["frames"] for s in e["segments"]), "segments": e["segments"]}
        for name, e in files.items()
    }
    want["held.mp4"] = {"frames": 2, "segments": [seg("s9", 0, 1), seg("s2", 0, 1)]}
    assert "".join(cat.json_chunks()) == json.dumps(dict(sorted(want.items())), ensure_ascii=False)
    assert cat.written("a.mp4").tolist() == [[0, 1]] and cat.written("c.mp4").tolist() == [[0, 0], [4, 5]]
    assert cat.written("b.mp4").tolist() == [[0, -1]]  # no runs recorded
    assert cat.layout("b.mp4") == other and cat.layout("a.mp4") == fixed and cat.ranks("a.mp4") == []
    assert cat.ranks("held.mp4") == [0] and cat.num_files() == 5 and cat.max_frames() == 3


def _items(names: list[str], frames: int = 2) -> list[Item]:
    layout = flatten(torch.zeros(frames, 3), frames, "x")[0]
    idx = torch.arange(frames)
    return [Item.of(name, layout, idx, [torch.zeros(frames, 3)], [], None, 0) for name in names]


@pytest.mark.parametrize(
    "names,max_bytes,count",
    [
        ([f"v{i:04d}.mp4" for i in range(50)], 1 << 30, 1),  # everything fits: one shard
        ([f"v{i:04d}.mp4" for i in range(50)], 100, 25),  # cut by bytes: 40 an item (24 of frames, 16 of frame_idx)
        ([f'v"{i}".mp4' for i in range(50)], 300, 8),  # names JSON escapes; 7 items a shard
        ([f"{i:03d}" + "x" * 200_000 for i in range(400)], 1 << 30, 2),  # records of 200,051 bytes: 335 in 64 MiB
    ],
)
def test_shards_are_cut_where_the_next_item_would_pass_a_limit(names, max_bytes, count):
    items = _items(names)
    shards = fill(items, max_bytes)
    assert [item for shard in shards for item in shard] == items  # in order, each once
    for k, shard in enumerate(shards):
        size = sum(item.nbytes + 8 * item.n for item in shard)
        header = sum(segment_record_bytes(item.name) for item in shard)
        assert len(shard) == 1 or (size <= max_bytes and header <= SHARD_HEADER_MAX)
        if k + 1 < len(shards):  # the next shard's first item would not have fit in this one
            nxt = shards[k + 1][0]
            over_bytes = size + nxt.nbytes + 8 * nxt.n > max_bytes
            assert over_bytes or header + segment_record_bytes(nxt.name) > SHARD_HEADER_MAX
    assert len(shards) == count


def whole_file_outputs(case: str) -> dict[str, list]:
    """Fixed-size frames, each filename one run of frame_idx: one image a filename, or videos from odd starts."""
    if case == "videos":
        return {
            f"v{i:03d}.mp4": [(s, torch.full((3,), float(i * 100 + s))) for s in range(i % 5, i % 5 + 1 + i % 29)]
            for i in range(40)
        }
    return {  # a dict output: two fixed leaves of two dtypes
        f'img_{i:05d}"é.jpg': [(0, {"x": torch.full((4,), float(i)), "k": torch.tensor([i, -i])})] for i in range(3000)
    }


def shard_records(path) -> list[tuple[str, str]]:
    """Each shard's ``groups`` and ``segments`` metadata, in shard order."""
    out = []
    for shard in sorted(tdgather.open(path).index["shards"]):
        with safe_open(str(path / shard), "pt") as f:
            meta = f.metadata()
        out.append((meta["groups"], meta["segments"]))
    return out


@pytest.mark.parametrize(
    "case,max_bytes", [("images", 1 << 30), ("images", 4000), ("videos", 1 << 30), ("videos", 300)]
)
def test_whole_files_write_the_shards_items_write(tmp_path, case, max_bytes):
    """The usual write, cut and laid out in columns (`whole_files`), is what one item a filename writes."""
    gathered = tdgather.gather(whole_file_outputs(case))
    slices = whole_files(gathered, {}, set(), max_bytes)
    assert slices is not None and all(isinstance(s, Slice) for s in slices)  # the columnar path is taken
    assert (len(slices) > 1) == (max_bytes < 1 << 30)
    per_file = {name: gathered[name] for name in gathered}  # `Frames` a filename: items
    catalogs = {}
    for name, frames in (("columns", gathered), ("items", per_file)):
        w = DatasetWriter(tmp_path / name, max_shard_bytes=max_bytes)
        w.write(frames)
        catalogs[name] = w.catalog
        w.commit({})
    a, b = shard_tensors(tmp_path / "columns"), shard_tensors(tmp_path / "items")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert shard_records(tmp_path / "columns") == shard_records(tmp_path / "items")
    cols, items = catalogs["columns"], catalogs["items"]
    assert "".join(cols.json_chunks()) == "".join(items.json_chunks())
    for name in gathered:  # the frames written, as later writes compare against them
        assert torch.equal(cols.written(name), items.written(name)) and cols.layout(name) == items.layout(name)
    ds = tdgather.open(tmp_path / "columns")
    assert len(ds) == len(gathered) and ds.index["metadata"]["total_frames"] == sum(
        g.num_frames for g in gathered.groups
    )
    name = sorted(gathered)[-1]
    assert torch.equal(ds[name].frame_idx, gathered[name].frame_idx)


def test_only_the_usual_write_is_taken_in_columns(tmp_path):
    videos = whole_file_outputs("videos")
    gathered = tdgather.gather(videos)
    assert whole_files(gathered, {}, {"v007.mp4"}, 1 << 30) is None  # a filename written before
    assert whole_files(gathered, {"v007.mp4": {0}}, set(), 1 << 30) is None  # ranks given
    gaps = tdgather.gather({"a.mp4": [(0, torch.zeros(3)), (2, torch.zeros(3))], "b.mp4": [(0, torch.zeros(3))]})
    assert whole_files(gaps, {}, set(), 1 << 30) is None  # frames 0 and 2: not one run
    ragged = tdgather.gather({"a.mp4": [(0, torch.zeros(3))], "b.mp4": [(0, torch.zeros(5))]})
    assert ragged.groups[0].layout.ragged and whole_files(ragged, {}, set(), 1 << 30) is None
    two = tdgather.gather({"a.mp4": [(0, torch.zeros(3))], "b.mp4": [(0, {"x": torch.zeros(3)})]})
    assert len(two.groups) == 2 and whole_files(two, {}, set(), 1 << 30) is None  # two layouts
    labels = tdgather.gather({"a.mp4": [(0, {"x": torch.zeros(3), "label": "cat"})]})
    assert whole_files(labels, {}, set(), 1 << 30) is None  # a JSON leaf
    g = gathered.groups[0]
    rows = torch.zeros(g.num_frames, dtype=torch.int32)
    rows[g.starts[3] + 1] = 1  # one frame of the fourth video from another rank
    spread = Group(g.layout, g.files, g.counts, g.frame_idx, g.leaves, g.json, rows)
    assert whole_files(Merged([spread]), {}, set(), 1 << 30) is None
    one = Group(g.layout, g.files, g.counts, g.frame_idx, g.leaves, g.json, torch.zeros_like(rows))
    assert [s.ranks for s in whole_files(Merged([one]), {}, set(), 1 << 30)] == [[0] * len(g.files)]
    w = DatasetWriter(tmp_path / "ds")
    w.write(gathered)
    w.write(tdgather.gather(videos))  # every frame again: by items, each copy compared and dropped
    frames = sum(len(v) for v in videos.values())
    assert w.duplicates.exact == w.duplicates.dropped == frames and w.frames == frames
    w.commit({})
    assert tdgather.open(tmp_path / "ds").index["metadata"]["total_frames"] == frames
