from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from kvgate.dev.up import Stack, StackOptions

# Simulated replicas run 20x faster than the documented H100 timing model: the tests check routing
# and wire behaviour, not latency.
FAST_SIM = ("--time-scale", "0.05")


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    options = StackOptions(
        replicas=4,
        port=0,
        sim_args=FAST_SIM,
        workdir=tmp_path_factory.mktemp("stack"),
        extproc={"max_body_bytes": 2 * 1024 * 1024},
    )
    with Stack(options) as running:
        yield running


class Spy(http.server.ThreadingHTTPServer):
    """An HTTP server that records every request it gets: a backend that must never be reached."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        spy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                spy.hits.append(self.path)
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            do_GET = do_POST

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def spy() -> Iterator[Spy]:
    server = Spy()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
