#!/usr/bin/env bash
# Set up (idempotently), then run the demo. Extra arguments go to `tandem demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/tandem demo "$@"
