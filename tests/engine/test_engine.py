"""The in-process Engine: bad input is refused with the field named and nothing lost, aborts free
everything, streaming, stop conditions, seeded sampling, model loading errors and the CLI."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from functools import partial

import pytest

from tandem.server.config import EngineConfig
from tandem.server.loop.inbox import Call
from tandem.server.model.loader import ModelLoadError, load_weights, resolve_model
from tandem.server.scheduling.sampling_params import InvalidRequestError, SamplingParams

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)


def rejected_field(engine, prompt, params=GREEDY) -> str:
    with pytest.raises(InvalidRequestError) as err:
        engine.submit(prompt, params)
    return err.value.field


BAD_PARAMS = [
    ("temperature", dict(temperature=-0.5)),
    ("temperature", dict(temperature=math.nan)),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=math.inf)),
    ("top_k", dict(top_k=-2)),
    ("min_p", dict(min_p=1.5)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("frequency_penalty", dict(frequency_penalty=-3.0)),
    ("presence_penalty", dict(presence_penalty=math.nan)),
    ("max_new_tokens", dict(max_new_tokens=-1)),
    ("stop_token_ids", dict(stop_token_ids=(10**6,))),
    ("seed", dict(seed=-7)),
]


@pytest.mark.parametrize("field,bad", BAD_PARAMS, ids=[f"{f}={v}" for f, v in BAD_PARAMS])
def test_bad_sampling_values_name_the_field(make_engine, field, bad):
    engine = make_engine(max_total_tokens=2048)
    with pytest.raises(InvalidRequestError) as err:
        engine.submit("hello", SamplingParams(**bad))
    assert err.value.field == field and field in str(err.value)


def test_bad_prompts_are_refused_and_the_engine_keeps_serving(make_engine):
    engine = make_engine(max_total_tokens=512, page_size=16)
    # A request in flight while the bad ones arrive must be unaffected.
    running = engine.submit("The capital of France is", SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))
    assert rejected_field(engine, "") == "prompt"
    assert rejected_field(engine, []) == "prompt"
    assert rejected_field(engine, [1, 2, -5]) == "prompt_token_ids"
    assert rejected_field(engine, [1, 2, 49152]) == "prompt_token_ids"
    with pytest.raises(InvalidRequestError, match=r"KV pool of 512 tokens.*at most 511"):
        engine.submit([5] * 600, GREEDY)
    with pytest.raises(InvalidRequestError, match=r"context length 8192"):
        engine.submit([5] * 9000, GREEDY)
    out = running.result()
    assert out.finish_reason == "length" and len(out.output_ids) == 16
    assert engine.submit("Hello", GREEDY).result().finish_reason in ("stop", "length")


def test_prompt_over_the_context_length(make_engine):
    engine = make_engine(context_length=64, max_total_tokens=1024)
    with pytest.raises(InvalidRequestError, match=r"context length 64 \(at most 63\)") as err:
        engine.submit([7] * 64, GREEDY)
    assert err.value.field == "prompt"
    # Output is capped by the context: 60 prompt tokens leave room for 4.
    out = engine.submit([7] * 60, SamplingParams(max_new_tokens=100, temperature=0, ignore_eos=True)).result()
    assert len(out.output_ids) == 4 and out.finish_reason == "length"


def test_duplicate_request_id_is_refused(make_engine):
    engine = make_engine()
    stream = engine.submit("a b c", SamplingParams(max_new_tokens=64, temperature=0, ignore_eos=True), rid="same")
    with pytest.raises(InvalidRequestError) as err:
        engine.submit("d e f", GREEDY, rid="same")
    assert err.value.field == "rid"
    stream.abort()
    assert stream.result().finish_reason == "abort"


def test_abort_mid_stream_frees_everything(make_engine):
    engine = make_engine(page_size=4)
    params = SamplingParams(max_new_tokens=500, temperature=0, ignore_eos=True)
    streams = [engine.submit(f"Count to a thousand, number {i}:", params) for i in range(3)]
    seen = 0
    for out in streams[0]:
        seen += len(out.token_ids)
        if seen == 5:
            break
    for s in streams:
        s.abort()
        s.abort()  # idempotent
    engine.abort("no-such-request")  # unknown ids are fine
    results = [s.result() for s in streams[1:]]
    assert all(r.finish_reason == "abort" and len(r.output_ids) < 500 for r in results)
    # make_engine's teardown proves every page and slot came back.


def test_abort_while_waiting(make_engine):
    engine = make_engine(max_running_requests=1)
    params = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True)
    first = engine.submit("one two three", params)
    queued = engine.submit("four five six", params)
    queued.abort()
    assert queued.result().finish_reason == "abort"
    first.abort()
    assert first.result().finish_reason == "abort"


def test_streaming_chunks_add_up(make_engine):
    engine = make_engine()
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    chunks = list(engine.submit("The capital of France is", params))
    assert all(len(c.token_ids) == 1 for c in chunks)
    assert [c.completion_tokens for c in chunks] == list(range(1, 13))
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    whole = engine.submit("The capital of France is", params).result()
    assert [t for c in chunks for t in c.token_ids] == whole.output_ids
    assert "".join(c.text for c in chunks) == whole.text == engine.tokenizer.decode(whole.output_ids, skip_special_tokens=True)


def test_stop_strings_and_stop_tokens(make_engine):
    engine = make_engine()
    base = engine.submit("The capital of France is", SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)).result()
    assert base.text.startswith(" Paris.")
    out = engine.submit("The capital of France is", SamplingParams(max_new_tokens=20, temperature=0, stop=("ris",))).result()
    assert out.finish_reason == "stop" and out.matched_stop == "ris" and out.text == " Pa"
    stop_id = base.output_ids[2]
    out = engine.submit("The capital of France is", SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=(stop_id,))).result()
    assert out.finish_reason == "stop" and out.matched_stop == stop_id and out.output_ids == base.output_ids[:3]


def test_eos_stops_unless_ignored(make_engine):
    engine = make_engine()
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}], tokenize=False, add_generation_prompt=True)
    out = engine.submit(prompt, SamplingParams(max_new_tokens=200, temperature=0)).result()
    assert out.finish_reason == "stop" and out.matched_stop in engine.eos_token_ids
    assert out.output_ids[-1] in engine.eos_token_ids
    longer = engine.submit(prompt, SamplingParams(max_new_tokens=len(out.output_ids) + 5, temperature=0, ignore_eos=True)).result()
    assert longer.finish_reason == "length" and longer.output_ids[: len(out.output_ids)] == out.output_ids


def test_seeded_sampling_is_reproducible_under_any_batching(make_engine):
    engine = make_engine()
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.95, top_k=50, seed=1234)
    alone = engine.submit("Tell me a story:", params).result().output_ids
    crowd = [engine.submit(f"Unrelated prompt {i}", SamplingParams(max_new_tokens=16, temperature=1.0)) for i in range(4)]
    again = engine.submit("Tell me a story:", params)
    assert again.result().output_ids == alone
    for c in crowd:
        c.result()
    other = engine.submit("Tell me a story:", SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.95, top_k=50, seed=99)).result()
    assert other.output_ids != alone


def test_logprobs(make_engine):
    engine = make_engine()
    out = engine.submit("The capital of France is", SamplingParams(max_new_tokens=4, temperature=0, logprobs=True, top_logprobs=3)).result()
    assert len(out.logprobs) == len(out.output_ids) == 4
    for token, lp, tops in zip(out.output_ids, out.logprobs, out.top_logprobs):
        assert lp <= 0 and tops[0][0] == token and tops[0][1] == pytest.approx(lp)  # greedy: the top one
        assert [v for _, v in tops] == sorted((v for _, v in tops), reverse=True)


def test_concurrent_submitters(make_engine):
    engine = make_engine(max_running_requests=4)
    results, errors = {}, []

    def worker(i):
        try:
            results[i] = engine.submit(f"Item {i}:", SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)).result()
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 10 and all(len(r.output_ids) == 6 for r in results.values())


def test_unknown_model_and_corrupt_gguf(tmp_path):
    with pytest.raises(ModelLoadError, match=r"--model '/nonexistent/model.gguf': no such file"):
        resolve_model("/nonexistent/model.gguf")
    with pytest.raises(ModelLoadError, match=r"unknown built-in model"):
        resolve_model("builtin:gpt-17")
    corrupt = tmp_path / "broken.gguf"
    real = resolve_model("builtin:smollm2-135m").path
    corrupt.write_bytes(real.read_bytes()[:4096])  # a valid header, truncated data
    with pytest.raises(ModelLoadError, match=r"--model .*broken.gguf.*cannot read the model"):
        load_weights(resolve_model(str(corrupt)))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ModelLoadError, match=r"cannot read the model"):
        load_weights(resolve_model(str(garbage)))


def test_invalid_engine_config_names_the_flag():
    for bad, flag in [
        (dict(page_size=0), "--page-size"),
        (dict(chunked_prefill_size=8, page_size=16), "--chunked-prefill-size"),
        (dict(kv_memory_fraction=1.5), "--kv-memory-fraction"),
        (dict(max_running_requests=0), "--max-running-requests"),
        (dict(max_prefill_tokens=0), "--max-prefill-tokens"),
        (dict(compute_priority="idle", tp_size=3), "--compute-priority"),
    ]:
        with pytest.raises(ValueError, match=flag):
            EngineConfig(**bad).validate()


def test_cli_generate_json(tmp_path, smollm_fp32):
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3,"]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in prompts) + "\n")
    cmd = [sys.executable, "-m", "tandem.cli.main", "generate", "--prompts-file", str(path), "--max-new-tokens", "8",
           "--temperature", "0", "--ignore-eos", "--json", "--max-total-tokens", "4096", "--page-size", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    tok = smollm_fp32.tokenizer
    for row, prompt in zip(rows, prompts):
        assert set(row) == {"index", "prompt_tokens", "output_ids", "text", "finish_reason"}
        assert row["prompt_tokens"] == len(tok.encode(prompt)) and len(row["output_ids"]) == 8
        assert row["text"] == tok.decode(row["output_ids"], skip_special_tokens=True)
    assert rows[0]["text"].startswith(" Paris")
    bad = subprocess.run(cmd[:-4] + ["--top-k", "-5"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "top_k" in bad.stderr


def test_logprobs_only_for_requests_that_ask(make_engine):
    engine = make_engine()
    asks = engine.submit("The capital of France is", SamplingParams(max_new_tokens=5, temperature=0, logprobs=True, top_logprobs=2))
    plain = engine.submit("The capital of Italy is", SamplingParams(max_new_tokens=5, temperature=0))
    a, b = asks.result(), plain.result()
    assert len(a.logprobs) == len(a.top_logprobs) == 5 and all(isinstance(v, float) for v in a.logprobs)
    assert b.logprobs == [] and b.top_logprobs == []


def test_stopped_engine_refuses_and_ends_everything(smollm_fp32):
    from tandem.server.loop.engine import Engine

    engine = Engine(EngineConfig(max_total_tokens=2048), model=smollm_fp32).start()
    streams = [engine.submit(f"Story number {i}:", SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)) for i in range(4)]
    engine.shutdown()
    assert not engine.alive
    assert all(s.result().finish_reason == "abort" for s in streams)  # none hangs
    with pytest.raises(RuntimeError, match="shut down"):
        engine.submit("late", GREEDY)
    with pytest.raises(RuntimeError, match="shut down"):
        engine.call(lambda: None)
    engine.abort("anything")  # harmless


def test_engine_shut_down_before_it_started_ends_what_was_submitted(smollm_fp32):
    """The loop runs only after start(); what was submitted before a shutdown still ends."""
    from concurrent.futures import Future

    from tandem.server.loop.engine import Engine

    engine = Engine(EngineConfig(max_total_tokens=2048), model=smollm_fp32)
    stream = engine.submit("never run", GREEDY, rid="early")
    pending: Future = Future()
    engine.inbox.put(Call(lambda: 1, pending))
    engine.shutdown()
    assert stream.result().finish_reason == "abort" and not engine.alive
    with pytest.raises(RuntimeError, match="shut down"):
        pending.result(timeout=1)
    with pytest.raises(RuntimeError, match="shut down"):
        engine.start()
    engine.shutdown()  # twice is harmless


def test_hf_id_resolves_from_the_local_cache_only(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--acme--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    source = resolve_model("hf:acme/tiny")
    assert (source.kind, source.path, source.name) == ("hf", snapshot, "tiny")
    with pytest.raises(ModelLoadError, match=r"--model 'hf:acme/absent': no cached snapshot .*never downloads"):
        resolve_model("hf:acme/absent")


@pytest.mark.parametrize("plain", [False, True], ids=["overlap", "plain"])
def test_the_engine_loads_its_model_on_its_own_thread_and_a_failed_load_raises_here(monkeypatch, plain):
    """All torch work on one thread (the OpenMP pools: see server/loop/engine_thread.py), the one that runs
    the forward passes: the runner thread under overlap scheduling, else the engine thread. What
    loading raises comes out of the constructor, and nothing is left running."""
    from tandem.server.loop import engine_thread
    from tandem.server.loop.engine import Engine

    loaded_on = []

    def failing_load(*args, **kwargs):
        loaded_on.append(threading.current_thread())
        raise ModelLoadError("--model 'x': cannot read the model")

    monkeypatch.setattr(engine_thread, "load_model", failing_load)
    with pytest.raises(ModelLoadError, match="cannot read the model"):
        Engine(EngineConfig(max_total_tokens=2048, disable_overlap_schedule=plain))
    [thread] = loaded_on
    assert thread.name.startswith("tandem-engine" if plain else "tandem-runner")
    assert thread is not threading.current_thread()
    thread.join(timeout=10)
    assert not thread.is_alive()


@pytest.mark.parametrize("plain", [False, True], ids=["overlap", "plain"])
def test_compute_priority_idle_puts_the_forward_pass_thread_alone_under_sched_idle(make_engine, plain):
    """`--compute-priority idle` (a decode sharing its cores with a prefill): the thread that
    runs forward passes (the runner thread under overlap, else the engine thread) is SCHED_IDLE;
    under overlap the engine thread, which plans and publishes, is not. Outputs are unchanged."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    normal = make_engine(disable_overlap_schedule=plain)
    idle = make_engine(disable_overlap_schedule=plain, compute_priority="idle")
    policy = partial(os.sched_getscheduler, 0)  # the calling thread's
    forward = idle.call(policy) if plain else idle.steps.run(policy)
    assert forward == os.SCHED_IDLE
    assert idle.call(policy) == (os.SCHED_IDLE if plain else os.SCHED_OTHER)
    assert normal.call(policy) == os.SCHED_OTHER
    assert [o.output_ids for o in idle.generate(prompts, params)] == [o.output_ids for o in normal.generate(prompts, params)]
