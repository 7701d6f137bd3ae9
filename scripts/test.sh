#!/usr/bin/env bash
# Installs everything and runs the test suite: the README's test command and CI's.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/install.sh"
if [ ! -x /usr/bin/chromium ]; then
  # The playground's browser tests drive Debian's Chromium through Playwright (Playwright's
  # own browser download needs the internet).
  sudo_=""; [ "$(id -u)" = 0 ] || sudo_="sudo"
  $sudo_ apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq chromium >/dev/null
fi
cd "$root"
ruff check vllm_omni tests benchmarks scripts
exec python -m pytest -v "$@"
