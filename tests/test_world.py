"""Real multi-process gloo worlds: tdgather.gather against torch.distributed.gather_object."""

import pytest

import tdgather
from tdgather.tools.launch import run_local_world

from . import cases

pytestmark = pytest.mark.world
WORLDS = [2, 3, 4]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("scenario", ["uneven", "zero_rank", "all_empty", "split", "mixed", "nested"])
def test_gather_matches_gather_object(world, scenario):
    out = run_local_world(cases.case_compare, world, scenario, timeout=120)
    assert out[1:] == [None] * (world - 1)
    summary = out[0]
    assert summary["frames"] == summary["sent"]
    assert sum(summary["per_rank"].values()) == summary["sent"]
    assert len(summary["per_rank"]) == world
    if scenario == "all_empty":
        assert summary["frames"] == 0
    if scenario == "zero_rank":
        assert summary["per_rank"]["1"] == 0


@pytest.mark.parametrize("world", WORLDS)
def test_identical_duplicates_are_kept_once_and_counted(world):
    summary = run_local_world(cases.case_compare, world, "dup_identical", timeout=120)[0]
    assert summary["duplicates"] == 2
    assert summary["frames"] == summary["sent"] - 2


@pytest.mark.parametrize("world", WORLDS)
def test_conflicting_duplicates_raise_on_every_rank(world):
    out = run_local_world(cases.case_error, world, "dup_conflict", "exact", timeout=120)
    assert out[0]["type"] == "DuplicateFrameError"
    assert "filename 'x.mp4', frame_idx 1" in out[0]["message"]
    assert "ranks 0 and 1" in out[0]["message"]
    for r in out[1:]:
        assert r["type"] == "PeerError" and r["rank"] == 0
        assert "DuplicateFrameError" in r["message"]


@pytest.mark.parametrize("world", WORLDS)
def test_shape_mismatch_names_filename_shapes_and_ranks(world):
    out = run_local_world(cases.case_error, world, "shape_mismatch", timeout=120)
    msg = out[0]["message"]
    assert out[0]["type"] == "ShapeMismatchError"
    assert "'x.mp4'" in msg and "float32[3]" in msg and "float32[3, 4]" in msg
    assert "rank 0" in msg and "rank 1" in msg
    # nothing received is lost: every other frame, and x.mp4 as rank 0 sent it
    assert out[0]["received"] == {"ok.mp4": list(range(world)), "x.mp4": [0]}


def test_bad_input_on_a_sender_is_reported_by_rank_0():
    out = run_local_world(cases.case_error, 3, "unsupported", timeout=120)
    assert out[1]["type"] == "UnsupportedValueError" and "complex128" in out[1]["message"]
    assert out[0]["type"] == "PeerError" and out[0]["rank"] == 1
    assert "UnsupportedValueError" in out[0]["message"] and "complex128" in out[0]["message"]
    assert out[2]["type"] == "PeerError" and out[2]["rank"] == 0


@pytest.mark.parametrize("world", WORLDS)
def test_frame_store_batches(world):
    assert run_local_world(cases.case_store, world, 5, timeout=120)[0]["frames"] == world * 20


def test_rank_0_never_unpickles():
    assert run_local_world(cases.case_no_unpickle, 3, "nested", timeout=120)[0]["frames"] > 0


@pytest.mark.parametrize("world", [16, 32])
def test_many_ranks(tmp_path, world):
    out = run_local_world(cases.case_many_ranks, world, str(tmp_path / "ds"), timeout=280)
    assert out[1:] == [None] * (world - 1)
    assert out[0]["ranks_sending"] == world  # every rank held frames, so every stream carried data


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl", "gloo"])
def test_side_gloo_group_is_made_once_and_reused(backend):
    out = run_local_world(cases.case_side_group, 3, backend, timeout=120)
    want = [] if backend == "gloo" else ["gloo"]  # three gathers, one group
    assert [r["made"] for r in out] == [want] * 3


def test_one_writer_per_node_with_node_groups(tmp_path):
    out = run_local_world(cases.case_writer_per_node, 4, str(tmp_path), 2, timeout=120)
    assert [(r["node"], r["wrote"]) for r in out] == [(0, True), (0, False), (1, True), (1, False)]
    got = {}
    for node in (0, 1):
        ds = tdgather.open(tmp_path / f"node-{node}")
        got.update({name: ds[name] for name in ds})
    expected = cases.reference([cases.predictions("uneven", r, 4) for r in range(4)])
    cases.assert_matches(dict(sorted(got.items())), expected)


@pytest.mark.parametrize("world,early_bytes", [(2, 32 << 20), (3, 6 << 20)])
def test_pieces_that_come_while_rank0_places_land_after_it(world, early_bytes):
    # 80k frames of 256 bytes: ~20 MB over the senders, pieces of about 4 MiB (with 3 ranks, each
    # sender's first piece fits in 6 MiB, its second does not)
    out = run_local_world(cases.case_slow_placement, world, 80_000, early_bytes, timeout=120)[0]
    assert out["frames"] == 80_000 and out["dups"] == 1
    if early_bytes > 10 << 20:
        assert out["early"] == out["pieces"] >= 2  # every piece came while rank 0 was placing
    else:
        assert 1 <= out["early"] < out["pieces"]  # some early, the rest waited for the placement
