"""The error every process's configuration and contract checks raise.

    ConfigError      a configuration value, policy value or contract record (an etcd value, an index
                     event field) is missing, of the wrong type, out of range or unknown; the message
                     names the key. Never reaches a client: at the gateway's edge a bad policy value is
                     refused and the last good one stays; at start a bad config exits with status 2.

Each package keeps its own errors (``extproc.errors``, ``agent.errors``, ``kvcached.errors``) and
translates this one with ``raise ... from`` where it needs to.
"""

from __future__ import annotations

import msgspec

#: What decoding untrusted msgpack can raise: msgspec's ``DecodeError`` (``ValidationError`` is one) and,
#: for a string that is not UTF-8, Python's ``UnicodeDecodeError``, which msgspec passes up as it is (found
#: by tests/fuzz: it escaped every ``except msgspec.DecodeError``).
MSGPACK_ERRORS = (msgspec.DecodeError, UnicodeDecodeError)


class ConfigError(Exception):
    """A configuration value is missing, of the wrong type, out of range or unknown."""
