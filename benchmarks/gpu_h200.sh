#!/usr/bin/env bash
# The GPU benchmark, prepared for an H200-class host (CUDA torch installed, >= 128 GiB RAM):
# pinpool against the field's baselines with the CUDA runtime, plus PyTorch's own pinned
# allocation (torch.empty(pin_memory=True)) and its threaded host-register mode, and the
# longest single cudaHostRegister call per chunk size. One script, about 6-7 minutes.
# It runs the harness ./dev bench runs (benchmarks/pin_throughput.py) from this checkout,
# with the Python in $PYTHON (default python3), which must import pinpool.
#
#   pip install -e .            # with the host's CUDA build of torch already installed
#   OUT=results bash benchmarks/gpu_h200.sh
#
# Writes $OUT/cuda-16GiB.{md,json} and $OUT/cuda-64GiB.{md,json}.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench-results}
py=${PYTHON:-python3}
mkdir -p "$out"
"$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device: run this on a GPU host")'
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/gpu.txt" || true

# 16 GiB: every configuration, 3 repetitions (+1 warm-up). ~3 min.
timeout 240 "$py" benchmarks/pin_throughput.py --runtime cuda --size 16GiB --reps 3 \
    --stall-chunk-sizes 256MiB,1GiB,4GiB,16GiB --overhead-chunks 10000 --overhead-reps 1 \
    --json "$out/cuda-16GiB.json" --markdown "$out/cuda-16GiB.md"

# 64 GiB: the main baselines, 1 repetition (+1 warm-up). ~3 min.
timeout 240 "$py" benchmarks/pin_throughput.py --runtime cuda --size 64GiB --reps 1 --no-huge-pages \
    --configs "sequential,fault-then-register,torch host_register x8" \
    --stall-chunk-sizes 4GiB,64GiB --overhead-chunks "" --no-rss \
    --json "$out/cuda-64GiB.json" --markdown "$out/cuda-64GiB.md"
cat "$out"/cuda-*.md
