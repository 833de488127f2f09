"""Loading a model: its weights in the precision the flags choose (`precision.py`), the torch
module over them and its tokenizer, bundled for the engine (`LoadedModel`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from tandem.common.cpu import ISA_CAP_VARIABLE, cpu_flags, isa_cap
from tandem.kernels.isa import cpu_features
from tandem.server.config import EngineConfig
from tandem.server.model.config import ModelConfig
from tandem.server.model.llama import LlamaForCausalLM
from tandem.server.model.loader import ModelSource, load_block_weights, load_weights, resolve_model
from tandem.server.model.precision import Precision, check
from tandem.server.model.random_weights import SHAPES, random_weights
from tandem.server.model.shard import Shard

log = logging.getLogger("tandem.model")


@dataclass
class LoadedModel:
    source: ModelSource
    config: ModelConfig
    module: LlamaForCausalLM
    tokenizer: object  # a transformers tokenizer (None on tensor-parallel ranks other than 0)
    precision: Precision  # the dtypes of its weights, math, prompt products and KV cache
    device: torch.device
    shard: Shard = Shard()  # which tensor-parallel rank's share `module` holds (config: the whole model's)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids = set(self.config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_model(config: EngineConfig, shard: Shard = Shard(),
               all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> LoadedModel:
    """`config.model` on `config.device`, in the precision --dtype, --prefill-dtype, --kv-cache-dtype
    and --gguf-blocks choose there (`Precision.resolve`). `shard`, `all_reduce`: load one
    tensor-parallel rank's share (`tandem.server.model.shard`)."""
    check(config)
    from tandem.server.model.tokenizer import load_tokenizer

    source = resolve_model(config.model)
    dev = resolve_device(config.device)
    # Random weights are drawn below, on the device in the dtype it computes in.
    model_config, weights = (SHAPES[source.name], None) if source.kind == "random" else load_weights(source)
    shard.check(model_config)
    blocks = load_block_weights(source, model_config) if dev.type == "cpu" else {}
    precision = Precision.resolve(config, dev, blocks)
    if weights is None:
        weights = random_weights(model_config, precision.compute, dev)
    module = LlamaForCausalLM(model_config, weights, precision, dev, blocks=blocks, shard=shard, all_reduce=all_reduce)
    del weights  # the module holds its own (fused) copies
    if dev.type == "cuda":  # give the unfused copies back, so that the KV pool can size itself from what is free
        torch.cuda.empty_cache()
    if shard.rank:
        return LoadedModel(source, model_config, module, None, precision, dev, shard)
    log.info("%s: %s", source.name, model_config.describe())
    first = module.layers[0]
    layer_linear = getattr(first, "qkv", None) or getattr(first, "gate_up", None)
    forms = (f"layers' projections: {layer_linear.describe()}; " if layer_linear is not None else "") + \
        f"LM head: {module.lm_head.describe()}"
    log.info("%s on %s: %s; %s; CPU flags: %s%s%s", source.name, dev, precision.describe(), forms,
             " ".join(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma"))) or "-",
             f" ({cpu_features().describe()})" if dev.type == "cpu" else "",
             f", capped at {cap} by {ISA_CAP_VARIABLE}" if (cap := isa_cap()) else "")
    return LoadedModel(source, model_config, module, load_tokenizer(source), precision, dev, shard)
