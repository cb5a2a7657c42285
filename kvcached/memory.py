"""Keep freed block buffers in the process: glibc malloc settings for a daemon that moves megabyte blocks.

Every block that kvcached serves, fetches or verifies passes through fresh buffers of up to a few MiB
(the decrypted packet, the stream's chunks, the joined payload, the gRPC message). With glibc's defaults,
buffers above the mmap threshold are mapped and unmapped on each use, and the heap top is trimmed back to
the kernel whenever more than twice that is free, so the next buffer is faulted in again page by page:
about 256 faults per MiB, and on the 1 MiB QUIC fetch here that was a third of the client's CPU time
(measured with ``load/bench/kvcached_peers.py``: 4.3 ms of CPU per fetch with the defaults, 2.6 ms with
the settings below).

:func:`tune_malloc` raises the mmap threshold to :data:`MMAP_THRESHOLD_BYTES` (32 MiB, glibc's own upper
bound for its dynamic threshold, so a slot-sized buffer still comes from the heap), the trim threshold to
:data:`TRIM_THRESHOLD_BYTES` and the top pad to :data:`TOP_PAD_BYTES`. The cost is memory held: up to the
trim threshold of freed heap stays mapped in the daemon (the RAM tier's budget is separate and unchanged).

It is process-wide, so only entry points call it (the daemon, and the peer benchmark's two processes,
which stand for two daemons); the library classes never do. On a C library without ``mallopt`` (musl,
macOS) it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 256 * 1024 * 1024
TOP_PAD_BYTES = 64 * 1024 * 1024
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc's <malloc.h>


def tune_malloc() -> bool:
    """Apply the settings above to this process's glibc malloc; ``False`` (and a debug line) if there is
    no glibc ``mallopt`` or it refuses one."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.debug("no mallopt in this C library: malloc left as it is")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
        (_M_TOP_PAD, TOP_PAD_BYTES),
    )
    ok = all(mallopt(option, value) == 1 for option, value in settings)
    if not ok:
        log.debug("mallopt refused a setting: malloc partly tuned")
    return ok
