"""Stage 1, the per-rank frame store: predictions in, groups of batches out (by layout).

Frames are grouped by `Layout` (structure, dtypes, per-frame shapes), so a
group is a variable-length stack of same-shaped frames: it needs no padding.

`FrameStore.add` runs in the inference loop, so it does little per batch:

- a CPU tensor of a dtype and shape seen before, with int64 frame indexes, skips `flatten`
  and `as_index` (its layout's group is cached by dtype and shape);
- filenames are checked (str, encodable as UTF-8) with one join, then kept as given (a
  reference a row, so a name built per frame stays alive until `FrameStore.parts`);
- a small batch to copy (up to 64 KiB) is copied, frame indexes and frames, into its layout's
  open block (one ``memmove`` each), after the batches before it: blocks double from 64 KiB to
  4 MiB and are sent as they are (`tdgather.comm.pack`); other batches are chunks of their own.

A filename given with a layout that does not fit its first (another dtype, dim after the first,
or set of keys) is refused by the `add` or `update` that brings it, and nothing of that batch is
kept: a `tdgather.Collector` goes on with what it holds (C-level set operations on the batch's
names, not a lookup per frame). One whose first dims differ fits: the filename is then in two
groups, and rank dst makes those leaves ragged (`tdgather.core.promote`), unless ``fixed``. Deferred to
`FrameStore.parts` / ``groups()`` / ``names`` (C-level passes over all the rows, once):
filenames get their ids.

What the store keeps of a batch given to `FrameStore.add`:

- CUDA tensors are copied to the host once, asynchronously, into pinned memory; so are the
  values of a ragged leaf on the GPU (a jagged nested tensor, or a list of per-image dicts
  joined on the GPU), whose offsets (T + 1 int64) are read to the host when the batch is added;
- CPU tensors are copied (``copy=True``, the default), because inference loops often
  reuse their output buffers, and ``inference_mode`` tensors carry no version counter
  that could tell; with ``copy=False`` they are kept by reference, and the caller must
  not modify them until they are sent. With an ``arena`` (a Collector's sender on rank
  dst's host), a batch of one tensor leaf is copied into the shared memory its chunk is
  sent in (`tdgather.comm.arena.Arena`) instead of into memory of its own; a CUDA batch too,
  by the GPU, once that memory is page-locked;
- ``update``'s frames (a dict's, one tensor each, or one flat dict of tensors each, which skips
  `flatten` where its keys, dtypes and shapes were seen: `tdgather.core.forms.tree_key`) are
  stacked into a batch per layout (a ragged leaf's rows joined), which is their copy; but a
  store that keeps references (``copy=False``, as `as_store` makes for `gather` of a dict, read
  during the call) holds each frame of at least `ROW_ALONE` bytes as it is, a chunk of one
  row, so that the copy into the message or into rank dst's result is its only one;
- either way, a view of a much larger storage (``out[:, :2]``) is compacted, so the
  store holds, and the memory budget counts, only the frames' own bytes (plus, uncounted,
  the unused rest of each layout's open block: under 4 MiB);
- conjugate and negative views are resolved, so the bits sent are the values seen.

A layout's rows and its open block are `tdgather.core.layoutgroup`; the forms ``add`` and ``update``
take beyond filenames and frame indexes (``ragged=``, ``update``'s dicts), and the refusals of a
layout that does not fit, are `tdgather.core.forms`.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ..errors import ShapeMismatchError, UnsupportedValueError
from .flatten import check_ragged_names, flatten
from .forms import (
    Bucket,
    as_pairs,
    by_filename,
    declared_fixed,
    frame_label,
    join_frames,
    mismatch,
    not_a_pair,
    ragged_spec,
    tree_key,
)
from .frames import Layout, RaggedSpec
from .inputs import as_index, check_filenames
from .layoutgroup import ROW_ALONE, Chunk, LayoutGroup, is_plain_index, unflagged
from .part import Part
from .promote import promote, varying
from .ragged import Ragged

__all__ = ["FrameStore", "as_store"]

_FIT_PAIRS = 4096  # pairs of layouts whose fit a store remembers (then it forgets them all and starts again)


class FrameStore:
    """The frames one rank holds, before they are sent.

    Args:
        copy: copy CPU tensors given to `add` (default), so the loop may reuse its output
            buffers; with False they are kept by reference and must not change until sent.
        saved: a resumed run's layout of each filename it saved; a filename's frames must fit it.
        fixed: every leaf declared fixed (``ragged=False``): a first dim that changes is refused.

    Example:
        >>> store = FrameStore()
        >>> store.add(["a.mp4", "a.mp4"], [1, 0], torch.zeros(2, 3))
        >>> store.update({"b.mp4": (0, torch.ones(3))})
        >>> len(store), store.nbytes
        (3, 36)
    """

    def __init__(
        self, copy: bool = True, saved: Mapping[str, Layout] | None = None, fixed: bool = False, arena: Any = None
    ) -> None:
        self.copy = copy
        # where copied batches go, when the store's bytes are to be sent through shared memory: an object
        # with ``put(key, t)`` giving a CPU batch's copy there and ``take(key, nbytes, device)`` the uint8
        # room for a CUDA batch's, or None (`tdgather.comm.arena.Arena`)
        self.arena = arena
        self.fixed = fixed  # frames declared fixed (ragged=False): a first dim that changes is refused
        self._saved = saved or {}  # a resumed run's layouts: a filename must keep the one it was saved with
        self._groups: dict[Layout, LayoutGroup] = {}
        self._plain: dict[tuple, LayoutGroup] = {}  # plain tensors' groups by (dtype, batch shape)
        self._ids: dict[str, int] = {}
        self._owner: dict[str, Layout] = {}  # each filename's layout
        self._fit: dict[tuple[Layout, Layout], bool] = {}  # `_fits` of pairs of layouts that differ
        self._names: list[str] = []
        self._copies: list = []  # CUDA events of pending device-to-host copies
        self.num_frames = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return self.num_frames

    def add(
        self,
        filenames: str | Sequence[str],
        frame_idx: torch.Tensor | Sequence[int],
        frames: Any,
        *,
        ragged: bool | str | Iterable[str] = (),
    ) -> None:
        """Add a batch of B frames (B may be 0).

        Args:
            filenames: B names (a list or tuple of str, as a DataLoader collates them), or one
                name for all B frames.
            frame_idx: B integers: an integer tensor or array, or a list of ints, numpy integers
                or one-element integer tensors. Floats and bools are refused, never truncated.
            frames: ``Tensor[B, ...]``, or a dict / TensorDict / tensorclass with batch dim B, or
                a list of B frames (tensors, dicts, ...). A leaf may be ragged (its first dim
                differs per frame): a jagged nested tensor ``[B, j, ...]``, or in a list of
                frames a tensor whose first dim differs between them.
            ragged: leaves that are ragged even when every frame of this batch happens to have
                the same first dim (a batch of one, say): dotted keys (``"boxes"``,
                ``"det.boxes"``), or True for every tensor leaf that has a dim (fixed-size ones
                too: name the leaves when a frame has both kinds). Not needed for a leaf whose
                first dim changes: it is made ragged where that is found. False declares every
                leaf fixed, from now on: a first dim that changes is then refused.

        Raises:
            ShapeMismatchError: a filename this store holds with a layout that does not fit (another
                dtype, dim after the first, or set of keys; any other shape with ``ragged=False``);
                nothing of the batch is kept (in a Collector, a filename sent in an earlier chunk is
                checked by rank dst).
        """
        n = frame_idx.shape[0] if is_plain_index(frame_idx) else 0
        g = None
        if ragged is False:
            self.declare_fixed()
        elif ragged:
            return self._add_any(filenames, frame_idx, frames, ragged_spec(ragged))
        if n and type(frames) is torch.Tensor and frames.is_cpu and not frames.is_nested:
            g = self._plain.get((frames.dtype, frames.shape)) if frames.layout is torch.strided else None
        names = filenames if type(filenames) is list else [filenames] * n if isinstance(filenames, str) else ()
        if g is None or frames.size(0) != n or len(names) != n:
            return self._add_any(filenames, frame_idx, frames)
        # the common case, fast: a CPU tensor of a dtype and shape seen before, int64 frame indexes
        check_filenames(names)
        self._claim(g, names)
        g.pending += names
        if self.copy and n <= g.small and frames.is_contiguous() and not (frames.is_conj() or frames.is_neg()):
            g.copy_in(frame_idx, (frames,), n)
        else:
            g.keep(frame_idx.clone(), self._held(g, [frames], self.copy))
        self.num_frames += n
        self.nbytes += n * g.frame_nbytes
        return None

    def _add_any(self, filenames: Any, frame_idx: Any, frames: Any, ragged: RaggedSpec = frozenset()) -> None:
        """Any batch, checked in full."""
        idx = as_index(frame_idx, "add() frame_idx")
        count = idx.numel()
        names = [filenames] * count if isinstance(filenames, str) else list(filenames)
        if len(names) != count:
            raise ValueError(
                f"add(): got {len(names)} filenames and {count} frame indices; expected one filename and one "
                "frame_idx per frame (and frames with that batch dimension)"
            )
        try:
            batches = [(names, idx, *flatten(frames, count, "add() frames", ragged))]
        except ShapeMismatchError as e:  # a list whose frames differ: each filename's frames a batch of their own
            batches = by_filename(names, idx, frames, ragged, e)
        if not count:
            return
        check_filenames(names)
        for sub, _, layout, _, _ in batches:  # all checked before anything is kept
            if self.fixed and layout.ragged:
                raise declared_fixed(sub[0], layout)
            self._refuse(layout, sub, self._groups[layout].files if layout in self._groups else set())
        for sub, sub_idx, layout, tensors, json in batches:
            group = self._groups.get(layout) or LayoutGroup(layout)
            self._claim(group, sub)
            self._groups.setdefault(layout, group)
            if type(frames) is torch.Tensor and not layout.ragged:
                self._plain[(frames.dtype, frames.shape)] = group
            self._append(group, sub, sub_idx, tensors, json, self.copy)

    def update(self, predictions: Mapping[str, Any], *, ragged: bool | str | Iterable[str] = ()) -> None:
        """Add ``{filename: (frame_idx, value)}`` or ``{filename: [(frame_idx, value), ...]}``.

        ``ragged``: the leaves whose first dim changes from frame to frame (as in `add`).
        """
        fast: dict[tuple, Bucket] = {}  # plain tensors by (dtype, shape): no Layout hashed per frame
        other: dict[Layout, Bucket] = {}
        trees: dict[tuple, Bucket] = {}  # dicts of plain tensors by their keys, dtypes and shapes: no flatten per frame
        if ragged is False:
            self.declare_fixed()
        spec = ragged_spec(ragged) if ragged else frozenset()
        plain_ragged = spec is True or "" in spec  # a plain tensor's rows vary: keyed by the shape of a row
        known: set[str] = set()  # the tensor leaves seen: each name in ragged= must be one of them somewhere
        frames = 0
        for name, entry in predictions.items():
            for pair in as_pairs(name, entry):
                try:
                    fi, value = pair
                except (TypeError, ValueError):
                    raise not_a_pair(name, pair) from None
                frames += 1
                if (
                    type(value) is torch.Tensor
                    and value.layout is torch.strided
                    and not value.is_nested
                    and (not spec or (plain_ragged and value.dim()))
                ):
                    key = (value.dtype, value.shape[1:] if spec else value.shape)
                    bucket = fast.get(key)
                    if bucket is None:
                        layout = _flattened(value, frame_label(name, fi), spec, known)[0]
                        bucket = fast[key] = Bucket(layout, "ragged" if spec else "stack")
                    bucket.names.append(name)  # `Bucket.add`, inline: the plain tensors' path, per frame
                    bucket.idx.append(fi)
                    bucket.leaves[0].append(value)
                elif type(value) is dict and (tree := tree_key(value, spec)) is not None:
                    key, tensors = tree
                    bucket = trees.get(key)
                    if bucket is None:  # the first frame of these keys and shapes: flattened, so checked
                        layout = _flattened(value, frame_label(name, fi), spec, known)[0]
                        bucket = trees[key] = other.setdefault(layout, Bucket(layout, "rows"))
                    bucket.add(name, fi, tensors)
                else:
                    layout, tensors, json = _flattened(value, frame_label(name, fi), spec, known)
                    bucket = other.get(layout) or other.setdefault(layout, Bucket(layout, "rows"))
                    bucket.add(name, fi, tensors, json)
        if frames:  # a rank with no frames has nothing to match the names against
            check_ragged_names(spec, known, "the frames given")
        buckets = [(b, as_index(b.idx, "frame_idx", b.names)) for b in [*fast.values(), *other.values()]]
        claimed: dict[str, Layout] = {}
        for b, _ in buckets:
            check_filenames(b.names)
            for name in dict.fromkeys(b.names):
                first = claimed.setdefault(name, self._owner.get(name, b.layout))
                if not self._fits(first, b.layout):
                    raise mismatch(name, first, b.layout)
                if not self._fits(self._saved.get(name, b.layout), b.layout):
                    raise mismatch(name, self._saved[name], b.layout, saved=True)
        for b, idx in buckets:  # checked: nothing is half-added
            group = self._group(b.layout)
            self._claim(group, b.names)
            if not self.copy and not b.layout.ragged and _referenced(b, group):  # each frame a chunk: no stack
                group.pending += b.names
                group.keep_rows(idx, [self._keep(t, False) for t in b.leaves[0]])
                self.num_frames += len(b.names)
                self.nbytes += len(b.names) * group.frame_nbytes
                continue
            tensors = [join_frames(ts, b.join(j)) for j, ts in enumerate(b.leaves)]
            self._append(group, b.names, idx, tensors, b.json, copy=False)

    def _claim(self, g: LayoutGroup, names: list[str]) -> None:
        """Record that ``names`` have ``g``'s layout; refuse, before anything is added, a name it does not fit.

        A name held in another layout that fits (`_fits`) is in both groups: rank dst makes the
        leaves that differ ragged (`tdgather.core.plan.place`).
        """
        if g.files.issuperset(names):  # the common case: names this group holds already
            return
        fresh = self._refuse(g.layout, names, g.files)
        g.files |= fresh
        self._owner.update(dict.fromkeys(fresh.difference(self._owner), g.layout))  # a pass over fresh, not the store

    def _refuse(self, layout: Layout, names: list[str], files: set[str]) -> set[str]:
        """Raise for a name whose held (or saved) layout ``layout`` does not fit; return the names not in ``files``."""
        fresh = set(names).difference(files)
        held = self._owner.keys() & fresh
        clash = {name for name in held if not self._fits(self._owner[name], layout)}
        if clash:
            name = min(clash, key=names.index)
            raise mismatch(name, self._owner[name], layout)
        clash = {name for name in self._saved.keys() & fresh if not self._fits(self._saved[name], layout)}
        if clash:
            name = min(clash, key=names.index)
            raise mismatch(name, self._saved[name], layout, saved=True)
        return fresh

    def declare_fixed(self) -> None:
        """Declare every leaf fixed from now on (``ragged=False``), refusing what this store holds that is not.

        Raises:
            ShapeMismatchError: a leaf held ragged, or a filename held with two first dims.
        """
        for layout, g in self._groups.items():
            if layout.ragged and g.files:
                raise declared_fixed(min(g.files), layout)
        for layout, g in self._groups.items():
            for name in g.files:
                if self._owner[name] != layout:
                    raise mismatch(name, self._owner[name], layout)
        self.fixed = True

    def _fits(self, a: Layout, b: Layout) -> bool:
        """Whether frames of layouts ``a`` and ``b`` may share a filename (only first dims differ, unless fixed).

        They must then promote to one layout: trees that differ only in their batch dims do not.
        """
        if a == b:
            return True
        if self.fixed:
            return False
        fit = self._fit.get((a, b))
        if fit is None:  # worked out once per pair: a detector's box counts give a layout each
            if len(self._fit) >= _FIT_PAIRS:
                self._fit.clear()
            names = varying(a, b)
            fit = self._fit[a, b] = names is not None and promote(a, names) == promote(b, names)
        return fit

    def _group(self, layout: Layout) -> LayoutGroup:
        group = self._groups.get(layout)
        if group is None:
            group = self._groups[layout] = LayoutGroup(layout)
        return group

    def _append(
        self, g: LayoutGroup, names: list[str], idx: torch.Tensor, tensors: list, json: list, copy: bool
    ) -> None:
        n = idx.shape[0]
        if not n:
            return
        g.pending += names
        if (
            copy
            and n <= g.small
            and is_plain_index(idx)
            and all(t.is_cpu and t.is_contiguous() and unflagged(t) for t in tensors)
        ):
            g.copy_in(idx, tensors, n)
        else:
            g.keep(idx.clone(), self._held(g, tensors, copy))
        for values, new in zip(g.json, json, strict=True):
            values += new
        self.num_frames += n
        self.nbytes += n * g.frame_nbytes + sum(t.nbytes for t in tensors if isinstance(t, Ragged))

    def _held(self, g: LayoutGroup, tensors: list, copy: bool) -> list:
        """What the store keeps of a batch's leaves: copied into the arena where it takes them, else `_keep` each.

        The arena takes a copied CPU or CUDA batch of one tensor leaf and no JSON leaf, right after
        the batch before it: the rows then lie where the data message puts them
        (`tdgather.comm.arena.Arena`). A CUDA batch's copy there is asynchronous, as into the store's
        own pinned memory.
        """
        if copy and self.arena is not None and len(tensors) == 1 and not g.json:
            t = tensors[0]
            if type(t) is torch.Tensor and (t.is_cpu or t.is_cuda) and t.numel() and not (t.is_conj() or t.is_neg()):
                t = t.detach()  # the values: no autograd graph through the copy
                if t.is_cpu:
                    held = self.arena.put(g, t)
                else:
                    room = self.arena.take(g, t.nbytes, t.device)
                    held = None if room is None else self._from_device(room.view(t.dtype).view(t.shape), t)
                if held is not None:
                    return [held]
        return [self._keep(t, copy) for t in tensors]

    def _from_device(self, host: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``t`` copied into page-locked ``host`` without waiting; `synchronize` waits for it."""
        host.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(t.device))
        self._copies.append(event)
        return host

    def _keep(self, t: Any, copy: bool) -> Any:
        """What the store holds of ``t`` (see the module docstring): a CPU tensor of its own bytes.

        Of a ragged leaf, its frames' rows (and their lengths), nothing before or after them.
        """
        if isinstance(t, Ragged):
            values, lengths = t.span()
            return Ragged.from_lengths(self._keep(values, copy), lengths.cpu())
        t = t.detach()
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()  # a new tensor already: no further copy needed
            copy = False
        if t.device.type == "cpu":
            if copy:
                return t.clone(memory_format=torch.contiguous_format)
            if t.untyped_storage().nbytes() > 2 * t.numel() * t.element_size() + 4096:
                return t.clone(memory_format=torch.contiguous_format)  # a view of a larger storage
            return t
        if t.device.type != "cuda":  # another accelerator: one synchronous copy
            return t.to("cpu", memory_format=torch.contiguous_format)
        return self._from_device(torch.empty(t.shape, dtype=t.dtype, pin_memory=True), t)

    def _intern(self) -> None:
        """Give ids to the filenames added since the last call, with C-level passes over the rows."""
        ids = self._ids
        for g in self._groups.values():
            if not g.pending:
                continue
            fresh = dict.fromkeys(g.pending)  # in order of first appearance
            ordered = [name for name in fresh if name not in ids]  # new to the store (one layout each: `_claim`)
            if ordered:
                ids.update(zip(ordered, itertools.count(len(self._names))))
                self._names += ordered
            g.ids.append(torch.frombuffer(array("q", map(ids.__getitem__, g.pending)), dtype=torch.int64))
            g.pending = []

    def synchronize(self) -> None:
        """Wait until every device-to-host copy made by `add` has landed."""
        for event in self._copies:
            event.synchronize()
        self._copies.clear()

    @property
    def names(self) -> list[str]:
        """The filenames added so far (their ids): by layout, in order of first appearance."""
        self._intern()
        return self._names

    def parts(self, rank: int) -> list[Part]:
        """The frames as one `Part` per layout, viewing the stored batches: no copy."""
        self.synchronize()
        self._intern()
        parts = []
        for g in self._groups.values():
            g.seal()
            if len(g.ids) > 1:
                g.ids = [torch.cat(g.ids)]
            idx = torch.cat(g.idx) if len(g.idx) > 1 else g.idx[0]
            json = [values[:] for values in g.json]
            chunks, lengths = g.chunks[:], []
            if g.layout.ragged:  # a ragged leaf's chunks are its values; its lengths go beside them
                lengths = [
                    torch.cat([c[j].lengths for c in chunks]) if leaf.ragged else None
                    for j, leaf in enumerate(g.layout.leaves)
                ]
                chunks = [[t.values if isinstance(t, Ragged) else t for t in c] for c in chunks]
            parts.append(Part(rank, g.layout, self._names, g.ids[0], idx, json, chunks, lengths))
        return parts

    def groups(self) -> list[tuple[Layout, list[Chunk]]]:
        """The chunks of every layout, in the order added (after every device copy has landed)."""
        out = []
        for part, g in zip(self.parts(0), self._groups.values(), strict=True):
            sizes = [i.shape[0] for i in g.idx]
            ids = part.file_ids.split(sizes)
            ends = itertools.accumulate(sizes)
            chunks = [
                Chunk(ids[c], g.idx[c], tensors, [values[end - n : end] for values in part.json])
                for c, (tensors, n, end) in enumerate(zip(g.chunks, sizes, ends, strict=True))
            ]
            out.append((part.layout, chunks))
        return out

    @property
    def _chunks(self) -> dict[Layout, list[Chunk]]:
        """``groups()`` as a dict (for tests that look inside)."""
        return dict(self.groups())

    @property
    def num_chunks(self) -> int:
        """Chunks held: blocks of small batches copied together, and batches kept as they are."""
        return sum(len(g.chunks) + (g.fill > g.start) for g in self._groups.values())


def _flattened(value: Any, where: str, spec: RaggedSpec, known: set[str]) -> tuple[Layout, list, list]:
    """One frame of ``update``: its layout, a tensor per leaf (the frame's own rows) and a value per JSON leaf.

    Under ``spec``, flattened as a batch of one, so that the leaves it names are ragged, and its
    tensor leaves' dotted names added to ``known`` (each name in ``spec`` must be one of them).
    """
    if not spec:
        return flatten(value, None, where)
    layout, tensors, json = flatten([value], 1, where, spec, False)
    known.update(".".join(leaf.path) for leaf in layout.leaves)
    return layout, [t.values if isinstance(t, Ragged) else t[0] for t in tensors], [values[0] for values in json]


def _referenced(b: Bucket, g: LayoutGroup) -> bool:
    """Whether a bucket's frames may be held as they are, each a chunk of one row (`LayoutGroup.keep_rows`).

    Plain CPU tensors (one leaf, no JSON) of at least `ROW_ALONE` bytes a frame: then the copy into
    the message (or, rank dst's own, into the result) is the only one, where a stack would copy
    every frame once more first. (A view of a much larger storage, or a frame with a conjugate or
    negative bit, is copied alone, as `FrameStore._keep` does.)
    """
    return g.frame_nbytes >= ROW_ALONE and len(b.leaves) == 1 and not b.json and all(t.is_cpu for t in b.leaves[0])


def as_store(predictions: FrameStore | Mapping[str, Any], ragged: Any = ()) -> FrameStore:
    """Return ``predictions`` as a `FrameStore` (a store passes through); ``ragged`` as `FrameStore.update` takes it."""
    if isinstance(predictions, FrameStore):
        if ragged is False:
            predictions.declare_fixed()
        return predictions
    if not isinstance(predictions, Mapping):
        raise UnsupportedValueError(
            "expected a dict {filename: (frame_idx, tensor)}, {filename: [(frame_idx, tensor), ...]} "
            f"or a tdgather.FrameStore, got {type(predictions).__name__}"
        )
    store = FrameStore(copy=False)  # read during the call that was given it: its large frames are not copied
    store.update(predictions, ragged=ragged)
    return store
