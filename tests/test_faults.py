"""The fault matrix (docs/design.md), in real gloo worlds; every test is bounded in time.

Rows 1-8, 14, 15 and 17 are here, named ``test_row<N>_...``. The others sit beside the feature
they test:

- row 9 (unsupported tensors): test_codec ``test_store_rejects_bad_input_with_clear_messages``,
  test_world ``test_bad_input_on_a_sender_is_reported_by_rank_0``;
- row 10 (non-JSON values): test_codec ``test_store_rejects_bad_input_with_clear_messages``;
- row 11 (hostile filenames): test_sink ``test_save_and_open_roundtrip`` and
  ``test_shards_read_with_plain_safetensors`` (``HOSTILE``);
- row 12 (duplicates): test_world ``test_identical_duplicates_are_kept_once_and_counted``,
  ``test_conflicting_duplicates_raise_on_every_rank``; test_merge; test_sink (across shards);
- row 13 (shape or dtype conflicts): test_world ``test_shape_mismatch_names_filename_shapes_and_ranks``;
- row 16 (empty ranks): test_world ``test_gather_matches_gather_object[zero_rank/all_empty]``,
  test_sink ``test_empty_dataset``;
- row 18 (no distributed): test_local;
- rows 22 and 23 (resume after a kill; a resume that does not fit): test_resume;
- row 24 (one writer per block of ranks): test_writers, test_torchrun, test_lightning;
- row 25 (SIGTERM): test_sigterm; row 26 (object storage): test_objects;
- row 27 (first dims that vary, with no ``ragged=``): test_promote;
- row 28 (same-host senders through shared memory): test_shm.
- row 29 (a rank's loop hangs while its process lives; a slow loop) and row 33 (the loss window) are here.

Rows 5-7 are also fuzzed without processes in test_codec (hypothesis). The time to error of the
kill and stop rows is printed (``pytest -s``) for the release note.
"""

import json
import os
import re
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import tdgather
from tdgather.format.names import INDEX_NAME
from tdgather.tools.launch import WorldError, run_local_world

from . import faults

pytestmark = pytest.mark.world
STOP_TIMEOUT = 3.0  # the tdgather timeout in the stop rows
SLACK = 5.0
ROOT = str(
    Path(__file__).resolve().parents[1]
)  # scheduling on a loaded 2-core CI machine; the measured figures are printed


def world(fn, *args, timeout=120):
    """Run a world whose killed or stopped ranks leave no result; return every rank's result."""
    try:
        return run_local_world(fn, 3, *args, timeout=timeout)
    except WorldError as e:
        for rank, failure in e.failures.items():
            assert "exited with code" in failure, f"rank {rank} failed:\n{failure}"
        return e.results


def assert_shards_complete(directory):
    """Every file with a final name is a whole safetensors file; no temporary file is left."""
    for shard in directory.glob("shard-*.safetensors"):
        with safe_open(shard, framework="pt") as f:
            assert f.metadata()["format"] == "tdgather"
            for key in f.keys():
                f.get_tensor(key)
    assert not [p.name for p in directory.iterdir() if ".tmp-" in p.name]


def assert_saved_exactly(out, k, ragged=False):
    """What a failed Collector run saved: rank 0's and rank 2's frames in full, rank 1's first k batches."""
    assert not out.exists()
    with pytest.raises(tdgather.OutputError, match="incomplete=True"):
        tdgather.open(out)
    partial = out.with_name(out.name + ".partial")
    assert not (partial / INDEX_NAME).exists()
    assert_shards_complete(partial)
    ds = tdgather.open(out, incomplete=True)
    expected = [faults.batch(r, b, ragged) for r, n in ((0, 3), (1, k), (2, 6)) for b in range(n)]
    assert sorted(ds) == sorted(names[0] for names, _, _ in expected)
    for names, idx, frames in expected:
        got = ds[names[0]]
        assert got.frame_idx.tolist() == idx and faults.same_frames(got.frames, frames), names[0]
    return ds.metadata


def time_to_error(tmp_path, result):
    seconds = result["seen"] - faults._read_stamp(str(tmp_path), "fault")["time"]
    print(f"time to error: {seconds:.2f} s")
    return seconds


@pytest.mark.parametrize("ragged", [False, True], ids=["fixed", "ragged"])
def test_row1_a_rank_raises_after_k_batches(tmp_path, ragged):
    out = tmp_path / "ds"
    r = world(faults.case_stream_fault, str(out), "raise", 4, str(tmp_path), 30, ragged)
    assert r[1]["type"] == "RuntimeError" and r[1]["message"] == "boom after 4 batches"
    assert r[0]["type"] == "PeerError" and r[0]["rank"] == 1
    assert "rank 1 failed with RuntimeError: boom after 4 batches" in r[0]["message"]
    assert r[2]["type"] == "PeerError" and r[2]["rank"] == 0  # told at once, not left waiting
    assert time_to_error(tmp_path, r[0]) < SLACK
    meta = assert_saved_exactly(out, 4, ragged)
    assert meta["failure"]["rank"] == 1 and meta["failure"]["type"] == "PeerError"
    assert meta["frames_per_rank"] == {"0": 24, "1": 32, "2": 48}


def test_row1_gather_keeps_what_arrived(tmp_path):
    r = world(faults.case_gather_fault, "raise", str(tmp_path), 30)
    assert r[1]["type"] == "UnsupportedValueError"
    assert r[0]["type"] == "PeerError" and r[0]["rank"] == 1 and "complex128" in r[0]["message"]
    assert r[0]["received"]["per_rank"] == {"0": 24, "1": 0, "2": 48}  # checked bit for bit on rank 0
    assert r[2]["type"] == "PeerError" and r[2]["rank"] == 0, r[2]


def test_row2_killed_before_sending(tmp_path):
    r = world(faults.case_gather_fault, "kill", str(tmp_path), 30)
    assert r[1] is None  # killed
    assert r[0]["type"] == "PeerLostError" and r[0]["rank"] == 1
    assert "its connection failed" in r[0]["message"] and "the process probably died" in r[0]["message"]
    assert r[0]["received"]["per_rank"] == {"0": 24, "1": 0, "2": 48}
    assert r[2]["type"] == "PeerError" and r[2]["rank"] == 0, r[2]
    seconds = r[0]["seen"] - r[0]["start"]
    print(f"gather() with a killed rank raised after {seconds:.2f} s")
    assert seconds < SLACK


@pytest.mark.parametrize("ragged", [False, True], ids=["fixed", "ragged"])
def test_row2_killed_between_header_and_payload(tmp_path, ragged):
    out = tmp_path / "ds"
    r = world(faults.case_stream_fault, str(out), "kill", 4, str(tmp_path), 30, ragged)
    assert r[1] is None
    assert r[0]["type"] == "PeerLostError" and r[0]["rank"] == 1
    assert re.search(r"during the payload of message \d+", r[0]["message"]), r[0]["message"]  # not the header
    assert r[2]["type"] == "PeerError" and r[2]["rank"] == 0, r[2]
    assert time_to_error(tmp_path, r[0]) < SLACK
    meta = assert_saved_exactly(out, 4, ragged)
    assert meta["failure"]["type"] == "PeerLostError" and meta["failure"]["rank"] == 1


def test_row3_a_stopped_rank_fails_after_the_timeout(tmp_path):
    out = tmp_path / "ds"
    r = world(faults.case_stream_fault, str(out), "stop", 4, str(tmp_path), STOP_TIMEOUT)
    assert r[0]["type"] == "PeerLostError" and r[0]["rank"] == 1
    assert f"no progress for {STOP_TIMEOUT:g} s" in r[0]["message"] and "timeout=" in r[0]["message"]
    # a gloo timeout closes every connection of rank 0, so rank 2 sees rank 0 go, at once
    assert r[2]["type"] == "PeerLostError" and r[2]["rank"] == 0, r[2]
    assert "timed out waiting for another rank" in r[2]["message"]
    assert r[2]["seen"] - r[0]["seen"] < SLACK
    seconds = time_to_error(tmp_path, r[0])
    assert seconds <= STOP_TIMEOUT + SLACK
    assert_saved_exactly(out, 4)


def test_row3_gather_with_a_stopped_rank(tmp_path):
    r = world(faults.case_gather_fault, "stop", str(tmp_path), STOP_TIMEOUT)
    assert r[0]["type"] == "PeerLostError" and r[0]["rank"] == 1
    assert "no progress for 3 s on the prelude of message 0" in r[0]["message"]
    assert r[0]["received"]["per_rank"] == {"0": 24, "1": 0, "2": 48}
    assert r[2]["type"] == "PeerLostError" and r[2]["rank"] == 0, r[2]
    seconds = r[0]["seen"] - r[0]["start"]
    print(f"gather() with a stopped rank raised after {seconds:.2f} s (timeout {STOP_TIMEOUT} s)")
    assert STOP_TIMEOUT <= seconds <= STOP_TIMEOUT + SLACK


@pytest.mark.parametrize("hung", [1, 0], ids=["sender", "rank0"])
def test_row29_a_rank_whose_loop_hangs_is_named_on_every_rank(tmp_path, hung):
    out = tmp_path / "ds"
    r = world(faults.case_hung_loop, str(out), hung, str(tmp_path), STOP_TIMEOUT)
    assert r[hung] is None  # still hung, then killed
    for rank in {0, 1, 2} - {hung}:
        assert r[rank]["type"] in ("StalledError", "PeerError"), r[rank]
        assert f"rank {hung} stalled: its loop made no call into tdgather for" in r[rank]["message"], r[rank]
        assert "_hang_forever" in r[rank]["message"]  # where it is stuck
        seconds = r[rank]["seen"] - faults._read_stamp(str(tmp_path), "fault")["time"]
        print(f"rank {rank} named the hung rank {hung} after {seconds:.2f} s (timeout {STOP_TIMEOUT} s)")
        assert STOP_TIMEOUT <= seconds <= STOP_TIMEOUT + SLACK
    if hung == 1:  # rank 0 keeps what it received
        assert r[0]["type"] == "PeerError" and r[0]["rank"] == 1
        ds = tdgather.open(out, incomplete=True)
        assert {f"r1_b{b:03d}.mp4" for b in range(2)} <= set(ds)


def test_row29_a_slow_loop_that_progresses_completes(tmp_path):
    out = tmp_path / "ds"
    # rank 1's 10 batches take 0.6 s each: 6 s in all, twice the timeout, while rank 0 waits in close
    r = run_local_world(faults.case_slow_loop, 3, str(out), 3.0, 0.6, timeout=120)
    assert r[0]["frames"] == sum(faults.BATCHES.values()) * faults.B
    assert len(tdgather.open(out)) == sum(faults.BATCHES.values())


@pytest.mark.parametrize("streaming", [False, True])
def test_row4_senders_exit_right_after_finishing(tmp_path, streaming):
    r = world(faults.case_exit_after_finishing, str(tmp_path / "ds"), streaming)
    assert r[0] == {"frames": 8 * (3 + 10 + 6)}  # rank 0 asserted every frame


CORRUPTIONS = {  # row 5, 6, 7, 8: name -> the field the error must name
    "magic": "prelude.magic",
    "version": "prelude.version",
    "header_len": "prelude.header_len",
    "payload_len": "prelude.payload_len",
    "non_utf8": "header",
    "nan": "header",
    "duplicate_keys": "header",
    "deep": "header",
    "pieces": "header.groups[0].pieces[0]",
    "runs": "header.groups[0].runs",
    "index": "prelude.payload_len",
    "dtype": "header.groups[0].layout.leaves[0].dtype",
    "file_ids": "header.groups[0].runs[]",
    "pickle": "header",
}


def test_rows5to8_corrupted_messages_from_real_peers(tmp_path):
    evidence = tmp_path / "unpickled"
    names = list(CORRUPTIONS)
    out = run_local_world(faults.case_corrupted_peers, len(names) + 1, names, str(evidence), timeout=180)[0]
    for rank, name in enumerate(names, start=1):
        got = out[name]
        assert got["type"] == "ProtocolError", (name, got)
        assert got["rank"] == rank and got["field"] == CORRUPTIONS[name], (name, got)
        assert f"protocol error from rank {rank} in {CORRUPTIONS[name]}: expected" in got["message"]
        # refused before any piece (1 MiB), or a header over the cap, was allocated
        assert got["largest_allocation"] < 64 << 10, (name, got)
    assert not evidence.exists()  # row 8: the pickle in the header never ran


def test_row8_pickle_bytes_travel_as_data_and_never_run(tmp_path):
    evidence = tmp_path / "unpickled"
    out = run_local_world(faults.case_pickle_as_data, 2, str(evidence), timeout=120)
    assert out[0] == {"files": ["meta.json", "payload.bin"]}
    assert not evidence.exists()
    import pickle

    pickle.loads(pickle.dumps(faults.MakesAFile(str(evidence))))  # the evidence works when unpickled
    assert evidence.exists()


def test_row14_disk_full_keeps_committed_shards_and_leaves_no_temporary_file(tmp_path):
    out = tmp_path / "ds"
    r = run_local_world(faults.case_disk_full, 2, str(out), timeout=120)
    assert r[0]["type"] == "OutputError" and "File too large" in r[0]["message"]
    assert "files already committed stay valid" in r[0]["message"]
    assert r[1]["type"] == "PeerError" and r[1]["rank"] == 0 and "OutputError" in r[1]["message"]
    partial = out.with_name("ds.partial")
    assert len(list(partial.glob("shard-*.safetensors"))) >= 2
    assert_shards_complete(partial)
    assert not out.exists()
    tdgather.save(tdgather.gather({"a": (0, torch.ones(1))}), out, overwrite=True)  # a rerun replaces it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_row14_output_refused_before_any_transfer(tmp_path):
    (tmp_path / "file").write_text("x")
    r = run_local_world(faults.case_output_refused, 2, str(tmp_path / "file" / "ds"), timeout=120)
    assert r[0]["type"] == "OutputError" and "cannot create its parent directory" in r[0]["message"]
    assert r[1]["type"] == "PeerError" and r[1]["rank"] == 0 and "OutputError" in r[1]["message"]


@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="needs POSIX users")
def test_row14_unwritable_directory_is_refused():
    # not under tmp_path: pytest makes that private to this user, and the check may run as another
    with tempfile.TemporaryDirectory(prefix="tdgather-ro-") as tmp:
        parent = Path(tmp) / "read-only"
        parent.mkdir()
        parent.chmod(0o555)
        os.chmod(tmp, 0o755)
        if os.geteuid() != 0:
            with pytest.raises(tdgather.OutputError, match="not writable; choose a writable path"):
                tdgather.storage.outdir.check_output(parent / "ds", overwrite=False)
            return
        # root writes anywhere: check as an unprivileged user, in a forked child (it runs no torch code)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.setuid(65534)
                tdgather.storage.outdir.check_output(parent / "ds", overwrite=False)
                os.write(write, b"accepted")
            except BaseException as e:
                os.write(write, str(e).encode()[:4000])
            os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        told = os.read(read, 4096).decode()
        os.close(read)
        assert "its parent directory is not writable; choose a writable path" in told, told


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_row17_millions_of_tiny_frames_in_bounded_memory(tmp_path):
    budget = 64 << 20
    out = run_local_world(faults.case_many_tiny_frames, 3, str(tmp_path / "ds"), 1_000_000, budget, timeout=300)[0]
    assert out["frames"] == 2_000_000
    assert out["anon"] < budget, f"rank 0 held {out['anon'] / 2**20:.0f} MiB over a {budget / 2**20:.0f} MiB budget"
    assert out["max_header"] < 64 << 10, "wire headers must not grow with the frame count"
    ds = tdgather.open(tmp_path / "ds")
    assert len(ds) == 2000 and ds["r2_clip00999.mp4"].frame_idx.tolist() == list(range(1000))
    for shard in (tmp_path / "ds").glob("shard-*.safetensors"):
        with open(shard, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
        assert header_len < 1 << 20, f"{shard.name}: safetensors header of {header_len} bytes"
    assert (tmp_path / "ds" / INDEX_NAME).stat().st_size < 4 << 20


def same_as(ds, kind):
    expected = faults.dataset(kind)
    return sorted(ds) == sorted(expected) and all(
        torch.equal(ds[n].frames, torch.stack([v for _, v in pairs])) for n, pairs in expected.items()
    )


KILL_POINTS = [("write", 2), ("write", 9), ("fsync", 1), ("fsync", 2), ("replace", 1), ("fsync", 5)]
KILL_POINTS += [("replace", 3), ("fsync", 7), ("replace", 4), ("exchange", 1), ("fsync", 9)]


ROW15 = [(*point, True) for point in KILL_POINTS] + [(*p, False) for p in KILL_POINTS if p[0] != "exchange"]


@pytest.mark.parametrize("event,count,with_old", ROW15)
def test_row15_rank0_killed_while_writing(tmp_path, event, count, with_old):
    target = tmp_path / "ds"
    if with_old:
        tdgather.save(tdgather.gather(faults.dataset("old")), target)
    with pytest.raises(WorldError, match="exited with code -9"):  # it was killed at that point
        run_local_world(faults.case_write_and_die, 1, str(target), event, count, timeout=60)
    partial = tmp_path / "ds.partial"
    # 1. what is visible is one complete dataset, or none
    if (target / INDEX_NAME).exists():
        assert same_as(tdgather.open(target), "old") or same_as(tdgather.open(target), "new")
    else:
        assert not with_old or event == "exchange", "the old dataset must stay until the new one replaces it"
        assert not target.exists() or not any(target.iterdir())
        with pytest.raises(tdgather.OutputError, match="not a complete tdgather dataset"):
            tdgather.open(target)
    # 2. no file with a final name is partial
    for directory in (target, partial):
        if directory.exists():
            for shard in directory.glob("shard-*.safetensors"):
                with safe_open(shard, framework="pt") as f:
                    [f.get_tensor(k) for k in f.keys()]
    # 3. a rerun is safe: it refuses, or replaces atomically when asked, and leaves nothing behind
    if target.exists() or partial.exists():
        with pytest.raises(tdgather.OutputError, match="overwrite=True"):
            tdgather.save(tdgather.gather(faults.dataset("new")), target)
    tdgather.save(tdgather.gather(faults.dataset("new")), target, overwrite=True)
    assert same_as(tdgather.open(target), "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]
    assert not [p.name for p in target.iterdir() if ".tmp-" in p.name]


def test_row33_rank_dst_killed_in_a_slow_job_with_small_outputs_loses_only_the_last_commit_interval(tmp_path):
    out = tmp_path / "ds"
    every = 1.0
    with pytest.raises(WorldError) as info:
        run_local_world(faults.case_small_outputs_then_dst_killed, 2, str(out), str(tmp_path), every, timeout=120)
    killed = faults._read_stamp(str(tmp_path), "fault")["time"]
    dst = json.loads((tmp_path / "rank0.json").read_text())
    assert dst["received"]["1"] > 0  # status() moved during the loop: rank 1 sends in time, not at close
    sender = info.value.results[1]
    assert sender["type"] == "PeerLostError" and sender["rank"] == 0, sender
    sender_log = sender["log"]
    ds = tdgather.open(out, incomplete=True)
    window = every + every / 4 + SLACK / 2  # the commit interval, a sender's flush, and scheduling on 2 cores
    for name, log in (("r0.mp4", dst["log"]), ("r1.mp4", sender_log)):
        due = max((n for t, n in log if t <= killed - window), default=0)  # added more than the window before
        saved = len(ds[name].frame_idx) if name in ds else 0
        print(f"{name}: {saved} frames saved, {due} added more than {window:.1f} s before the kill")
        assert due > 0 and saved >= due, (name, saved, due)
    log = (tmp_path / "rank0.err").read_text()  # progress lines in a plain log, with no logging setup
    assert re.search(r"tdgather: \d+ frames received, \d+ MB, \d+ shards", log), log[-2000:]
