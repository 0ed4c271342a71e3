"""A one-machine job's stores, listening on loopback only.

PyTorch's ``TCPStore`` server listens on every interface of the machine whatever host name it is given,
so anyone who can reach the port could join a rendezvous or write to a job's store. It does accept a
listening socket of one's own (``master_listen_fd``): ``loopback_store`` binds one to 127.0.0.1.

``ddpkit train`` and ``ddpkit run`` on one machine use the rendezvous registered here under
``BACKEND`` in place of torchrun's standalone one: torchrun's own dynamic rendezvous (its
``C10dRendezvousBackend`` and handler, unchanged) on a loopback store, which also hands each round's
workers a fresh loopback store of the agent's for their process group (``use_agent_store``), so no worker
listens either: a plain ``torch.distributed`` script gets the same protection as ddpkit's own. A fresh
store per round keeps a restarted group from reading the dead one's addresses (PyTorch issue 135712,
the reason ddpkit does not share the rendezvous store itself with the workers).
"""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

BACKEND = "ddpkit-loopback"
LOOPBACK = "127.0.0.1"
ENDPOINT = f"{LOOPBACK}:0"  # what the agent is told; the port is the kernel's pick
DEFAULT_READ_TIMEOUT_S = 60  # torchrun's for its c10d rendezvous store


def listening_socket(address: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on ``address`` only (IPv4 or IPv6), for TCPStore's ``master_listen_fd``."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    return socket.create_server((address, port), family=family)


def store_on(address: str, *, port: int = 0, world_size: int | None = None, timeout_s: float,
             wait_for_workers: bool = True) -> dist.TCPStore:
    """A TCPStore server that listens on ``address`` only (port 0: a free one, ``store.port`` says which)."""
    listener = listening_socket(address, port)
    chosen_port = listener.getsockname()[1]
    # The store takes the descriptor over and closes it with itself: the Python object lets go of it.
    return dist.TCPStore(address, chosen_port, world_size, is_master=True,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=wait_for_workers,
                         master_listen_fd=listener.detach())


def loopback_store(timeout_s: float = DEFAULT_READ_TIMEOUT_S) -> dist.TCPStore:
    return store_on(LOOPBACK, timeout_s=timeout_s)


class LoopbackRendezvous(RendezvousHandler):
    """torchrun's dynamic c10d rendezvous on a loopback store, serving each round's workers a store too."""

    def __init__(self, params: RendezvousParameters):
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

        # Without it torchrun's handler would start a store for the workers itself, on every interface;
        # they get the one of next_rendezvous instead (and the workers inherit the variable, unread).
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        self._timeout_s = params.get_as_int("read_timeout", DEFAULT_READ_TIMEOUT_S)
        store = loopback_store(self._timeout_s)
        self._inner = create_handler(store, C10dRendezvousBackend(store, params.run_id), params)
        self._workers_store: dist.TCPStore | None = None

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers' process group connects to the store of next_rendezvous, never hosts one

    def next_rendezvous(self) -> RendezvousInfo:
        joined = self._inner.next_rendezvous()
        # The last round's store goes with its workers, which are gone by now.
        self._workers_store = loopback_store(self._timeout_s)
        return RendezvousInfo(joined.store, joined.rank, joined.world_size,
                              RendezvousStoreInfo(LOOPBACK, self._workers_store.port))

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        self._workers_store = None
        return self._inner.shutdown()


def register() -> None:
    """Make ``BACKEND`` known to torchrun's rendezvous registry (again: no harm)."""
    rendezvous_handler_registry.register(BACKEND, LoopbackRendezvous)
