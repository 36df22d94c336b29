"""The standard gRPC health service (grpc.health.v1.Health, `Check`), which Kubernetes' gRPC
probes and grpc_health_probe call: SERVING while `serving()` says so, NOT_SERVING otherwise
(a decode server: its engine failed, or it drains). `Watch` answers UNIMPLEMENTED (probes do not
use it). Its two messages have one field each (HealthCheckRequest.service, a string;
HealthCheckResponse.status, an enum), so they are encoded here by hand: no generated module for
one varint.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

SERVICE = "grpc.health.v1.Health"
SERVING, NOT_SERVING, SERVICE_UNKNOWN = 1, 2, 3


def handler(serving: Callable[[], bool], services: tuple[str, ...] = ()) -> grpc.GenericRpcHandler:
    """The health service for grpc.server.add_generic_rpc_handlers. `services`: the names a
    request may ask about besides "" (the whole server); any other is SERVICE_UNKNOWN."""

    def check(request: str, context) -> int:
        if request and request not in services:
            return SERVICE_UNKNOWN
        return SERVING if serving() else NOT_SERVING

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Check": grpc.unary_unary_rpc_method_handler(
                check, request_deserializer=decode_request, response_serializer=encode_status
            )
        },
    )


def encode_status(status: int) -> bytes:
    """HealthCheckResponse{status}: field 1, varint (all statuses are below 128)."""
    return bytes([0x08, status])


def decode_request(data: bytes) -> str:
    """HealthCheckRequest.service: field 1, length-delimited; "" when absent. Other fields (none
    are defined) are refused."""
    if not data:
        return ""
    if data[0] != 0x0A:
        raise ValueError("HealthCheckRequest: only field 1 (service) is defined")
    length, offset = _varint(data, 1)
    return data[offset : offset + length].decode()


def encode_request(service: str = "") -> bytes:
    """HealthCheckRequest{service}, for clients (tests, probes)."""
    raw = service.encode()
    return b"\x0a" + _encode_varint(len(raw)) + raw if raw else b""


def decode_status(data: bytes) -> int:
    """HealthCheckResponse.status (0, UNKNOWN, when absent)."""
    return data[1] if len(data) >= 2 and data[0] == 0x08 else 0


def _varint(data: bytes, offset: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[offset]
        value |= (byte & 0x7F) << shift
        offset += 1
        if not byte & 0x80:
            return value, offset
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)
