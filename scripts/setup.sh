#!/usr/bin/env bash
# Creates .venv (Python 3.11+) and installs omnimesh with its test extras. Idempotent; safe to re-run.
# torch is installed first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
python -c "import torch, transformers, grpc, fastapi; print(f'omnimesh env ready: torch {torch.__version__}, transformers {transformers.__version__}')"
