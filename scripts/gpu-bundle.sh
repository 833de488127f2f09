#!/usr/bin/env bash
# Make .gpu/, what scripts/gpu-check.sh needs on a GPU machine beside the repository (that machine
# has no network): run here, where PyPI and Debian's archive answer, then carry .gpu to it. The
# wheels are for its Python 3.12 on x86-64; the kernel sources FlashInfer's attention does not
# compile, and Mooncake's store, tools and benchmarks, are left out to fit the 64 MiB a call carries.
# Idempotent: what exists is kept (delete .gpu/ to start over). FlashInfer kernels compiled by a
# run come back as $OUT/jit.tar.xz.*: copy them into .gpu/jit/ for the next run.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
GPU=$REPO/.gpu
FLASHINFER=flashinfer-python==0.7.2.post1
MOONCAKE=mooncake-transfer-engine-cuda13==0.3.14
# What the GPU machine's image lacks, at versions its grpcio (1.84) and torch accept.
WHEELS=("apache-tvm-ffi==0.1.15.post2" "smg-grpc-proto==0.4.28" "grpcio-health-checking==1.84.0" "protobuf==7.36.2"
        "nvidia-ml-py==13.615.71")
# Mooncake's engine links libibverbs, libmlx5, libnuma and libcurl; gpu-check.sh adds each only where missing.
DEBS=(libibverbs1 ibverbs-providers libnuma1 libnl-3-200 libnl-route-3-200 libcurl4 libnghttp2-14 librtmp1 libssh2-1
      libpsl5 libldap-2.5-0 libbrotli1 libsasl2-2 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libkeyutils1
      libidn2-0 libunistring2 libgnutls30 libhogweed6 libnettle8 libtasn1-6 libp11-kit0 libffi8 libzstd1)

grep -qx '/.gpu/' "$REPO/.git/info/exclude" 2>/dev/null || echo /.gpu/ >> "$REPO/.git/info/exclude"
mkdir -p "$GPU/wheels" "$GPU/debs" "$GPU/jit"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
download() {  # wheels for CPython 3.12 on x86-64 Linux, no dependencies
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$@"
}

if ! ls "$GPU"/wheels/*.whl > /dev/null 2>&1; then
    download "$GPU/wheels" "${WHEELS[@]}"
fi
if [ ! -f "$GPU/flashinfer.tar.xz" ]; then
    download "$TMP" "$FLASHINFER"
    mkdir "$TMP/fi" && (cd "$TMP/fi" && unzip -q "$TMP"/flashinfer_python-*.whl)
    find "$TMP/fi/flashinfer/data/csrc" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +  # other kernels' sources
    tar -C "$TMP/fi" -cf - . | xz -T0 -6 > "$GPU/flashinfer.tar.xz"
fi
if [ ! -f "$GPU/mooncake.tar.xz" ]; then
    download "$TMP" "$MOONCAKE"
    mkdir "$TMP/mc" && (cd "$TMP/mc" && unzip -q "$TMP"/mooncake_transfer_engine_cuda13-*.whl)
    mkdir -p "$TMP/mcslim/mooncake" "$TMP/mcslim/mooncake_transfer_engine_cuda13.libs"
    cp "$TMP"/mc/mooncake/{__init__.py,engine.so,engine.pyi,libasio.so,libetcd_wrapper.so} "$TMP/mcslim/mooncake/"
    cp "$TMP"/mc/mooncake_transfer_engine_cuda13.libs/{libyaml-cpp,libjsoncpp,libglog,libgflags}* \
        "$TMP/mcslim/mooncake_transfer_engine_cuda13.libs/"
    tar -C "$TMP/mcslim" -cf - . | xz -T0 -6 > "$GPU/mooncake.tar.xz"
fi
if ! ls "$GPU"/debs/*.deb > /dev/null 2>&1; then
    (cd "$GPU/debs" && apt-get download "${DEBS[@]}")
fi
if [ ! -f "$GPU/tokenizer/tokenizer.json" ]; then
    "$REPO/.venv/bin/tandem" export-tokenizer "$GPU/tokenizer" > /dev/null
fi
du -sh "$GPU"
