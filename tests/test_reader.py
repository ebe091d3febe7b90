"""The reader trusts nothing on disk: a malformed index or shard is a DatasetError, never a read elsewhere."""

import contextlib
import copy
import json
import math
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tensordict import TensorDict

import tdgather
import tdgather.storage.segments
from tdgather import DatasetError
from tdgather.format.names import INCOMPLETE_NAME, INDEX_NAME
from tdgather.storage.segments import read_segment
from tdgather.storage.store import LocalStore
from tdgather.storage.writer import DatasetWriter

from .cases import DepthMask, assert_same_value, value

SHARD = "shard-00000.safetensors"
HOSTILE = ["..", "../outside.safetensors", "/abs/path.mp4", "nul\x00byte", "__metadata__", "y" * 2000, "", "g0"]


def frames(names=("a",), n=3, shape=(2,), dtype=torch.float32, start=0):
    return tdgather.gather(
        {name: [(j, value(name, j, shape, dtype)) for j in range(start, start + n)] for name in names}
    )


def nested(n=3):
    return tdgather.gather(
        {
            "nested.mp4": [
                (j, {"depth": value("d", j, (2,)), "meta": {"label": f"l{j}", "ok": j % 2 == 0}}) for j in range(n)
            ]
        }
    )


def save(tmp_path, result=None, name="ds", **kw):
    return tdgather.save(frames() if result is None else result, tmp_path / name, **kw)


def load_index(path):
    return json.loads((path / INDEX_NAME).read_text(encoding="utf-8"))


def store_index(path, index, name=INDEX_NAME):
    (path / name).write_text(json.dumps(index, ensure_ascii=False), encoding="utf-8")


def edit(path, fn, name=INDEX_NAME):
    index = json.loads((path / name).read_text(encoding="utf-8"))
    fn(index)
    store_index(path, index, name)


def read_all(path, **kw):
    ds = tdgather.open(path, **kw)
    return {name: ds[name] for name in ds}


def rewrite_shard(shard: Path, tensors=None, metadata=None):
    """Rewrite a shard as valid safetensors with its tensors and/or metadata changed."""
    with safe_open(shard, framework="pt") as f:
        meta = f.metadata()
    data = load_file(shard)
    if tensors:
        tensors(data)
    if metadata:
        metadata(meta)
    save_file({k: v.contiguous() for k, v in data.items()}, shard, metadata=meta)


def header(shard: Path) -> tuple[dict, bytes]:
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_header(shard: Path, head: dict, data: bytes) -> None:
    raw = json.dumps(head).encode()
    raw += b" " * (-len(raw) % 8)
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


class Opens:
    """Records every shard path the reader opens (each local file is opened as a `MappedFile`)."""

    def __init__(self):
        self.paths = []
        self._real = tdgather.storage.store.MappedFile

    def __call__(self, path, *args, **kw):
        self.paths.append(os.path.realpath(path))
        return self._real(path, *args, **kw)

    def __enter__(self):
        self._patch = mock.patch.object(tdgather.storage.store, "MappedFile", self)
        self._patch.start()
        return self

    def __exit__(self, *exc):
        self._patch.stop()

    def inside(self, directory) -> bool:
        root = os.path.realpath(directory)
        return all(os.path.dirname(p) == root for p in self.paths)


# ---- valid datasets keep working -------------------------------------------------------------------


def test_hostile_filenames_json_leaves_and_user_metadata_roundtrip(tmp_path):
    p = {name: [(j, value(name, j, (2,))) for j in range(2)] for name in HOSTILE}
    p["nested.mp4"] = [
        (j, {"depth": value("d", j, (2,)), "meta": {"label": f"l{j}\n\u2028", "x": 1.5}}) for j in range(3)
    ]
    p["tc.mp4"] = [
        (j, DepthMask(depth_map=value("t", j, (2,)), mask=torch.ones(2, dtype=torch.bool), batch_size=[]))
        for j in (2, 0)
    ]
    result = tdgather.gather(p)
    meta = {"model": "m", "deep": {"a": [1, {"b": None}]}, "total": "user key, not ours"}
    out = save(tmp_path, result, max_shard_bytes=64, metadata=meta)
    ds = tdgather.open(out)
    assert sorted(ds) == sorted(p) and ds.metadata["user"] == meta  # "total" is the user's, beside ours
    for name, f in result.items():
        got = ds[name]
        assert torch.equal(got.frame_idx, f.frame_idx)
        assert_same_value(got.frames, f.frames, name)
    assert ds["nested.mp4"].frames["meta", "label"] == ["l0\n\u2028", "l1\n\u2028", "l2\n\u2028"]
    assert isinstance(ds["tc.mp4"].frames, DepthMask)


def test_multi_segment_files_merge_and_incomplete_datasets_read(tmp_path):
    w = DatasetWriter(tmp_path / "ds")
    w.write(frames(("a", "b"), n=2))
    w.write(tdgather.gather({"a": [(j, value("a", j, (2,))) for j in (5, 2, 3)], "c": (0, torch.ones(4, 2))}))
    out = w.commit()
    ds = tdgather.open(out)
    assert len(ds.index["files"]["a"]["segments"]) == 2
    assert ds["a"].frame_idx.tolist() == [0, 1, 2, 3, 5]
    assert torch.equal(ds["a"].frames, torch.stack([value("a", j, (2,)) for j in (0, 1, 2, 3, 5)]))
    w = DatasetWriter(tmp_path / "failed")
    w.write(frames(("a",), n=2))
    w.write(nested())
    w.abort(RuntimeError("boom"))
    got = read_all(tmp_path / "failed", incomplete=True)
    assert got["a"].frame_idx.tolist() == [0, 1] and got["nested.mp4"].frames["meta", "label"] == ["l0", "l1", "l2"]
    assert tdgather.open(tmp_path / "failed", incomplete=True).metadata["failure"]["type"] == "RuntimeError"


def test_a_symlinked_dataset_and_a_shard_linked_inside_it_are_read(tmp_path):
    out = save(tmp_path)
    os.rename(out / SHARD, out / "real.bin")  # a link to a file in the directory itself is accepted
    os.symlink("real.bin", out / SHARD)
    os.symlink(out, tmp_path / "latest")
    assert read_all(tmp_path / "latest")["a"].frame_idx.tolist() == [0, 1, 2]


def test_opening_checks_no_shard_and_reading_checks_each_shard_once(tmp_path):
    out = save(tmp_path, frames(("a", "b")))
    (out / SHARD).write_bytes(b"gone")
    ds = tdgather.open(out)  # the index is fine: shards are checked lazily
    assert ds.num_frames("a") == 3 and ds.layout("a").describe() == "float32[2]"
    with pytest.raises(DatasetError, match=r"shard-00000.safetensors: header: expected a readable safetensors"):
        ds["a"]
    out = save(tmp_path, frames(("a", "b")), name="ok")
    ds = tdgather.open(out)
    with mock.patch.object(tdgather.storage.reader, "check_shard", wraps=tdgather.storage.reader.check_shard) as checks:
        ds["a"], ds["b"], ds["a"]
    assert checks.call_count == 1


# ---- paths: never a file outside the directory -------------------------------------------------------


@pytest.mark.parametrize(
    "where", ["../outside.safetensors", "ABS", "sub/shard-00000.safetensors", "shard-0.safetensors"]
)
@pytest.mark.parametrize("in_shards", [True, False])
def test_shard_names_that_leave_the_directory_are_refused(tmp_path, where, in_shards):
    out = save(tmp_path)
    (out / "sub").mkdir()
    for there in (tmp_path / "outside.safetensors", out / "sub" / SHARD, out / "shard-0.safetensors"):
        shutil.copy(out / SHARD, there)  # a valid shard sits there: reading it would succeed
    name = str(tmp_path / "outside.safetensors") if where == "ABS" else where

    def point(index):
        index["files"]["a"]["segments"][0]["shard"] = name
        if in_shards:
            index["shards"] = {name: index["shards"][SHARD]}

    edit(out, point)
    field = r"shards\[" if in_shards else r"files\['a'\]\.segments\[0\]\.shard"
    with Opens() as opens, pytest.raises(DatasetError, match=field + r".*: expected a shard file name like"):
        read_all(out)
    assert opens.paths == []


def test_a_symlink_shard_pointing_outside_is_never_opened(tmp_path):
    out = save(tmp_path)
    os.rename(out / SHARD, tmp_path / "outside.safetensors")  # a real, valid shard outside
    os.symlink(tmp_path / "outside.safetensors", out / SHARD)
    ds = tdgather.open(out)
    with (
        Opens() as opens,
        pytest.raises(
            DatasetError,
            match=r"shard-00000.safetensors: file: expected a file in the dataset directory, got a link to",
        ),
    ):
        ds["a"]
    os.unlink(out / SHARD)
    os.symlink(Path("..") / "outside.safetensors", out / SHARD)  # relative, same thing
    with opens, pytest.raises(DatasetError, match="got a link to"):
        ds["a"]
    assert opens.paths == []


def test_an_index_linked_from_outside_is_refused(tmp_path):
    out = save(tmp_path)
    os.rename(out / INDEX_NAME, tmp_path / "index.json")
    os.symlink(tmp_path / "index.json", out / INDEX_NAME)
    with pytest.raises(DatasetError, match=r"tdgather.index.json: file: expected a file in the dataset directory"):
        tdgather.open(out)


@pytest.mark.parametrize("make", ["missing", "directory", "fifo"])
def test_a_shard_that_is_not_a_regular_file_is_refused_without_opening_it(tmp_path, make):
    out = save(tmp_path)
    (out / SHARD).unlink()
    if make == "directory":
        (out / SHARD).mkdir()
    elif make == "fifo":
        os.mkfifo(out / SHARD)  # opening it would block forever
    ds = tdgather.open(out)
    with Opens() as opens, pytest.raises(DatasetError, match=r"shard-00000.safetensors: file: expected a regular file"):
        ds["a"]
    assert opens.paths == []


def test_read_segment_checks_its_segment(tmp_path):
    out = save(tmp_path)
    layout = tdgather.open(out).layout("a")
    seg = {"shard": SHARD, "group": "g0", "start": 0, "frames": 3}
    assert read_segment(LocalStore(out), seg, layout)[0].tolist() == [0, 1, 2]
    with pytest.raises(DatasetError, match=r"segment.shard: expected a shard file name"):
        read_segment(LocalStore(out), {**seg, "shard": "../outside.safetensors"}, layout)
    with pytest.raises(DatasetError, match=r"segment: expected start \+ frames <= 3, the rows of g0"):
        read_segment(LocalStore(out), {**seg, "start": 1}, layout)
    with pytest.raises(DatasetError, match=r"__metadata__.groups\['g0'\]: expected float32\[3\]"):
        read_segment(LocalStore(out), seg, tdgather.open(save(tmp_path, frames(shape=(3,)), name="other")).layout("a"))
    with pytest.raises(DatasetError, match=r"segment.start: expected an integer"):
        read_segment(LocalStore(out), {**seg, "start": -1}, layout)


# ---- the index ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, match",
    [
        ("{not json", r"tdgather.index.json: index: expected strict UTF-8 JSON"),
        (b"\xff\xfe{}", r"index: expected strict UTF-8 JSON"),
        ("[1, 2]", r"index: expected an object, got \[1, 2\]"),
        ('{"format": "tdgather", "format": "tdgather"}', r"index: expected strict UTF-8 JSON.*duplicate key 'format'"),
        ("[" * 100_000 + "]" * 100_000, r"index: expected strict UTF-8 JSON"),
        ('{"format": "other"}', r"format: expected 'tdgather', got 'other'"),
    ],
)
def test_an_index_that_is_not_strict_json_is_refused(tmp_path, text, match):
    out = save(tmp_path)
    (out / INDEX_NAME).write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(DatasetError, match=match):
        tdgather.open(out)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_in_the_index_is_refused(tmp_path, constant):
    out = save(tmp_path)
    text = (out / INDEX_NAME).read_text().replace('"total_bytes": 24', f'"total_bytes": {constant}')
    (out / INDEX_NAME).write_text(text)
    with pytest.raises(DatasetError, match=f"index: expected strict UTF-8 JSON .*{constant.lstrip('-')} is not JSON"):
        tdgather.open(out)


@pytest.mark.parametrize("version, got", [(9, "9"), (0, "0"), ("2", "'2'"), (True, "True"), (None, "None")])
def test_an_unknown_version_is_refused_saying_which_this_tdgather_reads(tmp_path, version, got):
    out = save(tmp_path)
    edit(out, lambda index: index.update(version=version))
    wanted = r"1, 2, 3, 4, 5, 6, 7 or 8 \(this tdgather reads index version 1, 2, 3, 4, 5, 6, 7 or 8 only\)"
    with pytest.raises(DatasetError, match=rf"version: expected {wanted}, got {got}"):
        tdgather.open(out)


@pytest.mark.parametrize(
    "where, field",
    [
        (("files", "a", "segments", 0, "start"), "files['a'].segments[0].start"),
        (("files", "a", "segments", 0, "frames"), "files['a'].segments[0].frames"),
        (("files", "a", "frames"), "files['a'].frames"),
        (("shards", SHARD, "frames"), f"shards['{SHARD}'].frames"),
        (("shards", SHARD, "bytes"), f"shards['{SHARD}'].bytes"),
        (("metadata", "total_frames"), "metadata.total_frames"),
        (("metadata", "num_filenames"), "metadata.num_filenames"),
    ],
)
@pytest.mark.parametrize("bad", [-1, 1.0, 2.5, True, "1", None, 2**63, [1]])
def test_counts_must_be_non_negative_integers(tmp_path, where, field, bad):
    out = save(tmp_path)

    def put(index):
        node = index
        for k in where[:-1]:
            node = node[k]
        node[where[-1]] = bad

    edit(out, put)
    with pytest.raises(DatasetError, match=rf"{re.escape(field)}: expected an integer in 0\.\.{2**62}, got"):
        tdgather.open(out)


@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda i: i["metadata"].update(total_frames=4),
            r"metadata.total_frames: expected 3, as the shards and files say, got 4",
        ),
        (
            lambda i: i["metadata"].update(total_bytes=0),
            r"metadata.total_bytes: expected 24, as the shards and files say",
        ),
        (lambda i: i["metadata"].update(num_filenames=2), r"metadata.num_filenames: expected 1, as"),
        (lambda i: i["metadata"].pop("total_frames"), r"metadata.total_frames: expected an integer"),
        (
            lambda i: i["shards"][SHARD].update(frames=2),
            r"shards\['shard-00000.safetensors'\].frames: expected 3, the sum over its segments",
        ),
        (lambda i: i["shards"][SHARD].update(bytes=25), r"shards\['shard-00000.safetensors'\].bytes: expected 24"),
        (
            lambda i: i["files"]["a"].update(frames=4),
            r"files\['a'\].frames: expected 3, the sum of its segments' frames, got 4",
        ),
        (lambda i: i["files"]["a"].update(segments=[]), r"files\['a'\].segments: expected at least one segment"),
        (
            lambda i: i["files"]["a"]["segments"][0].update(group="g7"),
            r"files\['a'\].segments\[0\].group: expected a group of shard-00000.safetensors \(\['g0'\]\), got 'g7'",
        ),
        (
            lambda i: i["files"]["a"]["segments"][0].update(shard="shard-00001.safetensors"),
            r"segments\[0\].shard: expected a shard listed in 'shards'",
        ),
        (lambda i: i["files"]["a"]["segments"][0].update(extra=1), r"segments\[0\]: expected an object with keys"),
        (lambda i: i.update(extra=1), r"index: expected an object with keys"),
        (lambda i: i.update(files=[]), r"files: expected an object, got \[\]"),
        (lambda i: i.update(metadata="x"), r"metadata: expected an object"),
        (
            lambda i: i["shards"][SHARD]["groups"].update(h0=i["shards"][SHARD]["groups"]["g0"]),
            r"groups: expected group names like 'g0', got 'h0'",
        ),
    ],
)
def test_counts_and_references_must_agree(tmp_path, change, match):
    out = save(tmp_path)
    edit(out, change)
    with pytest.raises(DatasetError, match=match):
        tdgather.open(out)


LAYOUT = r"shards\['shard-00000.safetensors'\].groups\['g0'\]"


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda g: g.update(kind="blob"), r"\.kind: expected 'tensor' or 'tree'"),
        (lambda g: g.update(cls=5), r"\.cls: expected a string"),
        (lambda g: g["leaves"][0].update(dtype="complex128"), r"\.leaves\[0\].dtype: expected a supported dtype name"),
        (lambda g: g["leaves"][0].update(shape=[-1]), r"\.leaves\[0\].shape\[0\]: expected an integer"),
        (lambda g: g["leaves"][0].update(path=["x"]), r": expected one tensor leaf at the root for kind 'tensor'"),
        (
            lambda g: g.update(kind="tree", leaves=[{**g["leaves"][0], "path": p} for p in (["x"], ["x", "y"])]),
            r"\.leaves: expected distinct non-empty paths, none inside another",
        ),
        (
            lambda g: g.update(kind="tree", leaves=[{**g["leaves"][0], "path": ["x"]}], json=[["x"]]),
            r"\.leaves: expected distinct non-empty paths",
        ),
        (lambda g: g.update(kind="tree"), r"\.leaves: expected distinct non-empty paths"),
        (lambda g: g.pop("json"), r": expected an object with keys \['cls', 'json', 'kind', 'leaves'\]"),
    ],
)
def test_layouts_are_validated_like_wire_layouts(tmp_path, change, match):
    out = save(tmp_path)
    edit(out, lambda index: change(index["shards"][SHARD]["groups"]["g0"]))
    with pytest.raises(DatasetError, match=LAYOUT + match):
        tdgather.open(out)


def test_segment_start_or_frames_beyond_the_shard_rows_are_refused(tmp_path):
    out = save(tmp_path)
    edit(out, lambda i: i["files"]["a"]["segments"][0].update(start=1))
    ds = tdgather.open(out)  # the index alone cannot know the rows: the shard header does
    with pytest.raises(
        DatasetError,
        match=r"tdgather.index.json: files\['a'\].segments\[0\]: expected start \+ frames <= 3, "
        r"the rows of g0 in shard-00000.safetensors, got 4",
    ):
        ds["a"]
    out = save(tmp_path, name="more")

    def grow(index):  # 5 frames everywhere, consistently: only the shard disagrees
        index["files"]["a"]["segments"][0]["frames"] = index["files"]["a"]["frames"] = 5
        index["shards"][SHARD]["frames"] = index["metadata"]["total_frames"] = 5
        index["shards"][SHARD]["bytes"] = index["metadata"]["total_bytes"] = 40

    edit(out, grow)
    with pytest.raises(DatasetError, match=r"segments\[0\]: expected start \+ frames <= 3.*got 5"):
        read_all(out)


def test_overlapping_segments_are_refused(tmp_path):
    out = save(tmp_path, frames(("a", "b")))
    edit(out, lambda i: i["files"]["b"]["segments"][0].update(start=2))
    with pytest.raises(
        DatasetError,
        match=r"files\['b'\].segments\[0\].start: expected a start >= 3, "
        r"where files\['a'\].segments\[0\] of the same group ends, got 2",
    ):
        tdgather.open(out)


def test_segments_of_one_filename_must_share_a_layout(tmp_path):
    w = DatasetWriter(tmp_path / "ds")
    w.write(frames(("a",)))
    w.write(tdgather.gather({"a": (7, value("a", 7, (2,))), "c": (0, torch.ones(4, dtype=torch.int16))}))
    out = w.commit()
    assert (
        tdgather.open(out).index["shards"]["shard-00001.safetensors"]["groups"]["g1"]["leaves"][0]["dtype"] == "int16"
    )
    edit(out, lambda i: i["files"]["a"]["segments"][1].update(group="g1"))
    with pytest.raises(
        DatasetError,
        match=r"files\['a'\].segments\[1\].group: expected the layout of the earlier segments, float32\[2\] \(or "
        r"one that differs only in a leaf's first dim\), got 'g1'",
    ):
        tdgather.open(out)
    edit(out, lambda i: i.update(version=5) or i.pop("schema"))  # before 6, a filename's segments have one layout
    with pytest.raises(DatasetError, match=r"expected the layout of the earlier segments, float32\[2\], got 'g1'"):
        tdgather.open(out)


def test_long_and_hostile_filenames_are_named_short_in_errors(tmp_path):
    out = save(tmp_path, frames(("y" * 2000,)))
    edit(out, lambda i: i["files"]["y" * 2000].update(frames=9))
    with pytest.raises(
        DatasetError, match=r"files\['yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy'\.\.\.\]\.frames: expected 3"
    ) as e:
        tdgather.open(out)
    assert len(str(e.value)) < 400


def test_incomplete_index_failure_is_checked(tmp_path):
    w = DatasetWriter(tmp_path / "ds")
    w.write(frames())
    partial = w.abort(ValueError("x"))
    edit(partial, lambda i: i["metadata"]["failure"].update(rank="0"), INCOMPLETE_NAME)
    with pytest.raises(DatasetError, match=r"tdgather.incomplete.json: metadata.failure.rank: expected an integer"):
        tdgather.open(tmp_path / "ds", incomplete=True)
    edit(partial, lambda i: i["metadata"]["failure"].pop("rank"), INCOMPLETE_NAME)
    with pytest.raises(
        DatasetError, match=r"metadata.failure: expected an object with keys \['message', 'rank', 'type'\]"
    ):
        tdgather.open(tmp_path / "ds", incomplete=True)
    edit(partial, lambda i: i["metadata"].pop("failure"), INCOMPLETE_NAME)  # the attempts still say it
    assert tdgather.open(tmp_path / "ds", incomplete=True).metadata["failure"]["type"] == "ValueError"


# ---- shards ------------------------------------------------------------------------------------------


def test_a_truncated_shard_is_refused(tmp_path):
    out = save(tmp_path)
    raw = (out / SHARD).read_bytes()
    (out / SHARD).write_bytes(raw[: len(raw) // 2])
    with pytest.raises(
        DatasetError, match=r"shard-00000.safetensors: header: expected a readable safetensors file, got"
    ):
        read_all(out)


@pytest.mark.parametrize(
    "raw", [b"", b"not safetensors at all", struct.pack("<Q", 2**40) + b"{}", struct.pack("<Q", 2) + b"[]"]
)
def test_a_shard_that_is_not_safetensors_is_refused(tmp_path, raw):
    out = save(tmp_path)
    (out / SHARD).write_bytes(raw)
    with pytest.raises(DatasetError, match=r"shard-00000.safetensors: header: expected a readable safetensors file"):
        read_all(out)


@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda m: m.update(groups=m["groups"].replace("float32", "float64")),
            r"__metadata__.groups: expected the groups the index lists for this shard",
        ),
        (lambda m: m.update(groups="{"), r"__metadata__.groups: expected strict UTF-8 JSON"),
        (lambda m: m.pop("groups"), r"__metadata__.groups: expected a string, got None"),
        (lambda m: m.update(format="other"), r"__metadata__.format: expected 'tdgather', got 'other'"),
    ],
)
def test_a_shard_whose_metadata_disagrees_with_the_index_is_refused(tmp_path, change, match):
    out = save(tmp_path)
    rewrite_shard(out / SHARD, metadata=change)
    with pytest.raises(DatasetError, match=r"shard-00000.safetensors: " + match):
        read_all(out)


@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda t: t.update({"g0": t["g0"].double()}),
            r"g0: expected float32\[3, 2\], got 'float64\[3, 2\]'",
        ),
        (
            lambda t: t.update({"g0": t["g0"][:, :1]}),
            r"g0: expected float32\[3, 2\], got 'float32\[3, 1\]'",
        ),
        (lambda t: t.pop("g0:frame_idx"), r"g0:frame_idx: expected int64\[N\], got 'no such tensor'"),
        (
            lambda t: t.update({"g0:frame_idx": t["g0:frame_idx"].int()}),
            r"g0:frame_idx: expected int64\[N\], got 'int32\[3\]'",
        ),
        (
            lambda t: t.update({"g0:frame_idx": t["g0:frame_idx"][:, None]}),
            r"g0:frame_idx: expected int64\[N\], got 'int64\[3, 1\]'",
        ),
        (
            lambda t: t.update({k: v[:2] for k, v in t.items()}),
            r"tdgather.index.json: files\['a'\].segments\[0\]: expected start \+ frames <= 2",
        ),
    ],
)
def test_shard_tensors_must_match_the_layout(tmp_path, change, match):
    out = save(tmp_path)
    rewrite_shard(out / SHARD, tensors=change)
    with pytest.raises(DatasetError, match=match):
        read_all(out)


def _json_shard(tmp_path):
    out = save(tmp_path, nested())
    assert tdgather.open(out).layout("nested.mp4").nontensor == (("meta", "label"), ("meta", "ok"))
    return out


@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda o: o[1:3].copy_(o[1:3].flip(0).clone()),
            r"g0.meta.label:offsets: expected non-decreasing offsets in 0..15 \(rows 0..3\)",
        ),
        (
            lambda o: o[3].fill_(14),
            r"g0.meta.label:offsets: expected first and last offsets \[0, 15\] \(the blob's length\), got \[0, 14\]",
        ),
        (lambda o: o[0].fill_(-1), r"g0.meta.label:offsets: expected first and last offsets \[0, 15\]"),
        (lambda o: o[1].fill_(99), r"g0.meta.label:offsets: expected non-decreasing offsets in 0..15"),
        (lambda o: o[1].fill_(-5), r"g0.meta.label:offsets: expected non-decreasing offsets in 0..15"),
    ],
)
def test_json_offsets_out_of_order_are_refused(tmp_path, change, match):
    out = _json_shard(tmp_path)
    rewrite_shard(out / SHARD, tensors=lambda t: change(t["g0.meta.label:offsets"]))
    with pytest.raises(DatasetError, match=r"shard-00000.safetensors: " + match):
        read_all(out)


@pytest.mark.parametrize(
    "line, match",
    [
        (
            b"[12]\n",
            r"g0.meta.label row 1: expected a JSON scalar \(str, int, finite float, bool or null\), got \[12\]",
        ),
        (b'"l1 \n', r"g0.meta.label row 1: expected strict UTF-8 JSON"),
        (b'"\xff" \n', r"g0.meta.label row 1: expected strict UTF-8 JSON"),
        (b"NaN \n", r"g0.meta.label row 1: expected strict UTF-8 JSON .*NaN is not JSON"),
        (b"1e999", r"g0.meta.label row 1: expected a JSON scalar .*got inf"),
        (b"1 2 \n", r"g0.meta.label row 1: expected strict UTF-8 JSON"),
    ],
)
def test_json_lines_must_be_json_scalars(tmp_path, line, match):
    out = _json_shard(tmp_path)
    assert len(line) == 5  # '"l1"\n': the offsets stay right

    def put(t):
        blob = bytearray(t["g0.meta.label"].numpy().tobytes())
        assert blob[5:10] == b'"l1"\n'
        blob[5:10] = line
        t["g0.meta.label"] = torch.frombuffer(blob, dtype=torch.uint8).clone()

    rewrite_shard(out / SHARD, tensors=put)
    with pytest.raises(DatasetError, match=r"shard-00000.safetensors: " + match):
        read_all(out)


def test_a_tensorclass_that_no_longer_fits_is_read_as_a_tensordict(tmp_path):
    out = save(tmp_path, nested())
    cls = "tdgather.core.frames:Frames"  # imported, a tensorclass, with other fields
    edit(out, lambda i: [x.update(cls=cls) for x in (i["shards"][SHARD]["groups"]["g0"], *i["schema"])])

    def meta(m):
        groups = json.loads(m["groups"])
        groups["g0"]["cls"] = cls
        m["groups"] = json.dumps(groups)

    rewrite_shard(out / SHARD, metadata=meta)
    with pytest.warns(UserWarning, match=r"'tdgather.core.frames:Frames': it has no field \['depth', 'meta'\]"):
        got = read_all(out)["nested.mp4"].frames
    assert type(got) is TensorDict and sorted(got.keys()) == ["depth", "meta"]


# ---- fuzz: whatever is on disk, a DatasetError or frames consistent with the index ------------------


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    w = DatasetWriter(root / "ds")
    w.write(
        tdgather.gather({"a": [(j, value("a", j, (2,))) for j in range(3)], "": (0, torch.ones(2, dtype=torch.int16))})
    )
    w.write(nested())
    w.write(tdgather.gather({"a": [(j, value("a", j, (2,))) for j in (7, 4)], "../x": (1, torch.zeros(()))}))
    return w.commit({"user": {"model": {"name": "m", "epochs": [1, 2]}, "note": None}})


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**64)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
_interesting = st.sampled_from(
    [
        -1,
        0,
        1,
        2,
        3,
        4,
        5,
        7,
        8,
        24,
        2**62,
        2**63,
        1.0,
        True,
        False,
        None,
        "1",
        "",
        "g0",
        "g1",
        "g2",
        "float32",
        "int16",
        "tensor",
        "tree",
        SHARD,
        "shard-00001.safetensors",
        "shard-00002.safetensors",
        "shard-00003.safetensors",
        "../outside.safetensors",
        "/etc/passwd",
        "sub/shard-00000.safetensors",
        [],
        {},
        ["meta"],
        [0],
    ]
).map(copy.deepcopy)  # a fresh [] or {} each time: never one shared by two examples


def _nodes(obj, path=()):
    yield path
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from _nodes(v, (*path, k))


def _mutate(data, obj):
    """Replace, nudge, delete or copy a random node of a JSON document, or add a key; return the document."""
    paths = list(_nodes(obj))[1:]
    if not paths:
        return data.draw(_json_values)
    path = data.draw(st.sampled_from(paths))
    parent = obj
    for k in path[:-1]:
        parent = parent[k]
    node = parent[path[-1]]
    action = data.draw(st.sampled_from(["replace", "replace", "nudge", "delete", "copy", "add"]))
    if action == "add" and isinstance(node, dict):
        k = data.draw(st.text(max_size=5) | st.sampled_from(["frames", "g9", SHARD, "../outside.safetensors"]))
        node[k] = data.draw(_interesting | _json_values)
    elif action == "nudge" and type(node) is int:
        parent[path[-1]] = node + data.draw(st.sampled_from([-2, -1, 1, 2]))
    elif action == "delete":
        del parent[path[-1]]
    elif action == "copy" and isinstance(parent, list):
        parent.insert(data.draw(st.integers(0, len(parent))), json.loads(json.dumps(node)))
    else:
        parent[path[-1]] = data.draw(_interesting | _json_values)
    return obj


_SAME_SIZE = {
    1: ["U8", "I8", "BOOL", "F8_E4M3"],
    2: ["F16", "BF16", "I16"],
    4: ["F32", "I32", "U32"],
    8: ["I64", "F64", "U64"],
}


def _mutate_tensor(data, head):
    """Change a tensor entry so that safetensors still accepts it: same-size dtype, same-numel shape, or a rename."""
    codes = {code: size for size, same in _SAME_SIZE.items() for code in same}
    names = sorted(
        k
        for k, e in head.items()
        if isinstance(e, dict)
        and isinstance(e.get("dtype"), str)
        and e["dtype"] in codes
        and isinstance(e.get("shape"), list)
        and all(type(d) is int and d >= 0 for d in e["shape"])
    )
    if not names:
        return _mutate(data, head)
    name = data.draw(st.sampled_from(names))
    entry = head[name]
    action = data.draw(st.sampled_from(["dtype", "shape", "rename"]))
    if action == "dtype":
        entry["dtype"] = data.draw(st.sampled_from(_SAME_SIZE[codes[entry["dtype"]]]))
    elif action == "shape":
        n = math.prod(entry["shape"])
        entry["shape"] = data.draw(
            st.sampled_from([[n], [n, 1], [1, n], [n, 1, 1], [2, n // 2] if n % 2 == 0 else [n]])
        )
    else:
        other = data.draw(st.sampled_from(names))
        head[name], head[other] = head[other], head[name]
    return head


def _parsed(meta):
    """The groups of a (mutated) shard ``__metadata__``, or None."""
    try:
        return json.loads(meta["groups"]) if isinstance(meta, dict) and isinstance(meta.get("groups"), str) else None
    except ValueError:
        return None


def _read_consistently(out):
    with Opens() as opens:
        try:
            ds = tdgather.open(out)
            for name in ds:
                got = ds[name]
                n = ds.num_frames(name)
                assert got.frame_idx.shape == (n,) and got.batch_size == torch.Size([n])
                assert n == sum(s["frames"] for s in ds.index["files"][name]["segments"])
        except DatasetError:
            pass
    assert opens.inside(out), opens.paths


@contextlib.contextmanager
def _copy(base):
    """A fresh copy of the base dataset to damage, with a valid shard just outside it; removed after."""
    work = Path(tempfile.mkdtemp(prefix="tdg-fuzz-"))
    try:
        shutil.copy(next(base.glob("shard-*")), work / "outside.safetensors")  # valid, and outside
        yield Path(shutil.copytree(base, work / "ds"))
    finally:
        shutil.rmtree(work)


def _a_shard(data, out):
    return out / data.draw(st.sampled_from(sorted(p.name for p in out.glob("shard-*"))))


_FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_FUZZ
@given(st.data())
def test_fuzz_a_mutated_index(base, data):
    with _copy(base) as out:
        index = load_index(out)
        for _ in range(data.draw(st.integers(1, 3))):
            index = _mutate(data, index)
        text = json.dumps(index, ensure_ascii=False)
        if data.draw(st.integers(0, 9)) == 0:  # sometimes raw text damage too
            cut = data.draw(st.integers(0, len(text)))
            text = (
                text[:cut] + data.draw(st.sampled_from(["", "NaN", '"format": 1,', "}", "\x00", "\ud800"])) + text[cut:]
            )
        (out / INDEX_NAME).write_bytes(text.encode("utf-8", "surrogatepass"))
        _read_consistently(out)


@_FUZZ
@given(st.data())
def test_fuzz_a_mutated_shard_header(base, data):
    with _copy(base) as out:
        shard = _a_shard(data, out)
        head, rest = header(shard)
        for _ in range(data.draw(st.integers(1, 3))):
            meta = head.get("__metadata__") if isinstance(head, dict) else None
            action = data.draw(st.sampled_from(["tensor", "tensor", "groups", "any"]))
            if action == "tensor" and isinstance(head, dict) and len(head) > 1:
                head = _mutate_tensor(data, head)
            elif action == "groups" and isinstance(_parsed(meta), dict):
                meta["groups"] = json.dumps(_mutate(data, _parsed(meta)))  # inside the JSON string
            else:
                head = _mutate(data, head)
        write_header(shard, head, rest)
        _read_consistently(out)


@_FUZZ
@given(st.data())
def test_fuzz_damaged_shard_bytes(base, data):
    with _copy(base) as out:
        shard = _a_shard(data, out)
        raw = bytearray(shard.read_bytes())
        data_start = 8 + struct.unpack("<Q", raw[:8])[0]
        for _ in range(data.draw(st.integers(1, 4))):
            at = data.draw(st.integers(data_start, len(raw) - 1) | st.integers(0, len(raw) - 1))
            raw[at] = data.draw(st.integers(0, 255))
        if data.draw(st.booleans()):
            raw = raw[: data.draw(st.integers(0, len(raw)))]
        shard.write_bytes(bytes(raw))
        _read_consistently(out)


def test_fuzz_base_dataset_reads(base):
    got = read_all(base)
    assert got["a"].frame_idx.tolist() == [0, 1, 2, 4, 7] and math.isclose(float(got[""].frames.sum()), 2.0)
    assert got["nested.mp4"].frames["meta", "ok"] == [True, False, True]


def test_swapped_shard_files_are_refused(tmp_path):
    w = DatasetWriter(tmp_path / "ds", max_shard_bytes=1)  # one filename per shard, same layout
    w.write(
        tdgather.gather(
            {
                "v0.mp4": [(j, torch.full((2,), 0.0)) for j in range(5)],
                "v1.mp4": [(j, torch.full((2,), 1.0)) for j in range(5)],
            }
        )
    )
    out = w.commit()
    a, b = out / "shard-00000.safetensors", out / "shard-00001.safetensors"
    a.rename(out / "tmp")
    b.rename(a)
    (out / "tmp").rename(b)
    with pytest.raises(DatasetError, match=r"__metadata__.shard: expected 'shard-00000.safetensors' \(its own name"):
        tdgather.open(out)["v0.mp4"]


def test_repeated_or_unordered_frame_idx_in_a_shard_is_refused(tmp_path):
    out = save(tmp_path, frames(n=4))
    tensors = load_file(out / SHARD)
    tensors["g0:frame_idx"][1] = tensors["g0:frame_idx"][0]
    save_file(tensors, out / SHARD, metadata=safe_open(out / SHARD, "pt").metadata())
    with pytest.raises(
        DatasetError,
        match=r"files\['a'\] frame_idx: expected strictly increasing indices, each frame "
        r"once \(rows 0 and 1\), got \[0, 0\]",
    ):
        tdgather.open(out)["a"]


# ---- tensor names (index version 2) and version 1 datasets ------------------------------------

V1 = Path(__file__).parent / "fixtures" / "v1_dataset"


def test_a_version_1_dataset_still_reads(tmp_path):
    """tests/fixtures/v1_dataset was written by index version 1 (leaves named g0.leaf<j>), in two segments."""
    ds = tdgather.open(V1)
    assert ds.index["version"] == 1 and sorted(ds) == ["clip.mp4", "plain.mp4"]
    clip = ds["clip.mp4"]
    assert clip.frame_idx.tolist() == [0, 1, 2]
    depth = torch.stack(
        [torch.arange(6.0).reshape(2, 3), torch.full((2, 3), -1.0), torch.arange(6.0, 12.0).reshape(2, 3)]
    )
    assert torch.equal(clip.frames["depth"], depth)
    assert list(clip.frames["label"]) == ["cat", "emu", "dog"]
    boxes = clip.frames["boxes"]
    assert boxes.offsets().tolist() == [0, 2, 5, 5]
    assert torch.equal(
        boxes.values(), torch.cat([torch.arange(8.0).reshape(2, 4), torch.arange(100.0, 112).reshape(3, 4)])
    )
    assert ds.lengths("clip.mp4")["boxes"].tolist() == [2, 3, 0]
    plain = ds["plain.mp4"]
    assert plain.frame_idx.tolist() == [0, 1] and plain.frames.dtype == torch.int16
    assert plain.frames.tolist() == [[3, 4, 5], [0, 1, 2]]
    ds.verify()
    copy_ = shutil.copytree(V1, tmp_path / "v1")  # a v1 shard claiming version 2 names is refused, naming the tensor
    rewrite_shard(copy_ / "shard-00001.safetensors", metadata=lambda m: m.update(version="2"))
    with pytest.raises(DatasetError, match=r"shard-00001.safetensors: g0:frame_idx: expected int64\[N\], got 'no such"):
        tdgather.open(copy_)["clip.mp4"]


def test_tensor_names_say_what_is_inside_and_never_collide(tmp_path):
    keys = {
        "depth": torch.ones(2),
        "det": {"boxes": torch.ones(3, 4)},
        "d.x": torch.zeros(1),
        "a:b": torch.ones(1),
    }
    keys |= {"50%": torch.ones(1), "": torch.ones(1), "é": torch.ones(1), "label": "x", "frame_idx": torch.ones(1)}
    out = tdgather.save(
        tdgather.gather({"v.mp4": [(0, keys)], "p.mp4": (0, torch.ones(3))}, ragged=["det.boxes"]), tmp_path / "ds"
    )
    with safe_open(out / SHARD, framework="pt") as f:
        names = set(f.keys())
        assert f.metadata()["version"] == "2"
    group = {n.split(".")[0].split(":")[0] for n in names if "det" in n}.pop()
    other = ({"g0", "g1"} - {group}).pop()
    assert {n.removeprefix(group) for n in names if n.split(".")[0].split(":")[0] == group} == {
        ":frame_idx",
        ".depth",
        ".det.boxes",
        ".det.boxes:offsets",
        ".d%2Ex",
        ".a%3Ab",
        ".50%25",
        ".%",
        ".%C3%A9",
        ".label",
        ".label:offsets",
        ".frame_idx",
    }
    assert names - {n for n in names if n.startswith(group)} == {other, f"{other}:frame_idx"}  # a plain tensor
    got = tdgather.open(out)["v.mp4"].frames[0]
    for k in ["depth", "d.x", "a:b", "50%", "", "é", "frame_idx"]:
        assert torch.equal(got[k], keys[k]), k
    assert torch.equal(got["det", "boxes"], keys["det"]["boxes"]) and got["label"] == "x"


def test_an_unknown_shard_version_is_refused(tmp_path):
    out = save(tmp_path)
    rewrite_shard(out / SHARD, metadata=lambda m: m.update(version="3"))
    with pytest.raises(DatasetError, match=r"__metadata__.version: expected '1' or '2', got '3'"):
        read_all(out)


# ---- a handle and a rewrite of its path: the rows it opened, or a DatasetError; never another run's ----

RUN_NAMES = [f"f{i:02d}.jpg" for i in range(12)]
PER_SHARD = 3  # filenames a shard holds (max_shard_bytes below): 4 shards, named alike in every run


def run_frames(tag: int):
    """Every frame's values say its run (``tag``), filename and frame: another run's rows never pass for ours."""
    return tdgather.gather(
        {n: [(j, torch.full((2,), tag * 1000.0 + i * 10 + j)) for j in range(3)] for i, n in enumerate(RUN_NAMES)}
    )


def expected_rows(tag: int, name: str) -> list:
    i = RUN_NAMES.index(name)
    return [[tag * 1000.0 + i * 10 + j] * 2 for j in range(3)]


SHARD_BYTES = PER_SHARD * 3 * (8 + 8)  # 3 frames of float32[2] and their int64 frame_idx, per filename


def rewrite(path: Path, how: str, tag: int) -> None:
    """Replace the dataset at ``path`` with run ``tag``'s, as a user would: save or a Collector, overwrite=True."""
    if how == "save":
        tdgather.save(run_frames(tag), path, overwrite=True, max_shard_bytes=SHARD_BYTES)
        return
    with tdgather.Collector(path, overwrite=True, max_shard_bytes=SHARD_BYTES, progress=False) as col:
        for name in RUN_NAMES:
            col.add([name] * 3, [0, 1, 2], torch.tensor(expected_rows(tag, name)))


def old_or_refused(ds, name: str) -> str:
    """``"old"`` when ``ds[name]`` gives run 1's rows, ``"refused"`` for a DatasetError naming the changed shard."""
    try:
        got = ds[name]
    except DatasetError as e:
        assert re.search(r"shard-0000\d\.safetensors: __metadata__\.run: expected run '[0-9a-f]+', the index's", str(e))
        assert "rewritten (overwrite=True) since it was opened" in str(e)
        return "refused"
    assert got.frame_idx.tolist() == [0, 1, 2] and got.frames.tolist() == expected_rows(1, name), name
    return "old"


@pytest.mark.parametrize("how", ["save", "collector"])
def test_a_handle_never_reads_another_runs_rows_after_a_rewrite(tmp_path, how):
    path = tdgather.save(run_frames(1), tmp_path / "ds", max_shard_bytes=SHARD_BYTES)
    shards = sorted(p.name for p in path.glob("shard-*"))
    assert len(shards) == 4
    cached = tdgather.open(path)
    read_before = RUN_NAMES[: 2 * PER_SHARD]  # the first two shards opened before the rewrite
    assert [old_or_refused(cached, n) for n in read_before] == ["old"] * len(read_before)
    lazy = tdgather.open(path)  # nothing read before the rewrite
    rewrite(path, how, 2)
    assert sorted(p.name for p in path.glob("shard-*")) == shards  # the same file names, other rows
    assert tdgather.open(path)["f00.jpg"].frames.tolist() == expected_rows(2, "f00.jpg")
    got = {n: old_or_refused(cached, n) for n in RUN_NAMES}
    assert got == {n: "old" if n in read_before else "refused" for n in RUN_NAMES}
    assert {n: old_or_refused(lazy, n) for n in RUN_NAMES} == dict.fromkeys(RUN_NAMES, "refused")
    with pytest.raises(DatasetError, match=r"shard-00000.safetensors: __metadata__.run"):
        lazy.verify()


def test_a_shard_closed_to_bound_open_files_is_checked_again_when_reopened(tmp_path, monkeypatch):
    monkeypatch.setattr(tdgather.storage.reader, "OPEN_SHARDS", 1)
    path = tdgather.save(run_frames(1), tmp_path / "ds", max_shard_bytes=SHARD_BYTES)
    ds = tdgather.open(path)
    assert old_or_refused(ds, "f00.jpg") == old_or_refused(ds, "f03.jpg") == "old"  # shard 1 open, shard 0 closed
    rewrite(path, "save", 2)
    assert old_or_refused(ds, "f04.jpg") == "old"  # still open: still run 1's
    assert old_or_refused(ds, "f00.jpg") == "refused"  # reopened: checked again
    assert old_or_refused(ds, "f00.jpg") == "refused"  # and again: a refused shard is never kept open
    assert old_or_refused(ds, "f05.jpg") == "old"  # so shard 1 stayed open


def test_an_older_index_refuses_a_shard_of_a_run(tmp_path):
    """A version 1 dataset's handle, rewritten by this tdgather: its shards now carry a run, the index none."""
    path = shutil.copytree(V1, tmp_path / "v1")
    ds = tdgather.open(path)
    tdgather.save(tdgather.gather({"clip.mp4": [(j, torch.ones(2)) for j in range(3)]}), path, overwrite=True)
    with pytest.raises(DatasetError, match=r"shard-00000.safetensors: __metadata__.run: expected no run, as in an ind"):
        ds["plain.mp4"]


def test_an_index_of_version_3_must_name_its_run(tmp_path):
    out = save(tmp_path)
    edit(out, lambda index: index["metadata"].pop("run"))
    with pytest.raises(DatasetError, match=r"tdgather.index.json: metadata.run: expected a string, got None"):
        tdgather.open(out)
    edit(out, lambda index: index["metadata"].update(run="another"))
    with pytest.raises(DatasetError, match=r"shard-00000.safetensors: __metadata__.run: expected run 'another'"):
        tdgather.open(out)["a"]


def _type(shape):
    return {"kind": "tensor", "cls": None, "leaves": [{"path": [], "dtype": "float32", "shape": shape}], "json": []}


@pytest.mark.parametrize(
    "schema, match",
    [
        ([], r"schema: expected one type that frames stored as float32\[2\] read as, got 'none'"),
        ([_type([3])], r"schema: expected one type that frames stored as float32\[2\] read as, got 'none'"),
        ([_type([2]), _type([2])], r"got 'float32\[2\] and float32\[2\]'"),
        ([_type([2]), _type([3])], r"schema\[1\]: expected a type some group's frames read as, got 'float32\[3\]'"),
        ("x", r"schema: expected a list"),
        ([_type([2]) | {"kind": "bogus"}], r"schema\[0\].kind: expected 'tensor' or 'tree', got 'bogus'"),
    ],
)
def test_a_schema_edited_by_hand_is_refused_naming_the_field(tmp_path, schema, match):
    out = save(tmp_path)
    assert load_index(out)["schema"] == [_type([2])]
    edit(out, lambda i: i.update(schema=schema))
    with pytest.raises(DatasetError, match=match):
        tdgather.open(out)
    edit(out, lambda i: i.pop("schema"))
    with pytest.raises(DatasetError, match=r"index: expected an object with keys \['files', 'format', 'metadata', "):
        tdgather.open(out)
