from __future__ import annotations

from pathlib import Path

from kvgate.envoyconf import EnvoyParams, render, render_yaml

ROOT = Path(__file__).resolve().parents[1]


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
