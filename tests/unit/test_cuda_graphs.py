"""What of CUDA graphs for decode runs without a GPU: the batch sizes captured, the bucket a batch
pads to, when graphs are off and why, and the flags' checks. The graphs themselves are tested on a
GPU (tests/engine/test_cuda_graphs_gpu.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tandem.kernels.kv_cache import PagedKVCache
from tandem.server.config import EngineConfig
from tandem.server.loop.cuda_graphs import DecodeGraphs, capture_sizes, graphs_unavailable
from tandem.server.model.config import ModelConfig


def test_default_sizes_cover_one_to_the_running_limit():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]


def test_asked_sizes_are_sorted_and_checked():
    assert capture_sizes(64, (8, 1, 8, 64)) == [1, 8, 64]
    with pytest.raises(ValueError, match=r"--cuda-graph-bs=\(1, 65\) .*\[1, --max-running-requests \(64\)\]"):
        EngineConfig(cuda_graph_bs=(1, 65), max_running_requests=64).validate()
    with pytest.raises(ValueError, match=r"--cuda-graph-bs=\(0,\) is invalid: must be batch sizes in \[1, "):
        EngineConfig(cuda_graph_bs=(0,)).validate()
    EngineConfig(cuda_graph_bs=(1, 64)).validate()


def test_a_batch_pads_to_the_smallest_size_that_holds_it():
    cache = PagedKVCache(1, 9, 16, 1, 8, torch.float32, "cpu")
    graphs = DecodeGraphs(model=None, kv_cache=cache, sizes=[8, 1, 4], scratch_page=8)
    assert graphs.sizes == [1, 4, 8]
    assert [graphs.bucket(n) for n in (1, 2, 4, 5, 8)] == [1, 4, 4, 8, 8]
    assert graphs.fits(8, 0) and not graphs.fits(9, 0) and not graphs.fits(3, 1) and not graphs.fits(0, 0)
    assert graphs.scratch_slot == 8 * 16
    with pytest.raises(ValueError, match="scratch page 9 is not a page of the KV cache"):
        DecodeGraphs(model=None, kv_cache=cache, sizes=[1], scratch_page=9)


def test_padding_rows_decode_on_the_scratch_page():
    cache = PagedKVCache(1, 9, 16, 1, 8, torch.float32, "cpu")
    graphs = DecodeGraphs(model=None, kv_cache=cache, sizes=[4], scratch_page=8)
    graphs._write([5, 6], [40, 7], [100, 33])
    assert graphs.inputs.tolist() == [[5, 6, 0, 0], [40, 7, 0, 0], [100, 33, 128, 128]]

    class Attn:
        batch_size, out_slots = 4, graphs.inputs[2, :4]

    batch = graphs._batch(Attn, [41, 8], [[6, 1, 3], [2]])
    assert batch.q_lens == [1] * 4 and batch.num_extends == 0
    assert batch.kv_lens == [41, 8, 1, 1] and batch.page_tables == [[6, 1, 3], [2], [8], [8]]
    assert batch.out_slots is Attn.out_slots  # the graph reads its slots where _write put them


def test_graphs_are_off_where_they_cannot_run():
    cuda, flashinfer = torch.device("cuda"), object.__new__(__import__(
        "tandem.kernels.flashinfer_attention", fromlist=["FlashInferAttention"]).FlashInferAttention)
    config = EngineConfig()
    assert graphs_unavailable(config, cuda, "colocated", flashinfer) is None
    assert graphs_unavailable(config, cuda, "decode", flashinfer) is None
    assert "on cpu" in graphs_unavailable(config, torch.device("cpu"), "colocated", flashinfer)
    assert graphs_unavailable(EngineConfig(disable_cuda_graph=True), cuda, "colocated", flashinfer) == "--disable-cuda-graph"
    assert "no decode steps" in graphs_unavailable(config, cuda, "prefill", flashinfer)
    assert "--tp-size 2" in graphs_unavailable(EngineConfig(tp_size=2), cuda, "colocated", flashinfer)
    assert "torch attention backend" in graphs_unavailable(config, cuda, "colocated", object())
    moe = ModelConfig("qwen3_moe", 8, 8, 16, 2, 2, 1, 4, 1e-6, 1e4, 64, False, False, num_experts=4,
                      experts_per_token=2, sparse_layers=(0, 1))
    assert "mixture-of-experts" in graphs_unavailable(config, cuda, "decode", flashinfer, moe)
    assert graphs_unavailable(config, cuda, "decode", flashinfer, replace(moe, sparse_layers=())) is None
    windows = replace(moe, sparse_layers=(), sliding_window=4, sliding_layers=(0,))
    assert "sliding-window" in graphs_unavailable(config, cuda, "decode", flashinfer, windows)
