"""Without torch.distributed, or with one rank, gather works locally and makes no distributed calls."""

import pytest
import torch
import torch.distributed as dist

import tdgather
from tdgather.tools.launch import WorldError, run_local_world


def test_not_initialised_works_locally(monkeypatch):
    def no_calls(*a, **k):
        raise AssertionError("distributed call")

    monkeypatch.setattr(dist, "isend", no_calls)
    monkeypatch.setattr(dist, "irecv", no_calls)
    out = tdgather.gather({"a": [(2, torch.ones(1)), (1, torch.zeros(1))]})
    assert list(out) == ["a"] and out["a"].frame_idx.tolist() == [1, 2]
    assert out.stats.frames_per_rank == {0: 2}


def one_rank_world() -> dict:
    def no_calls(*a, **k):
        raise AssertionError("distributed call")

    dist.isend = dist.irecv = dist.new_group = no_calls
    out = tdgather.gather({"a": (0, torch.ones(2))})
    return {"files": list(out)}


def test_world_size_one_makes_no_distributed_calls():
    assert run_local_world(one_rank_world, 1, timeout=60) == [{"files": ["a"]}]


def failing_rank() -> None:
    if dist.get_rank() == 1:
        raise KeyError("boom")


def test_launcher_reports_rank_failures():
    with pytest.raises(WorldError, match=r"ranks \[1\][\s\S]*KeyError: 'boom'") as info:
        run_local_world(failing_rank, 2, timeout=60)
    assert info.value.results == [None, None] and list(info.value.failures) == [1]


@pytest.mark.parametrize("kw", [{"memory_budget": 0}, {"memory_budget": -5}, {"max_pending": 0}, {"chunk_bytes": 0}])
def test_collector_settings_are_checked(kw, tmp_path):
    with pytest.raises(ValueError, match=rf"{next(iter(kw))}: expected"):
        tdgather.Collector(tmp_path / "ds", **kw)
