"""The gateway config ``kvgate up`` writes for its ext_procs (``WORKDIR/gateway.json``, before ``--auth``
and ``--config`` are merged in), and each ext_proc's own copy with its listen addresses.

Every ext_proc of a stack runs the same config (same engines, models, etcd, feeds); only the listen
addresses differ. They start on port 0; once an ext_proc has bound its ports, its copy is rewritten with
them (:func:`pin_listeners`), so a restarted ext_proc listens where Envoy already sends it streams.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from certs.store import LeafFiles
from contracts.errors import ConfigError
from kvgate.dev.options import DEFAULT_MODEL, StackOptions

log = logging.getLogger(__name__)

#: The ext_proc's listen keys (``[extproc]``) and the ready-file port each one reports.
LISTENERS = {"listen": "extproc", "health_listen": "health", "metrics_listen": "metrics"}


def model_dir_for(opts: StackOptions, model: str, models: Sequence[str], smollm2_dir: str) -> str | None:
    """Where ``model``'s tokenizer is: ``--model-dir``, else SmolLM2's for the simulators and agents
    (whatever they are called) and for SmolLM2 behind ``--endpoint``; ``None`` (routing on digests
    of the request bytes) for another model behind ``--endpoint``."""
    if opts.model_dir is not None:
        if len(models) > 1:
            raise ConfigError(
                f"--model-dir is one model's tokenizer, but the engines serve {', '.join(models)}: "
                "name the model with --model"
            )
        return opts.model_dir
    if opts.endpoints and model != DEFAULT_MODEL:
        log.info("no --model-dir for %s: routing on request-byte digests, not exact tokens", model)
        return None
    return smollm2_dir


def gateway_config(
    opts: StackOptions,
    *,
    models: Sequence[str],
    served: Mapping[str, list[str]],
    engines: Sequence[Mapping[str, str]],
    smollm2_dir: str,
    etcd: str | None,
    certs: Mapping[str, LeafFiles],
    feeds_tls: bool,
    secure: bool,
) -> dict[str, Any]:
    """The ext_procs' config for the engines started or given: ``engines`` with the models ``served``
    (static endpoints; none with an ``etcd``, which then names the fleet), listen addresses on port 0,
    mTLS to the feeds (``feeds_tls``) and on every hop (``secure``) from ``certs["extproc"]``."""
    model_tables = []
    for name in models:
        model_dir = model_dir_for(opts, name, models, smollm2_dir)
        if model_dir is not None:
            template = {"chat_template": opts.chat_template} if opts.chat_template else {}
            model_tables.append({"name": name, "model_dir": model_dir, **template})
    config: dict[str, Any] = {
        "extproc": {**dict.fromkeys(LISTENERS, "127.0.0.1:0"), **opts.extproc},
        "models": model_tables,
        "endpoints": [] if etcd else [{**e, "models": served[e["id"]], **_adapters(opts)} for e in engines],
    }
    if etcd is not None:
        config["etcd"] = {"endpoints": [etcd]}
    if feeds_tls:
        feeds = certs["extproc"]
        config["feeds"] = {"tls_ca": str(feeds.ca), "tls_cert": str(feeds.cert), "tls_key": str(feeds.key)}
    if opts.slot_restore:
        config["slot_restore"] = dict(opts.slot_restore)
    if opts.index:
        config["index"] = dict(opts.index)
    if opts.scheduling is not None:
        config["scheduling"] = opts.scheduling
    if opts.scrape:
        config["scrape"] = {**config.get("scrape", {}), **opts.scrape}
    if secure:
        files = certs["extproc"]
        tls = {"tls_cert": str(files.cert), "tls_key": str(files.key)}
        config["extproc"] = {**config["extproc"], **tls, "tls_client_ca": str(files.ca)}
        config["scrape"] = {**config.get("scrape", {}), **tls, "tls_ca": str(files.ca)}
    return config


def pin_listeners(path: Path, config: Mapping[str, Any], ports: Mapping[str, int]) -> None:
    """Write ``config`` to ``path`` with its ext_proc listening on the ``ports`` it reported ready on
    (``{"extproc": ..., "health": ..., "metrics": ...}``): where a restart listens again."""
    extproc = dict(config["extproc"])
    for key, port_name in LISTENERS.items():
        if port_name in ports:
            host = str(extproc[key]).rpartition(":")[0]
            extproc[key] = f"{host}:{ports[port_name]}"
    path.write_text(json.dumps({**config, "extproc": extproc}, indent=2))


def _adapters(opts: StackOptions) -> dict[str, Any]:
    """An endpoint's ``adapters`` key when the engines serve LoRA adapters."""
    return {"adapters": list(opts.adapters)} if opts.adapters else {}
