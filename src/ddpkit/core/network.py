"""Which network interface a job's processes use to reach each other, and the host-name trap gloo falls into.

gloo (the CPU backend, and the group ddpkit keeps beside NCCL for small messages) picks the address it
advertises to the other processes from this machine's host name, unless ``GLOO_SOCKET_IFNAME`` names an
interface. Many machines map their own name to a loopback address in ``/etc/hosts`` (127.0.1.1 on Debian
and Ubuntu, 127.0.0.1 on some cloud images): harmless on one machine, but across machines each node would
tell the others to reach it at 127.0.x.x, and node 0 fails with "connectFullMesh failed" while the others
hang. ``gloo_interface`` picks the interface that reaches the other nodes instead (or says which to set).

Stores. PyTorch's ``TCPStore`` server listens on every interface of the machine whatever host name it is given,
so anyone who can reach the port could join a rendezvous or write to a job's store. It does accept a listening
socket of one's own (``master_listen_fd``): ``store_on`` binds one to the address that must be reachable, and
no other (``bind_address`` says which).

    >>> from ddpkit.core import network
    >>> network.interface_for("127.0.0.1")["interface"]
    'lo'
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import socket

import torch.distributed as dist

from ddpkit.core.errors import UsageError
from ddpkit.core.version import torch_at_least

GLOO_VARIABLE = "GLOO_SOCKET_IFNAME"
LOOPBACK = "127.0.0.1"
PROBE_TIMEOUT_S = 3.0  # a connection to a host that answers takes milliseconds; a cut network, forever


def interface_for(address: str) -> dict:
    """The local address and interface this machine uses to reach ``address`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((socket.gethostbyname(address), 9))
        except OSError as error:
            return {"address": None, "interface": None, "error": str(error)}
        local = probe.getsockname()[0]
    return {"address": local, "interface": interface_with(local)}


def addresses() -> dict[str, str]:
    """Every interface of this machine that has an IPv4 address: name -> address."""
    import fcntl
    import struct

    found = {}
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock, contextlib.suppress(OSError):
            packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def interface_with(ip: str) -> str | None:
    """The interface that holds the IPv4 address ``ip``, or None."""
    return next((name for name, address in addresses().items() if address == ip), None)


def is_loopback(address: str | None) -> bool:
    """Whether ``address`` is a loopback IP address (IPv4 or IPv6, brackets allowed); a name (not resolved here) or
    None is not."""
    if address is None:
        return False
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def resolve(host: str) -> str | None:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def own_name_address() -> tuple[str, str | None]:
    """This machine's host name and the address it resolves to here (None: it does not resolve)."""
    name = socket.gethostname()
    return name, resolve(name)


def gloo_interface(peer: str) -> tuple[str, str] | None:
    """For a job across machines whose other nodes are reached through ``peer`` (node 0, or the rendezvous
    host): the (interface, address) gloo must use when this machine's name resolves to a loopback address, or
    None when gloo's own choice is right (or ``GLOO_SOCKET_IFNAME`` is set already: call only without it).

    The interface is the one the route to ``peer`` leaves by; on the machine that is ``peer`` itself, the only
    interface besides loopback. A ``peer`` that is a loopback address (every node on this machine): None. Several candidates and no route to tell them apart: a UsageError naming them.
    """
    name, address = own_name_address()
    if address is not None and not is_loopback(address):
        return None
    if peer != name and is_loopback(resolve(peer)):  # "nodes" that all run on this machine: loopback is right
        return None
    route = interface_for(peer)
    if route["interface"] is not None and not is_loopback(route["address"]):
        return route["interface"], route["address"]
    others = {iface: ip for iface, ip in sorted(addresses().items()) if not is_loopback(ip)}
    if len(others) == 1:
        return next(iter(others.items()))
    what = f"resolves to {address}, a loopback address," if address else "does not resolve, so"
    choices = ", ".join(f"{iface} ({ip})" for iface, ip in others.items()) or "none found"
    raise UsageError(f"this machine's name {name} {what} which gloo would advertise to the other nodes; set "
                     f"{GLOO_VARIABLE} (and NCCL_SOCKET_IFNAME on GPUs) to the interface that reaches them "
                     f"(this machine's: {choices})")


def loopback_name_warning() -> str | None:
    """One line for ``ddpkit doctor`` when this machine's name resolves to a loopback address and
    ``GLOO_SOCKET_IFNAME`` does not say which interface to use; None otherwise."""
    name, address = own_name_address()
    if address is not None and not is_loopback(address):
        return None
    resolves = f"resolves to {address} (loopback)" if address else "does not resolve"
    return (f"host name {name} {resolves}: fine on one machine, but across machines gloo would advertise it; "
            f"ddpkit train/run pick the interface that reaches node 0, or set {GLOO_VARIABLE}")


def answers(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether ``host`` accepts (or refuses) a TCP connection to ``port`` within ``timeout_s``: its network is
    up. A refusal counts, as it comes from the host; silence or "unreachable" do not."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def listening_socket(address: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on ``address`` only (IPv4 or IPv6), for TCPStore's ``master_listen_fd``."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    return socket.create_server((address, port), family=family)


def store_on(address: str, *, port: int = 0, world_size: int | None = None, timeout_s: float,
             wait_for_workers: bool = True) -> dist.TCPStore:
    """A TCPStore server that listens on ``address`` only (port 0: a free one, ``store.port`` says which)."""
    try:
        listener = listening_socket(address, port)
    except OSError as error:  # as PyTorch's own store says it, which the launcher turns into one line
        reason = os.strerror(error.errno) if error.errno else str(error)
        raise dist.DistNetworkError(f"cannot listen on {address}:{port}: {reason}") from None
    chosen_port = listener.getsockname()[1]
    # The store takes the descriptor over and closes it with itself: the Python object lets go of it. libuv's
    # server (the default since torch 2.4) takes a listening descriptor only from torch 2.8 (pytorch#150215);
    # before, the legacy server does.
    legacy = {} if torch_at_least("2.8") else {"use_libuv": False}
    return dist.TCPStore(address, chosen_port, world_size, is_master=True,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=wait_for_workers,
                         master_listen_fd=listener.detach(), **legacy)


def bind_address(host: str, *, one_machine: bool) -> str | None:
    """Where a store that the ranks reach as ``host`` listens on this machine: the address ``host`` resolves
    to, when it is one of this machine's interfaces, or (``one_machine``) a loopback address. None: neither
    (every interface then, as PyTorch's stores)."""
    address = resolve(host)
    if address is None:
        return None
    if is_loopback(address):
        # Across machines a name that resolves to loopback here is the other nodes' way to this one (the trap
        # choose_gloo_interface handles): they would not reach it there.
        return address if one_machine else None
    return address if address in addresses().values() else None
