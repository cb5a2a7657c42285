"""The one error a power source raises: :class:`PowerSourceError`, its message fit for logs and status."""

from __future__ import annotations


class PowerSourceError(Exception):
    """A source could not give a reading: unreachable, refused (credentials), timed out, or it answered
    something that is not a reading. The message never holds credentials."""
