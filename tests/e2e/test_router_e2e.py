"""The real router (`smg`, the Shepherd Model Gateway) in front of `tandem serve`: OpenAI chat and
text completions, streaming and not, errors mapped to HTTP statuses, nothing left behind."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc

from support.serving import Router, ServerProcess, http_post, router_workers, served_tokenizer_dir
from support.structured import SCHEMAS, chat_completions_json
from tandem.server.scheduling.sampling_params import SamplingParams

POOL = 4096
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("router")
    server = ServerProcess("--max-total-tokens", str(POOL), "--served-model-name", "smollm2", log_path=logs / "server.log")
    router = Router(*router_workers([server]), tokenizer_dir=served_tokenizer_dir(server.target),
                    log_path=logs / "router.log")
    yield router.url, server
    router.stop()
    assert server.stop() == 0


post = http_post


@pytest.fixture(scope="module")
def expected_answer(smollm_fp32):
    """What the in-process engine answers greedily to QUESTION."""
    from tandem.server.config import EngineConfig
    from tandem.server.loop.engine import Engine

    prompt = smollm_fp32.tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    with Engine(EngineConfig(max_total_tokens=2048), model=smollm_fp32) as engine:
        out = engine.submit(prompt, SamplingParams(max_new_tokens=24, temperature=0.0)).result()
    assert "Paris" in out.text
    return out


def test_chat_completion(stack, expected_answer):
    base, _ = stack
    status, body = post(base, "/v1/chat/completions", {"model": "smollm2", "messages": QUESTION, "max_tokens": 24, "temperature": 0})
    assert status == 200, body
    reply = json.loads(body)
    choice = reply["choices"][0]
    assert choice["message"]["content"] == expected_answer.text.strip()
    assert choice["finish_reason"] == expected_answer.finish_reason
    assert reply["usage"]["completion_tokens"] == len(expected_answer.output_ids)


def test_chat_completion_streaming(stack, expected_answer):
    base, _ = stack
    req = urllib.request.Request(
        base + "/v1/chat/completions",
        json.dumps({"model": "smollm2", "messages": QUESTION, "max_tokens": 24, "temperature": 0, "stream": True}).encode(),
        {"Content-Type": "application/json"},
    )
    pieces, finish = [], None
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            choice = json.loads(line[5:])["choices"][0]
            pieces.append(choice["delta"].get("content") or "")
            finish = choice.get("finish_reason") or finish
    assert len([p for p in pieces if p]) > 3  # streamed in pieces, not one blob
    assert "".join(pieces) == expected_answer.text.strip()
    assert finish == expected_answer.finish_reason


def test_text_completion(stack):
    base, _ = stack
    status, body = post(base, "/v1/completions", {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0})
    assert status == 200, body
    assert json.loads(body)["choices"][0]["text"].startswith(" Paris")


@pytest.mark.parametrize("bad,message", [
    ({"repetition_penalty": 0}, "repetition_penalty: must be > 0"),
    ({"stop_token_ids": [999999]}, "stop_token_ids: token id 999999 is outside the vocabulary"),
])
def test_bad_request_is_400_with_the_server_message(stack, bad, message):
    base, _ = stack
    status, body = post(base, "/v1/chat/completions", {"model": "smollm2", "messages": QUESTION, "max_tokens": 4, **bad})
    assert status == 400 and message in json.loads(body)["error"]["message"]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_response_format_json_schema(stack, temperature):
    """OpenAI's structured output: smg turns response_format into sampling_params.json_schema."""
    base, server = stack
    chat_completions_json(lambda path, body: post(base, path, body), SCHEMAS, temperature)
    with grpc.insecure_channel(server.target) as channel:
        load = pb_grpc.SglangSchedulerStub(channel).GetLoads(pb.GetLoadsRequest()).loads[0]
    assert load.num_running_reqs == load.num_waiting_reqs == load.num_used_tokens == 0


def test_an_unsupported_schema_is_400_naming_the_field(stack):
    base, _ = stack
    status, body = post(base, "/v1/chat/completions", {
        "model": "smollm2", "messages": QUESTION, "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "matrix"}}}})
    assert status == 400 and "json_schema: does not compile" in json.loads(body)["error"]["message"], body


def test_request_that_cannot_fit_is_429_or_503(stack):
    base, server = stack
    start = time.monotonic()
    status, body = post(base, "/v1/completions", {"model": "smollm2", "prompt": "hello " * (POOL + 200), "max_tokens": 4}, timeout=60)
    assert status in (429, 503), body
    assert "KV pool" in body
    assert time.monotonic() - start < 60  # answered, not hung
    with grpc.insecure_channel(server.target) as channel:
        load = pb_grpc.SglangSchedulerStub(channel).GetLoads(pb.GetLoadsRequest()).loads[0]
    assert load.num_running_reqs == load.num_waiting_reqs == load.num_used_tokens == 0
