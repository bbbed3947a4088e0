#!/usr/bin/env bash
# Sets up the environment (first run only) and starts the whole mesh on this machine.
# With no MODEL it serves the built-in tiny Qwen3-Omni. Extra arguments go to `omnimesh serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec omnimesh serve "$@"
