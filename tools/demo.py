"""`tandem demo`: the whole disaggregated stack on 127.0.0.1 (a prefill server, a decode server
and the smg router in PD mode), a few chat questions streamed through the router's OpenAI
endpoint with TTFT and tokens/s, then a clean shutdown. `--offline` runs the engine in-process
instead, with no servers.
"""

from __future__ import annotations

import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from tandem.server.config import EngineConfig
from tandem.server.scheduling.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for writing readable Python code.",
    "Explain in two sentences what a KV cache is in a language model.",
    "Write a haiku about Kubernetes.",
]


def run_offline_demo(config: EngineConfig, max_new_tokens: int) -> int:
    from tandem.server.loop.engine import Engine

    t0 = time.monotonic()
    print(f"loading {config.model} ({config.dtype}) ...", flush=True)
    engine = Engine(config)
    print(
        f"loaded in {time.monotonic() - t0:.1f}s; KV pool {engine.max_total_tokens} tokens, page size {config.page_size}",
        flush=True,
    )
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    with engine:
        chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
        prompts = [engine.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
        start = time.monotonic()
        # All questions run together (continuous batching); each answer is collected by its own
        # thread and streamed to the terminal in question order, with a progress line after it.
        streams = [engine.submit(engine.tokenizer.encode(p), params) for p in prompts]
        tokens = [0] * len(streams)
        texts = [""] * len(streams)
        done = [threading.Event() for _ in streams]

        def collect(i: int) -> None:
            for out in streams[i]:
                tokens[i] = out.completion_tokens
                texts[i] += out.text
            done[i].set()

        for i in range(len(streams)):
            threading.Thread(target=collect, args=(i,), daemon=True).start()
        for i, question in enumerate(QUESTIONS):
            print(f"\n>>> {question}", flush=True)
            printed = 0
            while True:  # stream answer i as it grows; the others keep generating meanwhile
                finished = done[i].wait(0.05)
                text = texts[i]
                sys.stdout.write(text[printed:])
                sys.stdout.flush()
                printed = len(text)
                if finished and printed == len(texts[i]):
                    break
            elapsed = time.monotonic() - start
            print(
                f"\n  [{sum(e.is_set() for e in done)}/{len(done)} answers done, {sum(tokens)} tokens, "
                f"{sum(tokens) / elapsed:.1f} tokens/s]",
                flush=True,
            )
        elapsed = time.monotonic() - start
        total = sum(tokens)
        print(f"\n[{len(streams)} requests, {total} tokens in {elapsed:.2f}s: {total / elapsed:.1f} tokens/s]")
    return 0


def run_pd_demo(engine_args: list[str], max_new_tokens: int, keep_running: bool, log_dir: str | None) -> int:
    from tandem.tools.stack import LocalStack, metric_value

    logs = Path(log_dir or tempfile.mkdtemp(prefix="tandem-demo-"))
    logs.mkdir(parents=True, exist_ok=True)
    # SIGINT and SIGTERM stop the stack, also where the demo started with SIGINT ignored (a shell
    # running it in the background without job control does that), and never leave servers behind.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    stack = LocalStack(logs, tuple(engine_args))
    try:
        t0 = time.monotonic()
        print(f"starting a prefill server, a decode server and the smg router (logs in {logs}) ...", flush=True)
        prefill, decode = stack.start_servers(["prefill", "decode"])
        stack.wait()
        base = stack.start_router().url
        print(f"up in {time.monotonic() - t0:.1f}s: prefill grpc://{prefill.target} (bootstrap :{prefill.bootstrap_port}), "
              f"decode grpc://{decode.target}, router {base}", flush=True)
        total_tokens, total_time = 0, 0.0
        for question in QUESTIONS:
            print(f"\n>>> {question}", flush=True)
            tokens, ttft, elapsed = _stream_chat(base, stack.model_name, question, max_new_tokens)
            total_tokens, total_time = total_tokens + tokens, total_time + elapsed
            rate = (tokens - 1) / (elapsed - ttft) if tokens > 1 and elapsed > ttft else 0.0
            print(f"\n  [TTFT {ttft * 1000:.0f} ms, {tokens} tokens, {rate:.1f} tokens/s]", flush=True)
        kv = metric_value(prefill.metrics_text(), "tandem_kv_transfer_bytes_total")
        print(f"\n[{len(QUESTIONS)} requests, {total_tokens} tokens in {total_time:.2f}s; "
              f"{kv / 1e6:.1f} MB of KV moved prefill -> decode over Mooncake]", flush=True)
        if keep_running:
            _print_how_to_call(base, prefill, decode, stack.model_name)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        _say("\ninterrupted")
    finally:
        _say("shutting down ...")
        stack.close()  # whatever happened above, the servers and the router go too
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _say(text: str) -> None:
    """Print, but never fail the shutdown over a closed terminal or pipe."""
    try:
        print(text, flush=True)
    except OSError:
        pass


def _stream_chat(base: str, model: str, question: str, max_new_tokens: int) -> tuple[int, float, float]:
    """Stream one chat answer to stdout; (completion tokens, TTFT, total seconds)."""
    from tandem.tools.client import stream_openai

    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_new_tokens,
            "temperature": 0, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, tokens, chunks = None, None, 0
    for event in stream_openai(base, "/v1/chat/completions", body):
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        for choice in event.get("choices", []):
            text = choice.get("delta", {}).get("content")
            if text:
                if ttft is None:
                    ttft = time.perf_counter() - start
                chunks += 1
                sys.stdout.write(text)
                sys.stdout.flush()
    elapsed = time.perf_counter() - start
    return tokens if tokens is not None else chunks, ttft or elapsed, elapsed


def _print_how_to_call(base: str, prefill, decode, model: str) -> None:
    print(f"""
The stack keeps running (Ctrl-C stops it). Call it:

  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hi!"}}], "stream": true}}'

  # gRPC (SGLang's scheduler protocol): a disaggregated request goes to both servers with the
  # same bootstrap room; the router does that pairing, so call the router or run both legs:
  tandem client generate --target {decode.target} --prefill-target {prefill.target} \\
      --bootstrap-port {prefill.bootstrap_port} --prompt "What is a KV cache?" --chat

Metrics: http://127.0.0.1:{prefill.metrics_port}/metrics (prefill), http://127.0.0.1:{decode.metrics_port}/metrics (decode)
""", flush=True)
