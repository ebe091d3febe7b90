"""A real S3 API endpoint on localhost for the object store tests: moto's standalone server.

`s3_server()` starts one (``ThreadedMotoServer``) on a free port of 127.0.0.1 and gives the
``storage_options`` that reach it through s3fs, exactly as a user passes them. Every process of
a test's world talks to the same server over HTTP, as ranks talk to a bucket.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator

import pytest

CREDENTIALS = {"key": "testing", "secret": "testing"}


@contextlib.contextmanager
def s3_server() -> Iterator[dict]:
    """A moto S3 server on a free port; yields the ``storage_options`` for it."""
    moto_server = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield {"endpoint_url": f"http://{host}:{port}", **CREDENTIALS}
    finally:
        server.stop()


def new_bucket(options: dict) -> str:
    """A new, empty bucket on the server; its name."""
    import s3fs

    name = f"t-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(**options, skip_instance_cache=True).mkdir(name)
    return name
