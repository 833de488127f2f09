"""Decode steps replayed from CUDA graphs (`tandem.server.loop.cuda_graphs`) against the same steps run
eagerly, on the GPU, for a Llama-3-8B-shaped model (head dim 128) and a Llama-3.2-1B-shaped one
(head dim 64), two layers each, random weights.

The graphs pad a batch to the next captured size; eager runs it at its size. The two differ in the
order bfloat16 sums are taken in (products of other shapes, another attention plan), so their
hidden states are compared within a tolerance, and their greedy tokens wherever the eager
logits' top two are further apart than that noise (random weights make near-ties common; a real
model's text has few). Each step also proves the padding rows wrote no KV slot but the scratch
page's. Where CUDA is absent, conftest.py skips these tests; where it is present, FlashInfer
must be installed."""

from __future__ import annotations

import random

import pytest
import torch

from support.checks import assert_engine_clean
from support.gpu import random_model
from tandem.kernels.flashinfer_attention import FlashInferAttention
from tandem.kernels.kv_cache import PagedKVCache, flat_slots
from tandem.server.loop.cuda_graphs import DecodeGraphs
from tandem.server.loop.runner import ForwardInputs, forward_pass
from tandem.server.model.llama import LlamaForCausalLM
from tandem.server.model.precision import Precision
from tandem.server.model.random_weights import random_weights, shape_config

pytestmark = pytest.mark.gpu

PAGE = 16
NUM_PAGES = 512
SIZES = [1, 2, 4, 8, 16]
STEPS = 4
DECISIVE_GAP = 0.1  # logits: bfloat16 noise between the two forms stays far below this


@pytest.mark.parametrize("shape", ["llama3-8b", "llama3.2-1b"])
def test_graph_decode_matches_eager(shape):
    device = torch.device("cuda")
    c = shape_config(shape, num_layers=2, vocab_size=8192)
    model = LlamaForCausalLM(c, random_weights(c, torch.bfloat16, device), Precision.uniform(torch.bfloat16), device)
    cache = PagedKVCache(c.num_layers, NUM_PAGES + 1, PAGE, c.num_kv_heads, c.head_dim, torch.bfloat16, device)
    cache.buffer.normal_()  # the cached prefixes: random K and V
    eager = FlashInferAttention(cache, c.num_heads, c.head_dim, c.head_dim**-0.5)
    graphs = DecodeGraphs(model, cache, SIZES, scratch_page=NUM_PAGES)
    graphs.capture()
    rng = random.Random(0)
    compared = 0
    for n in (1, 3, 8, 13):  # 3 and 13 are padded (to 4 and 16)
        cached = [rng.randrange(1, 300) for _ in range(n)]
        pages = iter(rng.sample(range(NUM_PAGES), NUM_PAGES))
        tables = [[next(pages) for _ in range(-(-(k + STEPS) // PAGE))] for k in cached]
        tokens = [rng.randrange(c.vocab_size) for _ in range(n)]
        for _ in range(STEPS):
            slots = [flat_slots(t, k, k + 1, PAGE)[0] for t, k in zip(tables, cached)]
            inputs = ForwardInputs(tokens, list(cached), slots, [1] * n, [k + 1 for k in cached],
                                   [t[: -(-(k + 1) // PAGE)] for t, k in zip(tables, cached)], 0)
            before = cache.buffer.clone()
            with torch.inference_mode():
                graph_hidden = graphs.run(inputs.input_ids, inputs.positions, inputs.slots, inputs.kv_lens,
                                          inputs.page_tables).clone()
                written = (cache.buffer != before).flatten(4).any(-1).any(1).any(0).flatten()  # per flat slot
                allowed = torch.zeros_like(written)
                allowed[slots] = True
                allowed[NUM_PAGES * PAGE :] = True
                assert not (written & ~allowed).any(), f"{n} rows: a graph replay wrote KV outside its slots"
                eager_hidden = forward_pass(model, eager, inputs, device)
                torch.testing.assert_close(graph_hidden.float(), eager_hidden.float(), atol=6e-2, rtol=6e-2)
                assert (graph_hidden.float() - eager_hidden.float()).abs().mean() < 1e-2
                graph_logits, eager_logits = model.logits(graph_hidden), model.logits(eager_hidden)
            top2 = eager_logits.topk(2).values
            decisive = (top2[:, 0] - top2[:, 1]) > DECISIVE_GAP
            same = graph_logits.argmax(-1) == eager_logits.argmax(-1)
            assert same[decisive].all(), f"{n} rows: graph and eager greedy tokens differ where the choice is clear"
            compared += int(decisive.sum())
            tokens = eager_logits.argmax(-1).tolist()
            cached = [k + 1 for k in cached]
    assert graphs.replays == 4 * STEPS
    assert compared >= 0.3 * 25 * STEPS, f"only {compared} of {25 * STEPS} greedy choices were clear enough to compare"


def test_engine_decodes_through_graphs():
    """The engine captures graphs for every batch size up to its running-request limit, replays
    them for its decode steps (overlapped, as on CUDA by default), and leaks nothing; with
    --disable-cuda-graph it captures none."""
    from tandem.server.config import EngineConfig
    from tandem.server.loop.engine import Engine
    from tandem.server.model.load import load_model
    from tandem.server.scheduling.sampling_params import SamplingParams

    model = load_model(EngineConfig(model=random_model("llama3.2-1b"), dtype="bfloat16", device="cuda"))
    rng = random.Random(1)
    prompts = [[rng.randrange(1000, 20000) for _ in range(rng.randrange(5, 300))] for _ in range(11)]
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    config = dict(max_running_requests=8, max_total_tokens=16384, chunked_prefill_size=128)
    with Engine(EngineConfig(**config), model=model) as engine:
        assert engine.overlap
        assert engine.runner.graphs.sizes == [1, 2, 4, 8]
        outputs = engine.generate(prompts, params)
        assert [len(o.output_ids) for o in outputs] == [24] * len(prompts)
        assert all(o.finish_reason == "length" for o in outputs)
        assert engine.runner.graphs.replays >= 23  # the longest request's decode steps, at the least
        assert_engine_clean(engine)
    with Engine(EngineConfig(**config, disable_cuda_graph=True), model=model) as engine:
        assert engine.runner.graphs is None
        assert len(engine.generate(prompts[:2], params)[1].output_ids) == 24
        assert_engine_clean(engine)
