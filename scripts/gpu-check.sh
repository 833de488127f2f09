#!/usr/bin/env bash
# Every GPU check of tandem in one run, on a lent GPU machine that has CUDA, torch and nvcc but no
# network (the `device` tool's machines: Python 3.12, torch 2.11+cu130). Run from the repository
# root; what it needs beside the repository comes in .gpu/ (not in git; scripts/gpu-bundle.sh makes
# it here, where PyPI and Debian's archive answer):
#
#   .gpu/wheels/*.whl          pure or cp312 wheels the machine lacks (tvm-ffi, smg-grpc-proto, ...)
#   .gpu/flashinfer.tar.xz     flashinfer-python without the kernel sources attention does not use
#   .gpu/mooncake.tar.xz       the Mooncake transfer engine (CUDA 13 build) without its store and tools
#   .gpu/debs/*.deb            Debian's libibverbs, libnuma, libcurl and theirs, used where missing
#   .gpu/tokenizer/            the built-in model's tokenizer (random-weight models use it)
#   .gpu/jit/*.tar.xz.*        FlashInfer kernels compiled by earlier runs (optional; name each run's
#                              $OUT/jit.tar.xz.* apart, e.g. run2-jit.tar.xz.aa): they load as
#                              FlashInfer's own prebuilt modules, so no compile is paid twice
#
# Stages, each bounded so that the whole run ends within GPU_CHECK_SECONDS (default 450): the
# Triton-kernel and CUDA-graph tests, `tandem bench gpu --profile`, the serving tests (colocated
# 8B-shaped server under load; prefill + decode pair), the new families on CUDA, FlashInfer against
# the torch backend (which compiles float16 kernels too). At the end the kernels FlashInfer compiled
# go to $OUT/jit.tar.xz.* for the next run's .gpu/jit/. GPU_CHECK_STAGES (names, e.g. "bench graphs")
# runs only those stages.
set -uo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
GPU=${GPU_BUNDLE:-$REPO/.gpu}
OUT=${OUT:-$GPU/out}
SITE=/tmp/tandem-site
BUDGET=${GPU_CHECK_SECONDS:-450}
START=$(date +%s)
mkdir -p "$OUT" "$SITE"
exec > >(tee "$OUT/gpu-check.log") 2>&1

log() { echo "[$(( $(date +%s) - START ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - START) )); }

# stage NAME SECONDS CMD...: run CMD for at most SECONDS (less if the budget runs short, keeping 25 s
# to save the compiled kernels), its output in $OUT/NAME.log; the end of it here if it failed.
stage() {
    local name=$1 limit=$2
    shift 2
    if [[ " ${GPU_CHECK_STAGES:-$name} " != *" $name "* ]]; then
        log "SKIP $name: not in GPU_CHECK_STAGES"
        return
    fi
    local avail=$(( $(left) - 25 ))
    (( limit > avail )) && limit=$avail
    if (( limit < 20 )); then
        log "SKIP $name: the budget is spent"
        return
    fi
    log "START $name (at most ${limit}s)"
    timeout --signal=INT --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    log "END $name rc=$rc"
    if (( rc != 0 )); then
        tail -n 40 "$OUT/$name.log"
    fi
    grep -E "^(PASSED|FAILED|ERROR)|passed|failed|^\| |^goal|^device|^profile|^ +[0-9.]+ ms " "$OUT/$name.log" | tail -n 60
}

log "machine: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)"

# -- packages -----------------------------------------------------------------------------------
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$GPU"/wheels/*.whl
tar -xJf "$GPU/flashinfer.tar.xz" -C "$SITE"
tar -xJf "$GPU/mooncake.tar.xz" -C "$SITE"
mkdir -p "$SITE/tandem"
for pkg in cli tools server kernels operator common; do ln -sfn "$REPO/$pkg" "$SITE/tandem/$pkg"; done
if ls "$GPU"/jit/*.tar.xz.* > /dev/null 2>&1; then  # one run's parts after another's: tar reads on past each end
    mkdir -p "$SITE/flashinfer/data/aot"
    cat "$GPU"/jit/*.tar.xz.* | tar -xJ --ignore-zeros -C "$SITE/flashinfer/data/aot"
    log "FlashInfer kernels from an earlier run: $(ls "$SITE/flashinfer/data/aot" | tr '\n' ' ')"
fi
# Shared libraries Mooncake links that this machine lacks (only those: the system's own stay first).
mkdir -p /tmp/debroot /tmp/syslibs
for deb in "$GPU"/debs/*.deb; do dpkg -x "$deb" /tmp/debroot; done
for lib in /tmp/debroot/usr/lib/x86_64-linux-gnu/*.so.* /tmp/debroot/lib/x86_64-linux-gnu/*.so.*; do
    [ -e "$lib" ] || continue
    name=$(basename "$lib")
    ldconfig -p | grep -q " $name " || cp -L "$lib" /tmp/syslibs/
done
CUDART=$(dirname "$(find "$(python3 -c 'import site; print(site.getsitepackages()[0])')" /usr/local/cuda*/ \
    -name 'libcudart.so.13*' 2>/dev/null | head -n 1)")
export LD_LIBRARY_PATH=/tmp/syslibs:$CUDART:${LD_LIBRARY_PATH:-}
export PYTHONPATH=$SITE PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer-ws MAX_JOBS=16
export TANDEM_TOKENIZER_DIR=$GPU/tokenizer
log "libraries added: $(ls /tmp/syslibs | tr '\n' ' ')"
python3 - <<'EOF'
import torch, flashinfer
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(), "flashinfer", flashinfer.__version__)
try:
    from mooncake.engine import TransferEngine  # noqa: F401
    print("mooncake: imports")
except Exception as e:
    print("mooncake: does not import:", type(e).__name__, e)
EOF

# -- checks ---------------------------------------------------------------------------------------
PYTEST=(python3 -m pytest -p no:cacheprovider -v -rfE)
mkdir -p /tmp/tandem-pytest  # each stage's --basetemp below it (pytest makes only the last folder)
stage graphs 120 "${PYTEST[@]}" --timeout=85 --basetemp=/tmp/tandem-pytest/graphs tests/engine/test_triton_ops_gpu.py \
    tests/engine/test_cuda_graphs_gpu.py
stage bench 200 python3 -m tandem.cli.main bench gpu --shapes llama3-8b llama3.2-1b --profile --json-out "$OUT/bench.json"
stage serving 240 "${PYTEST[@]}" --timeout=200 --basetemp=/tmp/tandem-pytest/serving tests/e2e/test_cuda_serving_gpu.py -s
stage families 60 "${PYTEST[@]}" --timeout=50 --basetemp=/tmp/tandem-pytest/families tests/engine/test_new_architectures_gpu.py
stage flashinfer 150 "${PYTEST[@]}" --basetemp=/tmp/tandem-pytest/flashinfer tests/engine/test_flashinfer_gpu.py

# -- what the next run reuses ---------------------------------------------------------------------
# (The machine sends back at most 8 files: this log, bench.json, logs.tar.xz and up to 5 parts.)
mkdir -p /tmp/aot
for so in $(find /tmp/flashinfer-ws -path '*cached_ops/*' -name '*.so' 2>/dev/null); do
    name=$(basename "$so" .so)
    [ "$(basename "$(dirname "$so")")" = "$name" ] && mkdir -p "/tmp/aot/$name" && cp "$so" "/tmp/aot/$name/"
done
if [ -n "$(ls /tmp/aot)" ]; then
    (cd /tmp/aot && tar -cf - . | xz -T16 -6 | split -b 15M - "$OUT/jit.tar.xz.")
    log "compiled kernels saved: $(ls /tmp/aot | tr '\n' ' ')($(du -ch "$OUT"/jit.tar.xz.* | tail -n 1 | cut -f1))"
fi
mkdir -p /tmp/stage-logs
mv "$OUT"/{bench,graphs,serving,families,flashinfer}.log /tmp/stage-logs/ 2>/dev/null
find /tmp/tandem-pytest -name '*.log' -exec cp --backup=numbered {} /tmp/stage-logs/ \; 2>/dev/null
tar -cJf "$OUT/logs.tar.xz" -C /tmp/stage-logs .
log "done"
