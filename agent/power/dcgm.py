"""DCGM: a dcgm-exporter's ``/metrics`` (Prometheus text), parsed with prometheus_client's parser.

Fields read, per GPU (the exporter's ``gpu`` label), and what the node's :class:`~agent.power.reading.Sample`
makes of them:

- ``DCGM_FI_DEV_POWER_USAGE`` (W): summed -> ``watts``; a reply without it is an error;
- ``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION`` (mJ since the driver loaded): summed / 1000 -> ``energy_j``;
- ``DCGM_FI_DEV_POWER_MGMT_LIMIT`` or ``DCGM_FI_DEV_ENFORCED_POWER_LIMIT`` (W): summed -> ``limit_w``
  (only when every GPU read has one; neither is in dcgm-exporter's default counter list);
- ``DCGM_FI_DEV_GPU_TEMP`` and ``DCGM_FI_DEV_MEMORY_TEMP`` (degrees C): the hottest -> ``temperature_c``;
- ``DCGM_FI_DEV_CLOCKS_EVENT_REASONS`` (``DCGM_FI_DEV_CLOCK_THROTTLE_REASONS`` before the rename; a
  bitmask, not in the default list either): any GPU with a bit of
  :data:`~agent.power.reading.THROTTLE_MASK` -> ``throttled``;
- ``DCGM_FI_DEV_SM_CLOCK`` (MHz): the mean -> ``sm_clock_mhz``.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import defaultdict

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from agent.power.errors import PowerSourceError
from agent.power.reading import (
    MAX_CELSIUS,
    MAX_MHZ,
    MAX_MILLIJOULES,
    MAX_WATTS,
    THROTTLE_MASK,
    Sample,
    number,
)

POWER = "DCGM_FI_DEV_POWER_USAGE"
ENERGY = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
LIMITS = ("DCGM_FI_DEV_POWER_MGMT_LIMIT", "DCGM_FI_DEV_ENFORCED_POWER_LIMIT")
TEMPS = ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_MEMORY_TEMP")
REASONS = ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS")
SM_CLOCK = "DCGM_FI_DEV_SM_CLOCK"
_WANTED = frozenset({POWER, ENERGY, *LIMITS, *TEMPS, *REASONS, SM_CLOCK})
#: The most of an exporter's answer read (bytes): a node's exporter answers some tens of KiB (a few
#: hundred lines per GPU with profiling fields); a larger answer is an error, not parsed.
MAX_BODY_BYTES = 4 * 1024 * 1024


def parse_dcgm(text: str, gpus: frozenset[int] | None = None) -> Sample:
    """The node's sample from dcgm-exporter's metrics ``text`` (module docstring); ``gpus``: only those
    GPU indices (``None``: all). :class:`PowerSourceError` for text that does not parse, a GPU without a
    power reading, or an implausible number."""
    fields: dict[str, dict[str, float]] = defaultdict(dict)
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                # The parser names a counter family's samples <name>_total (the energy counter's too).
                name = family.name if sample.name == family.name + "_total" else sample.name
                if name not in _WANTED:
                    continue
                gpu = sample.labels.get("gpu", "")
                if gpus is not None and (not gpu.isdigit() or int(gpu) not in gpus):
                    continue
                fields[name][gpu] = sample.value
    except (ValueError, TypeError, IndexError) as exc:  # the parser's ways of refusing text
        raise PowerSourceError(f"not Prometheus text: {exc}") from exc
    power = fields.get(POWER, {})
    if not power:
        raise PowerSourceError(f"no {POWER} in the exporter's metrics" + (" for those GPUs" if gpus else ""))
    ids = sorted(power)
    watts = sum(number(power[g], f"{POWER}{{gpu={g}}}", MAX_WATTS) for g in ids)
    energy = fields.get(ENERGY, {})
    energy_j = (
        sum(number(energy[g], f"{ENERGY}{{gpu={g}}}", MAX_MILLIJOULES) for g in ids) / 1000.0
        if all(g in energy for g in ids)
        else None
    )
    limit_w = None
    for name in LIMITS:
        values = fields.get(name, {})
        if all(g in values for g in ids):
            limit_w = sum(number(values[g], f"{name}{{gpu={g}}}", MAX_WATTS) for g in ids)
            break
    temps = [number(v, name, MAX_CELSIUS) for name in TEMPS for v in fields.get(name, {}).values()]
    throttled = None
    for name in REASONS:
        values = fields.get(name, {})
        if values:
            masks = [int(number(v, name, float(2**63))) for v in values.values()]
            throttled = any(m & THROTTLE_MASK for m in masks)
            break
    clocks = [number(v, SM_CLOCK, MAX_MHZ) for v in fields.get(SM_CLOCK, {}).values()]
    return Sample(
        watts=watts,
        limit_w=limit_w,
        energy_j=energy_j,
        temperature_c=max(temps) if temps else None,
        throttled=throttled,
        sm_clock_mhz=sum(clocks) / len(clocks) if clocks else None,
    )


class DcgmSource:
    """Reads a dcgm-exporter over HTTP(S) (``tls``: verification settings for https; on by default).

    The answer is read up to :data:`MAX_BODY_BYTES` (more is an error) and parsed in a worker thread
    (the parser takes some milliseconds per hundred lines: on the event loop a large answer would stall
    the agent), one parse at a time: while a parse the monitor gave up waiting for still runs, a read is
    a reported error."""

    kind = "dcgm"

    def __init__(
        self, name: str, url: str, *, gpus: frozenset[int] | None = None, tls: ssl.SSLContext | None = None
    ) -> None:
        self.name, self.url, self.gpus = name, url, gpus
        self._tls: ssl.SSLContext | bool = tls if tls is not None else True
        self._session: aiohttp.ClientSession | None = None
        #: A parse is under way in a worker thread: the next read is refused until it ends.
        self._busy = False

    async def read(self) -> Sample:
        if self._busy:
            raise PowerSourceError("the previous answer is still being parsed")
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._tls))
        try:
            async with self._session.get(self.url) as resp:
                if resp.status != 200:
                    raise PowerSourceError(f"GET {self.url}: HTTP {resp.status}")
                body = bytearray()
                async for chunk in resp.content.iter_any():
                    body += chunk
                    if len(body) > MAX_BODY_BYTES:
                        raise PowerSourceError(
                            f"GET {self.url}: the answer is over {MAX_BODY_BYTES} bytes (not an exporter's)"
                        )
                text = body.decode(resp.charset or "utf-8")
        except (aiohttp.ClientError, UnicodeDecodeError, LookupError) as exc:
            raise PowerSourceError(f"GET {self.url}: {type(exc).__name__}: {exc}") from exc
        self._busy = True

        def work() -> Sample:
            try:
                return parse_dcgm(text, self.gpus)
            finally:
                self._busy = False  # also when the monitor gave up waiting: the thread ends by itself

        return await asyncio.to_thread(work)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
