"""The same-host path: shm files written, checked as hostile input, mapped, swept; gloo where it cannot be used."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

import tdgather
from tdgather import ProtocolError
from tdgather.comm.shm import RING, ShmWriter, open_shm
from tdgather.comm.shmfiles import pid_namespace, sweep
from tdgather.comm.wire import Kind, decode_header
from tdgather.tools.launch import WorldError, run_local_world

from . import shm_cases as sc

PIECES = [
    [torch.arange(10, dtype=torch.uint8)],
    [torch.full((3,), 7, dtype=torch.uint8), torch.ones(2, dtype=torch.uint8)],
]


def test_a_segment_is_written_mapped_and_unlinked_at_once(shm):
    w = ShmWriter(ring=0)  # no shm file kept: each chunk in a new one
    name, keep = w.write(PIECES, [0, 64], 69)
    assert not keep and (shm / name).stat().st_size == 69
    data = open_shm(name, 69, src=1)
    assert not (shm / name).exists()  # mapped: gone from the directory, alive in the mapping
    assert data[:10].tolist() == list(range(10)) and data[64:69].tolist() == [7, 7, 7, 1, 1]
    w.cleanup()  # nothing left to remove, and no error


def test_the_ring_is_written_again_once_rank_dst_has_let_go_of_it(shm):
    w = ShmWriter(ring=1)
    name, keep = w.write(PIECES, [0, 64], 69)
    assert keep
    data = open_shm(name, 69, src=1, keep=True)
    view = data[64:69]
    del data
    assert (shm / name).exists()  # kept: a view of it is alive
    other, keep = w.write([[torch.full((4,), 9, dtype=torch.uint8)]], [0], 4)  # not handed back: a new one
    assert other != name and not keep
    open_shm(other, 4, src=1)
    assert view.tolist() == [7, 7, 7, 1, 1]  # untouched
    del view  # the last view: handed back
    assert sorted(p.name for p in shm.iterdir()) == [name + ".free"]
    again, keep = w.write([[torch.full((100,), 5, dtype=torch.uint8)]], [0], 100)  # taken back, and grown
    assert (again, keep) == (name, True) and (shm / name).stat().st_size == 100
    assert open_shm(again, 100, src=1, keep=True).tolist() == [5] * 100
    w.cleanup()
    assert list(shm.iterdir()) == []


@pytest.mark.parametrize(
    "name, size, field",
    [
        ("../etc/passwd", 4, "header.shm.name"),
        ("tdgather-1-7-zzzzzzzz-0", 4, "header.shm.name"),
        (7, 4, "header.shm.name"),
        ("tdgather-1-7-0123abcd-0", 4, "header.shm.name"),  # no such shm file
        ("tdgather-1-7-0123abcd-1", 5, "header.shm"),  # another size than announced
        ("tdgather-1-7-0123abcd-2", 4, "header.shm"),  # a link
        ("tdgather-1-7-0123abcd-3", 4, "header.shm"),  # a directory
    ],
)
def test_a_peer_naming_a_segment_is_checked_before_anything_is_mapped(shm, tmp_path, name, size, field):
    (shm / "tdgather-1-7-0123abcd-1").write_bytes(b"abcd")
    (tmp_path / "outside").write_bytes(b"abcd")
    (shm / "tdgather-1-7-0123abcd-2").symlink_to(tmp_path / "outside")
    (shm / "tdgather-1-7-0123abcd-3").mkdir()
    with pytest.raises(ProtocolError, match=rf"rank 3.*{field.replace('.', '[.]')}"):
        open_shm(name, size, src=3)
    assert (tmp_path / "outside").read_bytes() == b"abcd"


def test_a_header_whose_segment_size_disagrees_with_its_groups_is_refused():
    store = tdgather.FrameStore()
    store.add(["a"], [0], torch.ones(1, 5))
    from tdgather.comm.pack import pack

    header = dict(pack(store).header)
    index_len = pack(store).index.numel()
    ok = decode_header({**header, "shm": {"name": "tdgather-1-7-0123abcd-0", "size": 20}}, Kind.DATA, 1, index_len)
    assert ok.shm == ("tdgather-1-7-0123abcd-0", 20, False) and ok.pieces()  # the pieces are in the shm file
    kept = {"name": "tdgather-1-7-0123abcd-0", "size": 20, "keep": True}
    assert decode_header({**header, "shm": kept}, Kind.DATA, 1, index_len).shm[2]
    with pytest.raises(ProtocolError, match=r"header.shm.keep"):
        decode_header({**header, "shm": {**kept, "keep": 1}}, Kind.DATA, 1, index_len)
    with pytest.raises(ProtocolError, match=r"header.shm.size: expected 20"):
        decode_header({**header, "shm": {"name": "tdgather-1-7-0123abcd-0", "size": 1 << 40}}, Kind.DATA, 1, index_len)
    with pytest.raises(ProtocolError, match=r"header.shm"):
        decode_header({**header, "shm": {"name": "x"}}, Kind.DATA, 1, index_len)


def test_sweep_removes_the_segments_of_dead_processes_only(shm):
    dead = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True, check=True).stdout.strip()
    ns = pid_namespace()
    (shm / f"tdgather-{dead}-{ns}-0123abcd-0").write_bytes(b"x")
    (shm / f"tdgather-{dead}-{ns}-0123abcd-1.free").write_bytes(b"x")  # a ring's shm file, handed back
    (shm / f"tdgather-{os.getppid()}-{ns}-0123abcd-0").write_bytes(b"x")  # alive
    (shm / f"tdgather-{dead}-{ns + 1}-0123abcd-0").write_bytes(b"x")  # another namespace's (a container's)
    (shm / "unrelated").write_bytes(b"x")
    assert sweep() == 2
    kept = [f"tdgather-{os.getppid()}-{ns}-0123abcd-0", f"tdgather-{dead}-{ns + 1}-0123abcd-0", "unrelated"]
    assert sorted(p.name for p in shm.iterdir()) == sorted(kept)


def test_without_room_the_writer_declines_and_logs_once(shm, monkeypatch, caplog):
    monkeypatch.setenv("TDGATHER_SHM_SPARE", str(1 << 62))
    w = ShmWriter()
    with caplog.at_level("INFO", logger="tdgather"):
        assert w.write([[torch.ones(4, dtype=torch.uint8)]], [0], 4) is None
        assert w.write([[torch.ones(4, dtype=torch.uint8)]], [0], 4) is None
    assert caplog.text.count("shared memory unavailable") == 1 and not list(shm.iterdir())


@pytest.mark.world
def test_a_collector_on_one_host_hands_chunks_over_in_shared_memory(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    dead = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True, check=True).stdout.strip()
    (shm / f"tdgather-{dead}-{pid_namespace()}-0123abcd-0").write_bytes(b"x")  # a killed sender's leftover: swept
    env = {"TDGATHER_SHM_DIR": str(shm)}
    out = run_local_world(sc.case_collect, 3, str(tmp_path / "ds"), env, timeout=120)
    assert out[0]["frames"] == 3 * 24 * 8 and out[0]["shared"] >= 2  # every frame checked bit for bit
    assert all(r["left"] == [] for r in out)  # no shm file outlives the run (the leftover swept)


@pytest.mark.world
@pytest.mark.parametrize("env", [{"TDGATHER_SHM": "0"}, {"TDGATHER_SHM_SPARE": str(1 << 62)}])
def test_gloo_carries_the_chunks_where_shared_memory_is_off_or_full(tmp_path, env):
    shm = tmp_path / "shm"
    shm.mkdir()
    out = run_local_world(sc.case_collect, 3, str(tmp_path / "ds"), {"TDGATHER_SHM_DIR": str(shm), **env}, timeout=120)
    assert out[0]["frames"] == 3 * 24 * 8 and out[0]["shared"] == 0
    assert all(r["left"] == [] for r in out)


@pytest.mark.world
def test_rank_dst_removes_a_killed_senders_segments_when_the_run_ends(tmp_path):
    """Its ring (and a chunk it was killed writing) would stay in RAM until a later run on this host swept it."""
    shm = tmp_path / "shm"
    shm.mkdir()
    with pytest.raises(WorldError) as e:
        run_local_world(sc.case_sender_killed, 2, str(tmp_path / "ds"), {"TDGATHER_SHM_DIR": str(shm)}, str(tmp_path))
    assert e.value.failures == {1: "exited with code -9 and no result"}, e.value.failures
    out = e.value.results[0]
    assert out["error"] == {"type": "PeerLostError", "rank": 1}
    assert out["left"] == [(tmp_path / "decoy").read_text()]  # another writer's shm file stays


@pytest.mark.parametrize("raw", ["abc", "1.5", "-1", ""])
def test_a_ring_size_that_is_not_a_count_is_logged_and_the_default_used(shm, monkeypatch, caplog, raw):
    monkeypatch.setenv("TDGATHER_SHM_RING", raw)
    with caplog.at_level("WARNING", logger="tdgather"):
        assert ShmWriter().ring == RING and ShmWriter().ring == RING
    assert caplog.text.count(f"TDGATHER_SHM_RING={raw!r} is not a count of shm files") == 1
    monkeypatch.setenv("TDGATHER_SHM_RING", "0")
    assert ShmWriter().ring == 0
