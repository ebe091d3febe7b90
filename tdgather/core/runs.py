"""Sets of frame indexes kept as runs: int64 ``[k, 2]``, inclusive ``[first, last]``, sorted, disjoint.

Frames usually come in order, so a filename costs a few runs, not 8 bytes per frame.
"""

from __future__ import annotations

import torch

__all__ = ["add_runs", "in_runs"]


_SMALL = 64  # up to this many indexes and runs, plain Python is faster than a dozen tensor calls


def add_runs(runs: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor:
    """The union of ``runs`` (int64 ``[k, 2]``, inclusive, sorted, disjoint) and the indices ``idx``.

    Frames usually come in order, so a filename costs a few runs, not 8 bytes per frame written.
    A writer calls this once per filename of each shard: for a few frames (a `DistributedSampler`
    gives each rank every W-th frame of a video) it works on Python lists, in a few microseconds.

    >>> add_runs(torch.tensor([[0, 3]]), torch.tensor([5, 4, 9])).tolist()
    [[0, 5], [9, 9]]
    """
    if idx.numel() <= _SMALL and (runs is None or runs.shape[0] <= _SMALL):
        return _add_few(runs, idx)
    idx = torch.unique(idx.to(torch.int64))
    new_run = torch.ones_like(idx, dtype=torch.bool)
    new_run[1:] = idx[1:] - idx[:-1] != 1
    first = new_run.nonzero().flatten()
    last = torch.cat([first[1:] - 1, torch.tensor([idx.numel() - 1])])
    fresh = torch.stack([idx[first], idx[last]], dim=1)
    both = fresh if runs is None else torch.cat([runs, fresh])
    both = both[torch.argsort(both[:, 0])]
    reach = torch.cummax(both[:, 1], dim=0).values
    starts = torch.ones(both.shape[0], dtype=torch.bool)
    starts[1:] = both[1:, 0] > reach[:-1] + 1
    heads = starts.nonzero().flatten()
    tails = torch.cat([heads[1:] - 1, torch.tensor([both.shape[0] - 1])])
    return torch.stack([both[heads, 0], reach[tails]], dim=1)


def _add_few(runs: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor:
    pairs = sorted([*([] if runs is None else runs.tolist()), *([i, i] for i in set(idx.tolist()))])
    out: list[list[int]] = []
    for first, last in pairs:
        if out and first <= out[-1][1] + 1:  # overlaps or touches the run before: one run
            out[-1][1] = max(out[-1][1], last)
        else:
            out.append([first, last])
    return torch.tensor(out, dtype=torch.int64).view(-1, 2)


def in_runs(runs: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Which of ``idx`` lie in ``runs`` (as `add_runs` makes them)."""
    at = torch.searchsorted(runs[:, 0].contiguous(), idx.to(torch.int64), right=True) - 1
    return (at >= 0) & (idx <= runs[at.clamp(min=0), 1])
