"""The output directory: what may be replaced, the staging directory, publishing, deleting only ours.

Rules (checked by rank dst before any frame moves):

1. the target is absent, empty, or (with ``overwrite=True``) a complete tdgather dataset holding
   only files tdgather names; ``<name>.partial`` likewise holds only tdgather's files;
2. neither is a symbolic link (renames and deletions would act on the link);
3. tdgather deletes files it wrote, one by one by name (the index first), and removes a directory
   only when that leaves it empty: never a tree;
4. a complete staging directory is moved into place in one step; an old dataset is exchanged with
   it atomically (``renameat2(RENAME_EXCHANGE)`` on Linux), so a crash leaves one or the other.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from ..errors import OutputError
from ..format.names import FORMAT, INDEX_NAME, OURS, SHARD_NAME

__all__ = [
    "describe_names",
    "exchange",
    "check_output",
    "fsync_dir",
    "lock_dir",
    "publish",
    "remove_ours",
    "staging_of",
]


_OURS = re.compile(OURS.pattern + r"|\." + OURS.pattern + r"\.tmp-\d+")  # and their temporary names


def _foreign(directory: Path) -> list[str]:
    """Entries of ``directory`` that tdgather did not write (sorted); [] unless it is a directory.

    A file named like tdgather's counts as tdgather's only if its first bytes say so (`_written_by_us`):
    a user's file that happens to carry such a name is never deleted.
    """
    if not directory.is_dir():
        return []
    return sorted(n for n in os.listdir(directory) if not _is_ours(directory / n))


def _is_ours(path: Path) -> bool:
    """A regular file (not a link) with one of tdgather's names, that holds what tdgather writes there."""
    return bool(_OURS.fullmatch(path.name)) and path.is_file() and not path.is_symlink() and _written_by_us(path)


_JSON_FORMAT = re.compile(rb'^\s*\{.*"format"\s*:\s*"' + FORMAT.encode() + rb'"', re.DOTALL)
_JSON_HEAD = 4096  # the index, a record and a run mark name their format first
_SHARD_HEAD_MAX = 100 << 20  # safetensors' own limit on a header


def _written_by_us(path: Path) -> bool:
    """Whether a file named like tdgather's is one.

    A shard whose header says ``"format": "tdgather"``, a JSON object that names that format in its
    first 4 KB, or a temporary file a killed writer left (never read).
    """
    if path.name.startswith("."):
        return True
    try:
        with open(path, "rb") as f:
            if not SHARD_NAME.fullmatch(path.name):
                return _JSON_FORMAT.match(f.read(_JSON_HEAD)) is not None
            size = int.from_bytes(f.read(8).ljust(8, b"\xff"), "little")
            if size > _SHARD_HEAD_MAX:
                return False
            header = json.loads(f.read(size))
    except (OSError, ValueError, RecursionError):
        return False
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return isinstance(meta, dict) and meta.get("format") == FORMAT


def describe_names(names: list[str]) -> str:
    """The first few names, quoted, and how many more: for messages about what a directory holds."""
    shown = ", ".join(repr(n) for n in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def check_output(path: str | os.PathLike, overwrite: bool, resume: bool = False) -> Path:
    """Refuse an output directory that cannot be used, before any work; return it.

    The target must be absent, an empty directory, or (with ``overwrite=True``) a complete
    tdgather dataset. ``<name>.partial`` must be absent, or (with ``overwrite=True``) hold only
    what a tdgather run left there. Anything else is refused even with ``overwrite=True``:
    tdgather never deletes a file it did not write. The parent must be creatable and writable.
    With ``resume=True``, a complete dataset at the target and tdgather's files in ``<name>.partial``
    are what the run continues from (`tdgather.storage.resume`), not obstacles.
    """
    target = Path(path)
    staging = staging_of(target)
    for p in (target, staging):  # renames and deletions act on links, not on what they point to
        if p.is_symlink():
            raise OutputError(
                f"{str(p)!r} is a symbolic link (to {os.readlink(p)!r}); tdgather writes, swaps and removes "
                f"directories by renaming them, which a link would break: pass the directory itself "
                f"({str(p.resolve())!r}) or another path"
            )
    if target.exists() and not target.is_dir():
        raise OutputError(f"output {str(target)!r}: expected a directory, got a file; choose another path")
    if target.is_dir() and any(target.iterdir()):
        foreign = _foreign(target)
        if foreign or not (target / INDEX_NAME).is_file():
            what = f"it holds {describe_names(foreign)}" if foreign else f"it has shards but no {INDEX_NAME}"
            raise OutputError(
                f"output {str(target)!r} holds files tdgather did not write, or is not a complete tdgather dataset "
                f"({what}); tdgather never replaces or deletes what it did not write, even with overwrite=True: "
                "choose another path, or move those files away"
            )
        if not overwrite and not resume:
            raise OutputError(
                f"output {str(target)!r} already holds a tdgather dataset; pass overwrite=True to replace it "
                "atomically (once the new one is complete), or choose another path"
            )
    foreign = _foreign(staging)
    if staging.exists() and (foreign or not staging.is_dir()):
        raise OutputError(
            f"{str(staging)!r} is where tdgather stages {str(target)!r}, but it holds "
            f"{describe_names(foreign) if staging.is_dir() else 'a file'}, which tdgather did not write; move it away "
            "(tdgather never deletes what it did not write, even with overwrite=True)"
        )
    if (staging / INDEX_NAME).exists() and not overwrite and not resume:
        raise OutputError(
            f"{str(staging)!r} holds a complete dataset whose move into place was interrupted (or the old one of "
            "an interrupted overwrite); tdgather.open() reads it there: keep it, remove it, or pass "
            "overwrite=True to replace it"
        )
    if staging.exists() and not overwrite and not resume:
        raise OutputError(
            f"{str(staging)!r} holds shards left by an interrupted run (no index, so incomplete); continue that "
            "run with resume=True, or pass overwrite=True to start over (read what it saved with "
            "tdgather.open(path, incomplete=True))"
        )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"output {str(target)!r}: cannot create its parent directory ({e}); fix the path") from e
    if not os.access(target.parent, os.W_OK | os.X_OK):
        raise OutputError(f"output {str(target)!r}: its parent directory is not writable; choose a writable path")
    return target


def remove_ours(directory: Path) -> None:
    """Delete the files tdgather wrote in ``directory``, then the directory if that left it empty.

    Never a tree: a file someone else put there meanwhile stays, and so does the directory.
    """
    if not directory.is_dir():
        return
    names = sorted(os.listdir(directory), key=lambda n: n != INDEX_NAME)  # the index first: never a
    for name in names:  # "complete" dataset with shards missing, should this be interrupted
        if _OURS.fullmatch(name) and (directory / name).is_file():
            (directory / name).unlink(missing_ok=True)
    try:
        directory.rmdir()
    except OSError:
        pass  # not empty: something that is not ours appeared; it is left where it is


def staging_of(target: Path) -> Path:
    """Where a dataset is written before it is moved into place: ``<name>.partial`` beside it."""
    return target.with_name(target.name + ".partial")


def publish(staging: Path, target: Path, overwrite: bool, swap: Callable[[Path, Path], bool] | None = None) -> None:
    """Move a complete staging directory into place.

    An old dataset is exchanged with the new one in one atomic step (Linux ``renameat2``), so a
    crash leaves the old dataset or the new one at ``target``, never neither; the old one, then
    at ``<name>.partial`` with its index, is removed. Elsewhere it is renamed aside first.
    """
    if target.exists() and any(target.iterdir()):
        if not overwrite:
            raise OutputError(f"output {str(target)!r} appeared while writing; pass overwrite=True to replace it")
        foreign = _foreign(target)
        if foreign:  # appeared since check_output: keep the old dataset, and say so
            raise OutputError(
                f"output {str(target)!r} gained files tdgather did not write ({describe_names(foreign)}) "
                f"while the new dataset was written; the new one is complete in {str(staging)!r}"
            )
        if (swap or exchange)(staging, target):
            fsync_dir(target.parent)
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.rename(staging, old)  # the old dataset never waits at <name>.partial, where a resume would look
            remove_ours(old)
            return
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.rename(target, old)
        os.replace(staging, target)
        fsync_dir(target.parent)
        remove_ours(old)
        return
    os.replace(staging, target)
    fsync_dir(target.parent)


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with ``renameat2(RENAME_EXCHANGE)``; False where that is unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def lock_dir(path: Path) -> int:
    """Hold an exclusive lock on a staging directory; return its descriptor (closing it releases the lock).

    Two jobs writing one output (a requeued job whose first run still lives) would mix their shards.

    Raises:
        OutputError: another process holds the lock.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OutputError(
            f"{str(path)!r} is being written by another process (the same job running twice?): wait for it to "
            "end, or choose another path"
        ) from None
    except OSError:  # a filesystem without locks: nothing to hold
        pass
    return fd


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
