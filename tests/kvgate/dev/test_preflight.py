"""What `kvgate up` checks before it starts anything: its listener port, the models of engines it fronts."""

from __future__ import annotations

import http.server
import json
import socket
import threading
from collections.abc import Iterator

import pytest

from contracts.errors import ConfigError
from kvgate.dev.preflight import PortInUse, check_port_free, endpoint_from_url, served_models


@pytest.mark.parametrize("reuse_port", [True, False], ids=["held-with-SO_REUSEPORT", "held-plainly"])
def test_a_port_in_use_is_refused_naming_it(reuse_port: bool) -> None:
    """Envoy listens with SO_REUSEPORT, so a second one could bind the same port: the check must not."""
    with socket.socket() as held:
        if reuse_port:
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(PortInUse, match=rf"^127\.0\.0\.1:{port} is already in use .* --port 0"):
            check_port_free("127.0.0.1", port)


def test_a_free_port_passes() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    check_port_free("127.0.0.1", port)


def test_an_address_not_of_this_machine_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"cannot listen on 192\.0\.2\.1:8080"):
        check_port_free("192.0.2.1", 8080)


def test_endpoint_from_url() -> None:
    assert endpoint_from_url("http://127.0.0.1:8000/v1", 2, "vllm") == {
        "id": "engine-2",
        "address": "127.0.0.1:8000",
        "engine": "vllm",
        "metrics_url": "http://127.0.0.1:8000/metrics",
    }
    # Envoy is given engines by IP (EDS carries no names): a name is resolved, an IPv6 address bracketed
    assert endpoint_from_url("http://localhost:8000", 0, "vllm")["address"] == "127.0.0.1:8000"
    assert endpoint_from_url("http://[::1]:8000", 0, "vllm")["address"] == "[::1]:8000"
    assert endpoint_from_url("http://[::1]:8000", 0, "vllm")["metrics_url"] == "http://[::1]:8000/metrics"
    with pytest.raises(ConfigError, match=r"cannot resolve 'no-such-host\.invalid'"):
        endpoint_from_url("http://no-such-host.invalid:8000", 0, "vllm")
    for url in ("http://127.0.0.1/v1", "http://127.0.0.1:99999", "127.0.0.1:http"):
        with pytest.raises(ConfigError, match="--endpoint needs http://host:port"):
            endpoint_from_url(url, 0, "vllm")


class Engine(http.server.ThreadingHTTPServer):
    """Answers GET /v1/models with ``status`` and ``body``."""

    def __init__(self) -> None:
        self.status, self.body = 200, b""
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(engine.status if self.path == "/v1/models" else 404)
                self.send_header("content-length", str(len(engine.body)))
                self.end_headers()
                self.wfile.write(engine.body)

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture(scope="module")
def running_engine() -> Iterator[Engine]:
    server = Engine()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def engine(running_engine: Engine) -> Engine:
    running_engine.status, running_engine.body = 200, b""
    return running_engine


def test_served_models_are_the_engines_list(engine: Engine) -> None:
    engine.body = json.dumps({"object": "list", "data": [{"id": "org/a"}, {"id": "b"}]}).encode()
    assert served_models(engine.url) == ["org/a", "b"]
    assert served_models(f"{engine.url}/v1") == ["org/a", "b"]


@pytest.mark.parametrize(
    ("status", "body", "reason"),
    [
        (404, b"{}", "answered 404"),
        (200, b"<html>", "is not an OpenAI model list"),
        (200, b'{"data": []}', "lists no model by name"),
        (200, b'{"data": [{"id": 3}]}', "lists no model by name"),
    ],
)
def test_served_models_refuses_what_is_not_a_model_list(
    engine: Engine, status: int, body: bytes, reason: str
) -> None:
    engine.status, engine.body = status, body
    with pytest.raises(ConfigError, match=reason) as info:
        served_models(engine.url)
    assert "--model" in str(info.value)


def test_served_models_of_an_engine_that_does_not_answer() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ConfigError, match=rf"no answer to GET http://127\.0\.0\.1:{port}/v1/models"):
        served_models(f"http://127.0.0.1:{port}", timeout_s=1.0)
