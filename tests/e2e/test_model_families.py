"""Each new family served as a user deploys it: a prefill with `--tp-size 2` and a decode, KV over
Mooncake, smg's OpenAI endpoint in front, the family's chat template from its tokenizer config.
The chat reply is HF transformers' greedy continuation of the templated prompt, and so are the
tokens a gRPC client gets sending both legs itself, without the router; GetModelInfo,
GetServerInfo and the startup log name the architecture (and a mixture of experts' experts and
top k) and the KV bytes per token (a rank's share of the heads; DeepSeek-V3's whole latent on
every rank); every page is freed on both sides."""

from __future__ import annotations

import json
from dataclasses import dataclass

import grpc
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc

from support.checks import HFReference, assert_matches_reference
from support.serving import PDStack, assert_all_freed
from support.tiny_models import (write_deepseek_v3, write_gemma3, write_mixtral, write_qwen3, write_qwen3_moe,
                                 write_tokenizer)
from tandem.server.model.config import ModelConfig
from tandem.server.model.loader import load_weights, resolve_model

NEW_TOKENS = 10
VOCAB = 49152  # the tokenizer's: the templated prompt uses any of its ids
MESSAGES = [{"role": "user", "content": "Which rivers flow into the Black Sea?"}]

# family -> (writer, chat template, HF class, what the startup log says of the architecture)
FAMILIES = {
    "qwen3": (write_qwen3, "qwen3", "Qwen3ForCausalLM", "qwen3 (Qwen3ForCausalLM): 3 layers, hidden 96"),
    "qwen3_moe": (write_qwen3_moe, "qwen3", "Qwen3MoeForCausalLM", "8 experts, top 2, on 2 of 3 layers"),
    "mixtral": (write_mixtral, "mixtral", "MixtralForCausalLM", "4 experts, top 2, on 2 of 2 layers"),
    "gemma3_text": (write_gemma3, "gemma3", "Gemma3ForCausalLM", "sliding window 7 on 3 of 5 layers"),
    "deepseek_v3": (write_deepseek_v3, "deepseek_v3", "DeepseekV3ForCausalLM",
                    "8 experts, top 2, on 2 of 3 layers, latent attention: KV of 32 + 16 per token and layer"),
}


@dataclass
class Served:
    """One family's model served by a PD stack, and what HF answers."""

    architecture: str
    stack: PDStack
    config: ModelConfig
    prompt: list[int]  # MESSAGES under the family's chat template
    want: list[int]  # HF's greedy reply
    gaps: list[float]  # its top-2 logit gap at each step
    reply: str  # `want` as text


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> Served:
    """A PD stack serving the family's model directory, as a checkpoint ships it."""
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
    yield Served(request.param, stack, load_weights(resolve_model(str(path)))[0], list(prompt), want, gaps, reply)
    stack.close()


def test_the_chat_reply_is_hfs_through_prefill_and_decode(family):
    assert min(family.gaps) > 1e-3, "a near tie in HF's reply: pick another question"
    status, body = family.stack.one_by_one.post("/v1/chat/completions", {
        "model": "smollm2", "messages": MESSAGES, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    answer = json.loads(body)
    assert answer["usage"]["prompt_tokens"] == len(family.prompt), "the router did not apply the family's chat template"
    assert answer["usage"]["completion_tokens"] == NEW_TOKENS
    assert answer["choices"][0]["message"]["content"] == family.reply
    assert_all_freed(family.stack.servers)


def test_both_legs_over_grpc_without_the_router(family):
    """The gRPC path alone: a client sends the prefill leg and the decode leg itself, with one
    bootstrap room (`tandem client generate --prefill-target`), streaming from the decode."""
    import random
    import threading

    from tandem.server.scheduling.sampling_params import SamplingParams
    from tandem.tools.client import Client, request_message

    prefill, decode, prompt = family.stack.prefills[0], family.stack.decodes[0], family.prompt
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    bootstrap = ("127.0.0.1", prefill.bootstrap_port, random.randrange(1 << 31))
    prefill_client, decode_client = Client(prefill.target), Client(decode.target)
    try:
        first_leg = []
        leg = threading.Thread(target=lambda: first_leg.append(
            prefill_client.stream(request_message(prompt, params, bootstrap=bootstrap), timeout=120)))
        leg.start()
        result = decode_client.stream(request_message(prompt, params, bootstrap=bootstrap), timeout=120)
        leg.join(130)
    finally:
        prefill_client.close()
        decode_client.close()
    assert result.finish_reason == "length"
    assert_matches_reference(result.output_ids, family.want, family.gaps, f"{family.architecture} over gRPC")
    assert first_leg and first_leg[0].finish_reason is not None
    assert_all_freed(family.stack.servers)


def test_the_servers_name_the_architecture(family):
    architecture, config = family.architecture, family.config
    _, _, hf_class, described = FAMILIES[architecture]
    for server in family.stack.servers:
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.SglangSchedulerStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest())
            args = stub.GetServerInfo(pb.GetServerInfoRequest()).server_args
        assert (info.model_type, list(info.architectures)) == (architecture, [hf_class])
        experts = "experts" in described
        assert (args["num_experts"] > 0, args["num_experts_per_tok"] == 2) == (experts, experts)
        assert described in server.log_path.read_text()
        assert args["kv_bytes_per_token"] == kv_bytes_per_token(config, server.role)


def kv_bytes_per_token(config, role: str) -> int:
    """float32 KV per token on rank 0: a latent row per layer on every rank; else K and V of the
    rank's KV heads (the prefill runs --tp-size 2)."""
    if config.latent:
        return config.num_layers * config.kv_dim * 4
    return 2 * config.num_layers * config.num_kv_heads // (2 if role == "prefill" else 1) * config.head_dim * 4
