"""A "host" on this machine that shares nothing with the test's others but the ports it is given:
a network namespace of its own (`ip netns`), joined to this one by a veth pair, in which only the
listed services are reachable, each at the host side's address through a `socat` forwarder to
where it really listens. A process started with `Host.prefix` runs in it: its 127.0.0.1 is its
own, and the API, the other hosts and everything else of this machine are out of its reach.

Needs root (CAP_NET_ADMIN: CI runs the suite as root) and `ip` (iproute2) and `socat`:
`require_netns()` fails the test, naming what is missing, never skips.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial

import pytest

from tests.servers import require_binary, stop, wait_until


def require_netns() -> None:
    require_binary("ip")
    require_binary("socat")
    if os.geteuid() != 0:
        pytest.fail("network namespaces need root (CAP_NET_ADMIN): run this test as root", pytrace=False)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@dataclass
class Host:
    name: str  # the namespace's (and its veth pair's) name
    address: str  # where the host's processes reach the forwarded services (the veth's host side)
    forwarders: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def prefix(self) -> list[str]:
        """The argv prefix that runs a command in this host's namespace."""
        return ["ip", "netns", "exec", self.name]

    def reaches(self, port: int, address: str | None = None) -> bool:
        """Whether a TCP connection from inside the namespace to `address:port` succeeds."""
        target = address or self.address
        probe = f"import socket; socket.create_connection(({target!r}, {port}), timeout=1)"
        out = subprocess.run([*self.prefix, "python3", "-c", probe], capture_output=True)
        return out.returncode == 0


@contextlib.contextmanager
def isolated_host(forward: dict[int, tuple[str, int]]) -> Iterator[Host]:
    """A namespace in which `address:port` reaches `forward[port]` (host, port) of this machine,
    and nothing else does; removed (veth, forwarders, namespace) when the block ends."""
    require_netns()
    tag = secrets.token_hex(3)
    name, subnet = f"lq{tag}", 16 + int(tag, 16) % 200  # 10.252.<subnet>.0/30, one per host
    outside, inside = f"10.252.{subnet}.1", f"10.252.{subnet}.2"
    host = Host(name=name, address=outside)
    _ip("netns", "add", name)
    try:
        _ip("link", "add", f"{name}h", "type", "veth", "peer", "name", f"{name}n")
        _ip("link", "set", f"{name}n", "netns", name)
        _ip("addr", "add", f"{outside}/30", "dev", f"{name}h")
        _ip("link", "set", f"{name}h", "up")
        _ip("netns", "exec", name, "ip", "addr", "add", f"{inside}/30", "dev", f"{name}n")
        _ip("netns", "exec", name, "ip", "link", "set", f"{name}n", "up")
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        for port, (target, target_port) in forward.items():
            proc = subprocess.Popen(
                ["socat", f"TCP-LISTEN:{port},bind={outside},fork,reuseaddr", f"TCP:{target}:{target_port}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
            host.forwarders.append(proc)
            wait_until(partial(host.reaches, port), f"socat for port {port}", proc, timeout=20)
        yield host
    finally:
        for proc in host.forwarders:
            stop(proc, grace=5)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", f"{name}h")  # takes its peer with it
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("netns", "del", name)


@dataclass(frozen=True)
class Link:
    """A direct link between two hosts' namespaces (a veth pair): each end's address and device."""

    addresses: tuple[str, str]
    devices: tuple[str, str]


@contextlib.contextmanager
def linked(a: Host, b: Host) -> Iterator[Link]:
    """A veth pair from `a`'s namespace to `b`'s, on a /30 of their own: what two machines on one
    network have (every port of each reachable from the other), which the ranks of a job on both
    need (a rendezvous port and the collectives' own ports). Removed when the block ends."""
    subnet = 16 + int(a.name[2:], 16) % 200  # 10.253.<subnet>.0/30
    link = Link(addresses=(f"10.253.{subnet}.1", f"10.253.{subnet}.2"), devices=(f"{a.name}p", f"{b.name}p"))
    _ip("link", "add", link.devices[0], "netns", a.name, "type", "veth", "peer", "name", link.devices[1],
        "netns", b.name)  # fmt: skip
    try:
        for host, address, device in zip((a, b), link.addresses, link.devices, strict=True):
            _ip("netns", "exec", host.name, "ip", "addr", "add", f"{address}/30", "dev", device)
            _ip("netns", "exec", host.name, "ip", "link", "set", device, "up")
        yield link
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("netns", "exec", a.name, "ip", "link", "del", link.devices[0])  # takes its peer with it


def kill_host(host: Host) -> None:
    """SIGKILL every process in the host's namespace, as a machine that loses power: its worker,
    torchrun and ranks (which run in sessions of their own) all at once."""
    out = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True, check=True)
    for pid in out.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
