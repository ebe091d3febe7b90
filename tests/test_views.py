"""`tdgather.storage.views`: one item per frame (`FrameDataset`, a DataLoader); `tdgather.integrations.hf`: Hugging Face
datasets (`to_hf`)."""

import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from tensordict import TensorDictBase
from torch.utils.data import DataLoader

import tdgather
from tdgather.errors import ExportError
from tdgather.storage.views import FrameDataset, collate_frames, frame_ranges
from tdgather.storage.writer import DatasetWriter

V1 = Path(__file__).parent / "fixtures" / "v1_dataset"


def _dets(n: int, g: torch.Generator) -> dict:
    return {
        "boxes": torch.rand(n, 4, generator=g),
        "scores": torch.rand(n, generator=g).to(torch.bfloat16),
        "emb": {"v": torch.randint(-9, 9, (3, 2), generator=g, dtype=torch.int16)},
        "label": f"n={n}",
    }


def _write(path: Path) -> Path:
    """Two calls to one writer: ``b.mp4`` gets two segments in two shards, its frames interleaved."""
    g = torch.Generator().manual_seed(0)
    w = DatasetWriter(path)
    first = {
        "b.mp4": [(j, _dets(j % 3, g)) for j in (0, 2, 4, 6)],
        "a.mp4": [(j, _dets(1 + j % 2, g)) for j in range(3)],
        "plain.mp4": [(j, torch.rand(2, 2, generator=g)) for j in (5, 9)],
    }
    w.write(tdgather.gather(first, ragged=["boxes", "scores"]))
    w.write(tdgather.gather({"b.mp4": [(j, _dets(j % 4, g)) for j in (1, 3, 5)]}, ragged=["boxes", "scores"]))
    return w.commit()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("views") / "ds")


def _expected(ds) -> list[tuple[str, int, object]]:
    return [(n, int(i), ds[n][k].frames) for n in sorted(ds) for k, i in enumerate(ds[n].frame_idx)]


def _same(got, want) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
        return
    assert isinstance(got, TensorDictBase) and got.batch_size == want.batch_size == torch.Size([])
    keys = sorted(k if isinstance(k, tuple) else (k,) for k in want.keys(True, True))
    assert sorted(k if isinstance(k, tuple) else (k,) for k in got.keys(True, True)) == keys
    for k in keys:
        a, b = got.get(k), want.get(k)
        if isinstance(b, torch.Tensor):
            _same(a, b)
        else:
            assert got[k] == want[k]


def test_per_frame_equals_open(saved):
    ds = tdgather.open(saved)
    assert len(ds.index["files"]["b.mp4"]["segments"]) == 2  # the case this is about
    fd = ds.per_frame()
    want = _expected(ds)
    assert len(fd) == len(want) == 12
    for i, (name, idx, value) in enumerate(want):
        item = fd[i]
        assert (item["filename"], item["frame_idx"]) == (name, idx) == fd.locate(i)
        _same(item["frames"], value)
    assert [fd.locate(i)[1] for i in range(3, 10)] == list(range(7))  # b.mp4, merged over its segments
    assert fd[3]["frames"]["boxes"].shape == (0, 4) and fd[4]["frames"]["boxes"].shape == (1, 4)
    _same(fd[-1]["frames"], want[-1][2])
    with pytest.raises(IndexError):
        fd[12]
    assert len(list(fd)) == 12  # iteration stops at IndexError


def test_per_frame_reads_v1_fixture():
    ds = tdgather.open(V1)
    fd = FrameDataset(ds)
    for i, (name, idx, value) in enumerate(_expected(ds)):
        assert fd.locate(i) == (name, idx)
        _same(fd[i]["frames"], value)


def test_per_frame_in_dataloader_workers(saved):
    fd = tdgather.open(saved).per_frame()
    want = _expected(tdgather.open(saved))
    loader = DataLoader(fd, batch_size=3, num_workers=2, collate_fn=collate_frames)
    got = [(n, int(i), v) for b in loader for n, i, v in zip(b["filename"], b["frame_idx"], b["frames"], strict=True)]
    assert [(n, i) for n, i, _ in got] == [(n, i) for n, i, _ in want]
    for (_, _, a), (_, _, b) in zip(got, want, strict=True):
        _same(a, b)
    single = DataLoader(fd, batch_size=None, num_workers=2, collate_fn=collate_frames)
    assert [(x["filename"], x["frame_idx"]) for x in single] == [(n, i) for n, i, _ in want]
    copy = pickle.loads(pickle.dumps(fd))  # what spawn / forkserver workers get: no open file inside
    _same(copy[5]["frames"], want[5][2])


def test_per_frame_keeps_reading_what_it_opened_when_the_dataset_is_replaced(tmp_path):
    path = tdgather.save(tdgather.gather({"a": [(j, torch.full((2,), j)) for j in range(4)]}), tmp_path / "ds")
    fd = tdgather.open(path).per_frame()
    tdgather.save(tdgather.gather({"a": [(j + 10, torch.full((2,), j + 5)) for j in range(4)]}), path, overwrite=True)
    assert [(fd[i]["frame_idx"], fd[i]["frames"].tolist()) for i in range(4)] == [(j, [j, j]) for j in range(4)]
    copy = pickle.loads(pickle.dumps(fd))  # a spawned worker's copy opens the shard again: the other run's
    with pytest.raises(tdgather.DatasetError, match=r"shard-00000.safetensors: __metadata__.run: expected run"):
        copy[1]


def _items(fd) -> list:
    """Every item as ``(filename, frame_idx, values)``, or ``"refused"`` for a DatasetError naming a shard's run."""
    out = []
    for i in range(len(fd)):
        try:
            item = fd[i]
        except tdgather.DatasetError as e:
            assert re.search(r"shard-0000\d\.safetensors: __metadata__\.run: expected run '[0-9a-f]+'", str(e))
            out.append("refused")
            continue
        out.append((item["filename"], item["frame_idx"], item["frames"].tolist()))
    return out


def test_per_frame_items_never_give_another_runs_rows(tmp_path):
    """Built before a rewrite, in process, forked into workers or pickled: the first run's rows, or refused."""
    names = [f"f{i}" for i in range(6)]

    def run(tag: int):
        frames = {n: [(j, torch.full((2,), float(tag + i * 10 + j))) for j in range(2)] for i, n in enumerate(names)}
        return tdgather.gather(frames)

    path = tdgather.save(run(1000), tmp_path / "ds", max_shard_bytes=2 * 2 * 16)  # two filenames a shard
    assert len(list(path.glob("shard-*"))) == 3
    old = [(n, j, [1000 + i * 10 + j] * 2) for i, n in enumerate(names) for j in range(2)]
    fd = tdgather.open(path).per_frame()
    lazy = pickle.loads(pickle.dumps(fd))  # no shard open yet
    tdgather.save(run(2000), path, overwrite=True, max_shard_bytes=2 * 2 * 16)
    assert _items(fd) == old
    loader = DataLoader(fd, batch_size=None, num_workers=2, collate_fn=collate_frames)  # fork: the open shards
    got = [(x["filename"], x["frame_idx"], x["frames"].tolist()) for x in loader]
    assert got == old
    assert _items(lazy) == ["refused"] * len(old)
    assert _items(tdgather.open(path).per_frame()) == [
        (n, j, [2000 + i * 10 + j] * 2) for i, n in enumerate(names) for j in range(2)
    ]


def test_frame_ranges():
    assert frame_ranges(torch.tensor([0, 1, 2, 3, 10, 12, 13])) == "0-3, 10, 12-13"
    assert frame_ranges([]) == ""


# ---- Hugging Face datasets ----


def _as_tensor(value, like: torch.Tensor) -> torch.Tensor:
    """An HF cell back as a tensor of ``like``'s dtype (widened dtypes come back exactly)."""
    arr = np.asarray(value, dtype=np.float32 if like.dtype == torch.bfloat16 else None)
    t = torch.from_numpy(arr.reshape(like.shape) if arr.size == like.numel() else arr)
    assert t.to(like.dtype).to(t.dtype).equal(t), "the conversion lost bits"
    return t.to(like.dtype)


def test_to_hf_every_row_and_dtype(saved, tmp_path):
    pytest.importorskip("datasets")
    ds = tdgather.open(saved)
    hf = ds.to_hf(cache_dir=tmp_path / "cache")
    assert (tmp_path / "cache").exists() and len(hf) == 12
    f = hf.features
    assert f["filename"].dtype == "string" and f["frame_idx"].dtype == "int64"
    assert type(f["boxes"]).__name__ == "Array2D" and f["boxes"].shape == (None, 4)
    assert type(f["scores"]).__name__ == "List" and f["scores"].feature.dtype == "float32"  # bfloat16, widened
    assert f["emb.v"].shape == (3, 2) and f["emb.v"].dtype == "int16"
    assert f["frames"].shape == (2, 2) and f["label"].dtype == "string"
    assert "bfloat16 -> float32" in hf.info.description
    for row, (name, idx, value) in zip(hf, _expected(ds), strict=True):
        assert (row["filename"], row["frame_idx"]) == (name, idx)
        if isinstance(value, torch.Tensor):  # plain.mp4: no tree leaves
            assert torch.equal(_as_tensor(row["frames"], value), value)
            assert row["label"] is None
            continue
        for key in ("boxes", "scores", "emb.v"):
            want = value.get(tuple(key.split(".")))
            assert torch.equal(_as_tensor(row[key], want), want), (name, idx, key)
        assert row["label"] == value["label"]
    assert hf.data.column("boxes").null_count == 2 and hf.data.column("frames").null_count == 10  # null: no leaf
    again = ds.to_hf(cache_dir=tmp_path / "cache")  # unchanged dataset: the cache is reused
    assert again.cache_files == hf.cache_files


def test_to_hf_other_dtypes_and_json_types(tmp_path):
    pytest.importorskip("datasets")
    frames = {
        "a": [
            (
                j,
                {
                    "f8": torch.tensor([0.5, -2.0, 448.0]).to(torch.float8_e4m3fn),
                    "c": torch.tensor([1 + 2j, -3j], dtype=torch.complex64),
                    "u": torch.tensor([2**64 - 1, 0], dtype=torch.uint64),
                    "h": torch.tensor(1.5, dtype=torch.float16),
                    "b": torch.tensor([True, False]),
                    "n": j,
                    "mixed": [1, 1.0, None][j],
                },
            )
            for j in range(3)
        ]
    }
    ds = tdgather.open(tdgather.save(tdgather.gather(frames), tmp_path / "ds"))
    hf = ds.to_hf()  # in memory: nothing under home, the temporary directory removed
    assert hf.cache_files == []
    assert hf.features["n"].dtype == "int64" and type(hf.features["mixed"]).__name__ == "Json"
    assert hf.features["u"].feature.dtype == "uint64" and hf.features["h"].dtype == "float16"
    hf = hf.with_format("numpy")
    for j, row in enumerate(hf):
        assert row["f8"].tolist() == [0.5, -2.0, 448.0] and row["c"].tolist() == [[1, 2], [0, -3]]
        assert row["b"].tolist() == [True, False] and row["n"] == j
    assert hf.with_format(None)["u"] == [[2**64 - 1, 0]] * 3  # exact (the numpy format casts ints to int64)
    assert [x for x in hf.with_format(None)["mixed"]] == [1, 1.0, None]
    assert type(hf.with_format(None)["mixed"][1]) is float


def test_to_hf_gives_columns_that_disagree_one_type_both_fit_in(tmp_path):
    """to_hf never refuses a dataset tdgather wrote: a leaf that differs between filenames gets a wider column."""
    pytest.importorskip("datasets")

    def export(frames, name):
        return tdgather.open(tdgather.save(tdgather.gather(frames), tmp_path / name)).to_hf()

    ragged = export({"a": (0, {"x": torch.zeros(2)}), "b": (0, {"x": torch.ones(3)})}, "ragged")
    assert [r["x"] for r in ragged] == [[0, 0], [1, 1, 1]]  # one frame each: x is ragged
    dims = export({"a": (0, {"x": torch.zeros(2, 2)}), "b": (0, {"x": torch.ones(2, 3)})}, "dims")
    assert [r["x"] for r in dims] == [[[0, 0], [0, 0]], [[1, 1, 1], [1, 1, 1]]]  # a dim that varies
    wider = export({"a": (0, {"x": torch.full((2,), 0.5, dtype=torch.float16)}), "b": (0, {"x": torch.ones(2)})}, "f")
    assert wider.features["x"].feature.dtype == "float32" and [r["x"] for r in wider] == [[0.5, 0.5], [1, 1]]
    kinds = export({"a": (0, {"x": torch.arange(4).reshape(2, 2)}), "b": (0, {"x": "text"})}, "kinds")
    assert [r["x"] for r in kinds] == [[[0, 1], [2, 3]], "text"]  # a tensor here, JSON there: JSON values
    clash = {"a": (0, {"frame_idx": torch.zeros(2)})}
    with pytest.raises(ExportError, match="collide"):
        tdgather.open(tdgather.save(tdgather.gather(clash), tmp_path / "clash")).to_hf()


def test_keys_that_join_alike_get_columns_of_their_own(tmp_path):
    """{"a.b": x} and {"a": {"b": y}} (and a key "") are separate leaves: each keeps its column and values."""
    pytest.importorskip("datasets")
    value = {"a.b": torch.zeros(2), "a": {"b": torch.ones(2)}, "": torch.full((2,), 7.0), "frames": torch.ones(1)}
    ds = tdgather.open(tdgather.save(tdgather.gather({"v": (0, value)}), tmp_path / "ds"))
    hf = ds.to_hf().with_format("torch")
    assert sorted(hf.features) == ["%", "a%2Eb", "a.b", "filename", "frame_idx", "frames"]
    row = hf[0]
    assert row["a%2Eb"].tolist() == [0, 0] and row["a.b"].tolist() == [1, 1] and row["%"].tolist() == [7, 7]


def test_what_the_reader_refuses_the_other_views_refuse_too(saved, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    bad = tmp_path / "bad"
    import shutil

    shutil.copytree(saved, bad)
    shard = bad / "shard-00000.safetensors"
    with safe_open(shard, framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    group = next(k.split(":")[0] for k in tensors if k.endswith(":frame_idx") and tensors[k].numel() == 7)
    tensors[f"{group}:frame_idx"] = tensors[f"{group}:frame_idx"].flip(0).contiguous()  # rows out of order
    save_file(tensors, shard, metadata=meta)
    ds = tdgather.open(bad)
    with pytest.raises(tdgather.DatasetError, match="strictly increasing"):
        ds["a.mp4"]
    with pytest.raises(tdgather.DatasetError, match="strictly increasing"):
        ds.per_frame()
    pytest.importorskip("datasets")
    with pytest.raises(tdgather.DatasetError, match="strictly increasing"):  # not datasets' wrapper error
        ds.to_hf(filenames=["a.mp4"])


def test_an_item_holds_its_own_rows_not_the_shard(saved, tmp_path):
    """safetensors' slices view the whole tensor: an item (pickled to a DataLoader's main process) must not."""
    big = {"v": [(j, {"x": torch.rand(64), "boxes": torch.rand(j % 5, 4)}) for j in range(200)]}
    frames = tdgather.open(tdgather.save(tdgather.gather(big, ragged=["boxes"]), tmp_path / "big")).per_frame()
    assert tdgather.open(tmp_path / "big")["v"].frames["x"].untyped_storage().nbytes() == 200 * 64 * 4  # whole file
    for i in range(len(frames)):
        item = frames[i]["frames"]
        leaves = [item] if isinstance(item, torch.Tensor) else [item.get(k) for k in item.keys(True, True)]
        for t in leaves:
            if isinstance(t, torch.Tensor):
                t = t.values() if t.is_nested else t
                assert t.untyped_storage().nbytes() <= 2 * t.nbytes + 4096, (i, t.shape)
    with pytest.raises(TypeError, match="integer position, got bool"):
        frames[True]
