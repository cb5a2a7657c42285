"""Dev PKI for kvgate: a short-lived CA and per-service leaf certificates (``kvgate certs``).

:mod:`certs.authority` builds certificates from keys and a ``now`` (no IO); :mod:`certs.store` writes
them to a directory (private keys mode 0600, every file replaced atomically, so a rotation never
exposes a half-written file); :mod:`certs.verify` checks a chain the way a TLS peer would;
:mod:`certs.cli` is the command line. Private keys are named ``*.key`` and certificates ``*.pem``,
both ignored by git.
"""
