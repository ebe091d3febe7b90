"""Process groups and ranks: the gloo group a call sends on, rank dst, global ranks, and the timeout.

Messages go on a gloo group. When the given group is not plain gloo (NCCL, or
``cpu:gloo,cuda:nccl``), `transport_group` makes a side gloo group with the same ranks once
and reuses it. `resolve_dst` turns torch's ``dst``/``group_dst`` pair into the group rank that
receives; ranks on the wire are group ranks, and `global_rank` names the global rank beside
them in messages. `as_timeout` normalises a call's timeout, which bounds silence, and
`heartbeat_interval` is how often a waiting rank hears from a busy one.
"""

from __future__ import annotations

import operator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = [
    "DEFAULT_TIMEOUT",
    "as_timeout",
    "global_rank",
    "heartbeat_interval",
    "needs_side_group",
    "resolve_dst",
    "transport_group",
]

DEFAULT_TIMEOUT = timedelta(minutes=30)
_SIDE_GROUPS: dict[tuple[int, ...], Any] = {}


def as_timeout(timeout: float | timedelta | None) -> timedelta:
    """Normalise a timeout given in seconds or as a timedelta (None: the default)."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not 0 < seconds < 10**8:  # gloo needs a finite wait; heartbeats make a long one unnecessary
        raise ValueError(
            f"timeout: expected a positive, finite number of seconds (it bounds silence, not work: busy ranks "
            f"send heartbeats), got {timeout!r}"
        )
    return timedelta(seconds=seconds)


def needs_side_group(backend: str) -> bool:
    """Whether a process group with this backend string needs a side gloo group.

    >>> needs_side_group("gloo"), needs_side_group("nccl"), needs_side_group("cpu:gloo,cuda:nccl")
    (False, True, True)
    """
    return str(backend).lower() != "gloo"


def transport_group(group: Any = None) -> Any:
    """Return the gloo group tdgather sends on for ``group`` (default: the world).

    Every member of ``group`` must call this, in the same order, the first time
    (``dist.new_group`` is collective over the members). Later calls are free.
    """
    group = group if group is not None else dist.group.WORLD
    if not needs_side_group(dist.get_backend(group)):
        return group
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in _SIDE_GROUPS:
        _SIDE_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return _SIDE_GROUPS[ranks]


def resolve_dst(group: Any, dst: int | None, group_dst: int | None) -> int:
    """The rank of ``group`` that receives, from torch's pair of arguments; every rank computes the same.

    As in ``torch.distributed.gather``: ``dst`` is a global rank, ``group_dst`` a rank within
    ``group``; at most one may be given, and with neither the receiver is global rank 0. Without
    a process group, 0 (this process).

    Raises:
        ValueError: both were given, or the rank named is not in the group.
    """
    if dst is not None and group_dst is not None:
        raise ValueError(
            f"dst={dst!r} and group_dst={group_dst!r}: pass one of them, as in torch.distributed: dst is a "
            "global rank, group_dst a rank within group="
        )
    defaulted = dst is None and group_dst is None
    dst, group_dst = _rank(dst, "dst"), _rank(group_dst, "group_dst")
    if not (dist.is_available() and dist.is_initialized()):
        return 0  # a local call: this process receives
    group = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    if group_dst is not None:
        if not 0 <= group_dst < len(ranks):
            raise ValueError(
                f"group_dst: expected a rank within the group, 0..{len(ranks) - 1} (global ranks {ranks}), "
                f"got {group_dst}"
            )
        return group_dst
    dst = 0 if dst is None else dst
    if dst not in ranks:
        default = " (the default, as in torch.distributed)" if defaulted else ""
        raise ValueError(
            f"dst: global rank {dst}{default} is not in the group, whose global ranks are {_describe_ranks(ranks)}; "
            f"pass dst= one of those, or group_dst= a rank within the group (0..{len(ranks) - 1})"
        )
    return dist.get_group_rank(group, dst)


def _rank(value: Any, name: str) -> int | None:
    """A rank given as an int, a numpy integer or a one-element integer tensor (never a bool or a float)."""
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name}: expected an integer rank, got {type(value).__name__} {value!r}") from None


def _describe_ranks(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 16 else f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] ({len(ranks)} ranks)"


def global_rank(group: Any, rank: int) -> int:
    """The global rank of ``group``'s rank ``rank``: itself for the world (``None``), or without a process group.

    Ranks on the wire and in a call's bookkeeping are group ranks; messages name the global rank beside
    it (`tdgather.errors.rank_name`), as torchrun's logs do. A `tdgather.comm.transport.Channel` maps its
    peer once, here.
    """
    if group is None or group is dist.group.WORLD or not (dist.is_available() and dist.is_initialized()):
        return rank
    return dist.get_global_rank(group, rank)


def heartbeat_interval(timeout: timedelta) -> float:
    """Seconds between heartbeats: a quarter of the timeout, at most 30 s."""
    return min(timeout.total_seconds() / 4, 30.0)
