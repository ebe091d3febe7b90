"""Which role each rank plays in a `tdgather.Collector` call: `role`, a function of four integers.

With one writer (the default) rank ``dst`` receives every other rank's frames and writes the
dataset; every other rank sends to it. With ``ranks_per_writer=k`` the ranks form blocks of k
consecutive ranks, and each block's first rank is its writer: it receives its block's frames and
writes them as shards of its own. Rank ``dst`` (a writer, so a multiple of k) is also the
coordinator: at close every other writer reports its shards to it, and it writes the one index.

So a sender sends its frames to its block's writer (rank dst, with one writer); a writer receives
its peers' frames; a block writer also sends rank dst its report at close, and rank dst answers it.

What each role does at open, close and abort is in `tdgather.api.choreography`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["Role", "role"]


@dataclass(frozen=True)
class Role:
    """What one rank does in a Collector call (`role` says which).

    Attributes:
        name: ``"dst"`` (rank dst, the one writer), ``"sender"``, ``"block writer"`` (a block's
            first rank, not rank dst), or ``"coordinator"`` (rank dst with several writers).
        to: the rank it sends to: a sender's writer, a block writer's coordinator; None on rank dst.
        peers: the ranks it receives from, ascending: its block's other ranks and, on the
            coordinator, the other writers; empty on a sender.
        writers: on the coordinator, the other writers by their numbers; else empty.
        number: a writer's number with several writers (its shards carry it); else None.
        ranks_per_writer: k with several writers; None with one (every rank's call must agree).
    """

    name: str
    to: int | None = None
    peers: tuple[int, ...] = ()
    writers: Mapping[int, int] = field(default_factory=dict)
    number: int | None = None
    ranks_per_writer: int | None = None

    @property
    def writes(self) -> bool:
        """Whether it receives frames and writes shards (every role but a sender)."""
        return self.name != "sender"


def role(rank: int, world: int, dst: int, ranks_per_writer: int | None = None) -> Role:
    """The role of ``rank`` in a group of ``world`` ranks whose rank dst is ``dst``.

    ``ranks_per_writer`` (k) of None, or of ``world`` or more, means one writer: rank dst.

    Example:
        >>> [role(r, 4, dst=0).name for r in range(4)]
        ['dst', 'sender', 'sender', 'sender']
        >>> role(0, 4, dst=0)
        Role(name='dst', to=None, peers=(1, 2, 3), writers={}, number=None, ranks_per_writer=None)
        >>> role(3, 4, dst=0).to
        0
        >>> [role(r, 6, dst=3, ranks_per_writer=3).name for r in range(6)]
        ['block writer', 'sender', 'sender', 'coordinator', 'sender', 'sender']
        >>> role(3, 6, dst=3, ranks_per_writer=3)
        Role(name='coordinator', to=None, peers=(0, 4, 5), writers={0: 0}, number=1, ranks_per_writer=3)
        >>> role(0, 6, dst=3, ranks_per_writer=3)
        Role(name='block writer', to=3, peers=(1, 2), writers={}, number=0, ranks_per_writer=3)
        >>> role(1, 6, dst=3, ranks_per_writer=3).to  # a sender sends to its block's writer
        0
        >>> role(0, 1, dst=0, ranks_per_writer=8)  # no process group: one rank, which writes alone
        Role(name='dst', to=None, peers=(), writers={}, number=None, ranks_per_writer=None)
        >>> role(0, 4, dst=1, ranks_per_writer=2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: dst: with ranks_per_writer=2, rank dst coordinates the writers and must be one of them ...

    Raises:
        ValueError: with several writers, ``dst`` is not a writer.
    """
    k = min(ranks_per_writer or world, world)
    if k >= world:  # one writer: rank dst
        if rank == dst:
            return Role("dst", peers=tuple(p for p in range(world) if p != rank))
        return Role("sender", to=dst)
    if dst % k:
        raise ValueError(
            f"dst: with ranks_per_writer={k}, rank dst coordinates the writers and must be one of them "
            f"(a multiple of {k}), got {dst}"
        )
    first = rank - rank % k  # its block's writer
    block = tuple(p for p in range(first, min(first + k, world)) if p != rank)
    if rank == dst:
        writers = {w: w // k for w in range(0, world, k) if w != rank}
        return Role(
            "coordinator",
            peers=tuple(sorted({*block, *writers})),
            writers=writers,
            number=rank // k,
            ranks_per_writer=k,
        )
    if rank != first:
        return Role("sender", to=first, ranks_per_writer=k)
    return Role("block writer", to=dst, peers=block, number=rank // k, ranks_per_writer=k)
