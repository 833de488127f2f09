"""CUDA graphs for decode steps: the model's forward pass captured once per batch size, replayed.

A decode step of a model of a few billion parameters launches about ten kernels per layer. Eager,
Python launches each one (tens of microseconds apiece), and for small batches the GPU finishes a
kernel before the next is launched: the step is bound by the host, not by the GPU's memory. A
CUDA graph records the launches of one forward pass at startup; a replay launches all of them with
one call.

A graph replays fixed addresses and shapes, so each batch size gets its own graph (`sizes`, from
`capture_sizes`), all reading static buffers: the token ids, positions and KV slots of the step
(`inputs`), and the page tables of FlashInfer's decode plan (`FlashInferGraphDecode`). Before each
replay, outside the graph, the runner writes the step into those buffers and plans attention:
`run` pads a batch of n sequences to the smallest captured size `bs >= n`; the padding
rows decode token 0 at position 0 over one scratch page of the KV cache that no request is ever
given (the engine allocates it beyond the pool's pages), and their outputs are dropped.

Only pure decode steps replay; a step with prompt pieces, or more sequences than the largest
size, runs eagerly. Logits and sampling stay outside the graph (sampling reads each request's own
parameters, and its output goes to the host anyway).
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from tandem.kernels.attention import AttentionBatch
from tandem.kernels.flashinfer_attention import WORKSPACE_BYTES, FlashInferAttention, FlashInferGraphDecode
from tandem.kernels.kv_cache import PagedKVCache
from tandem.server.config import EngineConfig
from tandem.server.model.config import ModelConfig
from tandem.server.model.llama import LlamaForCausalLM

log = logging.getLogger("tandem.engine")

SMALL_SIZES = (1, 2, 4)  # then every STEP
STEP = 8


def capture_sizes(max_running_requests: int, asked: tuple[int, ...] = ()) -> list[int]:
    """The batch sizes to capture, ascending: `asked` (--cuda-graph-bs), or by default 1, 2, 4,
    then every multiple of 8, up to the running-request limit, which is itself one (a decode step
    never has more sequences than requests hold slots). Padding a batch to the next size costs at
    most 7 rows, which at these sizes read no more weight bytes (the step's main cost).
    `EngineConfig.validate` has checked `asked` against the limit."""
    if asked:
        return sorted(set(asked))
    sizes = {n for n in SMALL_SIZES if n < max_running_requests} | set(range(STEP, max_running_requests, STEP))
    return sorted(sizes | {max_running_requests})


def graphs_unavailable(config: EngineConfig, device: torch.device, role: str, attention,
                       model: ModelConfig | None = None) -> str | None:
    """Why decode steps cannot replay CUDA graphs here, or None when they can. `attention`: the
    runner's eager backend (graphs use FlashInfer's decode kernels as it does); `model`: the
    architecture."""
    if device.type != "cuda":
        return f"they are for CUDA devices; this server runs on {device.type}"
    if config.disable_cuda_graph:
        return "--disable-cuda-graph"
    if role == "prefill":
        return "a prefill server runs no decode steps"
    if config.tp_size > 1:
        return f"not with tensor parallelism (--tp-size {config.tp_size}) yet: every rank would replay its own"
    if model is not None and model.sparse_layers:
        return "not for mixture-of-experts models yet: their expert GEMMs have not been captured and checked on a GPU"
    if model is not None and model.latent:
        return "not for latent attention (DeepSeek-V3) yet: it runs on the torch attention backend"
    if model is not None and model.sliding_layers:
        return "not for sliding-window models yet: their attention runs on the torch backend"
    if not isinstance(attention, FlashInferAttention):
        return "the torch attention backend's decode batches change shape every step (use --attention-backend flashinfer)"
    return None


def capture_decode_graphs(config: EngineConfig, model: LlamaForCausalLM, kv_cache: PagedKVCache, role: str,
                          attention, scratch_page: int) -> "DecodeGraphs | None":
    """The engine's graphs: captured and logged where they can run (`graphs_unavailable`), else
    None (logged on CUDA)."""
    off = graphs_unavailable(config, kv_cache.device, role, attention, model.config)
    if off is not None:
        if kv_cache.device.type == "cuda":
            log.info("CUDA graphs off: %s", off)
        return None
    graphs = DecodeGraphs(model, kv_cache, capture_sizes(config.max_running_requests, config.cuda_graph_bs),
                          scratch_page)
    seconds = graphs.capture()
    log.info("CUDA graphs: decode captured for %d batch sizes (%s) in %.1f s", len(graphs.sizes),
             ", ".join(map(str, graphs.sizes)), seconds)
    return graphs


class DecodeGraphs:
    """One captured forward pass per size in `sizes` over `model` and `kv_cache`, whose page
    `scratch_page` no request uses. `capture()` once (on the thread that runs forward passes),
    then `run` for each decode step that `fits`."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: PagedKVCache, sizes: list[int], scratch_page: int):
        if not 0 <= scratch_page < kv_cache.num_pages:
            raise ValueError(f"scratch page {scratch_page} is not a page of the KV cache ({kv_cache.num_pages} pages)")
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = sorted(sizes)
        self.max_size = self.sizes[-1]
        self.scratch_page = scratch_page
        self.scratch_slot = scratch_page * kv_cache.page_size
        device = kv_cache.device
        # The step's token ids, positions and KV slots (rows 0, 1, 2); a graph of size bs reads [:, :bs].
        self.inputs = torch.zeros(3, self.max_size, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, FlashInferGraphDecode, torch.Tensor]] = {}
        self.replays = 0

    def fits(self, num_seqs: int, num_extends: int) -> bool:
        return num_extends == 0 and 1 <= num_seqs <= self.max_size

    def bucket(self, num_seqs: int) -> int:
        """The smallest captured size that holds `num_seqs` sequences."""
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def _write(self, input_ids: list[int], positions: list[int], slots: list[int]) -> None:
        """The step's inputs into the static buffer, padded: one host-to-device copy."""
        pad = self.max_size - len(input_ids)
        host = torch.tensor([input_ids + [0] * pad, positions + [0] * pad, slots + [self.scratch_slot] * pad],
                            dtype=torch.long)
        self.inputs.copy_(host)

    def _batch(self, attn: FlashInferGraphDecode, kv_lens: list[int], page_tables: list[list[int]]) -> AttentionBatch:
        pad = attn.batch_size - len(kv_lens)
        return AttentionBatch(q_lens=[1] * attn.batch_size, kv_lens=kv_lens + [1] * pad,
                              page_tables=page_tables + [[self.scratch_page]] * pad, num_extends=0,
                              out_slots=attn.out_slots)

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size, largest first (the smaller ones reuse its memory pool); seconds taken."""
        start = time.perf_counter()
        c, device = self.model.config, self.kv_cache.device
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # Every page a batch's tables can hold: the pool's, and the scratch page once per padding row.
        page_ids = torch.zeros(self.kv_cache.num_pages + self.max_size, dtype=torch.int32, device=device)
        stream = torch.cuda.Stream(device)
        pool = None
        for bs in reversed(self.sizes):
            attn = FlashInferGraphDecode(self.kv_cache, c.num_heads, c.head_dim, c.softmax_scale, bs, workspace,
                                         page_ids, self.inputs[2, :bs])
            self._write([], [], [])
            attn.prepare(self._batch(attn, [], []))
            ids, positions = self.inputs[0, :bs], self.inputs[1, :bs]
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):  # warm up (lazy initialization, kernel loading) off the capture
                for _ in range(2):
                    self.model(ids, positions, attn)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = self.model(ids, positions, attn)
            pool = graph.pool()
            self.graphs[bs] = graph, attn, out
        torch.cuda.synchronize(device)
        return time.perf_counter() - start

    @torch.inference_mode()  # plan() writes into buffers made under inference mode
    def load(self, input_ids: list[int], positions: list[int], slots: list[int], kv_lens: list[int],
             page_tables: list[list[int]]) -> int:
        """The host's part of a decode step of len(input_ids) sequences: its inputs written into
        the static buffer and its attention planned for the graph that holds it; that graph's size."""
        bs = self.bucket(len(input_ids))
        self._write(input_ids, positions, slots)
        self.graphs[bs][1].prepare(self._batch(self.graphs[bs][1], kv_lens, page_tables))
        return bs

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], kv_lens: list[int],
            page_tables: list[list[int]]) -> torch.Tensor:
        """One decode step of len(input_ids) sequences -> their final hidden states [n, hidden]
        (a view into the graph's output, valid until the next replay)."""
        graph, _, out = self.graphs[self.load(input_ids, positions, slots, kv_lens, page_tables)]
        graph.replay()
        self.replays += 1
        return out[: len(input_ids)]
