"""gather's same-host senders write their rows straight into rank dst's result (`tdgather.comm.direct`)."""

from __future__ import annotations

import os

import pytest
import torch

from tdgather.comm.direct import ResultMemory, Target
from tdgather.core.framestore import FrameStore
from tdgather.errors import ProtocolError
from tdgather.tools.launch import WorldError, run_local_world

from . import direct_cases as dc

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="no memfd on this system")


@pytest.mark.world
@pytest.mark.parametrize("world,dst", [(3, 0), (2, 1)])
def test_senders_on_rank_dsts_host_write_their_rows_in_place(shm, world, dst):
    out = run_local_world(dc.case_gather, world, {"TDGATHER_SHM_DIR": str(shm)}, "plain", dst, timeout=120)
    # every frame checked bit for bit on rank dst; no piece went over gloo
    assert out[dst] == {"in_place": world - 1, "pieces": 0, "dropped": 0}
    assert os.listdir(shm) == []


@pytest.mark.world
def test_copies_written_in_place_are_compared_and_one_kept(shm):
    out = run_local_world(dc.case_gather, 3, {"TDGATHER_SHM_DIR": str(shm)}, "copies", timeout=120)
    assert out[0] == {"in_place": 2, "pieces": 0, "dropped": 2 * 4}  # frame 0 of each video, from ranks 1 and 2


@pytest.mark.world
@pytest.mark.parametrize(
    "variant,env,in_place",
    [
        ("plain", {"TDGATHER_SHM": "0"}, 0),  # the same-host path turned off
        ("hosts", {}, 0),  # every rank on another host
        ("tiny", {}, 0),  # frames of 60 bytes: over gloo, during rank dst's placement
        ("ragged", {}, 1),  # the rank with a ragged leaf sends pieces, the other writes in place
    ],
)
def test_otherwise_the_frames_go_over_gloo_with_the_same_result(shm, variant, env, in_place):
    frames = 3000 if variant == "tiny" else 30  # tiny: more than a MiB a sender
    out = run_local_world(dc.case_gather, 3, {"TDGATHER_SHM_DIR": str(shm), **env}, variant, 0, frames, timeout=120)
    assert out[0]["in_place"] == in_place and out[0]["pieces"] > 0


@pytest.mark.world
def test_a_sender_killed_mid_write_loses_only_its_own_frames(shm):
    with pytest.raises(WorldError) as e:
        run_local_world(dc.case_sender_killed_mid_write, 3, {"TDGATHER_SHM_DIR": str(shm)}, timeout=120)
    assert list(e.value.failures) == [1] and "exited with code -9" in e.value.failures[1]  # killed
    out = e.value.results
    got, bytes_of_kept = out[0]
    assert got["type"] == "PeerLostError" and got["rank"] == 1
    # ranks 0 and 2's frames, bit for bit; none of rank 1's, though some of its rows were written
    assert got["kept"] == {f"v{k}.mp4": [i for i in range(30) if i % 3 != 1] for k in range(4)}
    assert got["per_rank"] == [40, 0, 40] and bytes_of_kept  # the stats count what arrived
    assert out[2]["type"] == "PeerError"


@pytest.mark.world
def test_no_collection_runs_while_a_sender_sends(shm):
    out = run_local_world(dc.case_collections_while_sending, 3, {"TDGATHER_SHM_DIR": str(shm)}, timeout=120)
    # a full collection walks every object of the process: amid a write in place it cost a sender 0.2 s
    assert out[0] == {"inside": 0, "enabled": True, "in_place": 2}
    assert out[1] == out[2] == {"inside": 0, "enabled": True, "in_place": None}


ROW, SIZE = 4096, 32768  # bytes a frame, of the result
END = 16 * 4096  # the memfds' bytes: SIZE in 16 regions of whole pages


def _memory_and_place(shm) -> tuple[ResultMemory, dict, list]:
    """Rank dst's memfd with one placed part of 4 frames ``[4, 256]`` (float32) in 6 rows, in this process."""
    store = FrameStore()
    store.add("a.mp4", [0, 1, 2, 3], torch.arange(4096, dtype=torch.float32).view(4, 4, 256))
    parts = store.parts(1)
    memory = ResultMemory()
    assert memory.fds and memory.arena(SIZE) and memory.data.numel() == END
    buffers = [[memory.take((6, 4, 256), torch.float32)]]
    place = memory.place(buffers, [(0, torch.tensor([5, 0, 2, 1]))])
    return memory, place, parts


@pytest.mark.parametrize(
    "width", [256, 1024, 8192]
)  # rows of 4 KiB (copied through a mapping), 16 and 128 KiB (pwritev)
def test_a_sender_writes_where_rank_dst_says(shm, width):
    frames = torch.arange(16 * width, dtype=torch.float32).view(4, 4, width)
    store = FrameStore()
    store.add("a.mp4", [0, 1, 2, 3], frames)
    parts = store.parts(1)
    memory = ResultMemory()
    assert memory.arena(8 * frames[0].numel() * 4)
    result = memory.take((6, 4, width), torch.float32)
    place = memory.place([[result]], [(0, torch.tensor([5, 0, 3, 4]))], first=0.5)
    target = Target.open(memory.ready(), parts * 100)  # (more than a MiB: worth writing in place)
    assert target is not None
    target.write(place, parts, 0)
    target.close()
    assert torch.equal(result[[5, 0, 3, 4]], frames)
    assert not result[[1, 2]].any()  # nothing written elsewhere
    memory.close()


def _tamper(place: dict, path: tuple, value) -> dict:
    import copy

    out = copy.deepcopy(place)
    at = out
    for key in path[:-1]:
        at = at[key]
    at[path[-1]] = value
    return out


@pytest.mark.parametrize(
    "path,value,field",
    [
        (("size",), 2 * END, "header.place.size"),  # not the memfds' size
        (("region",), 8192, "header.place.size"),  # nor the regions'
        (("first",), 1.0, "header.place.first"),  # not a fraction of the rows
        (("first",), "0", "header.place.first"),
        (("groups",), [], "header.place.groups"),  # not one per part
        (("groups", 0, "dest"), [6 * ROW, 3], "header.place.groups[0].dest"),  # not this rank's 4 rows
        (("groups", 0, "dest"), [END, 4], "header.place.groups[0].dest"),  # past the end
        (("groups", 0, "dest"), [END - 8, 4], "header.place.groups[0].dest"),  # across the end
        (("groups", 0, "dest"), [8, 4], "header.place.groups[0].dest"),  # not aligned
        (("groups", 0, "leaves", 0), [0, 6, 12], "header.place.groups[0].leaves[0]"),  # rows of another size
        (("groups", 0, "leaves", 0), [0, 200, ROW], "header.place.groups[0].leaves[0]"),  # rows past the end
        (("groups", 0, "leaves", 0), [0, 5, ROW], "header.place.groups[0].dest"),  # row 5 is not in 5 rows
        (("groups", 0, "leaves"), "x", "header.place.groups[0].leaves"),
    ],
)
def test_a_place_answer_is_checked_before_anything_is_written(shm, path, value, field):
    memory, place, parts = _memory_and_place(shm)
    target = Target.open(memory.ready(), parts * 100)
    assert target is not None
    before = memory.data.clone()
    with pytest.raises(ProtocolError, match=field.replace("[", r"\[").replace("]", r"\]")) as e:
        target.write(_tamper(place, path, value), parts, 0)
    assert e.value.rank == 0
    assert torch.equal(memory.data, before)  # nothing written
    target.close()
    memory.close()


def test_every_parts_row_places_are_checked_before_any_row_is_written(shm):
    store = FrameStore()
    store.add("a.mp4", [0, 1], torch.ones(2, 8192))  # 32 KiB rows: written with pwritev
    store.add("b.mp4", [0, 1], torch.ones(2, 4, dtype=torch.int64))
    parts = store.parts(1)
    memory = ResultMemory()
    assert memory.arena(1 << 20)
    a, b = memory.take((2, 8192), torch.float32), memory.take((2, 4), torch.int64)
    place = memory.place([[a], [b]], [(0, torch.tensor([0, 1])), (1, torch.tensor([1, 0]))])
    at = place["groups"][1]["dest"][0]
    memory.data[at : at + 16].view(torch.int64)[1] = 2  # the second part's row places: row 2 of 2 rows
    target = Target.open(memory.ready(), parts * 100)
    assert target is not None
    with pytest.raises(ProtocolError, match=r"header\.place\.groups\[1\]\.dest"):
        target.write(place, parts, 0)
    assert not a.any() and not b.any()  # not even the first part's rows
    target.close()
    memory.close()


def test_regions_that_are_not_the_memfds_are_refused(shm):
    memory, place, parts = _memory_and_place(shm)
    target = Target.open(memory.ready(), parts * 100)
    assert target is not None
    with pytest.raises(ProtocolError, match="header.place.region"):  # sizes that agree, but not the files'
        target.write({**place, "size": 2 * END, "region": 2 * END // 16}, parts, 0)
    target.close()
    memory.close()


def test_no_memfd_of_another_host_or_process_is_opened(shm, tmp_path, monkeypatch):
    memory, place, parts = _memory_and_place(shm)
    many = parts * 100
    ready = memory.ready()
    assert Target.open({**ready, "host": "another"}, many) is None
    assert Target.open({**ready, "memfd": {**ready["memfd"], "name": "tdgather-result-" + "0" * 16}}, many) is None
    assert Target.open({**ready, "memfd": {**ready["memfd"], "name": "../x"}}, many) is None
    fds = ready["memfd"]["fds"]
    assert Target.open({**ready, "memfd": {**ready["memfd"], "fds": fds[1:] + fds[:1]}}, many) is None  # out of order
    assert Target.open({**ready, "memfd": {**ready["memfd"], "fds": [*fds, fds[0]]}}, many) is None  # too many
    assert Target.open({**ready, "memfd": {**ready["memfd"], "fds": [0, *fds[1:]]}}, many) is None  # not a memfd
    assert Target.open(ready, parts) is None  # 16 KB: not worth a round trip
    monkeypatch.setenv("TDGATHER_SHM", "0")
    assert Target.open(ready, many) is None
    memory.close()


def test_a_result_keeps_no_file_descriptor_open(shm):
    before = len(os.listdir("/proc/self/fd"))
    memory = ResultMemory()
    assert memory.arena(SIZE)
    result = memory.take((6, 4, 256), torch.float32)
    memory.close()
    result.fill_(1.0)  # alive, mapped
    assert len(os.listdir("/proc/self/fd")) == before  # results kept cannot use up the process's descriptors
