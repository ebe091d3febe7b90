"""The streaming Collector in real gloo worlds."""

import os
import re

import pytest
import torch
from safetensors import safe_open

import tdgather
from tdgather.format.names import INDEX_NAME
from tdgather.tools.launch import run_local_world

from . import cases

pytestmark = pytest.mark.world


@pytest.mark.parametrize(
    "world,shape,budget,chunk",
    [
        (2, (3, 16, 16), 256 << 10, 16 << 10),  # 3 KiB rows: each spill merged into new buffers
        (4, (3, 16, 16), 256 << 10, 16 << 10),
        (3, (3, 48, 48), 8 << 20, 512 << 10),  # 27 KiB rows: written from the received buffers, reused
    ],
)
def test_streaming_matches_gather(tmp_path, world, shape, budget, chunk):
    path = str(tmp_path / "ds")
    out = run_local_world(cases.case_stream_vs_gather, world, path, budget, chunk, shape, timeout=180)
    summary = out[0]
    assert summary["shards"] > 3 and summary["segments"] > 1  # it really wrote while frames arrived
    assert summary["dups"] == (-(12 * 40) % world)  # the sampler's padding, dropped once each
    assert sum(summary["per_rank"].values()) == summary["frames"] + summary["dups"]


def test_a_zero_byte_leaf_beside_large_rows(tmp_path):
    """A frame ``{"x": [64, 64], "empty": [0, 3]}``: written by reference, the empty leaf has no bytes (it raised
    TypeError in the writer, and the run saved nothing)."""
    summary = run_local_world(cases.case_zero_byte_leaf, 2, str(tmp_path / "ds"), timeout=180)[0]
    assert summary["shards"] > 1 and summary["dups"] == 16


def test_back_pressure_bounds_the_senders_queue(tmp_path):
    out = run_local_world(cases.case_backpressure, 2, str(tmp_path / "ds"), timeout=180)
    assert out[1]["peak"] <= 2  # max_pending
    assert out[1]["peak"] == 2  # the queue did fill: add() had to wait
    assert out[0]["frames"] == 40 * 8


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
@pytest.mark.parametrize("ragged", [False, True], ids=["fixed", "ragged"])
def test_rank0_memory_stays_under_the_budget(tmp_path, ragged):
    # resident data (anonymous memory) on rank 0; library code paged in is file-backed and reported apart
    budget = 48 << 20
    out = run_local_world(cases.case_memory, 3, str(tmp_path / "ds"), budget, 150, ragged, timeout=300)[0]
    assert out["bytes"] > 290_000_000  # six times the budget went through rank 0
    assert out["shards"] > 3
    assert out["anon"] < budget, f"rank 0 held {out['anon'] / 2**20:.0f} MiB over a {budget / 2**20:.0f} MiB budget"


@pytest.mark.parametrize("chunk", [16 << 10, 256 << 10])
def test_shards_grow_with_bytes_not_with_chunks_under_a_small_budget(tmp_path, chunk):
    """20,000 frames of 32 bytes of 500 videos, shuffled over 2 ranks, a 4 MiB budget: hundreds of chunks.

    Each spill (a few chunks: their filenames filled the budget's share) was a shard of its own, and
    every video had a segment in most of them. Spills are merged into the shard being gathered: a
    shard is written at ``max_shard_bytes``, and reading a video touches one segment per shard at most.
    """
    shard = 96 << 10
    out = run_local_world(cases.case_small_frames, 2, str(tmp_path / "ds"), 4 << 20, chunk, shard, timeout=180)[0]
    assert out["frames"] == 20_000
    written = out["bytes"] + 8 * out["frames"]  # as a shard counts them: frames and their frame_idx
    assert out["shards"] <= written // shard + 2, out
    assert out["segments"] <= out["shards"]


@pytest.mark.parametrize("failing", [0, 1])
def test_error_inside_the_block(tmp_path, failing):
    out = run_local_world(cases.case_stream_error, 3, str(tmp_path / "ds"), failing, timeout=180)
    assert out[failing]["type"] == "RuntimeError" and f"boom on rank {failing}" in out[failing]["message"]
    assert out[failing]["listed"]  # rank 0 answered the failing rank only once the partial was listed
    failure = tdgather.open(tmp_path / "ds", incomplete=True).metadata["failure"]
    assert failure["type"] == ("RuntimeError" if failing == 0 else "PeerError") and failure["rank"] == failing
    if failing != 0:
        assert out[0]["type"] == "PeerError" and out[0]["rank"] == failing
        assert f"rank {failing} failed with RuntimeError: boom" in out[0]["message"]
    for r in range(3):
        if r not in (0, failing):
            assert out[r]["type"] == "PeerError" and out[r]["rank"] == 0
    assert not (tmp_path / "ds").exists()  # no dataset, so clearly incomplete
    partial = tmp_path / "ds.partial"
    assert not (partial / INDEX_NAME).exists()
    shards = sorted(partial.glob("shard-*.safetensors"))
    assert shards, "shards committed before the error are kept"
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            assert f.metadata()["format"] == "tdgather"
    assert not list(partial.glob(".*tmp*"))


def test_existing_dataset_is_refused_unless_overwrite(tmp_path):
    target = tmp_path / "ds"
    tdgather.save(tdgather.gather({"old": (0, torch.zeros(2))}), target)
    out = run_local_world(cases.case_stream_open, 2, str(target), False, timeout=120)
    assert out[0]["type"] == "OutputError" and "pass overwrite=True" in out[0]["message"]
    assert out[1]["type"] == "PeerError" and "OutputError" in out[1]["message"]
    assert list(tdgather.open(target)) == ["old"]
    out = run_local_world(cases.case_stream_open, 2, str(target), True, timeout=120)
    assert out == [{"type": None}, {"type": None}]
    assert sorted(tdgather.open(target)) == ["new_0", "new_1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_local_collector_without_distributed(tmp_path):
    with tdgather.Collector(tmp_path / "ds", memory_budget=1 << 20, chunk_bytes=4096, progress=False) as col:
        for b in range(20):
            col.add([f"v{b % 3}"] * 10, [b * 10 + k for k in range(10)], torch.full((10, 50), float(b)))
    assert col.summary.frames == 200 and col.summary.frames_per_rank == {0: 200}
    ds = tdgather.open(tmp_path / "ds")
    assert ds["v1"].frame_idx.tolist() == [b * 10 + k for b in range(1, 20, 3) for k in range(10)]


@pytest.mark.parametrize("progress", [True, False, None])
def test_progress_bar_only_when_asked_or_on_a_terminal(tmp_path, capsys, progress):
    with tdgather.Collector(tmp_path / "ds", chunk_bytes=1024, progress=progress) as col:
        for b in range(5):
            col.add(["v"] * 4, [b * 4 + k for k in range(4)], torch.ones(4, 100))
    err = capsys.readouterr().err
    if progress:
        assert "tdgather" in err and "20 frames" in err and "r0:20/" in err
    else:  # pytest's stderr is not a terminal, so None means off
        assert err == ""


def test_summary_is_logged_when_asked(tmp_path, caplog):
    caplog.set_level("INFO", logger="tdgather")
    with tdgather.Collector(tmp_path / "ds", progress=False, log_summary=True) as col:
        col.update({"a": (0, torch.ones(3))})
    assert "tdgather: 1 frames" in caplog.text and str(col.summary) in caplog.text
    assert col.summary.throughput_mb_s > 0 and col.summary.shards == 1


@pytest.mark.parametrize("when", ["same_spill", "on_disk", "in_rank", "in_rank_later"])
def test_a_filename_with_two_layouts_fails_the_run_and_loses_nothing_else(tmp_path, when):
    out = run_local_world(cases.case_stream_mismatch, 3, str(tmp_path / "ds"), when, timeout=180)
    errors = [r["error"] for r in out]
    saved, added = {n: set(idx) for n, idx in out[0]["saved"].items()}, out[0]["added"]
    union: dict[str, set] = {}
    for per_rank in added:
        for name, idx in per_rank.items():
            union.setdefault(name, set()).update(idx)
    union["odd.mp4"] = {0}  # of rank 1's layout, float32[4]; rank 0 checked every saved frame's bits
    assert errors[2]["type"] == "PeerError"
    if when == "in_rank":  # rank 1's add refuses it at once; what rank 1 added before is still sent and saved
        assert errors[1]["type"] == "ShapeMismatchError"
        assert "frames on rank 1 have float32[4] and float32[4, 1]" in errors[1]["message"]
        assert errors[0]["type"] == "PeerError" and errors[0]["rank"] == 1
        assert all(idx <= union[name] for name, idx in saved.items())
        assert all(set(idx) <= saved[name] for name, idx in [*added[0].items(), *added[1].items()])
        return
    # rank 0 finds it, names the file, both layouts and both ranks
    assert errors[0]["type"] == "ShapeMismatchError"
    assert "'odd.mp4'" in errors[0]["message"] and "float32[4]" in errors[0]["message"]
    assert "float32[4, 1]" in errors[0]["message"] and re.search(r"ranks? \[?1", errors[0]["message"])
    assert [(e["type"], e["rank"]) for e in errors[1:]] == [("PeerError", 0), ("PeerError", 0)]
    if when == "in_rank_later":  # rank 1 may have stopped before sending all: rank 0's own are all saved
        assert all(idx <= union[name] for name, idx in saved.items())
        assert all(set(idx) <= saved[name] for name, idx in added[0].items()) and saved["odd.mp4"] == {0}
    else:  # every frame was sent before the conflicting one: all saved
        assert saved == union
