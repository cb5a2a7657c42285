"""The simulator's power model: what a replica's GPU draws per engine step, a power cap that lowers its
clocks (and so stretches its steps), and the energy counter a dcgm-exporter would report. Pure: time is
passed in.

**GPU classes** (:data:`GPU_CLASSES`): board power at full load is each GPU's published TDP (NVIDIA data
sheets: H100 SXM5 700 W, A100 SXM4 80 GB 400 W, L40S 350 W). ``speed`` scales the timing model (whose
defaults are an H100's) by memory bandwidth relative to the H100's 3.35 TB/s (A100 80 GB 2.04 TB/s ->
0.61, L40S 0.864 TB/s -> 0.26): decode, most of serving time, is bound by reading weights and KV.
``idle_w`` is an assumption (what ``nvidia-smi`` shows for such boards with no work: tens of watts), not
a measurement. Full-load energy per step time: an H100 draws 700 W at speed 1, an A100 400 W at 0.61
(656 W per H100-second of work), an L40S 350 W at 0.26 (1,346 W): three efficiency classes.

**Power of a step**: ``idle_w + (max_w - idle_w) x (floor + (1 - floor) x f)`` with the step's share of
the batch capacity ``f = min(1, n_decoding / max_num_seqs + n_prefill_tokens / max_num_batched_tokens)``.
``floor`` (0.35, an assumption) is what a lone decode step already draws of the dynamic range: it reads
every weight. The shape (prompt processing near TDP, token generation well below it) follows what
Splitwise (Patel et al., ISCA 2024) reports for LLM inference on H100 and A100; the numbers are not
calibrated to a measured curve.

**Power cap** ``cap_w``: a step that would draw more runs at lower clocks. Dynamic power goes with
roughly the cube of the clock (P ~ f V^2, V ~ f), so the clock ratio is
``r = ((cap_w - idle_w) / (P - idle_w)) ** (1/3)``, the step takes ``1 / r`` as long and draws ``cap_w``.
Stretching the whole step overstates the slowdown of memory-bound decode steps. A capped step reports
the SW power cap clocks event reason (0x4) and the SM clock ``max_sm_mhz x r``.

**Energy** (:class:`EnergyMeter`): ``idle_w`` between steps, each step's watts over its duration; the
counter is reported in mJ as ``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: SW power cap, the clocks event reason a capped step reports (NVML/DCGM bit 0x4); 0x1 is GPU idle.
REASON_SW_POWER_CAP = 0x4
REASON_IDLE = 0x1


@dataclass(frozen=True, slots=True)
class GpuClass:
    """A GPU type: TDP and idle draw (W), speed relative to the timing model's H100 defaults, SM clock
    at full speed (MHz), marketing name (the exporter's ``modelName``)."""

    name: str
    model_name: str
    idle_w: float
    max_w: float
    speed: float
    max_sm_mhz: float


GPU_CLASSES = {
    "h100": GpuClass("h100", "NVIDIA H100 80GB HBM3", idle_w=70.0, max_w=700.0, speed=1.0, max_sm_mhz=1980.0),
    "a100": GpuClass(
        "a100", "NVIDIA A100-SXM4-80GB", idle_w=55.0, max_w=400.0, speed=0.61, max_sm_mhz=1410.0
    ),
    "l40s": GpuClass("l40s", "NVIDIA L40S", idle_w=35.0, max_w=350.0, speed=0.26, max_sm_mhz=2520.0),
}


@dataclass(frozen=True, slots=True)
class PowerModel:
    """One replica's GPU: its class, its power cap (W; ``None``: the TDP) and the decode floor."""

    gpu: GpuClass
    cap_w: float | None = None
    floor: float = 0.35

    def __post_init__(self) -> None:
        if self.cap_w is not None and not self.gpu.idle_w < self.cap_w < math.inf:
            raise ValueError(f"cap_w must be above the idle draw ({self.gpu.idle_w} W), got {self.cap_w!r}")
        if not 0.0 <= self.floor <= 1.0:
            raise ValueError(f"floor must be in [0, 1], got {self.floor!r}")

    @property
    def limit_w(self) -> float:
        """The power limit in force (W)."""
        return self.gpu.max_w if self.cap_w is None else min(self.cap_w, self.gpu.max_w)

    def step(
        self, n_decoding: int, n_prefill_tokens: int, max_seqs: int, max_batched: int
    ) -> tuple[float, float]:
        """``(watts, clock ratio)`` of a step (module docstring); the caller divides its duration by the
        ratio (1.0: not capped)."""
        g = self.gpu
        share = min(1.0, n_decoding / max_seqs + n_prefill_tokens / max_batched)
        watts = g.idle_w + (g.max_w - g.idle_w) * (self.floor + (1.0 - self.floor) * share)
        limit = self.limit_w
        if watts <= limit:
            return watts, 1.0
        return limit, ((limit - g.idle_w) / (watts - g.idle_w)) ** (1.0 / 3.0)


class EnergyMeter:
    """Energy drawn over the driver's timeline (J; ``now``: the driver's clock, seconds), the draw now
    (W), and the seconds spent capped."""

    def __init__(self, idle_w: float, now: float) -> None:
        self.idle_w = idle_w
        self._energy_j = 0.0
        self._since = now
        self._watts = idle_w
        #: Clock ratio of the step running now (1.0 when idle or not capped).
        self.clock_ratio = 1.0
        #: Seconds steps ran at a capped clock.
        self.capped_s = 0.0

    def begin(self, start: float, end: float, watts: float, clock_ratio: float) -> None:
        """A step runs from ``start`` to ``end`` drawing ``watts``."""
        self._advance(start)
        self._watts, self.clock_ratio = watts, clock_ratio
        if clock_ratio < 1.0:
            self.capped_s += max(0.0, end - start)

    def end(self, now: float) -> None:
        """The step ended at ``now``: idle until the next one."""
        self._advance(now)
        self._watts, self.clock_ratio = self.idle_w, 1.0

    def watts(self) -> float:
        return self._watts

    def energy_j(self, now: float) -> float:
        """Joules drawn up to ``now``."""
        return self._energy_j + self._watts * max(0.0, now - self._since)

    def _advance(self, now: float) -> None:
        if now > self._since:
            self._energy_j += self._watts * (now - self._since)
            self._since = now


#: Where each number of the model comes from (the result JSON of a benchmark carries it). ``assumed``:
#: no published figure; the benchmarks sweep these by 2x.
SOURCES = {
    "h100.max_w": "NVIDIA H100 Tensor Core GPU data sheet: H100 SXM5 max TDP 700 W",
    "h100.bandwidth": "NVIDIA H100 data sheet: H100 SXM5 memory bandwidth 3.35 TB/s (speed 1.0)",
    "a100.max_w": "NVIDIA A100 Tensor Core GPU data sheet: A100 80GB SXM max TDP 400 W",
    "a100.bandwidth": "NVIDIA A100 data sheet: A100 80GB SXM 2,039 GB/s (speed 2.04 / 3.35 = 0.61)",
    "l40s.max_w": "NVIDIA L40S data sheet: max power 350 W",
    "l40s.bandwidth": "NVIDIA L40S data sheet: 864 GB/s (speed 0.26)",
    "shape": "Patel et al., Splitwise, ISCA 2024: prompt phase near TDP, token phase well below it on "
    "H100/A100 (the shape only; not calibrated to its curves)",
    "cap": "CMOS dynamic power P ~ C V^2 f with V ~ f, so ~ f^3 (clock ratio under a cap)",
    "idle_w": "assumed (tens of watts, what nvidia-smi shows for such idle boards); not measured",
    "floor": "assumed (a lone decode step reads every weight: 0.35 of the dynamic range); not measured",
}


def describe(models: dict[str, PowerModel]) -> dict[str, object]:
    """The power model's parameters per replica and their :data:`SOURCES` (for a result JSON)."""
    return {
        "replicas": {
            name: {
                "gpu": m.gpu.name,
                "idle_w": m.gpu.idle_w,
                "max_w": m.gpu.max_w,
                "speed": m.gpu.speed,
                "cap_w": m.cap_w,
                "floor": m.floor,
            }
            for name, m in models.items()
        },
        "step_watts": "idle_w + (max_w - idle_w) x (floor + (1 - floor) x f), f = batch share",
        "cap_clock_ratio": "((cap_w - idle_w) / (P - idle_w)) ** (1/3)",
        "sources": dict(SOURCES),
    }
