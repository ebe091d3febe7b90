"""End to end: `tdgather demo` and `tdgather inspect`."""

import subprocess
import sys

import pytest
import torch

import tdgather
from tdgather.cli import main
from tdgather.demo import DemoNet, video_frames


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
    boxes = torch.nested.nested_tensor_from_jagged(torch.zeros(5, 4), torch.tensor([0, 2, 2, 5]))
    tdgather.save(tdgather.gather(_store("v.mp4", boxes)), tmp_path / "dets")
    assert main(["inspect", str(tmp_path / "dets")]) == 0
    text = capsys.readouterr().out
    assert "float32[*, 4]" in text and "<tensor>: rows per frame min 0, mean 1.7, max 3" in text
    assert main(["inspect", str(tmp_path / "missing")]) == 1


def test_inspect_what_a_failed_run_saved(tmp_path, capsys):
    writer = tdgather.sink.DatasetWriter(tmp_path / "ds")
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
