"""What the conformance suite cannot see of the mooncake backend: protocol="rdma" is refused
where Mooncake would silently run over TCP, bad construction arguments are refused, and close()
really stops Mooncake's engine."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

pytest.importorskip("mooncake.engine")

import transport
from transport.base import TransferError, WriteOp
from transport.memory import HostBuffer
from transport.mooncake.backend import MooncakeTransport

RDMA_SYSFS = "/sys/class/infiniband"
HAS_RDMA = os.path.isdir(RDMA_SYSFS) and bool(os.listdir(RDMA_SYSFS))


@pytest.mark.skipif(HAS_RDMA, reason="this host has an RDMA device")
def test_rdma_without_a_device_is_refused_naming_the_fix():
    threads = threading.active_count()
    with pytest.raises(ValueError, match="no RDMA device") as refused:
        transport.create("mooncake", protocol="rdma")
    assert "silently run over TCP" in str(refused.value)
    assert "use protocol='tcp'" in str(refused.value)
    assert "install and configure an RDMA NIC" in str(refused.value)
    assert threading.active_count() == threads  # refused before anything started


def test_rdma_device_filter_that_matches_no_device_is_refused():
    with pytest.raises(ValueError, match="no RDMA device named 'tandem-no-such-hca'"):
        MooncakeTransport(protocol="rdma", device_name="tandem-no-such-hca")


def test_bad_arguments_are_refused_naming_them():
    with pytest.raises(ValueError, match="protocol: 'udp'"):
        MooncakeTransport(protocol="udp")
    with pytest.raises(ValueError, match="device_name"):
        MooncakeTransport(device_name="mlx5_0")
    with pytest.raises(ValueError, match="unknown options window"):
        MooncakeTransport(window=8)


def test_tcp_needs_the_peer_to_receive():
    with MooncakeTransport() as agent:
        assert agent.one_sided is False


def test_close_stops_the_engine_even_while_a_failed_transfer_is_kept():
    buffer = HostBuffer(4096)
    receiver, sender = MooncakeTransport(), MooncakeTransport()
    receiver.register(buffer.addr, buffer.nbytes)
    sender.register(buffer.addr, buffer.nbytes)
    peer = sender.connect(receiver.endpoint(), time.monotonic() + 5)
    receiver.close()
    failed = sender.write(peer, [WriteOp(buffer.addr, buffer.addr, 4096)], time.monotonic() + 5)
    with pytest.raises(TransferError):
        failed.wait()
    host, port = json.loads(sender.endpoint())["session"].rsplit(":", 1)
    sender.close()
    # Mooncake's handshake listener goes with its engine: nothing may still hold the engine.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=1).close()
    assert failed.error() is not None
    buffer.close()
