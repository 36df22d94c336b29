"""gRPC keepalive for tandem's channels and its decode server: a peer that vanishes without
closing its connections (a host down, a link cut, a network partition) fails the calls in flight
within KEEPALIVE_S + KEEPALIVE_TIMEOUT_S seconds instead of leaving them waiting on a socket
that TCP keeps retransmitting to for many minutes. Measured without it: a streamed completion
whose decode server's link was cut hung for as long as it was watched (100 s), and the decode
server kept generating for a client it could no longer reach.

Both ends ping while calls are open: the client to fail its calls, the server to cancel the
calls of a client it cannot reach (their context ends, so the request is aborted and its KV
blocks freed). The server accepts the clients' pings at their rate, even on a stream that
carries no data for a while (a Generate waiting for its prefill's commits).
"""

KEEPALIVE_S = 10
KEEPALIVE_TIMEOUT_S = 5

_COMMON = [
    ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000),
    ("grpc.http2.max_pings_without_data", 0),  # a quiet stream is still pinged
]

CHANNEL_OPTIONS = [
    *_COMMON,
    ("grpc.keepalive_permit_without_calls", 0),
    # A peer that went away and came back on its address (restarted, rescheduled) is reconnected
    # within a second: gRPC's default backoff grows to two minutes between attempts.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
"""For grpc.insecure_channel / grpc.aio.insecure_channel(address, options=...)."""

SERVER_OPTIONS = [
    *_COMMON,
    ("grpc.keepalive_permit_without_calls", 1),
    # Accepts a ping every half period (the clients ping every KEEPALIVE_S), and never answers
    # pings with GOAWAY ("too_many_pings"), which would fail the very calls being kept alive.
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_S * 500),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_S * 500),
    ("grpc.http2.max_ping_strikes", 0),
]
"""For grpc.server(..., options=...)."""
