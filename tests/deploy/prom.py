"""A real Prometheus server (Debian's ``prometheus``) on 127.0.0.1 for the deploy tests, and the PromQL
helpers they share: Grafana's variables replaced, metric names read from an expression."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from kvgate.dev.procs import Child

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

#: Grafana's variables in the dashboards, as the tests evaluate them (scrapes every second; a rate window
#: that reaches back to the start of the test, so data stays in it while every query is polled).
GRAFANA_VARIABLES = {"$__rate_interval": "10m", "$__interval": "1s", "${datasource}": ""}


def binary(name: str) -> str:
    """The path of ``name`` (``prometheus``, ``promtool``, ``systemd-analyze``): installed by ``./dev``
    setup, so a missing one is a setup error, not a skip."""
    path = shutil.which(name)
    assert path is not None, f"{name} not on PATH: run ./dev setup (it installs the Debian package)"
    return path


def grafana_expr(expr: str) -> str:
    """A dashboard target's PromQL with Grafana's variables replaced."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NAME = re.compile(r"(?<![\w:\"])([a-zA-Z_:][\w:]*)(?=\s*(?:\{|\[|\)|$|\s|,))")
_KEYWORDS = {
    "sum", "min", "max", "avg", "count", "rate", "increase", "irate", "histogram_quantile", "scalar",
    "vector", "and", "or", "unless", "bool", "offset", "abs", "clamp_max", "clamp_min", "delta", "time",
}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names an expression reads (label matchers and grouping labels removed first)."""
    bare = _GROUPING.sub("", re.sub(r"\{[^}]*\}", "{}", expr))
    bare = re.sub(r"\[[^\]]*\]", "[]", bare)
    return {n for n in _NAME.findall(bare) if n not in _KEYWORDS and not re.fullmatch(r"[\d.e]+", n)}


def family(name: str) -> str:
    """The metric family a sample name belongs to (``_total``, ``_bucket``, ``_sum``, ``_count`` off)."""
    return re.sub(r"_(?:total|bucket|sum|count|created)$", "", name)


def dashboards() -> dict[str, dict[str, Any]]:
    """Every dashboard under deploy/grafana, by file name."""
    return {p.name: json.loads(p.read_text()) for p in sorted((DEPLOY / "grafana").glob("*.json"))}


def panel_queries(dashboard: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel (rows' nested panels too)."""
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                yield inner["title"], grafana_expr(target["expr"])


def alert_rules() -> list[dict[str, Any]]:
    """Every rule of every file under deploy/prometheus that holds rule groups."""
    rules: list[dict[str, Any]] = []
    for path in rule_files():
        for group in yaml.safe_load(path.read_text())["groups"]:
            rules.extend(group["rules"])
    return rules


def rule_files() -> list[Path]:
    return [
        p for p in sorted((DEPLOY / "prometheus").glob("*.yml")) if "groups" in yaml.safe_load(p.read_text())
    ]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape_job(name: str, path: str, targets: Sequence[str], ca_file: Path | None = None) -> dict[str, Any]:
    """One ``scrape_configs`` entry: ``targets`` (``host:port``) at ``path``; HTTPS verified against
    ``ca_file`` when given."""
    job: dict[str, Any] = {
        "job_name": name,
        "metrics_path": path,
        "static_configs": [{"targets": list(targets)}],
    }
    if ca_file is not None:
        job["scheme"] = "https"
        job["tls_config"] = {"ca_file": str(ca_file)}
    return job


class Prometheus:
    """``prometheus`` scraping ``jobs`` (:func:`scrape_job`) every second, evaluating ``rules`` every
    second, on a free loopback port, its data in ``workdir``."""

    def __init__(self, workdir: Path, jobs: Sequence[Mapping[str, Any]], rules: Sequence[Path]) -> None:
        self.config = workdir / "prometheus.yml"
        self.config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(p) for p in rules],
                    "scrape_configs": [dict(job) for job in jobs],
                }
            )
        )
        self.workdir = workdir
        self.url = ""
        #: The targets not up at the last :meth:`targets_up`, with Prometheus's reason.
        self.targets_down: list[str] = []
        self.child: Child | None = None

    def start(self, timeout_s: float = 60.0) -> Prometheus:
        for _ in range(3):  # the free port may be taken between the probe and the bind
            port = free_port()
            argv = [
                binary("prometheus"),
                f"--config.file={self.config}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ]
            child = Child("prometheus", argv, self.workdir / "prometheus.log")
            self.url = f"http://127.0.0.1:{port}"
            try:
                child.wait_until(self._ready, timeout_s, "ready")
            except Exception:
                if child.alive() or "address already in use" not in child.tail():
                    child.stop()
                    raise
                child.stop()
                continue
            self.child = child
            return self
        raise AssertionError("prometheus found no free port")

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()
            self.child = None

    def _ready(self) -> bool | None:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp:
                return True if resp.status == 200 else None
        except (OSError, urllib.error.URLError):
            return None

    def api(self, path: str, **params: str) -> Any:
        """GET ``/api/v1/<path>``: its ``data`` (a query error raises, with Prometheus's message)."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path} {params}: {exc.code} {exc.read().decode()}") from exc
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's vector (a scalar result becomes one sample)."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def targets_up(self) -> bool | None:
        active = self.api("targets", state="active")["activeTargets"]
        self.targets_down = [f"{t['scrapeUrl']}: {t['lastError']}" for t in active if t["health"] != "up"]
        return True if active and not self.targets_down else None

    def known_names(self) -> set[str]:
        """Every series name Prometheus holds and every metric family the targets described."""
        names = set(self.api("label/__name__/values"))
        return names | set(self.api("metadata"))


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary("promtool"), *args], capture_output=True, text=True, timeout=60, check=False
    )


def adapter_rules() -> list[dict[str, Any]]:
    """prometheus-adapter's rules for the picker's autoscaler (deploy/kubernetes/components/
    picker-autoscaling/adapter-rules.yaml)."""
    path = DEPLOY / "kubernetes" / "components" / "picker-autoscaling" / "adapter-rules.yaml"
    rules: list[dict[str, Any]] = yaml.safe_load(path.read_text())["rules"]
    return rules


def adapter_query(rule: Mapping[str, Any], series: str, namespace: str, pods: Sequence[str]) -> str:
    """A rule's ``metricsQuery`` as prometheus-adapter renders it for an HPA's Pods metric (a Go template
    with ``<<`` ``>>`` delimiters: the series, the namespace and the pods asked about, grouped by pod)."""
    query = str(rule["metricsQuery"])
    for key, value in (
        ("<<.Series>>", series),
        ("<<.LabelMatchers>>", f'namespace="{namespace}",pod=~"{"|".join(pods)}"'),
        ("<<.GroupBy>>", "pod"),
    ):
        query = query.replace(key, value)
    assert "<<" not in query and ">>" not in query, query
    return query
