"""The agent's view of its engines' load and its GPUs, sent to the gateways as ``Load`` events.

- :class:`EngineScraper` reads one engine's Prometheus metrics (bytes that are not UTF-8 read as U+FFFD)
  with :func:`engines.metrics.parse_metrics` (the names of REFERENCE.md section 4) into requests waiting
  and running and KV use 0..1. llama.cpp's
  server (build 11434, checked) exports no KV-use gauge (older builds had
  ``llamacpp:kv_cache_usage_ratio``, read when present); then ``GET /slots`` stands in: busy slots / all
  slots (``is_processing``). That is a proxy, not a measurement:
  each slot reserves ``n_ctx / slots`` tokens of the KV cache, so busy slots say how much of the cache is
  claimed by running requests, not how many cells they filled, and nothing about idle slots' cached
  prompts. A llama.cpp scraper with ``on_slots`` set reads ``/slots`` on every scrape and hands each
  reading to it (the automatic slot saves of :mod:`agent.autosave` watch slots this way). A redirect is
  not followed: a redirected ``/metrics`` is a failed scrape, a redirected ``/slots`` no KV reading. An
  answer over :data:`engines.metrics.MAX_METRICS_BYTES` (16 MiB, the gateway's scrapes' bound too) is not
  read whole: a failed scrape (``/metrics``) or no KV reading (``/slots``).
- :class:`GpuTelemetry` reads NVML (``import pynvml``, from the ``nvidia-ml-py`` package): per GPU its name,
  power draw and enforced limit (mW -> W), SM and memory clocks (MHz), temperature (C), memory used/total
  (bytes), utilisation (0..1) and the clocks event (throttle) reasons bitmask. ``nvmlInit`` runs once, on
  first read; without the package, the driver or a GPU, or on an NVML error there, it logs one line ``no GPU
  telemetry: <reason>`` and returns ``[]`` from then on, never raising. A field a GPU does not support reads
  as ``None``. Device indices are NVML's (PCI order), not ``CUDA_VISIBLE_DEVICES``'s. The tests exercise the
  NVML path with a fake ``pynvml`` module put in ``sys.modules`` (no GPU on CI).
- :class:`LoadChanges` (sans-IO) decides what to send: a ``Load`` whose routing signals (waiting,
  running, KV use, healthy, draining) changed, or any ``Load`` whose endpoint has sent nothing for
  ``heartbeat_s`` (GPU telemetry and the engine's prefix-cache counters, for the gateway's drift alarm,
  do not trigger a send: they ride along).
- :class:`TelemetryLoop` polls every watched engine (and the GPUs) each ``interval_s`` and hands the
  ``Load`` events to send to a callback (the feed's ``publish``). ``heartbeat_s`` must stay below the
  gateway's ``scrape.stale_after_s``, or an idle engine's load expires there between heartbeats. An
  engine whose reading fails (whatever the error) counts as that engine's failed scrape only; one whose
  reading hangs (a stopped process: up to the scraper's 2 s timeout) is reported in the
  round its answer arrives in, without holding back the others' (one wait for all stretched every round
  to that timeout: the node's other engines were reported every 2 s, the gateway's staleness bound, and
  one that came back ready up to 2 s late). The GPUs are read likewise, one NVML read at a time in a
  worker thread, waited for at most ``gpu_timeout_s``: a hung driver holds one thread, and the loads go out
  without GPU readings (a warning when that starts, a line when NVML answers) instead of stopping the feed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import ssl
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from contracts.events import Gpu, Load, Power
from engines.kinds import metric_names
from engines.metrics import MAX_METRICS_BYTES, LoraState, parse_metrics
from runtime.httpbody import read_body

log = logging.getLogger(__name__)

LLAMA_CPP_KV_METRIC = "llamacpp:kv_cache_usage_ratio"
"""KV-use gauge of older llama.cpp servers (0..1); newer ones have none and ``/slots`` is used."""


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One reading of an engine: requests waiting and running, KV use 0..1 (``None``: unknown), its
    counter of output tokens generated since it started (``None``: it exports none), and its LoRA
    adapters (``None``: no LoRA metric)."""

    waiting: float
    running: float
    kv_usage: float | None
    generation_tokens: float | None = None
    lora: LoraState | None = None
    #: The prefix cache's counters (prompt tokens hit, looked up; ``None``: the engine exports none).
    prefix_hits: float | None = None
    prefix_queries: float | None = None


class TokenRate:
    """Output tokens/s of one engine from its cumulative counter (sans-IO; ``now``: monotonic seconds).

    The rate is the counter's growth over windows of at least ``window_s`` (tokens come in bursts, so a
    100 ms difference would swing between 0 and several times the mean); ``None`` until the first window
    ends or when the engine has no counter. A counter that goes down (the engine restarted) starts a new
    window and keeps the last rate.
    """

    def __init__(self, window_s: float = 1.0) -> None:
        self.window_s = window_s
        self._start: tuple[float, float] | None = None
        #: The latest rate (tokens/s), ``None`` while unknown.
        self.rate: float | None = None

    def observe(self, count: float | None, now: float) -> float | None:
        """Take a counter reading; the rate in force afterwards."""
        if count is None:
            self._start, self.rate = None, None
            return None
        start = self._start
        if start is None or count < start[1]:
            self._start = (now, count)
        elif now - start[0] >= self.window_s:
            self.rate = (count - start[1]) / (now - start[0])
            self._start = (now, count)
        return self.rate


class EngineScraper:
    """Reads one engine's load from its Prometheus ``metrics_url``.

    ``engine``: its kind (:data:`engines.kinds.ENGINE_KINDS`), which picks the metric names.
    ``slots_url``: llama.cpp's ``/slots`` (default: ``metrics_url`` with the path ``/slots``), read only
    for llama.cpp and only when the metrics carry no KV use. ``tls``: verification and client certificate
    for ``https`` URLs. ``session``: a shared aiohttp session (default: one of its own, closed by
    :meth:`aclose`).
    """

    def __init__(
        self,
        engine: str,
        metrics_url: str,
        *,
        slots_url: str | None = None,
        timeout_s: float = 2.0,
        tls: ssl.SSLContext | None = None,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.engine = engine
        self.metrics_url = metrics_url
        names = metric_names(engine)
        self._llama = engine == "llama_cpp"
        if self._llama:
            names = dataclasses.replace(names, kv_usage=LLAMA_CPP_KV_METRIC)
            if slots_url is None:
                parts = urlsplit(metrics_url)
                slots_url = urlunsplit((parts.scheme, parts.netloc, "/slots", "", ""))
        self._names = names
        self.slots_url = slots_url
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._tls: ssl.SSLContext | bool = tls if tls is not None else True
        self._session = session
        self._own_session = session is None
        self._slots_ok = True
        #: Why the last scrape failed ("" after a success).
        self.last_error = ""
        #: llama.cpp only: called with every ``/slots`` reading (the list as the engine sent it); set, it
        #: makes every scrape read ``/slots`` (:mod:`agent.autosave` watches slots through it).
        self.on_slots: Callable[[list[dict[str, Any]]], object] | None = None

    async def scrape(self) -> EngineSample | None:
        """The engine's load now; ``None`` when the metrics cannot be read (see :attr:`last_error`)."""
        try:
            text = await self._get(self.metrics_url)
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            return None
        self.last_error = ""
        m = parse_metrics(text, self._names, 0.0)
        kv = m.kv_usage
        if (kv is None or self.on_slots is not None) and self._llama and self.slots_url is not None:
            from_slots = await self._slots_usage(self.slots_url)
            kv = from_slots if kv is None else kv
        return EngineSample(
            m.waiting, m.running, kv, m.generation_tokens, m.lora, m.prefix_hits, m.prefix_queries
        )

    async def aclose(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def _get(self, url: str) -> str:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, connector=aiohttp.TCPConnector(limit=0, ssl=self._tls)
            )
        async with self._session.get(url, raise_for_status=True, allow_redirects=False) as resp:
            _not_redirected(resp)
            # At most MAX_METRICS_BYTES (more: a failed scrape); a stray byte spoils a line, not the reading.
            return (await read_body(resp, MAX_METRICS_BYTES)).decode(errors="replace")

    async def _slots_usage(self, url: str) -> float | None:
        """Busy slots / all slots from llama.cpp's ``/slots`` (``is_processing``; ``state`` != 0 in
        older builds); ``None`` if unavailable (e.g. ``--no-slots``)."""
        try:
            assert self._session is not None
            async with self._session.get(url, raise_for_status=True, allow_redirects=False) as resp:
                _not_redirected(resp)
                slots: Any = json.loads(await read_body(resp, MAX_METRICS_BYTES))
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            if self._slots_ok:
                log.info("llama.cpp %s unavailable (%s): KV use unknown", url, type(exc).__name__)
                self._slots_ok = False
            return None
        if not isinstance(slots, list) or not slots:
            return None
        if self.on_slots is not None:
            try:
                self.on_slots([s for s in slots if isinstance(s, dict)])
            except Exception:  # a slot watcher's bug must not stop telemetry
                log.exception("slot watcher failed on %s", url)
        busy = sum(
            1
            for s in slots
            if isinstance(s, dict) and (s.get("is_processing") is True or s.get("state", 0) not in (0, None))
        )
        self._slots_ok = True
        return busy / len(slots)


def _not_redirected(resp: aiohttp.ClientResponse) -> None:
    """A redirect is an error, not followed: the engine's own URL is read, never one its answer names."""
    if resp.status >= 300:
        raise aiohttp.ClientResponseError(
            resp.request_info, resp.history, status=resp.status, message="redirect not followed"
        )


class GpuTelemetry:
    """NVML readings of this node's GPUs (see the module docstring); never raises."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._devices: list[tuple[int, Any, str]] = []
        #: True once NVML turned out unusable: :meth:`read` returns ``[]`` from then on.
        self.disabled = False

    def read(self) -> list[Gpu]:
        """Every GPU's telemetry now (blocking NVML calls: run it in a thread from async code)."""
        if self.disabled or (self._nvml is None and not self._start()):
            return []
        return [self._read(index, handle, name) for index, handle, name in self._devices]

    def close(self) -> None:
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml = None
        self.disabled = True

    def _start(self) -> bool:
        try:
            import pynvml
        except ImportError as exc:
            return self._disable(f"nvidia-ml-py is not importable ({exc})")
        try:
            pynvml.nvmlInit()
        except (pynvml.NVMLError, OSError) as exc:
            return self._disable(str(exc) or type(exc).__name__)
        try:
            devices = []
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                name = pynvml.nvmlDeviceGetName(handle)
                devices.append((index, handle, name.decode() if isinstance(name, bytes) else str(name)))
        except (pynvml.NVMLError, OSError) as exc:
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()
            return self._disable(str(exc) or type(exc).__name__)
        if not devices:
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()
            return self._disable("no GPU found")
        self._nvml, self._devices = pynvml, devices
        log.info("GPU telemetry: %s", ", ".join(f"{i}: {n}" for i, _, n in devices))
        return True

    def _disable(self, reason: str) -> bool:
        log.info("no GPU telemetry: %s", reason)
        self.disabled = True
        return False

    def _read(self, index: int, handle: Any, name: str) -> Gpu:
        nv = self._nvml
        power = _field(nv.nvmlDeviceGetPowerUsage, handle)
        limit = _field(nv.nvmlDeviceGetEnforcedPowerLimit, handle)
        temp = _field(nv.nvmlDeviceGetTemperatureV, handle, nv.NVML_TEMPERATURE_GPU)
        if temp is None:  # drivers before nvmlDeviceGetTemperatureV
            temp = _field(nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU)
        memory = _field(nv.nvmlDeviceGetMemoryInfo, handle)
        util = _field(nv.nvmlDeviceGetUtilizationRates, handle)
        sm = _field(nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_SM)
        mem = _field(nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_MEM)
        # Renamed from ...ThrottleReasons in NVML 12.x's headers; older bindings have only the old name.
        reasons_fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )
        reasons = None if reasons_fn is None else _field(reasons_fn, handle)
        energy_fn = getattr(nv, "nvmlDeviceGetTotalEnergyConsumption", None)  # bindings before NVML 9 lack it
        energy = None if energy_fn is None else _field(energy_fn, handle)  # mJ; Not Supported before Volta
        return Gpu(
            index=index,
            name=name,
            power_w=None if power is None else power / 1000.0,
            power_limit_w=None if limit is None else limit / 1000.0,
            sm_clock_mhz=None if sm is None else float(sm),
            mem_clock_mhz=None if mem is None else float(mem),
            temperature_c=None if temp is None else float(temp),
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            utilization=None if util is None else util.gpu / 100.0,
            throttle_reasons=None if reasons is None else int(reasons),
            energy_mj=None if energy is None else int(energy),
        )


def _field(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or ``None`` when NVML cannot answer (not supported, GPU lost, ...)."""
    try:
        return fn(*args)
    except Exception as exc:  # NVMLError and its many subclasses; a telemetry field is never fatal
        log.debug("NVML %s failed: %s", getattr(fn, "__name__", fn), exc)
        return None


class LoadChanges:
    """Which ``Load`` events to send (see the module docstring). ``now``: monotonic seconds."""

    def __init__(self, heartbeat_s: float) -> None:
        self.heartbeat_s = heartbeat_s
        self._sent: dict[str, tuple[tuple[object, ...], float]] = {}

    def offer(self, load: Load, now: float) -> bool:
        """Whether to send ``load`` now (if so, it is remembered as sent)."""
        key = (
            load.waiting,
            load.running,
            load.kv_usage,
            load.healthy,
            load.draining,
            load.lora_running,
            load.lora_waiting,
            load.max_lora,
            load.lora_slots_used,
        )
        last = self._sent.get(load.endpoint)
        if last is not None and last[0] == key and now - last[1] < self.heartbeat_s:
            return False
        self._sent[load.endpoint] = (key, now)
        return True

    def forget(self, endpoint: str) -> None:
        self._sent.pop(endpoint, None)


@dataclass(frozen=True, slots=True)
class EngineStatus:
    """What the supervisor says of an engine: ready to serve, and whether it is draining."""

    healthy: bool
    draining: bool = False


@dataclass(slots=True)
class _Watched:
    scraper: EngineScraper
    status: Callable[[], EngineStatus] | None
    gpus: frozenset[int] | None
    failures: int = 0
    tokens: TokenRate = dataclasses.field(default_factory=TokenRate)
    #: The reading under way (one at a time: an engine that hangs is not asked again until it answers).
    reading: asyncio.Task[EngineSample | None] | None = None


class TelemetryLoop:
    """Polls engines and GPUs every ``interval_s`` seconds and emits ``Load`` events (module docstring).

    ``emit`` receives the loads to send of one round (one feed batch). An engine is reported unhealthy
    (zero load, ``healthy=False``) after ``unhealthy_after`` failed scrapes in a row, or at once when its
    ``status`` callback says so. ``power``: the node's latest power readings (the agent's
    :meth:`agent.power.monitor.PowerMonitor.readings`, a list in memory), put on every ``Load``; like GPU
    telemetry they ride along and never trigger a send themselves. Each load also carries the engine's
    output tokens/s (:class:`TokenRate`; riding along too). ``clock``: monotonic seconds.
    """

    def __init__(
        self,
        interval_s: float,
        emit: Callable[[list[Load]], object],
        *,
        heartbeat_s: float = 1.0,
        gpus: GpuTelemetry | None = None,
        power: Callable[[], list[Power]] | None = None,
        unhealthy_after: int = 3,
        clock: Callable[[], float] = time.monotonic,
        gpu_timeout_s: float = 1.0,
    ) -> None:
        if interval_s <= 0 or heartbeat_s <= 0 or unhealthy_after < 1 or gpu_timeout_s <= 0:
            raise ValueError("interval_s, heartbeat_s and gpu_timeout_s must be > 0, unhealthy_after >= 1")
        self.interval_s = interval_s
        self._emit = emit
        self._changes = LoadChanges(heartbeat_s)
        self._gpus = gpus
        self._power = power
        self._unhealthy_after = unhealthy_after
        self._clock = clock
        self._watched: dict[str, _Watched] = {}
        self._task: asyncio.Task[None] | None = None
        self.gpu_timeout_s = gpu_timeout_s
        #: The NVML read under way, in a worker thread (one at a time: a hung driver holds one thread,
        #: and the rounds go on without GPU readings until it answers).
        self._gpu_read: asyncio.Future[list[Gpu]] | None = None
        #: Rounds in a row that went out without GPU readings because NVML had not answered.
        self.gpu_late = 0

    def watch(
        self,
        endpoint: str,
        scraper: EngineScraper,
        *,
        status: Callable[[], EngineStatus] | None = None,
        gpus: Collection[int] | None = None,
    ) -> None:
        """Report ``endpoint`` from ``scraper`` (now owned by the loop); ``status``: the supervisor's
        word on the engine (default: healthy, not draining); ``gpus``: NVML indices of its GPUs (default:
        all of the node's)."""
        self._watched[endpoint] = _Watched(scraper, status, None if gpus is None else frozenset(gpus))

    async def unwatch(self, endpoint: str) -> None:
        watched = self._watched.pop(endpoint, None)
        self._changes.forget(endpoint)
        if watched is not None:
            reading, watched.reading = watched.reading, None
            if reading is not None:
                reading.cancel()
                await asyncio.gather(reading, return_exceptions=True)
            await watched.scraper.aclose()

    async def tick(self, wait_s: float | None = None) -> list[Load]:
        """One round: read the GPUs and every engine not still being read, wait for those readings
        (``wait_s``: at most that many seconds; a slower one is reported in the round its answer arrives
        in), emit what changed (or is due), and return it."""
        gpu = self._gpus
        if self._gpu_read is None and gpu is not None and not gpu.disabled:
            self._gpu_read = asyncio.create_task(asyncio.to_thread(gpu.read))
        watched = list(self._watched.items())
        for _, w in watched:
            if w.reading is None:
                w.reading = asyncio.create_task(w.scraper.scrape())
        readings = await self._gpu_readings(wait_s)
        if watched:
            await asyncio.wait([w.reading for _, w in watched if w.reading is not None], timeout=wait_s)
        power = self._power() if self._power is not None else []
        now = self._clock()
        out: list[Load] = []
        for endpoint, w in watched:
            reading = w.reading
            if reading is None or not reading.done():
                continue  # still reading (reported in a later round), or unwatched meanwhile
            w.reading = None
            try:
                sample = reading.result()
            except Exception as exc:  # a scraper's bug on one engine's answer: that engine's failed reading
                w.scraper.last_error = type(exc).__name__  # the type only: the message may quote the body
                sample = None
            status = w.status() if w.status is not None else EngineStatus(True)
            mine = [g for g in readings if w.gpus is None or g.index in w.gpus]
            if sample is None:
                w.failures += 1
                if w.failures == self._unhealthy_after:
                    reason = w.scraper.last_error
                    log.warning("engine %s unhealthy: metrics unreadable (%s)", endpoint, reason)
                if w.failures < self._unhealthy_after and status.healthy:
                    continue
                load = Load(
                    endpoint, 0.0, 0.0, None, healthy=False, draining=status.draining, gpus=mine, power=power
                )
            else:
                if w.failures >= self._unhealthy_after:
                    log.info("engine %s metrics readable again", endpoint)
                w.failures = 0
                tps = w.tokens.observe(sample.generation_tokens, now)
                lora = sample.lora
                load = Load(
                    endpoint,
                    sample.waiting,
                    sample.running,
                    sample.kv_usage,
                    healthy=status.healthy,
                    draining=status.draining,
                    gpus=mine,
                    power=power,
                    output_tps=tps,
                    lora_running=None if lora is None else sorted(lora.running),
                    lora_waiting=None if lora is None else sorted(lora.waiting),
                    max_lora=None if lora is None else lora.max_lora,
                    lora_slots_used=None if lora is None else lora.slots_used,
                    prefix_hits=sample.prefix_hits,
                    prefix_queries=sample.prefix_queries,
                )
            if self._changes.offer(load, now):
                out.append(load)
        if out:
            self._emit(out)
        return out

    async def _gpu_readings(self, wait_s: float | None) -> list[Gpu]:
        """The GPU readings of this round: the NVML read under way, waited for at most ``gpu_timeout_s``
        (and ``wait_s``); ``[]`` when there is none or it has not answered (it stays under way, and the
        round goes on without GPU readings: one warning when that starts, one line when NVML answers)."""
        read = self._gpu_read
        if read is None:
            return []
        bound = self.gpu_timeout_s if wait_s is None else min(wait_s, self.gpu_timeout_s)
        await asyncio.wait([read], timeout=bound)
        if not read.done():
            self.gpu_late += 1
            if self.gpu_late == 1:
                log.warning("GPU telemetry: NVML did not answer within %g s; loads go without it", bound)
            return []
        self._gpu_read = None
        if self.gpu_late:
            log.info("GPU telemetry: NVML answered again after %d rounds without it", self.gpu_late)
            self.gpu_late = 0
        try:
            return read.result()
        except Exception:  # GpuTelemetry.read never raises; a bug there must not end the round
            log.exception("GPU telemetry read failed")
            return []

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvgate-telemetry")

    async def aclose(self) -> None:
        """Stop polling and close every watched engine's scraper."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for endpoint in list(self._watched):
            await self.unwatch(endpoint)
        read, self._gpu_read = self._gpu_read, None
        if read is not None:  # its thread ends when NVML answers; nobody waits for it
            read.cancel()

    async def _run(self) -> None:
        while True:
            started = self._clock()
            try:
                await self.tick(self.interval_s)
            except Exception:  # a bad round must not end telemetry for good
                log.exception("telemetry round failed")
            await asyncio.sleep(max(0.0, self.interval_s - (self._clock() - started)))
