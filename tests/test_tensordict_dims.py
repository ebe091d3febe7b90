"""A TensorDict's batch dims past the frames' ([B, 3] -> [3] a frame) kept, and tensorclasses that changed since.

- Multi-crop batches (TensorDicts and a tensorclass of batch size ``[B, 3]``) through `gather` + `save`
  and through a `Collector`, in real gloo worlds: read back with batch size ``[T, 3]``, bit-exact.
- The layout description's ``batch_dims``: absent when empty (datasets written before are unchanged),
  and checked as hostile input from a file or a peer.
- A tensorclass whose class changed (a field renamed) or is not defined in the reading process: a
  TensorDict, with a warning naming the class and why; ``tdgather.open(path, tensorclass=False)``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from tensordict import NonTensorStack, TensorDict, tensorclass

import tdgather
from tdgather import DatasetError, ProtocolError, ShapeMismatchError
from tdgather.core.checks import ProtocolCheck, decode_layout
from tdgather.format.names import INDEX_NAME
from tdgather.tools.launch import run_local_world

from . import tdims_cases as tc
from .procs import finish
from .test_reader import SHARD, edit, rewrite_shard
from .test_torchrun import torchrun

# ---- in real gloo worlds -----------------------------------------------------------------------


@pytest.mark.world
def test_multicrop_batches_through_gather_and_save_keep_their_crop_dim(tmp_path):
    # 5 files x 7 frames (4 of TensorDicts, 1 of the tensorclass), batches of 4, one padded copy
    out = run_local_world(tc.case_gather_save, 2, str(tmp_path / "ds"), 5, 7, 4, timeout=180)[0]
    assert out == {"frames": 35, "duplicates": 1, "batch_dims": [[3]]}


@pytest.mark.world
def test_multicrop_batches_through_a_collector_keep_their_crop_dim(tmp_path):
    # 5 files x 13 frames over 2 ranks: 65 frames, one padded copy; a budget small enough for many shards
    out = run_local_world(tc.case_collector, 2, str(tmp_path / "ds"), 5, 13, 4, 16 << 10, timeout=180)[0]
    assert out["shards"] > 1 and out["segments"] > 1
    assert out["duplicates"] == 1


WRITER = """
import os

import torch
import torch.distributed as dist
from tensordict import tensorclass

import tdgather


@tensorclass
class Pred:
    logits: torch.Tensor
    score: torch.Tensor


dist.init_process_group("gloo")
rank = dist.get_rank()
x = torch.arange(5 * 3 * 4, dtype=torch.float32).view(5, 3, 4) + 1000 * rank
pred = Pred(logits=x, score=x.sum(-1), batch_size=[5, 3])  # 5 frames of 3 crops
with tdgather.Collector(os.environ["OUT"], overwrite=True, progress=False) as col:
    col.add(f"video_{rank}.mp4", torch.arange(5), pred)
dist.destroy_process_group()
"""

READER = """
import json
import os
import sys
import warnings

import torch
from tensordict import tensorclass

import tdgather

if sys.argv[1] == "renamed":

    @tensorclass
    class Pred:
        logits: torch.Tensor
        confidence: torch.Tensor  # was score

else:

    @tensorclass
    class Pred:
        logits: torch.Tensor
        score: torch.Tensor


out = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ds = tdgather.open(os.environ["OUT"], tensorclass=sys.argv[1] != "off")
    for rank, name in enumerate(sorted(ds)):
        f = ds[name].frames
        x = torch.arange(5 * 3 * 4, dtype=torch.float32).view(5, 3, 4) + 1000 * rank
        assert torch.equal(f.get("logits"), x) and torch.equal(f.get("score"), x.sum(-1)), name
        assert torch.equal(f[:, 0].get("logits"), x[:, 0]), name
        item = ds.per_frame()[5 * rank + 1]["frames"]
        out[name] = [type(f).__name__, list(f.batch_size), type(item).__name__, list(item.batch_size)]
out["warnings"] = sorted({str(w.message) for w in caught})
print("RESULT " + json.dumps(out))
"""


def _read(script: Path, out: Path, how: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(script), how],
        env={**os.environ, "OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.world
def test_a_tensorclass_read_by_a_process_that_renamed_a_field_is_a_tensordict(tmp_path):
    (tmp_path / "writer.py").write_text(WRITER, encoding="utf-8")
    (tmp_path / "reader.py").write_text(READER, encoding="utf-8")
    out = tmp_path / "preds"
    finish([torchrun("--standalone", "--nproc-per-node=2", str(tmp_path / "writer.py"), env={"OUT": str(out)})])

    same = _read(tmp_path / "reader.py", out, "same")  # the class as it was: rebuilt
    assert same["video_0.mp4"] == ["Pred", [5, 3], "Pred", [3]] and same["warnings"] == []

    renamed = _read(tmp_path / "reader.py", out, "renamed")
    assert renamed["video_1.mp4"] == ["TensorDict", [5, 3], "TensorDict", [3]]
    (warning,) = renamed["warnings"]  # one message, for both filenames and the per-frame items
    assert "tensorclass '__main__:Pred': it has no field ['score']" in warning, warning
    assert "its fields here: ['confidence', 'logits']" in warning and "tensorclass=False" in warning, warning

    off = _read(tmp_path / "reader.py", out, "off")  # the documented option: TensorDicts, no warning
    assert off["video_0.mp4"] == ["TensorDict", [5, 3], "TensorDict", [3]] and off["warnings"] == []

    # this process has no __main__.Pred at all
    with pytest.warns(UserWarning, match=r"'__main__:Pred': module '__main__' has no tensorclass 'Pred'"):
        frames = tdgather.open(out)["video_1.mp4"].frames
    assert type(frames) is TensorDict and frames.batch_size == (5, 3)


# ---- the layout description's batch_dims -------------------------------------------------------


def _crops(n: int = 2, dims=(3,)) -> TensorDict:
    return TensorDict({"x": torch.arange(n * 12.0).view(n, *dims, -1)}, batch_size=[n, *dims])


def test_a_tree_without_batch_dims_is_described_as_before(tmp_path):
    plain = tdgather.gather({"a": (0, TensorDict({"x": torch.ones(3)})), "b": (1, {"y": torch.zeros(2)})})
    out = tdgather.save(plain, tmp_path / "plain")
    assert "batch_dims" not in (out / INDEX_NAME).read_text(encoding="utf-8")
    assert "batch_dims" not in (out / SHARD).read_bytes()[:4096].decode("utf-8", "replace")


def test_every_batch_dim_past_the_frames_is_kept():
    store = tdgather.FrameStore()
    store.add("b", torch.arange(2), _crops(2, (2, 3)))
    frames = tdgather.gather(store)["b"].frames
    assert frames.batch_size == (2, 2, 3)  # every dim past the frames' is kept


def test_a_single_frame_tensordict_keeps_its_batch_size(tmp_path):
    frame = TensorDict({"x": torch.rand(3, 4), "label": "cat"}, batch_size=[3])  # one frame of 3 crops
    result = tdgather.gather({"a": [(0, frame), (1, frame)]})
    got = result["a"].frames
    assert got.batch_size == (2, 3) and got[1, 2]["label"] == "cat" and torch.equal(got[0]["x"], frame["x"])
    ds = tdgather.open(tdgather.save(result, tmp_path / "ds"))
    assert ds.layout("a").describe() == "{x: float32[3, 4], label: json} with batch dims [3]"
    assert ds["a"].frames.batch_size == (2, 3) and ds["a"].frames[:, 1]["label"] == ["cat", "cat"]


def test_a_filename_given_with_two_batch_sizes_of_the_same_leaves_is_refused():
    store = tdgather.FrameStore()
    store.add("a", torch.arange(2), _crops(2))
    flat = TensorDict({"x": torch.zeros(2, 3, 4)}, batch_size=[2])  # the same leaves, per-frame batch size []
    with pytest.raises(ShapeMismatchError, match=r"with batch dims \[3\]"):
        store.add("a", torch.arange(2, 4), flat)
    with pytest.raises(ShapeMismatchError, match=r"batch dims"):
        tdgather.gather({"b": [(0, TensorDict({"x": torch.zeros(3)}, [3])), (1, TensorDict({"x": torch.zeros(3)}))]})


def test_crop_counts_that_change_make_the_leaves_ragged_and_drop_the_dims():
    store = tdgather.FrameStore()
    store.add("a", torch.arange(2), _crops(2, (3,)))
    store.add("a", torch.arange(2, 4), TensorDict({"x": torch.zeros(2, 5, 4)}, batch_size=[2, 5]))
    frames = tdgather.gather(store)["a"].frames
    assert frames.batch_size == (4,) and frames["x"].is_nested  # as a dict's leaf whose first dim changes


def test_json_values_that_differ_within_a_frame_are_refused():
    same = TensorDict({"x": torch.zeros(3), "label": NonTensorStack("a", "a", "a")}, batch_size=[3])
    assert tdgather.gather({"a": (0, same)})["a"].frames[0, 2]["label"] == "a"  # one value for the frame
    differ = TensorDict({"x": torch.zeros(3), "label": NonTensorStack("a", "b", "a")}, batch_size=[3])
    with pytest.raises(tdgather.UnsupportedValueError, match=r"key 'label': a JSON leaf holds one value per frame"):
        tdgather.gather({"a": (0, differ)})


GOOD = {
    "kind": "tree",
    "cls": None,
    "leaves": [{"path": ["x"], "dtype": "float32", "shape": [3, 4]}],
    "json": [],
    "batch_dims": [3],
}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"batch_dims": "3"}, r"g\.batch_dims: expected a list"),
        ({"batch_dims": [3.0]}, r"g\.batch_dims\[0\]: expected an integer"),
        ({"batch_dims": [-3]}, r"g\.batch_dims\[0\]: expected an integer in 0\.\."),
        ({"batch_dims": [True]}, r"g\.batch_dims\[0\]: expected an integer"),
        ({"batch_dims": []}, r"g\.batch_dims: expected a non-empty list of dims \(or no such key\)"),
        ({"batch_dims": [4]}, r"g\.leaves\[0\]\.shape: expected a shape that starts with batch_dims \[4\]"),
        ({"batch_dims": [3, 4, 1]}, r"g\.leaves\[0\]\.shape: expected a shape that starts with batch_dims"),
        (
            {"leaves": [{"path": ["x"], "dtype": "float32", "shape": [4], "ragged": True}]},
            r"g\.leaves\[0\]\.ragged: expected no such key with batch_dims",
        ),
        (
            {"kind": "tensor", "leaves": [{"path": [], "dtype": "float32", "shape": [3, 4]}]},
            r"g\.batch_dims: expected no such key for kind 'tensor'",
        ),
    ],
)
def test_batch_dims_from_a_peer_are_checked(change, match):
    assert decode_layout(GOOD, ProtocolCheck(1), "g").batch_dims == (3,)
    with pytest.raises(ProtocolError, match=match):
        decode_layout({**GOOD, **change}, ProtocolCheck(1), "g")


@pytest.mark.parametrize(
    ("dims", "match"),
    [([4], r"leaves\[0\]\.shape"), (["3"], r"batch_dims\[0\]"), ([], r"batch_dims: expected a non-empty")],
)
def test_batch_dims_on_disk_are_checked(tmp_path, dims, match):
    store = tdgather.FrameStore()
    store.add("a", torch.arange(2), _crops(2))
    out = tdgather.save(tdgather.gather(store), tmp_path / "ds")

    def meta(m):
        groups = json.loads(m["groups"])
        groups["g0"]["batch_dims"] = dims
        m["groups"] = json.dumps(groups)

    edit(out, lambda i: i["shards"][SHARD]["groups"]["g0"].update(batch_dims=dims))
    rewrite_shard(out / SHARD, metadata=meta)
    with pytest.raises(DatasetError, match=r"tdgather\.index\.json: shards\[.*\]\.groups\['g0'\]\.(?:.*)" + match):
        tdgather.open(out)


# ---- tensorclasses that changed, and tensorclass=False -------------------------------------------


def test_a_tensorclass_of_a_module_not_imported_here_is_a_tensordict_with_a_warning(tmp_path):
    store = tdgather.FrameStore()
    store.add("a", torch.arange(2), tc.Crops(logits=torch.ones(2, 3, 5), emb=torch.zeros(2, 3, 1), batch_size=[2, 3]))
    out = tdgather.save(tdgather.gather(store), tmp_path / "ds")
    _name_class(out, "tdgather_never_imported.models:Crops")
    with pytest.warns(UserWarning, match=r"'tdgather_never_imported\.models:Crops': its module .* is not imported"):
        frames = tdgather.open(out)["a"].frames
    assert type(frames) is TensorDict and frames.batch_size == (2, 3)
    assert "tdgather_never_imported" not in sys.modules  # never imported by tdgather


def test_tensorclass_false_reads_every_tree_as_a_tensordict(tmp_path):
    store = tdgather.FrameStore()
    store.add("a", torch.arange(2), tc.Crops(logits=torch.ones(2, 3, 5), emb=torch.zeros(2, 3, 1), batch_size=[2, 3]))
    out = tdgather.save(tdgather.gather(store), tmp_path / "ds")
    assert type(tdgather.open(out)["a"].frames) is tc.Crops  # the class is imported here, as written
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = tdgather.open(out, tensorclass=False)
        frames, item = ds["a"].frames, ds.per_frame()[1]["frames"]
    assert type(frames) is TensorDict and frames.batch_size == (2, 3) and sorted(frames.keys()) == ["emb", "logits"]
    assert type(item) is TensorDict and item.batch_size == (3,)
    assert ds.layout("a").cls is None and ds.stored_layout("a").cls == "tests.tdims_cases:Crops"


@tensorclass
class Gained:  # `tc.Crops` with a field more, added after the frames were written
    logits: torch.Tensor
    emb: torch.Tensor
    extra: torch.Tensor


def test_a_tensorclass_that_gained_a_field_is_rebuilt_without_it(tmp_path):
    store = tdgather.FrameStore()
    store.add("a", torch.arange(2), tc.Crops(logits=torch.ones(2, 3, 5), emb=torch.zeros(2, 3, 1), batch_size=[2, 3]))
    out = tdgather.save(tdgather.gather(store), tmp_path / "ds")
    _name_class(out, f"{__name__}:Gained")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        frames = tdgather.open(out)["a"].frames
    assert type(frames) is Gained and frames.extra is None and torch.equal(frames.logits, torch.ones(2, 3, 5))


def _name_class(out: Path, cls: str) -> None:
    """Make the dataset's group ``g0`` name the tensorclass ``cls`` (in the index and in the shard)."""

    def meta(m):
        groups = json.loads(m["groups"])
        groups["g0"]["cls"] = cls
        m["groups"] = json.dumps(groups)

    edit(out, lambda i: [x.update(cls=cls) for x in (i["shards"][SHARD]["groups"]["g0"], *i["schema"])])
    rewrite_shard(out / SHARD, metadata=meta)
