"""`dst` is a global rank and `group_dst` a rank within `group=`, as in torch.distributed, in real gloo worlds."""

import re

import pytest
import torch

import tdgather
from tdgather.tools.launch import run_local_world

from . import dst_cases as dc

pytestmark = pytest.mark.world
FROM_BOTH = ["from_1.mp4", "from_3.mp4"]


def test_dst_is_a_global_rank_in_a_subgroup():
    out = run_local_world(dc.case_gather_in_a_subgroup, 4, {"dst": 1}, timeout=120)
    assert [r["member"] for r in out] == [False, True, False, True]
    assert out[1]["value"] == FROM_BOTH and out[3]["value"] is None  # global rank 1, not group rank 1 (global 3)


@pytest.mark.parametrize("kind", ["numpy", "tensor"])
def test_dst_may_be_a_numpy_or_tensor_integer(kind):
    out = run_local_world(dc.case_gather_in_a_subgroup, 4, {"dst": 3, "dst_as": kind}, timeout=120)
    assert out[3]["value"] == FROM_BOTH and out[1]["value"] is None


def test_group_dst_is_a_rank_within_the_group():
    out = run_local_world(dc.case_gather_in_a_subgroup, 4, {"group_dst": 1}, timeout=120)
    assert out[3]["value"] == FROM_BOTH and out[1]["value"] is None


@pytest.mark.parametrize(
    ("how", "match"),
    [
        ({"dst": 2}, r"global rank 2 is not in the group, whose global ranks are \[1, 3\]"),
        ({}, r"global rank 0 \(the default, as in torch.distributed\) is not in the group.*group_dst="),
        ({"dst": 0}, r"dst: global rank 0 is not in the group, whose global ranks are \[1, 3\]"),
        ({"dst": 1.0}, r"dst: expected an integer rank, got float 1.0"),
        ({"group_dst": 2}, r"group_dst: expected a rank within the group, 0..1 \(global ranks \[1, 3\]\), got 2"),
        ({"dst": 1, "group_dst": 0}, r"pass one of them"),
    ],
)
def test_a_dst_outside_the_group_is_refused_on_every_member(how, match):
    out = run_local_world(dc.case_gather_in_a_subgroup, 4, how, timeout=120)
    for r in (out[1], out[3]):
        assert r["type"] == "ValueError", out
        assert re.search(match, r["message"]), r["message"]


def test_collector_dst_is_a_global_rank(tmp_path):
    out = run_local_world(dc.case_collector_in_a_subgroup, 4, str(tmp_path / "a"), {"dst": 3}, timeout=120)
    assert out[3]["value"] is True and out[1]["value"] is False  # global rank 3 wrote
    ds = tdgather.open(tmp_path / "a")
    assert sorted(ds) == FROM_BOTH and torch.equal(ds["from_3.mp4"].frames, torch.full((1, 2), 3.0))
    out = run_local_world(dc.case_collector_in_a_subgroup, 4, str(tmp_path / "b"), {"group_dst": 0}, timeout=120)
    assert out[1]["value"] is True and out[3]["value"] is False
    out = run_local_world(dc.case_collector_in_a_subgroup, 4, str(tmp_path / "c"), {}, timeout=120)
    assert all("not in the group" in out[r]["message"] for r in (1, 3)), out
    assert not (tmp_path / "c").exists()


def test_with_writers_rank_dst_must_be_a_writer(tmp_path):
    out = run_local_world(dc.case_collector_dst, 4, str(tmp_path / "x"), {"dst": 1, "ranks_per_writer": 2}, timeout=120)
    assert all(r["type"] == "ValueError" and "must be one of them" in r["message"] for r in out), out
    out = run_local_world(dc.case_collector_dst, 4, str(tmp_path / "y"), {"dst": 2, "ranks_per_writer": 2}, timeout=120)
    assert [r["value"] for r in out] == [False, False, True, False]
    assert sorted(tdgather.open(tmp_path / "y")) == [f"from_{r}.mp4" for r in range(4)]


def test_both_dst_and_group_dst_are_refused_without_a_process_group(tmp_path):
    with pytest.raises(ValueError, match="pass one of them"):
        tdgather.gather({"a": (0, torch.ones(1))}, dst=0, group_dst=0)
    with pytest.raises(ValueError, match="pass one of them"):
        tdgather.Collector(tmp_path / "x", dst=0, group_dst=0)


def test_errors_name_the_global_rank_with_the_group_rank_beside_it(tmp_path):
    out = run_local_world(dc.case_a_failure_in_a_subgroup, 4, str(tmp_path / "ds"), timeout=120)
    assert [r["member"] for r in out] == [True, False, False, True]
    gather, collect = out[0]["gather"], out[0]["collect"]  # rank 0, told that global rank 3 (its group's 1) failed
    assert gather["type"] == "PeerError" and gather["rank"] == 1, gather
    assert "rank 3 (group rank 1) failed with UnsupportedValueError" in gather["message"], gather
    assert collect["type"] == "PeerError" and collect["rank"] == 1, collect
    assert "rank 3 (group rank 1) failed with RuntimeError: boom on rank 3" in collect["message"], collect
    assert out[3]["gather"]["type"] == "UnsupportedValueError" and out[3]["collect"]["type"] == "RuntimeError"
    failure = tdgather.open(tmp_path / "ds", incomplete=True).metadata["failure"]
    assert "rank 3 (group rank 1) failed" in failure["message"]
