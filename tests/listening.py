"""The TCP addresses a process listens on, read from /proc (Linux): for tests of where stores listen."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct

LISTEN = "0A"  # the TCP state in /proc/net/tcp


def _address(hex_address: str) -> str:
    packed = bytes.fromhex(hex_address)
    if len(packed) == 4:
        return socket.inet_ntop(socket.AF_INET, packed[::-1])
    # /proc/net/tcp6 writes the 16 bytes as four 32-bit words in host (little-endian) order
    words = struct.unpack("<4I", packed)
    return socket.inet_ntop(socket.AF_INET6, struct.pack(">4I", *words))


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket that process ``pid`` holds in the listening state."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as handle:
            for line in handle.readlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == LISTEN and inode in inodes:
                    address, port = local.split(":")
                    found.add((_address(address), int(port, 16)))
    return found


def not_loopback(found: set[tuple[str, int]]) -> set[tuple[str, int]]:
    """Those of ``found`` that other machines could reach (the wildcard addresses included)."""
    return {(address, port) for address, port in found if not ipaddress.ip_address(address).is_loopback}
