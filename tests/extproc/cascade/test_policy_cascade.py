"""A cascade is a policy value like any other (extproc.control.policy): ``models/<virtual>`` in etcd or
``[models."<virtual>".cascade]`` in the policy file, validated with the other routes; a refused value
leaves the last good cascade in force (also through a real etcd and the cluster's policy listener)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import etcd3aio
import pytest

from contracts.errors import ConfigError
from contracts.etcd import EtcdSettings, encode_value, policy_key
from extproc.cascade.plan import CascadePolicy
from extproc.cascade.spec import CascadeSpec
from extproc.config import parse_config
from extproc.control.cluster import Cluster
from extproc.control.policy import (
    ModelRoute,
    PolicyStore,
    cascade_policy,
    load_policy_file,
    routing_policy,
    write_policy_file,
)
from extproc.fleet import Fleet
from extproc.index.hybrid import HybridIndex
from extproc.models.registry import ModelRegistry
from extproc.routing.router import Router
from kvgate.policy_cli import main as policy_main
from tests.polling import until

pytest_plugins = ("tests.etcd_fixtures",)

AUTO = {"cascade": {"steps": ["small", "large"], "threshold": -0.5, "stat": "min"}}
SPEC = CascadeSpec(("small", "large"), -0.5, "min")


def test_a_cascade_route_is_in_force() -> None:
    store = PolicyStore()
    policy = store.put("models/auto", encode_value(AUTO))
    assert policy is not None and policy.routes["auto"] == ModelRoute(cascade=SPEC)
    assert cascade_policy(policy).cascades == {"auto": SPEC}
    assert store.get("models/auto") == {"cascade": {**AUTO["cascade"], "gate": "logprob", "timeout_s": 30.0}}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"cascade": {"steps": ["small"], "threshold": -1}}, "expected 2 to 4 model names"),
        ({"cascade": {"steps": ["small", "large"], "threshold": 1}}, "threshold must be a log-probability"),
        ({"cascade": {"steps": ["small", "large"], "threshold": -1, "stat": "p50"}}, "stat must be one of"),
        ({"cascade": {"steps": ["small", "large"], "threshold": -1, "stat": "first_k"}}, "needs k"),
        ({"cascade": {"steps": ["small", "auto"], "threshold": -1}}, "cannot be one of its own steps"),
        ({**AUTO, "labels": {"pool": "a"}}, "labels cannot go with it"),
        ({**AUTO, "disaggregation": {"mode": "conditional"}}, "disaggregation cannot go with it"),
        ({"cascade": "small,large"}, "expected an object"),
    ],
)
def test_bad_cascades_are_refused_and_the_last_good_one_stays(value: object, message: str) -> None:
    store = PolicyStore()
    store.put("models/auto", encode_value(AUTO))
    good = store.policy
    with pytest.raises(ConfigError, match="policy models/auto") as info:
        store.validate("models/auto", encode_value(value))
    assert message in str(info.value)
    assert store.put("models/auto", encode_value(value)) is None
    assert message in store.rejected["models/auto"]
    assert store.policy is good and cascade_policy(store.policy).cascades == {"auto": SPEC}


def test_no_nesting() -> None:
    store = PolicyStore()
    store.put("models/auto", encode_value(AUTO))
    nested = {"cascade": {"steps": ["tiny", "auto"], "threshold": -1}}
    assert store.put("models/meta", encode_value(nested)) is None
    assert "step 'auto' is itself a cascade" in store.rejected["models/meta"]
    # nor may a step become a cascade later
    assert (
        store.put("models/large", encode_value({"cascade": {"steps": ["a", "b"], "threshold": -1}})) is None
    )
    assert "models/large" in store.rejected


def test_policy_file(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text('[models."auto".cascade]\nsteps = ["small", "large"]\nthreshold = -0.5\nstat = "min"\n')
    store = PolicyStore()
    policy = store.load(load_policy_file(path))
    assert cascade_policy(policy).cascades == {"auto": SPEC}
    again = tmp_path / "again.json"
    write_policy_file(again, load_policy_file(path))
    assert PolicyStore().load(load_policy_file(again)) == policy
    path.write_text('[models."auto".cascade]\nsteps = ["small", "large"]\nthreshold = 0.5\n')
    with pytest.raises(ConfigError, match="threshold must be a log-probability"):
        PolicyStore().load(load_policy_file(path))


def test_kvgate_policy_set_refuses_a_bad_cascade(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The operator's path: ``kvgate policy set`` validates before writing and exits 2 on a bad value."""
    path = tmp_path / "policy.json"
    path.write_text("{}\n")
    bad = '{"cascade": {"steps": ["s"], "threshold": -1}}'
    assert policy_main(["set", "models/auto", bad, "--file", str(path)]) == 2
    assert "expected 2 to 4 model names" in capsys.readouterr().err
    assert path.read_text() == "{}\n"
    good = '{"cascade": {"steps": ["s", "l"], "threshold": -1}}'
    assert policy_main(["set", "models/auto", good, "--file", str(path)]) == 0
    assert "cascade" in path.read_text()


async def test_a_cascade_follows_etcd_and_a_refused_value_keeps_the_last_good_one(
    etcd_settings: EtcdSettings, etcd_client: etcd3aio.Etcd3Client
) -> None:
    config = dataclasses.replace(parse_config({}), etcd=etcd_settings)
    store = PolicyStore.from_config(config)
    fleet, index = Fleet([]), HybridIndex()
    router = Router(fleet, ModelRegistry([]), index, routing_policy(store.policy, max_fallbacks=2))
    cluster = Cluster(config, fleet, index, router, store)
    seen: list[CascadePolicy] = []
    cluster.pd_listener = lambda policy: seen.append(cascade_policy(policy))
    await cluster.start()
    try:
        assert etcd_client.kv is not None
        key = policy_key(etcd_settings.prefix, "models/auto")
        await etcd_client.kv.put(key, encode_value(AUTO))
        await until(lambda: bool(seen) and "auto" in seen[-1].cascades, 5.0)
        count = len(seen)
        await etcd_client.kv.put(key, b'{"cascade": {"steps": ["small", "large"], "threshold": "low"}}')
        await until(lambda: "models/auto" in cluster.store.rejected, 5.0)
        assert len(seen) == count and seen[-1].cascades["auto"] == SPEC
        await etcd_client.kv.delete(key)
        await until(lambda: "auto" not in seen[-1].cascades, 5.0)
    finally:
        await cluster.aclose()
