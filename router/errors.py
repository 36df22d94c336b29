"""The router's errors, each carrying the HTTP status to answer with, and OpenAI's error body
(`error_body`, the one place that builds it): every 4xx and 5xx the router answers carries it,
and so does the error event that ends a failed stream."""

from __future__ import annotations


class RequestError(Exception):
    """A request that cannot be served as asked (the client's fault): answered with `status`
    and an error body whose `param` names the offending field, if one is."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


class BackendError(Exception):
    """The request could not be served by the prefill and decode instances; `status` is the
    HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """{"error": {message, type, param, code}}: type "invalid_request_error" for a 4xx,
    "server_error" for a 5xx."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
