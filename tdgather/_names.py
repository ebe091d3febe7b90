"""The names of a group's tensors in a shard, by index version.

Version 2 names each leaf by its path, so that
``safe_open(shard).keys()`` says what is inside: a group ``g0`` of frames
``{"depth": ..., "det": {"boxes": ...}, "label": "cat"}`` holds

- ``g0:frame_idx``: int64 ``[N]``;
- ``g0.depth``, ``g0.det.boxes``, ``g0.label``: a tensor leaf, or a JSON leaf's UTF-8 lines;
  a plain tensor frame (no keys) is ``g0`` itself;
- ``<name>:offsets``: int64 ``[N+1]`` beside a ragged leaf's values and a JSON leaf's lines.

Each key of the path is escaped, so that names never collide: ``%``, ``.``, ``:`` and every
character that is not printable ASCII are written as ``%XX`` (their UTF-8 bytes), and an empty
key as ``%``. So ``.`` only ever separates keys and ``:`` only ever starts a suffix.

Version 1 named leaves by position: ``g0.frame_idx``, ``g0.leaf<j>``, ``g0.json<j>``, and
``<name>.offsets``. The reader still reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .frames import Layout

__all__ = ["GroupNames", "escape_key", "group_names"]

_SAFE = frozenset(chr(c) for c in range(0x20, 0x7F)) - {"%", ".", ":"}


def escape_key(key: str) -> str:
    """One key of a leaf's path, as it appears in a tensor name.

    >>> escape_key("det"), escape_key("a.b"), escape_key("50%"), escape_key(""), escape_key("é")
    ('det', 'a%2Eb', '50%25', '%', '%C3%A9')
    """
    if not key:
        return "%"
    return "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in key)


@dataclass(frozen=True)
class GroupNames:
    """A group's tensor names: its frame indexes, each tensor leaf, each JSON leaf, and offsets."""

    frame_idx: str
    leaves: tuple[str, ...]
    json: tuple[str, ...]
    offsets_suffix: str

    def offsets(self, name: str) -> str:
        """The offsets beside a ragged leaf's values or a JSON leaf's lines."""
        return name + self.offsets_suffix


def group_names(group: str, layout: Layout, version: int) -> GroupNames:
    """The tensor names of group ``group`` (``g<k>``) of ``layout`` in a shard of index ``version``.

    >>> from tdgather.frames import Leaf
    >>> import torch
    >>> layout = Layout("tree", None, (Leaf(("det", "boxes"), torch.float32, (4,), True),), (("label",),))
    >>> n = group_names("g0", layout, 2)
    >>> n.frame_idx, n.leaves, n.json, n.offsets(n.leaves[0])
    ('g0:frame_idx', ('g0.det.boxes',), ('g0.label',), 'g0.det.boxes:offsets')
    >>> group_names("g0", layout, 1).leaves, group_names("g0", layout, 1).offsets("g0.leaf0")
    (('g0.leaf0',), 'g0.leaf0.offsets')
    """
    if version == 1:
        return GroupNames(
            f"{group}.frame_idx",
            tuple(f"{group}.leaf{j}" for j in range(len(layout.leaves))),
            tuple(f"{group}.json{j}" for j in range(len(layout.nontensor))),
            ".offsets",
        )

    def name(path: tuple[str, ...]) -> str:
        return ".".join([group, *map(escape_key, path)])

    return GroupNames(
        f"{group}:frame_idx",
        tuple(name(leaf.path) for leaf in layout.leaves),
        tuple(name(path) for path in layout.nontensor),
        ":offsets",
    )
