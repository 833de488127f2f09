"""The new families on CUDA: Gemma 3's sliding-window layers and DeepSeek-V3's latent cache (the
torch attention backend, which `auto` picks for them there) and a mixture of experts, whose experts run as grouped GEMMs in
bfloat16 and one pair of matmuls per expert in float32. Float32 logits equal HF's; the bfloat16
MoE layer is close to the float32 one."""

from __future__ import annotations

import pytest
import torch

from support.tiny_models import forward_logits, write_deepseek_v3, write_gemma3, write_qwen3_moe
from tandem.server.model.llama import LlamaForCausalLM
from tandem.server.model.loader import load_weights, resolve_model
from tandem.server.model.moe import SparseMoE
from tandem.server.model.precision import Precision

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("writer", [write_gemma3, write_qwen3_moe, write_deepseek_v3],
                         ids=["gemma3", "qwen3_moe", "deepseek_v3"])
def test_float32_logits_on_cuda_equal_hfs(tmp_path, writer):
    hf = writer(tmp_path)
    config, weights = load_weights(resolve_model(str(tmp_path)))
    ours = LlamaForCausalLM(config, weights, Precision.uniform(torch.float32), "cuda")
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = hf(ids[None]).logits[0].float()
    # forward_logits pages the prompt on the module's device through the torch backend
    logits = forward_logits(ours, ids.cuda()).cpu()
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_the_moe_layer_in_bfloat16_on_cuda_runs_grouped_and_stays_close(tmp_path):
    write_qwen3_moe(tmp_path)
    config, weights = load_weights(resolve_model(str(tmp_path)))
    reference = SparseMoE(config, "model.layers.0.", weights)
    x = torch.randn(64, config.hidden_size, generator=torch.Generator().manual_seed(2))
    cuda = {k: v.to("cuda", torch.bfloat16) for k, v in weights.items()}
    moe = SparseMoE(config, "model.layers.0.", cuda)
    assert moe.grouped == (torch.cuda.get_device_capability() >= (8, 0))
    torch.testing.assert_close(moe(x.to("cuda", torch.bfloat16)).float().cpu(), reference(x), atol=3e-2, rtol=3e-2)
