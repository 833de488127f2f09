"""Which KV connector a server's disaggregation role plugs into the engine loop, and the address
its peers reach it at. The one module that imports both connectors: connector.py, the interface
they implement, imports neither."""

from __future__ import annotations

import socket
from typing import Callable

from tandem.kernels.kv_cache import PagedKVCache
from tandem.server.config import DisaggConfig
from tandem.server.disagg.connector import KVConnector, OtherRanks
from tandem.server.disagg.decode import DecodeConnector
from tandem.server.disagg.layout import KVLayout
from tandem.server.disagg.prefill import PrefillConnector
from tandem.server.scheduling.memory import KVMemory


def advertise_host(disagg: DisaggConfig, host: str) -> str:
    """The address peers reach this server's bootstrap service and Mooncake engines at."""
    return disagg.advertise_host or (host if host not in ("0.0.0.0", "::", "") else socket.gethostbyname(socket.gethostname()))


def create_connector(disagg: DisaggConfig, host: str, port: int | None, layout: KVLayout, kv_cache: PagedKVCache,
                     memory: KVMemory, wake: Callable[[], None], on_transfer: Callable[[float], None],
                     ranks: OtherRanks | None = None) -> KVConnector:
    """The KV connector of `disagg.role`. A prefill's bootstrap service listens on `host`; peers
    reach this server at the advertised host, and a decode is named by it and its gRPC `port`
    (a successor at the same address replaces its predecessor on each prefill). `ranks`: the
    server's other tensor-parallel ranks, whose KV heads move with rank 0's."""
    if disagg.role == "colocated":
        return KVConnector(on_transfer)
    advertise = advertise_host(disagg, host)
    if disagg.role == "prefill":
        return PrefillConnector(disagg, host, advertise, layout, kv_cache, memory, wake, on_transfer, ranks)
    name = f"{advertise}:{port}" if port else None
    return DecodeConnector(disagg, advertise, layout, kv_cache, memory, wake, on_transfer, name, ranks)
