"""How a model is served: aggregated, disaggregated, or conditional (the ``disaggregation`` object of a
model route, etcd ``models/<name>``). Pure: parsing and validation only.

    {"mode": "conditional", "min_uncached_tokens": 512, "prefill_profile": "prefill",
     "prefill_timeout_s": 30}

``mode``: ``aggregated`` (the default: one endpoint prefills and decodes), ``disaggregated`` (every
request is prefilled on a prefill endpoint, then decoded on a decode-capable one), ``conditional``
(disaggregated only when the decode pick would have to compute at least ``min_uncached_tokens`` prompt
tokens itself). ``prefill_profile``: the scheduling profile run over the prefill pool (``null``: the
route's own profile). ``prefill_timeout_s``: the bound on the prefill sub-request; past it the request is
served aggregated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from contracts.errors import ConfigError

MODES = ("aggregated", "disaggregated", "conditional")
DEFAULT_MIN_UNCACHED_TOKENS = 512
DEFAULT_PREFILL_TIMEOUT_S = 30.0
_KEYS = ("mode", "min_uncached_tokens", "prefill_profile", "prefill_timeout_s")


@dataclass(frozen=True, slots=True)
class PdSpec:
    """A model's serving mode (module docstring); ``min_uncached_tokens`` in tokens, the timeout in
    seconds."""

    mode: str = "aggregated"
    min_uncached_tokens: int = DEFAULT_MIN_UNCACHED_TOKENS
    prefill_profile: str | None = None
    prefill_timeout_s: float = DEFAULT_PREFILL_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if isinstance(self.min_uncached_tokens, bool) or self.min_uncached_tokens < 0:
            raise ConfigError(f"min_uncached_tokens must be an integer >= 0, got {self.min_uncached_tokens}")
        if not 0 < self.prefill_timeout_s <= 600:
            raise ConfigError(f"prefill_timeout_s must be in (0, 600], got {self.prefill_timeout_s}")

    def disaggregates(self, uncached_tokens: int) -> bool:
        """Whether a request whose decode pick lacks ``uncached_tokens`` prompt tokens is prefilled
        elsewhere first."""
        if self.mode == "disaggregated":
            return True
        return self.mode == "conditional" and uncached_tokens >= self.min_uncached_tokens

    def to_json(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "min_uncached_tokens": self.min_uncached_tokens,
            "prefill_profile": self.prefill_profile,
            "prefill_timeout_s": self.prefill_timeout_s,
        }


def parse_pd(value: object, where: str) -> PdSpec:
    """A ``disaggregation`` object; unknown keys and bad values are a :class:`ConfigError` naming
    ``where``. Profile names are checked by the caller (it knows the profiles)."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected an object {{{', '.join(_KEYS)}}}, got {type(value).__name__}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(_KEYS)}")
    mode = value.get("mode", "aggregated")
    threshold = value.get("min_uncached_tokens", DEFAULT_MIN_UNCACHED_TOKENS)
    profile = value.get("prefill_profile")
    timeout = value.get("prefill_timeout_s", DEFAULT_PREFILL_TIMEOUT_S)
    if not isinstance(mode, str):
        raise ConfigError(f"{where}.mode: expected one of {', '.join(MODES)}, got {mode!r}")
    if not isinstance(threshold, int) or isinstance(threshold, bool):
        raise ConfigError(f"{where}.min_uncached_tokens: expected an integer, got {threshold!r}")
    if profile is not None and not (isinstance(profile, str) and profile):
        raise ConfigError(f"{where}.prefill_profile: expected a profile name, got {profile!r}")
    if not isinstance(timeout, int | float) or isinstance(timeout, bool):
        raise ConfigError(f"{where}.prefill_timeout_s: expected a number of seconds, got {timeout!r}")
    try:
        seconds = float(timeout)
    except OverflowError:  # an integer too large for a float (``1`` then 400 zeros)
        seconds = math.inf  # refused below, as any timeout past the bound
    try:
        return PdSpec(mode, threshold, profile, seconds)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
