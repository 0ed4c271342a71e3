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

Across machines the rendezvous store must be reachable from the other nodes, but still not from every
network the host is on: ``STATIC`` and ``C10D`` are torchrun's static and c10d rendezvous with the store
listening only on the address the endpoint's name resolves to, when that is one of this machine's
(``bind_address``); when it is not (a name this machine resolves to loopback, the trap that
``choose_gloo_interface`` handles), they fall back to torchrun's own store, on every interface.
"""

from __future__ import annotations

import os

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

from ddpkit.core.network import LOOPBACK, bind_address, store_on

BACKEND = "ddpkit-loopback"
STATIC = "ddpkit-static"  # torchrun's static rendezvous (--node-rank), its store on the chosen address
C10D = "ddpkit-c10d"  # torchrun's c10d rendezvous (--rdzv-endpoint), its store on the chosen address
DEFAULT_C10D_PORT = 29400  # torchrun's, for an endpoint without a port
ENDPOINT = f"{LOOPBACK}:0"  # what the agent is told; the port is the kernel's pick
DEFAULT_READ_TIMEOUT_S = 60  # torchrun's for its c10d rendezvous store


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


def _static_class():
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    class ChosenAddressStatic(StaticTCPRendezvous):
        """torchrun's static rendezvous; node 0's store listens on the master address only (``bind_address``)."""

        def get_backend(self) -> str:
            return STATIC  # torchrun checks that the handler is the backend it asked for

        def next_rendezvous(self) -> RendezvousInfo:
            if self._store is None and self.rank == 0:
                bind = bind_address(self.master_addr, one_machine=self.world_size == 1)
                if bind is not None:
                    self._store = store_on(bind, port=self.master_port, world_size=self.world_size,
                                           timeout_s=self.timeout.total_seconds())
            return super().next_rendezvous()  # with a store set, it only wraps it

    return ChosenAddressStatic


def create_static_handler(params: RendezvousParameters) -> RendezvousHandler:
    """``STATIC``: as torchrun's ``--rdzv-backend static``, from ``--rdzv-endpoint MASTER:PORT`` and
    ``--rdzv-conf rank=NODE_RANK,timeout=SECONDS``."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    master_addr, master_port = parse_rendezvous_endpoint(params.endpoint, -1)
    return _static_class()(master_addr, master_port, rank=int(params.config["rank"]), world_size=params.max_nodes,
                           run_id=params.run_id, timeout=int(params.config.get("timeout", 600)))


def create_c10d_handler(params: RendezvousParameters) -> RendezvousHandler:
    """``C10D``: torchrun's c10d rendezvous; on the machine the endpoint names, its store listens on that
    address only. Elsewhere, or where the name is not one of this machine's addresses, torchrun's own."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend, create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    class ChosenAddressC10d(C10dRendezvousBackend):
        @property
        def name(self) -> str:
            return C10D  # the handler's backend name, which torchrun checks against the one it asked for

    host, port = parse_rendezvous_endpoint(params.endpoint, DEFAULT_C10D_PORT)
    bind = bind_address(host, one_machine=params.max_nodes == 1)
    if bind is None:
        _, store = create_backend(params)  # torchrun's own store: a client, or a server on every interface
    else:
        store = store_on(bind, port=port, timeout_s=params.get_as_int("read_timeout", DEFAULT_READ_TIMEOUT_S),
                         wait_for_workers=False)
    return create_handler(store, ChosenAddressC10d(store, params.run_id), params)


def register() -> None:
    """Make ddpkit's rendezvous backends known to torchrun's registry (again: no harm)."""
    rendezvous_handler_registry.register(BACKEND, LoopbackRendezvous)
    rendezvous_handler_registry.register(STATIC, create_static_handler)
    rendezvous_handler_registry.register(C10D, create_c10d_handler)
