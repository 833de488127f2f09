"""Each new family served as a user deploys it: a prefill with `--tp-size 2` and a decode, KV over
Mooncake, smg's OpenAI endpoint in front, the family's chat template from its tokenizer config.
The chat reply is HF transformers' greedy continuation of the templated prompt; GetModelInfo,
GetServerInfo and the startup log name the architecture (and a mixture of experts' experts and
top k); every page is freed on both sides."""

from __future__ import annotations

import json

import grpc
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc

from support.checks import HFReference
from support.serving import PDStack, assert_all_freed
from support.tiny_models import write_gemma3, write_mixtral, write_qwen3, write_qwen3_moe, write_tokenizer

NEW_TOKENS = 10
VOCAB = 49152  # the tokenizer's: the templated prompt uses any of its ids
MESSAGES = [{"role": "user", "content": "Which rivers flow into the Black Sea?"}]

# family -> (writer, chat template, HF class, what the startup log says of the architecture)
FAMILIES = {
    "qwen3": (write_qwen3, "qwen3", "Qwen3ForCausalLM", "qwen3 (Qwen3ForCausalLM): 3 layers, hidden 96"),
    "qwen3_moe": (write_qwen3_moe, "qwen3", "Qwen3MoeForCausalLM", "8 experts, top 2, on 2 of 3 layers"),
    "mixtral": (write_mixtral, "mixtral", "MixtralForCausalLM", "4 experts, top 2, on 2 of 2 layers"),
    "gemma3_text": (write_gemma3, "gemma3", "Gemma3ForCausalLM", "sliding window 7 on 3 of 5 layers"),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """The model directory as a checkpoint ships it, HF's greedy reply to MESSAGES, and a PD stack
    serving it."""
    from transformers import AutoTokenizer

    writer, template, _, _ = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = writer(path, vocab_size=VOCAB)
    write_tokenizer(path, template)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    want, gaps = HFReference(hf).greedy(list(prompt), NEW_TOKENS)
    reply = tokenizer.decode(want, skip_special_tokens=True)
    assert reply.strip()
    stack = PDStack(tmp_path_factory.mktemp("logs"), ("--model", str(path), "--max-total-tokens", "4096"),
                    prefill_args=("--tp-size", "2"), pairs=1)
    yield request.param, stack, list(prompt), reply, min(gaps)
    stack.close()


def test_the_chat_reply_is_hfs_through_prefill_and_decode(family):
    architecture, stack, prompt, reply, smallest_gap = family
    assert smallest_gap > 1e-3, "a near tie in HF's reply: pick another question"
    status, body = stack.one_by_one.post("/v1/chat/completions", {
        "model": "smollm2", "messages": MESSAGES, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    answer = json.loads(body)
    assert answer["usage"]["prompt_tokens"] == len(prompt), "the router did not apply the family's chat template"
    assert answer["usage"]["completion_tokens"] == NEW_TOKENS
    assert answer["choices"][0]["message"]["content"] == reply
    assert_all_freed(stack.servers)


def test_the_servers_name_the_architecture(family):
    architecture, stack, *_ = family
    _, _, hf_class, described = FAMILIES[architecture]
    for server in stack.servers:
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.SglangSchedulerStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest())
            args = stub.GetServerInfo(pb.GetServerInfoRequest()).server_args
        assert (info.model_type, list(info.architectures)) == (architecture, [hf_class])
        experts = "experts" in described
        assert (args["num_experts"] > 0, args["num_experts_per_tok"] == 2) == (experts, experts)
        assert described in server.log_path.read_text()
