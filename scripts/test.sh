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
# Line coverage of vllm_omni over the whole suite, servers and engine processes included
# (pyproject.toml's [tool.coverage]); the report and its total are printed at the end.
python -m coverage erase
status=0
python -m coverage run -m pytest -v --durations=25 "$@" || status=$?
python -m coverage combine -q || true
python -m coverage report || true
echo "coverage of vllm_omni (every process of the suite): $(python -m coverage report --format=total)%"
exit "$status"
