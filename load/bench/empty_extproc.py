"""An empty ext_proc: the floor under kvgate's gateway overhead (``load.bench.overhead``'s ``empty`` target).

    python -m load.bench.empty_extproc --port 0 --ready-file F --upstream 127.0.0.1:PORT

A grpc.aio server on uvloop (as kvgate's ext_proc runs) with the services the bundled Envoy bootstrap
(:func:`kvgate.envoy.bootstrap.render`) calls on its ext_proc cluster, doing nothing beyond the protocol:

* ``envoy.service.ext_proc.v3.ExternalProcessor/Process``: each message gets the minimal valid reply for
  its phase, in the pattern kvgate's processor (:mod:`extproc.processor`) uses. FULL_DUPLEX_STREAMED
  request body (the bundled default): the request headers are held until the body's end, then the
  headers reply routes to ``--upstream`` the way kvgate does (header ``x-gateway-destination-endpoint``,
  ``content-length``, ``envoy.lb`` dynamic metadata with the destination and the primary, route cache
  cleared) and the body is streamed back unchanged in chunks of at most 62,000 bytes. BUFFERED body
  mode (Envoy says so on the request headers; the bundled ``--fail-open`` config): the headers get an
  empty reply and the whole-body reply carries the same routing. A body-less request is routed at its
  headers. Request trailers, response headers, body and trailers: an empty reply of their kind. A
  message of no known kind fails the stream (``INVALID_ARGUMENT``): Envoy, failing closed, answers 503.
  No decision metadata (``kvgate.decision``), model or timeout headers: there is no decision.
* ``EndpointDiscoveryService/StreamEndpoints`` for ``kvgate_engines``: the one ``--upstream`` (Envoy's
  ``override_host`` balancer sends only to hosts its cluster lists), built by kvgate's own EDS code.
* gRPC health: every service ``SERVING`` (Envoy health-checks ``liveness``).

Once serving, the ready file gets ``{"extproc": PORT, "pid": PID}``; SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.struct_pb2 import Struct
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contracts.epp import DESTINATION, LB_NS, MAX_CHUNK, PRIMARY
from extproc.xds.eds import HEALTHY, SotwStream, snapshot, socket_address
from runtime.lifecycle import stop_on_signals, write_ready_file

#: Largest gRPC message either way (bytes): Envoy forwards body data in chunks as large as its buffer.
MESSAGE_LIMIT = 64 * 1024 * 1024


class UnexpectedMessage(ValueError):
    """A ``ProcessingRequest`` with no phase this processor knows."""


class EmptyStream:
    """One Envoy HTTP stream, sans IO: :meth:`handle` takes each ``ProcessingRequest`` and returns the
    replies to send, in order. Every routed request goes to ``upstream`` (``ip:port``)."""

    def __init__(self, upstream: str) -> None:
        self._upstream = upstream
        self._buffered = False
        self._in_body = False
        self._chunks: list[bytes] = []

    def handle(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The replies to ``msg``; :class:`UnexpectedMessage` for a message of no known phase."""
        which = msg.WhichOneof("request")
        if which == "request_headers":
            self._buffered = msg.protocol_config.request_body_mode == ProcessingMode.BUFFERED
            if msg.request_headers.end_of_stream:
                return [self._routed_headers(0)]
            self._in_body = True
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())] if self._buffered else []
        if which == "request_body":
            if self._buffered:
                self._in_body = False
                return [self._routed_body(len(msg.request_body.body))]
            self._chunks.append(msg.request_body.body)
            return self._release() if msg.request_body.end_of_stream else []
        if which == "request_trailers":
            out = self._release() if self._in_body else []
            return [*out, pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if which == "response_headers":
            return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]
        if which == "response_body":
            return [pb.ProcessingResponse(response_body=pb.BodyResponse())]
        if which == "response_trailers":
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        raise UnexpectedMessage(f"unexpected ext_proc message: {which}")

    def _release(self) -> list[pb.ProcessingResponse]:
        """The body's end (streamed mode): the routed headers reply, then the body back in chunks."""
        self._in_body = False
        body, self._chunks = b"".join(self._chunks), []
        out = [self._routed_headers(len(body))]
        if not body:
            out.append(_body_chunk(b"", True))
        for off in range(0, len(body), MAX_CHUNK):
            out.append(_body_chunk(body[off : off + MAX_CHUNK], off + MAX_CHUNK >= len(body)))
        return out

    def _routing(self, length: int) -> tuple[pb.CommonResponse, Struct]:
        """The mutation and metadata kvgate's processor sends a routed request, for ``upstream``."""
        mutation = pb.HeaderMutation(
            set_headers=[_header(DESTINATION, self._upstream), _header("content-length", str(length))]
        )
        metadata = Struct()
        metadata.update({LB_NS: {DESTINATION: self._upstream, PRIMARY: self._upstream}})
        return pb.CommonResponse(header_mutation=mutation, clear_route_cache=True), metadata

    def _routed_headers(self, length: int) -> pb.ProcessingResponse:
        common, metadata = self._routing(length)
        return pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata
        )

    def _routed_body(self, length: int) -> pb.ProcessingResponse:
        common, metadata = self._routing(length)
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata)


def _header(key: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(
        header=HeaderValue(key=key, raw_value=value.encode()),
        append_action=HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _body_chunk(data: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    streamed = pb.StreamedBodyResponse(body=data, end_of_stream=end_of_stream)
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(
            response=pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed))
        )
    )


class EmptyProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """``Process``: one :class:`EmptyStream` per Envoy stream, its replies sent as they come."""

    def __init__(self, upstream: str) -> None:
        self._upstream = upstream

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        stream = EmptyStream(self._upstream)
        async for msg in request_iterator:
            try:
                replies = stream.handle(msg)
            except UnexpectedMessage as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            for reply in replies:
                yield reply


class OneEndpoint(eds_pb2_grpc.EndpointDiscoveryServiceServicer):  # type: ignore[misc]
    """State-of-the-world EDS of ``kvgate_engines`` holding ``upstream`` alone, healthy, never changing."""

    def __init__(self, upstream: str) -> None:
        self._snapshot = snapshot(((upstream, HEALTHY),))

    async def StreamEndpoints(
        self,
        request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        stream = SotwStream()
        async for req in request_iterator:
            stream.request(req)
            resp = stream.response(self._snapshot)
            if resp is not None:
                yield resp


class Serving(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """gRPC health: every service is ``SERVING`` while the process runs."""

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def start_server(upstream: str, port: int = 0) -> tuple[grpc.aio.Server, int]:
    """The three services on ``127.0.0.1:port`` (0: any free port), started; the server and its port."""
    options = [
        ("grpc.max_receive_message_length", MESSAGE_LIMIT),
        ("grpc.max_send_message_length", MESSAGE_LIMIT),
    ]
    server = grpc.aio.server(options=options)
    pb_grpc.add_ExternalProcessorServicer_to_server(EmptyProcessor(upstream), server)
    eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server(OneEndpoint(upstream), server)
    health_pb2_grpc.add_HealthServicer_to_server(Serving(), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound


async def serve(upstream: str, port: int, ready_file: Path | None) -> int:
    """Serve until SIGINT/SIGTERM; the ready file (if any) gets the bound port and this PID."""
    server, bound = await start_server(upstream, port)
    if ready_file is not None:
        write_ready_file(ready_file, {"extproc": bound, "pid": os.getpid()})
    stop = asyncio.Event()
    stop_on_signals(stop)
    await stop.wait()
    await server.stop(1.0)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m load.bench.empty_extproc``: 0 after a signal, 2 for an ``--upstream`` not ``ip:port``."""
    p = argparse.ArgumentParser(
        prog="python -m load.bench.empty_extproc", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--port", type=int, default=0, help="gRPC port on 127.0.0.1 (0: any free port)")
    p.add_argument("--ready-file", type=Path, help="written (JSON: extproc port, pid) once serving")
    p.add_argument("--upstream", required=True, help="ip:port every request is routed to")
    args = p.parse_args(argv)
    if socket_address(args.upstream) is None:
        print(f"--upstream must be ip:port, got {args.upstream!r}", file=sys.stderr)
        return 2
    import uvloop

    try:
        return uvloop.run(serve(args.upstream, args.port, args.ready_file))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
