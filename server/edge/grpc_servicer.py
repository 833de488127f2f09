"""SGLang's scheduler protocol (`sglang.grpc.scheduler.SglangScheduler`) over the Engine: generate
and abort here, the read side (health, info, loads, tokenizer, KV events) in grpc_status.py.

Protobuf stays in these two modules: requests become token lists and SamplingParams, engine outputs
become GenerateResponse messages. Errors are gRPC status codes: INVALID_ARGUMENT for input that can
never be served (the message names the field), RESOURCE_EXHAUSTED when the server is full or the
request can never fit its KV pool, UNAVAILABLE while loading or draining.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import uuid

import grpc
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc

from tandem.server.edge.grpc_status import KV_EVENTS_HEARTBEAT_SECONDS, ServerIdentity, ServingState, StatusServicer
from tandem.server.loop.engine import Engine
from tandem.server.loop.outputs import StreamOutput
from tandem.server.scheduling.request import Bootstrap
from tandem.server.scheduling.sampling_params import CapacityError, Constraint, InvalidRequestError, SamplingParams

log = logging.getLogger("tandem.grpc")

MAX_N = 16  # choices per request

# SamplingParams fields the proto's SamplingParams carries under the same name (the logprob
# settings ride on GenerateRequest; the proto has no seed).
_PROTO_FIELDS = {f.name: f.is_repeated for f in pb.SamplingParams.DESCRIPTOR.fields
                 if f.name in {g.name for g in dataclasses.fields(SamplingParams)}}


def to_sampling_params(sp: pb.SamplingParams, request: pb.GenerateRequest) -> SamplingParams:
    """Proto -> engine params. Proto3 scalars have no 'unset' (0 is the default), so the router
    always sends every field; only max_new_tokens has explicit presence."""
    if request.top_logprobs_num < 0:
        raise InvalidRequestError("top_logprobs_num", f"must be >= 0, got {request.top_logprobs_num}")
    values = {name: tuple(getattr(sp, name)) if repeated else getattr(sp, name) for name, repeated in _PROTO_FIELDS.items()}
    values["max_new_tokens"] = sp.max_new_tokens if sp.HasField("max_new_tokens") else None
    kind = sp.WhichOneof("constraint")  # a oneof: the wire holds one constraint at most
    constraint = Constraint(kind, getattr(sp, kind)) if kind is not None else None
    return SamplingParams(**values, logprobs=request.return_logprob, constraint=constraint,
                          top_logprobs=request.top_logprobs_num if request.return_logprob else 0)


def sampling_params_message(params: SamplingParams) -> pb.SamplingParams:
    """Engine params -> proto, for clients: one choice, special tokens skipped. (The logprob
    settings go on the GenerateRequest; a seed cannot be sent.)"""
    values = {name: getattr(params, name) for name in _PROTO_FIELDS if getattr(params, name) is not None}
    if params.constraint is not None:
        values[params.constraint.kind] = params.constraint.text
    return pb.SamplingParams(**values, skip_special_tokens=True, n=1)


def _logprobs(out_ids: list[int], lps: list[float], tops: list) -> pb.OutputLogProbs:
    msg = pb.OutputLogProbs(token_logprobs=lps, token_ids=out_ids)
    for alternatives in tops:
        msg.top_logprobs.add(token_ids=[t for t, _ in alternatives], values=[v for _, v in alternatives])
    return msg


class SchedulerServicer(StatusServicer):
    """The whole protocol: generating and aborting here, the server's state from `StatusServicer`."""

    def __init__(self, engine: Engine, identity: ServerIdentity, state: ServingState, kv_events: bool = True,
                 kv_events_heartbeat: float = KV_EVENTS_HEARTBEAT_SECONDS):
        super().__init__(engine, identity, state, kv_events, kv_events_heartbeat)
        self._choices: dict[str, list[str]] = {}  # request_id -> engine rids of its n choices
        self._lock = threading.Lock()

    # -- Generate ---------------------------------------------------------------------------------
    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        if self.state.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        rid = request.request_id
        cancelled = threading.Event()
        streams: list = []

        def on_done():  # the call ended: finished, or cancelled by the client (then it is an abort)
            cancelled.set()
            for s in streams:
                s.abort()  # a no-op for finished ones; engine rids are unique to this call

        if not context.add_callback(on_done):
            return  # the call is already over
        try:
            if not rid:
                raise InvalidRequestError("request_id", "must not be empty")
            params = to_sampling_params(request.sampling_params, request)
            n = request.sampling_params.n or 1
            if n > MAX_N:
                raise InvalidRequestError("sampling_params.n", f"{n} choices requested; at most {MAX_N}")
            bootstrap = self._bootstrap(request, n)
            prompt = list(request.tokenized.input_ids)
            streams.extend(self._submit(rid, prompt, params, n, bootstrap))
        except CapacityError as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RuntimeError as e:  # the engine has stopped
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        if cancelled.is_set():
            for s in streams:
                s.abort()
        # Accepted: answer with headers now. The router treats a leg with no response at all for
        # a few seconds as a silent (dead) worker, and a queued or long prompt takes longer.
        context.send_initial_metadata(())
        try:
            for index, stream in enumerate(streams):
                yield from self._respond(rid, index, stream, request.stream, cancelled, context)
        finally:
            with self._lock:
                self._choices.pop(rid, None)

    def _bootstrap(self, request: pb.GenerateRequest, n: int) -> Bootstrap | None:
        """Where the two legs of a disaggregated request meet; None on a colocated server."""
        if self.identity.role == "colocated":
            return None
        if not request.HasField("disaggregated_params") or not request.disaggregated_params.bootstrap_host:
            raise InvalidRequestError(
                "disaggregated_params", f"required on a {self.identity.role} server: bootstrap_host, bootstrap_port "
                "and bootstrap_room (the router sets them)"
            )
        if n != 1:
            raise InvalidRequestError("sampling_params.n", f"{n} choices requested; a disaggregated request has 1")
        d = request.disaggregated_params
        if not 0 < d.bootstrap_port < 65536 or d.bootstrap_room < 0:
            raise InvalidRequestError(
                "disaggregated_params", f"bootstrap_port {d.bootstrap_port} must be in 1-65535 and bootstrap_room {d.bootstrap_room} >= 0"
            )
        return Bootstrap(d.bootstrap_host, d.bootstrap_port, d.bootstrap_room)

    def _submit(self, rid: str, prompt: list[int], params: SamplingParams, n: int, bootstrap: Bootstrap | None):
        # Engine ids unique to this call: a late abort from a finished call can never hit a
        # later call that reuses the request id.
        call_id = uuid.uuid4().hex[:8]
        rids = [f"{rid}#{call_id}#{i}" for i in range(n)]
        with self._lock:
            if rid in self._choices:
                raise InvalidRequestError("request_id", f"{rid!r} is already in flight")
            self._choices[rid] = rids
        streams = []
        try:
            for r in rids:
                streams.append(self.engine.submit(prompt, params, rid=r, bootstrap=bootstrap))
        except Exception:
            for s in streams:
                s.abort()
            with self._lock:
                self._choices.pop(rid, None)
            raise
        return streams

    def _respond(self, rid: str, index: int, stream, streaming: bool, cancelled: threading.Event, context):
        ids: list[int] = []
        lps: list[float] = []
        tops: list = []
        last: StreamOutput | None = None
        for out in stream:
            last = out
            ids += out.token_ids
            lps += out.logprobs
            tops += out.top_logprobs
            if streaming and out.token_ids:
                chunk = pb.GenerateStreamChunk(
                    token_ids=out.token_ids,
                    prompt_tokens=out.prompt_tokens,
                    completion_tokens=out.completion_tokens,
                    cached_tokens=out.cached_tokens,
                    index=index,
                )
                if out.logprobs:
                    chunk.output_logprobs.CopyFrom(_logprobs(out.token_ids, out.logprobs, out.top_logprobs))
                yield pb.GenerateResponse(request_id=rid, chunk=chunk)
        if cancelled.is_set() and last is not None and last.finish_reason == "abort":
            return  # the client is gone; nobody reads a Complete
        if last.error_code:  # the server failed the request (a peer leg that never came, a dead peer)
            context.abort(getattr(grpc.StatusCode, last.error_code.upper(), grpc.StatusCode.INTERNAL), last.error)
        complete = pb.GenerateComplete(
            output_ids=ids,
            finish_reason=last.finish_reason,
            prompt_tokens=last.prompt_tokens,
            completion_tokens=last.completion_tokens,
            cached_tokens=last.cached_tokens,
            index=index,
        )
        if isinstance(last.matched_stop, int):
            complete.matched_token_id = last.matched_stop
        elif isinstance(last.matched_stop, str):
            complete.matched_stop_str = last.matched_stop
        if lps:
            complete.output_logprobs.CopyFrom(_logprobs(ids, lps, tops))
        yield pb.GenerateResponse(request_id=rid, complete=complete)

    def Abort(self, request: pb.AbortRequest, context):
        with self._lock:
            rids = self._choices.get(request.request_id, [])
        for r in rids:
            self.engine.abort(r)  # idempotent; unknown ids are fine
        return pb.AbortResponse(success=True, message=f"aborted {request.request_id}")


def add_to_server(servicer: SchedulerServicer, server: grpc.Server) -> None:
    pb_grpc.add_SglangSchedulerServicer_to_server(servicer, server)
