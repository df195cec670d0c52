"""Which local address and network interface reach another host (Linux, standard library only).

A job on several hosts cannot always trust the hostname: on many machines it resolves to a
loopback address (Debian's 127.0.1.1, containers' 127.0.0.1) or not at all. Rank 0 would then
advertise a rendezvous no other host can reach, and Gloo would bind to loopback. launch.py asks
here instead; nothing here talks to the network (a UDP `connect` only consults the routing table).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import Iterable

_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address


def addresses() -> dict[str, str]:
    """This host's interfaces that have an IPv4 address: name -> address (loopback included)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on this interface
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def is_loopback(addr: str) -> bool:
    return ipaddress.ip_address(addr).is_loopback


def source_address(dest: str) -> str:
    """The local address this host sends from to reach `dest` (the routing table's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((dest, 9))  # UDP: no packet leaves
        return s.getsockname()[0]


def interface_for(dest: str) -> str | None:
    """The interface this host reaches `dest` through; None when there is no route or no such interface."""
    try:
        src = source_address(socket.gethostbyname(dest))
    except OSError:
        return None
    return next((name for name, addr in addresses().items() if addr == src), None)


def host_address() -> str | None:
    """The hostname's IPv4 address; None when it does not resolve or resolves to loopback."""
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:
        return None
    return None if is_loopback(addr) else addr


def reachable_address(peers: Iterable[str]) -> str | None:
    """The local address that routes to the first of `peers` on another host; None without one.

    A peer address that this host has too (loopback, or docker0's 172.17.0.1 present on
    every host) says nothing about the network between hosts, so it is skipped.
    """
    own = set(addresses().values())
    for peer in peers:
        if peer in own or is_loopback(peer):
            continue
        try:
            src = source_address(peer)
        except OSError:
            continue
        if src in own and not is_loopback(src):
            return src
    return None
