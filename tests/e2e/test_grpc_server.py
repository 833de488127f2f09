"""`tandem serve` over SGLang's gRPC scheduler protocol: exact streamed output, aborts and
cancellations free everything, bad input names the field, the info RPCs the router reads,
/metrics counters that move by exactly the tokens served, and a graceful SIGTERM."""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import threading
import time
import zipfile
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2

from support.checks import assert_matches_reference
from support.serving import ServerProcess, metric_value
from support.structured import REGEXES, SCHEMAS, assert_full_match, assert_valid_json, chat_prompt
from tandem.server.scheduling.sampling_params import Constraint, SamplingParams
from tandem.tools.client import Client, request_message

POOL = 6144


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(
        "--max-total-tokens", str(POOL), "--page-size", "16", "--chunked-prefill-size", "256",
        "--served-model-name", "smollm2", log_path=tmp_path_factory.mktemp("serve") / "server.log",
    )
    yield proc
    assert proc.stop() == 0


@pytest.fixture
def client(server):
    c = Client(server.target)
    yield c
    c.close()


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.SglangSchedulerStub(channel)


def wait_idle(stub, timeout=30.0) -> pb.SchedulerLoad:
    """Until nothing runs or waits; then every page must be free or evictable cache."""
    deadline = time.monotonic() + timeout
    while True:
        load = stub.GetLoads(pb.GetLoadsRequest()).loads[0]
        if load.num_running_reqs == 0 and load.num_waiting_reqs == 0 and load.num_used_tokens == 0:
            return load
        assert time.monotonic() < deadline, f"server not idle: {load}"
        time.sleep(0.1)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def test_streamed_output_equals_in_process_engine(server, client, stub, smollm_fp32, hf_reference, make_engine):
    tok = smollm_fp32.tokenizer
    prompts = [tok.encode(t) for t in (
        "The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
        "Kubernetes is a system for", "1, 2, 3, 4,", "The quick brown fox",
    )]
    results: dict[int, object] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, client.stream(request_message(prompts[i], greedy(16)))))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine = make_engine(page_size=16, chunked_prefill_size=256)
    local = engine.generate(prompts, greedy(16))
    for i, p in enumerate(prompts):
        want, gaps = hf_reference.greedy(p, 16)
        assert results[i].finish_reason == "length" and results[i].prompt_tokens == len(p)
        assert_matches_reference(results[i].output_ids, want, gaps, f"grpc prompt {i}")
        assert_matches_reference(local[i].output_ids, want, gaps, f"engine prompt {i}")
        assert results[i].output_ids == local[i].output_ids
    wait_idle(stub)


def test_non_streaming_returns_one_complete_with_all_ids(stub, smollm_fp32):
    ids = smollm_fp32.tokenizer.encode("The capital of France is")
    responses = list(stub.Generate(request_message(ids, greedy(8), stream=False)))
    assert len(responses) == 1 and responses[0].HasField("complete")
    c = responses[0].complete
    assert len(c.output_ids) == 8 and c.finish_reason == "length" and c.completion_tokens == 8


def test_stop_token_and_eos(stub, smollm_fp32):
    tok = smollm_fp32.tokenizer
    ids = tok.encode("The capital of France is")
    full = list(stub.Generate(request_message(ids, greedy(10), stream=False)))[0].complete.output_ids
    params = SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=(full[2],))
    c = list(stub.Generate(request_message(ids, params, stream=False)))[0].complete
    assert c.finish_reason == "stop" and c.matched_token_id == full[2] and list(c.output_ids) == list(full[:3])
    chat = tok.apply_chat_template([{"role": "user", "content": "Say hi."}], tokenize=False, add_generation_prompt=True)
    # No max_new_tokens and no EOS listed: the server stops on the model's own EOS.
    msg = request_message(tok.encode(chat), SamplingParams(max_new_tokens=None, temperature=0.0), stream=False)
    c = list(stub.Generate(msg))[0].complete
    assert c.finish_reason == "stop" and c.matched_token_id in (2,) and c.output_ids[-1] == 2


def test_n_choices(stub, smollm_fp32):
    ids = smollm_fp32.tokenizer.encode("The capital of France is")
    msg = request_message(ids, greedy(6))
    msg.sampling_params.n = 3
    completes = [r.complete for r in stub.Generate(msg) if r.HasField("complete")]
    assert sorted(c.index for c in completes) == [0, 1, 2]
    assert len({tuple(c.output_ids) for c in completes}) == 1  # greedy: the same answer thrice


def test_abort_mid_stream_frees_everything(server, stub, smollm_fp32):
    ids = smollm_fp32.tokenizer.encode("Count from one to a thousand:")
    msg = request_message(ids, greedy(2000), rid="to-abort")
    seen, final = 0, None
    for response in stub.Generate(msg):
        if response.HasField("chunk"):
            seen += 1
            if seen == 3:
                assert stub.Abort(pb.AbortRequest(request_id="to-abort")).success
                assert stub.Abort(pb.AbortRequest(request_id="to-abort")).success  # idempotent
        else:
            final = response.complete
    assert final is not None and final.finish_reason == "abort" and final.completion_tokens < 2000
    assert stub.Abort(pb.AbortRequest(request_id="never-existed")).success
    wait_idle(stub)


def test_client_cancel_frees_everything(stub, smollm_fp32):
    ids = smollm_fp32.tokenizer.encode("Write a very long story:")
    call = stub.Generate(request_message(ids, greedy(2000)))
    for i, _ in enumerate(call):
        if i == 3:
            call.cancel()
            break
    assert call.code() == grpc.StatusCode.CANCELLED
    wait_idle(stub)


BAD = [
    ("input_ids", lambda m: m.tokenized.ClearField("input_ids"), "prompt"),
    ("over the context", lambda m: m.tokenized.input_ids.extend([5] * 8200), "context length 8192"),
    ("token beyond vocab", lambda m: m.tokenized.input_ids.append(49152), "prompt_token_ids"),
    ("top_k", lambda m: setattr(m.sampling_params, "top_k", -5), "top_k"),
    ("temperature", lambda m: setattr(m.sampling_params, "temperature", math.nan), "temperature"),
    ("top_p", lambda m: setattr(m.sampling_params, "top_p", 1.5), "top_p"),
    ("repetition_penalty", lambda m: setattr(m.sampling_params, "repetition_penalty", -1.0), "repetition_penalty"),
    ("max_new_tokens", lambda m: setattr(m.sampling_params, "max_new_tokens", 0), "max_new_tokens"),
    ("stop_token_ids", lambda m: m.sampling_params.stop_token_ids.append(10**6), "stop_token_ids"),
    ("n", lambda m: setattr(m.sampling_params, "n", 1000), "sampling_params.n"),
    ("top_logprobs_num", lambda m: setattr(m, "top_logprobs_num", -3), "top_logprobs_num"),
    ("request_id", lambda m: setattr(m, "request_id", ""), "request_id"),
    ("regex", lambda m: setattr(m.sampling_params, "regex", "(a"), "regex: does not compile"),
    ("json_schema", lambda m: setattr(m.sampling_params, "json_schema", '{"type": 1}'), "json_schema: does not compile"),
    ("json_schema not JSON", lambda m: setattr(m.sampling_params, "json_schema", "{'a'}"), "json_schema: is not valid JSON"),
    ("ebnf_grammar", lambda m: setattr(m.sampling_params, "ebnf_grammar", "root ::= ("), "ebnf_grammar: does not compile"),
    ("structural_tag", lambda m: setattr(m.sampling_params, "structural_tag", "[]"), "structural_tag: does not compile"),
]


@pytest.mark.parametrize("case,mutate,field", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_invalid_argument_naming_the_field(stub, case, mutate, field):
    msg = request_message([1, 2, 3, 4], greedy(4))
    mutate(msg)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(msg))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    wait_idle(stub)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_constrained_output_over_grpc(client, stub, smollm_fp32, temperature):
    """Every schema and regex as sampling_params.json_schema / .regex, all at once (sampled ones with
    the server's seeds: the wire has none)."""
    tok = smollm_fp32.tokenizer
    cases = [(what, Constraint("json_schema", json.dumps(schema)), schema) for what, schema in SCHEMAS]
    cases += [(what, Constraint("regex", pattern), pattern) for what, pattern in REGEXES]
    results: dict[int, object] = {}

    def one(i):
        params = SamplingParams(max_new_tokens=200, temperature=temperature, constraint=cases[i][1])
        results[i] = client.stream(request_message(tok.encode(chat_prompt(tok, cases[i][0])), params))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i, (what, constraint, spec) in enumerate(cases):
        assert results[i].finish_reason == "stop", what
        text = tok.decode(results[i].output_ids, skip_special_tokens=True)
        if constraint.kind == "regex":
            assert_full_match(text, spec, what)
        else:
            assert_valid_json(text, spec, what)
    wait_idle(stub)


def test_client_cli_takes_a_regex(server):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "tandem.cli.main", "client", "generate", "--target", server.target, "--chat",
           "--prompt", "What time is it?", "--regex", r"([01]\d|2[0-3]):[0-5]\d", "--max-new-tokens", "20"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert_full_match(proc.stdout.strip(), r"([01]\d|2[0-3]):[0-5]\d", "client --regex")
    assert ", stop; TTFT" in proc.stderr


def test_request_that_cannot_fit_is_resource_exhausted(stub):
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request_message([5] * (POOL + 10), greedy(4))))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "KV pool" in err.value.details()


def test_health_and_info(server, stub):
    with grpc.insecure_channel(server.target) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert stub.HealthCheck(pb.HealthCheckRequest()).healthy
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.is_generation and info.served_model_name == "smollm2"
    assert info.max_context_length == 8192 and info.vocab_size == 49152 and 2 in info.eos_token_ids
    assert info.max_req_input_len == POOL - 1 and info.architectures == ["LlamaForCausalLM"]
    assert (info.tokenizer_path and json.loads(open(f"{info.tokenizer_path}/tokenizer.json").read()))
    args = stub.GetServerInfo(pb.GetServerInfoRequest()).server_args
    assert args["page_size"] == 16 and args["disaggregation_mode"] == "null" and args["max_total_tokens"] == POOL
    assert args["grammar_backend"] == "xgrammar"  # structured output (the protocol has no field of its own)
    assert args["max_prefill_tokens"] == 256  # unset: resolved for a CPU, and reported as resolved
    load = stub.GetLoads(pb.GetLoadsRequest(include=["all"]))
    assert load.dp_rank_count == 1 and load.loads[0].max_total_num_tokens == POOL


def test_a_cpu_server_runs_on_tcmalloc(server):
    """`tandem serve` re-executed itself (same pid) with tcmalloc preloaded, and says so."""
    assert "libtcmalloc_minimal.so.4" in Path(f"/proc/{server.proc.pid}/maps").read_text()
    assert re.search(r"memory allocator: tcmalloc \(\S+libtcmalloc_minimal\.so\.4; auto: a CPU server",
                     server.log_path.read_text())


def test_get_tokenizer_streams_a_zip(stub):
    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest() and all(not c.sha256 for c in chunks[:-1])
    archive = zipfile.ZipFile(io.BytesIO(data))
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(archive.namelist())
    # The model's config comes with the tokenizer: smg would otherwise look it up on the Hub per chat request.
    config = json.loads(archive.read("config.json"))
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152


def test_flush_cache_and_unimplemented(stub):
    assert stub.FlushCache(common_pb2.FlushCacheRequest()).success
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(pb.EmbedRequest(request_id="e"))
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_metrics_count_exactly_the_tokens_served(server, client, stub):
    wait_idle(stub)
    before = server.metrics_text()
    prompts = [[100 + i] * (20 + i) for i in range(3)]
    results = [client.stream(request_message(p, greedy(5 + i))) for i, p in enumerate(prompts)]
    wait_idle(stub)
    after = server.metrics_text()

    def delta(name):
        return metric_value(after, name) - metric_value(before, name)

    assert delta("tandem_generation_tokens_total") == sum(len(r.output_ids) for r in results) == 5 + 6 + 7
    assert delta("tandem_prompt_tokens_total") == sum(len(p) for p in prompts)
    assert delta("tandem_time_to_first_token_seconds_count") == 3
    assert delta("tandem_e2e_request_latency_seconds_count") == 3
    assert delta("tandem_inter_token_latency_seconds_count") == 4 + 5 + 6
    assert metric_value(after, "tandem_kv_pages_total") == POOL // 16
    assert metric_value(after, "tandem_num_requests_running") == 0
    assert 'role="colocated"' in after and 'model="smollm2"' in after


def test_front_stays_responsive_under_load(server, stub, smollm_fp32):
    """Health, loads and /metrics answer while every slot streams long generations."""
    ids = smollm_fp32.tokenizer.encode("Tell me everything about the history of computing.")
    calls = [stub.Generate(request_message(ids, greedy(300), rid=f"load-{i}")) for i in range(8)]
    first = [next(iter(c)) for c in calls]  # all started
    assert all(r.HasField("chunk") for r in first)
    for _ in range(3):
        assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=5).healthy
        assert stub.GetLoads(pb.GetLoadsRequest(), timeout=5).loads[0].num_running_reqs >= 1
        assert "tandem_num_requests_running" in server.metrics_text()
    for i, c in enumerate(calls):
        stub.Abort(pb.AbortRequest(request_id=f"load-{i}"))
        list(c)
    wait_idle(stub)


def test_sigterm_drains_and_exits_zero(tmp_path, smollm_fp32):
    proc = ServerProcess("--max-total-tokens", "2048", "--drain-grace-seconds", "30", log_path=tmp_path / "drain.log")
    client = Client(proc.target)
    ids = smollm_fp32.tokenizer.encode("Once upon a time")
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", client.stream(request_message(ids, greedy(40)))))
    t.start()
    with grpc.insecure_channel(proc.target) as channel:  # wait until it is in flight
        loads = pb_grpc.SglangSchedulerStub(channel)
        deadline = time.monotonic() + 60
        while loads.GetLoads(pb.GetLoadsRequest()).loads[0].num_running_reqs == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
    proc.proc.send_signal(15)
    deadline = time.monotonic() + 30
    while "draining" not in proc.log_path.read_text() and proc.proc.poll() is None:
        assert time.monotonic() < deadline, "the server never started draining"
        time.sleep(0.05)
    with pytest.raises(grpc.RpcError) as err:
        client.stream(request_message(ids, greedy(4)))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    t.join(120)
    assert box["r"].finish_reason == "length" and len(box["r"].output_ids) == 40  # in flight: finished
    assert proc.stop() == 0
    client.close()


def test_client_cli_streams_and_reports(server):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "tandem.cli.main", "client", "generate", "--target", server.target,
           "--prompt", "The capital of France is", "--max-new-tokens", "8", "--ignore-eos"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(" Paris")
    assert "[8 tokens, length; TTFT" in proc.stderr and "tokens/s]" in proc.stderr
    chat = subprocess.run(
        [sys.executable, "-m", "tandem.cli.main", "chat", "--target", server.target, "--max-new-tokens", "24"],
        input="What is the capital of France?\n\n", capture_output=True, text=True, timeout=120,
    )
    assert chat.returncode == 0, chat.stderr
    assert "Paris" in chat.stdout and "TTFT" in chat.stderr
