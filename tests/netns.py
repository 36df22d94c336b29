"""Hosts of their own for the suites that run tandem across machines (as root): a network
namespace per host, each with its own address on a bridge (the switch, in a namespace of its
own), and this test process's host on it too. Removing the namespaces removes their links."""

from __future__ import annotations

import os
import subprocess

TEST_HOST = 254
"""The test process's own number on the bridge."""


class Network:
    def __init__(self, name: str, hosts: dict[str, int]) -> None:
        """`hosts`: host name -> its number on the subnet (1..253). `name`: a prefix (at most 4
        characters) for the namespaces and links; the subnet is this process's own."""
        self.tag = f"{name}{os.getpid() % 10000}"
        self.subnet = f"10.{77 + os.getpid() % 100}.{os.getpid() % 250}"
        self.hosts = hosts

    def address(self, host: str) -> str:
        return f"{self.subnet}.{self.hosts[host]}"

    @property
    def test_address(self) -> str:
        return f"{self.subnet}.{TEST_HOST}"

    def on(self, host: str, own_sysfs: bool = True) -> tuple[str, ...]:
        """The prefix that runs a command on `host`: `ip netns exec`, which mounts a /sys of the
        namespace's own (its network devices in /sys/class/net); or, not `own_sysfs`, only
        the network namespace entered, the machine's /sys kept (its cgroups, which a daemon
        such as slurmd needs)."""
        if own_sysfs:
            return ("ip", "netns", "exec", self.namespace(host))
        return ("nsenter", f"--net=/run/netns/{self.namespace(host)}")

    def namespace(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def make(self) -> None:
        switch = self.namespace("switch")
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for host, number in self.hosts.items():
            ns = self.namespace(host)
            _ip("netns", "add", ns)
            _ip("link", "add", self.link(host), "type", "veth", "peer", "name", "eth0",
                "netns", ns)  # fmt: skip
            _ip("link", "set", self.link(host), "netns", switch)
            _ip("-n", switch, "link", "set", self.link(host), "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.subnet}.{number}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        own = f"{self.tag}t"
        _ip("link", "add", own, "type", "veth", "peer", "name", f"{own}-h", "netns", switch)
        _ip("-n", switch, "link", "set", f"{own}-h", "master", "br0", "up")
        _ip("addr", "add", f"{self.test_address}/24", "dev", own)
        _ip("link", "set", own, "up")

    def remove(self) -> None:
        """Each namespace, and with it the links it holds (and their peers)."""
        for name in (*self.hosts, "switch"):
            subprocess.run(["ip", "netns", "del", self.namespace(name)], capture_output=True)

    def link(self, host: str) -> str:
        """The switch's end of a host's link (at most 15 characters, as Linux wants)."""
        return f"{self.tag}{host[0]}{host[-1]}"

    def cut(self, host: str, down: bool) -> None:
        """Takes the host's link down (or up again)."""
        _ip("-n", self.namespace("switch"), "link", "set", self.link(host),
            "down" if down else "up")  # fmt: skip


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)
