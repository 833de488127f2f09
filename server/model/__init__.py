"""Loading a model: weights, the torch module and its tokenizer, bundled for the engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.server.model.config import ModelConfig
from tandem.server.model.llama import LlamaForCausalLM
from tandem.server.model.loader import ModelLoadError, ModelSource, load_weights, resolve_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    source: ModelSource
    config: ModelConfig
    module: LlamaForCausalLM
    tokenizer: object  # a transformers tokenizer
    dtype: torch.dtype
    device: torch.device

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


def load_model(model: str, dtype: str, device: str) -> LoadedModel:
    from tandem.server.tokenizer import load_tokenizer

    if dtype not in DTYPES:
        raise ValueError(f"--dtype={dtype!r} is invalid: choose one of {', '.join(DTYPES)}")
    source = resolve_model(model)
    config, weights = load_weights(source)
    dev = resolve_device(device)
    module = LlamaForCausalLM(config, weights, DTYPES[dtype], dev)
    return LoadedModel(source, config, module, load_tokenizer(source), DTYPES[dtype], dev)


__all__ = ["LoadedModel", "ModelConfig", "ModelLoadError", "load_model", "resolve_device", "DTYPES"]
