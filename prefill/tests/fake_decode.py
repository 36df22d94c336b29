"""A stand-in for the decode server's gRPC face, for tests of the send path alone: Hello as the
decode server answers it (prefill.ticket.mismatch, the same check), commits recorded. A test
may hold Hello back (`hello_gate`) to play a server that does not answer, and slow its commits
(`commit_delay_s`)."""

from __future__ import annotations

import threading
import time

import grpc

from prefill.ticket import mismatch
from proto.tandem.v1 import decode_pb2, decode_pb2_grpc, layout_pb2


class FakeDecode(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, layout: layout_pb2.LayoutDescriptor) -> None:
        self.layout = layout
        self.commits: list[decode_pb2.CommitRequest] = []
        self.hellos = 0
        self.hello_gate = threading.Event()
        self.hello_gate.set()
        self.commit_delay_s = 0.0

    def Hello(self, request, context):
        self.hellos += 1
        self.hello_gate.wait()
        problem = mismatch(self.layout, request.sender_layout)
        if problem:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot write here: {problem}")
        return decode_pb2.HelloResponse(decode_layout=self.layout)

    def Commit(self, request, context):
        time.sleep(self.commit_delay_s)
        self.commits.append(request)
        return decode_pb2.CommitResponse(committed_senders=1, expected_senders=1)
