"""The math under the model: attention over the paged KV cache, projections, a layer's small
steps, sampling. Native CPU kernels (C++, csrc/) and Triton and FlashInfer on CUDA, each beside the
torch code it replaces, which stays the reference and the fallback.

Attention and the KV cache:
    attention.py             AttentionBackend, the interface every backend implements; AttentionBatch,
                             the ragged batch it receives; per-layer sliding windows (a window narrows
                             what a layer reads; every layer's KV is kept)
    attention_backends.py    create_backend: which backend runs a model (auto, torch, flashinfer)
    kv_cache.py              PagedKVCache: per layer K and V pages in FlashInfer's NHD layout, or one
                             latent row per token and layer (MLA: V is each row's first kv_lora_rank
                             values); all views of one buffer (one region to register for transfers),
                             on huge pages on a CPU. Its dtype is the compute dtype's, or
                             --kv-cache-dtype's (auto: bfloat16 beside a float32 model's bfloat16
                             prompt products, on a CPU that multiplies bfloat16 natively)
    torch_attention.py       CPU (or any device): SDPA over gathered pages, prompt pieces in the
                             model's prefill dtype. Decode rows of a float32 or bfloat16 cache read the
                             pages in place (csrc/paged_decode_attention.cpp, AVX2 or AVX-512), or a
                             fused layer does (decode_in_place); with AVX512-BF16, bfloat16 prompt
                             pieces read them in place too (csrc/prompt_attention_bf16.cpp)
    flashinfer_attention.py  CUDA: FlashInfer's paged prefill and decode kernels; FlashInferGraphDecode,
                             the decode of one CUDA graph (fixed batch size, static page-table buffers)

Projections:
    linear.py                Linear: a projection's weight in the forms the device multiplies fastest,
                             one for steps of up to 8 rows (BLOCK_MAX_ROWS) and one for more, picked at
                             load from weight_forms.py's registry. On a CPU: oneDNN-packed, and the GGUF
                             file's blocks for up to 8 rows; with --prefill-dtype bfloat16, the blocks
                             in bfloat16 from 5 rows (4-bit stripes from 2) and a bfloat16 copy above 8
    weight_forms.py          one class per weight form (oneDNN-packed, x @ W, F.linear, the bfloat16
                             prefill copy, int8 / 4-bit / 4-bit striped / 8-bit blocks), each with its
                             product, bytes and startup-log words; WEIGHT_FORMS, the ordered registry
                             Linear asks. A new form is one class and one registry line (its docstring,
                             "Adding a weight form")
    block_linear.py          the GGUF file's blocks as the block kernels read them: BlockWeights (int8 +
                             scale + offset, block_gemm), Nibbles (Q4_0/Q4_1, block_gemm_q4), Bytes
                             (Q8_0, block_gemm_q8), NibbleStripes (4-bit blocks, 16 weight rows to a
                             vector: block_gemm_q4_stripes); block_gemm_bf16 over any of them. Float32
                             products are exact; each kernel's csrc/ file says how it runs (AVX2,
                             AVX-512, AVX512-BF16; csrc/block_tiles_avx512.h the shared AVX-512 loop)

A layer's other steps:
    layer_ops.py             the steps between projections (RMSNorm with its residual add, rotary
                             embedding, SiLU product): torch's ops, or one native call each in float32
                             or bfloat16 (csrc/layer_ops.cpp; csrc/vec8.h rounds bfloat16 as torch), or
                             on CUDA in bfloat16/float16 one Triton kernel each. out_dtype hands a
                             float32 model's bfloat16 prompt products the values they would round to
    triton_ops.py            CUDA only, imported on first use: those steps, the KV store, and RoPE with
                             the KV store in one kernel (FlashInfer's `rotate_and_attend`); they round
                             where torch's ops round
    fused_decode.py          a float32 Llama layer with 4-bit projections, at a decode step of at most
                             8 rows read in place, in one native call (csrc/decode_layer.cpp: the same
                             kernels in the same order, bit for bit the op-by-op layer);
                             FusedDecodeStack: all of a model's layers in one call a step (over
                             DecodeStackQ4, a torch class holding their operands)

The CPU, and sampling:
    cpu_ops.py               builds csrc/*.cpp (AVX2 + FMA; AVX512-BF16 functions marked as such) into
                             torch.ops.tandem.* with torch's extension builder, or loads the library an
                             image built for the same sources (TANDEM_KERNELS_DIR); says why they cannot
                             run, and callers keep the torch paths. idle_compute_threads: a server's
                             compute threads under SCHED_IDLE (--compute-priority idle)
    isa.py                   what the CPU executes, not only what /proc/cpuinfo lists: each listed
                             AVX512-BF16 / AMX feature runs one instruction in a forked child
                             (csrc/isa_probe.cpp) before the dtype choice or a kernel trusts it
    sampling.py              penalties, allowed-token bitmasks, temperature, top-k/top-p/min-p, seeded
                             draws, logprobs

    csrc/                    the C++ kernels cpu_ops.py builds; each file's header says what it
                             computes and for which instructions
"""
