"""The duplicates policy: what happens when one ``(filename, frame_idx)`` arrives more than once.

``DistributedSampler(drop_last=False)`` pads the last ranks with repeats of the first samples.
The repeats run through the model in other batches, on other ranks, and batched kernels give
last-bit differences, so the two copies are often not bit-identical. Every copy after the first
is therefore compared with the kept one, classified as exact or inexact (with the largest
absolute difference), and then either dropped or refused, as the policy says:

- ``"keep"`` (the default): keep one copy, drop the others, count them;
- ``"exact"``: any bit difference raises `DuplicateFrameError`;
- ``DuplicatePolicy("close", rtol=..., atol=...)``: a difference beyond ``torch.isclose``'s
  tolerance raises; closer copies are dropped and counted as inexact.

The kept copy is the one from the lowest rank (in one merge; see `tdgather.core.merge`). Copies
whose ragged leaf has another number of rows (a detector that kept one more box) are inexact,
with an infinite difference: ``"keep"`` keeps the first, the strict policies refuse them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import DuplicateFrameError
from .frames import Layout
from .ragged import Ragged
from .rows import row_view

__all__ = ["DuplicateCounts", "DuplicatePolicy", "Verdict", "compare", "conflict", "json_same", "overlap_warning"]

_MODES = ("keep", "exact", "close")


@dataclass(frozen=True)
class DuplicatePolicy:
    """How copies of one frame are resolved.

    Example:
        >>> DuplicatePolicy.of("keep"), DuplicatePolicy.of("close").rtol
        (DuplicatePolicy(mode='keep', rtol=1e-05, atol=1e-08), 1e-05)
    """

    mode: str = "keep"
    rtol: float = 1e-5
    atol: float = 1e-8

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(f"duplicates: expected one of {', '.join(map(repr, _MODES))}, got {self.mode!r}")
        if not (self.rtol >= 0 and self.atol >= 0):
            raise ValueError(f"duplicates: expected rtol >= 0 and atol >= 0, got rtol={self.rtol}, atol={self.atol}")

    @staticmethod
    def of(value: str | DuplicatePolicy) -> DuplicatePolicy:
        """Accept a mode name or a policy."""
        if isinstance(value, DuplicatePolicy):
            return value
        if isinstance(value, str):
            return DuplicatePolicy(value)
        raise TypeError(f"duplicates: expected 'keep', 'exact', 'close' or a DuplicatePolicy, got {value!r}")

    def describe(self) -> str:
        """The policy as users write it, for messages."""
        return f"close (rtol={self.rtol:g}, atol={self.atol:g})" if self.mode == "close" else repr(self.mode)


@dataclass(frozen=True)
class DuplicateCounts:
    """Copies dropped: bit-identical ones, inexact ones, and the largest absolute difference seen.

    >>> (DuplicateCounts(1, 0, 0.0) + DuplicateCounts(0, 2, 1e-6)).dropped
    3
    """

    exact: int = 0
    inexact: int = 0
    max_abs_diff: float = 0.0

    @property
    def dropped(self) -> int:
        """Every copy dropped."""
        return self.exact + self.inexact

    def __add__(self, other: DuplicateCounts) -> DuplicateCounts:
        return DuplicateCounts(
            self.exact + other.exact, self.inexact + other.inexact, max(self.max_abs_diff, other.max_abs_diff)
        )

    def to_json(self) -> dict[str, Any]:
        """As stored in the index metadata (an infinite difference, from a NaN against a number, as "inf")."""
        diff = self.max_abs_diff if math.isfinite(self.max_abs_diff) else "inf"
        return {"exact": self.exact, "inexact": self.inexact, "max_abs_diff": diff}


@dataclass(frozen=True)
class Verdict:
    """The comparison of K copies with the K frames they repeat."""

    counts: DuplicateCounts
    refused: torch.Tensor  # bool [K]: copies the policy does not accept
    diff: torch.Tensor  # float64 [K]: largest absolute difference per copy
    json_diff: dict[int, str]  # copy k -> its first JSON leaf that differs, described

    def describe(self, k: int) -> str:
        """How copy ``k`` differs, for messages."""
        return self.json_diff.get(k) or f"largest absolute difference {float(self.diff[k]):g}"


def json_same(a: Any, b: Any) -> bool:
    """JSON values compared by type and value: ``True != 1``, ``1 != 1.0``, ``0.0 != -0.0``.

    >>> json_same(True, 1), json_same(1, 1.0), json_same(0.0, -0.0), json_same("a", "a")
    (False, False, False, True)
    """
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return math.copysign(1.0, a) == math.copysign(1.0, b) and a == b
    return a == b


def compare(layout: Layout, new: list[Any], old: list[Any], new_json: list, old_json: list, policy: Any) -> Verdict:
    """Compare K copies (``new``: leaves ``[K, ...]``) with the frames they repeat (``old``).

    Args:
        layout: the frames' layout.
        new: the copies' tensor leaves, ``[K, ...]`` each (a `Ragged` of K frames for a ragged leaf).
        old: the kept frames' tensor leaves, row k against row k of ``new``.
        new_json: the copies' JSON leaves, K values each.
        old_json: the kept frames' JSON leaves.
        policy: a `DuplicatePolicy` (or its mode name).
    """
    policy = DuplicatePolicy.of(policy)
    k = len(new[0]) if new else (len(new_json[0]) if new_json else 0)
    exact = torch.ones(k, dtype=torch.bool)
    close = torch.ones(k, dtype=torch.bool)
    diff = torch.zeros(k, dtype=torch.float64)
    json_diff: dict[int, str] = {}
    for leaf, a, b in zip(layout.leaves, new, old, strict=True):
        if isinstance(a, Ragged):
            same = a.lengths == b.lengths
            for i in (~same).nonzero().flatten().tolist():
                kept, copy = int(b.lengths[i]), int(a.lengths[i])  # described as the errors name ranks: kept first
                rows = f"{kept} row{'' if kept == 1 else 's'} against {copy}"
                json_diff.setdefault(i, f"key {'.'.join(leaf.path) or '<tensor>'!r}: {rows}")
            rows = same.nonzero().flatten()
            e, d, c = _ragged_difference(a.index_select(0, rows), b.index_select(0, rows), policy)
            exact[rows] &= e
            close[rows] &= c
            diff[rows] = torch.maximum(diff[rows], d)
            exact &= same
            close &= same
            diff[~same] = math.inf
            continue
        if not a[:1].numel():
            continue
        exact &= (row_view(a, 1) == row_view(b, 1)).all(1)
        d, c = _difference(a.reshape(k, -1), b.reshape(k, -1), policy)
        diff = torch.maximum(diff, d)
        close &= c
    for path, a, b in zip(layout.nontensor, new_json, old_json, strict=True):
        same = torch.tensor([json_same(x, y) for x, y in zip(a, b, strict=True)], dtype=torch.bool)
        exact &= same
        close &= same
        for i in (~same).nonzero().flatten().tolist():
            json_diff.setdefault(i, f"JSON key {'.'.join(path)!r}: {a[i]!r:.60} against {b[i]!r:.60}")
    refused = {"keep": torch.zeros(k, dtype=torch.bool), "exact": ~exact, "close": ~close}[policy.mode]
    inexact = ~exact
    max_diff = float(diff[inexact].max()) if bool(inexact.any()) else 0.0
    return Verdict(DuplicateCounts(int(exact.sum()), int(inexact.sum()), max_diff), refused, diff, json_diff)


def _ragged_difference(a: Ragged, b: Ragged, policy: DuplicatePolicy) -> tuple[torch.Tensor, ...]:
    """Per frame of two columns with the same lengths: bit-exact, largest difference, close."""
    k = len(a)
    av, lengths = a.span()
    bv, _ = b.span()
    if not av[:1].numel():
        return torch.ones(k, dtype=torch.bool), torch.zeros(k, dtype=torch.float64), torch.ones(k, dtype=torch.bool)
    frame = torch.repeat_interleave(torch.arange(k), lengths)  # the frame of each value row
    rows = av.shape[0]
    d, c = _difference(av.reshape(rows, -1), bv.reshape(rows, -1), policy)
    differ = torch.zeros(k, dtype=torch.int64).index_add_(0, frame, (row_view(av, 1) != row_view(bv, 1)).any(1).long())
    far = torch.zeros(k, dtype=torch.int64).index_add_(0, frame, (~c).long())
    most = torch.zeros(k, dtype=torch.float64).scatter_reduce_(0, frame, d, "amax")
    return differ == 0, most, far == 0


def _difference(a: torch.Tensor, b: torch.Tensor, policy: DuplicatePolicy) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the largest absolute difference, and whether every value is close (NaN equals NaN)."""
    if a.dtype == torch.bool:
        ne = a != b
        return ne.any(1).double(), ~ne.any(1)
    wide = torch.complex128 if a.dtype.is_complex else torch.float64
    x, y = a.to(wide), b.to(wide)
    both_nan = torch.isnan(x) & torch.isnan(y)
    d = torch.where((x == y) | both_nan, 0.0, (x - y).abs().to(torch.float64))
    d = d.nan_to_num(nan=math.inf)  # a NaN against a number, or infinities of opposite sign
    close = torch.isclose(x, y, rtol=policy.rtol, atol=policy.atol, equal_nan=True).all(1)
    return d.amax(1), close


_PADDING_FIX = (
    "Copies of a frame from DistributedSampler padding differ in the last bits when the model ran them in other "
    "batches: use duplicates='keep' (the default) or a wider tolerance; if two different predictions claim the "
    "same frame, check how frames are assigned to ranks"
)


def conflict(
    name: str, frame: int, how: str, policy: Any, who: str, where: str = "", fix: str | None = None
) -> DuplicateFrameError:
    """The error for copies of one frame that the policy refuses; ``how`` says how they differ.

    ``who`` names the two senders, kept copy first; ``fix`` says what to do (default: the advice for
    copies within one run, which come from a padding sampler or overlapping shares).
    """
    return DuplicateFrameError(
        f"filename {name!r}, frame_idx {frame}: {who} sent values that differ{where} ({how}), and the "
        f"duplicates policy is {DuplicatePolicy.of(policy).describe()}. {fix or _PADDING_FIX}"
    )


def overlap_warning(dropped: int, ranks: int, max_frames: int, padding: bool = True) -> str | None:
    """Why copies dropped are not a padding sampler's, and what it means; None when they may be.

    ``DistributedSampler`` pads with at most ``ranks - 1`` samples, and a sample is at most one
    filename's frames, so padding makes at most ``(ranks - 1) * max_frames`` copies. More means
    the ranks' shares overlapped (a shuffling sampler seeded differently on each rank, a loader that
    is not split by rank), and as many other frames were never predicted. With ``padding=False``
    (a sampler that never pads, as Lightning's predict loop uses) any copy means that.

    >>> overlap_warning(1, 2, 1) is None, overlap_warning(6, 2, 1)[:33]
    (True, '6 copies of frames were predicted')
    """
    limit = (ranks - 1) * max_frames if padding else 0
    if dropped <= limit:
        return None
    bound = f"a padding DistributedSampler makes at most {limit}" if padding else "this loop's sampler never pads"
    return (
        f"{dropped} copies of frames were predicted more than once and dropped as duplicates, but {bound}: the "
        f"ranks' shares overlapped, so about {dropped} other frames were probably never predicted. Check the number "
        "of frames saved against your dataset; give every rank the same sampler seed (torch.manual_seed / "
        "lightning.seed_everything before building the loader, or DistributedSampler(seed=...)), or shuffle=False"
    )
