"""Datagrams larger than aioquic was written for: fewer packets per block on loopback or jumbo-frame paths.

aioquic runs its packet loop in Python, so a 1 MiB block costs in proportion to the packets carrying it
(about 30-50 us of Python per packet on each side here). Two of its encodings cap a packet's payload:

- a long-header packet (Initial, Handshake) writes its length as a 2-byte varint (< 16,384), and the
  client pads its Initial to the whole datagram, so the handshake must run with datagrams of at most
  :data:`HANDSHAKE_DATAGRAM_MAX` bytes;
- a STREAM frame writes its data length as a 2-byte varint too, and aioquic puts one frame per stream in
  a packet, so a single stream cannot fill a datagram larger than that either.

:func:`grow_datagrams` is called once the handshake is complete (1-RTT packets carry no length field): it
raises the connection's datagram size, its congestion control's and pacer's, and installs
:func:`_write_stream_frames`, which writes a STREAM frame's length as a 4-byte varint, so one frame fills
a 64 KB packet (one receive event per packet instead of four), and adds further frames while room is left.
The peer needs no change: any varint length, and several STREAM frames in a packet, are ordinary QUIC
(RFC 9000 sections 16 and 12.4), and aioquic receives datagrams of any size.

A datagram must fit the path: loopback's MTU is 65,536 bytes; on a network, ``max_datagram_size`` above
the path MTU minus 28 makes the kernel refuse the send (EMSGSIZE, don't-fragment), so keep the default
1,200 (or 8,972 with 9,000-byte jumbo frames). This touches aioquic internals (pinned by the tests in
``tests/kvcached/test_peers.py``, which exercise every size the configuration accepts).
"""

from __future__ import annotations

from typing import Any

from aioquic.buffer import size_uint_var
from aioquic.quic.congestion.base import K_INITIAL_WINDOW
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import QuicFrameType
from aioquic.quic.packet_builder import QuicPacketBuilder
from aioquic.quic.recovery import QuicPacketSpace
from aioquic.quic.stream import QuicStream

HANDSHAKE_DATAGRAM_MAX = 16_000
"""Largest datagram used before the handshake completes (see the module docstring)."""
_LENGTH_BYTES = 4
_LENGTH_VARINT_4 = 0x8000_0000
"""A STREAM frame's data length is written as a 4-byte varint (aioquic writes 2 bytes: < 16,384)."""
_SMALLEST_USEFUL_FRAME = 512
"""A further STREAM frame in a packet is written only if this much data fits (else the next packet)."""


def grow_datagrams(quic: QuicConnection, size: int) -> None:
    """Send ``size``-byte datagrams on ``quic`` from now on; call once its handshake is complete."""
    if size <= quic._max_datagram_size:
        return
    quic._max_datagram_size = size
    recovery = quic._loss
    cc: Any = recovery._cc
    cc._max_datagram_size = size
    cc.congestion_window = max(cc.congestion_window, K_INITIAL_WINDOW * size)
    recovery._pacer._max_datagram_size = size
    if size > HANDSHAKE_DATAGRAM_MAX:
        quic._write_stream_frame = _write_stream_frames  # type: ignore[method-assign]


def _write_stream_frames(
    builder: QuicPacketBuilder, space: QuicPacketSpace, stream: QuicStream, max_offset: int
) -> int:
    """Write ``stream``'s pending data into the packet as STREAM frames with 4-byte lengths; return the
    new bytes sent (the flow-control credit used), as aioquic's own single-frame writer does."""
    sender, stream_id = stream.sender, stream.stream_id
    assert stream_id is not None  # only streams with an id are ever queued for sending
    before = sender.highest_offset
    first = True
    while True:
        offset = sender.next_offset
        overhead = 1 + _LENGTH_BYTES + size_uint_var(stream_id) + (size_uint_var(offset) if offset else 0)
        room = builder.remaining_flight_space - overhead
        if not first and room < _SMALLEST_USEFUL_FRAME:
            break
        frame = sender.get_frame(room, max_offset)
        if frame is None:
            break
        frame_type = QuicFrameType.STREAM_BASE | 2  # explicit length
        if frame.offset:
            frame_type |= 4
        if frame.fin:
            frame_type |= 1
        end = frame.offset + len(frame.data)
        buf = builder.start_frame(
            frame_type,
            capacity=overhead,
            handler=sender.on_data_delivery,
            handler_args=(frame.offset, end, frame.fin),
        )
        buf.push_uint_var(stream_id)
        if frame.offset:
            buf.push_uint_var(frame.offset)
        buf.push_uint32(len(frame.data) | _LENGTH_VARINT_4)
        buf.push_bytes(frame.data)
        first = False
        if frame.fin or len(frame.data) < room:
            break  # the stream has nothing more now (or flow control stopped it)
    return sender.highest_offset - before
