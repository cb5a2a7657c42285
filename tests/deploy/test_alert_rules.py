"""deploy/prometheus/kvgate-alerts.yml under ``promtool test rules``: given series, an alert fires for
what its summary says (Debian's ``promtool``, as tests/deploy/test_prometheus.py uses it; no stack runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.deploy.prom import DEPLOY, alert_rules, run_promtool

RULES = DEPLOY / "prometheus" / "kvgate-alerts.yml"


def expected(alert: str, **labels: str) -> dict[str, Any]:
    """The alert as promtool reports it: the rule's labels and annotations, ``$labels`` filled in."""
    (rule,) = [r for r in alert_rules() if r.get("alert") == alert]
    annotations = {}
    for key, text in rule.get("annotations", {}).items():
        for name, value in labels.items():
            text = text.replace(f"{{{{ $labels.{name} }}}}", value)
        annotations[key] = text
    return {"exp_labels": {**rule.get("labels", {}), **labels}, "exp_annotations": annotations}


def test_no_eligible_endpoint_fires_for_an_empty_fleet_too(tmp_path: Path) -> None:
    """An ext_proc that knows no endpoint at all (every agent's lease gone, no pool pod) answers 503 as
    surely as one whose endpoints are all unhealthy, and exports no ``kvgate_endpoint_healthy`` series:
    KvgateNoEligibleEndpoint fires for both, and not for a replica with a healthy endpoint."""
    up = 'up{job="kvgate-extproc", instance="%s"}'
    healthy = 'kvgate_endpoint_healthy{job="kvgate-extproc", instance="%s", endpoint="e1"}'
    tests = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": [
                    {"series": up % "empty:9090", "values": "1x20"},
                    {"series": up % "unhealthy:9090", "values": "1x20"},
                    {"series": healthy % "unhealthy:9090", "values": "0x20"},
                    {"series": up % "healthy:9090", "values": "1x20"},
                    {"series": healthy % "healthy:9090", "values": "1x20"},
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "3m",
                        "alertname": "KvgateNoEligibleEndpoint",
                        "exp_alerts": [
                            expected("KvgateNoEligibleEndpoint", instance="empty:9090"),
                            expected("KvgateNoEligibleEndpoint", instance="unhealthy:9090"),
                        ],
                    }
                ],
            }
        ],
    }
    path = tmp_path / "tests.yml"
    path.write_text(yaml.safe_dump(tests))
    done = run_promtool("test", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
