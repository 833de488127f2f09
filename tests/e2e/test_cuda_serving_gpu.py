"""The engine end to end on one GPU at a real size: a Llama-3-8B-shaped model (random bfloat16
weights) served over gRPC with CUDA graphs, the radix prefix cache and chunked prefill, 64
requests at once, and nothing left held afterwards; then a prefill server and a decode server (two
processes, KV through Mooncake) on the same GPU giving the colocated server's greedy tokens.

Requests go one at a time for that comparison, so that both sides run the same batch shapes: the
same kernels, the same sums. The colocated server stops before the pair starts. Where CUDA is
absent, conftest.py skips these tests."""

from __future__ import annotations

import random
import threading
import time

import pytest

from support.checks import assert_engine_clean
from support.gpu import random_model
from support.serving import ServerProcess, assert_all_freed, free_port
from tandem.server.scheduling.sampling_params import SamplingParams
from tandem.tools.client import Client, request_message

pytestmark = pytest.mark.gpu

MODEL = random_model("llama3-8b")
ENGINE = dict(model=MODEL, dtype="bfloat16", device="cuda", chunked_prefill_size=512)
GREEDY = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
GROUPS, PER_GROUP, PREFIX = 8, 8, 384  # 64 prompts: 8 groups sharing a 384-token prefix each


@pytest.fixture(scope="module")
def colocated():
    from tandem.server.config import EngineConfig, ServeConfig
    from tandem.server.edge.serve import Server

    server = Server(EngineConfig(**ENGINE, max_running_requests=64, max_total_tokens=49152),
                    ServeConfig(port=free_port(), metrics_port=free_port()))
    server.start()
    yield server
    server.drain()
    server.wait()


def shared_prefix_prompts(rng: random.Random) -> list[list[int]]:
    prompts = []
    for _ in range(GROUPS):
        prefix = [rng.randrange(1000, 40000) for _ in range(PREFIX)]
        prompts += [prefix + [rng.randrange(1000, 40000) for _ in range(rng.randrange(64, 640))] for _ in range(PER_GROUP)]
    rng.shuffle(prompts)
    return prompts


def test_colocated_serves_64_at_once(colocated):
    prompts = shared_prefix_prompts(random.Random(0))
    target = f"127.0.0.1:{colocated.config.port}"
    results: list = [None] * len(prompts)

    def send(i: int) -> None:
        client = Client(target)
        try:
            results[i] = client.stream(request_message(prompts[i], GREEDY), timeout=600)
        finally:
            client.close()

    start = time.perf_counter()
    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    assert all(r is not None and r.finish_reason == "length" and len(r.output_ids) == 32 for r in results)
    snapshot = colocated.engine.snapshot
    print(f"64 requests, {sum(len(p) for p in prompts)} prompt tokens, {64 * 32} output tokens in {seconds:.1f} s; "
          f"prefix hits {snapshot.prefix_hit_tokens} tokens; {colocated.engine.runner.graphs.replays} graph replays")
    assert snapshot.prefix_hit_tokens >= PREFIX  # later arrivals of a group reuse its prefix
    assert sum(r.cached_tokens for r in results) >= PREFIX
    assert colocated.engine.runner.graphs.replays > 0
    colocated.engine.check_integrity()
    assert_engine_clean(colocated.engine)


def test_prefill_decode_pair_gives_colocated_tokens(colocated, tmp_path):
    rng = random.Random(1)
    prompts = [[rng.randrange(1000, 40000) for _ in range(n)] for n in (37, 300, 777)]
    target = f"127.0.0.1:{colocated.config.port}"
    client = Client(target)
    try:
        expected = [client.stream(request_message(p, GREEDY), timeout=300).output_ids for p in prompts]
    finally:
        client.close()
    # Three 8B-shaped models (16 GB each, twice that while one is built) do not fit an 80 GB GPU.
    colocated.drain()
    colocated.wait()

    bootstrap_port = free_port()
    engine_args = ("--model", MODEL, "--dtype", "bfloat16", "--device", "cuda", "--max-total-tokens", "32768")
    prefill = ServerProcess("--role", "prefill", "--bootstrap-port", str(bootstrap_port), *engine_args,
                            log_path=tmp_path / "prefill.log", wait=False)
    decode = ServerProcess("--role", "decode", *engine_args, log_path=tmp_path / "decode.log", wait=False)
    try:
        prefill.wait_healthy(timeout=600)
        decode.wait_healthy(timeout=600)
        prefill_client, decode_client = Client(prefill.target), Client(decode.target)
        try:
            for prompt, want in zip(prompts, expected):
                bootstrap = ("127.0.0.1", bootstrap_port, rng.randrange(1 << 31))
                leg = threading.Thread(target=prefill_client.stream,
                                       args=(request_message(prompt, GREEDY, bootstrap=bootstrap),), kwargs={"timeout": 300})
                leg.start()
                got = decode_client.stream(request_message(prompt, GREEDY, bootstrap=bootstrap), timeout=300)
                leg.join()
                assert got.finish_reason == "length"
                assert got.output_ids == want, f"{len(prompt)}-token prompt: PD differs from colocated"
        finally:
            prefill_client.close()
            decode_client.close()
        assert_all_freed([prefill, decode])
    finally:
        prefill.stop()
        decode.stop()
