"""What a new user does on day one, in real gloo worlds: the seed scenario, uneven ranks, conflicts after
shards were written, a filename UTF-8 cannot encode, and collective misuse. Each test is bounded in time."""

import os
import threading

import pytest
import torch

import tdgather
from tdgather.tools.launch import WorldError, run_local_world

from . import newuser
from .procs import kill_later

pytestmark = pytest.mark.world


@pytest.mark.parametrize("how", ["gather", "collector"])
@pytest.mark.parametrize("world", [3, 5])
def test_seed_scenario_padded_sampler_with_a_batched_conv_model(tmp_path, how, world):
    """DistributedSampler pads with repeats that the model runs in other batches: one copy is kept."""
    runs = [run_local_world(newuser.case_seed, world, how, str(tmp_path / f"run{k}"), timeout=120)[0] for k in (0, 1)]
    r = runs[0]
    print(f"\n{how}, {world} ranks: {r}")
    assert r["exact"] + r["inexact"] == r["padding"] > 0
    assert r["max_abs_diff"] < 1e-5
    assert runs[1] == r  # the same run keeps the same copies...
    a, b = tdgather.open(tmp_path / "run0"), tdgather.open(tmp_path / "run1")
    for name in a:  # ...and writes the same bits
        assert torch.equal(a[name].frames["depth"].view(torch.int32), b[name].frames["depth"].view(torch.int32))


def test_seed_scenario_under_the_exact_policy_names_the_inexact_copy(tmp_path):
    r = run_local_world(newuser.case_seed, 5, "gather", str(tmp_path / "ds"), "keep", timeout=120)[0]
    if not r["inexact"]:
        pytest.skip("this CPU gave bit-identical padded copies: nothing for the exact policy to refuse")
    with pytest.raises(
        Exception,
        match=r"DuplicateFrameError: filename 'video_\d\d.mp4', frame_idx \d+: ranks \d and "
        r"\d sent values that differ \(largest absolute difference [\d.e-]+\), and the duplicates "
        r"policy is 'exact'",
    ):
        run_local_world(newuser.case_seed, 5, "gather", str(tmp_path / "strict"), "exact", timeout=120)


# (gather, a late sender) is not here: every rank must enter gather within the timeout, as documented
@pytest.mark.parametrize("how, busy", [("collector", "dst"), ("collector", "sender"), ("gather", "dst")])
def test_ranks_that_finish_many_timeouts_apart_complete(tmp_path, how, busy):
    out = run_local_world(newuser.case_uneven_finish, 3, how, busy, 6.0, 1.0, str(tmp_path / "ds"), timeout=120)
    assert out[0]["frames"] == 9
    assert all(r["waited"] >= 5.5 for r in out)  # everyone waited through 6 timeouts of 1 s, and nobody failed


def test_a_stopped_dst_is_detected_by_finished_senders_within_the_timeout(tmp_path):
    out = str(tmp_path / "ds")
    killer = threading.Thread(target=kill_later, args=(out + ".pid", 8.0), daemon=True)
    killer.start()
    with pytest.raises(WorldError) as info:  # rank 0 stopped, then killed: it leaves no result
        run_local_world(newuser.case_dst_stops_after_senders_finished, 3, out, 2.0, timeout=40)
    stopped = os.path.getmtime(out + ".pid")  # written by rank 0 just before it stopped: the world's own clock
    assert set(info.value.failures) == {0}
    for r in info.value.results[1:]:
        assert r["type"] == "PeerLostError" and r["rank"] == 0, r
        assert "no progress for 2 s" in r["message"]
        assert r["at"] - stopped < 2.0 + 5.0  # the timeout, plus slack on 2 cores (process start-up not counted)


def test_a_conflict_after_shards_were_written_keeps_what_was_saved(tmp_path):
    out = tmp_path / "ds"
    r = run_local_world(newuser.case_conflict_after_shards, 3, str(out), timeout=120)
    assert r[0]["type"] == "DuplicateFrameError", r[0]
    assert "'x.mp4', frame_idx 1: rank 1 and later rank 2" in r[0]["message"]
    assert r[1]["type"] == r[2]["type"] == "PeerError" and r[1]["rank"] == 0
    assert not out.exists()
    saved = tdgather.open(out, incomplete=True)
    assert "DuplicateFrameError" == saved.metadata["failure"]["type"]
    assert sorted(saved) == ["one.mp4", "three.mp4", "two.mp4", "x.mp4"]  # what arrived after the conflict too
    assert saved["x.mp4"].frames.eq(0).all()  # rank 1's copy, written first, stays


def test_gather_conflict_error_carries_what_was_received():
    r = run_local_world(newuser.case_gather_conflict_keeps_received, 3, timeout=120)
    assert r[0]["type"] == "DuplicateFrameError" and "ranks 0 and 1" in r[0]["message"]
    assert r[0]["received"] == {
        "own0.mp4": [[0.0, 0.0]],
        "own1.mp4": [[1.0, 1.0]],
        "own2.mp4": [[2.0, 2.0]],
        "x.mp4": [[0.0, 0.0]],
    }


@pytest.mark.parametrize("how", ["gather", "collector"])
def test_a_filename_utf8_cannot_encode_is_named_by_rank_dst_within_a_second(tmp_path, how):
    r = run_local_world(newuser.case_bad_filename_on_a_rank, 3, how, str(tmp_path / "ds"), timeout=120)
    assert r[1]["type"] == "UnsupportedValueError" and "cannot be encoded as UTF-8" in r[1]["message"]
    assert r[0]["type"] == "PeerError" and r[0]["rank"] == 1 and "cannot be encoded as UTF-8" in r[0]["message"]
    assert r[0]["seconds"] < 1.0 + 1.0  # one second, plus scheduling slack on 2 cores
    assert not (tmp_path / "ds").exists()


def test_different_dst_ends_within_the_timeout_naming_the_likely_cause(tmp_path):
    r = run_local_world(newuser.case_misuse, 3, "different_dst", str(tmp_path), 3.0, timeout=120)
    assert all(x["type"] in ("PeerError", "PeerLostError", "CallMismatchError") for x in r), r
    assert all(x["seconds"] < 3.0 + 5.0 for x in r)
    mismatch = [x for x in r if x["type"] == "CallMismatchError"]
    assert mismatch and all("its dst differ (rank " in x["message"] for x in mismatch), r


def test_a_skipped_collector_is_named_not_mixed_in(tmp_path):
    r = run_local_world(newuser.case_misuse, 3, "skipped_collector", str(tmp_path), 30.0, timeout=120)
    assert r[2]["type"] == "CallMismatchError" and "rank 0 is in another tdgather call" in r[2]["message"]
    assert "its kind of call (gather or Collector) or Collector path differ" in r[2]["message"]
    assert r[0]["type"] == "CallMismatchError" and "rank 2 is in another tdgather call" in r[0]["message"]
    assert all(x["seconds"] < 10 for x in r)
    assert not (tmp_path / "epoch_1").exists() and not (tmp_path / "epoch_2").exists()


def test_two_collectors_on_one_group_are_refused_on_every_rank(tmp_path):
    r = run_local_world(newuser.case_misuse, 3, "two_collectors", str(tmp_path), 30.0, timeout=120)
    for x in r:  # refused on the rank itself, or (if rank 0 refused first) relayed from rank 0
        assert x["type"] in ("CallMismatchError", "PeerError"), x
        assert "was started while another tdgather call" in x["message"] and "dist.new_group(" in x["message"]
    r = run_local_world(newuser.case_misuse, 3, "gather_inside_collector", str(tmp_path / "g"), 30.0, timeout=120)
    for x in r:
        assert x["type"] in ("CallMismatchError", "PeerError") and "a gather was started while" in x["message"], x


def test_two_collectors_on_two_groups_both_work(tmp_path):
    r = run_local_world(newuser.case_misuse, 3, "two_collectors_two_groups", str(tmp_path), 30.0, timeout=120)
    assert r[0] == {"type": None, "pred": 3, "emb": 3, "emb_shape": [1, 3]}


def test_collector_overwrite_onto_a_user_directory_is_refused_on_every_rank(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    r = run_local_world(newuser.case_overwrite_user_directory, 3, str(mine), timeout=120)
    assert (
        r[0]["type"] == "OutputError" and "is not a complete tdgather dataset (it holds 'notes.txt')" in r[0]["message"]
    )
    for x in r[1:]:
        assert x["type"] == "PeerError" and x["rank"] == 0 and "not a complete tdgather dataset" in x["message"]
    assert os.listdir(mine) == ["notes.txt"] and (mine / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["mine"]


def test_a_rank_late_to_open_the_collector_is_the_one_named(tmp_path):
    r = run_local_world(newuser.case_late_open, 3, str(tmp_path / "ds"), 4.0, 1.0, timeout=120)
    assert r[0]["type"] == "PeerLostError" and r[0]["rank"] == 1, r[0]
    assert "did not open its Collector within 1 s of rank 0" in r[0]["message"]
    assert all(x["type"] is not None for x in r)  # nobody goes on as if nothing happened
    assert os.listdir(tmp_path) == []  # no .partial left to block the rerun


def test_a_rank_that_died_before_opening_is_not_called_late(tmp_path):
    with pytest.raises(WorldError) as e:
        run_local_world(newuser.case_dead_before_open, 2, str(tmp_path / "ds"), 30.0, timeout=120)
    r = e.value.results[0]
    assert r["type"] == "PeerLostError" and r["rank"] == 1 and r["seconds"] < 25, r
    assert "probably failed or died" in r["message"] and "did not open its Collector within" not in r["message"]


@pytest.mark.parametrize("same_seed", [True, False], ids=["padding", "overlap"])
def test_copies_beyond_what_padding_makes_are_reported_as_frames_never_predicted(tmp_path, same_seed):
    r = run_local_world(newuser.case_sampler_overlap, 2, str(tmp_path / "ds"), same_seed, timeout=120)[0]
    if same_seed:  # DistributedSampler pads 23 samples to 24: one copy, expected, no warning
        assert r["dropped"] == 1 and r["frames"] == 23 and r["warnings"] == []
    else:  # each rank its own permutation: the shares overlap, frames are lost
        assert r["dropped"] > 1 and r["frames"] < 23 and len(r["warnings"]) == 1, r
        assert f"{r['dropped']} copies of frames were predicted more than once" in r["warnings"][0]
        assert "never predicted" in r["warnings"][0] and "WARNING:" in r["text"]
