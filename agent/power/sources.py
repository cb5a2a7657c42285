"""From a node's ``[[power]]`` tables to the sources the :class:`~agent.power.monitor.PowerMonitor` reads."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from agent.power.config import DcgmConfig, IpmiConfig, NvmlConfig, PowerConfig, RedfishConfig
from agent.power.dcgm import DcgmSource
from agent.power.ipmi import IpmiSource
from agent.power.monitor import PowerMonitor, Source
from agent.power.nvml import NvmlSource
from agent.power.redfish import RedfishSource
from contracts.events import Gpu


def build_source(config: PowerConfig, read_gpus: Callable[[], Sequence[Gpu]]) -> Source:
    """The source ``config`` describes; ``read_gpus``: the agent's NVML read (for ``kind = "nvml"``)."""
    name = config.common.name
    if isinstance(config, NvmlConfig):
        return NvmlSource(name, read_gpus)
    if isinstance(config, DcgmConfig):
        return DcgmSource(name, config.url, gpus=config.gpus)
    if isinstance(config, RedfishConfig):
        return RedfishSource(
            name,
            config.url,
            username=config.username,
            password_env=config.password_env,
            timeout_s=config.common.timeout_s,
            verify=config.verify,
            auth=config.auth,
            chassis=config.chassis,
            sensor=config.sensor,
        )
    assert isinstance(config, IpmiConfig)
    return IpmiSource(
        name,
        config.host,
        username=config.username,
        password_env=config.password_env,
        sensor=config.sensor,
        port=config.port,
        interface=config.interface,
        cipher_suite=config.cipher_suite,
        privilege=config.privilege,
        temperature_sensor=config.temperature_sensor,
    )


def build_monitor(configs: Sequence[PowerConfig], read_gpus: Callable[[], Sequence[Gpu]]) -> PowerMonitor:
    """A monitor over every configured source (not started)."""
    return PowerMonitor(
        [(build_source(c, read_gpus), c.common.interval_s, c.common.timeout_s) for c in configs]
    )
