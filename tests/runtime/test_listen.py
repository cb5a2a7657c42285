"""runtime.listen: a listen address that cannot be bound is one line from every daemon, never a stack
trace. The helpers give the OS's reason (grpc's ``RuntimeError`` has none: a second bind finds it); each
daemon's ``main`` (extproc, agent, kvcached, the migration proxy) with one listen address on a port a
test socket holds prints ``<daemon>: cannot listen on ADDRESS: address already in use`` to stderr,
exits 1, and leaves nothing half-started (the listeners bound before it closed, a Unix socket file
removed)."""

from __future__ import annotations

import asyncio
import datetime as dt
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from agent.main import main as agent_main
from certs.store import dev_bundle
from extproc.migration.proxy import main as proxy_main
from extproc.server import main as extproc_main
from kvcached.main import main as kvcached_main
from runtime.listen import ListenError, add_grpc_port, binding

IN_USE = "address already in use"


@pytest.fixture
def taken() -> Iterator[str]:
    """``127.0.0.1:PORT`` of a port a listening test socket holds."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def bindable(address: str) -> bool:
    host, _, port = address.rpartition(":")
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, int(port)))
        except OSError:
            return False
    return True


def one_line(capsys: pytest.CaptureFixture[str], run: Callable[[], int], prefix: str, address: str) -> None:
    """``run()`` exits 1 with ``PREFIX: cannot listen on ADDRESS: address already in use``, no traceback."""
    assert run() == 1
    err = capsys.readouterr().err
    assert f"{prefix}: cannot listen on {address}: {IN_USE}\n" in err
    assert "Traceback" not in err


# -- the helpers ---------------------------------------------------------------------------------------


def test_grpc_port_taken_names_the_address_and_the_reason(taken: str) -> None:
    async def go() -> None:
        server = grpc.aio.server()
        with pytest.raises(ListenError) as err:
            add_grpc_port(server, taken)
        assert str(err.value) == f"cannot listen on {taken}: {IN_USE}"
        assert add_grpc_port(server, "127.0.0.1:0") > 0

    asyncio.run(go())


def test_grpc_port_that_returns_0_is_a_listen_error() -> None:
    class OldGrpc:  # older grpc returned 0 on a failed bind instead of raising
        def add_insecure_port(self, address: str) -> int:
            return 0

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        with pytest.raises(ListenError, match=f"cannot listen on {address}: {IN_USE}"):
            add_grpc_port(OldGrpc(), address)


def test_grpc_unix_socket_in_a_missing_directory(tmp_path: Path) -> None:
    address = f"unix:{tmp_path / 'missing' / 'x.sock'}"

    async def go() -> None:
        with pytest.raises(ListenError, match="no such file or directory"):
            add_grpc_port(grpc.aio.server(), address)

    asyncio.run(go())


def test_binding_keeps_the_os_reason_not_asyncios_repeat_of_the_address(taken: str) -> None:
    host, _, port = taken.rpartition(":")

    async def go() -> None:
        with pytest.raises(ListenError) as err, binding(taken):
            await asyncio.start_server(lambda r, w: None, host, int(port))
        assert str(err.value) == f"cannot listen on {taken}: {IN_USE}"

    asyncio.run(go())


# -- each daemon's main --------------------------------------------------------------------------------


def _extproc_config(tmp_path: Path, listen: str, health: str, metrics: str) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(
        f'[extproc]\nlisten = "{listen}"\nhealth_listen = "{health}"\nmetrics_listen = "{metrics}"\n'
    )
    return path


@pytest.mark.parametrize("which", ["listen", "health", "metrics"])
def test_extproc_listen_taken(
    which: str, taken: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    others = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    addresses = dict(zip([w for w in ("listen", "health", "metrics") if w != which], others, strict=True))
    addresses[which] = taken
    config = _extproc_config(tmp_path, addresses["listen"], addresses["health"], addresses["metrics"])
    one_line(capsys, lambda: extproc_main(["--config", str(config)]), "kvgate extproc", taken)
    if which == "metrics":  # the gRPC servers (started by then) are stopped: their ports are free again
        assert all(bindable(a) for a in others)


def _agent_config(tmp_path: Path, listen: str, admin: str) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(
        f'[agent]\nid = "node-a"\nlisten = "{listen}"\nadmin_listen = "{admin}"\n'
        f'state_dir = "{tmp_path / "state"}"\n'
        '[[engines]]\nkind = "llama_cpp"\nmodel = "m"\nmodel_path = "smollm2"\n'  # never started
    )
    return path


@pytest.mark.parametrize("which", ["listen", "admin_listen"])
def test_agent_listen_taken(
    which: str, taken: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = f"127.0.0.1:{free_port()}"
    listen, admin = (taken, other) if which == "listen" else (other, taken)
    config = _agent_config(tmp_path, listen, admin)
    one_line(capsys, lambda: agent_main(["--config", str(config)]), "kvgate agent", taken)
    assert bindable(other)


def _kvcached_config(tmp_path: Path, feed: str, metrics: str) -> Path:
    path = tmp_path / "kvcached.toml"
    path.write_text(
        f'[kvcached]\nnode = "node-a"\nlisten_unix = "{tmp_path / "kv.sock"}"\nfeed_listen = "{feed}"\n'
        f'metrics_listen = "{metrics}"\nram_bytes = 1048576\n'
    )
    return path


@pytest.mark.parametrize("which", ["feed_listen", "metrics_listen"])
def test_kvcached_listen_taken(
    which: str, taken: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = f"127.0.0.1:{free_port()}"
    feed, metrics = (taken, other) if which == "feed_listen" else (other, taken)
    config = _kvcached_config(tmp_path, feed, metrics)
    one_line(capsys, lambda: kvcached_main(["--config", str(config)]), "kvgate kvcached", taken)
    assert bindable(other)
    assert not (tmp_path / "kv.sock").exists()  # the API's socket, bound before metrics, is gone


@pytest.mark.parametrize("which", ["--listen", "--metrics-listen"])
def test_migration_proxy_listen_taken(which: str, taken: str, capsys: pytest.CaptureFixture[str]) -> None:
    other = f"127.0.0.1:{free_port()}"
    listen, metrics = (taken, other) if which == "--listen" else (other, taken)
    run = lambda: proxy_main(["--listen", listen, "--metrics-listen", metrics])  # noqa: E731
    one_line(capsys, run, "migration proxy", taken)
    assert bindable(other)


@pytest.mark.filterwarnings("ignore::ResourceWarning")  # uvloop leaves its UDP transport unclosed
def test_kvcached_quic_port_taken(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    leaf = dev_bundle(tmp_path / "certs", ["kvcached-a"], dt.datetime.now(dt.UTC))["kvcached-a"]
    feed = f"127.0.0.1:{free_port()}"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.bind(("127.0.0.1", 0))
        quic = f"127.0.0.1:{udp.getsockname()[1]}"
        config = _kvcached_config(tmp_path, feed, f"127.0.0.1:{free_port()}")
        config.write_text(
            config.read_text()
            + f'[kvcached.tls]\ncert = "{leaf.cert}"\nkey = "{leaf.key}"\nca = "{leaf.ca}"\n'
            + f'[quic]\nlisten = "{quic}"\n'
        )
        one_line(capsys, lambda: kvcached_main(["--config", str(config)]), "kvgate kvcached", quic)
    assert bindable(feed)  # the feed, bound before QUIC, is closed


def test_kvcached_unix_socket_in_a_missing_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sock = tmp_path / "missing" / "kv.sock"
    config = _kvcached_config(tmp_path, f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}")
    config.write_text(config.read_text().replace(str(tmp_path / "kv.sock"), str(sock)))
    assert kvcached_main(["--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert f"kvgate kvcached: cannot listen on unix:{sock}: no such file or directory\n" in err
    assert "Traceback" not in err


def test_extproc_federation_listen_taken(
    taken: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    others = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    config = _extproc_config(tmp_path, *others)
    config.write_text(config.read_text() + f'[federation]\ncluster = "east"\nlisten = "{taken}"\n')
    one_line(capsys, lambda: extproc_main(["--config", str(config)]), "kvgate extproc", taken)
    assert all(bindable(a) for a in others)  # the ext_proc, health and metrics ports, started, are closed
