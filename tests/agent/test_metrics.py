"""The agent's Prometheus metrics, from one ``Agent.status()`` snapshot."""

from __future__ import annotations

from prometheus_client import generate_latest

from agent.metrics import STATES, agent_registry
from agent.supervisor import EngineState

STATUS = {
    "node": "n1",
    "feed_seq": 42,
    "engines": [
        {
            "id": "vllm-0",
            "kind": "vllm",
            "state": "ready",
            "registered": True,
            "restarts": 2,
            "kv_subscriber": {"received": 10, "lost_reports": 1},
            "kv_translator": {"stored": 30, "removed": 4, "unknown_parent": 0},
        },
        {"id": "llama-0", "kind": "llama_cpp", "state": "restarting", "registered": False, "restarts": 0},
    ],
}


def test_states_are_the_supervisors() -> None:
    assert set(STATES) == {s.value for s in EngineState}


def test_status_becomes_metrics() -> None:
    text = generate_latest(agent_registry(lambda: STATUS)).decode()
    assert 'kvgate_agent_engine_state{engine="vllm-0",kind="vllm",state="ready"} 1.0' in text
    assert 'kvgate_agent_engine_state{engine="vllm-0",kind="vllm",state="starting"} 0.0' in text
    assert 'kvgate_agent_engine_state{engine="llama-0",kind="llama_cpp",state="restarting"} 1.0' in text
    assert 'kvgate_agent_engine_registered{engine="llama-0"} 0.0' in text
    assert 'kvgate_agent_engine_restarts_total{engine="vllm-0"} 2.0' in text
    assert 'kvgate_agent_kv_subscriber_received_total{engine="vllm-0"} 10.0' in text
    assert 'kvgate_agent_kv_subscriber_lost_reports_total{engine="vllm-0"} 1.0' in text
    assert 'kvgate_agent_kv_translator_stored_total{engine="vllm-0"} 30.0' in text
    assert "kvgate_agent_feed_seq 42.0" in text
    kv_lines = [line for line in text.splitlines() if line.startswith("kvgate_agent_kv_")]
    assert kv_lines and not [line for line in kv_lines if "llama-0" in line]  # no KV events: no KV series
