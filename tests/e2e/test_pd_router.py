"""Prefill/decode disaggregation end to end: `tandem serve --role prefill|decode` processes, KV
over Mooncake TCP, the real router (`smg --pd-disaggregation`) in front. Outputs equal the
reference; every page is freed on every server; a prefill killed mid-flight gives the router's
clients errors, not hangs, and the survivors stay clean and keep serving."""

from __future__ import annotations

import json
import random
import signal
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc

from support.checks import assert_matches_reference
from support.examples import instance
from support.kubelet import expand
from support.serving import PDStack, Router, assert_all_freed, free_port, http_post, metric_value
from support.structured import SCHEMAS, chat_completions_json
from tandem.operator import render

NEW_TOKENS = 12
ENGINE = ("--max-total-tokens", "16384", "--bootstrap-timeout", "20", "--peer-timeout", "2")


TOKEN = "pd-router-test-token"
ROUTER_ARGS = ("--prefill-policy", "round_robin", "--decode-policy", "round_robin", "--disable-retries")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Every server with a bootstrap token file: the pairs authenticate every bootstrap call."""
    logs = tmp_path_factory.mktemp("pd")
    (logs / "bootstrap-tokens").write_text(f"{TOKEN}\n")
    stack = PDStack(logs, (*ENGINE, "--bootstrap-token-file", str(logs / "bootstrap-tokens")), ROUTER_ARGS)
    yield stack
    stack.close()


def generate_all(router: Router, prompts: list[list[int]], max_new_tokens: int = NEW_TOKENS, timeout: float = 300):
    """Send every prompt at once through the router's /generate; [(status, body)] in order."""
    results: list = [None] * len(prompts)

    def one(i):
        body = {"model": "smollm2", "input_ids": prompts[i],
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
        results[i] = router.post("/generate", body, timeout=timeout)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return results


def output_ids(body: str) -> list[int]:
    reply = json.loads(body)
    return (reply[0] if isinstance(reply, list) else reply)["output_ids"]


def prompts_with(rng: random.Random, lengths, shared_prefix: int = 0, shared_count: int = 0) -> list[list[int]]:
    prefix = [rng.randrange(1000, 40000) for _ in range(shared_prefix)]
    out = [prefix + [rng.randrange(1000, 40000) for _ in range(8 + i)] for i in range(shared_count)]
    return out + [[rng.randrange(1000, 40000) for _ in range(n)] for n in lengths]


def test_one_prefill_one_decode_matches_the_reference(stack, hf_reference):
    rng = random.Random(11)
    # 12 concurrent prompts: four share a 500-token prefix, three are over 1,000 tokens.
    prompts = prompts_with(rng, (3, 40, 200, 333, 640, 1024, 1100, 1500), shared_prefix=500, shared_count=4)
    for prompt, (status, body) in zip(prompts, generate_all(stack.one_by_one, prompts)):
        assert status == 200, body
        want, gaps = hf_reference.greedy(prompt, NEW_TOKENS)
        assert_matches_reference(output_ids(body), want, gaps, f"{len(prompt)}-token prompt")
    assert_all_freed(stack.servers)  # first: the prefill books a send once its loop sees it end
    prefill, decode = stack.prefills[0].metrics_text(), stack.decodes[0].metrics_text()
    # Every byte sent arrived (summed over the stack: the 2x2 router's readiness probe crossed over).
    sent = sum(metric_value(s.metrics_text(), "tandem_kv_transfer_bytes_total") for s in stack.prefills)
    received = sum(metric_value(s.metrics_text(), "tandem_kv_transfer_bytes_total") for s in stack.decodes)
    assert sent == received > 0
    assert metric_value(decode, "tandem_kv_transfer_latency_seconds_count") >= len(prompts)
    assert metric_value(prefill, "tandem_kv_transfer_failures_total") == 0


def test_two_by_two_serves_forty_concurrent_requests(stack, hf_reference):
    rng = random.Random(12)
    distinct = prompts_with(rng, [rng.randrange(20, 400) for _ in range(10)])
    prompts = distinct * 4
    before = [metric_value(s.metrics_text(), "tandem_requests_finished_total") for s in stack.servers]
    for prompt, (status, body) in zip(prompts, generate_all(stack.two_by_two, prompts)):
        assert status == 200, body
        want, gaps = hf_reference.greedy(prompt, NEW_TOKENS)
        assert_matches_reference(output_ids(body), want, gaps, f"{len(prompt)}-token prompt")
    after = [metric_value(s.metrics_text(), "tandem_requests_finished_total") for s in stack.servers]
    assert all(a > b for a, b in zip(after, before)), "every server took part"
    assert sum(a - b for a, b in zip(after[:2], before[:2])) == 40  # each request prefilled once
    assert_all_freed(stack.servers)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_response_format_json_schema_through_the_pair(stack, temperature):
    """The prefill samples the first token under the schema, the decode the rest. Every third schema
    (objects, consts, patterns, anyOf, arrays of objects, closed objects, bounded numbers, tuples):
    all of them run in the engine and through the colocated router; here it is the hand-off."""
    chat_completions_json(stack.two_by_two.post, SCHEMAS[::3], temperature)
    assert_all_freed(stack.servers)


def test_decode_leg_with_an_unreachable_prefill_fails_fast(stack):
    """Straight to a decode server over gRPC: nothing listens on the bootstrap port."""
    request = pb.GenerateRequest(
        request_id="nowhere", tokenized=pb.TokenizedInput(input_ids=list(range(100, 140))),
        sampling_params=pb.SamplingParams(temperature=0, top_p=1, top_k=-1, repetition_penalty=1, max_new_tokens=4),
        disaggregated_params=pb.DisaggregatedParams(bootstrap_host="127.0.0.1", bootstrap_port=free_port(), bootstrap_room=5),
    )
    start = time.monotonic()
    with grpc.insecure_channel(stack.decodes[0].target) as channel:
        with pytest.raises(grpc.RpcError) as err:
            list(pb_grpc.SglangSchedulerStub(channel).Generate(request, timeout=60))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "unreachable" in err.value.details()
    assert time.monotonic() - start < 10
    assert_all_freed(stack.decodes[:1])


def bootstrap_call(prefill, path: str, body: dict | None = None, token: str | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(f"http://127.0.0.1:{prefill.bootstrap_port}{path}", data, headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_a_rogue_decode_is_refused_while_the_pairs_keep_serving(stack):
    """A "decode" without the token, or with a wrong one, gets 401 from a prefill's bootstrap
    service on every call (its layout, a peer registration, a room), counted by reason, while
    requests go through both pairs; afterwards the prefill knows only the real decodes, and nothing
    is held anywhere."""
    prefill = stack.prefills[0]
    refused = lambda: {r: metric_value(prefill.metrics_text(), "tandem_bootstrap_refused_total", reason=r)  # noqa: E731
                       for r in ("missing_token", "wrong_token")}
    before = refused()
    prompts = prompts_with(random.Random(21), [300 + 20 * i for i in range(6)])
    results = []
    sender = threading.Thread(target=lambda: results.extend(generate_all(stack.two_by_two, prompts)))
    sender.start()
    rogue = {"decode": "rogue:1", "decode_instance": "r1", "session": "127.0.0.1:1", "layout": {}, "kv_parts": [],
             "record_base": 0}
    room = {"decode": "rogue:1", "decode_instance": "r1", "room": 99, "request_id": "stolen", "prompt_len": 300,
            "digest": 0, "pages": list(range(20)), "record_slot": 0}
    for path, body, token in [("/v1/layout", None, None), ("/v1/peers", rogue, None), ("/v1/peers", rogue, "not-it"),
                              ("/v1/rooms", room, "not-it")]:
        code, answer = bootstrap_call(prefill, path, body, token)
        assert code == 401 and answer["reason"] == ("missing_token" if token is None else "wrong_token"), (path, answer)
    sender.join(300)
    assert [status for status, _ in results] == [200] * len(prompts)
    assert all(len(output_ids(body)) == NEW_TOKENS for _, body in results)
    after = refused()
    assert {r: after[r] - before[r] for r in after} == {"missing_token": 2, "wrong_token": 2}
    code, answer = bootstrap_call(prefill, "/v1/peers", token=TOKEN)
    assert code == 200 and "rogue:1" not in {p["decode"] for p in answer["peers"]} and len(answer["peers"]) <= 2
    assert bootstrap_call(prefill, "/v1/status", {"rooms": [99]}, TOKEN)[1]["rooms"]["99"]["state"] == "unknown"
    assert_all_freed(stack.servers)


def test_the_router_asks_for_one_of_the_specs_api_keys(stack):
    """The router as the operator renders it for `spec.router.apiKeys` (two keys of a Secret, as
    during a rotation), its `$(VAR)`s expanded from the Secret as the kubelet would: a request
    without a key, or with another, gets 401; either key generates."""
    inst = instance("minimal", router={"apiKeys": {"secretName": "client-keys", "keys": ["current", "next"]}})
    secret = {"current": "k-current", "next": "k-next"}
    container = render.render_router_deployment(inst)["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: secret[e["valueFrom"]["secretKeyRef"]["key"]] for e in container["env"] if "valueFrom" in e}
    args = container["args"]
    keys = [a for i, a in enumerate(args) if i and args[i - 1] == "--tenant-api-key"]
    assert len(keys) == 2
    router = stack.start_router(*(arg for key in keys for arg in ("--tenant-api-key", expand(key, env))),
                                servers=[stack.prefills[0], stack.decodes[0]], name="router-keys", api_key="k-current")
    body = {"model": "smollm2", "input_ids": list(range(200, 260)),
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    for key in (None, "k-wrong", "current:k-current"):
        status, answer = http_post(router.url, "/generate", body, api_key=key)
        assert status == 401 and "api key" in answer.lower(), (key, status, answer)
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert http_post(router.url, "/v1/chat/completions", chat)[0] == 401
    for key in ("k-current", "k-next"):
        status, answer = http_post(router.url, "/generate", body, api_key=key)
        assert status == 200 and len(output_ids(answer)) == 4, answer
    router.stop()
    assert_all_freed(stack.servers)


def test_prefill_killed_mid_flight(stack):
    """Last: it kills the second prefill."""
    rng = random.Random(13)
    prompts = prompts_with(rng, [1000 + 50 * i for i in range(8)])
    results = []
    sender = threading.Thread(target=lambda: results.extend(generate_all(stack.two_by_two, prompts, max_new_tokens=32, timeout=120)))
    start = time.monotonic()
    sender.start()
    victim = stack.prefills[1]
    deadline = time.monotonic() + 60
    while metric_value(victim.metrics_text(), "tandem_num_requests_running") + metric_value(victim.metrics_text(), "tandem_inflight_queue_requests") == 0:
        assert time.monotonic() < deadline, "the victim never got work"
        time.sleep(0.05)
    victim.stop(signal.SIGKILL)
    sender.join(150)
    assert not sender.is_alive() and time.monotonic() - start < 150, "a client hung"
    statuses = [status for status, _ in results]
    assert any(status != 200 for status in statuses), statuses  # the victim's requests failed...
    assert all(status in (200, 500, 502, 503, 504) for status in statuses), results  # ...with an answer, not a hang
    survivors = [stack.prefills[0], *stack.decodes]
    assert_all_freed(survivors)
    # The survivors keep serving: the 1x1 router (first prefill, first decode) ...
    status, body = stack.one_by_one.post("/generate", {"model": "smollm2", "input_ids": prompts[0],
                                                        "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert status == 200, body
    # ... and the second decode, paired with the surviving prefill by hand.
    room = rng.randrange(1 << 31)
    request = pb.GenerateRequest(
        request_id="after-kill", tokenized=pb.TokenizedInput(input_ids=prompts[1]),
        sampling_params=pb.SamplingParams(temperature=0, top_p=1, top_k=-1, repetition_penalty=1, max_new_tokens=4),
        disaggregated_params=pb.DisaggregatedParams(bootstrap_host="127.0.0.1", bootstrap_port=stack.prefills[0].bootstrap_port, bootstrap_room=room),
    )
    outs = {}

    def leg(server, key):
        with grpc.insecure_channel(server.target) as channel:
            outs[key] = list(pb_grpc.SglangSchedulerStub(channel).Generate(request, timeout=60))

    legs = [threading.Thread(target=leg, args=(s, k)) for s, k in ((stack.prefills[0], "p"), (stack.decodes[1], "d"))]
    for t in legs:
        t.start()
    for t in legs:
        t.join(70)
    assert len(outs["d"][-1].complete.output_ids) == 4
    assert_all_freed(survivors)
