"""`ObjectStore`: a dataset's files in an object store, through fsspec (``s3://``, ``gs://``, ``az://``, ``memory://``).

An object store has no rename and no directory: an object appears whole when its upload
completes, or not at all. So a shard is streamed up as a multipart upload that is completed
only once every byte is sent (an error aborts it, and nothing appears), and what fits in one
block (the index, a record, a small shard) is one PUT. On S3 `PARTS_IN_FLIGHT` parts upload at
once while the next is cut; other stores take fsspec's buffered file (``autocommit=False``), one
part at a time. Memory stays bounded: `PARTS_IN_FLIGHT` + 1 parts of `BLOCK_BYTES`.

An object is read by byte ranges (`RangedObject`): a shard's header, then only the rows asked
for (`tdgather.format.codec` reads and checks them).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import DatasetError, OutputError, TdgatherError
from ..format.names import RUN_TAG, SHARD_NAME, shard_run
from .store import Written, hashed

__all__ = ["BLOCK_BYTES", "PARTS_IN_FLIGHT", "ObjectStore", "RangedObject"]

log = logging.getLogger("tdgather")

BLOCK_BYTES = 8 << 20  # one multipart part (S3 takes 5 MiB at least); chunks are cut to it before the upload
PARTS_IN_FLIGHT = 3  # S3: parts uploading at once, while the next is cut (other stores: one at a time)
# S3's answers to a failed condition, as s3fs words them
_CONDITION_FAILED = ("pre-condition", "PreconditionFailed", "ConditionalRequestConflict")
_UNCONDITIONAL = threading.Lock()  # a store without conditional writes: check-then-put, one at a time in a process
_PACKAGES = {"s3": "s3fs", "gcs": "gcsfs", "azure": "adlfs"}  # each extra's fsspec backend
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}


class ObjectStore:
    """The objects under one prefix of an fsspec URL; `tdgather.storage.store.Store` for object stores."""

    atomic_rename = False
    checksum = "sha256"

    def __init__(self, url: str, storage_options: dict | None = None, block_bytes: int = BLOCK_BYTES) -> None:
        self.scheme = url.split("://", 1)[0].lower()
        self.where = url.rstrip("/")
        self.block_bytes = block_bytes
        self._options = dict(storage_options or {})
        self._fs, root = self._connect(cache=True)
        self._pid = os.getpid()
        self.root = root.rstrip("/")

    def _connect(self, cache: bool) -> tuple[Any, str]:
        """The fsspec filesystem for the URL (a new instance, uncached, in a forked process)."""
        try:
            from fsspec.core import url_to_fs

            return url_to_fs(self.where, **self._options, **({} if cache else {"skip_instance_cache": True}))
        except ImportError as e:
            extra = _EXTRAS.get(self.scheme)
            package = _PACKAGES.get(extra, e.name or "fsspec")
            how = f"pip install 'tdgather[{extra}]'" if extra else f"install the fsspec backend for {self.scheme}://"
            raise ImportError(f"writing or reading {self.where!r} needs {package}: {how}") from e
        except TypeError as e:
            raise self._bad_option(e) from e
        except ValueError as e:
            if "Protocol not known" not in str(e):
                raise
            raise ValueError(
                f"{self.where!r}: no store serves {self.scheme}:// (fsspec has no such protocol): check the URL, or "
                f"install the fsspec backend for {self.scheme}://"
            ) from e

    def _bad_option(self, error: TypeError) -> ValueError:
        return ValueError(
            f"storage_options={sorted(self._options)}: a key the {self.scheme}:// filesystem does not take "
            f"({error}); see its documentation for the options it accepts"
        )

    @property
    def fs(self) -> Any:
        """The fsspec filesystem; made again in a forked process (a DataLoader worker): its event loop is not ours."""
        if self._pid != os.getpid():
            self._fs, _ = self._connect(cache=False)
            self._pid = os.getpid()
        return self._fs

    def __getstate__(self) -> dict:
        """Pickled (a spawned worker) without its filesystem: the copy makes its own."""
        state = self.__dict__.copy()
        state["_fs"], state["_pid"] = None, -1
        return state

    def path(self, name: str) -> str:
        """``url/name``."""
        return f"{self.where}/{name}"

    def _key(self, name: str) -> str:
        return f"{self.root}/{name}"

    def list(self) -> dict[str, int]:
        """Every object under the prefix (nested ones as ``sub/name``); the prefix itself an object: ``{".": size}``."""
        with self._errors("listing the prefix"):
            try:
                self.fs.invalidate_cache(self.root)
                found = self.fs.find(self.root, detail=True, withdirs=False)
            except FileNotFoundError as e:
                self._check_bucket(e)
                return {}
        out = {}
        for key, info in found.items():
            if info.get("type") == "directory":  # s3fs's answer for a prefix whose first object lands meanwhile
                continue
            key = self.fs._strip_protocol(key).rstrip("/")
            name = key[len(self.root) + 1 :] if key.startswith(self.root + "/") else "."
            out[name] = int(info.get("size") or 0)
        return out

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """The store's own errors (credentials, endpoint, network, an option) as tdgather's, saying what to fix."""
        try:
            yield
        except (TdgatherError, FileNotFoundError, _SourceFailed):
            raise
        except TypeError as e:  # s3fs makes its session on first use: an option it does not take shows here
            raise self._bad_option(e) from e
        except Exception as e:
            raise OutputError(
                f"{self.where!r}: {what} failed ({type(e).__name__}: {e}); check the URL and storage_options "
                "(endpoint_url, credentials)"
            ) from e

    def _check_bucket(self, error: Exception) -> None:
        """Raise `OutputError` where the URL's bucket (S3, GCS, Azure) does not exist: nothing could be written."""
        bucket = self.root.split("/", 1)[0]
        if self.scheme in _EXTRAS and not self.fs.exists(bucket):
            raise OutputError(
                f"{self.where!r}: the bucket {bucket!r} does not exist, or these storage_options do not reach it: "
                "create it, or check the URL and storage_options (endpoint_url, credentials)"
            ) from error

    def size(self, name: str) -> int | None:
        """The object's size, or None where there is none."""
        key = self._key(name)
        with self._errors(f"reading {name}"):
            self.fs.invalidate_cache(key)
            try:
                info = self.fs.info(key)
            except FileNotFoundError:
                return None
        return int(info["size"]) if info.get("type") == "file" else None

    def read(self, name: str) -> bytes:
        """The whole object."""
        with self._errors(f"reading {name}"):
            try:
                return self.fs.cat_file(self._key(name))
            except FileNotFoundError:
                raise DatasetError(self.path(name), "object", _GONE) from None

    def open(self, name: str) -> RangedObject:
        """The object, to read by byte ranges (`RangedObject`)."""
        size = self.size(name)
        if size is None:
            raise DatasetError(self.path(name), "object", _GONE)
        return RangedObject(self, name, size)

    def put(self, name: str, chunks: Iterable, then: Callable[[Callable[[], None]], None] | None = None) -> Written:
        """Upload an object from its chunks: it appears whole once complete, or not at all.

        What fits in one block (the index, a record, a small shard) is one PUT; more is a multipart
        upload of blocks, completed once every part is sent, aborted on any error. ``then`` is not
        used: an object is durable when its upload completes.
        """
        h, count = hashlib.sha256(), [0]
        pieces = iter(hashed(_blocks(_source(chunks), self.block_bytes), h, count))
        first = bytearray()
        try:
            for piece in pieces:
                first += piece
                if len(first) >= self.block_bytes:
                    break
            else:  # the whole object is in hand
                self._write(name, functools.partial(self.fs.pipe_file, self._key(name), bytes(first)))
                return Written(count[0], h.hexdigest())
            self._write(name, functools.partial(self._multipart, name, first, pieces))
        except _SourceFailed as e:  # the bytes' own source failed, not the store: its error, as it was
            raise e.__cause__ from None
        return Written(count[0], h.hexdigest())

    def _multipart(self, name: str, first: bytearray, rest: Iterator) -> None:
        from fsspec.spec import AbstractBufferedFile

        if self._s3:
            return self._s3_multipart(name, first, rest)
        if self.scheme == "memory":  # no multipart upload (opening the file makes it): one PUT of every byte
            self.fs.pipe_file(self._key(name), bytes(first) + b"".join(bytes(p) for p in rest))
            return
        f = self.fs.open(self._key(name), "wb", block_size=self.block_bytes, autocommit=False)
        if not isinstance(f, AbstractBufferedFile):  # another filesystem without multipart uploads: one PUT
            f.discard()
            self.fs.pipe_file(self._key(name), bytes(first) + b"".join(bytes(p) for p in rest))
            return
        try:
            f.write(first)
            for piece in rest:
                f.write(piece)
            f.close()  # the last part; the upload is not complete yet
            f.commit()
        except BaseException:
            f.discard()  # the multipart upload is aborted: no object appears
            f.closed = True
            raise

    def _s3_multipart(self, name: str, first: bytearray, rest: Iterator) -> None:
        """S3: the parts uploaded `PARTS_IN_FLIGHT` at a time while the next is cut; completed last, else aborted."""
        bucket, key, _ = self.fs.split_path(self._key(name))
        upload = self.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
        done: list[dict] = []
        try:
            with ThreadPoolExecutor(PARTS_IN_FLIGHT, thread_name_prefix="tdgather-upload") as pool:
                flying: list[Future] = []
                for number, data in enumerate(_parts(first, rest, self.block_bytes), start=1):
                    if len(flying) == PARTS_IN_FLIGHT:  # memory stays PARTS_IN_FLIGHT + 1 parts
                        done.append(flying.pop(0).result())
                    flying.append(pool.submit(self._upload_part, bucket, key, upload, number, data))
                done += [f.result() for f in flying]
            parts = {"Parts": done}
            self.fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload, MultipartUpload=parts)
        except BaseException:
            with contextlib.suppress(Exception):  # no object appears; the parts sent are dropped
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
            raise
        finally:
            self.fs.invalidate_cache(self._key(name))

    def _upload_part(self, bucket: str, key: str, upload: str, number: int, data: bytes) -> dict:
        out = self.fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload, PartNumber=number, Body=data)
        return {"PartNumber": number, "ETag": out["ETag"]}

    def _write(self, name: str, upload: Callable[[], None]) -> None:
        with self._errors(f"writing {name} (objects already committed stay valid)"):
            upload()

    def remove(self, name: str) -> None:
        """Remove the object, if it is there."""
        with self._errors(f"removing {name}"):
            try:
                self.fs.rm_file(self._key(name))
            except FileNotFoundError:
                pass

    def version(self, name: str) -> str | None:
        """The object's ETag on S3; elsewhere the sha256 of its bytes (read whole: small objects); None if absent."""
        with self._errors(f"reading {name}"):
            key = self._key(name)
            self.fs.invalidate_cache(key)
            try:
                if self._s3:
                    return str(self.fs.info(key)["ETag"])
                return hashlib.sha256(self.fs.cat_file(key)).hexdigest()
            except FileNotFoundError:
                return None

    def put_if(self, name: str, data: bytes, expected: str | None) -> bool:
        """S3: one PUT with ``If-Match: expected`` (``If-None-Match: *`` for None), the store's own condition.

        Other stores: the version checked, then one PUT, under a lock of this process (two processes
        can still both pass the check: see docs/object-storage.md).
        """
        with self._errors(f"writing {name} (objects already committed stay valid)"):
            if self._s3:
                bucket, key, _ = self.fs.split_path(self._key(name))
                match = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}
                try:
                    self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **match)
                except OSError as e:
                    if isinstance(e, FileExistsError) or any(w in str(e) for w in _CONDITION_FAILED):
                        return False
                    if isinstance(e, FileNotFoundError) and expected is not None:  # If-Match on a removed object
                        return False
                    raise
                finally:
                    self.fs.invalidate_cache(self._key(name))
                return True
            with _UNCONDITIONAL:
                if self.version(name) != expected:
                    return False
                self.fs.pipe_file(self._key(name), data)
                return True

    def abort_uploads(self, runs: Iterable[str]) -> list[str]:
        """Abort the multipart uploads under the prefix that never completed, of shards of ``runs``; their names.

        A process killed mid-upload leaves its upload's parts stored (and billed) until it is aborted:
        those of the shards named by a run of ``runs`` (run ids, or the `RUN_TAG` digits shard names
        carry) go; nothing else, not another run's (it may be live). Best effort, after a commit: an
        error of the store (no ``s3:ListBucketMultipartUploads`` permission) is logged, not raised.
        Only S3 lists uploads; other stores: ``[]``.
        """
        tags = {run[:RUN_TAG] for run in runs}
        if not self._s3 or not tags:
            return []
        bucket, prefix, _ = self.fs.split_path(self.root)
        prefix = f"{prefix}/" if prefix else ""
        aborted: list[str] = []
        try:
            more: dict = {}
            while True:
                page = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **more)
                for upload in page.get("Uploads", []):
                    name = upload["Key"][len(prefix) :]
                    if SHARD_NAME.fullmatch(name) and shard_run(name) in tags:
                        self.fs.call_s3(
                            "abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                        )
                        aborted.append(name)
                if not page.get("IsTruncated"):
                    break
                more = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}
        except Exception as e:  # the commit is done: what is left is only storage, to be aborted later
            log.warning(
                "tdgather: %r: could not abort the unfinished uploads of this run (%s: %s); a bucket lifecycle rule "
                "(AbortIncompleteMultipartUpload) removes them",
                self.where,
                type(e).__name__,
                e,
            )
        if aborted:
            log.info("tdgather: %r: aborted %d unfinished upload(s) of interrupted attempts", self.where, len(aborted))
        return aborted

    @property
    def conditional_put(self) -> bool:
        """S3's ``If-Match`` / ``If-None-Match``: `put_if` is atomic against other processes (elsewhere not)."""
        return self._s3

    @property
    def _s3(self) -> bool:
        return self.scheme in ("s3", "s3a") and hasattr(self.fs, "call_s3")


class _SourceFailed(Exception):
    """The chunks an upload was reading raised (its ``__cause__``): not the store's error."""


def _source(chunks: Iterable) -> Iterator:
    """``chunks``, with an error of theirs marked as theirs (`_SourceFailed`)."""
    try:
        yield from chunks
    except Exception as e:
        raise _SourceFailed() from e


def _parts(first: bytearray, rest: Iterator, size: int) -> Iterator[bytes]:
    """The bytes of ``first`` then ``rest``, in parts of exactly ``size`` (the last one shorter)."""
    buffer = first
    for piece in rest:
        buffer += piece
        while len(buffer) >= size:
            yield bytes(buffer[:size])
            del buffer[:size]
    while len(buffer) >= size:
        yield bytes(buffer[:size])
        del buffer[:size]
    if buffer:
        yield bytes(buffer)


def _blocks(chunks: Iterable, size: int) -> Iterator[memoryview]:
    """The chunks' bytes in pieces of at most ``size`` (views: nothing is copied)."""
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        for at in range(0, len(view), size):
            yield view[at : at + size]


_GONE = "no such object (was the dataset rewritten since it was opened? open it again)"


class RangedObject:
    """An object as a `tdgather.format.codec.ByteSource`: each read one ranged GET, checked to be whole."""

    mapped = False

    def __init__(self, store: ObjectStore, name: str, size: int) -> None:
        self.store, self.name, self.size = store, name, size
        self.where = store.path(name)

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``start:end`` of the object, all of them or a `DatasetError`."""
        if end <= start:
            return b""
        store = self.store
        with store._errors(f"reading {self.name}"):
            try:
                data = store.fs.cat_file(store._key(self.name), start=start, end=end)
            except FileNotFoundError:
                raise DatasetError(self.where, "object", _GONE) from None
        if len(data) != end - start:
            raise DatasetError(self.where, "object", f"expected bytes {start}..{end}, got {len(data)} bytes")
        return data
