"""SubscribeKvEvents on a real engine, through the gRPC stubs: the stream a router rebuilds its
index from matches the radix cache through shared prefixes, evictions and a flush; resuming from
a sequence number gives the same batches; heartbeats carry the load; a stalled subscriber is
dropped (DATA_LOSS) while the engine goes on serving."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2

from support.checks import cached_prefixes
from tandem.server.edge.grpc_servicer import SchedulerServicer, add_to_server
from tandem.server.edge.grpc_status import ServerIdentity, ServingState
from tandem.server.scheduling.sampling_params import SamplingParams

PAGE = 16


@pytest.fixture
def serve(make_engine):
    """serve(**EngineConfig overrides) -> (engine, stub) with the servicer on a local port."""
    servers = []

    def start(**overrides):
        engine = make_engine(page_size=PAGE, **overrides)
        identity = ServerIdentity("smollm2", "model", "tokenizer", "colocated", {}, "test")
        server = grpc.server(futures.ThreadPoolExecutor(16))
        add_to_server(SchedulerServicer(engine, identity, ServingState(), kv_events_heartbeat=0.2), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        servers.append((server, channel))
        return engine, pb_grpc.SglangSchedulerStub(channel)

    yield start
    for server, channel in servers:
        channel.close()
        server.stop(0)


class Reader:
    """Reads a subscription on a thread: batches with events, heartbeats, and how it ended."""

    def __init__(self, stub, start: int = 0):
        self.call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(
            start_sequence_number=start, load_records_before_first_batch=True))
        self.batches: list = []
        self.heartbeats: list = []
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        try:
            for batch in self.call:
                (self.heartbeats if batch.load.load_only else self.batches).append(batch)
        except grpc.RpcError as e:
            self.error = e

    def last_sequence(self) -> int:
        return self.batches[-1].sequence_number if self.batches else 0

    def wait_for(self, sequence: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.last_sequence() < sequence:
            assert time.monotonic() < deadline, f"stream stuck at {self.last_sequence()}, engine at {sequence}"
            time.sleep(0.02)


def router_index(batches) -> dict[int, tuple]:
    """block hash -> token prefix ending with that page, as a router rebuilds it from the events."""
    index: dict[int, tuple] = {}
    for batch in batches:
        for event in batch.events:
            kind = event.WhichOneof("data")
            if kind == "stored":
                prefix = index[event.stored.parent_block_hash] if event.stored.HasField("parent_block_hash") else ()
                for block in event.stored.blocks:
                    assert block.block_hash not in index, "a live page announced twice"
                    assert block.block_size == PAGE == len(block.token_ids)
                    prefix = prefix + tuple(block.token_ids)
                    index[block.block_hash] = prefix
            elif kind == "removed":
                for h in event.removed.block_hashes:
                    del index[h]  # KeyError: removed a page never announced
            else:
                index.clear()
    return index


def engine_cached_prefixes(engine) -> set[tuple]:
    return engine.call(lambda: cached_prefixes(engine.memory.cache))


def shared_prefix_prompts(tokenizer, users: int) -> list[list[int]]:
    systems = [f"You are assistant number {i}. " + "Answer briefly and politely, and cite your sources. " * 3
               for i in range(3)]
    questions = [f"User {u} asks: what comes after " + ", ".join(str(u * 1000 + k) for k in range(12)) + "?"
                 for u in range(users)]
    return [tokenizer.encode(systems[u % 3] + questions[u]) for u in range(users)]


def test_the_stream_rebuilds_the_radix_cache_through_evictions_and_a_flush(serve):
    # a pool of 24 pages: 12 requests of ~5 pages each must evict what earlier ones cached
    engine, stub = serve(max_total_tokens=24 * PAGE, max_running_requests=2)
    first = Reader(stub)
    prompts = shared_prefix_prompts(engine.tokenizer, 12)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(0, len(prompts), 3):
        engine.generate(prompts[i : i + 3], greedy)
    sequence = engine.call(lambda: engine.kv_events.sequence)
    first.wait_for(sequence)
    index = router_index(first.batches)
    assert set(index.values()) == engine_cached_prefixes(engine) != set()
    kinds = [e.WhichOneof("data") for b in first.batches for e in b.events]
    assert kinds.count("removed") > 0, "the pool never evicted: the test does not test eviction"
    assert [b.sequence_number for b in first.batches] == list(range(1, sequence + 1))
    assert all(b.load.max_running_requests == 2 and b.load.sample > 0 for b in first.batches)

    # a second subscriber resuming from the middle gets the same batches from there on
    middle = sequence // 2
    resumed = Reader(stub, start=middle)
    resumed.wait_for(sequence)
    assert [b.events for b in resumed.batches] == [b.events for b in first.batches[middle - 1 :]]
    # and a new one from 0 gets the cache as a snapshot numbered as the last batch
    fresh = Reader(stub)
    fresh.wait_for(sequence)
    assert fresh.batches[0].sequence_number == sequence and fresh.batches[0].snapshot.count == 1
    assert set(router_index(fresh.batches).values()) == engine_cached_prefixes(engine)

    assert engine.flush_cache()
    for reader in (first, resumed, fresh):
        reader.wait_for(sequence + 1)
        assert [e.WhichOneof("data") for e in reader.batches[-1].events] == ["cleared"]
    assert router_index(first.batches) == router_index(fresh.batches) == {}
    # idle: heartbeats carry the load and repeat the last sequence number
    time.sleep(0.5)
    beat = first.heartbeats[-1]
    assert beat.sequence_number == sequence + 1 and not beat.events
    assert beat.load.running_requests == 0 and beat.load.max_total_num_tokens == 24 * PAGE
    assert engine.snapshot.kv_event_subscribers == 3


def test_cursors_that_cannot_resume_are_out_of_range(serve):
    engine, stub = serve()
    engine.generate([list(range(100, 140))], SamplingParams(max_new_tokens=2, temperature=0.0))
    sequence = engine.call(lambda: engine.kv_events.sequence)
    with pytest.raises(grpc.RpcError) as err:
        next(iter(stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=sequence + 5))))
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert f"ahead of this server's last batch {sequence}" in err.value.details()


def test_a_server_without_kv_events_says_unimplemented(make_engine):
    servicer = SchedulerServicer(make_engine(), ServerIdentity("m", "m", "t", "colocated", {}, "v"), ServingState(),
                                 kv_events=False)
    context = FakeContext()
    with pytest.raises(Aborted):
        next(servicer.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), context))
    assert context.code == grpc.StatusCode.UNIMPLEMENTED and "--disable-kv-events" in context.details


def test_a_stalled_subscriber_is_dropped_with_data_loss_while_requests_go_on(serve):
    engine, stub = serve(kv_events_queue=2)
    stalled = engine.subscribe_kv_events(0)  # never read: the engine must not wait for it
    reader = Reader(stub)
    greedy = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    for i in range(6):  # a batch per request at least: the stalled subscriber's queue holds 2
        assert len(engine.generate([[1000 + i] * 40], greedy)[0].output_ids) == 2
    assert stalled.dropped and "fell 2 KV event batches behind" in stalled.dropped
    assert engine.snapshot.kv_event_subscribers_dropped == 1 and reader.error is None

    # the servicer tells a dropped subscriber why, as DATA_LOSS (the router then resubscribes from 0)
    servicer = SchedulerServicer(engine, ServerIdentity("m", "m", "t", "colocated", {}, "v"), ServingState(),
                                 kv_events_heartbeat=0.05)
    context = FakeContext()
    stream = servicer.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), context)
    assert next(stream).snapshot.count == 1  # the cache as it is
    for i in range(4):  # 4 batches, a queue of 2, nobody reading
        engine.generate([[2000 + i] * 40], greedy)
    with pytest.raises(Aborted):
        for _ in stream:
            pass
    assert context.code == grpc.StatusCode.DATA_LOSS and "resubscribe from 0" in context.details


class Aborted(Exception):
    pass


class FakeContext:
    code = details = None

    def is_active(self):
        return True

    def add_callback(self, fn):
        return True

    def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted(details)
