"""The dashboards (deploy/grafana) and alerting rules (deploy/prometheus) against a real Prometheus.

``promtool`` checks the rules and the example scrape config. Then one stack runs the way an operator's
would be scraped (``kvgate up --agents 2 --kvcached --gpu h100 --power-cap-w 600``: etcd, two agents each
supervising a simulated vLLM and reading its simulated GPU's power as a dcgm-exporter, a kvcached daemon
per node, the ext_proc, Envoy with its read-only statistics listener, flow control
holding at most one request per engine and two per model), and Debian's ``prometheus`` scrapes every part
every second: the ext_proc (job ``kvgate-extproc``), Envoy (``envoy``), the agents (``kvgate-agent``),
the kvcached daemons (``kvcached``) and the engines the agents supervise (``engines``). Once every target
is up, a burst larger than the fleet goes through Envoy (some requests are held and dispatched, some
shed as queue_full) with a request for an unknown model (404), twice (a labelled series is born at its
first increment, and only its next increment gives it a rate). Every panel query of every dashboard
must then parse and return a number, and every alert rule must evaluate without error and read only
metrics the targets expose.

Queries that may stay empty here, and why (:data:`EMPTY_HERE`): series that appear only after an event
this stack cannot produce (llama.cpp slot restores, a failed upstream try, a kvcached API call or peer
fetch, which only llama.cpp slots make). For those the test still requires that every metric the query
reads is described by a target, so a renamed metric fails.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgate.dev.up import Stack, StackOptions
from tests.deploy.prom import (
    DEPLOY,
    Prometheus,
    adapter_query,
    adapter_rules,
    alert_rules,
    dashboards,
    family,
    metric_names,
    panel_queries,
    rule_files,
    run_promtool,
    scrape_job,
)
from tests.polling import poll

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"

#: Metric families whose series appear only after events this stack does not produce, with the reason.
EMPTY_HERE = {
    "kvgate_slot_restores": "slot restores happen only for llama.cpp engines with kvcached",
    "kvgate_endpoint_ejections": "an ejection follows a failed upstream try; every engine here answers",
    "kvcached_request_seconds": "agents call kvcached's API only to save and restore llama.cpp slots",
    "kvcached_get_seconds": "agents call kvcached's API only to save and restore llama.cpp slots",
    "kvcached_peer_fetch_seconds": "a peer fetch follows a local Get miss (llama.cpp slot restores only)",
    "kvgate_pd_decisions": "no model here disaggregates (no prefill endpoint): the recipes' vLLM and SGLang "
    "disaggregated stacks need GPUs",
    "kvgate_pd_prefill_seconds": "no model here disaggregates (no prefill endpoint)",
    "kvgate_pd_fallbacks": "no model here disaggregates (no prefill endpoint)",
    "kvgate_pd_prefill_errors": "no model here disaggregates (no prefill endpoint)",
    "kvgate_ttft_prediction_error_seconds": "a prediction is scored once an engine's TTFT histogram window "
    "closes with requests the predictor saw; a short burst may not close one",
}


# -- static checks ------------------------------------------------------------------------------------


def test_promtool_checks_rules_and_example_config() -> None:
    files = rule_files()
    assert files, "no rule files under deploy/prometheus"
    checked = run_promtool("check", "rules", *map(str, files))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    config = run_promtool("check", "config", str(DEPLOY / "prometheus" / "prometheus.yml"))
    assert config.returncode == 0, config.stdout + config.stderr


def test_dashboards_are_grafana_json() -> None:
    """Each dashboard: a unique uid, a Prometheus datasource variable every panel and target uses, unique
    panel ids, and at least one query per panel that is not a row."""
    found = dashboards()
    assert set(found) >= {"kvgate-gateway.json", "kvgate-fleet.json", "kvgate-kv.json", "kvgate-power.json"}
    assert len({d["uid"] for d in found.values()}) == len(found)
    for name, dash in found.items():
        (variable,) = dash["templating"]["list"]
        assert (variable["name"], variable["type"], variable["query"]) == (
            "datasource",
            "datasource",
            "prometheus",
        )
        ids = [p["id"] for p in dash["panels"]]
        assert len(ids) == len(set(ids)), name
        for panel in dash["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, (
                name,
                panel["title"],
            )
            assert panel["targets"] and panel["description"], (name, panel["title"])
            for target in panel["targets"]:
                assert target["datasource"] == panel["datasource"] and target["expr"].strip()


# -- a real Prometheus scraping a running stack ---------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    options = StackOptions(
        port=0,
        agents=2,
        kvcached=True,
        envoy_stats=True,
        agent_args=("--time-scale", "0.5"),
        gpus=("h100",),  # the simulated engines' power model, read by each agent as a dcgm-exporter
        power_caps_w=(600.0,),
        workdir=tmp_path_factory.mktemp("obs"),
        overlay={"flow": {"saturation": {"max_in_flight": 1}, "max_queued": 2}},
    )
    with Stack(options) as running:
        yield running


def scrape_jobs(stack: Stack) -> list[dict[str, Any]]:
    """The jobs of deploy/prometheus/prometheus.yml, with this stack's addresses. With kvcached the
    agents' admin APIs serve HTTPS (GETs need no client certificate), verified against the stack's CA."""
    engines = [str(e["address"]) for status in stack.agent_status for e in status["engines"]]
    assert stack.envoy_stats_url.startswith("http://")
    envoy = stack.envoy_stats_url.removeprefix("http://").split("/", 1)[0]
    extproc = scrape_job("kvgate-extproc", "/metrics", [])
    # Each ext_proc as Kubernetes service discovery labels a picker pod (prometheus-adapter maps the
    # `namespace` and `pod` labels to the HPA's pods: deploy/kubernetes/components/picker-autoscaling).
    extproc["static_configs"] = [
        {"targets": [f"127.0.0.1:{p['metrics']}"], "labels": {"namespace": NAMESPACE, "pod": pod}}
        for p, pod in zip(stack.extproc_listeners, picker_pods(stack), strict=True)
    ]
    return [
        extproc,
        scrape_job("envoy", "/stats/prometheus", [envoy]),
        scrape_job(
            "kvgate-agent",
            "/metrics",
            [f"127.0.0.1:{status['admin_port']}" for status in stack.agent_status],
            ca_file=stack.workdir / "certs" / "ca.pem",
        ),
        scrape_job("kvcached", "/metrics", [f"127.0.0.1:{d['metrics_port']}" for d in stack.kvcached]),
        scrape_job("engines", "/metrics", engines),
    ]


NAMESPACE = "kvgate"


def picker_pods(stack: Stack) -> list[str]:
    return [f"kvgate-epp-{i}" for i in range(len(stack.extproc_listeners))]


@pytest.fixture(scope="module")
def prometheus(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    server = Prometheus(tmp_path_factory.mktemp("prometheus"), scrape_jobs(stack), rule_files()).start()
    try:
        try:
            poll(server.targets_up, 60, "every target up")
        except AssertionError as exc:
            raise AssertionError(f"targets down: {server.targets_down}") from exc
        # Traffic only once every target was scraped, twice: a labelled series (an outcome, a shed reason)
        # is born at its first increment, so only a second burst, after Prometheus has scraped the first,
        # gives it a rate.
        burst(stack)
        poll(lambda: scraped(server), 30, "the first burst scraped")
        burst(stack)
        yield server
    finally:
        server.stop()


def burst(stack: Stack) -> None:
    """Eight concurrent chats (two engines of one request each, two queued: some held and dispatched, some
    shed with 429) and one chat for a model nobody serves (404). Each chat asks for 48 tokens (~0.1-0.2 s
    at the engines' time scale), so the eight overlap even when a loaded machine starts them tens of
    milliseconds apart: with 4 tokens CI twice saw five rounds of eight without a shed. The eight still
    go again, up to five times, until one is shed."""

    def chat(i: int, model: str = MODEL) -> int:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"hello {i} " * 20}],
            "max_tokens": 48,
        }
        return httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=60).status_code

    tries: list[list[int]] = []
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for _ in range(5):
            tries.append(list(pool.map(chat, range(8))))
            if 429 in tries[-1]:
                break
    for codes in tries:
        assert 200 in codes and set(codes) <= {200, 429, 503}, codes  # 503: held past the waiting room
    assert 429 in tries[-1], tries
    assert chat(99, "no-such-model") == 404


def scraped(server: Prometheus) -> bool | None:
    """Whether Prometheus holds the series the first burst created."""
    outcomes = {s["metric"]["outcome"] for s in server.query("kvgate_requests_total")}
    waits = server.query("kvgate_flow_wait_seconds_count")
    return True if {"routed", "404"} <= outcomes and waits else None


def numbers(result: list[dict[str, Any]]) -> list[float]:
    return [float(sample["value"][1]) for sample in result if not math.isnan(float(sample["value"][1]))]


def exempt(expr: str) -> str | None:
    reasons = [EMPTY_HERE[family(n)] for n in metric_names(expr) if family(n) in EMPTY_HERE]
    return reasons[0] if reasons else None


def test_every_dashboard_query_returns_data(prometheus: Prometheus) -> None:
    queries = [
        (f"{name}: {title}", expr)
        for name, dash in dashboards().items()
        for title, expr in panel_queries(dash)
    ]
    assert len(queries) >= 30
    for _, expr in queries:
        prometheus.query(expr)  # parses (a bad query raises with Prometheus's error)

    def missing() -> list[str]:
        return [
            f"{where}: {expr}"
            for where, expr in queries
            if exempt(expr) is None and not numbers(prometheus.query(expr))
        ]

    last: list[str] = []

    def complete() -> bool | None:
        last[:] = missing()
        return True if not last else None

    try:
        poll(complete, 60, "data for every panel")
    except AssertionError as exc:
        raise AssertionError("no data:\n" + "\n".join(last)) from exc
    known = prometheus.known_names()
    for where, expr in queries:
        names = metric_names(expr)
        assert names, f"{where}: no metric found in {expr}"
        unknown = {n for n in names if n not in known and family(n) not in known}
        assert not unknown, f"{where}: {sorted(unknown)} exposed by no target"


def test_every_alert_expression_evaluates(prometheus: Prometheus) -> None:
    rules = alert_rules()
    names = {r["alert"] for r in rules}
    assert len(names) == len(rules) >= 20

    def evaluated() -> dict[str, Any] | None:
        found = {r["name"]: r for g in prometheus.api("rules")["groups"] for r in g["rules"]}
        return found if set(found) == names and all(r["health"] == "ok" for r in found.values()) else None

    found = poll(evaluated, 30, "every rule evaluated")
    assert all(not r.get("lastError") for r in found.values()), json.dumps(found, indent=1)
    known = prometheus.known_names() | {"up"}
    for rule in rules:
        prometheus.query(rule["expr"])
        unknown = {n for n in metric_names(rule["expr"]) if n not in known and family(n) not in known}
        assert not unknown, f"{rule['alert']}: {sorted(unknown)} exposed by no target"


def test_envoy_stats_listener_serves_only_statistics(stack: Stack) -> None:
    """Envoy's read-only listener: GET /stats/prometheus answers, the admin's other pages do not."""
    got = httpx.get(stack.envoy_stats_url, timeout=10)
    assert got.status_code == 200 and "envoy_cluster_upstream_rq_total" in got.text
    base = stack.envoy_stats_url.removesuffix("/stats/prometheus")
    for path in ("/quitquitquit", "/logging", "/config_dump", "/stats"):
        assert httpx.get(base + path, timeout=10).status_code == 404, path
    assert httpx.post(stack.envoy_stats_url, timeout=10).status_code == 404
    assert Path(stack.admin_socket).exists()


def test_kvgate_up_envoy_stats_flag(tmp_path: Path) -> None:
    """``kvgate up --envoy-stats`` prints the statistics URL in its banner, and it serves."""
    argv = [sys.executable, "-m", "kvgate.cli", "up", "--port", "0", "--replicas", "1", "--envoy-stats"]
    proc = subprocess.Popen(
        [*argv, "--workdir", str(tmp_path)],
        env={**os.environ, "KVGATE_STATE_DIR": str(tmp_path / "state")},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout

    def read() -> None:
        with contextlib.suppress(ValueError, OSError):  # closed below once the process exited
            for line in stdout:
                lines.put(line)

    threading.Thread(target=read, daemon=True).start()

    def stats_line() -> str | None:  # readiness: the banner, printed once Envoy listens
        while not lines.empty():
            line = lines.get()
            if line.startswith("  Envoy stats:"):
                return line
        return None

    try:
        url = poll(stats_line, 120, "Envoy stats in the banner").split()[2]
        assert url.startswith("http://127.0.0.1:"), url
        got = httpx.get(url, timeout=10)
        assert got.status_code == 200 and "envoy_http_downstream_rq_total" in got.text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_the_picker_autoscaler_reads_a_number_per_pod(stack: Stack, prometheus: Prometheus) -> None:
    """The prometheus-adapter rules of the picker's HPA, as the adapter runs them: each rule's
    ``seriesQuery`` finds the series of every picker pod, and its ``metricsQuery`` (rendered for the
    HPA's namespace and pods) returns one number per pod (tests/deploy/test_kubernetes.py checks the
    rules' format and the HPA that names them)."""
    pods = picker_pods(stack)
    rules = adapter_rules()
    assert rules
    for rule in rules:
        series = prometheus.api("series", **{"match[]": rule["seriesQuery"]})
        assert {s["pod"] for s in series} == set(pods) and {s["namespace"] for s in series} == {NAMESPACE}
        name = rule["seriesQuery"].split("{")[0]
        query = adapter_query(rule, name, NAMESPACE, pods)

        def per_pod(query: str = query) -> dict[str, float] | None:
            found = {s["metric"].get("pod", ""): float(s["value"][1]) for s in prometheus.query(query)}
            ok = set(found) == set(pods) and all(not math.isnan(v) for v in found.values())
            return found if ok else None

        values = poll(per_pod, 60, f"a number per pod from {query}")
        assert all(v >= 0 for v in values.values()), (query, values)
