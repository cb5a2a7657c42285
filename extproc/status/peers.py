"""The status page of a host's workers, combined: each worker with a siblings directory (``[extproc]
siblings_dir``, :mod:`extproc.control.siblings`: mode 0700, this user's only) announces where it serves
its status, and its ``/status`` page reads every sibling's ``/status.json`` and shows them combined with
its own (:mod:`extproc.status.combine`).

The announcement is ``DIR/<worker>.status``: JSON ``{"url": "http://127.0.0.1:PORT", "pid": PID}``
(mode 0600, written to a temporary name and renamed, so a reader never sees half of one), removed when
the worker stops. A wildcard listen address is announced as loopback (the siblings share the host). A
file whose process is gone (a worker killed before it could remove it) is skipped; one whose worker does
not answer within the timeout is shown as such. ``/status.json`` stays the worker's own view (what
``kvgate status`` combines across hosts).
"""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from extproc.status.snapshot import Status, StatusError, decode

log = logging.getLogger(__name__)

SUFFIX = ".status"


def announced_url(listen: str, port: int) -> str:
    """The URL a sibling on this host reaches a status server at, bound from ``listen`` on ``port``."""
    host = listen.rpartition(":")[0].strip("[]")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: alive
        return True
    return True


class StatusPeers:
    """This worker's announcement in ``directory`` and its siblings' (module docstring)."""

    def __init__(self, directory: Path, name: str, timeout_s: float = 2.0) -> None:
        self.directory, self.name, self.timeout_s = directory, name, timeout_s
        self.path = directory / f"{name}{SUFFIX}"

    def announce(self, url: str) -> None:
        """Write this worker's status URL (replacing an earlier one of the same name)."""
        tmp = self.directory / f".{self.name}{SUFFIX}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"url": url, "pid": os.getpid()}, f)
        os.replace(tmp, self.path)

    def withdraw(self) -> None:
        self.path.unlink(missing_ok=True)

    def siblings(self) -> list[tuple[str, str]]:
        """``(worker, url)`` of every other live worker's announcement, by name."""
        out = []
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            name = path.name.removesuffix(SUFFIX)
            if name == self.name:
                continue
            try:
                doc = json.loads(path.read_text())
                url, pid = str(doc["url"]), int(doc["pid"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being replaced, or not one of ours
            if _alive(pid):
                out.append((name, url))
        return out

    def fetch(self) -> tuple[list[tuple[str, Status]], list[tuple[str, str]]]:
        """Every sibling's status, read at once: ``(views, failed)`` with each failure's reason."""
        siblings = self.siblings()
        if not siblings:
            return [], []
        with ThreadPoolExecutor(max_workers=min(8, len(siblings))) as pool:
            results = list(pool.map(lambda s: self._read(s[1]), siblings))
        views: list[tuple[str, Status]] = []
        failed: list[tuple[str, str]] = []
        for (name, _), result in zip(siblings, results, strict=True):
            if isinstance(result, Status):
                views.append((name, result))
            else:
                failed.append((name, result))
        return views, failed

    def _read(self, url: str) -> Status | str:
        try:
            with urllib.request.urlopen(url + "/status.json", timeout=self.timeout_s) as response:
                return decode(response.read())
        except urllib.error.HTTPError as exc:
            return f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError) as exc:
            return f"unreachable ({type(exc).__name__})"
        except StatusError:
            return "not a status document"
