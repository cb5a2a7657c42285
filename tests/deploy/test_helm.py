"""deploy/helm/kvgate rendered by Helm's own engine and linter (Helm v4's Go SDK, bundled as a shared
library by the ``helm-python-sdk`` wheel: no ``helm`` binary is packaged for PyPI, npm or Debian) and held
to the Kustomize tree: with its defaults the chart renders exactly the objects of deploy/kubernetes/base,
with ci/dev-values.yaml those of overlays/dev, with ci/production-values.yaml (and the certificates passed
as values, as ``--set-file`` does) those of overlays/production, and with
ci/production-autoscaling-values.yaml layered on those (``-f a -f b``) those of
overlays/production-autoscaling, up to Helm's own labels, its checksum annotations and Kustomize's hash
suffixes. Then every check tests/deploy/test_kubernetes.py makes of the Kustomize objects (schemas, how
the parts fit, a real ``kvgate extproc`` on the picker's ConfigMap, the agents' etcd identities against a
real etcd, the autoscaler's adapter rules) runs again on the chart's, by the same test functions; and
values.schema.json, the README's values table, the agent ordinals and the external-etcd and FailOpen
choices are checked."""

from __future__ import annotations

import base64
import copy
import difflib
import json
import re
import shutil
import tomllib
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import pytest
import yaml

from tests.deploy.prom import DEPLOY
from tests.deploy.test_kubernetes import (  # the same checks, on the chart's objects (fixture below)
    OVERLAYS,
    Objects,
    find,
    kustomize,
    mint_certs,
    test_each_agent_pod_has_an_etcd_identity_of_its_own,
    test_every_object_matches_its_schema,
    test_kv_events_stay_inside_the_model_server_pod,
    test_network_policies_deny_by_default_and_admit_each_service_port,
    test_non_root_containers_can_read_their_secret_files,
    test_pool_route_picker_and_servers_fit_together,
    test_probes_name_ports_the_configs_listen_on,
    test_production_etcd_requires_client_certificates_and_rbac,
    test_production_mounts_the_certificates_its_configs_name,
    test_prometheus_may_scrape_the_engines_and_the_agents,
    test_read_only_containers_write_only_to_volumes,
    test_the_picker_autoscaler_scales_on_what_the_adapter_serves,
    test_the_picker_config_serves_the_probes_the_pod_asks,
    test_the_picker_may_only_read_its_pool_and_pods,
)

pytest_plugins = ("tests.etcd_fixtures",)  # secure_etcd, for the per-pod identity check

CHART = DEPLOY / "helm" / "kvgate"
#: Each Kustomize overlay's counterpart: (values files under the chart, layered as ``helm -f a -f b``
#: does, as the overlay builds on others; namespace).
PRODUCTION = ("ci/production-values.yaml",)
PROFILES: dict[str, tuple[tuple[str, ...], str]] = {
    "base": ((), "default"),
    "overlays/dev": (("ci/dev-values.yaml",), "kvgate-dev"),
    "overlays/production": (PRODUCTION, "kvgate"),
    "overlays/production-autoscaling": ((*PRODUCTION, "ci/production-autoscaling-values.yaml"), "kvgate"),
}
HELM_LABELS = ("app.kubernetes.io/managed-by", "app.kubernetes.io/instance", "helm.sh/chart")
#: The secure profile's files (--set-file): agents get theirs per pod from cert-manager, signed with ca.key.
CERT_FILES = ("ca.pem", "ca.key", "extproc.pem", "extproc.key", "etcd.pem", "etcd.key")
CERT_FILES += ("root.pem", "root.key")

REEXPORTED = (
    test_each_agent_pod_has_an_etcd_identity_of_its_own,
    test_every_object_matches_its_schema,
    test_kv_events_stay_inside_the_model_server_pod,
    test_network_policies_deny_by_default_and_admit_each_service_port,
    test_non_root_containers_can_read_their_secret_files,
    test_pool_route_picker_and_servers_fit_together,
    test_probes_name_ports_the_configs_listen_on,
    test_production_etcd_requires_client_certificates_and_rbac,
    test_production_mounts_the_certificates_its_configs_name,
    test_prometheus_may_scrape_the_engines_and_the_agents,
    test_read_only_containers_write_only_to_volumes,
    test_the_picker_autoscaler_scales_on_what_the_adapter_serves,
    test_the_picker_config_serves_the_probes_the_pod_asks,
    test_the_picker_may_only_read_its_pool_and_pods,
)


def merged(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, maps merged key by key (what Helm does with several values files)."""
    out = dict(base)
    for key, value in top.items():
        below = out.get(key)
        out[key] = merged(below, value) if isinstance(below, dict) and isinstance(value, dict) else value
    return out


def values_file(names: tuple[str, ...]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name in names:
        values = merged(values, yaml.safe_load((CHART / name).read_text()))
    return values


def render(values: dict[str, Any], namespace: str = "kvgate") -> Objects:
    """The chart's objects for ``values`` (Helm's engine: ``helm template``), in template order."""
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name="kvgate", namespace=namespace, is_install=True)
    objects: Objects = []
    for path in sorted(manifests):
        if path.endswith(".yaml"):
            objects += [doc for doc in yaml.safe_load_all(manifests[path]) if doc]
    return objects


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Objects]]:
    """Both renders with the same minted certificates: ``kustomize`` and ``helm``, by overlay."""
    tree = tmp_path_factory.mktemp("k8s") / "kubernetes"
    shutil.copytree(DEPLOY / "kubernetes", tree)
    certs = tree / "overlays" / "production" / "certs"
    mint_certs(certs)
    out: dict[str, dict[str, Objects]] = {"kustomize": kustomize(tree), "helm": {}}
    for overlay, (names, namespace) in PROFILES.items():
        values = values_file(names)
        if values.get("secure", {}).get("enabled"):
            values["secure"]["certs"] = {f: (certs / f).read_text() for f in CERT_FILES}  # --set-file
        out["helm"][overlay] = render(values, namespace)
    return out


@pytest.fixture(scope="module")
def rendered(trees: dict[str, dict[str, Objects]]) -> dict[str, Objects]:
    """The chart's objects: what the test functions imported from test_kubernetes check here."""
    return trees["helm"]


def parsed(key: str, text: str) -> Any:
    """A ConfigMap's TOML or YAML file as data (the two renders' comments differ), else its text."""
    if key.endswith(".toml"):
        return tomllib.loads(text)
    if key.endswith((".yaml", ".yml")):
        return yaml.safe_load(text)
    return text


def normalized(objects: Objects, source: str, overlay: str) -> dict[tuple[str, str], Any]:
    """Objects by (kind, name), with what differs by tool alone taken out: Kustomize's hash suffixes on
    generated ConfigMaps and Secrets (and every reference to them), Helm's labels and checksum
    annotations; the TOML and YAML in ConfigMaps parsed (comments differ); no namespaces for the base,
    which has none in Kustomize."""
    objects = copy.deepcopy(objects)
    renames: dict[str, str] = {}
    if source == "kustomize":
        for obj in objects:
            if obj["kind"] in ("ConfigMap", "Secret"):
                name = obj["metadata"]["name"]
                renames[name] = re.sub(r"-[a-z0-9]{10}$", "", name)

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, str):
            return renames.get(node, node)
        return node

    out: dict[tuple[str, str], Any] = {}
    for obj in map(walk, objects):
        labels = obj["metadata"].get("labels", {})
        for label in HELM_LABELS:
            labels.pop(label, None)
        template = obj.get("spec", {}).get("template", {}).get("metadata", {})
        annotations = template.get("annotations", {})
        for key in [k for k in annotations if k.startswith("checksum/")]:
            del annotations[key]
        if "annotations" in template and not annotations:
            del template["annotations"]
        if overlay == "base":
            obj["metadata"].pop("namespace", None)
            for subject in obj.get("subjects", []):
                subject.pop("namespace", None)
        if obj["kind"] == "Secret":  # Kustomize folds long base64 lines
            obj["data"] = {k: base64.b64decode(v) for k, v in obj["data"].items()}
        if obj["kind"] == "ConfigMap":
            obj["data"] = {k: parsed(k, v) for k, v in obj["data"].items()}
        key = (obj["kind"], obj["metadata"]["name"])
        assert key not in out, key
        out[key] = obj
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_chart_renders_the_kustomize_objects(trees: dict[str, dict[str, Objects]], overlay: str) -> None:
    ours = normalized(trees["helm"][overlay], "helm", overlay)
    theirs = normalized(trees["kustomize"][overlay], "kustomize", overlay)
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        if ours[key] != theirs[key]:
            diff = difflib.unified_diff(
                yaml.safe_dump(theirs[key]).splitlines(),
                yaml.safe_dump(ours[key]).splitlines(),
                "kustomize",
                "helm",
                lineterm="",
            )
            raise AssertionError(f"{overlay}: {key} differs:\n" + "\n".join(diff))


def test_helm_lint_finds_nothing(tmp_path: Path) -> None:
    """``helm lint --strict`` (its Kubernetes version checks included) on every profile."""
    certs = tmp_path / "certs"
    mint_certs(certs)
    for overlay, (names, namespace) in PROFILES.items():
        values = values_file(names)
        if values.get("secure", {}).get("enabled"):
            values["secure"]["certs"] = {f: (certs / f).read_text() for f in CERT_FILES}
        report = helm.lint(CHART, values, strict=True, namespace=namespace, kube_version="v1.37.0")
        assert report["errors"] == [], (overlay, report)
        serious = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
        assert serious == [], (overlay, serious)


def test_values_schema_types_every_key_and_refuses_bad_values() -> None:
    """values.schema.json (which Helm applies on install, upgrade, template and lint) accepts the defaults
    and each profile, and refuses a failure mode the Inference Extension lacks, a misspelt key, a
    negative replica count, an autoscaling target that is no quantity, and (by the templates) a secure
    profile missing a certificate, no etcd endpoints, an HPA whose maximum is below its minimum."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(defaults, schema)
    for names, _ in PROFILES.values():
        jsonschema.validate(values_file(names), schema)
    bad: list[dict[str, Any]] = [
        {"epp": {"failureMode": "FailSometimes"}},
        {"epp": {"replicas": -1}},
        {"epp": {"replica": 3}},
        {"etcdd": {"enabled": False}},
        {"etcd": {"enabled": False, "endpoints": ["no port"]}},
        {"epp": {"autoscaling": {"enabled": True, "targetSaturation": "half"}}},
    ]
    for values in bad:
        with pytest.raises(helm.HelmValuesError, match="schema"):
            render(values)
    with pytest.raises(helm.HelmError, match=r"secure\.certs\.ca\.pem"):
        render({"secure": {"enabled": True}})
    with pytest.raises(helm.HelmError, match=r"etcd\.endpoints"):
        render({"etcd": {"enabled": False}})
    with pytest.raises(helm.HelmError, match=r"epp\.autoscaling\.maxReplicas"):
        render({"epp": {"replicas": 4, "autoscaling": {"enabled": True, "maxReplicas": 3}}})
    certs = {f: f"-----BEGIN {f}-----\n" for f in CERT_FILES}
    with pytest.raises(helm.HelmError, match=r"secure\.certs\.ca\.key"):
        render({"secure": {"enabled": True, "certs": {**certs, "ca.key": ""}}})


def test_the_bootstrap_job_makes_one_etcd_user_per_model_server_ordinal() -> None:
    """``secure.agentOrdinals`` users agent-kvgate-model-server-0 .. N-1 (after ``secure.etcdIdentities``),
    one per StatefulSet pod name; more model-server replicas than ordinals is refused, since a pod past
    the last one would have no etcd user and could not register."""
    certs = {f: f"-----BEGIN {f}-----\n" for f in CERT_FILES}
    values: dict[str, Any] = {
        "modelServer": {"replicas": 3},
        "secure": {"enabled": True, "certs": certs, "agentOrdinals": 3},
    }
    objects = render(values)
    (boot,) = find(objects, "Job", "kvgate-etcd-bootstrap")["spec"]["template"]["spec"]["containers"]
    identities = [a.partition("=")[2] for a in boot["args"] if a.startswith("--identity=")]
    servers = find(objects, "StatefulSet", "kvgate-model-server")
    pods = [f"{servers['metadata']['name']}-{i}" for i in range(servers["spec"]["replicas"])]
    assert identities == ["extproc", "operator", *(f"agent-{pod}" for pod in pods)]
    values["modelServer"]["replicas"] = 4
    with pytest.raises(helm.HelmError, match=r"secure\.agentOrdinals"):
        render(values)
    assert not [o for o in render({"modelServer": {"replicas": 40}}) if o["kind"] in ("Job", "Issuer")]


def leaves(node: Any, prefix: str = "") -> set[str]:
    """The dotted keys of values.yaml, down to what the README documents as one value: a map whose
    keys are names the user picks (images' entries, resources, labels, certs) counts as one."""
    whole = {"resources", "gatewayNamespaceLabels", "monitoringNamespaceLabels", "certs", "models"}
    if isinstance(node, dict) and node and prefix.rpartition(".")[2] not in whole:
        return {leaf for k, v in node.items() for leaf in leaves(v, f"{prefix}.{k}" if prefix else k)}
    return {prefix}


def test_readme_documents_every_value() -> None:
    """deploy/helm/README.md's values table lists each key of values.yaml with its default as written
    there, and no key that values.yaml lacks."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    rows = re.findall(r"^\| `([^`]+)` \| `([^`]*)` \|", (CHART.parent / "README.md").read_text(), re.M)
    documented = dict(rows)
    assert len(documented) == len(rows), "a key twice in the table"
    assert set(documented) == leaves(defaults)
    for key, shown in documented.items():
        value: Any = defaults
        for part in key.split("."):
            value = value[part]
        assert yaml.safe_load(shown) == value, (key, shown, value)


def test_external_etcd_and_fail_open_are_choices() -> None:
    """``etcd.enabled: false`` renders no etcd (no StatefulSet, Services, PDB, NetworkPolicy or etcd
    Secret) and points both configs and the bootstrap Job at your endpoints; ``epp.failureMode``
    reaches the InferencePool, FailClose unless asked."""
    endpoints = ["etcd-a.example:2379", "etcd-b.example:2379"]
    values = {"etcd": {"enabled": False, "endpoints": endpoints}, "epp": {"failureMode": "FailOpen"}}
    objects = render(values)
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert not {n for n in names if n[1].startswith("etcd") or n[1] == "kvgate-etcd"}, names
    for configmap, key in (("kvgate-epp", "gateway.toml"), ("kvgate-agent", "node.toml")):
        assert (
            tomllib.loads(find(objects, "ConfigMap", configmap)["data"][key])["etcd"]["endpoints"]
            == endpoints
        )
    pool = find(objects, "InferencePool", "kvgate-pool")
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    assert find(render({}), "InferencePool", "kvgate-pool")["spec"]["endpointPickerRef"]["failureMode"] == (
        "FailClose"
    )
    secure = {f: f"-----BEGIN {f}-----\n" for f in CERT_FILES}
    objects = render({**values, "secure": {"enabled": True, "certs": secure}})
    job = find(objects, "Job", "kvgate-etcd-bootstrap")
    assert [
        a for a in job["spec"]["template"]["spec"]["containers"][0]["args"] if a.startswith("--etcd=")
    ] == [f"--etcd={e}" for e in endpoints]
    assert {o["metadata"]["name"] for o in objects if o["kind"] == "Secret"} == {
        "kvgate-certs",
        "kvgate-etcd-root",
        "kvgate-agent-issuer",
    }
    assert (
        base64.b64decode(find(objects, "Secret", "kvgate-certs")["data"]["ca.pem"])
        == secure["ca.pem"].encode()
    )
