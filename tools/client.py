"""A small gRPC client for people and benchmarks: tokenizes locally, streams token ids from a
tandem server (SGLang's scheduler protocol), detokenizes as they arrive."""

from __future__ import annotations

import http.client
import json
import random
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

import grpc
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc

from tandem.server.edge.grpc_servicer import sampling_params_message
from tandem.server.scheduling.sampling_params import SamplingParams


@dataclass
class ClientResult:
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None  # seconds from sending to the first token
    token_times: list[float] = field(default_factory=list)  # arrival time of each chunk's tokens
    latency: float = 0.0


def request_message(prompt_ids: list[int], params: SamplingParams, rid: str | None = None, stream: bool = True,
                    bootstrap: tuple[str, int, int] | None = None) -> pb.GenerateRequest:
    """`bootstrap` (prefill host, bootstrap port, room): both legs of a disaggregated request carry it."""
    message = pb.GenerateRequest(
        request_id=rid or uuid.uuid4().hex,
        tokenized=pb.TokenizedInput(input_ids=prompt_ids),
        sampling_params=sampling_params_message(params),
        return_logprob=params.logprobs,
        top_logprobs_num=params.top_logprobs,
        stream=stream,
    )
    if bootstrap is not None:
        host, port, room = bootstrap
        message.disaggregated_params.CopyFrom(pb.DisaggregatedParams(bootstrap_host=host, bootstrap_port=port, bootstrap_room=room))
    return message


class Client:
    def __init__(self, target: str, credentials: grpc.ChannelCredentials | None = None):
        """`credentials`: TLS (`grpc.ssl_channel_credentials`) for a server started with --tls-cert."""
        self.channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
        self.stub = pb_grpc.SglangSchedulerStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def stream(self, message: pb.GenerateRequest, on_tokens=None, timeout: float | None = None) -> ClientResult:
        """Run one Generate call; `on_tokens(ids)` sees each chunk's new ids as they arrive."""
        result = ClientResult()
        start = time.perf_counter()
        for response in self.stub.Generate(message, timeout=timeout):
            now = time.perf_counter()
            if response.HasField("chunk"):
                ids = list(response.chunk.token_ids)
                if result.ttft is None:
                    result.ttft = now - start
                result.token_times.append(now)
                result.output_ids += ids
                if on_tokens:
                    on_tokens(ids)
            else:
                c = response.complete
                result.finish_reason = c.finish_reason
                result.prompt_tokens = c.prompt_tokens
                result.cached_tokens = c.cached_tokens
                if not message.stream:
                    result.output_ids = list(c.output_ids)
        result.latency = time.perf_counter() - start
        return result

    def abort(self, rid: str) -> bool:
        return self.stub.Abort(pb.AbortRequest(request_id=rid)).success


def _load_tokenizer(model: str):
    from tandem.server.model.loader import resolve_model
    from tandem.server.model.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(model))


def _stream_to_terminal(client: Client, tokenizer, prompt_ids: list[int], params: SamplingParams,
                        bootstrap: tuple[str, int, int] | None = None) -> tuple[ClientResult, str]:
    from tandem.server.model.tokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(tokenizer)

    def show(ids):
        for token in ids:
            sys.stdout.write(detok.push(token))
        sys.stdout.flush()

    result = client.stream(request_message(prompt_ids, params, bootstrap=bootstrap), on_tokens=show)
    return result, detok.text


def _report(result: ClientResult) -> None:
    n = len(result.output_ids)
    decode_time = result.latency - (result.ttft or 0.0)
    rate = (n - 1) / decode_time if n > 1 and decode_time > 0 else 0.0
    ttft = f"{result.ttft * 1000:.0f} ms" if result.ttft is not None else "n/a"
    print(f"\n[{n} tokens, {result.finish_reason}; TTFT {ttft}, {rate:.1f} tokens/s]", file=sys.stderr)


def generate(args, params: SamplingParams) -> int:
    """`tandem client generate`: args has target, prompt, chat, model, prefill_target, bootstrap_port."""
    tokenizer = _load_tokenizer(args.model)
    text = args.prompt
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    client = Client(args.target)
    prefill = None
    try:
        ids = tokenizer.encode(text)
        bootstrap = None
        if args.prefill_target:  # disaggregated: the prefill leg in the background, the decode leg streamed here
            host = args.prefill_target.rsplit(":", 1)[0]
            bootstrap = (host, args.bootstrap_port, random.randrange(1 << 31))
            prefill = Client(args.prefill_target)
            message = request_message(ids, params, bootstrap=bootstrap)
            threading.Thread(target=_quietly, args=(prefill.stream, message), daemon=True).start()
        result, _ = _stream_to_terminal(client, tokenizer, ids, params, bootstrap)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()
        if prefill is not None:
            prefill.close()
    _report(result)
    return 0


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except grpc.RpcError:
        pass  # the decode leg reports what went wrong


def chat(args, params: SamplingParams) -> int:
    """`tandem chat`: args has target and model."""
    tokenizer = _load_tokenizer(args.model)
    client = Client(args.target)
    history = []
    try:
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            history.append({"role": "user", "content": line})
            text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
            try:
                result, answer = _stream_to_terminal(client, tokenizer, tokenizer.encode(text), params)
            except grpc.RpcError as e:
                print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
                history.pop()
                continue
            history.append({"role": "assistant", "content": answer})
            _report(result)
    finally:
        client.close()
    return 0


def stream_openai(target: str, path: str, body: dict):
    """POST a streaming OpenAI-style request (the router's HTTP side) to HOST:PORT and yield each
    server-sent event as a dict; raises RuntimeError on a non-200 answer."""
    host, port = target.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    try:
        conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status} from {target}{path}: {resp.read()[:300]!r}")
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                yield json.loads(line[5:])
    finally:
        conn.close()
