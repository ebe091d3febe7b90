"""Merge across ranks, pure: parts built by packing one store per simulated rank and reading it back."""

import re

import pytest
import torch

import tdgather
from tdgather.core.duplicates import DuplicateCounts, DuplicatePolicy
from tdgather.core.merge import as_parts, merge
from tdgather.errors import DuplicateFrameError, ShapeMismatchError

from .cases import value, wire_roundtrip


def parts_of(*per_rank: dict):
    parts, packed = [], []
    for rank, preds in enumerate(per_rank):
        store = tdgather.FrameStore()
        store.update(preds)
        if not len(store):
            continue
        got, p = wire_roundtrip(store, rank)
        parts += got
        packed.append(p)
    return parts, packed


def frames(name, idxs, shape=(4,)):
    return [(i, value(name, i, shape)) for i in idxs]


def test_files_whole_or_split_over_ranks_are_merged_into_one_buffer_per_layout():
    # rank 0 ends with "m.mp4", rank 1 starts with it: adjacent in the concatenation, still split
    parts, _ = parts_of(
        {"a.mp4": frames("a.mp4", [2, 0, 1]), "m.mp4": frames("m.mp4", [0, 2])},
        {"m.mp4": frames("m.mp4", [1, 3]), "z.mp4": frames("z.mp4", [5])},
    )
    merged = merge(parts)
    out = merged.files
    assert merged.duplicates.dropped == 0 and list(out) == ["a.mp4", "m.mp4", "z.mp4"]
    assert merged.ranks == {"a.mp4": {0}, "m.mp4": {0, 1}, "z.mp4": {1}}
    assert out["m.mp4"].frame_idx.tolist() == [0, 1, 2, 3]
    for name, f in out.items():
        want = torch.stack([value(name, int(i), (4,)) for i in f.frame_idx])
        assert torch.equal(f.frames, want)
    (group,) = merged.groups  # one layout: one columnar buffer, files in order
    assert group.files == ["a.mp4", "m.mp4", "z.mp4"] and group.counts == [3, 4, 1]
    assert {f.frames.untyped_storage().data_ptr() for f in out.values()} == {
        group.leaves[0].untyped_storage().data_ptr()
    }


def test_identical_duplicates_within_and_across_ranks_are_dropped_and_counted_exact():
    a = frames("a", [0, 1, 2])
    parts, _ = parts_of({"a": a + [a[1]]}, {"a": [a[2], a[0]]})
    merged = merge(parts)
    assert merged.duplicates == DuplicateCounts(exact=3, inexact=0, max_abs_diff=0.0)
    assert merged.files["a"].frame_idx.tolist() == [0, 1, 2]
    assert torch.equal(merged.files["a"].frames, torch.stack([v for _, v in a]))


def test_keep_keeps_the_lowest_ranks_copy_and_measures_the_difference():
    a = frames("a", [0, 1, 2])
    nudged = a[1][1] + 1e-3
    for order in ([0, 1, 2], [2, 1, 0]):  # the rank order of the parts decides, not their position in a list
        per_rank = [{"a": a}, {"b": a}, {"a": [(1, nudged)]}]
        parts, _ = parts_of(*per_rank)
        parts = sorted(parts, key=lambda p: order.index(p.rank))
        merged = merge(sorted(parts, key=lambda p: p.rank))
        assert torch.equal(merged.files["a"].frames[1], a[1][1])  # rank 0's copy
        assert merged.duplicates.exact == 0 and merged.duplicates.inexact == 1
        assert merged.duplicates.max_abs_diff == pytest.approx(1e-3, rel=1e-3)


def test_exact_and_close_policies_refuse_naming_file_frame_ranks_and_difference():
    a = frames("a", [0, 1, 2])
    parts, _ = parts_of({"a": a}, {"b": a}, {"a": [(1, a[1][1] + 1)]})
    with pytest.raises(
        DuplicateFrameError,
        match=r"filename 'a', frame_idx 1: ranks 0 and 2 sent values that differ "
        r"\(largest absolute difference 1\), and the duplicates policy is 'exact'",
    ):
        merge(parts, "exact")
    with pytest.raises(DuplicateFrameError, match=r"policy is close \(rtol=1e-05, atol=0.5\)"):
        merge(parts, DuplicatePolicy("close", atol=0.5))
    assert merge(parts, DuplicatePolicy("close", atol=2.0)).duplicates.inexact == 1
    parts, _ = parts_of({"a": a + [(0, a[0][1] * 2)]})
    with pytest.raises(DuplicateFrameError, match=r"frame_idx 0: rank 0, in two copies, sent"):
        merge(parts, "exact")


def test_three_copies_are_each_compared_with_the_kept_one():
    a = frames("a", [0])
    parts, _ = parts_of({"a": a}, {"a": [(0, a[0][1] + 0.25)]}, {"a": [(0, a[0][1] + 0.5)]})
    merged = merge(parts, DuplicatePolicy("close", atol=0.6))
    assert merged.duplicates.inexact == 2 and merged.duplicates.max_abs_diff == pytest.approx(0.5)
    with pytest.raises(DuplicateFrameError, match="ranks 0 and 2"):
        merge(parts, DuplicatePolicy("close", atol=0.3))


def test_nan_duplicates_compare_by_bits():
    nan = torch.tensor([float("nan"), 1.0])
    parts, _ = parts_of({"n": [(0, nan)]}, {"n": [(0, nan.clone())]})
    assert merge(parts, "exact").duplicates.exact == 1
    parts, _ = parts_of({"n": [(0, torch.tensor([0.0]))]}, {"n": [(0, torch.tensor([-0.0]))]})
    with pytest.raises(DuplicateFrameError):
        merge(parts, "exact")
    assert merge(parts).duplicates == DuplicateCounts(0, 1, 0.0)  # -0.0 == 0.0 in value, not in bits
    parts, _ = parts_of({"n": [(0, torch.tensor([float("nan")]))]}, {"n": [(0, torch.tensor([1.0]))]})
    assert merge(parts).duplicates.max_abs_diff == float("inf")


@pytest.mark.parametrize(
    "dtype", [torch.bool, torch.uint8, torch.int64, torch.uint64, torch.float8_e4m3fn, torch.bfloat16, torch.complex64]
)
def test_difference_is_measured_for_every_kind_of_dtype(dtype):
    x = value("d", 0, (3,), dtype)
    y = x.clone()
    if dtype == torch.bool:
        y[0] = ~y[0]
    else:
        y.view(torch.uint8)[0] ^= 1  # the lowest bit of the first element
    parts, _ = parts_of({"d": [(0, x)]}, {"d": [(0, y)]})
    d = merge(parts).duplicates
    assert d.inexact == 1 and d.max_abs_diff > 0


def test_json_leaves_compare_by_type_and_value():
    for a, b in [(True, 1), (1, 1.0), (0.0, -0.0), ("x", "y"), (None, 0)]:
        parts, _ = parts_of({"j": [(0, {"t": torch.ones(1), "v": a})]}, {"j": [(0, {"t": torch.ones(1), "v": b})]})
        assert merge(parts).duplicates.inexact == 1, (a, b)
        with pytest.raises(DuplicateFrameError, match=re.escape(f"(JSON key 'v': {b!r} against {a!r})")):
            merge(parts, "exact")
    parts, _ = parts_of({"j": [(0, {"t": torch.ones(1), "v": 1.5})]}, {"j": [(0, {"t": torch.ones(1), "v": 1.5})]})
    assert merge(parts, "exact").duplicates.exact == 1


def test_layout_mismatch_across_ranks():
    parts, _ = parts_of({"x": frames("x", [0])}, {"y": frames("y", [0])}, {"x": frames("x", [1], (2, 2))})
    with pytest.raises(ShapeMismatchError, match=r"'x': rank 0 sent float32\[4\] but rank 2 sent float32\[2, 2\]"):
        merge(parts)


def test_json_leaves_follow_their_rows():
    parts, _ = parts_of(
        {"v": [(j, {"t": value("v", j, (1,)), "label": f"r0-{j}"}) for j in (4, 0)]},
        {"v": [(j, {"t": value("v", j, (1,)), "label": f"r1-{j}"}) for j in (3, 1)]},
    )
    out = merge(parts).files
    assert out["v"].frame_idx.tolist() == [0, 1, 3, 4]
    assert out["v"].frames["label"] == ["r0-0", "r1-1", "r1-3", "r0-4"]


def test_own_chunks_are_merged_from_the_store_without_packing():
    store = tdgather.FrameStore(copy=False)
    big = [torch.full((300, 1024), float(k)) for k in range(3)]  # 1.2 MB batches
    store.add(["a"] * 300, list(range(300)), big[0])
    store.add(["b"] * 150 + ["c"] * 150, list(range(150, 300)) + list(range(150)), big[1])
    store.add(["b"] * 150 + ["c"] * 150, list(range(150)) + list(range(150, 300)), big[2])
    (part,) = store.parts(0)
    assert [c[0].data_ptr() for c in part.chunks] == [t.data_ptr() for t in big]  # the store's own batches
    out = merge([part]).files
    assert torch.equal(out["a"].frames, big[0])
    assert out["b"].frame_idx.tolist() == list(range(300)) and out["c"].frame_idx.tolist() == list(range(300))
    assert torch.equal(out["b"].frames[:150], big[2][:150]) and torch.equal(out["b"].frames[150:], big[1][:150])
    assert torch.equal(out["c"].frames[:150], big[1][150:]) and torch.equal(out["c"].frames[150:], big[2][150:])


def test_a_merge_by_reference_leaves_long_rows_where_they_are_and_writes_the_same_bytes(tmp_path):
    big = (64, 64)  # 16 KiB rows: written by reference; (4,): copied
    preds = [
        {
            "m.mp4": frames("m.mp4", [0, 2, 4], big),
            "s.mp4": frames("s.mp4", [1, 0]),
            "d.mp4": frames("d.mp4", [0], big),
        },
        {"m.mp4": frames("m.mp4", [3, 1], big), "d.mp4": frames("d.mp4", [0, 1], big)},  # d.mp4 0: a duplicate
    ]
    parts, _ = parts_of(*preds)
    by_ref, copied = merge(parts, by_reference=True), merge(parts)
    kinds = {g.layout.leaves[0].shape: type(g.leaves[0]).__name__ for g in by_ref.groups}
    assert kinds == {(64, 64): "Rows", (4,): "Tensor"}
    assert by_ref.duplicates == copied.duplicates == DuplicateCounts(exact=1, inexact=0, max_abs_diff=0.0)
    for merged, name in ((by_ref, "ref"), (copied, "copy")):
        w = tdgather.storage.writer.DatasetWriter(tmp_path / name)
        w.write(merged, merged.ranks)
        w.commit()
    a, b = tdgather.open(tmp_path / "ref"), tdgather.open(tmp_path / "copy")
    assert sorted(a) == sorted(b) == ["d.mp4", "m.mp4", "s.mp4"]
    for name in a:
        assert torch.equal(a[name].frame_idx, b[name].frame_idx) and torch.equal(a[name].frames, b[name].frames)
    assert a["m.mp4"].frame_idx.tolist() == [0, 1, 2, 3, 4]
    # a changed copy is found by reference too, and named
    preds[1]["d.mp4"] = [(0, value("d.mp4", 0, big) + 1)]
    parts, _ = parts_of(*preds)
    with pytest.raises(DuplicateFrameError, match=r"'d.mp4'.*frame_idx 0"):
        merge(parts, "exact", by_reference=True)


def test_rows_select_and_slice_by_reference():
    from tdgather.core.merge import Rows

    sources = [torch.arange(12.0).view(3, 4), torch.arange(100.0, 108.0).view(2, 4)]
    rows = Rows(sources, torch.tensor([1, 0, 0, 1, 0]), torch.tensor([1, 0, 1, 0, 2]), 0, 5)
    want = torch.stack([sources[1][1], sources[0][0], sources[0][1], sources[1][0], sources[0][2]])
    assert torch.equal(rows.index_select(0, torch.arange(5)), want)
    assert rows[1:4].shape == (3, 4) and torch.equal(rows[1:4].index_select(0, torch.tensor([2, 0])), want[[3, 1]])
    views = rows[1:5].byte_views()  # rows 0 and 1 of source 0 are one run
    assert [len(v) for v in views] == [32, 16, 16]
    assert b"".join(views) == want[1:5].numpy().tobytes()
    assert rows[2:2].byte_views() == [] and rows[3:5].follows(rows[1:3]) and not rows[3:5].follows(rows[1:2])


@pytest.mark.parametrize("stride", [1, 2, 10**9], ids=["dense", "gaps", "sparse"])
@pytest.mark.parametrize("copies", [False, True])
def test_rows_are_ordered_per_file_and_frame_however_they_are_spread(stride, copies):
    # dense and distinct keys are placed by counting, others by sorting: both must give this order
    g = torch.Generator().manual_seed(stride + copies)
    per_rank: list[dict] = [{}, {}, {}]
    expected: dict[str, list[int]] = {}
    for f in range(40):
        name = f"v{f:02d}.mp4"
        idxs = (torch.randperm(30, generator=g)[: 5 + f % 20] * stride).tolist()
        expected[name] = sorted(idxs)
        owners = torch.randint(0, 3, (len(idxs),), generator=g).tolist()
        for i, r in zip(idxs, owners, strict=True):
            per_rank[r].setdefault(name, []).append((i, value(name, i, (3,))))
            if copies and i % 7 == 0:  # the same frame on a second rank
                per_rank[(r + 1) % 3].setdefault(name, []).append((i, value(name, i, (3,))))
    parts, _ = parts_of(*per_rank)
    merged = merge(parts)
    assert merged.duplicates.dropped == (sum(i % 7 == 0 for v in expected.values() for i in v) if copies else 0)
    out = tdgather.Gathered(merged.groups)
    assert sorted(out) == sorted(expected)
    for name, idxs in expected.items():
        assert out[name].frame_idx.tolist() == idxs, name
        assert torch.equal(out[name].frames, torch.stack([value(name, i, (3,)) for i in idxs])), name


def test_a_merged_result_taken_back_as_parts_merges_again_and_keeps_each_rows_sender():
    """A Collector gathers a shard over several spills: each spill is merged with what was gathered (`as_parts`)."""

    def det(name, j, n):  # a detector's frame: n boxes (a ragged leaf) and a label (a JSON leaf)
        return {"boxes": value(name, j, (n, 4)), "label": f"{name}-{j}"}

    first, _ = parts_of({"v": [(j, det("v", j, j % 3)) for j in (2, 0)]}, {"v": [(1, det("v", 1, 1))]})
    gathered = merge(first).groups
    second, _ = parts_of({"v": [(3, det("v", 3, 0))]}, {"v": [(2, det("v", 2, 2))], "w": [(0, det("w", 0, 2))]})
    merged = merge([*as_parts(gathered), *second])  # what was gathered first: its copy of frame 2 is kept
    assert merged.duplicates == DuplicateCounts(exact=1, inexact=0, max_abs_diff=0.0)
    assert merged.ranks == {"v": {0, 1}, "w": {1}}
    (group,) = merged.groups
    assert group.files == ["v", "w"] and group.rank.tolist() == [0, 1, 0, 0, 1]  # each row's sender, kept
    out = tdgather.Gathered(merged.groups)
    assert out["v"].frame_idx.tolist() == [0, 1, 2, 3]
    assert out["v"].frames["label"] == ["v-0", "v-1", "v-2", "v-3"]
    for j, boxes in enumerate(out["v"].frames["boxes"].unbind()):
        assert torch.equal(boxes, value("v", j, (j % 3 if j < 3 else 0, 4))), j


def test_a_layout_mismatch_with_what_was_gathered_names_the_rank_that_sent_it():
    first, _ = parts_of({"a": frames("a", [0])}, {"x": frames("x", [0])})  # gathered: "a" from rank 0, "x" from 1
    later, _ = parts_of({"y": frames("y", [0])}, {}, {"x": frames("x", [1], (2, 2))})
    with pytest.raises(ShapeMismatchError, match=r"'x': rank 1 sent float32\[4\] but rank 2 sent float32\[2, 2\]"):
        merge([*as_parts(merge(first).groups), *later])
