#!/usr/bin/env bash
# The one prepared run for a lent GPU machine (../shared/device/README.md): the GPU-marked tests (CUDA IPC
# hand-off, NCCL groups, the engine on CUDA in bf16), then bench/throughput.py on CUDA against transformers,
# everything written under $OUT. The machine has torch 2.11 + transformers 5.17 and no network, so the
# packages omnimesh pins travel as wheels. Here, before the run:
#   ../shared/device/fetch-wheels.sh $(grep -v '^#' scripts/gpu_wheels.txt)
# then the device tool's run, with carry [".whl"] and a timeout_s of ~580:
#   bash scripts/gpu_check.sh
# (~2-4 min of tests, the Qwen3-Omni and Qwen2.5-Omni meshes on CUDA among them, each test at most 150 s; ~3 min of
# bench, its meshes' KV pools at 2 GiB so start-up does not lay out ~90 GiB of blocks for a tiny model; each part is
# bounded by `timeout` so the results of the other come back.)
set -uo pipefail
OUT=${OUT:-/tmp/omnimesh-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl \
  || { echo "wheel install failed: fetch them first (see the top of this script)"; exit 1; }
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi; python3 -c "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__)"; } \
  > "$OUT/machine.txt" 2>&1
# the files that hold gpu-marked tests (tests/test_gpu_check.py keeps this list whole): collecting all of tests/
# would import what the machine lacks (openai, websockets, ...) for tests that do not run there. The quick unit
# tests come first and the meshes last, so a run cut short by its `timeout` loses the slow ones
GPU_TESTS=(
  tests/parallel/test_cuda_ranks.py
  tests/services/test_kv_cache_dtype.py
  tests/transport/test_cuda_ipc.py
  tests/models/test_load_format.py
  tests/models/test_qwen2_5_token2wav.py
  tests/e2e/test_cuda_mesh_e2e.py
  tests/e2e/test_qwen2_5_omni_e2e.py
)
timeout 270 python3 -m pytest -v -rA -p no:cacheprovider --timeout 150 --continue-on-collection-errors -m gpu \
  "${GPU_TESTS[@]}" 2>&1 | tee "$OUT/gpu-tests.txt"
# a mesh a killed test left running (its own session) would hold GPU memory through the benchmark
pkill -TERM -f "omnimesh.cli (serve|stage|gateway)" && sleep 5; pkill -KILL -f "omnimesh.cli (serve|stage|gateway)"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv >> "$OUT/machine.txt" 2>&1
timeout 260 python3 bench/throughput.py --device cuda --concurrency 1,8,16 --requests 32 --hf-requests 8 \
  --serve-args "--kv-cache-memory 2GiB" --json "$OUT/throughput-cuda.json" 2>&1 | tee "$OUT/throughput-cuda.txt"
