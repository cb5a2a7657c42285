"""The migration proxy: the one kvgate component in the token path, for opted-in models only.

Envoy sends an opted-in model's requests here (kvgate/envoy/migration.py) with two headers it writes
itself, after the ext_proc decided: :data:`UPSTREAMS_HEADER`, the decision's ordered list
``pick,fallback,...`` (from the ``envoy.lb`` metadata only the ext_proc writes; a client's copy is
stripped before any filter), and :data:`LIMIT_HEADER`, the model's ``migration_limit``. The proxy never
picks an engine: it walks that list, one host per try. It listens on loopback; only Envoy may reach it.

Per request (README.md has the rules): a streamed chat or completion is passed through
:class:`~extproc.migration.splice.Splicer`; when its engine dies (connection reset or refused, the
stream ending before ``[DONE]``, a 5xx), the next host of the list gets the continuation
(:mod:`extproc.migration.continuation`) and the client's stream goes on. A request that cannot be
continued (or a non-streamed one) is re-sent whole to the next host only while nothing reached the
client. At most ``migration_limit`` further tries per request.

Metrics on ``--metrics-listen``: ``kvgate_migrations_total{model,outcome}`` (a request that needed at
least one further try, by how it ended) and ``kvgate_migration_tries_total{model,kind}``.
Never logs bodies or header values.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import ssl
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvloop
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest

from contracts.epp import MIGRATE_UPSTREAMS_HEADER, MIGRATION_LIMIT_HEADER
from contracts.errors import ConfigError
from contracts.handoff import HANDOFF_FIELDS
from extproc.migration.continuation import (
    CHAT_PATH,
    continuation,
    migratable,
    stream_body,
    without_handoff,
)
from extproc.migration.report import CONNECT_FAILURE, REMOTE_RESET, FailureReports
from extproc.migration.splice import Splicer
from runtime.identity import ENGINE, check_server_role
from runtime.lifecycle import announce_ready, stop_on_signals
from runtime.listen import ListenError, binding
from runtime.tls import ClientTlsFiles, ReloadingClientCerts

log = logging.getLogger(__name__)

UPSTREAMS_HEADER = MIGRATE_UPSTREAMS_HEADER
LIMIT_HEADER = MIGRATION_LIMIT_HEADER
DEFAULT_LIMIT = 3

#: Not forwarded to an engine: hop-by-hop headers, the body's length (recomputed) and the proxy's own.
_DROPPED = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "upgrade",
        "host",
        "content-length",
        "proxy-connection",
        "trailer",
        UPSTREAMS_HEADER,
        LIMIT_HEADER,
    }
)
#: Errors of a try (the engine's side): the next host gets the request.
_TRY_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


class _ClientGone(Exception):
    """The client (Envoy's downstream) went away: nothing more to do."""


class _TryFailed(Exception):
    """One try failed on the engine's side (its reason: a metric label and a log word; ``status``: the
    engine's 5xx, if that was it)."""

    def __init__(self, reason: str, status: int | None = None) -> None:
        super().__init__(reason)
        self.status = status


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.migrations = Counter(
            "kvgate_migrations",
            "Requests that needed a further try (their engine failed), by how they ended: resumed "
            "(a stream continued on another replica), reissued (sent whole again before any byte reached "
            "the client), closed (the length limit was reached at the seam), lost.",
            ["model", "outcome"],
            registry=self.registry,
        )
        self.tries = Counter(
            "kvgate_migration_tries",
            "Further tries sent: continuation (a stream's partial answer continued) or whole.",
            ["model", "kind"],
            registry=self.registry,
        )


class MigrationProxy:
    """The aiohttp shell around the sans-IO core (module docstring)."""

    def __init__(
        self,
        connect_timeout_s: float = 2.0,
        reports: FailureReports | None = None,
        tls: ReloadingClientCerts | None = None,
    ) -> None:
        self.metrics = Metrics()
        #: Where failed tries are reported (every ext_proc; :mod:`extproc.migration.report`).
        self.reports = reports or FailureReports(())
        #: The engines speak HTTPS (mTLS, the secure profile) when set: its current context (re-read on
        #: rotation, per request) verifies them, their role included (:func:`engine_tls`), and presents
        #: the proxy's client certificate.
        self._tls = tls
        self._scheme = "https" if tls is not None else "http"
        self._connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._runners: list[web.AppRunner] = []
        self.ports: dict[str, int] = {}

    async def start(self, listen: tuple[str, int], metrics: tuple[str, int] | None) -> None:
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.ports["proxy"] = await self._serve(app, listen)
        if metrics is not None:
            mapp = web.Application()
            mapp.router.add_get("/metrics", self._metrics)
            self.ports["metrics"] = await self._serve(mapp, metrics)

    async def _serve(self, app: web.Application, where: tuple[str, int]) -> int:
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        self._runners.append(runner)  # cleaned up by aclose, also when the bind fails
        site = web.TCPSite(runner, where[0], where[1])
        with binding(f"{where[0]}:{where[1]}"):
            await site.start()
        server = site._server
        assert server is not None and server.sockets  # type: ignore[attr-defined]
        port: int = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        return port

    async def aclose(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        if self._session is not None:
            await self._session.close()
        await self.reports.aclose()

    def _report(self, host: str, failure: BaseException) -> None:
        """Tell the ext_procs of one failed try to ``host``, as Envoy's upstream log would."""
        if isinstance(failure, _TryFailed):
            if failure.status is not None:
                self.reports.failed(host, status=failure.status)
            else:
                self.reports.failed(host, REMOTE_RESET)
        elif isinstance(failure, aiohttp.ClientConnectorError | asyncio.TimeoutError):
            self.reports.failed(host, CONNECT_FAILURE)
        else:
            self.reports.failed(host, REMOTE_RESET)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), content_type="text/plain")

    # -- one request ------------------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        hosts = [h.strip() for h in request.headers.get(UPSTREAMS_HEADER, "").split(",") if h.strip()]
        if not hosts:
            return _error(503, "no_endpoint", "The gateway decided no engine for this request.")
        try:
            limit = max(0, int(request.headers.get(LIMIT_HEADER, DEFAULT_LIMIT)))
        except ValueError:
            limit = DEFAULT_LIMIT
        hosts = hosts[: limit + 1]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED}
        raw = await request.read()
        try:
            body = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            body = None
        path = request.rel_url.raw_path_qs
        model = str(body.get("model", "")) if isinstance(body, dict) else ""
        if isinstance(body, dict) and body.get("stream") is True:
            return await self._stream(request, hosts, headers, request.path, path, body, model)
        again = raw  # what a re-issue sends: no handoff fields (they paired the first try's host)
        if isinstance(body, dict) and not HANDOFF_FIELDS.isdisjoint(body):
            again = orjson.dumps(without_handoff(body))
        return await self._whole(request, hosts, headers, path, raw, again, model)

    async def _whole(
        self,
        request: web.Request,
        hosts: list[str],
        headers: dict[str, str],
        path: str,
        raw: bytes,
        again: bytes,
        model: str,
    ) -> web.StreamResponse:
        """A non-streamed request: re-sent whole to the next host while tries fail (nothing was sent);
        ``raw`` the first try's body, ``again`` the later tries'."""
        assert self._session is not None
        last: tuple[int, bytes, str] | None = None
        for n, host in enumerate(hosts):
            if n:
                self.metrics.tries.labels(model, "whole").inc()
            try:
                async with self._session.request(
                    request.method,
                    f"{self._scheme}://{host}{path}",
                    data=again if n else raw,
                    headers=headers,
                    timeout=self._timeout(),
                    ssl=self._ssl(),
                    allow_redirects=False,  # Envoy's header names the hosts, never an engine's answer
                ) as up:
                    data = await up.read()
                    last = (up.status, data, up.headers.get("content-type", "application/json"))
                    if up.status < 500:
                        break
                    log.info("try %d at %s: HTTP %d", n, host, up.status)
                    self._report(host, _TryFailed("5xx", up.status))
            except _TRY_ERRORS as exc:
                log.info("try %d at %s failed: %s", n, host, _why(exc))
                self._report(host, exc)
                last = None
        else:
            n = len(hosts)
        if n:
            self.metrics.migrations.labels(model, "reissued" if n < len(hosts) else "lost").inc()
        if last is None:
            return _error(503, "engine_unreachable", "No engine could serve this request.")
        status, data, content_type = last
        return web.Response(status=status, body=data, headers={"content-type": content_type})

    async def _stream(
        self,
        request: web.Request,
        hosts: list[str],
        headers: dict[str, str],
        route: str,
        path: str,
        body: dict[str, Any],
        model: str,
    ) -> web.StreamResponse:
        assert self._session is not None
        reason = migratable(route, body)
        options = body.get("stream_options")
        options = options if isinstance(options, dict) else {}
        splicer = Splicer(
            chat=route == CHAT_PATH,
            include_usage=options.get("include_usage") is True,
            continuous_usage=options.get("continuous_usage_stats") is True,
        )
        sent = orjson.dumps(stream_body(body)) if reason is None else orjson.dumps(body)
        response: web.StreamResponse | None = None
        raw_sent = False  # a request passed through unspliced: did any byte reach the client?
        outcome = "resumed"
        for n, host in enumerate(hosts):
            try:
                async with self._session.post(
                    f"{self._scheme}://{host}{path}",
                    data=sent,
                    headers=headers,
                    timeout=self._timeout(),
                    ssl=self._ssl(),
                    allow_redirects=False,  # Envoy's header names the hosts, never an engine's answer
                ) as up:
                    if up.status >= 500:
                        raise _TryFailed(f"HTTP {up.status}", up.status)
                    if up.status != 200:
                        data = await up.read()
                        if response is None:
                            ctype = up.headers.get("content-type", "application/json")
                            return web.Response(status=up.status, body=data, headers={"content-type": ctype})
                        await _write(
                            response, splicer.error(f"the continuation was refused (HTTP {up.status})")
                        )
                        outcome = "lost"
                        break
                    if response is None:
                        response = web.StreamResponse(
                            headers={
                                "content-type": up.headers.get("content-type", "text/event-stream"),
                                "cache-control": "no-cache",
                            }
                        )
                        await response.prepare(request)
                    async for data in up.content.iter_any():
                        out = splicer.feed(data) if reason is None else data
                        if out:
                            raw_sent = True
                            await _write(response, out)
                    if reason is not None or splicer.done:
                        break
                    raise _TryFailed("the stream ended before [DONE]")
            except _ClientGone:
                outcome = "client_gone"
                break
            except (_TryFailed, *_TRY_ERRORS) as exc:
                self._report(host, exc)
                log.info("try %d at %s failed: %s", n, host, _why(exc))
            # This try failed: what the next one sends.
            if n + 1 >= len(hosts):
                outcome = "lost"
                break
            if reason is None and splicer.sent_any:
                if splicer.finish_reason is not None:
                    await _write_quiet(response, splicer.closing())
                    outcome = "closed"
                    break
                cont = continuation(route, body, splicer.text, splicer.produced)
                if cont is None:
                    await _write_quiet(response, splicer.closing())
                    outcome = "closed"
                    break
                sent = orjson.dumps(cont)
                splicer.next_try()
                self.metrics.tries.labels(model, "continuation").inc()
            elif reason is not None and raw_sent:
                outcome = "lost"  # not continuable, and the client already has part of it
                break
            else:
                outcome = "reissued"
                self.metrics.tries.labels(model, "whole").inc()
                if not HANDOFF_FIELDS.isdisjoint(body):  # they paired the first try's host only
                    again = without_handoff(body)
                    sent = orjson.dumps(stream_body(again) if reason is None else again)
        else:
            outcome = "lost"
        if n or outcome in ("lost", "closed"):
            self.metrics.migrations.labels(model, outcome).inc()
        if outcome == "lost":
            if response is None:
                return _error(503, "engine_unreachable", "No engine could serve this request.")
            if reason is None and not splicer.done:
                await _write_quiet(
                    response, splicer.error("the engine failed and the request could not migrate")
                )
            elif request.transport is not None:
                request.transport.abort()  # cut, as the engine's own stream was: Envoy resets the client's
                return response
        if response is None:  # the client left before any answer
            return web.Response(status=499)
        if outcome != "client_gone":
            with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError):
                await response.write_eof()
        return response

    def _ssl(self) -> ssl.SSLContext | bool:
        """The context of a try's connection: the current one, so a rotated certificate is used by new
        connections (aiohttp pools connections per context) while pooled ones finish with the old."""
        return True if self._tls is None else self._tls.context()

    def _timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=None, connect=self._connect_timeout_s)


async def _write(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except (ConnectionError, aiohttp.ClientConnectionResetError) as exc:
        raise _ClientGone from exc


async def _write_quiet(response: web.StreamResponse | None, data: bytes) -> None:
    if response is None:
        return
    with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError):
        await response.write(data)


def _why(exc: BaseException) -> str:
    """A failed try's reason for the log: the exception's kind, and a certificate refusal's own words
    (the chain's verifier or the role check name no request data)."""
    if isinstance(exc, _TryFailed):
        return str(exc)
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return f"certificate refused: {exc.certificate_error}"
    return type(exc).__name__


def engine_tls(files: ClientTlsFiles) -> ReloadingClientCerts:
    """The proxy's client TLS towards engines and ext_procs: ``files`` re-read on rotation, and an
    engine's certificate must name the engine role (:data:`certs.roles.SERVERS`) besides chaining to the
    CA and matching the address; :class:`ConfigError` if the files are unusable."""
    return ReloadingClientCerts(files, where="migration", prepare=lambda c: check_server_role(c, ENGINE))


def _error(status: int, code: str, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "service_unavailable", "param": None, "code": code}}
    return web.Response(status=status, body=orjson.dumps(body), headers={"content-type": "application/json"})


def _hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host or "127.0.0.1", int(port)


async def serve(
    listen: str,
    metrics: str | None,
    ready_file: Path | None,
    failure_log: Sequence[str] = (),
    tls: ClientTlsFiles | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT; with ``tls`` the engines and the ext_procs' access-log services are
    called over mTLS with that client identity, re-read on rotation, and an engine must present the
    engine role (:func:`engine_tls`; :class:`ConfigError` if the files are unusable)."""
    if tls is None:
        proxy = MigrationProxy(reports=FailureReports(failure_log))
    else:
        certs = engine_tls(tls)
        proxy = MigrationProxy(reports=FailureReports(failure_log, certs), tls=certs)
    try:
        await proxy.start(_hostport(listen), _hostport(metrics) if metrics else None)
    except ListenError:  # the listener bound before it, and the client session, close
        await proxy.aclose()
        raise
    stop = asyncio.Event()
    stop_on_signals(stop)
    announce_ready(ready_file, {**proxy.ports, "pid": os.getpid()})
    log.info("migration proxy on %s", proxy.ports)
    try:
        await stop.wait()
    finally:
        await proxy.aclose()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m extproc.migration.proxy", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--listen", default="127.0.0.1:9010", help="host:port Envoy sends opted-in models to")
    parser.add_argument("--metrics-listen", default=None, help="host:port of /metrics (Prometheus)")
    parser.add_argument("--ready-file", type=Path, help="write the bound ports here (JSON) once serving")
    parser.add_argument(
        "--failure-log",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="an ext_proc's gRPC port, told of each failed try (repeat for every ext_proc; report.py)",
    )
    parser.add_argument("--tls-ca", type=Path, help="CA bundle (PEM) engines' and ext_procs' certs chain to")
    parser.add_argument("--tls-cert", type=Path, help="the proxy's client certificate (PEM), for mTLS")
    parser.add_argument("--tls-key", type=Path, help="its private key (PEM)")
    args = parser.parse_args(argv)
    given = (args.tls_ca, args.tls_cert, args.tls_key)
    if any(given) and not all(given):
        parser.error("--tls-ca, --tls-cert and --tls-key go together")
    tls = ClientTlsFiles(args.tls_ca, args.tls_cert, args.tls_key) if all(given) else None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return uvloop.run(serve(args.listen, args.metrics_listen, args.ready_file, args.failure_log, tls))
    except ConfigError as exc:
        print(f"migration proxy: {exc}", file=sys.stderr)
        return 2
    except ListenError as exc:  # a listen address taken, not this host's, or privileged
        print(f"migration proxy: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
