#!/usr/bin/env bash
# The one prepared run for a lent GPU machine (../shared/device/README.md): the GPU-marked tests (CUDA IPC
# hand-off, NCCL groups, the engine on CUDA in bf16), then bench/throughput.py on CUDA against transformers,
# everything written under $OUT. The machine has torch 2.11 + transformers 5.17 and no network, so the
# packages omnimesh pins travel as wheels. Here, before the run:
#   ../shared/device/fetch-wheels.sh $(grep -v '^#' scripts/gpu_wheels.txt)
# then the device tool's run, with carry [".whl"] and a timeout_s of ~580:
#   bash scripts/gpu_check.sh
# (~2-3 min of tests, the Qwen3-Omni and Qwen2.5-Omni meshes on CUDA among them; ~4 min of bench; each part is bounded by `timeout`
# so the results of the other come back.)
set -uo pipefail
OUT=${OUT:-/tmp/omnimesh-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl \
  || { echo "wheel install failed: fetch them first (see the top of this script)"; exit 1; }
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi; python3 -c "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__)"; } \
  > "$OUT/machine.txt" 2>&1
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$OUT/gpu-tests.txt"
timeout 290 python3 bench/throughput.py --device cuda --concurrency 1,8,16 --hf-requests 16 \
  --json "$OUT/throughput-cuda.json" 2>&1 | tee "$OUT/throughput-cuda.txt"
