"""Ragged leaves (a first dim that changes per frame): detections split over real gloo ranks, and locally."""

import json
import os

import pytest
import torch
from safetensors import safe_open

import tdgather
from tdgather import DatasetError, DuplicateFrameError, ProtocolError, ShapeMismatchError, UnsupportedValueError
from tdgather.comm.pack import pack
from tdgather.comm.wire import Kind, Limits, decode_header, decode_index, decode_json, encode_json, index_offsets
from tdgather.core.dtypes import DTYPES
from tdgather.core.ragged import Ragged, padded
from tdgather.storage.writer import DatasetWriter
from tdgather.tools.launch import WorldError, run_local_world

from . import ragged_cases as rc
from .test_reader import rewrite_shard

# ---- in real gloo worlds -----------------------------------------------------------------------


@pytest.mark.world
@pytest.mark.parametrize("form", ["nested", "list", "lazy"])
@pytest.mark.parametrize("world", [2, 3])
def test_ragged_leaves_split_over_ranks_with_padding_duplicates(world, form):
    # 7 files x 10 frames, 0-6 boxes each (empty frames included), batches of 4, sampler padding
    out = run_local_world(rc.case_gather, world, 7, 10, 6, 4, form, timeout=120)
    pad = -70 % world
    assert out[0]["frames"] == 70
    assert out[0]["dups"]["exact"] + out[0]["dups"]["inexact"] == pad
    assert out[0]["dups"]["max_abs_diff"] < 1e-6  # the embedding's last bit


@pytest.mark.world
def test_a_padded_copy_with_a_box_less_is_kept_once_and_counted_inexact():
    out = run_local_world(rc.case_gather, 3, 7, 10, 6, 4, "nested", True, timeout=120)[0]
    assert out["dups"]["inexact"] == 2 and out["dups"]["max_abs_diff"] == "inf"  # no numeric difference exists


@pytest.mark.world
def test_100k_frames_of_0_to_8_boxes():
    out = run_local_world(rc.case_gather, 2, 1000, 100, 8, 256, "nested", timeout=300)[0]
    assert out["frames"] == 100_000


@pytest.mark.world
def test_collector_and_save_write_the_same_ragged_dataset(tmp_path):
    out = run_local_world(rc.case_save_and_stream, 4, str(tmp_path / "ds"), 13, 41, 8, 64 << 10, timeout=180)[0]
    assert out["shards"] > 3 and out["segments"] > 1  # written while frames arrived, files over several shards
    assert out["dups"] == -(13 * 41) % 4 == 3  # padding copies, some compared with the copy already on disk


@pytest.mark.world
def test_a_sender_lost_mid_values_keeps_every_frame_that_landed_whole(tmp_path):
    try:
        results = run_local_world(rc.case_cut_mid_values, 2, str(tmp_path), timeout=120)
    except WorldError as e:
        assert "exited with code" in e.failures[1]
        results = e.results
    got = results[0]
    assert got["type"] == "PeerLostError"
    assert all(got["frames"][f"r0_b{b}.mp4"] == 64 for b in range(4))
    # rank 1 sent its fixed leaf, then batches of boxes, and died posting its 4th piece: the frames kept
    # are the batches whose boxes all came (k of them, at most 2), then the 3 empty frames that start
    # the next batch (their values are complete: there are none); all were checked bit for bit
    ones = sorted((name, n) for name, n in got["frames"].items() if name.startswith("r1"))
    k = sum(n == 64 for _, n in ones)
    whole = [(f"r1_b{b}.mp4", 64) for b in range(k)]
    assert k <= 2 and ones in (whole, [*whole, (f"r1_b{k}.mp4", 3)]), ones


# ---- one process -------------------------------------------------------------------------------


def _gather_boxes(lengths, dtype=torch.float32, shape=(4,)):
    store = tdgather.FrameStore()
    lengths = torch.tensor(lengths)
    values = torch.arange(int(lengths.sum()) * max(1, torch.Size(shape).numel())).reshape(-1, *shape)
    boxes = Ragged.from_lengths(values.to(dtype), lengths)
    store.add("v.mp4", torch.arange(len(lengths)), {"boxes": boxes.to_nested()})
    return boxes, tdgather.gather(store)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_every_dtype_round_trips_bit_exactly_through_save_and_open(tmp_path, dtype):
    lengths = torch.tensor([2, 0, 3, 1])
    bits = torch.randint(0, 256, (6 * 3 * dtype.itemsize,), dtype=torch.uint8)
    if dtype == torch.bool:
        bits = bits % 2
    values = bits.view(dtype).view(6, 3)  # every bit pattern: NaN payloads, -0.0, inf
    store = tdgather.FrameStore()
    store.add(["a", "a", "b", "a"], [3, 1, 0, 2], Ragged.from_lengths(values, lengths).to_nested())
    tdgather.save(tdgather.gather(store), tmp_path / "ds")
    ds = tdgather.open(tmp_path / "ds")
    a = ds["a"].frames  # frames 1, 2, 3 are rows 1, 3, 0 of the batch
    assert ds.layout("a").describe() == f"{tdgather.core.dtypes.dtype_name(dtype)}[*, 3]"
    assert a.offsets().tolist() == [0, 0, 1, 3]
    want = torch.cat([values[5:6], values[0:2]])
    assert torch.equal(a.values().view(torch.uint8), want.view(torch.uint8))
    assert ds["b"].frames.offsets().tolist() == [0, 3]


def test_frames_with_no_rows_and_files_with_no_values():
    _, got = _gather_boxes([0, 0, 0])
    boxes = got["v.mp4"].frames["boxes"]
    assert boxes.offsets().tolist() == [0, 0, 0, 0] and boxes.values().shape == (0, 4)
    assert boxes[1].shape == (0, 4)
    p, n = padded(boxes)
    assert p.shape == (3, 0, 4) and n.tolist() == [0, 0, 0]


def test_a_frame_reads_back_exactly_as_sent_and_pads_on_request():
    boxes, got = _gather_boxes([2, 0, 3])
    f = got["v.mp4"]
    assert torch.equal(f.frames["boxes"][2], boxes.values[2:5])
    assert torch.equal(f[2].frames["boxes"], boxes.values[2:5])  # indexing the Frames gives one frame
    p, n = padded(f.frames["boxes"], value=-1)
    assert p.shape == (3, 3, 4) and n.tolist() == [2, 0, 3]
    assert torch.equal(p[0, :2], boxes.values[:2]) and bool((p[1] == -1).all()) and bool((p[0, 2] == -1).all())


@pytest.mark.parametrize("dtype", [torch.uint64, torch.float8_e5m2, torch.bool])
def test_padded_works_where_to_padded_tensor_does_not(dtype):
    r = Ragged.from_lengths(torch.ones(3, 2).to(dtype), torch.tensor([1, 2]))
    p, n = padded(r.to_nested(), value=0)
    assert p.dtype == dtype and p.shape == (2, 2, 2) and n.tolist() == [1, 2]
    assert p.to(torch.float32).sum() == 6


def test_padded_refuses_a_value_the_dtype_cannot_hold_and_what_is_not_ragged():
    nt = Ragged.from_lengths(torch.arange(3, dtype=torch.uint8), torch.tensor([2, 0, 1])).to_nested()
    assert padded(nt, 255)[0].tolist() == [[0, 1], [255, 255], [2, 255]]
    for value in (300, -1, 1.5, "x"):
        with pytest.raises(ValueError, match=rf"value={value!r} does not fit the leaf's torch.uint8.*\[0, 255\]"):
            padded(nt, value)
    with pytest.raises(ValueError, match="expected 0, 1 or a bool"):
        padded(Ragged.from_lengths(torch.ones(2, dtype=torch.bool), torch.tensor([2])), 2)
    with pytest.raises(TypeError, match="got list; a list of tensors pads with torch.nn.utils.rnn.pad_sequence"):
        padded([torch.ones(2), torch.ones(3)])
    with pytest.raises(TypeError, match=r"or a tensor \[T, N, \.\.\.\], got a tensor of shape \[3\]"):
        padded(torch.ones(3))  # one value per frame: nothing to pad
    fixed = torch.arange(24.0).reshape(2, 3, 4)  # every frame had 3 rows: returned as it is
    p, n = padded(fixed, value=-1)
    assert p is fixed and n.tolist() == [3, 3]
    with pytest.raises(TypeError, match="expected ragged=True or dotted keys"):
        tdgather.FrameStore().add(["v"], [0], torch.ones(1, 3), ragged=1)


def test_a_batch_of_one_keeps_a_declared_leaf_ragged():
    store = tdgather.FrameStore()
    store.add(["v"], [0], [{"boxes": torch.ones(3, 4), "feat": torch.ones(8)}], ragged=["boxes"])
    store.add(["v"], [1], {"boxes": torch.ones(1, 5, 4), "feat": torch.ones(1, 8)}, ragged="boxes")
    store.add(["v", "v"], [2, 3], [{"boxes": torch.ones(2, 4), "feat": torch.ones(8)}] * 2, ragged="boxes")
    f = tdgather.gather(store)["v"]
    assert f.frames["boxes"].offsets().tolist() == [0, 3, 8, 10, 12]
    assert f.frames["feat"].shape == (4, 8)  # fixed leaves stay plain tensors


def test_a_leaf_declared_fixed_whose_first_dim_changes_is_refused_with_what_to_change():
    store = tdgather.FrameStore()
    store.add(["v"], [0], [{"boxes": torch.ones(3, 4)}], ragged=False)
    with pytest.raises(ShapeMismatchError, match=r"float32\[3, 4\].*float32\[2, 4\].*\['boxes'\].*ragged=False"):
        store.add(["v"], [1], [{"boxes": torch.ones(2, 4)}])
    assert tdgather.gather(store)["v"].frame_idx.tolist() == [0]


def test_leaves_that_differ_in_more_than_their_first_dim_are_refused():
    store = tdgather.FrameStore()
    with pytest.raises(ShapeMismatchError, match=r"frame 1 of the list has \{boxes: float32\[2, 5\]\}"):
        store.add(["v", "v"], [0, 1], [{"boxes": torch.ones(3, 4)}, {"boxes": torch.ones(2, 5)}])
    with pytest.raises(ShapeMismatchError, match=r"frame 1 of the list has \{boxes: int64\[3, 4\]\}"):
        store.add(["v", "v"], [0, 1], [{"boxes": torch.ones(3, 4)}, {"boxes": torch.ones(3, 4, dtype=torch.long)}])
    store.add(["v"], [0], {"b": Ragged.from_lengths(torch.ones(2, 4), torch.tensor([2])).to_nested()})
    with pytest.raises(ShapeMismatchError, match=r"float32\[\*, 4\]\} and \{b: float32\[\*, 3\]\}") as e:
        store.add(["v"], [1], {"b": Ragged.from_lengths(torch.ones(2, 3), torch.tensor([2])).to_nested()})
    assert "ragged=" not in str(e.value)  # a declaration would not help
    strided = torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(3, 5)])  # ragged in two dims
    with pytest.raises(ShapeMismatchError, match=r"frames differ in more than their first dim.*\(3, 5\)"):
        store.add(["v", "v"], [2, 3], strided)
    with pytest.raises(UnsupportedValueError, match=r"key 'boxes': got a list holding tensors.*per-frame dicts"):
        store.add(["v", "v"], [2, 3], {"boxes": [torch.ones(2, 4), torch.ones(3, 4)]})
    with pytest.raises(ValueError, match="'s' is named ragged, but it holds one value per frame"):
        store.add(["v", "v"], [2, 3], [{"b": torch.ones(2), "s": torch.tensor(1.0)}] * 2, ragged=["b", "s"])
    with pytest.raises(ValueError, match="named ragged, but it holds one value per frame"):
        tdgather.FrameStore().add(["v"], [0], {"s": torch.ones(1)}, ragged=["s"])
    with pytest.raises(ValueError, match=r"ragged=\['box'\] names \['box'\], which is not a tensor leaf.*\['boxes'\]"):
        tdgather.FrameStore().add(["v"], [0], [{"boxes": torch.ones(2, 4)}], ragged=["box"])  # a typo
    with pytest.raises(ValueError, match="ragged in dim 2"):
        nt = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(2, 4)], layout=torch.jagged)  # [2, 2, j]
        tdgather.FrameStore().add(["v", "v"], [0, 1], nt)


def test_a_strict_policy_refuses_a_copy_with_another_number_of_boxes():
    store = tdgather.FrameStore()
    store.add(["v", "v"], [0, 0], [torch.ones(2, 4), torch.ones(3, 4)])
    with pytest.raises(DuplicateFrameError, match=r"frame_idx 0.*'<tensor>': 2 rows against 3"):
        tdgather.gather(store, duplicates="exact")
    kept = tdgather.gather(store)  # keep: the first copy
    assert kept["v"].frames.offsets().tolist() == [0, 2] and kept.stats.duplicates.inexact == 1


def test_views_and_non_contiguous_batches_are_stored_as_their_values():
    big = torch.arange(400.0).reshape(10, 10, 4)
    rows = [big[i, : i % 4, :] for i in range(10)]  # views of one storage
    store = tdgather.FrameStore()
    store.add("v", torch.arange(10), [r.t().t() for r in rows])
    nt = torch.nested.narrow(
        torch.arange(40.0).reshape(10, 4),
        1,
        torch.tensor([0, 0, 1, 0, 0, 0, 0, 0, 0, 0]),
        torch.tensor([1, 2, 0, 3, 1, 0, 2, 1, 1, 4]),
        layout=torch.jagged,
    )
    store.add("w", torch.arange(10), nt)  # a jagged view with holes
    got = tdgather.gather(store)
    v, w = got["v"].frames, got["w"].frames
    assert all(torch.equal(v[i], rows[i]) for i in range(10))
    assert all(torch.equal(w[i], nt[i]) for i in range(10))
    assert store.nbytes == sum(r.numel() for r in rows) * 4 + int(nt.lengths().sum()) * 4


def test_a_ragged_leaf_off_the_cpu_stays_on_its_device_with_its_offsets():
    # "meta" stands for any device but the CPU (a GPU): torch wants a jagged tensor's offsets on its values'
    # device, while a Ragged keeps its offsets on the CPU (the store reads them); before, to_nested() mixed them
    r = Ragged.from_lengths(torch.empty(5, 4, device="meta"), torch.tensor([3, 0, 2]))
    nt = r.to_nested()
    assert (nt.device.type, nt.values().device.type, nt.offsets().device.type) == ("meta", "meta", "meta")
    assert nt.shape[0] == 3 and nt.shape[2] == 4 and r.offsets.device.type == "cpu"
    assert r[1:].to_nested().offsets().device.type == "meta"  # a row slice too
    picked = r.index_select(0, torch.tensor([2, 0]))  # the row index goes to the values' device
    assert picked.values.device.type == "meta" and picked.values.shape == (5, 4) and picked.lengths.tolist() == [2, 3]


def test_a_ragged_column_from_lists_of_per_image_dicts_is_one_cat_and_reads_back():
    # the torchvision form: a list of per-image dicts, boxes [N_i, 4]; on a GPU the same code joins them there
    images = [{"boxes": torch.rand(n, 4), "labels": torch.arange(n)} for n in (3, 0, 2)]
    store = tdgather.FrameStore()
    store.add(["v"] * 3, torch.arange(3), images)
    [(layout, [chunk])] = store.groups()
    boxes = chunk.tensors[[leaf.path for leaf in layout.leaves].index(("boxes",))]
    assert boxes.lengths.tolist() == [3, 0, 2] and boxes.values.shape == (5, 4)
    f = tdgather.gather(store)["v"]
    assert torch.equal(f.frames["boxes"].values(), torch.cat([i["boxes"] for i in images]))
    assert f.frames["labels"].offsets().tolist() == [0, 3, 3, 5]


@pytest.mark.parametrize("form", ["nested", "list"])
def test_a_cuda_ragged_batch_is_copied_to_the_host_once(form):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    lengths = torch.tensor([3, 0, 2])
    values = torch.rand(5, 4, device="cuda")
    nt = Ragged.from_lengths(values, lengths).to_nested()
    assert nt.offsets().device == values.device  # as torch requires
    feat = torch.rand(3, 8, device="cuda")
    if form == "nested":
        frames = {"boxes": nt, "feat": feat}
    else:  # torchvision's list of per-image dicts, on the GPU
        frames = [{"boxes": b, "feat": x} for b, x in zip(nt.unbind(), feat, strict=True)]
    store = tdgather.FrameStore()
    store.add(["v"] * 3, torch.arange(3, device="cuda"), frames)
    [(layout, [chunk])] = store.groups()
    boxes = chunk.tensors[[leaf.path for leaf in layout.leaves].index(("boxes",))]
    assert boxes.values.device.type == "cpu" and boxes.values.is_pinned()  # one pinned copy of the rows
    assert boxes.offsets.device.type == "cpu" and boxes.lengths.tolist() == [3, 0, 2]
    f = tdgather.gather(store)["v"]
    assert f.frames["boxes"].values().device.type == "cpu"
    assert torch.equal(f.frames["boxes"].values(), values.cpu())
    assert torch.equal(f.frames["feat"], feat.cpu())


# ---- hostile input: from a peer, and from disk --------------------------------------------------


def _ragged_message():
    store = tdgather.FrameStore()
    store.add(
        ["a", "a", "b"],
        [0, 1, 0],
        {"boxes": Ragged.from_lengths(torch.ones(5, 4), torch.tensor([2, 0, 3])).to_nested()},
    )
    packed = pack(store)
    return json.loads(encode_json(packed.header)), packed.index


def test_a_peers_lengths_are_checked_before_use():
    header, index = _ragged_message()
    parsed = decode_header(header, Kind.DATA, 1, index.numel())
    assert decode_index(parsed, index, 1)[0][2][0].tolist() == [2, 0, 3]
    at = index_offsets([(3, 4, 2, 1)])[2]  # int32 frame_idx, 2 runs, 1 ragged leaf
    for lengths, match in [
        ([2, -1, 4], "row counts >= 0 that sum to 5"),
        ([2, 0, 2], "row counts >= 0 that sum to 5"),
        ([2**62, 2**62, 5 - 2**63], "row counts >= 0 that sum to 5"),  # an overflow that sums to 5
    ]:
        bad = index.clone()
        bad[at : at + 24].view(torch.int64).copy_(torch.tensor(lengths, dtype=torch.int64))
        with pytest.raises(ProtocolError, match=rf"lengths of leaf 0: expected {match}"):
            decode_index(parsed, bad, 1)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda g: g["elems"].__setitem__(0, 6), r"pieces\[0\]: expected piece row counts >= 1 that sum to 6"),
        (lambda g: g["layout"]["leaves"][0].__setitem__("ragged", False), r"ragged: expected true"),
        (lambda g: g["layout"]["leaves"][0].__setitem__("extra", 1), r"leaves\[0\]: expected an object with keys"),
        (
            lambda g: g["layout"]["leaves"][0].pop("ragged"),
            r"elems\[0\]: expected 3 \(the rows of a leaf that is not ragged\)",
        ),
        (lambda g: g["elems"].pop(), r"elems: expected a list of 1 items"),
    ],
)
def test_a_peers_ragged_header_is_checked_before_anything_is_allocated(change, match):
    header, index = _ragged_message()
    change(header["groups"][0])
    with pytest.raises(ProtocolError, match=match):
        decode_header(decode_json(encode_json(header), 1, Limits()), Kind.DATA, 1, index.numel())


def _saved(tmp_path):
    boxes, got = _gather_boxes([2, 0, 3, 1])
    tdgather.save(got, tmp_path / "ds")
    return tmp_path / "ds", boxes


def test_a_plain_safetensors_reader_gets_values_and_offsets(tmp_path):
    out, boxes = _saved(tmp_path)
    index = json.loads((out / "tdgather.index.json").read_text())
    seg = index["files"]["v.mp4"]["segments"][0]
    with safe_open(out / seg["shard"], framework="pt") as f:
        offsets = f.get_slice(f"{seg['group']}.boxes:offsets")[seg["start"] : seg["start"] + seg["frames"] + 1]
        values = f.get_slice(f"{seg['group']}.boxes")[int(offsets[0]) : int(offsets[-1])]
    assert offsets.tolist() == [0, 2, 2, 5, 6] and torch.equal(values, boxes.values)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda o: o[1:3].copy_(torch.tensor([5, 2])), r"g0.boxes:offsets: expected non-decreasing offsets in 0..6"),
        (lambda o: o[2].fill_(99), r"g0.boxes:offsets: expected non-decreasing offsets in 0..6"),
        (lambda o: o[4].fill_(5), r"g0.boxes:offsets: expected first and last offsets \[0, 6\] \(the values' rows\)"),
    ],
)
def test_offsets_edited_on_disk_are_refused_before_the_values_are_read(tmp_path, change, match):
    out, _ = _saved(tmp_path)
    shard = next(out.glob("shard-*.safetensors")).name
    rewrite_shard(out / shard, tensors=lambda t: change(t["g0.boxes:offsets"]))
    with pytest.raises(DatasetError, match=match):
        tdgather.open(out)["v.mp4"]


def test_a_values_tensor_of_another_shape_is_refused(tmp_path):
    out, _ = _saved(tmp_path)
    shard = next(out.glob("shard-*.safetensors")).name
    rewrite_shard(out / shard, tensors=lambda t: t.__setitem__("g0.boxes", t["g0.boxes"].reshape(-1, 2)))
    with pytest.raises(DatasetError, match=r"g0.boxes: expected float32\[N, 4\], got 'float32\[12, 2\]'"):
        tdgather.open(out).verify()
    rewrite_shard(out / shard, tensors=lambda t: t.__setitem__("g0.boxes", t["g0.boxes"].reshape(-1)))
    with pytest.raises(DatasetError, match=r"g0.boxes: expected float32\[N, 4\], got 'float32\[24\]'"):
        tdgather.open(out).verify()
    assert os.path.isdir(out)


@pytest.mark.world
def test_the_dict_form_takes_ragged_too(tmp_path):
    assert run_local_world(rc.case_dict_form, 3, str(tmp_path / "ds"), timeout=120)[0] == {"frames": 45}


def test_a_copy_that_arrives_after_its_frame_was_written_is_compared_with_the_disk(tmp_path):
    from tdgather.storage.writer import DatasetWriter

    def frames(lengths):
        store = tdgather.FrameStore()
        boxes = Ragged.from_lengths(torch.arange(sum(lengths) * 4.0).view(-1, 4), torch.tensor(lengths))
        store.add("v", torch.arange(len(lengths)), {"boxes": boxes.to_nested(), "feat": torch.ones(len(lengths), 2)})
        return tdgather.gather(store)

    writer = DatasetWriter(tmp_path / "keep")
    writer.write(frames([2, 0, 3]))
    writer.write(frames([2, 1]))  # frame 0 again, the same; frame 1 again with a box more
    writer.commit()
    assert (writer.duplicates.exact, writer.duplicates.inexact) == (1, 1)
    assert tdgather.open(tmp_path / "keep")["v"].frames["boxes"].offsets().tolist() == [0, 2, 2, 5]  # the disk's
    strict = DatasetWriter(tmp_path / "exact", duplicates="exact")
    strict.write(frames([2, 0, 3]))
    with pytest.raises(DuplicateFrameError, match=r"frame_idx 1.*written to shard-00000.*'boxes': 0 rows against 1"):
        strict.write(frames([2, 1]))


def test_a_leaf_ragged_in_one_filename_reads_ragged_in_every_filename(tmp_path):
    """One type per leaf name across a dataset: frames stored fixed read as that many rows each."""
    from safetensors import safe_open

    fixed = torch.arange(24, dtype=torch.float32).reshape(3, 2, 4)  # every frame 2 boxes: stored fixed
    w = DatasetWriter(tmp_path / "ds")  # written apart (a gather would make b.mp4's boxes ragged too)
    w.write(tdgather.gather({"b.mp4": [(i, {"boxes": fixed[i], "depth": torch.rand(2)}) for i in range(3)]}))
    w.write(
        tdgather.gather(
            {"a.mp4": [(i, {"boxes": torch.rand(n, 4), "depth": torch.rand(2)}) for i, n in enumerate((1, 3, 0))]}
        )
    )
    ds = tdgather.open(w.commit())
    assert ds.ragged_leaves == {"boxes"}
    assert ds.stored_layout("b.mp4").describe() == "{boxes: float32[2, 4], depth: float32[2]}"
    assert (
        ds.layout("b.mp4") == ds.layout("a.mp4")
        and ds.layout("b.mp4").describe() == "{boxes: float32[*, 4], depth: float32[2]}"
    )
    boxes = ds["b.mp4"].frames["boxes"]
    assert boxes.is_nested and [tuple(t.shape) for t in boxes.unbind()] == [(2, 4)] * 3
    assert torch.equal(torch.stack(boxes.unbind()), fixed)
    assert ds.lengths("b.mp4")["boxes"].tolist() == [2, 2, 2] and ds.lengths("a.mp4")["boxes"].tolist() == [1, 3, 0]
    items = [ds.per_frame()[k] for k in range(len(ds.per_frame()))]
    assert [tuple(x["frames"]["boxes"].shape) for x in items] == [(1, 4), (3, 4), (0, 4), (2, 4), (2, 4), (2, 4)]
    group = next(
        g
        for g, lay in ds.index["shards"]["shard-00000.safetensors"]["groups"].items()
        if not any(leaf.get("ragged") for leaf in lay["leaves"])
    )
    with safe_open(tmp_path / "ds" / "shard-00000.safetensors", "pt") as f:  # the file holds what was stored
        assert f.get_slice(f"{group}.boxes").get_shape() == [3, 2, 4] and f"{group}.boxes:offsets" not in f.keys()


def test_to_hf_gives_a_leaf_one_column_type_when_some_filenames_stored_it_fixed(tmp_path):
    pytest.importorskip("datasets")
    store = tdgather.FrameStore()
    store.add(["a.mp4"] * 2, [0, 1], [{"boxes": torch.ones(n, 4)} for n in (1, 3)])
    store.add(["b.mp4"] * 2, [0, 1], {"boxes": torch.zeros(2, 2, 4)})
    hf = tdgather.open(tdgather.save(tdgather.gather(store), tmp_path / "ds")).to_hf(cache_dir=tmp_path / "hf")
    rows = {(r["filename"], r["frame_idx"]): r["boxes"] for r in hf}
    assert [len(rows["a.mp4", i]) for i in (0, 1)] == [1, 3] and [len(rows["b.mp4", i]) for i in (0, 1)] == [2, 2]


def test_a_copy_of_a_frame_with_large_ragged_rows_is_compared_in_one_spill(tmp_path):
    # masks of 16 KiB a row are written by reference (not merged into new buffers): the copy of
    # frame 0 is compared from those references (this raised AttributeError: 'Rows' has no 'device')
    def masks(i: int) -> dict:
        return {"masks": torch.rand(1 + i % 3, 64, 64, generator=torch.Generator().manual_seed(i))}

    with tdgather.Collector(tmp_path / "ds", progress=False) as col:
        col.add(["clip.mp4"] * 4, [0, 1, 2, 3], [masks(i) for i in [0, 1, 2, 3]])
        col.add(["clip.mp4"] * 2, [4, 0], [masks(i) for i in [4, 0]])
    assert col.summary.duplicates_dropped == 1
    got = tdgather.open(tmp_path / "ds")["clip.mp4"]
    assert got.frame_idx.tolist() == [0, 1, 2, 3, 4]
    for i, m in enumerate(got.frames["masks"].unbind()):
        assert torch.equal(m, masks(i)["masks"])
