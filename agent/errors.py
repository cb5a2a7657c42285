"""The error hierarchy of the node agent package.

Everything the agent raises on purpose is an :class:`AgentError`; lower-level errors (``OSError`` from a
spawn, ``contracts.errors.ConfigError`` from the shared TOML helper) are translated with ``raise ... from``
at the boundary that sees them, so callers catch one family.

    AgentError                  any agent failure
    ├── AgentConfigError        the node config is invalid; the message names the key
    │                           (``engines[0].kv_offload: 'hicache' is not supported by vllm; ...``)
    └── EngineError             an engine process could not be run as configured
        ├── EngineStartError    the argv could not be executed (binary missing, not executable, ...)
        └── EngineNotReady      not ready in the time waited, or stopped before its health check said 200
"""

from __future__ import annotations


class AgentError(Exception):
    """Base class of every error the agent raises on purpose."""


class AgentConfigError(AgentError):
    """A node config value is missing, ill-typed, out of range, unknown, or an impossible combination."""


class EngineError(AgentError):
    """An engine could not be rendered, started or supervised; ``engine_id`` names it."""

    def __init__(self, engine_id: str, message: str) -> None:
        super().__init__(f"engine {engine_id}: {message}")
        self.engine_id = engine_id


class EngineStartError(EngineError):
    """The engine's argv could not be executed (the message says why; nothing was started)."""


class EngineNotReady(EngineError):
    """The engine did not become ready within the wait, or was stopped (drained, closed) before it did;
    the message ends with the tail of its log."""
