#!/usr/bin/env bash
# Installs everything and serves the built-in tiny default model (made locally, no download)
# on an OpenAI-compatible API at http://localhost:8000. Extra arguments go to `vllm-omni serve`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/install.sh"
exec vllm-omni serve "$@"
