"""``kvgate up --config FILE``: a gateway config's sections merged over the one the launcher generates.

The file has the schema of ``kvgate extproc --config`` (:mod:`extproc.config`, TOML or JSON), so every
gateway feature can be tried on the local stack: ``[auth]`` and ``[[tenants]]``, ``[policy]``,
``[scheduling]``, ``[index]``, ``[slot_restore]``, ``[scrape]`` timing, ``[extproc]`` limits
(``max_body_bytes``, ``max_fallbacks``, ``conformance``), ``[[models]]``. Tables merge key by key (the
file's value wins), ``[[models]]`` merge by ``name`` (a file's model replaces the generated one of that
name, others are added), any other array (``[[tenants]]``) replaces the generated one.

The launcher keeps what makes the stack (:data:`LAUNCHER_KEYS`); a file setting any of them is refused,
never silently overridden: ``[[endpoints]]``, ``[etcd]`` and ``[feeds]`` (the fleet and its control
plane), the ``[extproc]`` listen addresses and TLS files, the ``[scrape]`` TLS files; and with ``--auth``,
``[auth]`` and ``[[tenants]]`` (the dev issuer's: use one or the other).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from contracts.config import read_tree
from contracts.errors import ConfigError
from extproc.config import parse_config

#: Top-level sections (whole) and keys of sections that the launcher sets.
LAUNCHER_KEYS: dict[str, tuple[str, ...] | None] = {
    "endpoints": None,
    "etcd": None,
    "feeds": None,
    "extproc": ("listen", "health_listen", "metrics_listen", "tls_cert", "tls_key", "tls_client_ca"),
    "scrape": ("tls_ca", "tls_cert", "tls_key"),
}
#: Sections that ``--auth`` generates.
DEV_AUTH_KEYS = ("auth", "tenants")


def check(overlay: Mapping[str, Any], *, dev_auth: bool) -> None:
    """:class:`ConfigError` naming every key of ``overlay`` that the launcher sets itself."""
    taken = []
    for section, keys in LAUNCHER_KEYS.items():
        if section not in overlay:
            continue
        if keys is None:
            taken.append(section)
        elif isinstance(overlay[section], Mapping):
            taken += [f"{section}.{k}" for k in keys if k in overlay[section]]
    if taken:
        raise ConfigError(
            f"{', '.join(taken)}: set by kvgate up itself (listen addresses, certificates, the fleet and "
            "its etcd); remove them from --config"
        )
    clash = [k for k in DEV_AUTH_KEYS if k in overlay]
    if dev_auth and clash:
        raise ConfigError(
            f"{', '.join(clash)}: --auth sets up its own; use either --auth or the file's {clash[0]}"
        )


def load(path: Path, *, dev_auth: bool) -> dict[str, Any]:
    """Read ``path``, refuse launcher keys (:func:`check`), validate it against the gateway schema on
    its own; the decoded tree. Every failure is a :class:`ConfigError` naming the file or the key."""
    tree = read_tree(path, "config")
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a table at the top, got {type(tree).__name__}")
    check(tree, dev_auth=dev_auth)
    try:
        parse_config(tree)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    return tree


def merge(generated: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    """``overlay`` over ``generated`` (neither is modified); see the module docstring for the rules."""
    merged = _tables(generated, overlay)
    models = overlay.get("models")
    if isinstance(models, list):  # anything else replaces, and the gateway schema refuses it
        names = {m.get("name") for m in models if isinstance(m, Mapping)}
        kept = [m for m in generated.get("models", []) if m.get("name") not in names]
        merged["models"] = [*kept, *models]
    return merged


def _tables(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        below = out.get(key)
        if isinstance(value, Mapping) and isinstance(below, Mapping):
            value = _tables(below, value)
        out[key] = value
    return out
