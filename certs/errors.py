"""Errors of the certs package.

CertError        a certificate cannot be built, read, written or verified (message says which)
"""

from __future__ import annotations


class CertError(Exception):
    """A certificate or key cannot be built, read, written or verified; the message names the file."""
