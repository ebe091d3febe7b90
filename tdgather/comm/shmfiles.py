"""Shared memory files by name: where they go, which host they are on, and removing those of writers gone.

Every shm file tdgather makes is named ``tdgather-<pid>-<namespace>-<token>-<n>`` (`SHM_NAME`) in
one directory (`shm_dir`), and a kept one rank dst has let go of is renamed ``<name>.free``
(`hand_back`). From the name alone: which writer made it (the name without its number), and the
writer's process, checked alive in its own PID namespace only. So rank dst removes the files of
peers lost mid-run (`PeerShm`), and any tdgather process removes those whose writer's process is
gone (`sweep`). What goes into the files, and how rank dst maps them: `tdgather.comm.shm`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import socket
import stat
from collections.abc import Iterable
from pathlib import Path

__all__ = ["FREE", "SHM_NAME", "PeerShm", "hand_back", "host_token", "pid_namespace", "shm_dir", "sweep"]

log = logging.getLogger("tdgather")

# pid, pid namespace, token, number: a pid is only known alive or dead in its own namespace
SHM_NAME = re.compile(r"tdgather-([0-9]{1,10})-([0-9]{1,20})-([0-9a-f]{8})-([0-9]{1,12})")
FREE = ".free"  # a kept shm file rank dst has handed back: ``<name>.free``

_said: set[str] = set()  # the directories found unusable, logged by this process (one line each)


def shm_dir() -> Path | None:
    """Where shm files go (``TDGATHER_SHM_DIR``, default ``/dev/shm``); None when off or not a writable directory.

    A directory that cannot be used (not ``TDGATHER_SHM=0``) is logged once per process.
    """
    if os.environ.get("TDGATHER_SHM", "1") == "0":
        return None
    path = Path(os.environ.get("TDGATHER_SHM_DIR", "/dev/shm"))
    if path.is_dir() and os.access(path, os.W_OK | os.X_OK):
        return path
    if str(path) not in _said:
        _said.add(str(path))
        log.info(
            "tdgather: shared memory unavailable: %s is not a writable directory (TDGATHER_SHM_DIR); "
            "gloo carries every chunk",
            path,
        )
    return None


def host_token() -> str | None:
    """This host, as rank dst names it: hostname and boot id hashed; None when shm files are off here."""
    if shm_dir() is None:
        return None
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return hashlib.sha256(f"{socket.gethostname()}\0{boot}\0{shm_dir()}".encode()).hexdigest()[:32]


def hand_back(path: Path) -> None:
    """Rank dst let go of a kept shm file: its sender may write it again."""
    with contextlib.suppress(OSError):
        os.rename(path, path.with_name(path.name + FREE))


class PeerShm:
    """The shm file writers each peer named in its data messages: rank dst removes a lost peer's shm files.

    A writer is the ``tdgather-<pid>-<namespace>-<token>`` its shm file names start with; its token is
    drawn per `tdgather.comm.shm.ShmWriter` (one per sender and run), so it names that sender's shm files of this
    run only: its ring (held or handed back), and a chunk it was killed writing, named or not.
    """

    def __init__(self) -> None:
        self.writers: dict[int, set[str]] = {}

    def note(self, peer: int, shm: tuple[str, int, bool] | None) -> None:
        """A data message of ``peer`` with shm file ``shm`` (its header's ``(name, size, keep)``, or None)."""
        m = SHM_NAME.fullmatch(shm[0]) if shm is not None else None
        if m is not None:
            self.writers.setdefault(peer, set()).add(_writer(m))

    def remove(self, peers: Iterable[int]) -> int:
        """Remove every shm file of the writers ``peers`` named (this user's files only); return how many.

        For peers lost (killed, hung): no sender will remove them, and rank dst reads none of them again.
        """
        writers = set().union(*(self.writers.get(p, set()) for p in peers))
        where = shm_dir()
        if not writers or where is None:
            return 0
        names = set()
        with contextlib.suppress(OSError):
            for entry in os.scandir(where):
                m = SHM_NAME.fullmatch(entry.name.removesuffix(FREE))
                if m is not None and _writer(m) in writers:
                    names.add(m.group(0))
        gone = 0
        for name in sorted(names):
            for path in (where / name, where / (name + FREE)):  # in this order: a hand-back renames one to the other
                with contextlib.suppress(OSError):
                    st = path.lstat()
                    if st.st_uid == os.getuid() and stat.S_ISREG(st.st_mode):
                        path.unlink()
                        gone += 1
        if gone:
            log.info("tdgather: removed %d shared memory file(s) of lost peers in %s", gone, where)
        return gone


def _writer(m: re.Match) -> str:
    """The writer of an shm file name (``SHM_NAME`` match): the name without its number."""
    return m.group(0).rsplit("-", 1)[0]


def pid_namespace() -> int:
    """This process's PID namespace (the inode of ``/proc/self/ns/pid``; 0 where it cannot be read)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def sweep() -> int:
    """Remove shm files (of this user) whose writer's process is gone; return how many.

    Only shm files written in this process's PID namespace: another namespace's pids (a container
    sharing ``/dev/shm``) cannot be checked from here, and are that namespace's to sweep.
    """
    where = shm_dir()
    if where is None:
        return 0
    gone = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(where):
            m = SHM_NAME.fullmatch(entry.name.removesuffix(FREE))
            if m is None or int(m.group(1)) == os.getpid() or int(m.group(2)) != pid_namespace():
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid != os.getuid() or _alive(int(m.group(1))):
                    continue
                os.unlink(entry.path)
                gone += 1
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's: alive
    return True
