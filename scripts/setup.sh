#!/usr/bin/env bash
# Creates .venv (Python 3.11+) and installs omnimesh with its test and ray extras. Idempotent; safe to re-run.
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
# under constraints.txt: the versions the suite last passed with, not whatever was released since
python -m pip install -q -c constraints.txt -e ".[test,ray,otel]"  # ray: --distributed-executor-backend ray; otel: tracing
# tcmalloc: omnimesh's processes re-execute themselves on it where it is installed (--malloc auto,
# omnimesh/allocator.py; +6-13% requests/s on CPU here). Optional: without it they run on glibc's malloc.
if ! (ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null) | grep -q libtcmalloc; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null) \
      || echo "setup: could not install libtcmalloc-minimal4; omnimesh will run on glibc's malloc (slower on CPU)"
  else
    echo "setup: tcmalloc is not installed; omnimesh will run on glibc's malloc (install libtcmalloc-minimal4 for faster CPU serving)"
  fi
fi
# the fused CPU kernels (omnimesh/csrc, ~10 s with g++): built now so no stage waits for them at its first start.
# Without a C++ compiler the stages run eager PyTorch (slower on small steps) and the kernel tests fail: install one.
if ! command -v "${CXX:-c++}" >/dev/null && ! command -v g++ >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq g++ >/dev/null) || echo "setup: could not install g++"
  else
    echo "setup: no C++ compiler (g++); omnimesh's fused CPU kernels cannot be built (install g++)"
  fi
fi
python -m omnimesh.kernels.cpu_kernels
# the sources' bytecode, compiled now as pip does for a regular install (an editable one skips it): where the
# environment sets PYTHONDONTWRITEBYTECODE every omnimesh process would compile them again (~0.4 s of CPU each, ~2 s
# of a mesh start on 2 cores)
python -m compileall -q omnimesh gateway services tests bench scripts
python -c "import torch, transformers, grpc, fastapi; print(f'omnimesh env ready: torch {torch.__version__}, transformers {transformers.__version__}')"
