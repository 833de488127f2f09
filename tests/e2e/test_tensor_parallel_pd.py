"""PD between servers of different tensor-parallel sizes, through the real router (`smg
--pd-disaggregation`): prefill tp 3 -> decode tp 1 and prefill tp 1 -> decode tp 3. Each prefill
rank writes the KV heads it holds into whichever decode rank holds them; outputs equal the HF
reference, and every page is freed on both servers."""

from __future__ import annotations

import json
import threading

import grpc
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc

from support.checks import assert_matches_reference
from support.prompts import prompts
from support.serving import PDStack, assert_all_freed
from tandem.tools.stack import metric_value

NEW_TOKENS = 12
ENGINE = ("--max-total-tokens", "8192", "--chunked-prefill-size", "256", "--bootstrap-timeout", "30")
ROUTER_ARGS = ("--prefill-policy", "round_robin", "--decode-policy", "round_robin", "--disable-retries")


def tp_size(server) -> int:
    with grpc.insecure_channel(server.target) as channel:
        return int(pb_grpc.SglangSchedulerStub(channel).GetServerInfo(pb.GetServerInfoRequest()).server_args["tp_size"])


@pytest.mark.parametrize("prefill_tp, decode_tp", [(3, 1), (1, 3)])
def test_router_pd_between_tp_sizes_matches_the_reference(tmp_path, smollm_fp32, hf_reference, prefill_tp, decode_tp):
    ids = sorted(prompts(smollm_fp32.tokenizer), key=len)
    work = [ids[0], ids[len(ids) // 2], ids[-2], ids[-1]]  # 4 tokens to the longest (1,200+)
    assert len(work[0]) == 4 and len(work[-1]) >= 1200
    stack = PDStack(tmp_path, ENGINE, ROUTER_ARGS, prefill_args=("--tp-size", str(prefill_tp)),
                    decode_args=("--tp-size", str(decode_tp)), pairs=1)
    try:
        assert (tp_size(stack.prefills[0]), tp_size(stack.decodes[0])) == (prefill_tp, decode_tp)
        # Twice: the second time the decode holds each prompt but its last page in its own prefix
        # cache, and only that page moves (head-major into its place when the splits differ).
        hits = {}
        for attempt in ("first", "again"):
            results: list = [None] * len(work)

            def one(i):
                body = {"model": "smollm2", "input_ids": work[i],
                        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
                results[i] = stack.one_by_one.post("/generate", body, timeout=300)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(work))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(320)
            for prompt, (status, body) in zip(work, results):
                assert status == 200, body
                reply = json.loads(body)
                got = (reply[0] if isinstance(reply, list) else reply)["output_ids"]
                want, gaps = hf_reference.greedy(prompt, NEW_TOKENS)
                assert_matches_reference(got, want, gaps, f"tp {prefill_tp} -> {decode_tp}, {len(prompt)} tokens, {attempt}")
            assert_all_freed(stack.servers)
            hits[attempt] = metric_value(stack.decodes[0].metrics_text(), "tandem_decode_prefix_hit_tokens_total")
        assert hits["again"] - hits["first"] == sum((len(prompt) - 1) // 16 * 16 for prompt in work)
    finally:
        stack.close()
