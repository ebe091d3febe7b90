"""The frame store's fast add path: blocks of small batches, deferred filename ids and layout checks."""

import os

import pytest
import torch

import tdgather
from tdgather.comm.pack import PIECE_MIN, pack
from tdgather.core.merge import merge
from tdgather.errors import ShapeMismatchError, UnsupportedValueError

from .cases import wire_roundtrip


def rows_of(store: tdgather.FrameStore, rank: int = 0) -> list[tuple[str, int, list]]:
    """Every row the store's parts hold, in their order: (filename, frame_idx, frame values)."""
    out = []
    for part in store.parts(rank):
        frames = torch.cat([c[0] for c in part.chunks])
        assert frames.shape[0] == part.num_frames == part.file_ids.numel()
        for fid, i, f in zip(part.file_ids.tolist(), part.frame_idx.tolist(), frames.tolist(), strict=True):
            out.append((part.files[fid], i, f))
    return out


def test_small_batches_share_blocks_and_keep_their_rows_in_order():
    store = tdgather.FrameStore()
    want = []
    for b in range(300):
        names = [f"v{(b * 8 + k) // 50}.mp4" for k in range(8)]
        idx = torch.arange(b * 8, b * 8 + 8) % 50
        frames = torch.randn(8, 4)
        store.add(names, idx, frames)
        want += list(zip(names, idx.tolist(), frames.tolist(), strict=True))
    assert rows_of(store) == want
    assert store.num_chunks < 10  # 300 batches, copied into a few blocks
    assert store.names == [f"v{i}.mp4" for i in range(48)]
    assert len(store) == 2400 and store.nbytes == 2400 * 16


def test_reused_output_and_index_buffers_are_copied():
    out, idx = torch.zeros(4, 3), torch.zeros(4, dtype=torch.int64)
    store = tdgather.FrameStore()
    for b in range(3):  # the first batch takes the full path, the others the fast one
        out.fill_(b)
        idx.copy_(torch.arange(4) + 10 * b)
        store.add("a", idx, out)
    got = merge(wire_roundtrip(store)[0]).files["a"]
    assert got.frame_idx.tolist() == [0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23]
    assert got.frames[:, 0].tolist() == [0.0] * 4 + [1.0] * 4 + [2.0] * 4


def test_blocks_and_batches_kept_alone_interleave_in_row_order():
    store = tdgather.FrameStore()
    # 4 frames of PIECE_MIN bytes each: kept as a chunk of its own (2 dims a frame: not the small frames'
    # leaf with another first dim, which would make the leaf ragged)
    big = torch.randn(4, 4, PIECE_MIN // 16)
    small = [torch.randn(2, 8) for _ in range(4)]
    store.add(["s"] * 2, torch.tensor([0, 1]), small[0])
    store.add(["s"] * 2, torch.tensor([2, 3]), small[1])
    store.add(["t"] * 2, torch.tensor([0, 1]), small[2].t().contiguous().t())  # not contiguous: a chunk alone
    store.add(["s"] * 2, torch.tensor([4, 5]), small[3])
    store.add(["b"] * 4, torch.arange(4), big)
    store.add(["s"] * 2, torch.tensor([6, 7]), small[0] + 1)
    want = [("s", i, r) for i, r in enumerate(torch.cat(small[:2]).tolist())]
    want += [("t", i, r) for i, r in enumerate(small[2].tolist())]
    want += [("s", 4 + i, r) for i, r in enumerate(small[3].tolist())]
    want += [("s", 6 + i, r) for i, r in enumerate((small[0] + 1).tolist())]
    by_layout = {}
    for name, i, f in rows_of(store):
        by_layout.setdefault(len(f), []).append((name, i, f))
    assert by_layout[8] == want
    assert [(n, i) for n, i, _ in by_layout[big.shape[1]]] == [("b", i) for i in range(4)]
    for _, chunks in store.groups():  # groups() agrees with parts(): every chunk's rows line up
        for c in chunks:
            assert all(t.shape[0] == c.file_ids.numel() == c.frame_idx.numel() for t in c.tensors)
    out = merge(wire_roundtrip(store)[0]).files
    assert torch.equal(out["b"].frames, big)
    assert torch.equal(out["s"].frames, torch.cat([small[0], small[1], small[3], small[0] + 1]))


def test_large_blocks_go_on_the_wire_as_they_are():
    store = tdgather.FrameStore()
    for b in range(2000):  # 2000 x 64 frames of 64 bytes: 8 MB, in blocks of up to 4 MiB
        store.add([f"f{b // 10}"] * 64, torch.arange(64) + 64 * (b % 10), torch.full((64, 16), float(b)))
    packed = pack(store)
    assert len(packed.pieces) < 10 and sum(t.nbytes for p in packed.pieces for t in p) == 2000 * 64 * 64
    out = merge(wire_roundtrip(store)[0]).files
    assert len(out) == 200 and out["f7"].frames[:, 0].unique().tolist() == list(range(70, 80))


def test_a_filename_with_two_layouts_is_refused_by_the_add_that_brings_it_and_nothing_of_it_is_kept():
    """Layouts that do not fit (a dim after the first, a dtype): a first dim that changes is fine (test_promote)."""
    store = tdgather.FrameStore()
    store.add(["x.mp4", "y.mp4"], torch.tensor([0, 0]), torch.zeros(2, 2, 3))
    store.add(["z.mp4"], torch.tensor([0]), torch.zeros(1, 2, 4))
    for batch in (torch.zeros(2, 2, 4), torch.zeros(2, 2, 3, dtype=torch.float64)):  # the fast path, a new layout
        with pytest.raises(ShapeMismatchError, match=r"filename 'y.mp4': frames on rank 0 have float32\[2, 3\] and "):
            store.add(["y.mp4", "x.mp4"], torch.tensor([1, 1]), batch)
    with pytest.raises(ShapeMismatchError, match=r"'x.mp4'.*float32\[2, 3\] and float32\[2, 4\] \(ranks \[0\]\)"):
        store.update({"w.mp4": (0, torch.zeros(2, 3)), "x.mp4": (2, torch.zeros(2, 4))})
    assert len(store) == 3 and store.names == ["x.mp4", "y.mp4", "z.mp4"]
    out = merge(store.parts(0)).files  # what was held is whole
    assert {n: f.frame_idx.tolist() for n, f in out.items()} == {"x.mp4": [0], "y.mp4": [0], "z.mp4": [0]}
    store.add(["y.mp4", "y.mp4"], torch.tensor([1, 2]), torch.ones(1, 2, 3).expand(2, 2, 3))  # still takes frames
    with pytest.raises(ShapeMismatchError, match=r"filename 'z.mp4'"):  # a new name of the batch clashes
        store.add(["w.mp4", "z.mp4"], torch.tensor([0, 2]), torch.zeros(2, 2, 3))
    store.add(["w.mp4"], torch.tensor([0]), torch.zeros(1, 2, 3))  # w.mp4 was not claimed by the refused batch
    assert {n: f.frame_idx.tolist() for n, f in merge(store.parts(0)).files.items()} == {
        "w.mp4": [0],
        "x.mp4": [0],
        "y.mp4": [0, 1, 2],
        "z.mp4": [0],
    }


def test_update_checks_filenames_against_added_frames_and_adds_nothing_on_error():
    store = tdgather.FrameStore()
    store.add(["a"] * 2, torch.tensor([0, 1]), torch.zeros(2, 3))
    store.add(["a"] * 2, torch.tensor([2, 3]), torch.zeros(2, 3))
    with pytest.raises(ShapeMismatchError, match=r"filename 'a': .*float32\[3\] and int64\[3\]"):
        store.update({"b": (0, torch.zeros(3)), "a": (4, torch.zeros(3, dtype=torch.long))})
    with pytest.raises(ShapeMismatchError, match=r"filename 'c': .*float32\[2\] and float32\[1, 2\]"):
        store.update({"c": [(0, torch.zeros(2)), (1, torch.zeros(1, 2))]})
    assert len(store) == 4
    store.update({"a": (4, torch.ones(3)), "c": (0, torch.ones(1))})
    out = merge(store.parts(0)).files
    assert out["a"].frame_idx.tolist() == [0, 1, 2, 3, 4] and list(out) == ["a", "c"]


def test_bad_filenames_are_refused_on_the_fast_path_too():
    store = tdgather.FrameStore()
    store.add(["ok"], torch.tensor([0]), torch.zeros(1, 2))  # the layout is now cached
    with pytest.raises(UnsupportedValueError, match=r"cannot be encoded as UTF-8 .*os.fsdecode"):
        store.add(["ok", os.fsdecode(b"clip_\xff.mp4")], torch.tensor([1, 2]), torch.zeros(2, 2))
    with pytest.raises(UnsupportedValueError, match=r"expected str filenames, got bytes"):
        store.add([b"clip.mp4"], torch.tensor([1]), torch.zeros(1, 2))
    with pytest.raises(ValueError, match=r"got 2 filenames and 1 frame indices"):
        store.add(["a", "b"], torch.tensor([1]), torch.zeros(1, 2))
    with pytest.raises(ValueError, match="leading batch dimension of 2"):
        store.add(["a", "b"], torch.tensor([1, 2]), torch.zeros(1, 2))
    assert len(store) == 1 and store.names == ["ok"]


def test_fast_path_resolves_views_and_odd_indexes():
    c = torch.randn(6, 3, dtype=torch.complex64)
    store = tdgather.FrameStore()
    store.add(["c"] * 2, torch.tensor([0, 1]), c[:2].clone())  # caches the layouts
    store.add(["n"] * 2, torch.tensor([0, 1]), c[:2].real.clone())
    store.add(["c"] * 2, torch.tensor([[2, 0], [3, 0]])[:, 0], c[2:4].conj())  # indexes not contiguous
    store.add(["n"] * 2, torch.tensor([2, 3], dtype=torch.int32), torch.conj(c[2:4]).imag)  # a negative view
    store.add(["c"], torch.tensor([4]), c[4:5])  # a view, contiguous
    got = merge(wire_roundtrip(store)[0]).files
    assert got["c"].frame_idx.tolist() == [0, 1, 2, 3, 4] and got["n"].frame_idx.tolist() == [0, 1, 2, 3]
    assert torch.equal(got["c"].frames, torch.cat([c[:2], c[2:4].conj().resolve_conj(), c[4:5]]))
    assert torch.equal(got["n"].frames, torch.cat([c[:2].real, -c[2:4].imag]))


def test_json_only_and_tree_layouts_still_work_with_many_batches():
    store = tdgather.FrameStore()
    for b in range(5):
        store.add(["j"] * 2, [2 * b, 2 * b + 1], {"label": ["x", f"y{b}"]})
        store.add(["t"] * 2, [2 * b, 2 * b + 1], {"m": torch.full((2, 2), b), "s": torch.tensor([b, b])})
    groups = dict(store.groups())
    assert sum(len(c.json[0]) for c in next(iter(groups.values()))) == 10
    out = merge(wire_roundtrip(store)[0]).files
    assert out["j"].frames["label"][:3] == ["x", "y0", "x"]
    assert out["t"].frames["s"].tolist() == [b for b in range(5) for _ in range(2)]


def test_copy_false_keeps_references_and_parts_can_be_taken_twice():
    store = tdgather.FrameStore(copy=False)
    batches = [torch.randn(3, 2) for _ in range(3)]
    for b, t in enumerate(batches):
        store.add(["r"] * 3, torch.arange(3) + 3 * b, t)
    first = store.parts(0)
    assert [c[0].data_ptr() for c in first[0].chunks] == [t.data_ptr() for t in batches]
    store.add(["r"] * 3, torch.arange(9, 12), torch.zeros(3, 2))
    second = store.parts(0)
    assert first[0].num_frames == 9 and second[0].num_frames == 12  # the first parts are unchanged
    assert torch.equal(merge(second).files["r"].frames, torch.cat([*batches, torch.zeros(3, 2)]))


def test_a_tuple_of_outputs_is_refused_not_taken_for_frames():
    """(y, z) from a model with two heads, with B == 2, must not become two 'frames' of [2, ...] each."""
    store = tdgather.FrameStore()
    with pytest.raises(UnsupportedValueError, match=r"got a tuple of 2.*return a dict that names them"):
        store.add(["a", "b"], [0, 0], (torch.zeros(2, 3), torch.ones(2, 3)))
    assert len(store) == 0
    store.add(["a", "b"], [0, 0], {"y": torch.zeros(2, 3), "z": torch.ones(2, 3)})
    assert len(store) == 2
