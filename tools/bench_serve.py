"""`tandem bench serve`: drive a running server with a fixed-seed streaming workload, at a fixed
concurrency, over gRPC (SGLang's protocol, straight to a tandem server) or over the router's
OpenAI-compatible HTTP endpoint. Prints output tokens/s, TTFT and TPOT percentiles as one JSON line.

Every request is greedy, ignores EOS and asks for exactly its drawn output length.
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tandem.common.stats import percentile
from tandem.server.scheduling.sampling_params import SamplingParams
from tandem.tools.bench_offline import make_workload


@dataclass
class Sample:
    output_tokens: int
    ttft: float
    latency: float

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def _grpc_runner(target: str):
    from tandem.tools.client import Client, request_message

    client = Client(target)

    def run_one(prompt: list[int], n: int) -> Sample:
        params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        result = client.stream(request_message(prompt, params))
        return Sample(len(result.output_ids), result.ttft or result.latency, result.latency)

    return run_one, client.close


def pd_grpc_runner(prefill_target: str, bootstrap_port: int, decode_target: str, credentials=None):
    """Both legs of each request over gRPC, as the router sends them: the prefill leg in the
    background and the decode leg streamed, with one bootstrap room. `credentials`: TLS for both."""
    import itertools
    from concurrent.futures import ThreadPoolExecutor

    from tandem.tools.client import Client, request_message

    prefill, decode = Client(prefill_target, credentials), Client(decode_target, credentials)
    host = prefill_target.rsplit(":", 1)[0]
    rooms = itertools.count(1)
    legs = ThreadPoolExecutor(64, thread_name_prefix="prefill-leg")

    def run_one(prompt: list[int], n: int) -> Sample:
        params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        bootstrap = (host, bootstrap_port, next(rooms))
        first = legs.submit(prefill.stream, request_message(prompt, params, bootstrap=bootstrap), None, 300)
        result = decode.stream(request_message(prompt, params, bootstrap=bootstrap), timeout=300)
        first.result()
        return Sample(len(result.output_ids), result.ttft or result.latency, result.latency)

    def close() -> None:
        legs.shutdown()
        prefill.close()
        decode.close()

    return run_one, close


def openai_runner(target: str, model_name: str, tokenizer):
    from tandem.tools.client import stream_openai

    def run_one(prompt: list[int], n: int) -> Sample:
        body = {"model": model_name, "prompt": tokenizer.decode(prompt), "max_tokens": n, "temperature": 0,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        ttft, chunks, usage = None, 0, None
        for event in stream_openai(target, "/v1/completions", body):
            if event.get("usage"):
                usage = event["usage"]
            if any(c.get("text") for c in event.get("choices", [])):
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - start
        latency = time.perf_counter() - start
        tokens = usage["completion_tokens"] if usage else chunks
        return Sample(tokens, ttft or latency, latency)

    return run_one, lambda: None


def run(args) -> int:
    from tandem.server.model.loader import resolve_model
    from tandem.server.model.tokenizer import load_tokenizer

    work = make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), args.workload_seed)
    if args.openai:
        source = resolve_model(args.model)
        run_one, close = openai_runner(args.target, source.name, load_tokenizer(source))
    else:
        run_one, close = _grpc_runner(args.target)
    result = {"bench": "serve", "transport": "openai-http" if args.openai else "grpc", **drive(run_one, work, args.concurrency)}
    close()
    print(json.dumps(result))
    return 0


def drive(run_one, work: list, concurrency: int, *more: list) -> dict:
    """Run the workload at a fixed concurrency, then each of `more` in turn; throughput over the
    whole time, TTFT and TPOT percentiles over every request."""
    samples, elapsed = [], 0.0
    for batch in (work, *more):
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            samples += pool.map(lambda w: run_one(*w), batch)
        elapsed += time.perf_counter() - start
    tokens = sum(s.output_tokens for s in samples)
    ttfts = [s.ttft for s in samples]
    tpots = [s.tpot for s in samples if s.tpot is not None]
    return {
        "num_requests": len(samples),
        "concurrency": concurrency,
        "output_tokens": tokens,
        "seconds": round(elapsed, 2),
        "output_tokens_per_s": round(tokens / elapsed, 1),
        "ttft_p50_s": round(percentile(ttfts, 50), 3),
        "ttft_p99_s": round(percentile(ttfts, 99), 3),
        "ttft_mean_s": round(statistics.mean(ttfts), 3),
        "tpot_p50_ms": round(percentile(tpots, 50) * 1000, 1),
        "tpot_p99_ms": round(percentile(tpots, 99) * 1000, 1),
        "tpot_mean_ms": round(statistics.mean(tpots) * 1000, 1),
    }
