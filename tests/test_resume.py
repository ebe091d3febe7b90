"""Resume (`Collector(resume=True)`, `tdgather.storage.resume`): a failed run continued gives the uninterrupted
run's dataset bit for bit, in real gloo worlds where a rank, or rank dst while writing, is SIGKILLed."""

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import tdgather
from tdgather import Saved, saved_at
from tdgather.errors import DatasetError, OutputError, ProtocolError
from tdgather.format.names import INCOMPLETE_NAME
from tdgather.tools.launch import WorldError, run_local_world

from . import resume_cases as rc
from .cases import bits, plain_read

WORLD = 3


def attempt(out: Path, resume: bool, kill: dict | None = None, **kw) -> list:
    """One attempt in a new world; with ``kill``, the world must fail and the killed rank exit by SIGKILL."""
    if kill is None:
        return run_local_world(rc.case_run, WORLD, str(out), resume, None, **kw, timeout=120)
    with pytest.raises(WorldError) as e:
        run_local_world(rc.case_run, WORLD, str(out), resume, kill, timeout=120)
    assert e.value.failures[kill["rank"]] == "exited with code -9 and no result", e.value.failures
    return e.value.results


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run."""
    out = tmp_path_factory.mktemp("ref") / "ds"
    attempt(out, resume=False)
    return out


def assert_same_dataset(got: Path, want: Path) -> None:
    a, b = tdgather.open(got), tdgather.open(want)
    assert sorted(a) == sorted(b) and len(a) == 6
    for name in b:
        x, y = a[name], b[name]
        assert torch.equal(x.frame_idx, y.frame_idx), name
        for leaf in ("depth", "feat"):
            assert x.frames[leaf].dtype == y.frames[leaf].dtype
            assert torch.equal(bits(x.frames[leaf]), bits(y.frames[leaf])), (name, leaf)
    assert_plain_safetensors_read(got, want)


def assert_plain_safetensors_read(got: Path, want: Path) -> None:
    """Read with safetensors and the index alone, as docs/format.md shows: the same frames."""
    a, b = plain_read(got), plain_read(want)
    assert a.keys() == b.keys()
    for name in a:
        assert [i for i, _ in a[name]] == [i for i, _ in b[name]]
        for (_, x), (_, y) in zip(a[name], b[name], strict=True):
            assert len(x) == 2 and all(torch.equal(u, v) for u, v in zip(x, y, strict=True))  # depth, feat


def attempts_of(out: Path) -> list[dict]:
    return tdgather.open(out).metadata["attempts"]


def test_a_rank_killed_mid_run_then_resumed_equals_the_uninterrupted_run(tmp_path, reference):
    out = tmp_path / "ds"
    attempt(out, resume=False, kill={"rank": 1, "batch": 4})
    partial = tmp_path / "ds.partial"
    record = tdgather.open(out, incomplete=True).metadata
    first = record["total_frames"]
    assert 0 < first < 87
    r = attempt(out, resume=True)
    assert {x["saved_frames"] for x in r} == {first}  # every rank was told the same
    assert sum(x["todo"] for x in r[:1]) == 87 - first
    assert_same_dataset(out, reference)
    assert not partial.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ds"]
    a = attempts_of(out)
    assert [x["attempt"] for x in a] == [1, 2] and a[0]["frames"] == first and a[1]["frames"] == 87 - first
    assert a[0]["failure"]["type"] == "PeerLostError" and a[0]["failure"]["rank"] == 1 and a[1]["failure"] is None
    assert tdgather.open(out).metadata["run"] == record["run"]  # one run, over both attempts


def test_rank_dst_killed_while_writing_then_resumed(tmp_path, reference):
    out = tmp_path / "ds"
    attempt(out, resume=False, kill={"rank": 0, "write": 4})
    partial = tmp_path / "ds.partial"
    names = sorted(p.name for p in partial.iterdir())
    assert [n for n in names if n.startswith("shard-")][:3] == [
        "shard-00000.safetensors",
        "shard-00001.safetensors",
        "shard-00002.safetensors",
    ]
    assert INCOMPLETE_NAME not in names and any(".tmp-" in n for n in names)  # killed: no record, half a file
    assert saved_at(out).num_frames > 0  # read back from the shards alone
    attempt(out, resume=True)
    assert_same_dataset(out, reference)
    a = attempts_of(out)
    assert a[0]["failure"]["type"] == "Unrecorded" and a[0]["frames"] > 0 and sum(x["frames"] for x in a) == 87


def test_resumed_twice(tmp_path, reference):
    out = tmp_path / "ds"
    attempt(out, resume=True, kill={"rank": 2, "batch": 2})  # resume=True with nothing saved: a fresh run
    one = saved_at(out).num_frames
    attempt(out, resume=True, kill={"rank": 0, "write": 3})
    two = saved_at(out).num_frames
    assert 0 < one < two < 87
    attempt(out, resume=True)
    assert_same_dataset(out, reference)
    a = attempts_of(out)
    assert [x["attempt"] for x in a] == [1, 2, 3]
    assert [x["frames"] for x in a] == [one, two - one, 87 - two]
    assert a[0]["failure"]["rank"] == 2 and a[1]["failure"]["type"] == "Unrecorded" and a[2]["failure"] is None


def test_resume_with_nothing_saved_is_a_fresh_run(tmp_path, reference):
    out = tmp_path / "ds"
    r = attempt(out, resume=True)
    assert r[0] == {"todo": 87, "saved_frames": 0, "saved_files": 0}
    assert_same_dataset(out, reference)
    assert [(x["attempt"], x["frames"], x["failure"]) for x in attempts_of(out)] == [(1, 87, None)]


def test_resume_of_a_complete_dataset_moves_nothing_and_keeps_it(tmp_path, reference):
    out = tmp_path / "ds"
    attempt(out, resume=False)
    r = attempt(out, resume=True)
    assert {x["todo"] for x in r} == {0} and r[0]["saved_frames"] == 87
    assert_same_dataset(out, reference)
    assert [x["frames"] for x in attempts_of(out)] == [87, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_a_resume_with_another_layout_is_refused_before_any_frame_moves(tmp_path, reference):
    out = tmp_path / "ds"
    attempt(out, resume=False, kill={"rank": 1, "batch": 4})
    partial = tmp_path / "ds.partial"
    before = {p.name: p.read_bytes() for p in partial.glob("shard-*")}
    r = run_local_world(rc.case_run_reporting, WORLD, str(out), True, "wider", timeout=120)
    for x in r:
        assert x.get("type") in ("ShapeMismatchError", "PeerError"), x
    refused = [x for x in r if x["type"] == "ShapeMismatchError"]
    assert refused and "the run being resumed saved its frames with" in refused[0]["message"]
    assert "resume=False, overwrite=True" in refused[0]["message"]
    assert {p.name: p.read_bytes() for p in partial.glob("shard-*")} == before  # nothing new was written
    attempt(out, resume=True)  # the right model: it still resumes
    assert_same_dataset(out, reference)


# -- without processes -----------------------------------------------------------------------------


def local_run(out: Path, frames: dict, resume: bool = False, fail: bool = False, **kw) -> tdgather.Collector:
    """A one-process Collector: add ``{filename: [(idx, tensor)]}``; ``fail``: raise inside the block."""
    col = tdgather.Collector(out, resume=resume, **kw)
    try:
        with col:
            for name, pairs in frames.items():
                if not col.saved.has(name, [i for i, _ in pairs]):
                    col.update({name: pairs})
            if fail:
                raise RuntimeError("boom")
    except RuntimeError:
        assert fail
    return col


def test_saved_todo_takes_what_loaders_give():
    s = Saved({"a.mp4": [0, 2, 5, 5], "b.mp4": [-3, -1]})
    assert s.num_frames == 7 and len(s) == 2 and "a.mp4" in s and torch.equal(s["a.mp4"], torch.tensor([0, 1, 2, 5]))
    for i in (1, np.int64(2), torch.tensor(5), torch.tensor([0]), np.array([1])):
        assert s.has("a.mp4", i), i
    assert not s.has("a.mp4", 3) and not s.has("c.mp4", 0) and s.has("b.mp4", -2)
    assert s.has("a.mp4", range(3)) and not s.has("a.mp4", range(6)) and s.has("a.mp4", torch.tensor([0, 5]))
    assert s.has("a.mp4", np.array([1, 2])) and not s.has("a.mp4", [1, 4])
    samples = [{"filename": "a.mp4", "frame_idx": i} for i in range(7)]
    todo = s.todo(samples, key=lambda x: (x["filename"], x["frame_idx"]))
    assert [x["frame_idx"] for x in todo] == [3, 4, 6]
    videos = [("a.mp4", range(3)), ("a.mp4", range(3, 6)), ("b.mp4", range(-3, 0))]
    assert s.todo(videos) == [("a.mp4", range(3, 6))]  # a video is skipped only when all its frames are saved
    ds = torch.utils.data.TensorDataset(torch.arange(7))
    assert list(s.subset(ds, key=lambda i: ("a.mp4", i)).indices) == [3, 4, 6]
    with pytest.raises(TypeError, match=r"key\(item\) to give \(filename, frame_idx\)"):
        s.todo(["a.mp4"])
    with pytest.raises(TypeError, match="floats and bools are refused"):
        s.has("a.mp4", [1.0])
    assert Saved().todo([("a", 1)]) == [("a", 1)] and not Saved()


@pytest.mark.parametrize(
    "wire, field",
    [
        ({"runs": {"a": [0, 1, 1, 2]}, "layouts": [], "layout_of": {}}, ".runs['a']"),  # overlapping runs
        ({"runs": {"a": [3, 1]}, "layouts": [], "layout_of": {}}, ".runs['a']"),  # first > last
        ({"runs": {"a": [0]}, "layouts": [], "layout_of": {}}, ".runs['a']"),  # odd
        ({"runs": {"a": [0, 1.5]}, "layouts": [], "layout_of": {}}, ".runs['a']"),
        ({"runs": {"a": [0, 2**63]}, "layouts": [], "layout_of": {}}, ".runs['a']"),
        ({"runs": {"a": [0, 1]}, "layouts": [], "layout_of": {"a": 0}}, ".layout_of['a']"),  # no such layout
        ({"runs": {"a": [0, 1]}, "layouts": [], "layout_of": {}}, ".layout_of:"),  # no layout for a
        ({"runs": [], "layouts": [], "layout_of": {}}, ".runs:"),
        ({"runs": {}, "layouts": [{"kind": "tensor"}], "layout_of": {}}, ".layouts[0]"),
        ({"runs": {}}, ":"),
    ],
)
def test_a_malformed_saved_set_from_rank_dst_is_refused(wire, field):
    with pytest.raises(ProtocolError, match=r"from rank 0 in header\.saved" + re.escape(field)):
        Saved.from_wire(wire, 0)


def test_saved_round_trips_through_the_wire():
    s = tdgather.FrameStore()
    s.update({"a": [(0, torch.ones(2)), (1, torch.ones(2)), (4, torch.ones(2))], "b": (7, {"x": torch.zeros(1, 3)})})
    out = local_run_store(s)
    back = Saved.from_wire(json.loads(json.dumps(out.to_wire())), 0)
    assert {k: back[k].tolist() for k in back} == {"a": [0, 1, 4], "b": [7]} and back.layouts == out.layouts


def local_run_store(store: tdgather.FrameStore) -> Saved:
    """What a resumed Collector over a dataset of ``store``'s frames would be told."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        tdgather.save(tdgather.gather(store), Path(d) / "ds")
        return saved_at(Path(d) / "ds")


def frames_of(k: int) -> dict:
    return {f"f{j}.mp4": [(i, torch.full((4,), float(10 * j + i))) for i in range(5)] for j in range(k)}


def test_in_one_process_a_failed_run_resumes(tmp_path):
    out = tmp_path / "ds"
    local_run(out, frames_of(2), fail=True)
    assert saved_at(out).num_frames == 10
    col = local_run(out, frames_of(4), resume=True)
    assert col.summary.frames == 20 and sorted(tdgather.open(out)) == [f"f{j}.mp4" for j in range(4)]
    assert [x["frames"] for x in attempts_of(out)] == [10, 10]
    assert torch.equal(tdgather.open(out)["f3.mp4"].frames[:, 0], torch.arange(30, 35, dtype=torch.float32))


def test_frames_sent_again_follow_the_duplicates_policy(tmp_path):
    out = tmp_path / "ds"
    local_run(out, frames_of(2), fail=True)
    again = {name: [(i, v + 1) for i, v in pairs] for name, pairs in frames_of(2).items()}  # other values
    with pytest.raises(tdgather.DuplicateFrameError, match="f0.mp4"):
        with tdgather.Collector(out, resume=True, duplicates="exact") as col:
            col.update(again)
    with tdgather.Collector(out, resume=True) as col:  # "keep": the copy on disk stays
        col.update(again)
    assert col.summary.duplicates_dropped == 10 and col.summary.frames == 10
    assert tdgather.open(out)["f1.mp4"].frames[0, 0] == 10


def test_a_shard_edited_by_hand_is_refused_and_nothing_is_changed(tmp_path):
    out = tmp_path / "ds"
    local_run(out, frames_of(2), fail=True)
    shard = tmp_path / "ds.partial" / "shard-00000.safetensors"
    raw = shard.read_bytes()
    shard.write_bytes(raw.replace(b'\\"f1.mp4\\", \\"g0\\", 5, 5', b'\\"f1.mp4\\", \\"g0\\", 5, 4'))
    assert shard.read_bytes() != raw
    with pytest.raises(DatasetError, match=r"shard-00000.safetensors.*segments"):
        tdgather.Collector(out, resume=True).open()
    assert shard.exists() and not out.exists()


def test_a_filename_listed_with_no_frame_holds_nothing_saved(tmp_path, reference):
    """An index edited by hand (or an old one) that lists a filename with an empty segment: not saved, resumable."""
    out = tmp_path / "ds"
    shutil.copytree(reference, out)
    index = json.loads((out / "tdgather.index.json").read_text())
    shard = sorted(index["shards"])[0]
    empty = {"shard": shard, "group": "g0", "start": 0, "frames": 0}
    index["files"]["ghost.jpg"] = {"frames": 0, "segments": [empty]}
    index["metadata"]["num_filenames"] += 1
    (out / "tdgather.index.json").write_text(json.dumps(index))
    saved = saved_at(out)
    assert "ghost.jpg" not in saved and dict(saved).keys() == dict(saved_at(reference)).keys()
    results = attempt(out, resume=True)
    assert all(r["todo"] == 0 for r in results)
    assert_same_dataset(out, reference)


def test_a_foreign_file_in_partial_is_refused(tmp_path):
    out = tmp_path / "ds"
    local_run(out, frames_of(1), fail=True)
    (tmp_path / "ds.partial" / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="notes.txt"):
        tdgather.Collector(out, resume=True).open()


def test_a_failed_run_over_a_complete_dataset_needs_overwrite(tmp_path):
    out = tmp_path / "ds"
    local_run(out, frames_of(1))
    local_run(out, frames_of(2), overwrite=True, fail=True)
    with pytest.raises(OutputError, match="pass overwrite=True as well as resume=True"):
        tdgather.Collector(out, resume=True).open()
    local_run(out, frames_of(3), resume=True, overwrite=True)
    assert len(tdgather.open(out)) == 3 and [x["frames"] for x in attempts_of(out)] == [10, 5]


def test_without_resume_leftovers_are_still_refused(tmp_path):
    out = tmp_path / "ds"
    local_run(out, frames_of(1), fail=True)
    with pytest.raises(OutputError, match="continue that run with resume=True"):
        tdgather.Collector(out).open()
    assert os.listdir(tmp_path / "ds.partial")


def test_the_lightning_writer_resumes(tmp_path):
    """One device, in this process (no launcher): attempt 1 fails in predict_step, attempt 2 resumes."""
    pytest.importorskip("lightning")
    import lightning as L
    from torch.utils.data import DataLoader

    from tdgather.integrations.lightning import PredictionWriter

    from .lightning_cases import Elementwise, samples

    out, data = tmp_path / "ds", samples(12, fields=True, seed=0)

    def predict(model, items):
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            callbacks=[PredictionWriter(out, resume=True)],
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
        )
        trainer.predict(model, DataLoader(items, batch_size=2), return_predictions=False)

    with pytest.raises(RuntimeError, match="boom on rank 0"):
        predict(Elementwise(fail_rank=0, fail_batch=3), data)
    done = saved_at(out)
    assert done.num_frames == 6
    todo = done.todo(data, key=lambda s: (s["filename"], s["frame_idx"]))
    assert len(todo) == 6
    predict(Elementwise(), todo)
    ds = tdgather.open(out)
    assert sum(ds.num_frames(n) for n in ds) == 12 and [a["frames"] for a in attempts_of(out)] == [6, 6]
    full = tmp_path / "full"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        callbacks=[PredictionWriter(full)],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.predict(Elementwise(), DataLoader(data, batch_size=2), return_predictions=False)
    ref = tdgather.open(full)
    for n in ref:
        assert torch.equal(bits(ds[n].frames["y"]), bits(ref[n].frames["y"])), n


def test_two_jobs_writing_one_output_are_refused(tmp_path):
    """A requeued job whose first run still lives: the second refuses instead of mixing shards."""
    out = tmp_path / "ds"
    local_run(out, frames_of(1), fail=True)
    first = tdgather.Collector(out, resume=True).open()
    with pytest.raises(OutputError, match="being written by another process"):
        tdgather.Collector(out, resume=True).open()
    with pytest.raises(OutputError, match="being written by another process"):
        tdgather.Collector(out, overwrite=True).open()
    first.update({"f9.mp4": (0, torch.zeros(4))})
    first.close()
    assert sorted(tdgather.open(out)) == ["f0.mp4", "f9.mp4"]
    local_run(out, frames_of(1), resume=True)  # released once closed


def test_what_a_killed_rank_dst_saved_reads_with_incomplete_true(tmp_path):
    out = tmp_path / "ds"
    local_run(out, frames_of(2), fail=True)
    (tmp_path / "ds.partial" / INCOMPLETE_NAME).unlink()  # as when rank dst is killed: shards, no record
    ds = tdgather.open(out, incomplete=True)
    assert sorted(ds) == ["f0.mp4", "f1.mp4"] and ds.metadata["failure"]["type"] == "Unrecorded"
    local_run(out, {"f2.mp4": frames_of(3)["f2.mp4"]}, resume=True, fail=True)  # a resumed attempt fails
    ds = tdgather.open(out, incomplete=True)  # every attempt's frames, not only the first record's
    assert sorted(ds) == ["f0.mp4", "f1.mp4", "f2.mp4"] and [a["frames"] for a in ds.metadata["attempts"]] == [10, 5]
    assert ds.metadata["failure"]["type"] == "RuntimeError"


def test_saved_edges():
    s = Saved({"a": [2**63 - 2, 2**63 - 1]})
    assert s["a"].tolist() == [2**63 - 2, 2**63 - 1]
    assert s.has("b", range(0)) and s.has("a", range(0))  # no frames: nothing to do
    with pytest.raises(TypeError, match="pass key=lambda item"):
        s.todo([{"filename": "a", "frame_idx": 2**63 - 1}])
