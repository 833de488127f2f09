"""Loading a model: its weights, the torch module over them, the tokenizer.

    load.py            load_model: a model from the EngineConfig, as a LoadedModel for the engine
    precision.py       Precision: the dtypes of weights, math, prompt products and KV cache, and why
    loader.py          finding a model and reading its weights (GGUF, HF safetensors) and GGUF blocks
    config.py          ModelConfig: the architecture, as found in the model's files
    hf_config.py       a HF config.json as a ModelConfig, per family
    random_weights.py  `random:<shape>`: a known model's shapes, random weights on the device
    llama.py           LlamaForCausalLM: the decoder every family runs
    mla.py             multi-head latent attention (DeepSeek-V3)
    moe.py             routed experts (Qwen3-MoE, Mixtral, DeepSeek-V3)
    shard.py           Shard: which slice of each weight a tensor-parallel rank holds
    tokenizer.py       tokenizers from GGUF or HF dirs, incremental detokenization
"""
