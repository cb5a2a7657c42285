"""``kvgate status`` against small HTTP servers on 127.0.0.1 (the real gateway: tests/e2e/test_status.py):
where it looks, what it prints, and its exit status for answers that are not a status."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.control.policy import PolicyStore
from extproc.fleet import Fleet
from extproc.flow.control import FlowControl
from extproc.index.hybrid import HybridIndex
from extproc.status.snapshot import encode, snapshot
from kvgate.dev.stackfile import STATE_DIR_ENV
from kvgate.status_cli import document_url, main
from tests.extproc.status.test_snapshot import A, B

DOC = encode(snapshot(Fleet([A, B]), HybridIndex(), FlowControl[str](), PolicyStore(), [], 1.0, 1.7e9))


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://127.0.0.1:9090", "http://127.0.0.1:9090/status.json"),
        ("http://127.0.0.1:9090/", "http://127.0.0.1:9090/status.json"),
        ("http://127.0.0.1:9090/metrics", "http://127.0.0.1:9090/status.json"),
        ("http://127.0.0.1:9090/status", "http://127.0.0.1:9090/status.json"),
        ("https://gw.example:443/status.json", "https://gw.example:443/status.json"),
        ("http://[::1]:9090/admin/metrics?x=1", "http://[::1]:9090/admin/status.json"),
    ],
)
def test_document_url(url: str, expected: str) -> None:
    assert document_url(url) == expected


@pytest.mark.parametrize(
    "url",
    ["127.0.0.1:9090", "ftp://h:1", "http://:9090", "file:///etc/passwd", "http://h:abc", "http://h:99999"],
)
def test_document_url_refuses(url: str) -> None:
    with pytest.raises(ValueError, match="expected http://HOST:PORT"):
        document_url(url)


class Fixed(http.server.ThreadingHTTPServer):
    """Answers every GET with one status and body, and records the paths asked for."""

    def __init__(self, code: int, body: bytes) -> None:
        self.paths: list[str] = []
        fixed = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                fixed.paths.append(self.path)
                self.send_response(code)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def answer(request: pytest.FixtureRequest) -> Iterator[Fixed]:
    code, body = request.param
    server = Fixed(code, body)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("answer", [(200, DOC)], indirect=True)
def test_shows_the_status(answer: Fixed, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--url", answer.url + "/metrics"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"gateway {answer.url} at 2023-11-14 22:13:20 UTC: 2/2 endpoints ready")
    assert answer.paths == ["/status.json"]
    assert main(["--url", answer.url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(DOC)


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        ((503, b"status unavailable\n"), "HTTP 503"),
        ((200, b"<html>not json</html>"), "not a kvgate status document"),
        ((200, json.dumps({**json.loads(DOC), "schema": 2}).encode()), "schema 2"),
    ],
    indirect=["answer"],
)
def test_an_answer_that_is_not_a_status_is_exit_1(
    answer: Fixed, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--url", answer.url]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kvgate status: {answer.url}/status.json: ") and says in err


@pytest.mark.parametrize(
    ("argv", "code", "says"),
    [
        (["--url", "http://127.0.0.1:1"], 1, "unreachable"),
        (["--url", "ftp://127.0.0.1:1"], 2, "expected http://HOST:PORT"),
        (["--url", "http://127.0.0.1:abc"], 2, "expected http://HOST:PORT"),  # not InvalidURL's traceback
        (["--timeout", "0", "--url", "http://127.0.0.1:1"], 2, "--timeout"),
        # not a traceback from the socket (ValueError, OverflowError): bad usage, exit 2
        (["--timeout", "nan", "--url", "http://127.0.0.1:1"], 2, "--timeout must be > 0 and <= 3600"),
        (["--timeout", "inf", "--url", "http://127.0.0.1:1"], 2, "--timeout"),
        (["--timeout", "1e300", "--url", "http://127.0.0.1:1"], 2, "--timeout"),
    ],
)
def test_kvgate_status_exit_codes(
    argv: list[str], code: int, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == code
    assert says in capsys.readouterr().err


def test_kvgate_status_without_a_stack_is_bad_usage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path))
    assert main([]) == 2
    assert "no --url given and no running kvgate up found" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["--bogus"])
    assert exited.value.code == 2
