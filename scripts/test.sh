#!/usr/bin/env bash
# The whole test suite. Sets up .venv on first use. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest "$@"
