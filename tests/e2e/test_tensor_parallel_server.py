"""`tandem serve --tp-size 3`: exact streamed output, GetServerInfo reports the TP size (the
router pairs servers by it), and a rank killed mid-request ends the call with INTERNAL naming the
rank, turns health off and makes the process exit 1, taking the other rank with it."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc

from support.checks import assert_matches_reference
from support.prompts import prompts
from support.serving import ServerProcess, process_gone
from tandem.server.scheduling.sampling_params import SamplingParams
from tandem.tools.client import Client, request_message


def rank_processes(pid: int) -> dict[int, int]:
    """{rank: pid} of the tensor-parallel ranks server `pid` started (from any of its threads)."""
    ranks = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            if b"tandem.server.parallel.workers" in argv:
                ranks[int(argv[argv.index(b"tandem.server.parallel.workers") + 1])] = int(child)
    return ranks


def test_tp3_server_serves_exactly_then_fails_fast_when_a_rank_dies(tmp_path, smollm_fp32, hf_reference):
    server = ServerProcess("--tp-size", "3", "--max-total-tokens", "4096", log_path=tmp_path / "server.log")
    client = Client(server.target)
    try:
        with grpc.insecure_channel(server.target) as channel:
            args = pb_grpc.SglangSchedulerStub(channel).GetServerInfo(pb.GetServerInfoRequest()).server_args
        assert args["tp_size"] == 3
        ranks = rank_processes(server.proc.pid)
        assert sorted(ranks) == [1, 2], ranks

        ids = smollm_fp32.tokenizer.encode("The three primary colors are")
        want, gaps = hf_reference.greedy(ids, 16)
        greedy = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
        assert_matches_reference(client.stream(request_message(ids, greedy)).output_ids, want, gaps, "tp3 server")

        long_prompt = max(prompts(smollm_fp32.tokenizer), key=len)
        box: dict = {}

        def call():
            try:
                client.stream(request_message(long_prompt, SamplingParams(max_new_tokens=4000, ignore_eos=True)))
            except grpc.RpcError as e:
                box["error"] = e

        t = threading.Thread(target=call)
        t.start()
        time.sleep(2.0)  # prefilling or decoding by now
        os.kill(ranks[2], signal.SIGKILL)
        t.join(60)
        assert not t.is_alive(), "the request hung after a rank died"
        err = box.get("error")
        assert err is not None and err.code() == grpc.StatusCode.INTERNAL, err
        assert "tensor-parallel rank 2 exited with code -9" in err.details()
        assert server.proc.wait(60) == 1
        assert "stopping: tensor-parallel rank 2 exited" in server.log_path.read_text()
        deadline = time.monotonic() + 20
        while not process_gone(ranks[1]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert process_gone(ranks[1]), "rank 1 outlived the server"
    finally:
        client.close()
        server.stop()


def test_tp_size_that_does_not_divide_the_heads_fails_at_startup(tmp_path):
    server = ServerProcess("--tp-size", "2", "--max-total-tokens", "1024", log_path=tmp_path / "bad.log", wait=False)
    try:
        assert server.proc.wait(240) != 0
        assert "--tp-size=2 is invalid for SmolLM2-135M-Instruct: it must divide the model's 9 query heads" in \
            server.log_path.read_text()
    finally:
        server.stop()

