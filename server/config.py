"""Server configuration: frozen dataclasses, the single source of defaults.

The CLI flags are generated from these fields (`tandem.common.options`); each field's `help`
metadata is its documentation. Values discovered at run time (number of KV pages, EOS ids,
context length of the loaded model) are returned by the components that find them and never
written back here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from tandem.common.options import opt

BUILTIN_MODEL = "builtin:smollm2-135m"


@dataclass(frozen=True)
class EngineConfig:
    model: str = opt(BUILTIN_MODEL, "model: builtin:smollm2-135m, a .gguf file, a HF safetensors directory, or hf:<org>/<name> from the local HF cache")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = opt(
        "auto", "weight and activation dtype; auto: bfloat16 on CUDA; on a CPU float32 where tandem's block "
        "kernels run on a GGUF file's 4-bit blocks (or its int8 blocks without AMX), else bfloat16 with AVX512-BF16 "
        "or AMX, else float32")
    prefill_dtype: Literal["auto", "float32", "bfloat16"] = opt(
        "auto", "for float32 weights on a CPU: the dtype of projections over many rows (prefill chunks, decode "
        "steps of 5+ requests) and of prompt pieces' attention; auto: bfloat16 where --dtype is auto and the CPU multiplies it natively, else float32 (exact)")
    gguf_blocks: Literal["4bit", "int8"] = opt(
        "4bit", "for float32 weights on a CPU: the form a GGUF file's Q4_0/Q4_1 blocks decode from; 4bit keeps them "
        "as the file does (0.625 bytes a weight), int8 widens them (1.25); both rebuild the file's values exactly")
    kv_cache_dtype: Literal["auto", "float32", "bfloat16"] = opt(
        "auto", "dtype the KV cache keeps; auto: the compute dtype, except bfloat16 for float32 weights on a CPU whose "
        "prompt products run in bfloat16 (--prefill-dtype): half the bytes decode attention reads")
    device: str = opt("auto", "cpu, cuda, cuda:N, or auto (cuda when available)")
    attention_backend: Literal["auto", "torch", "flashinfer"] = opt(
        "auto", "attention kernels: flashinfer on CUDA, torch elsewhere"
    )
    page_size: int = opt(16, "tokens per KV page")
    max_total_tokens: int | None = opt(None, "KV pool size in tokens (default: from --kv-memory-fraction)")
    kv_memory_fraction: float = opt(
        0.25, "fraction of free device memory given to the KV pool when --max-total-tokens is unset"
    )
    max_running_requests: int = opt(64, "requests that may hold a slot (prefilling or decoding) at once")
    max_queued_requests: int = opt(1024, "requests that may wait beyond the running ones; more are refused")
    max_prefill_tokens: int | None = opt(
        None, "prompt tokens admitted into one forward pass (the first prompt may exceed it); unset: 8192 on CUDA, "
              "256 on a CPU, whose products are compute-bound from a few hundred rows on: a bigger batch makes no "
              "pass faster, it only makes the first prompt wait for the others")
    chunked_prefill_size: int = opt(2048, "longest prompt piece prefilled in one step; 0 disables chunking")
    enable_mixed_chunk: bool | None = opt(
        None, "run a prefill chunk in the same forward pass as the running decodes; unset: on a CPU (its prompt "
              "passes are compute-bound, so the decodes ride along), off on CUDA (decode steps replay CUDA graphs)")
    schedule_policy: Literal["fcfs", "lpm"] = opt("fcfs", "waiting-queue order: first come, or longest prefix match")
    disable_radix_cache: bool = opt(False, "use a plain chunk cache instead of the radix prefix cache")
    context_length: int | None = opt(None, "override the model's context length")
    default_max_new_tokens: int = opt(
        16384, "output limit for requests that give none (further capped by the context length)"
    )
    init_new_token_ratio: float = opt(0.7, "share of each running request's remaining output reserved at start")
    min_new_token_ratio: float = opt(0.1, "floor the reserve ratio decays to")
    new_token_ratio_decay_steps: int = opt(600, "decode steps to decay the reserve ratio from init to min")
    seed: int = opt(0, "seed for requests that bring none")
    num_threads: int | None = opt(None, "torch CPU threads of each tensor-parallel rank (default: the cores shared evenly)")
    compute_priority: Literal["normal", "idle"] = opt(
        "normal", "CPU: how the threads that run forward passes are scheduled; idle (Linux SCHED_IDLE) computes "
                  "only in the time other processes leave, for a server sharing its cores with another one (a "
                  "decode beside its prefill on one machine: the prefill's forward passes go first, as a "
                  "colocated server's prefills pause its decodes)")
    tp_size: int = opt(1, "tensor-parallel ranks: processes (one GPU each on CUDA) that each hold 1/N of every layer's "
                          "heads and features; must divide the model's query and KV heads")
    disable_overlap_schedule: bool | None = opt(
        None, "run each step's scheduling and output processing between forward passes instead of during "
              "them; unset: overlapped on CUDA, where that host work is a large share of a step, and not on a "
              "CPU, where it is about 1% and a new prompt would wait for one more step (but for a decode, "
              "which polls for arrived KV while a step computes, and with --compute-priority idle, whose "
              "forward passes need a thread of their own)")
    disable_cuda_graph: bool = opt(False, "CUDA: run decode steps eagerly instead of replaying the CUDA graphs "
                                          "captured at startup (one per batch size in --cuda-graph-bs)")
    cuda_graph_bs: tuple[int, ...] = opt((), "CUDA: a decode batch size to capture a graph for (default: 1, 2, 4 "
                                              "and every multiple of 8 up to --max-running-requests, and it)")
    tp_timeout: float = opt(120.0, "seconds tensor-parallel ranks wait for each other in a collective before the "
                                   "server fails (and exits) rather than hang")
    grammar_compile_timeout: float = opt(
        30.0, "seconds a request's constraint (JSON schema, regex, grammar) may take to compile before the request "
              "is refused")
    kv_events_replay: int = opt(4096, "KV event batches kept for subscribers that reconnect with the sequence "
                                      "number they last applied (SubscribeKvEvents)")
    kv_events_queue: int = opt(1024, "KV event batches a subscriber may fall behind before it is dropped (told "
                                     "to resubscribe) so that a slow one never holds up the engine")

    def validate(self) -> None:
        """Raise ValueError naming the flag for values that can never work."""
        checks = [
            ("page_size", self.page_size >= 1, ">= 1"),
            ("max_running_requests", self.max_running_requests >= 1, ">= 1"),
            ("max_queued_requests", self.max_queued_requests >= 0, ">= 0"),
            ("max_prefill_tokens", self.max_prefill_tokens is None or self.max_prefill_tokens >= 1, ">= 1"),
            ("chunked_prefill_size", self.chunked_prefill_size == 0 or self.chunked_prefill_size >= self.page_size,
             f"0 (disabled) or >= page_size ({self.page_size})"),
            ("kv_memory_fraction", 0.0 < self.kv_memory_fraction < 1.0, "in (0, 1)"),
            ("max_total_tokens", self.max_total_tokens is None or self.max_total_tokens >= self.page_size,
             f">= page_size ({self.page_size})"),
            ("context_length", self.context_length is None or self.context_length >= 2, ">= 2"),
            ("tp_size", self.tp_size >= 1, ">= 1"),
            ("tp_timeout", self.tp_timeout > 0, "> 0"),
            ("cuda_graph_bs", all(1 <= n <= self.max_running_requests for n in self.cuda_graph_bs),
             f"batch sizes in [1, --max-running-requests ({self.max_running_requests})]"),
            ("compute_priority", self.compute_priority == "normal" or self.tp_size == 1,
             f"normal with --tp-size {self.tp_size} (idle is for one process)"),
            ("grammar_compile_timeout", self.grammar_compile_timeout > 0, "> 0"),
            ("kv_events_replay", self.kv_events_replay >= 1, ">= 1"),
            ("kv_events_queue", self.kv_events_queue >= 1, ">= 1"),
            ("min_new_token_ratio", 0.0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1.0,
             "0 <= min_new_token_ratio <= init_new_token_ratio <= 1"),
        ]
        for name, ok, limit in checks:
            if not ok:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag}={getattr(self, name)!r} is invalid: must be {limit}")


@dataclass(frozen=True)
class DisaggConfig:
    """The server's role and, for prefill and decode, how KV moves between them."""

    role: Literal["colocated", "prefill", "decode"] = opt(
        "colocated", "colocated (no KV connector), prefill (runs prompts, sends KV) or decode (receives KV, generates)"
    )
    bootstrap_port: int = opt(8998, "prefill: port of the bootstrap service decode servers meet it on")
    advertise_host: str | None = opt(
        None, "address peers reach this server's bootstrap service and Mooncake engine at (default: --host, "
        "or this machine's address when --host is 0.0.0.0)"
    )
    kv_transfer_protocol: Literal["tcp", "rdma"] = opt("tcp", "Mooncake transport: tcp, or rdma with --ib-device")
    ib_device: str = opt("", "RDMA devices for Mooncake, comma-separated (e.g. mlx5_0,mlx5_1)")
    bootstrap_timeout: float = opt(
        30.0, "seconds a leg waits for its peer leg: prefill for the decode to register its pages, decode for "
        "the prefill request to arrive (and for free KV pages to reserve)"
    )
    transfer_timeout: float = opt(
        300.0, "seconds a decode request waits for its KV once both legs are paired (prefill queueing, "
        "forward pass and transfer)"
    )
    peer_timeout: float = opt(3.0, "seconds a peer's bootstrap service may stay unreachable before its requests fail")
    disable_decode_prefix_reuse: bool = opt(
        False, "decode: take every prompt page from the prefill, even the leading ones this server's prefix "
        "cache holds already (by default only the rest moves)"
    )
    peer_heartbeat_interval: float = opt(
        5.0, "decode: seconds between liveness checks of each prefill it is registered with (offline after two "
        "missed in a row); prefill: how long a leaving server waits for its decode peers to hear it"
    )
    bootstrap_token_file: str | None = opt(
        None, "file of bootstrap tokens, one per line (e.g. a mounted Secret): a prefill accepts a bootstrap "
        "call only with one of them, a decode presents the first; without it the bootstrap service accepts "
        "any caller"
    )

    def validate(self) -> None:
        checks = [
            ("bootstrap_port", 0 < self.bootstrap_port < 65536, "in 1-65535"),
            ("bootstrap_timeout", self.bootstrap_timeout > 0, "> 0"),
            ("transfer_timeout", self.transfer_timeout > 0, "> 0"),
            ("peer_timeout", self.peer_timeout > 0, "> 0"),
            ("peer_heartbeat_interval", self.peer_heartbeat_interval > 0, "> 0"),
            ("ib_device", self.kv_transfer_protocol == "rdma" or not self.ib_device, "empty unless --kv-transfer-protocol rdma"),
        ]
        for name, ok, limit in checks:
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)!r} is invalid: must be {limit}")
        self.bootstrap_tokens()

    def bootstrap_tokens(self) -> list[str]:
        """The tokens in --bootstrap-token-file, first the one a decode presents ([] without the flag).
        Several lines let a token be rotated without a refused call: prefills accept old and new
        while decodes move to the new one."""
        if self.bootstrap_token_file is None:
            return []
        try:
            with open(self.bootstrap_token_file) as f:
                tokens = [line.strip() for line in f if line.strip()]
        except OSError as e:
            raise ValueError(f"--bootstrap-token-file={self.bootstrap_token_file!r} cannot be read: {e.strerror}") from None
        if not tokens:
            raise ValueError(f"--bootstrap-token-file={self.bootstrap_token_file!r} holds no token: must have one per line")
        return tokens


@dataclass(frozen=True)
class ServeConfig:
    """The serving process around the engine: where it listens, what it is called, how it drains."""

    host: str = opt("127.0.0.1", "address to listen on")
    port: int = opt(30000, "gRPC port (SGLang scheduler protocol and grpc.health.v1)")
    metrics_port: int = opt(30001, "Prometheus /metrics port")
    served_model_name: str | None = opt(None, "model id clients use (default: the model's name)")
    drain_grace_seconds: float = opt(30.0, "on SIGTERM, how long in-flight requests may take to finish")
    disable_kv_events: bool = opt(False, "answer SubscribeKvEvents with UNIMPLEMENTED: routers then guess where "
                                         "prefixes are cached instead of being told")
    tls_cert: str | None = opt(None, "PEM certificate (chain) of the gRPC port: with --tls-key, gRPC over TLS "
                                     "(renewed files are picked up without a restart)")
    tls_key: str | None = opt(None, "PEM private key of --tls-cert")
    tls_ca: str | None = opt(None, "PEM CA bundle: clients must present a certificate it signed (mutual TLS)")
    allocator: Literal["auto", "tcmalloc", "system"] = opt(
        "auto", "malloc of the server process: tcmalloc (preloaded: `tandem serve` re-executes itself once) or "
                "the system's; auto: tcmalloc on a CPU server where libtcmalloc-minimal4 is installed"
    )

    def validate(self) -> None:
        if not 0 < self.port < 65536 or not 0 < self.metrics_port < 65536 or self.port == self.metrics_port:
            raise ValueError(f"--port={self.port} / --metrics-port={self.metrics_port}: need two distinct ports in 1-65535")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")
        if self.tls_ca is not None and self.tls_cert is None:
            raise ValueError(f"--tls-ca={self.tls_ca!r} needs --tls-cert and --tls-key: mutual TLS is TLS first")
        for flag, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key), ("--tls-ca", self.tls_ca)):
            if path is not None and not os.access(path, os.R_OK):
                raise ValueError(f"{flag}={path!r} cannot be read")
