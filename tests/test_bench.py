"""The benchmark suite runs and reports (figures are measured there, never asserted here)."""

import re

import pytest
import torch

from benchmarks.suite import main


def test_suite_smoke(tmp_path, capsys):
    args = [
        "--worlds",
        "2",
        "--workloads",
        "mixed",
        "--methods",
        "raw_p2p",
        "tdgather_store",
        "gather_object",
        "--scale",
        "0.01",
        "--repeats",
        "1",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    [report] = tmp_path.glob("*.md")
    text = report.read_text()
    for method in ("raw_p2p", "tdgather_store", "gather_object"):
        assert f"| mixed | {method} |" in text
    assert "torch 2." in text and "command: `python -m benchmarks.suite" in text
    assert "failed" not in text


def test_scaling_smoke(tmp_path):
    from benchmarks.scaling import main as scaling

    assert scaling(["--worlds", "2", "3", "--mb", "0.2", "--repeats", "1", "--out", str(tmp_path)]) == 0
    [report] = tmp_path.glob("*-scaling.md")
    text = report.read_text()
    for world in (2, 3):
        for method in ("raw_p2p", "tdgather_store", "gather_object"):
            assert f"| {world} | " in text and f" | {method} | " in text
    assert text.count("\n| ") == 1 + 2 * 3  # the header row, then one row per (world, method)


def test_scaling_writers_smoke(tmp_path):
    from benchmarks.scaling import main as scaling

    args = ["--writers", "1", "2", "--worlds", "4", "--mb", "0.2", "--repeats", "1", "--out", str(tmp_path)]
    assert scaling(args) == 0
    [report] = tmp_path.glob("*-writers.md")
    rows = [line.split(" | ") for line in report.read_text().splitlines() if line[:3] in ("| 1", "| 2")]
    assert [r[0] for r in rows] == ["| 1", "| 2"]
    one, two = (float(r[2]) for r in rows)  # rank 0's MB received: from 3 ranks, then from its 1 block peer
    assert two == pytest.approx(one / 3, rel=0.05)


def test_combine_smoke(tmp_path):
    from benchmarks.combine import main as combine

    assert combine(["--writers", "2", "--videos", "20", "--repeats", "1", "--out", str(tmp_path)]) == 0
    [report] = tmp_path.glob("*-combine.md")
    assert "| 2 | 40 | " in report.read_text()


def test_small_budget_smoke(capsys):
    from benchmarks.small_budget import main as small_budget

    assert small_budget(["--videos", "40", "--frames", "20", "--budget-mib", "4", "--reads", "5"]) == 0
    row = capsys.readouterr().out.splitlines()[-1].split(" | ")
    assert row[0] == "| 4" and int(row[3]) >= 1  # budget, then peak, seconds, shards, segments, read ms


def test_loss_window_smoke(capsys):
    from benchmarks.loss_window import main as loss_window

    assert loss_window(["--seconds", "3", "--repeats", "1"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert [r[0] for r in rows] == ["| 300", "| 1"]
    default, often = (int(r[2]) for r in rows)  # shards: one at close, and one a second or so more
    assert default == 1 and often > default


def test_detection_smoke(tmp_path):
    from benchmarks.detection import METHODS, _rank
    from tdgather.tools.launch import run_local_world

    out = run_local_world(_rank, 2, 2, list(METHODS), 1, str(tmp_path), timeout=300)[0]
    rows = {m: (seconds, wire) for m, seconds, wire, _ in out["rows"]}
    assert sorted(rows) == sorted(METHODS)
    # bytes, not time: tdgather sends the frames plus its index and headers, no padding
    assert out["frame_bytes"] < rows["tdgather_gather"][1] < 1.1 * out["frame_bytes"]
    assert out["frame_bytes"] < rows["tdgather_dict"][1] < 1.1 * out["frame_bytes"]  # the seed's form: the same
    assert rows["pad_all_gather"][1] > rows["tdgather_gather"][1]


@pytest.mark.world
def test_suite_detection_data_exact():
    """The detection workload through tdgather_store and pad_all_gather: rank 0 holds every frame, bit for bit."""
    from tdgather.tools.launch import run_local_world

    out = run_local_world(_detection_rank, 2, 0.02, timeout=300)[0]
    assert out["frames"] == 200 and out["empty"] > 0  # 2 videos; frames with no box are among them
    assert out["wrong"] == {"tdgather_store": 0, "pad_all_gather": 0}


def _detection_rank(scale: float) -> dict | None:
    """Every rank gathers its detection batches with both methods; rank 0 counts the frames it got wrong."""
    import torch.distributed as dist

    from benchmarks.methods import METHODS, RankData, _file_id, _unbind
    from benchmarks.workloads import batches

    rank, world = dist.get_rank(), dist.get_world_size()
    data = RankData.build(list(batches("detection", rank, world, scale=scale)), scratch="")
    gathered = METHODS["tdgather_store"](data)
    padded = METHODS["pad_all_gather"](data)
    if rank != 0:
        return None
    expected = {
        (_file_id(name), i): frame
        for r in range(world)
        for names, idx, frames in batches("detection", r, world, scale=scale)
        for name, i, frame in zip(names, idx.tolist(), _unbind(frames), strict=True)
    }
    by_tdgather = {}
    for name, f in gathered.items():
        frames = _unbind({k: f.frames[k] for k in f.frames.keys()})
        by_tdgather |= {(_file_id(name), i): frame for i, frame in zip(f.frame_idx.tolist(), frames, strict=True)}
    cols = {k: torch.cat(rows) for k, rows in padded.items()}
    ids = cols.pop("ids").tolist()  # (file id, frame_idx, N_i of each ragged leaf)
    by_padding = {
        (file, i): {k: v[row, : n[data.ragged.index(k)]] if k in data.ragged else v[row] for k, v in cols.items()}
        for row, (file, i, *n) in enumerate(ids)
    }
    return {
        "frames": len(expected),
        "empty": sum(f["boxes"].shape[0] == 0 for f in expected.values()),
        "wrong": {"tdgather_store": _wrong(by_tdgather, expected), "pad_all_gather": _wrong(by_padding, expected)},
    }


def _wrong(got: dict, expected: dict) -> int:
    """Frames missing, extra, or not bit-exact in every leaf (dtype and shape included)."""
    same = [
        k
        for k in got.keys() & expected.keys()
        if got[k].keys() == expected[k].keys()
        and all(got[k][j].dtype == v.dtype and torch.equal(got[k][j], v) for j, v in expected[k].items())
    ]
    return len(got.keys() | expected.keys()) - len(same)


@pytest.mark.world
def test_seed_smoke(tmp_path):
    """The seed scenario, tiny, on the CPU: every method runs and gives every frame of the job (no timings)."""
    from benchmarks.seed import METHODS, QUICK
    from benchmarks.seed import main as seed

    assert seed(["--quick", "--device", "cpu", "--out", str(tmp_path)]) == 0
    [report] = tmp_path.glob("*-seed-quick.md")
    text = report.read_text()
    rows = [line.strip("| ").split(" | ") for line in text.splitlines() if line.startswith("| ")]
    assert rows[0][0] == "method" and rows[0][-1] == "frames"
    frames = {row[0]: row[-1] for row in rows[1:]}
    assert list(frames) == METHODS
    assert set(frames.values()) == {str(QUICK["videos"] * QUICK["frames"])}  # 15 frames, 1 padding repeat dropped
    assert "torch 2." in text and "command: `python -m benchmarks.seed --quick --device cpu" in text


def test_many_files_smoke(capsys):
    from benchmarks.many_files import main as many_files

    many_files(["--memory", "3000", "--resume", "400", "--close", "2000", "--repeats", "2"])
    out = capsys.readouterr().out
    assert "memory 3000 filenames" in out and "(3000 frames)" in out
    assert "resume 400 re-sent filenames" in out and " dropped" in out
    close = re.search(r"close 2000 one-frame filenames: .*each repeat's ratio (\S+), (\S+) \(median (\S+)x\)", out)
    assert close is not None, out
    assert float(close[3]) == pytest.approx((float(close[1]) + float(close[2])) / 2, abs=0.011)


@pytest.mark.world
def test_objects_smoke(capsys):
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from benchmarks.objects import frames_per_rank
    from benchmarks.objects import main as objects

    assert objects(["--world", "2", "--mb-per-rank", "1", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    rows = {tuple(c[:2]): c for c in (line.strip("| ").split(" | ") for line in out.splitlines()) if len(c) == 11}
    assert rows.pop(("method", "W"))[-2:] == ["frames sent", "frames read back"]
    assert sorted(rows) == [("collector_local", "2"), ("collector_s3", "2"), ("s3fs_one_object", "2")]
    sent = 2 * frames_per_rank(1)
    for method in ("collector_s3", "collector_local"):  # every frame rank 0 wrote reads back, values compared
        assert rows[(method, "2")][-2:] == [str(sent), str(sent)], rows[(method, "2")]
    assert float(rows[("s3fs_one_object", "2")][2]) == pytest.approx(sent * 65536 / 1e6, abs=0.1)
    assert "| put | " in out and "| complete | " in out


def test_stages_smoke(tmp_path):
    """benchmarks.stages times the stages a Collector call goes through, on every rank."""
    from benchmarks.stages import _rank
    from tdgather.tools.launch import run_local_world

    dst, sender = run_local_world(_rank, 2, "collector", "4", 1, str(tmp_path), timeout=300)
    for stages in (dst, sender):
        total, n, first, last = stages["(the call)"]
        assert n == 1 and first == 0 and last == total > 0
    assert dst["writer.DatasetWriter._write_shard"][1] >= 1  # the dataset was written on rank 0
    assert any(label.startswith("sending.send_frames") for label in sender)  # and sent by rank 1


@pytest.mark.world
def test_host_smoke(capsys):
    """benchmarks.host runs every method (the host's limits, the Collector's and gather's paths) end to end."""
    from benchmarks.host import METHODS
    from benchmarks.host import main as host

    host(["--world", "2", "--mb", "2", "--repeats", "1"])
    out = capsys.readouterr().out
    rows = {c[0]: c[1] for c in (line.strip("| ").split(" | ") for line in out.splitlines()) if len(c) == 2}
    assert set(METHODS) <= set(rows), rows
    for method in METHODS:  # seconds, GB/s and the ratio to disk (a copy of 2 MB may print 0.000 s)
        assert len([float(x) for x in rows[method].split(", ")]) == 3, (method, rows[method])
    assert "chunks through shared memory (collector, last call): W=2: " in out


@pytest.mark.world
def test_readback_smoke(capsys):
    """benchmarks.readback, tiny: every method of both workloads reads every prompt / frame back (no timings)."""
    from benchmarks.readback import WORKLOADS
    from benchmarks.readback import main as readback

    args = ["--prompts", "30", "--frames", "96", "--filenames", "6", "--world", "2", "--repeats", "1"]
    assert readback(args) == 0  # both workloads: the values are compared with the alternatives' first (_check)
    out = capsys.readouterr().out
    rows = [c for c in (line.strip("| ").split(" | ") for line in out.splitlines()) if len(c) == 7]
    assert rows[0][:3] == ["workload", "method", "items"]
    items = {(w, m): int(n) for w, m, n, *_ in rows[1:]}
    assert items == {(w, m): {"prompts": 30, "frames": 96}[w] for w in WORKLOADS for m in WORKLOADS[w]}
    assert "command: `python -m benchmarks.readback --prompts 30" in out and "torch 2." in out


@pytest.mark.world
def test_appends_smoke(capsys):
    from benchmarks.appends import main as appends

    assert (
        appends(
            [
                "--jobs",
                "1,2",
                "--frames",
                "16",
                "--files",
                "2",
                "--listed",
                "0:0,2:20",
                "--stores",
                "local",
                "--compact",
                "2:3:4",
            ]
        )
        == 0
    )
    rows = [
        line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| local")
    ]
    assert [r[1:3] for r in rows] == [
        ["concurrent", "1 jobs at once"],
        ["concurrent", "2 jobs at once"],
        ["listed", "0 shards, 0 filenames listed"],
        ["listed", "2 shards, 20 filenames listed"],
        ["compaction", "2 jobs x 3 filenames, 4 frames each"],
    ]
    assert rows[1][-1] == "1..2"  # both jobs committed: snapshots 1 and 2, none lost
    assert "x saving the frames in one run" in " ".join(rows[-1])


def test_spread_smoke(capsys):
    from benchmarks.spread import main as spread

    spread(["--world", "2", "--videos", "6", "--frames", "4", "--repeats", "1"])
    lines = [line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    rows = {r[0]: r for r in lines}
    one, each = rows["one writer"], rows["ranks_per_writer=1"]
    assert one[4] == each[4] == "24"  # every frame read back either way
    assert (one[5], each[5]) == ("6", "12")  # a segment a video, against one a video and rank
