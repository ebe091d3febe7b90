"""`FrameDataset.__getitems__` (a batch's items read together) and `collate_frames` (a batch as one value).

Correctness only: the same frames, bit for bit, as `__getitem__` and ``tdgather.open(path)[name]``
give them, whatever the order of the indices, the groups and shards a batch spans, the source
(a mapped file, an object store) or the process (DataLoader workers).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tensordict import TensorDictBase
from torch.utils.data import DataLoader, Subset

import tdgather
from tdgather.storage.views import FrameBatch, collate_frames
from tdgather.storage.writer import DatasetWriter


def _frame(n: int, g: torch.Generator) -> dict:
    return {
        "boxes": torch.rand(n, 4, generator=g),  # ragged
        "scores": torch.rand(n, generator=g).to(torch.bfloat16),  # ragged, 1-D rows
        "emb": {"v": torch.randint(-9, 9, (3, 2), generator=g, dtype=torch.int16)},  # fixed
        "label": f"n={n}",  # JSON
        "ok": n % 2 == 0,  # JSON
    }


def _write(path: Path) -> Path:
    """Two writes: ``b.mp4`` in two shards (its frames interleaved), ``c.mp4`` stored with ``boxes`` fixed."""
    g = torch.Generator().manual_seed(0)
    w = DatasetWriter(path)
    first = {
        "b.mp4": [(j, _frame(j % 3, g)) for j in (0, 2, 4, 6)],
        "a.mp4": [(j, _frame(1 + j % 2, g)) for j in range(3)],
    }
    w.write(tdgather.gather(first, ragged=["boxes", "scores"]))
    second = {
        "b.mp4": [(j, _frame(j % 4, g)) for j in (1, 3, 5)],
        "c.mp4": [(j, _frame(2, g)) for j in range(4)],  # two rows each, stored fixed: read as ragged
    }
    w.write(tdgather.gather(second, ragged=["scores"]))
    return w.commit()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("batches") / "ds")


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """Plain-tensor frames in two shards, and a filename of another shape (another layout)."""
    g = torch.Generator().manual_seed(1)
    frames = {f"v{i}.mp4": [(j, torch.rand(2, 3, generator=g)) for j in range(5)] for i in range(4)}
    frames["wide.mp4"] = [(j, torch.rand(2, 5, generator=g)) for j in range(3)]
    path = tmp_path_factory.mktemp("plain") / "ds"
    return tdgather.save(tdgather.gather(frames), path, max_shard_bytes=2 * 5 * 2 * 3 * 4)


def _same(got, want) -> None:
    """Equal bit for bit: dtypes, shapes, values, JSON values, the value's type."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.contiguous().flatten().view(torch.uint8), want.contiguous().flatten().view(torch.uint8))
        return
    assert type(got) is type(want) and isinstance(got, TensorDictBase) and got.batch_size == want.batch_size
    keys = sorted(k if isinstance(k, tuple) else (k,) for k in want.keys(True, True))
    assert sorted(k if isinstance(k, tuple) else (k,) for k in got.keys(True, True)) == keys
    for k in keys:
        if isinstance(want.get(k), torch.Tensor):
            _same(got.get(k), want.get(k))
        else:
            assert got[k] == want[k] and type(got[k]) is type(want[k])


def _same_nested(got: torch.Tensor, want: list[torch.Tensor]) -> None:
    """A jagged nested tensor holding exactly the frames ``want``."""
    assert got.is_nested and got.size(0) == len(want)
    for a, b in zip(got.unbind(), want, strict=True):
        _same(a, b)


def test_getitems_gives_the_items_getitem_gives_in_any_order(saved):
    fd = tdgather.open(saved).per_frame()
    assert len(fd) == 14
    g = torch.Generator().manual_seed(2)
    for indices in ([3, 4, 5], torch.randperm(14, generator=g).tolist(), [13, 0, 13, -1, 7, 7], [5], []):
        batch = fd.__getitems__(indices)
        assert isinstance(batch, FrameBatch) and len(batch) == len(indices)
        for item, i in zip(batch, indices, strict=True):
            want = fd[i]
            assert (item["filename"], item["frame_idx"]) == (want["filename"], want["frame_idx"]) == fd.locate(i)
            _same(item["frames"], want["frames"])
        assert batch[-1] is batch[len(indices) - 1] if indices else True  # items are built once
    with pytest.raises(IndexError):
        fd.__getitems__([0, 14])
    with pytest.raises(TypeError):
        fd.__getitems__([0, 1.0])


def test_getitem_is_what_open_gives(saved):
    ds = tdgather.open(saved)
    fd = ds.per_frame()
    want = [(n, int(i), ds[n][k].frames) for n in sorted(ds) for k, i in enumerate(ds[n].frame_idx)]
    for i, (name, idx, value) in enumerate(want):
        item = fd[i]
        assert (item["filename"], item["frame_idx"]) == (name, idx)
        _same(item["frames"], value)
    assert fd[3]["frames"]["boxes"].shape == (0, 4)  # b.mp4 frame 0: no rows
    assert ds.layout("c.mp4").leaves[0].ragged and fd[12]["frames"]["boxes"].shape == (2, 4)  # stored fixed


def test_collate_stacks_a_batch_as_open_gives_a_filename(saved):
    """Ragged leaves one nested tensor, fixed leaves one tensor, JSON leaves one stack: as ``ds[name].frames``."""
    ds = tdgather.open(saved)
    fd = ds.per_frame()
    indices = [9, 3, 12, 0, 8, 13, 5]  # b.mp4 from both shards, a.mp4, c.mp4 (stored fixed): one layout
    items = [fd[i] for i in indices]
    batch = collate_frames(fd.__getitems__(indices))
    assert batch["filename"] == [x["filename"] for x in items]
    assert batch["frame_idx"].dtype == torch.int64 and batch["frame_idx"].tolist() == [x["frame_idx"] for x in items]
    frames = batch["frames"]
    assert isinstance(frames, TensorDictBase) and frames.batch_size == torch.Size([len(indices)])
    _same_nested(frames["boxes"], [x["frames"]["boxes"] for x in items])
    _same_nested(frames["scores"], [x["frames"]["scores"] for x in items])
    _same(frames["emb", "v"], torch.stack([x["frames"]["emb", "v"] for x in items]))
    assert frames["label"] == [x["frames"]["label"] for x in items]
    assert frames["ok"] == [x["frames"]["ok"] for x in items]
    for k, item in enumerate(items):  # a row of the batch is the item
        _same(frames[k], item["frames"])
    whole = ds["b.mp4"].frames  # one filename's frames in order: what ds[name] gives
    _same(collate_frames(fd.__getitems__(list(range(3, 10))))["frames"]["emb", "v"], whole["emb", "v"])
    assert collate_frames(fd[4]) is not None and collate_frames(fd[4])["frame_idx"] == 1  # batch_size=None


def test_collate_plain_tensors_and_layouts_that_differ(plain):
    ds = tdgather.open(plain)
    assert len(ds.index["shards"]) > 1
    fd = ds.per_frame()
    assert [fd.locate(i)[0] for i in (0, 19, 20)] == ["v0.mp4", "v3.mp4", "wide.mp4"]
    indices = [19, 0, 7, 12, 3]  # every v*.mp4: one layout, over shards
    batch = collate_frames(fd.__getitems__(indices))
    _same(batch["frames"], torch.stack([fd[i]["frames"] for i in indices]))
    for k, i in enumerate(indices):
        _same(batch["frames"][k], ds[fd.locate(i)[0]].at(fd.locate(i)[1]).frames)
    mixed = [21, 2, 20]  # wide.mp4's frames are float32[2, 5]: a list, each frame as it is
    batch = collate_frames(fd.__getitems__(mixed))
    assert isinstance(batch["frames"], list) and batch["frame_idx"].tolist() == [1, 2, 0]
    for got, i in zip(batch["frames"], mixed, strict=True):
        _same(got, fd[i]["frames"])
    items = [fd[i] for i in indices]  # items of another source (a list): kept as they are
    assert collate_frames(items)["frames"] == [x["frames"] for x in items]


def test_a_dataloader_with_workers_gives_every_frame_once_bit_exact(saved, plain):
    for path in (saved, plain):
        ds = tdgather.open(path)
        fd = ds.per_frame()
        want = {fd.locate(i): fd[i]["frames"] for i in range(len(fd))}
        g = torch.Generator().manual_seed(3)
        loader = DataLoader(fd, batch_size=4, shuffle=True, generator=g, num_workers=2, collate_fn=collate_frames)
        got = {}
        for batch in loader:
            assert not isinstance(batch["frames"], list) or path == plain  # plain's last layout differs
            for name, idx, value in zip(batch["filename"], batch["frame_idx"].tolist(), batch["frames"], strict=True):
                assert (name, idx) not in got
                got[name, idx] = value
        assert sorted(got) == sorted(want)
        for k, value in got.items():
            _same(value, want[k])
        subset = Subset(fd, [5, 1, 2])  # a Subset asks the dataset for its batch too
        [batch] = list(DataLoader(subset, batch_size=3, num_workers=2, collate_fn=collate_frames))
        assert batch["filename"] == [fd.locate(i)[0] for i in (5, 1, 2)]
        copy = pickle.loads(pickle.dumps(fd))  # spawn's copy: opens and checks its own shards
        _same(collate_frames(copy.__getitems__([2, 0]))["frames"][1], want[fd.locate(0)])


def test_an_object_store_dataset_reads_batches_by_runs_of_rows(saved):
    """Not mapped: one read per run of consecutive rows; the same frames."""
    url = f"memory://batches-{id(saved)}/ds"
    ds = tdgather.open(saved)
    tdgather.save(ds, url)
    remote = tdgather.open(url).per_frame()
    local = ds.per_frame()
    assert not remote.dataset.shard(next(iter(remote.dataset.index["shards"]))).f.source.mapped
    assert local.dataset.shard(next(iter(ds.index["shards"]))).f.source.mapped
    for indices in ([3, 4, 5, 6], [9, 3, 12, 0, 8, 13, 5], [6, 5, 5, 4]):
        for got, want in zip(remote.__getitems__(indices), local.__getitems__(indices), strict=True):
            assert (got["filename"], got["frame_idx"]) == (want["filename"], want["frame_idx"])
            _same(got["frames"], want["frames"])
        a, b = collate_frames(remote.__getitems__(indices)), collate_frames(local.__getitems__(indices))
        _same(a["frames"]["emb", "v"], b["frames"]["emb", "v"])
        _same_nested(a["frames"]["boxes"], list(b["frames"]["boxes"].unbind()))


def _rewrite(shard: Path, change) -> None:
    with safe_open(shard, framework="pt") as f:
        meta = f.metadata()
    data = load_file(shard)
    change(data)
    save_file({k: v.contiguous() for k, v in data.items()}, shard, metadata=meta)


def test_offsets_out_of_order_are_refused_in_a_batch(tmp_path):
    g = torch.Generator().manual_seed(4)
    frames = {"a.mp4": [(j, _frame(1 + j, g)) for j in range(4)]}
    out = tdgather.save(tdgather.gather(frames, ragged=["boxes", "scores"]), tmp_path / "ds")
    [shard] = out.glob("shard-*.safetensors")
    names = [k for k in load_file(shard) if k.endswith("boxes:offsets")]
    _rewrite(shard, lambda t: t[names[0]][2].fill_(0))  # frame 1 ends before it starts
    fd = tdgather.open(out).per_frame()
    _same(fd.__getitems__([0])[0]["frames"]["boxes"], fd[0]["frames"]["boxes"])  # frame 0 is whole
    _same(fd.__getitems__([2])[0]["frames"]["boxes"], fd[2]["frames"]["boxes"])  # its own pair is in order
    for read in (lambda: fd[1], lambda: fd.__getitems__([3, 1]), lambda: fd.__getitems__([2, 1, 0])):
        with pytest.raises(tdgather.DatasetError, match=r"boxes:offsets: expected non-decreasing offsets in 0\.\.\d+"):
            read()


def test_a_frame_index_that_changed_is_refused_in_a_batch(tmp_path):
    frames = {"a.mp4": [(j, torch.full((2,), float(j))) for j in range(4)]}
    out = tdgather.save(tdgather.gather(frames), tmp_path / "ds")
    fd = tdgather.open(out).per_frame()  # reads frame_idx now
    [shard] = out.glob("shard-*.safetensors")
    index = (out / "tdgather.index.json").read_bytes()
    _rewrite(shard, lambda t: t["g0:frame_idx"][2].fill_(7))  # a later run of the same files, say
    (out / "tdgather.index.json").write_bytes(index)
    fresh = pickle.loads(pickle.dumps(fd))  # opens the shard again: its run is the same, its frame 2 is not
    with pytest.raises(tdgather.DatasetError, match=r"g0 frame_idx row 2: expected \[2\] \(as read at construction\)"):
        fresh.__getitems__([0, 2])


def test_torchs_default_collate_still_takes_a_batch_of_plain_frames(plain):
    """A `FrameBatch` is a sequence of the items: torch's default collate stacks them as before."""
    fd = tdgather.open(plain).per_frame()
    for workers in (0, 2):
        batches = list(DataLoader(Subset(fd, range(20)), batch_size=6, num_workers=workers))
        assert [len(b["filename"]) for b in batches] == [6, 6, 6, 2]
        for k, b in enumerate(batches):
            _same(b["frames"], torch.stack([fd[i]["frames"] for i in range(6 * k, min(6 * k + 6, 20))]))
            assert b["frame_idx"].tolist() == [fd.locate(i)[1] for i in range(6 * k, min(6 * k + 6, 20))]
