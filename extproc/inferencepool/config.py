"""``[inference_pool]`` in the gateway config: which InferencePool to follow and how to reach the API.

::

    [inference_pool]
    name = "kvgate-pool"           # the InferencePool (inference.networking.k8s.io/v1); required
    namespace = "kvgate"           # default: the picker's own (in-cluster), else "default"
    kubeconfig = "~/.kube/config"  # absent: the in-cluster service account
    context = "kind-kvgate"        # a kubeconfig context (only with kubeconfig)
    engine = "vllm"                # the engine kind of a pod without a kvgate.io/engine annotation
    models = ["SmolLM2-135M-Instruct"]  # served by a pod without kvgate.io/models; default: [[models]]
    metrics_path = "/metrics"      # scraped on each target port ("": not scraped)
    timeout_s = 10.0               # connect and list timeout
    max_backoff_s = 30.0           # longest wait between reconnections
    agents_outside_pool = false    # true: also route to agents' etcd endpoints that are no ready pod
                                   # of the pool (default: held out until one is)
    agent_node_is_pod = false      # true: an agent's record at a pod's address is admitted only if its
                                   # node id is that pod's name (agents named after their pods, each
                                   # with its own etcd identity: no agent can claim another pod's engine)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from contracts.config import REQUIRED, Section, choice
from contracts.errors import ConfigError
from engines.kinds import ENGINE_KINDS

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """A validated ``[inference_pool]`` section (``models``: the defaults, never empty once resolved by
    :func:`parse_pool_settings`)."""

    name: str
    namespace: str | None = None
    kubeconfig: str | None = None
    context: str | None = None
    engine: str = "vllm"
    models: frozenset[str] = frozenset()
    metrics_path: str = "/metrics"
    timeout_s: float = 10.0
    max_backoff_s: float = 30.0
    agents_outside_pool: bool = False
    agent_node_is_pod: bool = False


def parse_pool_settings(raw: object, where: str, default_models: tuple[str, ...]) -> PoolSettings:
    """Validate ``[inference_pool]``; ``default_models``: the config's ``[[models]]`` names, served by a
    pod that names none (an error when both are empty)."""
    s = Section(raw, where)
    name = s.string("name", REQUIRED)
    if len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        raise ConfigError(f"{where}.name: not a Kubernetes object name: {name!r}")
    namespace = s.string("namespace")
    if namespace is not None and (len(namespace) > 63 or not _DNS_LABEL.match(namespace)):
        raise ConfigError(f"{where}.namespace: not a Kubernetes namespace name: {namespace!r}")
    kubeconfig = s.string("kubeconfig")
    if kubeconfig == "":
        raise ConfigError(f"{where}.kubeconfig: must be a file path, got an empty string")
    context = s.string("context")
    if context is not None and kubeconfig is None:
        raise ConfigError(f"{where}.context: needs kubeconfig (in-cluster access has no contexts)")
    engine = choice(s.string("engine", "vllm"), ENGINE_KINDS, f"{where}.engine")
    models_raw = s.array("models", list(default_models))
    if not all(isinstance(m, str) and m for m in models_raw):
        raise ConfigError(f"{where}.models: expected a list of model names")
    if not models_raw:
        raise ConfigError(f"{where}.models: required without [[models]] (what a pool pod serves)")
    metrics_path = s.string("metrics_path", "/metrics")
    if metrics_path and not metrics_path.startswith("/"):
        raise ConfigError(f"{where}.metrics_path: expected a path starting with /, got {metrics_path!r}")
    settings = PoolSettings(
        name=name,
        namespace=namespace,
        kubeconfig=None if kubeconfig is None else os.path.expanduser(kubeconfig),
        context=context,
        engine=engine,
        models=frozenset(models_raw),
        metrics_path=metrics_path,
        timeout_s=s.number("timeout_s", 10.0, minimum=0.001),
        max_backoff_s=s.number("max_backoff_s", 30.0, minimum=0.001),
        agents_outside_pool=s.flag("agents_outside_pool", False),
        agent_node_is_pod=s.flag("agent_node_is_pod", False),
    )
    s.done()
    return settings
