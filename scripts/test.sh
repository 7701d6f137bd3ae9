#!/usr/bin/env bash
# Installs everything and runs the test suite: the README's test command and CI's.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/install.sh"
cd "$root"
ruff check vllm_omni tests benchmarks scripts
exec python -m pytest -v "$@"
