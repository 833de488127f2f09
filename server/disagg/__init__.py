"""Prefill/decode disaggregation: the KV connectors a role plugs into the engine loop.

    layout.py     KVLayout (what both sides must agree on), page addresses, coalesced page runs
    transfer.py   the Mooncake transfer engine: registration, batched one-sided writes, arrival records
    bootstrap.py  the bootstrap service on each prefill server (HTTP + JSON) and its client
    connector.py  KVConnector: the interface, and the colocated pass-through
    prefill.py    PrefillConnector: bootstrap queue -> scheduler -> inflight (KV being sent) -> done
    decode.py     DecodeConnector: prealloc (handshake, reserve) -> transfer (poll) -> running
"""
