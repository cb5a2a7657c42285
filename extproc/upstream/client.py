"""One HTTP client for the gateway's own requests to engines (prefill sub-requests and cascade steps
today; burst and migration are meant to use it too).

:class:`UpstreamClient` posts a JSON body to ``scheme://address/path`` and returns the whole answer, or
raises an :class:`~extproc.upstream.errors.UpstreamError`. One aiohttp session (connection pool) per
client, made on first use on the running loop and closed by :meth:`aclose`; every call has its own total
timeout; with an ``ssl.SSLContext`` it speaks HTTPS (the scraper's engine-side client certificate gives
mTLS; a :class:`~runtime.tls.ReloadingClientCerts` is asked per request, so a rotated certificate
reaches the next new connection). It never follows a redirect: an engine's answer does not choose
another upstream (a 3xx is an :class:`~extproc.upstream.errors.UpstreamStatus`). It never logs a body, a
header value or a URL query: only the address, the path, the status and the time.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError

from extproc.upstream.errors import Unreachable, UpstreamError, UpstreamStatus, UpstreamTimeout
from extproc.upstream.request import SubRequest
from runtime.tls import ClientTls, current_context

log = logging.getLogger(__name__)

#: Bytes of an answer read at most (a prefill answer is one token and a few hundred bytes of params).
MAX_ANSWER_BYTES = 4 * 1024 * 1024
#: What reading an answer can raise besides a timeout: aiohttp's client errors (a connection that broke,
#: a payload cut short or badly chunked: ``ClientPayloadError``), its HTTP parser's (``LineTooLong``, a
#: malformed header: not ``ClientError``s), the OS's. Each becomes :class:`Unreachable`.
_READ_ERRORS = (aiohttp.ClientError, HttpProcessingError, OSError)


@dataclass(frozen=True, slots=True)
class Answer:
    """An engine's 2xx answer: its status and whole body."""

    status: int
    body: bytes


class UpstreamClient:
    """Posts JSON to engines (module docstring). ``tls``: the client context for ``https`` (``None``:
    plain ``http``); ``connect_timeout_s`` bounds the connection alone."""

    def __init__(self, tls: ClientTls | None = None, connect_timeout_s: float = 2.0) -> None:
        self._tls = tls
        self._connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None

    @property
    def scheme(self) -> str:
        return "https" if self._tls is not None else "http"

    def _ssl(self) -> ssl.SSLContext | bool:
        """The context for the next connection (the current certificate where it follows rotation)."""
        return False if self._tls is None else current_context(self._tls)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No pool cap (aiohttp's default is 100): the requests held by the gateway bound the calls.
            connector = aiohttp.TCPConnector(ssl=False, limit=0)
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=True)
        return self._session

    async def post_json(
        self,
        address: str,
        path: str,
        body: bytes,
        *,
        timeout_s: float,
        headers: Mapping[str, str] | None = None,
    ) -> Answer:
        """POST ``body`` (JSON) to the engine at ``address`` (``ip:port``); the 2xx answer, else
        :class:`UpstreamStatus`, :class:`UpstreamTimeout` past ``timeout_s`` seconds in all, or
        :class:`Unreachable`."""
        url = f"{self.scheme}://{address}{path}"
        timeout = aiohttp.ClientTimeout(total=timeout_s, connect=min(timeout_s, self._connect_timeout_s))
        sent = {"content-type": "application/json", **(headers or {})}
        started = time.monotonic()
        try:
            async with self._client().post(
                url, data=body, headers=sent, timeout=timeout, ssl=self._ssl(), allow_redirects=False
            ) as response:
                data = await _read_whole(response.content, f"{address}{path}")
                status = response.status
        except TimeoutError as exc:
            raise UpstreamTimeout(f"no answer from {address}{path} within {timeout_s:g} s") from exc
        except _READ_ERRORS as exc:
            raise Unreachable(f"{address}{path}: {type(exc).__name__}") from exc
        log.debug("POST %s%s: %d in %.3f s", address, path, status, time.monotonic() - started)
        if not 200 <= status < 300:
            raise UpstreamStatus(status)
        return Answer(status, data)

    async def post_stream(
        self,
        address: str,
        path: str,
        body: bytes,
        on_line: Callable[[bytes], bool],
        *,
        timeout_s: float,
        headers: Mapping[str, str] | None = None,
    ) -> int:
        """POST ``body`` and hand each line of a 2xx answer (an SSE stream) to ``on_line`` as it arrives,
        until the answer ends or ``on_line`` returns false: the connection is then closed, which an
        engine takes as the client going away (vLLM and the simulator abort the request). A line is
        whatever comes up to a newline (its newline kept; the last one may have none) however long: only
        the answer as a whole is bounded (:data:`MAX_ANSWER_BYTES`; aiohttp's own line reader stops at 512
        KiB). Returns the status; errors as :meth:`post_json` (past ``timeout_s`` in all, or
        :data:`MAX_ANSWER_BYTES` read: :class:`UpstreamTimeout` / :class:`UpstreamError`)."""
        url = f"{self.scheme}://{address}{path}"
        timeout = aiohttp.ClientTimeout(total=timeout_s, connect=min(timeout_s, self._connect_timeout_s))
        sent = {"content-type": "application/json", **(headers or {})}
        started = time.monotonic()
        cut = False
        try:
            async with self._client().post(
                url, data=body, headers=sent, timeout=timeout, ssl=self._ssl(), allow_redirects=False
            ) as response:
                status = response.status
                if 200 <= status < 300:
                    cut = not await _hand_lines(response.content, on_line, f"{address}{path}")
                    if cut:
                        response.close()  # do not wait for (or pool) the rest
        except TimeoutError as exc:
            raise UpstreamTimeout(f"no complete answer from {address}{path} within {timeout_s:g} s") from exc
        except _READ_ERRORS as exc:
            raise Unreachable(f"{address}{path}: {type(exc).__name__}") from exc
        log.debug(
            "POST %s%s (stream): %d in %.3f s%s",
            address,
            path,
            status,
            time.monotonic() - started,
            ", cut short" if cut else "",
        )
        if not 200 <= status < 300:
            raise UpstreamStatus(status)
        return status

    async def send(self, sub: SubRequest) -> Answer:
        """:meth:`post_json` for a :class:`~extproc.upstream.request.SubRequest`."""
        return await self.post_json(
            sub.address, sub.path, sub.body, timeout_s=sub.timeout_s, headers=sub.headers
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _read_whole(content: aiohttp.StreamReader, where: str) -> bytes:
    """The answer to its end (``read(n)`` alone returns whatever is buffered: a part of an answer that
    arrives in pieces). Past :data:`MAX_ANSWER_BYTES`: :class:`UpstreamError`."""
    data = bytearray()
    async for piece in content.iter_any():
        data += piece
        if len(data) > MAX_ANSWER_BYTES:
            raise UpstreamError(f"{where}: answer over {MAX_ANSWER_BYTES} bytes")
    return bytes(data)


async def _hand_lines(content: aiohttp.StreamReader, on_line: Callable[[bytes], bool], where: str) -> bool:
    """Hand each line of ``content`` to ``on_line`` (:meth:`UpstreamClient.post_stream`); false: it said
    stop. Past :data:`MAX_ANSWER_BYTES` read: :class:`UpstreamError`."""
    read = 0
    pending = bytearray()  # the line so far (a long one comes in many reads)
    async for data in content.iter_any():
        read += len(data)
        if read > MAX_ANSWER_BYTES:
            raise UpstreamError(f"{where}: answer over {MAX_ANSWER_BYTES} bytes")
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            pending += data[start : end + 1]
            line = bytes(pending)
            pending.clear()
            start = end + 1
            if not on_line(line):
                return False
        pending += data[start:]
    return not pending or on_line(bytes(pending))


__all__ = ["Answer", "UpstreamClient", "UpstreamError"]
