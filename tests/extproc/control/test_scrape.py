"""extproc.control.scrape: health from scrapes of engines on 127.0.0.1 that answer, refuse, hang, pause
and come back on the same port."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import web

from certs.store import LeafFiles
from contracts.events import EndpointId
from engines.endpoint import Endpoint
from extproc.control.scrape import Scraper
from extproc.fleet import EndpointState, Fleet
from load.sim.server import SimFleet, server_tls
from runtime.tls import ReloadingClientCerts, client_tls
from tests.extproc.migration.test_identity import copy_of, rotate, sim_config
from tests.extproc.migration.test_report import certs  # noqa: F401 (fixture)
from tests.polling import until

METRICS = "vllm:num_requests_waiting 2\nvllm:num_requests_running 3\nvllm:kv_cache_usage_perc 0.5\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Engine:
    """An engine's ``/metrics`` (vLLM names) on 127.0.0.1: counts scrapes; while :attr:`running` is
    clear it holds every answer back (a stopped process), and answers them once it is set again."""

    def __init__(self, port: int = 0) -> None:
        self.port = port
        self.hits = 0
        self.running = asyncio.Event()
        self.running.set()
        self._runner: web.AppRunner | None = None

    async def _metrics(self, request: web.Request) -> web.Response:
        self.hits += 1
        await self.running.wait()
        return web.Response(text=METRICS)

    async def start(self) -> Engine:
        app = web.Application()
        app.add_routes([web.get("/metrics", self._metrics)])
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        server = site._server
        assert server is not None
        self.port = int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
        return self

    async def aclose(self) -> None:
        """Stop listening, as a killed process does (connections to the port are refused after)."""
        self.running.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


class Hung:
    """Accepts connections and never answers (a process stopped for good: the kernel still accepts)."""

    def __init__(self) -> None:
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)

    async def start(self) -> Hung:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def aclose(self) -> None:
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


def endpoint(name: str, port: int) -> Endpoint:
    return Endpoint(
        EndpointId(name),
        f"127.0.0.1:{port}",
        frozenset({"m"}),
        metrics_url=f"http://127.0.0.1:{port}/metrics",
    )


def scraper(fleet: Fleet, *, interval_s: float = 0.05, timeout_s: float = 0.2) -> Scraper:
    return Scraper(
        fleet,
        interval_s=interval_s,
        timeout_s=timeout_s,
        stale_after_s=10.0,
        unhealthy_after=3,
        clock=time.monotonic,
    )


def state(fleet: Fleet, name: str) -> EndpointState:
    found = fleet.get(EndpointId(name))
    assert found is not None
    return found


@asynccontextmanager
async def scraped_once(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]], *, timeout_s: float = 0.2
) -> AsyncIterator[EndpointState]:
    """The state of an endpoint whose ``/metrics`` is ``handler``, after one scrape."""
    app = web.Application()
    app.add_routes([web.get("/metrics", handler)])
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    fleet = Fleet([endpoint("e", runner.addresses[0][1])])
    scrapes = scraper(fleet, timeout_s=timeout_s)
    try:
        await scrapes.scrape_once()
        yield state(fleet, "e")
    finally:
        await scrapes.aclose()
        await runner.cleanup()


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    running = await Engine().start()
    yield running
    await running.aclose()


@pytest.fixture
async def hung() -> AsyncIterator[Hung]:
    server = await Hung().start()
    yield server
    await server.aclose()


async def test_refused_connection_marks_the_endpoint_unhealthy_at_once(hung: Hung) -> None:
    """Nothing listens on the port (the engine was killed): one scrape says so. A scrape that times out
    (a stalled engine, or a slow one) counts towards ``unhealthy_after`` as before."""
    fleet = Fleet([endpoint("gone", free_port()), endpoint("slow", hung.port)])
    scrapes = scraper(fleet, timeout_s=0.1)
    try:
        await scrapes.scrape_once()
        assert not state(fleet, "gone").healthy
        assert state(fleet, "slow").healthy and state(fleet, "slow").consecutive_failures == 1
    finally:
        await scrapes.aclose()


async def test_a_hung_endpoint_delays_neither_the_others_scrapes_nor_their_health(
    engine: Engine, hung: Hung
) -> None:
    """With one endpoint hanging to the scrape timeout (2 s here), the other is still scraped every
    interval (50 ms), and marked unhealthy within a few intervals of being killed. (One round for all
    waited for the slowest: 1 scrape of the other per 2 s, and 3 rounds, 6 s, to notice the kill.)"""
    fleet = Fleet([endpoint("live", engine.port), endpoint("hung", hung.port)])
    scrapes = scraper(fleet, timeout_s=2.0)
    scrapes.start()
    try:
        await until(lambda: engine.hits >= 10, 1.5)
        assert state(fleet, "live").metrics is not None
        await engine.aclose()
        took = await until(lambda: not state(fleet, "live").healthy, 1.0)
        assert took < 0.5
    finally:
        await scrapes.aclose()


async def test_engine_restarted_on_the_same_port_is_healthy_after_one_scrape(engine: Engine) -> None:
    """SIGKILL and a restart on the same port: unhealthy at the first refused scrape, healthy at the first
    scrape of the new process (no pooled connection to the old one gets in the way)."""
    fleet = Fleet([endpoint("e", engine.port)])
    scrapes = scraper(fleet)
    again = Engine(engine.port)
    try:
        await scrapes.scrape_once()
        assert state(fleet, "e").healthy
        await engine.aclose()
        await scrapes.scrape_once()
        assert not state(fleet, "e").healthy
        state(fleet, "e").count_routed(0.0, 5.0)  # the dead process's share of recent requests
        await again.start()
        await scrapes.scrape_once()
        e = state(fleet, "e")
        assert e.healthy and e.metrics is not None and e.metrics.running == 3.0
        # A new process, empty cache: a new replica to the scheduler, as for an agent's restarted engine.
        assert e.recent_routed(0.0) == 0.0
    finally:
        await scrapes.aclose()
        await again.aclose()


async def test_stopped_then_continued_engine_is_healthy_again_within_one_interval(engine: Engine) -> None:
    """SIGSTOP (answers held back: every scrape times out) marks the endpoint unhealthy after
    ``unhealthy_after`` timeouts; SIGCONT (the held answer goes out) marks it healthy at once."""
    fleet = Fleet([endpoint("e", engine.port)])
    scrapes = scraper(fleet, timeout_s=0.1)
    scrapes.start()
    try:
        await until(lambda: state(fleet, "e").metrics is not None, 1.0)
        engine.running.clear()
        await until(lambda: not state(fleet, "e").healthy, 1.0)
        state(fleet, "e").count_routed(0.0, 5.0)
        engine.running.set()
        took = await until(lambda: state(fleet, "e").healthy, 1.0)
        assert took < 0.2
        assert state(fleet, "e").recent_routed(0.0) == 5.0  # the same process, its cache intact
    finally:
        await scrapes.aclose()


async def test_endpoints_joining_and_leaving_the_fleet_are_followed(engine: Engine) -> None:
    """A scrape loop starts for an endpoint that joins (etcd, a config reload) and stops for one that
    leaves; the others' go on."""
    other = await Engine().start()
    fleet = Fleet([endpoint("a", engine.port)])
    scrapes = scraper(fleet)
    scrapes.start()
    try:
        fleet.upsert(endpoint("b", other.port))
        await until(lambda: state(fleet, "b").metrics is not None, 1.0)
        fleet.remove(EndpointId("b"))
        left_at, hits = other.hits, engine.hits
        await until(lambda: engine.hits >= hits + 5, 1.0)
        assert other.hits <= left_at + 1  # at most the scrape under way when it left
    finally:
        await scrapes.aclose()
        await other.aclose()


async def test_a_rotated_scrape_certificate_is_presented_by_the_next_connection(
    certs: dict[str, LeafFiles],  # noqa: F811
    tmp_path: Path,
) -> None:
    """``[scrape]`` with a CA, a certificate and a key follows rotation (``ReloadingClientCerts``): rotated
    to an identity engines refuse (operator), the next scrape gets the simulator's 403; rotated back to
    one they take, the next scrape succeeds, without a restart."""
    mine = copy_of(certs["extproc"], tmp_path)
    tls = client_tls(mine, where="scrape")
    assert isinstance(tls, ReloadingClientCerts)
    engine = certs["engine"]
    async with SimFleet(sim_config(), 1, ssl_context=server_tls(engine.cert, engine.key, engine.ca)) as sims:
        (address,) = sims.addresses
        ep = Endpoint(EndpointId("e"), address, frozenset({"m"}), metrics_url=f"https://{address}/metrics")
        fleet = Fleet([ep])
        scrapes = Scraper(
            fleet,
            interval_s=1.0,
            timeout_s=10.0,
            stale_after_s=60.0,
            unhealthy_after=3,
            clock=time.monotonic,
            tls=tls,
        )
        try:
            await scrapes.scrape_once()
            assert state(fleet, "e").consecutive_failures == 0 and state(fleet, "e").metrics is not None
            rotate(mine, "operator")
            await scrapes.scrape_once()
            assert state(fleet, "e").consecutive_failures == 1 and tls.reloads == 1
            rotate(mine, "extproc-2")
            await scrapes.scrape_once()
            assert state(fleet, "e").consecutive_failures == 0 and tls.reloads == 2
        finally:
            await scrapes.aclose()


async def test_an_engines_redirect_is_not_followed_and_is_a_failed_scrape(engine: Engine) -> None:
    """The endpoint record names where its metrics are: an engine answering 307 to another host's
    metrics does not get them read (nor that host called, with the gateway's client certificate) as its
    own; the answer is a failed scrape, not an empty (idle-looking) reading."""

    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(f"http://127.0.0.1:{engine.port}/metrics")

    async with scraped_once(moved) as e:
        assert engine.hits == 0 and e.metrics is None and e.consecutive_failures == 1


async def test_metrics_with_a_byte_that_is_not_utf8_are_still_read() -> None:
    """A stray byte (a label value in another encoding) spoils its line, not the reading: no exception out
    of the scrape (it ended the endpoint's scrape loop, and ``scrape_once`` at start-up)."""

    async def metrics(request: web.Request) -> web.Response:
        body = b'vllm:num_requests_waiting{model_name="caf\xe9"} 2\n' + METRICS.encode()
        return web.Response(body=body, content_type="text/plain")

    async with scraped_once(metrics) as e:
        assert e.metrics is not None and (e.metrics.waiting, e.metrics.running) == (4.0, 3.0)


@pytest.mark.parametrize("chunked", [False, True])
async def test_an_answer_over_the_bound_is_a_failed_scrape_not_read_whole(chunked: bool) -> None:
    """``/metrics`` answers over :data:`MAX_METRICS_BYTES` (announced, or streamed without a length) are
    failed scrapes: the gateway never holds an engine's endless answer in memory."""
    from extproc.control.scrape import MAX_METRICS_BYTES

    async def metrics(request: web.Request) -> web.StreamResponse:
        line = b"# " + b"x" * 1022 + b"\n"
        n = MAX_METRICS_BYTES // len(line) + 2
        if not chunked:
            return web.Response(body=METRICS.encode() + line * n, content_type="text/plain")
        response = web.StreamResponse(headers={"content-type": "text/plain"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(METRICS.encode())
        for _ in range(n):
            await response.write(line)
        await response.write_eof()
        return response

    async with scraped_once(metrics, timeout_s=10.0) as e:
        assert e.metrics is None and e.consecutive_failures == 1
