"""Prefill/decode disaggregation: the KV connectors a role plugs into the engine loop.

Both sides:
    connector.py        KVConnector: the interface, and the colocated pass-through
    roles.py            create_connector: the connector of a server's role (the one module importing
                        both connectors); advertise_host: the address its peers reach it at
    layout.py           KVLayout (what both sides must agree on), page addresses, coalesced page runs
    transfer.py         the Mooncake transfer engine: registration, batched one-sided writes, arrival records
    bootstrap.py        the bootstrap service on each prefill server (HTTP + JSON) and the decode's client
The prefill:
    prefill.py          PrefillConnector: bootstrap queue -> scheduler -> inflight (KV being sent) -> done
    prefill_rooms.py    PrefillRoomTable: the rooms and decode peers its bootstrap service keeps, no I/O
The decode:
    decode.py           DecodeConnector: its requests through the three stages below -> running; how
                        they end early, and the quarantine
    decode_stages.py    Stage; Pending, a request the connector holds; End, how a stage ends one
    decode_prealloc.py  DecodePrealloc: wait for the handshake, then a slot and pages past the cached prefix
    decode_register.py  DecodeRegister: register those pages under the room on the prefill
    decode_transfer.py  DecodeTransfer: poll the arrival record and the room; make the KV readable
    decode_peers.py     PrefillPeer: the registration with one prefill process, a pure state machine
    decode_links.py     PrefillLinks: the calls to the prefills (handshake, status polls, heartbeats,
                        cancels, goodbye), their answers fed to decode_peers.py

The three state machines (each module's docstring has its transitions; test paths under tests/):

    machine             states                          who drives the transitions          tested in
    RoomState           registered, claimed, queued,    PrefillRoomTable, under its lock:   unit/test_disagg.py,
    (prefill_rooms.py)  transferring, done, failed,     the bootstrap service's HTTP        unit/test_bootstrap_auth.py,
                        unknown                         threads (the decode's calls) and    engine/test_pd_engine.py
                                                        PrefillConnector (prefill loop)
    PeerState           connecting, failed, ready,      PrefillPeer's on_* methods, fed     unit/test_peers.py (every
    (decode_peers.py)   leaving, lost, gone             by PrefillLinks (decode loop):      transition, a fake clock),
                                                        the calls' answers and the clock    engine/test_pd_engine.py
    Stage               prealloc, registering,          DecodeConnector.poll (decode loop)  engine/test_pd_engine.py,
    (decode_stages.py)  transfer; then arrived, or      through DecodePrealloc,             engine/test_latent_pd.py,
                        ended (failed: pages free;      DecodeRegister, DecodeTransfer;     e2e/test_pd_router.py,
                        abandoned: pages quarantined)   DecodeConnector.abort ends one      e2e/test_pd_roll.py
"""
