"""Kubernetes API objects for the InferencePool tests: the recorded Pod of tests/data/k8s and the
InferencePool of deploy/kubernetes/base/pool.yaml, with what each test changes."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[3]
POD = json.loads((ROOT / "tests" / "data" / "k8s" / "pod-model-server.json").read_text())
POOL = next(d for d in yaml.safe_load_all((ROOT / "deploy/kubernetes/base/pool.yaml").read_text()) if d)
NAMESPACE = "kvgate"
LABELS = dict(POOL["spec"]["selector"]["matchLabels"])


def pod(
    name: str,
    ip: str | None,
    *,
    ready: bool = True,
    labels: dict[str, str] | None = None,
    deleting: bool = False,
    annotations: dict[str, str] | None = None,
    rv: int = 1,
) -> dict[str, Any]:
    """The recorded model-server Pod renamed ``name`` at ``ip`` (``None``: not scheduled yet)."""
    obj = copy.deepcopy(POD)
    meta, status = obj["metadata"], obj["status"]
    meta["name"] = name
    meta["resourceVersion"] = str(rv)
    if labels is not None:
        meta["labels"] = labels
    if annotations is not None:
        meta["annotations"] = {**meta["annotations"], **annotations}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-27T21:00:00Z"
        meta["deletionGracePeriodSeconds"] = 30
    for condition in status["conditions"]:
        if condition["type"] in ("Ready", "ContainersReady"):
            condition["status"] = "True" if ready else "False"
    if ip is None:
        for key in ("podIP", "podIPs"):
            status.pop(key)
    else:
        status["podIP"], status["podIPs"] = ip, [{"ip": ip}]
    return obj


def pool(
    *, ports: tuple[int, ...] = (8000,), annotations: dict[str, str] | None = None, rv: int = 1
) -> dict[str, Any]:
    """The deploy's InferencePool, as the API server returns it (namespace, resourceVersion)."""
    obj = copy.deepcopy(POOL)
    obj["metadata"].update(
        namespace=NAMESPACE, resourceVersion=str(rv), uid="9f8e7d6c-0000-4000-8000-000000000001"
    )
    if annotations:
        obj["metadata"]["annotations"] = annotations
    obj["spec"]["targetPorts"] = [{"number": p} for p in ports]
    return obj
