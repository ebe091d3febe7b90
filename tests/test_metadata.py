"""The user's metadata= is the user's: its own namespace in the index, checked up front on every rank."""

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

import tdgather
from tdgather.tools.launch import run_local_world

OURS_TOO = {"run": "exp-42", "duplicates": "keep-first", "total_frames": 1000, "attempts": [1]}


def test_save_keeps_user_keys_that_tdgather_also_uses(tmp_path):
    result = tdgather.gather({f"v{i}.mp4": (0, torch.ones(2)) for i in range(3)})
    tdgather.save(result, tmp_path / "ds", metadata=OURS_TOO)
    ds = tdgather.open(tmp_path / "ds")
    assert ds.metadata["user"] == OURS_TOO
    assert ds.metadata["total_frames"] == 3 and isinstance(ds.metadata["duplicates"], dict)


@pytest.mark.parametrize(
    ("metadata", "match"),
    [
        ({"lr": object()}, r"metadata\['lr'\]: expected a JSON value .* got object"),
        ({"cfg": {"shape": np.zeros(3)}}, r"metadata\['cfg'\]\['shape'\]: .* got numpy.ndarray; convert it first"),
        ({1: "a"}, r"keys must be str .* got int key 1"),
        ({"loss": float("nan")}, r"metadata\['loss'\]: expected a finite number"),
    ],
)
def test_bad_metadata_is_refused_before_any_work_naming_the_key(tmp_path, metadata, match):
    with pytest.raises((TypeError, ValueError), match=match):
        with tdgather.Collector(tmp_path / "ds", metadata=metadata):  # refused when it opens
            pass
    with pytest.raises((TypeError, ValueError), match=match):
        tdgather.save(tdgather.gather({"a": (0, torch.ones(1))}), tmp_path / "ds", metadata=metadata)
    assert not (tmp_path / "ds").exists() and not (tmp_path / "ds.partial").exists()


def case_collector_metadata(out: str, fail: bool) -> dict:
    rank = dist.get_rank()
    meta = {"lr": np.float32(0.1), "epoch": np.int64(3), "run": "exp-42", "ok": np.bool_(True)}
    try:
        with tdgather.Collector(out, timeout=60, progress=False, metadata=meta) as col:
            col.add([f"r{rank}.mp4"], [0], torch.ones(1, 2))
            if fail and rank == 1:
                raise RuntimeError("boom")
    except (RuntimeError, tdgather.PeerError) as e:
        return {"error": type(e).__name__}
    return {}


def case_bad_metadata(out: str, bad_on: list[int]) -> dict:
    """Ranks ``bad_on`` pass metadata JSON cannot hold; only rank dst's is stored, and checked."""
    rank = dist.get_rank()
    meta = {"lr": np.zeros(2)} if rank in bad_on else {"lr": 0.1}
    start = time.monotonic()
    try:
        with tdgather.Collector(out, metadata=meta, timeout=60, progress=False) as col:
            col.add([f"r{rank}.mp4"], [0], torch.ones(1, 2))
    except (TypeError, tdgather.PeerError) as e:
        return {"type": type(e).__name__, "error": str(e), "seconds": time.monotonic() - start}
    return {"type": None, "seconds": time.monotonic() - start}


@pytest.mark.world
def test_a_collector_stores_numpy_scalars_as_users_expect_complete_or_not(tmp_path):
    run_local_world(case_collector_metadata, 2, str(tmp_path / "ok"), False, timeout=120)
    want = {"lr": 0.1, "epoch": 3, "run": "exp-42", "ok": True}
    assert tdgather.open(tmp_path / "ok").metadata["user"] == want
    out = run_local_world(case_collector_metadata, 2, str(tmp_path / "failed"), True, timeout=120)
    assert [r["error"] for r in out] == ["PeerError", "RuntimeError"]
    ds = tdgather.open(tmp_path / "failed", incomplete=True)
    assert ds.metadata["user"] == want and ds.metadata["failure"]["rank"] == 1


@pytest.mark.world
def test_bad_metadata_on_rank_dst_fails_every_rank_when_it_opens(tmp_path):
    out = run_local_world(case_bad_metadata, 2, str(tmp_path / "ds"), [0], timeout=120)
    assert [r["type"] for r in out] == ["TypeError", "PeerError"], out
    assert all("metadata['lr']" in r["error"] and "numpy.ndarray" in r["error"] for r in out), out
    assert all(r["seconds"] < 30 for r in out), out  # at the `with` line, not after the 60 s timeout
    assert not (tmp_path / "ds").exists() and not (tmp_path / "ds.partial").exists()


@pytest.mark.world
def test_metadata_of_other_ranks_is_not_stored_nor_checked(tmp_path):
    out = run_local_world(case_bad_metadata, 2, str(tmp_path / "ds"), [1], timeout=120)
    assert [r["type"] for r in out] == [None, None], out
    assert tdgather.open(tmp_path / "ds").metadata["user"] == {"lr": 0.1}  # rank dst's
