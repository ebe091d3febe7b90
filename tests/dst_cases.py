"""Rank functions for `dst` / `group_dst` (torch's convention), run in real gloo worlds by test_dst.py."""

import numpy as np
import torch
import torch.distributed as dist

import tdgather


def _outcome(fn) -> dict:
    try:
        value = fn()
    except (ValueError, tdgather.TdgatherError) as e:
        return {"type": type(e).__name__, "message": str(e)}
    return {"value": value}


def _subgroup(rank: int):
    """Global ranks 1 and 3's gloo group (a collective: every rank makes it), connected on both before use.

    A member that raises at once would otherwise close its end while the other still connects
    ("Gloo connectFullMesh failed ... Connection closed by peer", seen under load).
    """
    group = dist.new_group([1, 3], backend="gloo")
    if rank in (1, 3):
        dist.barrier(group=group)
    return group


def case_gather_in_a_subgroup(how: dict) -> dict:
    """Global ranks 1 and 3 gather in their own group; who holds the result (by global rank)."""
    rank = dist.get_rank()
    group = _subgroup(rank)
    if rank not in (1, 3):
        return {"member": False}
    preds = {f"from_{rank}.mp4": (0, torch.full((2,), float(rank)))}

    how = dict(how)
    if "dst_as" in how:  # the forms a user holds: a numpy integer, a LongTensor element
        kind = how.pop("dst_as")
        how["dst"] = np.int64(how["dst"]) if kind == "numpy" else torch.tensor(how["dst"])

    def call() -> list | None:
        result = tdgather.gather(preds, group=group, timeout=60, **how)
        return None if result is None else sorted(result)

    return {"member": True, **_outcome(call)}


def case_collector_in_a_subgroup(out: str, how: dict) -> dict:
    """Global ranks 1 and 3 collect in their own group; which global rank wrote (and returned a summary)."""
    rank = dist.get_rank()
    group = _subgroup(rank)
    if rank not in (1, 3):
        return {"member": False}

    def call() -> bool:
        with tdgather.Collector(out, group=group, timeout=60, progress=False, **how) as col:
            col.add([f"from_{rank}.mp4"], [0], torch.full((1, 2), float(rank)))
        return col.summary is not None

    return {"member": True, **_outcome(call)}


def case_collector_dst(out: str, how: dict) -> dict:
    """A Collector on the whole world, with ``how`` (dst=, ranks_per_writer=...)."""
    rank = dist.get_rank()

    def call() -> bool:
        with tdgather.Collector(out, timeout=60, progress=False, **how) as col:
            col.add([f"from_{rank}.mp4"], [0], torch.full((1, 2), float(rank)))
        return col.summary is not None

    return _outcome(call)


def _failure(fn) -> dict:
    try:
        fn()
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e), "rank": getattr(e, "rank", None)}
    return {}


def case_a_failure_in_a_subgroup(out: str) -> dict:
    """Global ranks 0 and 3 in their own group; global rank 3 fails in gather, then in a Collector: how each says so."""
    rank = dist.get_rank()
    group = dist.new_group([0, 3], backend="gloo")
    if rank not in (0, 3):
        return {"member": False}
    dist.barrier(group=group)  # connected on both before rank 3 fails (see _subgroup)
    value = torch.ones(1, dtype=torch.complex128 if rank == 3 else torch.float32)  # refused on rank 3

    def collect() -> None:
        with tdgather.Collector(out, group=group, timeout=60, progress=False) as col:
            col.add([f"from_{rank}.mp4"], [0], torch.ones(1, 2))
            if rank == 3:
                raise RuntimeError("boom on rank 3")

    failed = _failure(lambda: tdgather.gather({"a.mp4": (rank, value)}, group=group, timeout=60))
    return {"member": True, "gather": failed, "collect": _failure(collect)}
