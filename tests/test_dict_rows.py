"""A dict's large frames are held as they are (no stack) and land straight in their places: bit for bit.

`tdgather.gather` of ``{filename: [(frame_idx, frame), ...]}`` keeps each frame of at least
`tdgather.core.layoutgroup.ROW_ALONE` bytes as a one-row chunk and copies it once, into the
message or into rank dst's result, in runs of consecutive places (`tdgather.core.scatter`). Frames
of every dtype, given out of order, as tensors of their own, rows of a batch and non-contiguous
columns, on one process and on 2 and 3 gloo ranks.
"""

from __future__ import annotations

import pytest
import torch

import tdgather
from tdgather.core.framestore import FrameStore
from tdgather.core.layoutgroup import ROW_ALONE
from tdgather.tools.launch import run_local_world

from . import dict_rows_cases as cases

DTYPES = ["float32", "bfloat16", "float16", "uint8", "bool", "float8_e4m3fn", "int32"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_process_gathers_every_frame_bit_for_bit(dtype):
    d = getattr(torch, dtype)
    got = tdgather.gather(cases.frames_of(0, d, seed=1))
    want = cases.expected(1, d, seed=1)
    assert sorted(got) == sorted(want)
    for name, (idx, frames) in want.items():
        assert got[name].frame_idx.tolist() == idx and cases.same_bits(got[name].frames, frames), name


@pytest.mark.parametrize(("world", "dtype"), [(2, "float32"), (2, "float8_e4m3fn"), (3, "bool"), (3, "bfloat16")])
def test_ranks_gather_every_frame_bit_for_bit(world, dtype):
    out = run_local_world(cases.case_gather, world, dtype, 7, timeout=120)[0]
    assert out["files"] == [f"clip_{k}.mp4" for k in range(5)] and out["wrong"] == []


def test_large_contiguous_frames_are_held_as_given_and_small_ones_stacked():
    big = [torch.full((ROW_ALONE // 4,), float(i)) for i in range(10)]  # ROW_ALONE bytes each
    small = [torch.full((8,), float(i)) for i in range(10)]
    store = FrameStore(copy=False)
    store.update({"big.mp4": list(enumerate(big)), "small.mp4": list(enumerate(small))})
    (big_layout, big_chunks), (_, small_chunks) = store.groups()
    assert big_layout.leaves[0].shape == (ROW_ALONE // 4,)
    assert [c.tensors[0].data_ptr() for c in big_chunks] == [t.data_ptr() for t in big]  # no copy
    assert len(small_chunks) == 1 and small_chunks[0].tensors[0].shape == (10, 8)  # one stack
    batch = torch.zeros(8, ROW_ALONE // 4)  # rows of a batch: views of a storage 8 times larger, compacted
    views = FrameStore(copy=False)
    views.update({"view.mp4": list(enumerate(batch))})
    ((_, chunks),) = views.groups()
    assert len(chunks) == 8 and all(c.tensors[0].untyped_storage().nbytes() == ROW_ALONE for c in chunks)
    copied = FrameStore()  # copy=True: the store must not hold the caller's tensors
    copied.update({"big.mp4": list(enumerate(big))})
    assert all(c.tensors[0].data_ptr() != big[0].data_ptr() for _, chunks in copied.groups() for c in chunks)
