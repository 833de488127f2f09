"""`tandem demo`, offline form: load the built-in model, stream a few chat answers, report speed."""

from __future__ import annotations

import sys
import threading
import time

from tandem.server.config import EngineConfig
from tandem.server.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for writing readable Python code.",
    "Explain in two sentences what a KV cache is in a language model.",
    "Write a haiku about Kubernetes.",
]


def run_offline_demo(config: EngineConfig, max_new_tokens: int) -> int:
    from tandem.server.engine import Engine

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
