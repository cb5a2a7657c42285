"""What the engines package raises, and who translates it.

    contracts.errors.ConfigError   a kind x role x kv_offload outside the kind's offload matrix, or an
                                   unknown kind (:func:`engines.kinds.check_combination`); the message
                                   names the key and the allowed values
    ArtifactNotFound               a local artifact a kind's renderer needs (the ``llama-server`` binary,
                                   the SmolLM2 GGUF) is not installed

The node agent, the one caller that renders, turns both into its own errors with ``raise ... from``
(:mod:`agent.launch`, :mod:`agent.config`), so callers above it still catch one family.
"""

from __future__ import annotations


class ArtifactNotFound(Exception):
    """A file a renderer needs is missing. ``subject`` names what needed it (an engine id, or a kind when
    no one engine is to blame); ``detail`` says what is missing and how to install it."""

    def __init__(self, subject: str, detail: str) -> None:
        super().__init__(f"{subject}: {detail}")
        self.subject = subject
        self.detail = detail
