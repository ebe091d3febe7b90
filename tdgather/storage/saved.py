"""`Saved`: the frames earlier attempts of a resumed run saved, as every rank gets them.

Rank dst reads them from disk (`tdgather.storage.resume`) and sends them in its ready answer as
JSON (`Saved.to_wire`); every other rank checks what it receives (`Saved.from_wire`) as any
peer's header. ``todo`` and ``subset`` skip what is saved; `tdgather.saved_at` reads the same
from disk where the output is visible.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from ..core.checks import ProtocolCheck, decode_layout
from ..core.frames import Layout
from ..core.inputs import as_index, index_value

__all__ = ["Saved"]


class Saved(Mapping[str, torch.Tensor]):
    """The frames a resumed run has saved already: ``saved[filename]`` is their sorted frame_idx.

    Every rank of the Collector gets the same one (``col.saved``), so filtering the same list
    with it gives every rank the same remaining work, and a `DistributedSampler` over what is
    left splits it as it would a fresh list. Empty for a fresh run.

    Example:
        >>> saved = Saved({"a.mp4": [0, 2, 5, 5]})  # frames 0, 1, 2 and 5 of a.mp4
        >>> saved.todo([("a.mp4", 1), ("a.mp4", 3), ("b.mp4", 0)])
        [('a.mp4', 3), ('b.mp4', 0)]
        >>> saved.has("a.mp4", range(3)), saved.has("a.mp4", range(4)), saved.num_frames
        (True, False, 4)
    """

    def __init__(self, runs: Mapping[str, list[int]] | None = None, layouts: Mapping[str, Layout] | None = None):
        self._starts = {name: flat[0::2] for name, flat in (runs or {}).items()}
        self._ends = {name: flat[1::2] for name, flat in (runs or {}).items()}
        self.layouts: dict[str, Layout] = dict(layouts or {})  # the layout each filename was saved with
        self.num_frames = sum(e - s + 1 for name in self._starts for s, e in zip(*self._runs(name), strict=True))

    def _runs(self, name: str) -> tuple[list[int], list[int]]:
        return self._starts[name], self._ends[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        starts, ends = self._runs(name)  # arange(s, e) + [e]: e + 1 may not fit in int64
        return torch.cat(
            [torch.cat([torch.arange(s, e), torch.tensor([e])]) for s, e in zip(starts, ends, strict=True)]
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._starts)

    def __len__(self) -> int:
        return len(self._starts)

    def __repr__(self) -> str:
        return f"Saved({len(self)} filenames, {self.num_frames} frames)"

    def has(self, filename: str, frame_idx: Any) -> bool:
        """Whether every frame given is saved: one index, or several (a range, list, tensor or array).

        A filename alone cannot say it: tdgather does not know how many frames it has. For a
        sample that is a whole video, pass ``range(num_frames)``.
        """
        if isinstance(frame_idx, range | list | tuple) and not frame_idx:
            return True  # no frames: nothing left to do
        if filename not in self._starts:
            return False
        starts, ends = self._runs(filename)
        one = index_value(frame_idx)
        if one is not None:
            at = bisect.bisect_right(starts, one) - 1
            return at >= 0 and one <= ends[at]
        if isinstance(frame_idx, range) and frame_idx.step == 1:
            if not frame_idx:
                return True
            at = bisect.bisect_right(starts, frame_idx.start) - 1
            return at >= 0 and frame_idx.stop - 1 <= ends[at]
        idx = as_index(frame_idx, f"Saved.has({filename!r}) frame_idx").tolist()
        return all(self.has(filename, i) for i in idx)

    def todo(self, items: Iterable[Any], key: Callable[[Any], tuple[str, Any]] | None = None) -> list[Any]:
        """The items whose frames are not all saved, in their order.

        Args:
            items: the work of the whole run, the same list on every rank (before any sampler).
            key: gives an item's ``(filename, frame_idx)``: one frame index, or several (a whole
                video: ``range(n)``). Default: the item is that pair.
        """
        out = []
        for item in items:
            pair = key(item) if key is not None else item
            if isinstance(pair, Mapping):  # a dict would unpack to its keys
                raise TypeError(
                    f"Saved.todo: got a {type(pair).__name__} item and no key; pass "
                    "key=lambda item: (item['filename'], item['frame_idx'])"
                )
            try:
                filename, frame_idx = pair
            except (TypeError, ValueError):
                raise TypeError(
                    f"Saved.todo: expected key(item) to give (filename, frame_idx), got {type(pair).__name__} "
                    f"{pair!r:.60}; pass key=lambda item: (item['filename'], item['frame_idx']) (or a range of "
                    "frame indexes for a whole video)"
                ) from None
            if not isinstance(filename, str):
                raise TypeError(f"Saved.todo: expected a str filename, got {type(filename).__name__} {filename!r:.60}")
            if not self.has(filename, frame_idx):
                out.append(item)
        return out

    def subset(self, dataset: Any, key: Callable[[int], tuple[str, Any]]) -> torch.utils.data.Subset:
        """A `torch.utils.data.Subset` of ``dataset`` without the items saved.

        ``key(i)`` gives item ``i``'s ``(filename, frame_idx)`` without loading it, e.g.
        ``key=lambda i: dataset.samples[i]``.
        """
        return torch.utils.data.Subset(dataset, self.todo(range(len(dataset)), key))

    def to_wire(self) -> dict:
        """The JSON rank dst sends every rank: flat runs per filename, and each filename's layout."""
        layouts = list(dict.fromkeys(self.layouts.values()))
        number = {layout: k for k, layout in enumerate(layouts)}
        return {
            "runs": {name: [v for pair in zip(*self._runs(name), strict=True) for v in pair] for name in self},
            "layouts": [layout.to_json() for layout in layouts],
            "layout_of": {name: number[layout] for name, layout in self.layouts.items()},
        }

    @staticmethod
    def from_wire(obj: Any, src: int) -> Saved:
        """Check and decode what `to_wire` made, received from rank ``src`` (ProtocolError if malformed)."""
        c = ProtocolCheck(src)
        c.obj(obj, "header.saved", {"runs", "layouts", "layout_of"})
        raw = c.list(obj["layouts"], "header.saved.layouts")
        layouts = [decode_layout(x, c, f"header.saved.layouts[{k}]") for k, x in enumerate(raw)]
        runs = {}
        for name, flat in _items(c, obj["runs"], "header.saved.runs"):
            f = f"header.saved.runs[{name[:40]!r}]"
            values = _ints(c, flat, f)
            ordered = all(a <= b for a, b in zip(values, values[1:], strict=False))
            apart = all(values[k] < values[k + 1] for k in range(1, len(values) - 1, 2))
            if len(values) % 2 or not values or not ordered or not apart:
                raise c.fail(f, "[first, last, ...] runs: sorted, disjoint, at least one", values[:8])
            runs[name] = values
        layout_of = {}
        for name, k in _items(c, obj["layout_of"], "header.saved.layout_of"):
            layout_of[name] = layouts[c.int(k, f"header.saved.layout_of[{name[:40]!r}]", len(layouts) - 1)]
        if layout_of.keys() != runs.keys():
            raise c.fail(
                "header.saved.layout_of", "a layout for each filename in header.saved.runs", sorted(layout_of)[:5]
            )
        return Saved(runs, layout_of)


def _items(c: ProtocolCheck, obj: Any, field: str) -> list[tuple[str, Any]]:
    if not isinstance(obj, dict):
        raise c.fail(field, "an object", type(obj).__name__)
    return [(c.str(k, f"{field} key"), v) for k, v in obj.items()]


def _ints(c: ProtocolCheck, obj: Any, field: str) -> list[int]:
    values = c.list(obj, field)
    bad = [v for v in values if type(v) is not int or not -(2**63) <= v < 2**63]
    if bad:
        raise c.fail(field, "int64 integers", bad[:3])
    return values
