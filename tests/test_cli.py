"""End to end: `tdgather demo`, `tdgather inspect` and `tdgather snapshots`."""

import subprocess
import sys

import pytest
import torch

import tdgather
from tdgather.tools.cli import main
from tdgather.tools.demo import DemoNet, video_frames


def test_demo_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    args = ["demo", "--world-size", "3", "--videos", "4", "--max-frames", "6", "--size", "16", "--out", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "frames" in text and "written to" in text and str(out) in text
    ds = tdgather.open(out)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 7, (4,), generator=g).tolist()
    assert [ds.num_frames(n) for n in sorted(ds)] == lengths
    assert f"frames              {sum(lengths)} in 4 filenames" in text
    torch.manual_seed(0)
    model = DemoNet().eval()
    for v, n in enumerate(lengths):
        f = ds[f"video_{v:04d}.mp4"]
        assert f.frame_idx.tolist() == list(range(n))
        with torch.inference_mode():
            want = model(video_frames(0, v, list(range(n)), 16))
        torch.testing.assert_close(f.frames["depth"], want["depth"], atol=1e-5, rtol=1e-4)
        assert f.frames["seg"].dtype == torch.uint8 and f.frames["seg"].shape == (n, 8, 8)
        boxes, scores = f.frames["boxes"], f.frames["scores"]  # detections: a varying number per frame
        assert boxes.is_nested and boxes.values().shape[1:] == (4,) and torch.equal(boxes.offsets(), scores.offsets())
        assert bool((scores.values() > 0.731).all())  # kept: objectness more than 1 std above the frame's mean
    assert ds.layout("video_0000.mp4").describe().startswith("{boxes: float32[*, 4], depth: float32[1, 8, 8]")


def _store(name, frames):
    store = tdgather.FrameStore()
    store.add(name, torch.arange(frames.shape[0]), frames)
    return store


def test_inspect(tmp_path, capsys):
    tdgather.save(tdgather.gather({"a.mp4": [(0, torch.zeros(2, 3)), (1, torch.ones(2, 3))]}), tmp_path / "ds")
    run = subprocess.run(
        [sys.executable, "-m", "tdgather", "inspect", str(tmp_path / "ds")], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert "'a.mp4'" in run.stdout and "float32[2, 3]" in run.stdout
    assert "total: 1 filenames, 2 frames, 48 B in 1 shard(s)" in run.stdout
    assert "schema: 1 type(s) of frame\n  float32[2, 3]  (1 filename(s))" in run.stdout
    boxes = torch.nested.nested_tensor_from_jagged(torch.zeros(5, 4), torch.tensor([0, 2, 2, 5]))
    tdgather.save(tdgather.gather(_store("v.mp4", boxes)), tmp_path / "dets")
    assert main(["inspect", str(tmp_path / "dets")]) == 0
    text = capsys.readouterr().out
    assert "float32[*, 4]" in text and "<tensor>: rows per frame min 0, mean 1.7, max 3" in text
    assert main(["inspect", str(tmp_path / "missing")]) == 1


def test_inspect_what_a_failed_run_saved(tmp_path, capsys):
    writer = tdgather.storage.writer.DatasetWriter(tmp_path / "ds")
    writer.write(tdgather.gather({"a.mp4": (0, torch.zeros(4))}))
    writer.abort(tdgather.PeerLostError(2, "PeerLost", "no progress for 60 s"))
    assert main(["inspect", str(tmp_path / "ds")]) == 1
    assert "tdgather.open(path, incomplete=True)" in capsys.readouterr().err
    assert main(["inspect", "--incomplete", str(tmp_path / "ds")]) == 0
    text = capsys.readouterr().out
    assert "total: 1 filenames, 1 frames, 16 B in 1 shard(s)" in text
    assert "incomplete: saved before PeerLostError (rank 2)" in text and "no progress for 60 s" in text


def test_demo_replaces_only_its_own_output(tmp_path, capsys):
    mine = tdgather.save(tdgather.gather({"mine.mp4": (0, torch.ones(2))}), tmp_path / "mine")
    assert main(["demo", "--out", str(mine), "--world-size", "2", "--videos", "1"]) == 1
    assert "holds a tdgather dataset that the demo did not write" in capsys.readouterr().err
    assert list(tdgather.open(mine)) == ["mine.mp4"]


@pytest.mark.parametrize("arg", ["--world-size", "--batch", "--size", "--max-frames", "--videos"])
def test_demo_refuses_non_positive_sizes(arg, capsys):
    with pytest.raises(SystemExit):
        main(["demo", arg, "0"])
    assert "expected an integer >= 1, got 0" in capsys.readouterr().err


def test_inspect_checks_every_shard(tmp_path, capsys):
    out = tdgather.save(tdgather.gather({"a": [(j, torch.ones(4)) for j in range(3)]}), tmp_path / "ds")
    shard = out / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-5])  # truncated
    assert main(["inspect", str(out)]) == 1
    assert "shard-00000.safetensors" in capsys.readouterr().err


def _views_dataset(tmp_path):
    writer = tdgather.storage.writer.DatasetWriter(tmp_path / "ds")
    frames = [(j, {"boxes": torch.full((j % 3, 4), float(j)), "x": torch.tensor([j, float("nan")])}) for j in range(4)]
    frames += [(j, {"boxes": torch.zeros(1, 4), "x": torch.tensor([j, 1.0])}) for j in range(10, 13)]
    writer.write(
        tdgather.gather(
            {"a.mp4": frames, "b.mp4": (0, {"boxes": torch.ones(2, 4), "x": torch.ones(2)})}, ragged=["boxes"]
        )
    )
    writer.write(
        tdgather.gather(
            {"a.mp4": [(j, {"boxes": torch.zeros(0, 4), "x": torch.zeros(2)}) for j in (4, 20)]}, ragged=["boxes"]
        )
    )
    return writer.commit()


def test_inspect_shards_and_one_filename(tmp_path, capsys):
    path = _views_dataset(tmp_path)
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "total: 2 filenames, 10 frames" in text
    assert "shard-00000.safetensors        8 frames" in text and "shard-00001.safetensors        2 frames" in text
    assert main(["inspect", str(path), "--frames", "a.mp4"]) == 0
    text = capsys.readouterr().out
    assert "'a.mp4': 9 frames, {boxes: float32[*, 4], x: float32[2]}" in text
    assert "frame_idx: 0-4, 10-12, 20" in text
    assert "segment: shard-00000.safetensors g0 rows 0..7" in text and "segment: shard-00001.safetensors" in text
    boxes = [line for line in text.splitlines() if line.startswith("boxes")][0]
    assert "float32" in boxes and "[*, 4]" in boxes and "min 0, mean 0.833333, max 2, NaN 0" in boxes
    assert "rows per frame min 0, mean 0.7, max 2" in text
    x = [line for line in text.splitlines() if line.startswith("x ")][0]
    assert "min 0, mean 3, max 12, NaN 4" in x
    assert main(["inspect", str(path), "--frames", "nope.mp4"]) == 1
    assert "'nope.mp4' is not in" in capsys.readouterr().err


def test_inspect_duplicates_dropped(tmp_path, capsys):
    store = tdgather.FrameStore()
    store.add(["a", "a", "a"], [0, 1, 1], torch.zeros(3, 2))
    tdgather.save(tdgather.gather(store), tmp_path / "ds")
    assert main(["inspect", str(tmp_path / "ds")]) == 0
    assert "duplicates dropped: 1 (exact 1, inexact 0, max abs diff 0.0)" in capsys.readouterr().out


def test_snapshots(tmp_path, capsys, monkeypatch):
    path = tmp_path / "ds"
    for var in ("SLURM_JOB_ID", "JOB_COMPLETION_INDEX", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    for task, frames in enumerate([range(0, 3), range(2, 6)]):  # two jobs; frame 2 of a.mp4 sent by both
        monkeypatch.setenv("SLURM_ARRAY_TASK_ID", str(task))
        gathered = tdgather.gather(
            {"a.mp4": [(j, torch.full((2,), float(task))) for j in frames], f"{task}.mp4": (0, torch.ones(2))}
        )
        tdgather.save(gathered, path, append=True)
    assert tdgather.open(path)["a.mp4"].frames[:, 0].tolist() == [0, 0, 0, 1, 1, 1]  # frame 2: the first commit's
    runs = [s.run[:12] for s in tdgather.snapshots(path)]
    assert main(["snapshots", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == "version made (UTC) run frames filenames added duplicates dropped job/host".split()
    first, second = (line.split() for line in lines[1:3])
    # version, run, frames, filenames, added, duplicates dropped (made: first[1])
    assert first[:1] + first[2:7] == ["1", runs[0], "4", "2", "4", "0"]
    assert second[:1] + second[2:7] == ["2", runs[1], "8", "3", "4", "1"]  # a.mp4's frame 2: the first job's copy
    assert first[7].startswith("SLURM_ARRAY_JOB_ID=77_0/") and second[7].startswith("SLURM_ARRAY_JOB_ID=77_1/")
    assert first[1] <= second[1] and first[1].endswith("+00:00")  # ISO 8601, UTC
    assert lines[3].startswith("2 snapshot(s); tdgather.open reads the newest, 2") and len(lines) == 4
    plain = tdgather.save(tdgather.gather({"b.mp4": (0, torch.ones(2))}), tmp_path / "plain")  # no job appended
    assert main(["snapshots", str(plain)]) == 0
    zero = capsys.readouterr().out.splitlines()[1].split()
    assert zero[0] == "0" and zero[1] == "-" and zero[3:8] == ["1", "1", "1", "0", "-"]
    assert main(["snapshots", str(tmp_path / "missing")]) == 1
    assert "no dataset there" in capsys.readouterr().err


@pytest.mark.parametrize("parquet", [False, True])
def test_export_hf(tmp_path, capsys, parquet):
    datasets = pytest.importorskip("datasets")
    path = _views_dataset(tmp_path)
    out = tmp_path / "hf"
    assert main(["export-hf", str(path), str(out), *(["--parquet"] if parquet else [])]) == 0
    text = capsys.readouterr().out
    assert f"wrote 10 rows (2 filenames) to {out}" in text and "boxes: Array2D(shape=(None, 4)" in text
    if parquet:
        assert "data/train-00000-of-00001.parquet" in text
        hf = datasets.load_dataset("parquet", data_dir=str(out / "data"), split="train", cache_dir=str(tmp_path / "c"))
    else:
        hf = datasets.load_from_disk(str(out))
    assert not list(tmp_path.glob(".tdgather-hf-*"))  # the build cache is gone
    assert hf.features["boxes"].shape == (None, 4) and hf.features["x"].length == 2
    ds = tdgather.open(path)
    rows = [(n, int(i), ds[n][k].frames) for n in sorted(ds) for k, i in enumerate(ds[n].frame_idx)]
    for row, (name, idx, value) in zip(hf.with_format("torch"), rows, strict=True):
        assert (row["filename"], int(row["frame_idx"])) == (name, idx)
        assert torch.equal(row["boxes"].reshape(-1, 4), value["boxes"])
        torch.testing.assert_close(row["x"], value["x"], rtol=0, atol=0, equal_nan=True)
    assert main(["export-hf", str(path), str(out)]) == 1  # never replaces a directory
    assert "exists" in capsys.readouterr().err
    assert main(["export-hf", str(path), str(path / "hf")]) == 1  # nor writes into the dataset
    assert "is inside the dataset" in capsys.readouterr().err and not (path / "hf").exists()
    name = sorted(tdgather.open(path))[0]
    assert main(["export-hf", str(path), str(tmp_path / "one"), "--filenames", name]) == 0
    assert f"({1} filenames)" in capsys.readouterr().out
