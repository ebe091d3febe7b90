"""A real S3 API endpoint on localhost for the object store tests: moto's server, its writes made atomic.

`s3_server()` starts one on a free port of 127.0.0.1 and gives the ``storage_options`` that reach
it through s3fs, exactly as a user passes them. Every process of a test's world talks to the same
server over HTTP, as ranks talk to a bucket.

moto checks a conditional PUT's ``If-None-Match``/``If-Match`` and then stores the object, in the
request's own thread: two racing commits can both pass the check (and two writes of one key can
break each other's buffers), which S3 never allows. The server here handles the requests that
change objects (PUT, POST, DELETE) one at a time, as S3's own conditional writes are atomic; reads
stay concurrent.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest

CREDENTIALS = {"key": "testing", "secret": "testing"}
CHANGES = frozenset({"PUT", "POST", "DELETE"})


class OneWriteAtATime:
    """A WSGI app around ``app`` that handles the requests changing objects one at a time (S3's atomic writes)."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app, self.lock = app, threading.Lock()

    def __call__(self, environ: dict, start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") not in CHANGES:
            return self.app(environ, start_response)
        with self.lock:
            return list(self.app(environ, start_response))  # the whole response made under the lock


@contextlib.contextmanager
def s3_server() -> Iterator[dict]:
    """A moto S3 server on a free port (its writes atomic); yields the ``storage_options`` for it."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    app = OneWriteAtATime(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, name="s3-server", daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    try:
        yield {"endpoint_url": f"http://{host}:{port}", **CREDENTIALS}
    finally:
        server.shutdown()
        thread.join(30)


def new_bucket(options: dict) -> str:
    """A new, empty bucket on the server; its name."""
    import s3fs

    name = f"t-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(**options, skip_instance_cache=True).mkdir(name)
    return name
