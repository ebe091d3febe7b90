"""Rows written into rank dst's result files (`tdgather.comm.rowwrite`), mapped as one range (`...regions`)."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from tdgather.comm.regions import map_regions, region_size
from tdgather.comm.rowwrite import PWRITE_RUN, Files, write_leaves, write_rows

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="no memfd on this system")


def _files(count: int, region: int) -> Files:
    fds = [os.memfd_create(f"tdgather-test-{i}") for i in range(count)]
    for fd in fds:
        os.ftruncate(fd, region)
    return Files(fds, region)


def _close(files: Files) -> None:
    for fd in files.fds:
        os.close(fd)


def _read(files: Files) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"".join(os.pread(fd, files.region, 0) for fd in files.fds)), dtype=torch.uint8)


@pytest.mark.parametrize("first", [0.0, 0.3, 0.99])
@pytest.mark.parametrize("order", ["runs", "every_third", "shuffled"])
def test_rows_land_at_their_places_across_files_and_chunks(first, order):
    # rows of 1000 bytes in files of one page: runs cross from one file into the next
    rows, row = 50, 1000
    base = 136  # the buffer starts inside the first file
    files = _files(16, 4096)
    g = torch.Generator().manual_seed(0)
    if order == "runs":
        dest = torch.cat([torch.arange(10, 30), torch.arange(0, 10), torch.arange(31, 51)])
    elif order == "every_third":
        dest = torch.arange(rows) * 3 % 55
    else:
        dest = torch.randperm(55, generator=g)[:rows]
    frames = torch.randint(0, 255, (rows, 10, 25), dtype=torch.int32, generator=g)  # 1000 bytes a row
    chunks = list(frames.split([7, 1, 0, 30, 12]))
    chunks[3] = chunks[3].transpose(1, 2).contiguous().transpose(1, 2)  # a chunk that is not contiguous
    write_rows(files, base, row, dest, chunks, first=first)
    got = _read(files)[base : base + 55 * row].view(torch.int32).view(55, 10, 25)
    assert torch.equal(got[dest], frames)
    untouched = torch.ones(55, dtype=torch.bool)
    untouched[dest] = False
    assert not got[untouched].any()  # nothing written anywhere else
    _close(files)


def test_leaves_in_small_runs_or_ragged_are_left_to_the_caller():
    files = _files(4, 1 << 20)
    dest = torch.arange(64) * 2  # every other place: runs of one row
    big = torch.ones(64, PWRITE_RUN // 4, dtype=torch.float32)  # rows of PWRITE_RUN bytes
    small = torch.ones(64, 3, dtype=torch.float32)
    rest = write_leaves(files, [0, 1 << 21, None], [PWRITE_RUN, 12, 12], [dest, dest, dest], [[big, small, small]])
    assert rest == [1, 2]  # the small rows' leaf, and the one not in the files
    got = _read(files)[: 128 * PWRITE_RUN].view(torch.float32).view(128, -1)
    assert torch.equal(got[dest], big) and not got[dest + 1].any()
    assert write_leaves(files, [0], [12], [object()], [[small]]) == [0]  # a ragged leaf's places: left
    _close(files)


def test_regions_are_mapped_as_one_range_and_unmapped_with_the_last_view():
    region = region_size(10_000, 3)
    assert region == 4096  # 3,334 bytes each, in whole pages
    files = _files(3, region)
    data = map_regions(files.fds, region)
    assert data.numel() == 3 * region
    data[region - 2 : region + 2] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)  # across two files
    assert os.pread(files.fds[0], 2, region - 2) == b"\x01\x02" and os.pread(files.fds[1], 2, 0) == b"\x03\x04"
    view = data[region:]
    del data
    gc.collect()
    inode = os.fstat(files.fds[1]).st_ino
    assert _mapped(inode)  # a view keeps the range mapped
    del view
    gc.collect()
    assert not _mapped(inode)
    _close(files)


def _mapped(inode: int) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.split()[4] == str(inode) for line in f if "memfd:tdgather-test" in line)
