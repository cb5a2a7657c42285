"""What ``kvgate up`` checks and asks before it starts a child: its listener port, the engines it fronts.

:func:`check_port_free` binds the OpenAI listener's address the way Envoy will (``SO_REUSEADDR``) but
without ``SO_REUSEPORT``, so a listener that has ``SO_REUSEPORT`` (another ``kvgate up``'s Envoy) is found
as well as any other server. :func:`served_models` asks an engine that already runs which models it
serves (``GET /v1/models``, the OpenAI list). Both fail with a :class:`~contracts.errors.ConfigError`
worded for the user.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import socket
from urllib.parse import urlsplit

from contracts.errors import ConfigError
from kvgate.dev.procs import http_get

#: How long an engine behind ``--endpoint`` has to answer ``GET /v1/models`` (s).
MODELS_TIMEOUT_S = 5.0


class PortInUse(ConfigError):
    """The OpenAI listener's ``host:port`` is taken."""


def check_port_free(host: str, port: int) -> None:
    """:class:`PortInUse` unless a listener can bind ``host:port`` now (:class:`ConfigError` for any
    other reason it cannot, such as an address that is not this machine's)."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        family = socket.AF_INET  # a name: bind resolves it
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers do not count
        try:
            sock.bind((host, port))
            sock.listen(1)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(
                    f"{host}:{port} is already in use (another kvgate up, or another server): "
                    "choose another --port, or --port 0 for any free port"
                ) from exc
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc


def endpoint_from_url(url: str, i: int, engine: str) -> dict[str, str]:
    """The ``[[endpoints]]`` table (id ``engine-<i>``) of an engine at ``http://host:port``."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    try:
        port = parts.port  # ValueError: not a number, or out of range
    except ValueError:
        port = None
    if not parts.hostname or not port:
        raise ConfigError(f"--endpoint needs http://host:port, got {url!r}")
    ip = _ip_of(parts.hostname, url)
    address = f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
    return {
        "id": f"engine-{i}",
        "address": address,
        "engine": engine,
        "metrics_url": f"http://{address}/metrics",
    }


def _ip_of(host: str, url: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``host`` as an IP address, a name resolved now (its first address, IPv4 first): the gateway hands
    Envoy its engines by IP (EDS carries no names), so an endpoint registered as ``localhost:8000`` would
    never be reachable."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise ConfigError(f"--endpoint {url}: cannot resolve {host!r} ({exc})") from exc
    ips = sorted({ipaddress.ip_address(str(info[4][0]).partition("%")[0]) for info in infos}, key=_v4_first)
    if not ips:
        raise ConfigError(f"--endpoint {url}: {host!r} resolves to no address")
    return ips[0]


def _v4_first(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> tuple[int, str]:
    return ip.version, str(ip)


def served_models(url: str, timeout_s: float = MODELS_TIMEOUT_S) -> list[str]:
    """The model ids the engine at ``url`` lists at ``GET /v1/models`` (at least one, in its order)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    models_url = f"{parts.scheme}://{parts.netloc}/v1/models"
    got = http_get(models_url, timeout_s)
    hint = "is the engine running? or name its model with --model"
    if got is None:
        raise ConfigError(f"--endpoint {url}: no answer to GET {models_url} within {timeout_s:g} s ({hint})")
    status, body = got
    if status != 200:
        raise ConfigError(f"--endpoint {url}: GET {models_url} answered {status} ({hint})")
    try:
        ids = [m["id"] for m in json.loads(body)["data"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"--endpoint {url}: GET {models_url} is not an OpenAI model list ({hint})") from exc
    if not ids or not all(isinstance(i, str) and i for i in ids):
        raise ConfigError(f"--endpoint {url}: GET {models_url} lists no model by name ({hint})")
    return [str(i) for i in ids]
