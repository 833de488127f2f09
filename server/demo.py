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
    print(f"loaded in {time.monotonic() - t0:.1f}s; KV pool {engine.max_total_tokens} tokens, "
          f"page size {config.page_size}", flush=True)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    with engine:
        prompts = [
            engine.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in QUESTIONS
        ]
        start = time.monotonic()
        # All questions run together (continuous batching); the first answer streams live while
        # the others are collected, then printed.
        streams = [engine.submit(engine.tokenizer.encode(p), params) for p in prompts]
        totals = [0] * len(streams)
        texts = [""] * len(streams)

        def collect(i):
            for out in streams[i]:
                totals[i] = out.completion_tokens
                texts[i] += out.text

        workers = [threading.Thread(target=collect, args=(i,)) for i in range(1, len(streams))]
        for w in workers:
            w.start()
        print(f"\n>>> {QUESTIONS[0]}\n", flush=True)
        for out in streams[0]:
            totals[0] = out.completion_tokens
            texts[0] += out.text
            sys.stdout.write(out.text)
            sys.stdout.flush()
        for w in workers:
            w.join()
        elapsed = time.monotonic() - start
        print()
        for q, text in zip(QUESTIONS[1:], texts[1:]):
            print(f"\n>>> {q}\n\n{text.strip()}")
        total = sum(totals)
        print(f"\n[{len(streams)} requests, {total} tokens in {elapsed:.2f}s: {total / elapsed:.1f} tokens/s]")
    return 0
