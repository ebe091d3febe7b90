"""The exceptions tdgather raises: one hierarchy, one module.

Every message says what was expected, what came, and what to do. Tests share
the message text through ``pytest.raises(match=...)``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CallMismatchError",
    "DatasetError",
    "DuplicateFrameError",
    "ExportError",
    "FrameConflictError",
    "OutputError",
    "PeerError",
    "PeerLostError",
    "ProtocolError",
    "ShapeMismatchError",
    "StalledError",
    "TdgatherError",
    "Terminated",
    "UnsupportedValueError",
    "rank_name",
]


class TdgatherError(Exception):
    """Base class of every error tdgather raises on purpose.

    Attributes:
        received: on rank ``dst`` after a failed `tdgather.api.gather`, the frames that had arrived
            (a `tdgather.Gathered`, from every rank, the failed one's included), so nothing already
            received is lost; None elsewhere, or when they could not be merged.
    """

    received: Any = None


class UnsupportedValueError(TdgatherError, TypeError):
    """A prediction holds something tdgather cannot carry (refused at the sender)."""


class ProtocolError(TdgatherError):
    """A peer's message broke the wire contract; raised before anything is allocated.

    Attributes:
        rank: the group rank that sent the message.
        field: the prelude or header field that was wrong.
    """

    def __init__(self, rank: int, field: str, message: str) -> None:
        super().__init__(
            f"protocol error from rank {rank} in {field}: {message}. The bytes are not a valid tdgather "
            f"message: check that every rank runs the same tdgather version and that nothing "
            f"else sends on this process group"
        )
        self.rank = rank
        self.field = field


def rank_name(rank: int, global_rank: int | None = None) -> str:
    """A rank as messages name it: the global rank, with the group rank beside it where they differ.

    >>> rank_name(1), rank_name(1, 1), rank_name(1, 3)
    ('rank 1', 'rank 1', 'rank 3 (group rank 1)')
    """
    if global_rank is None or global_rank == rank:
        return f"rank {rank}"
    return f"rank {global_rank} (group rank {rank})"


# errors rank dst raises about what ranks sent (the ranks its message names), not about its own code
_FOUND_IN_DATA = frozenset({"ShapeMismatchError", "DuplicateFrameError", "FrameConflictError"})
_FOUND_HINT = " (found in the frames the ranks it names sent: fix what they send and rerun)"


class PeerError(TdgatherError):
    """A peer reported a failure (an ``error`` message), or rank ``dst`` did.

    The message names the global rank (as torchrun's ``[rankN]`` log prefixes do), and the rank
    within ``group=`` beside it where the two differ: ``rank 3 (group rank 1) failed with ...``.

    Attributes:
        rank: the group rank that failed.
        error_type: the name of the exception type on that rank.
        error_message: its message.
        global_rank: its global rank (``torch.distributed.get_rank()`` there); ``rank`` where not known.
    """

    def __init__(self, rank: int, error_type: str, error_message: str, global_rank: int | None = None) -> None:
        hint = self.hint if error_type not in _FOUND_IN_DATA else _FOUND_HINT
        hint = "" if error_message.endswith(hint) else hint
        super().__init__(f"{rank_name(rank, global_rank)} failed with {error_type}: {error_message}{hint}")
        self.rank = rank
        self.global_rank = rank if global_rank is None else global_rank
        self.error_type = error_type
        self.error_message = error_message

    hint = " (its log has the traceback; fix that rank's error and rerun)"


class PeerLostError(PeerError):
    """A peer stopped answering (timeout) or its connection closed (killed)."""

    hint = ""  # the cause carries its own advice


class StalledError(TdgatherError):
    """A rank's loop made no call into tdgather for the timeout while its process lived (`tdgather.api.liveness`).

    Raised on that rank (if its loop ever comes back) and sent to rank dst, so that every rank
    raises naming it.

    Attributes:
        rank: the rank whose loop is stuck.
    """

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"rank {rank} stalled: {message}")
        self.rank = rank


class FrameConflictError(TdgatherError, ValueError):
    """Frames of one filename that cannot be merged."""


class DuplicateFrameError(FrameConflictError):
    """The same ``(filename, frame_idx)`` came twice with different values."""


class ShapeMismatchError(FrameConflictError):
    """Frames of one filename differ in structure, shape or dtype."""


class OutputError(TdgatherError, OSError):
    """The output directory cannot be used, or writing it failed."""


class DatasetError(TdgatherError, ValueError):
    """A saved dataset on disk is malformed, truncated or hostile (refused before it is used).

    Attributes:
        file: the file that is wrong (the index or a shard).
        field: the index or header field that is wrong.
    """

    def __init__(self, file: str, field: str, message: str) -> None:
        super().__init__(
            f"{file}: {field}: {message}. tdgather.open refuses what it cannot trust: if the dataset was edited "
            "by hand, truncated or corrupted, restore it or write it again"
        )
        self.file = file
        self.field = field


class ExportError(TdgatherError, ValueError):
    """A dataset cannot be one table (`Dataset.to_hf`): two filenames disagree on a column, or a name collides."""


class CallMismatchError(TdgatherError):
    """The ranks of a group are not in the same tdgather call (a different ``dst``, a skipped call, ...)."""


class Terminated(SystemExit):
    """A termination signal (SIGTERM) arrived while a `tdgather.Collector` was open.

    Raised in the main thread, as Ctrl-C raises ``KeyboardInterrupt``, so that the Collector keeps
    what it holds before the process ends. Like ``SystemExit`` it passes ``except Exception``;
    uncaught, the process exits with status ``128 + signum`` (143 for SIGTERM), as a shell reports
    a process the signal ended.

    Attributes:
        signum: the signal's number.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum

    def __str__(self) -> str:
        import signal

        return f"{signal.Signals(self.signum).name}: the process was asked to stop (status {self.code})"
