"""The read side of SGLang's scheduler protocol: health, model and server info, loads, the
tokenizer, the prefix cache's KV events, and flushing that cache. `SchedulerServicer`
(grpc_servicer.py) adds generating and aborting on top.
"""

from __future__ import annotations

import hashlib
import io
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf import struct_pb2, timestamp_pb2
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2

from tandem.server.kvcache.kv_events import AllCleared, BlocksRemoved, BlocksStored, CursorError, EventBatch, SubscriberLimitError
from tandem.server.loop.engine import Engine

TOKENIZER_CHUNK_BYTES = 64 * 1024
KV_EVENTS_HEARTBEAT_SECONDS = 1.0  # a load-only batch after this long without events


@dataclass(frozen=True)
class ServerIdentity:
    """What the servicer reports about itself (GetModelInfo / GetServerInfo)."""

    served_model_name: str
    model_path: str
    tokenizer_path: str  # an absolute local directory with tokenizer.json and the chat template
    role: str  # colocated | prefill | decode
    server_args: dict  # flat, JSON-able: what GetServerInfo.server_args carries
    version: str


class ServingState:
    """Ready -> draining. Thread-safe flags read by every RPC."""

    def __init__(self):
        self.started = time.time()
        self._draining = threading.Event()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def drain(self) -> None:
        self._draining.set()


class StatusServicer(pb_grpc.SglangSchedulerServicer):
    """What the server reports about itself and its engine; it starts and changes no request."""

    def __init__(self, engine: Engine, identity: ServerIdentity, state: ServingState, kv_events: bool = True,
                 kv_events_heartbeat: float = KV_EVENTS_HEARTBEAT_SECONDS):
        self.engine = engine
        self.identity = identity
        self.state = state
        self.kv_events = kv_events
        self.kv_events_heartbeat = kv_events_heartbeat

    # -- health and info --------------------------------------------------------------------------
    def HealthCheck(self, request, context):
        if not self.engine.alive:
            return pb.HealthCheckResponse(healthy=False, message="engine stopped")
        if self.state.draining:
            return pb.HealthCheckResponse(healthy=False, message="draining")
        return pb.HealthCheckResponse(healthy=True, message="ok")

    def GetModelInfo(self, request, context):
        e, mc, ident = self.engine, self.engine.model.config, self.identity
        tok = e.tokenizer
        return pb.GetModelInfoResponse(
            model_path=ident.model_path,
            tokenizer_path=ident.tokenizer_path,
            is_generation=True,
            served_model_name=ident.served_model_name,
            max_context_length=e.context_length,
            vocab_size=mc.vocab_size,
            model_type=mc.architecture,
            eos_token_ids=sorted(e.eos_token_ids),
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
            bos_token_id=mc.bos_token_id or 0,
            max_req_input_len=min(e.context_length, e.max_total_tokens) - 1,
            architectures=[mc.hf_class],
        )

    def GetServerInfo(self, request, context):
        args = struct_pb2.Struct()
        args.update(self.identity.server_args)
        snap = self.engine.snapshot
        started = timestamp_pb2.Timestamp()
        started.FromSeconds(int(self.state.started))
        return pb.GetServerInfoResponse(
            server_args=args,
            active_requests=snap.running + snap.waiting,
            is_paused=self.state.draining,
            uptime_seconds=time.time() - self.state.started,
            sglang_version=self.identity.version,
            server_type="grpc",
            start_time=started,
            max_total_num_tokens=self.engine.max_total_tokens,
        )

    def GetLoads(self, request, context):
        snap = self.engine.snapshot
        load = pb.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=snap.running,
            num_waiting_reqs=snap.waiting,
            num_total_reqs=snap.running + snap.waiting,
            num_used_tokens=snap.used_tokens,
            max_total_num_tokens=self.engine.max_total_tokens,
            token_usage=snap.token_usage,
            cache_hit_rate=snap.prefix_hit_rate,
            utilization=snap.running / self.engine.config.max_running_requests,
            max_running_requests=self.engine.config.max_running_requests,
        )
        load.memory.token_capacity = self.engine.max_total_tokens
        load.queues.waiting = snap.waiting
        pd = load.disaggregation
        pd.mode = self.identity.role if self.identity.role != "colocated" else "null"
        pd.prefill_prealloc_queue_reqs, pd.prefill_inflight_queue_reqs = snap.bootstrap_queue, snap.inflight_queue
        pd.decode_prealloc_queue_reqs, pd.decode_transfer_queue_reqs = snap.prealloc_queue, snap.transfer_queue
        now = timestamp_pb2.Timestamp()
        now.GetCurrentTime()
        response = pb.GetLoadsResponse(timestamp=now.ToJsonString(), version=self.identity.version, dp_rank_count=1, loads=[load])
        agg = response.aggregate
        agg.total_running_reqs, agg.total_waiting_reqs = snap.running, snap.waiting
        agg.total_reqs, agg.avg_token_usage = snap.running + snap.waiting, snap.token_usage
        return response

    def GetTokenizer(self, request, context):
        data = tokenizer_archive(Path(self.identity.tokenizer_path))
        digest = hashlib.sha256(data).hexdigest()
        for start in range(0, len(data), TOKENIZER_CHUNK_BYTES):
            last = start + TOKENIZER_CHUNK_BYTES >= len(data)
            yield common_pb2.GetTokenizerChunk(data=data[start : start + TOKENIZER_CHUNK_BYTES], sha256=digest if last else "")

    # -- KV events --------------------------------------------------------------------------------
    def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.ServicerContext):
        """The prefix cache's events, one batch per step that changed it, each with the engine's
        load; a load-only batch (numbered as the last batch sent, 0 before any) after a second
        without events. A cursor that cannot be resumed from is OUT_OF_RANGE, a subscriber that
        fell too far behind ends with DATA_LOSS: either way it resubscribes from 0."""
        if not self.kv_events:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "KV events are off on this server (--disable-kv-events)")
        if self.state.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        try:
            sub = self.engine.subscribe_kv_events(request.start_sequence_number)
        except CursorError as e:
            context.abort(grpc.StatusCode.OUT_OF_RANGE, str(e))
        except SubscriberLimitError as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except RuntimeError as e:  # the engine has stopped
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        context.add_callback(sub.close)  # the subscriber hung up
        sent, samples = None, 0  # the last sequence number sent; load records sent
        try:
            while context.is_active():
                batch = sub.next(self.kv_events_heartbeat)
                if sub.dropped:
                    context.abort(grpc.StatusCode.DATA_LOSS, sub.dropped)
                if sub.closed:
                    return  # the engine stopped
                if batch is None and sent is None and not request.load_records_before_first_batch:
                    continue  # an old subscriber takes its first load record with the first batch
                samples += 1
                if batch is None:
                    yield common_pb2.KvEventBatch(sequence_number=sent or 0, timestamp=time.time(),
                                                  load=self._engine_load(samples, load_only=True))
                    continue
                message = _event_batch(batch)
                message.load.CopyFrom(self._engine_load(samples, load_only=False, full=sent is None))
                sent = batch.sequence
                yield message
        finally:
            sub.close()

    def _engine_load(self, sample: int, load_only: bool, full: bool = True) -> common_pb2.EngineLoad:
        """The load record: what GetLoads answers; the telemetry beyond routing on heartbeats and a
        stream's first record only."""
        snap, config = self.engine.snapshot, self.engine.config
        load = common_pb2.EngineLoad(
            running_requests=snap.running, waiting_requests=snap.waiting,
            waiting_uncached_tokens=snap.queued_prompt_tokens, token_usage=snap.token_usage,
            max_running_requests=config.max_running_requests, sample=sample, load_only=load_only,
        )
        if load_only or full:
            load.cache_hit_rate = snap.prefix_hit_rate
            load.num_used_tokens = snap.used_tokens
            load.max_total_num_tokens = self.engine.max_total_tokens
            load.queues.waiting = snap.waiting
            load.disaggregation.mode = self.identity.role if self.identity.role != "colocated" else "null"
        return load

    def FlushCache(self, request, context):
        ok = self.engine.flush_cache()
        message = "prefix cache flushed" if ok else "not flushed: running requests pin cached pages"
        return common_pb2.FlushCacheResponse(success=ok, message=message)


def _event_batch(batch: EventBatch) -> common_pb2.KvEventBatch:
    message = common_pb2.KvEventBatch(sequence_number=batch.sequence, timestamp=batch.timestamp)
    for event in batch.events:
        out = message.events.add()
        if isinstance(event, BlocksStored):
            stored = out.stored
            for h, ids in zip(event.hashes, event.token_ids):
                stored.blocks.add(block_hash=h, token_ids=ids, block_size=len(ids))
            if event.parent is not None:
                stored.parent_block_hash = event.parent
            stored.tier = common_pb2.KV_CACHE_TIER_DEVICE
            stored.locality = common_pb2.KV_CACHE_LOCALITY_LOCAL
        elif isinstance(event, BlocksRemoved):
            out.removed.block_hashes.extend(event.hashes)
            out.removed.tier = common_pb2.KV_CACHE_TIER_DEVICE
            out.removed.locality = common_pb2.KV_CACHE_LOCALITY_LOCAL
        elif isinstance(event, AllCleared):
            out.cleared.SetInParent()
    if batch.snapshot_pages is not None:
        message.snapshot.index, message.snapshot.count, message.snapshot.blocks = 0, 1, batch.snapshot_pages
    return message


# A HF model directory is also its tokenizer's: what GetTokenizer leaves out of it.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx")


def tokenizer_archive(directory: Path) -> bytes:
    """The tokenizer directory as a ZIP (flat, regular files only): the tokenizer's files and the
    model's config, never its weights."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(directory.iterdir()):
            if path.is_file() and not path.name.startswith(".") and path.suffix not in WEIGHT_SUFFIXES:
                zf.write(path, arcname=path.name)
    return buf.getvalue()
