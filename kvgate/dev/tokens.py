"""JWT signing keys and token minting, including deliberately bad tokens for tests.

:func:`mint` signs claims with a :class:`SigningKey` (what the dev issuer does). The forging helpers
build what an attacker or a broken client would send: :func:`unsigned` (``alg: none``),
:func:`tampered` (claims changed after signing, signature kept), :func:`bad_signature` (signature bytes
altered). Expired or wrong-issuer/audience tokens are just :func:`mint` with those claims.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

ALGORITHMS = ("RS256", "ES256")


@dataclass(frozen=True, slots=True)
class SigningKey:
    """A private signing key and its JWS ``alg``; ``kid`` is the public key's RFC 7638 thumbprint."""

    alg: str
    private: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey

    @classmethod
    def generate(cls, alg: str = "RS256") -> SigningKey:
        """A fresh key: RSA 2048 for RS256, P-256 for ES256."""
        if alg == "RS256":
            return cls(alg, rsa.generate_private_key(65537, 2048))
        if alg == "ES256":
            return cls(alg, ec.generate_private_key(ec.SECP256R1()))
        raise ValueError(f"unsupported alg {alg!r}; expected one of {', '.join(ALGORITHMS)}")

    @classmethod
    def load_or_create(cls, path: Path, alg: str = "RS256") -> SigningKey:
        """The key in ``path`` (PEM, PKCS#8), created there (mode 0600) on first use; the algorithm
        follows the key type."""
        if path.exists():
            private = serialization.load_pem_private_key(path.read_bytes(), password=None)
            if isinstance(private, rsa.RSAPrivateKey):
                return cls("RS256", private)
            if isinstance(private, ec.EllipticCurvePrivateKey) and isinstance(private.curve, ec.SECP256R1):
                return cls("ES256", private)
            raise ValueError(f"{path}: expected an RSA or P-256 private key")
        key = cls.generate(alg)
        pem = key.private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        return key

    def _jwk(self) -> dict[str, Any]:
        if isinstance(self.private, rsa.RSAPrivateKey):
            jwk = RSAAlgorithm.to_jwk(self.private.public_key(), as_dict=True)
        else:
            jwk = ECAlgorithm.to_jwk(self.private.public_key(), as_dict=True)
        return {k: v for k, v in jwk.items() if k in ("kty", "n", "e", "crv", "x", "y")}

    @property
    def kid(self) -> str:
        """RFC 7638 thumbprint: SHA-256 of the required public members, sorted, no whitespace."""
        canonical = json.dumps(self._jwk(), sort_keys=True, separators=(",", ":")).encode()
        return _b64(hashlib.sha256(canonical).digest())

    def public_jwk(self) -> dict[str, Any]:
        """The public key as a JWK (for the JWKS document)."""
        return {**self._jwk(), "kid": self.kid, "use": "sig", "alg": self.alg}


def mint(claims: dict[str, Any], key: SigningKey, headers: dict[str, Any] | None = None) -> str:
    """A signed JWT (compact form) carrying exactly ``claims``."""
    return jwt.encode(claims, key.private, algorithm=key.alg, headers={"kid": key.kid, **(headers or {})})


def unsigned(claims: dict[str, Any]) -> str:
    """An ``alg: none`` token: header and claims, empty signature."""
    return f"{_b64(json.dumps({'alg': 'none', 'typ': 'JWT'}).encode())}.{_b64(json.dumps(claims).encode())}."


def tampered(token: str, **changes: Any) -> str:
    """``token`` with claims changed after signing (the original signature kept)."""
    header, payload, signature = token.split(".")
    claims = {**json.loads(_unb64(payload)), **changes}
    return f"{header}.{_b64(json.dumps(claims).encode())}.{signature}"


def bad_signature(token: str) -> str:
    """``token`` with its signature altered (first byte flipped)."""
    header, payload, signature = token.split(".")
    raw = bytearray(_unb64(signature))
    raw[0] ^= 0xFF
    return f"{header}.{payload}.{_b64(bytes(raw))}"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
