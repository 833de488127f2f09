"""Loading a model: its weights, the torch module over them, the tokenizer.

    load.py            load_model: a model from the EngineConfig, as a LoadedModel for the engine
    precision.py       Precision: the dtypes of weights, math, prompt products and KV cache that
                       --dtype, --prefill-dtype, --kv-cache-dtype and --gguf-blocks choose on this
                       device, decided once, with the reasons the startup log gives
    loader.py          finding a model and reading its weights: GGUF via `gguf` (dequantized, and its
                       Q8_0/Q4 blocks), HF safetensors
    config.py          ModelConfig: the architecture, as found in the model's files
    hf_config.py       a HF config.json as a ModelConfig, per family (Gemma 3's through transformers'
                       own config class)
    random_weights.py  `random:<shape>`: a known model's shapes, random weights on the device
    llama.py           LlamaForCausalLM: the decoder every family runs; Qwen3's q/k norms, sliding-window
                       layers, Gemma 3's norms, GeLU and scaled embeddings are ModelConfig fields
    mla.py             multi-head latent attention (DeepSeek-V3) over a latent KV cache, the
                       up-projections absorbed
    moe.py             routed experts (Qwen3-MoE, Mixtral, DeepSeek-V3): one grouped GEMM per projection
    shard.py           Shard: which slice of each weight a tensor-parallel rank holds, experts included;
                       MLA's latent on every rank
    tokenizer.py       tokenizers from GGUF or HF dirs, incremental detokenization
"""
