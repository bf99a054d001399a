#!/usr/bin/env bash
# The GPU benchmark, prepared for an H200-class host (CUDA torch installed, >= 128 GiB RAM):
# pinpool against the field's baselines with the CUDA runtime, plus PyTorch's own pinned
# allocation (torch.empty(pin_memory=True)) and its threaded host-register mode, and the
# longest single cudaHostRegister call per chunk size. One script, about 6-7 minutes (2-3 more with a NIC).
# It runs the harness ./dev bench runs (benchmarks/pin_throughput.py) from this checkout,
# with the Python in $PYTHON (default python3), which must import pinpool.
#
#   pip install -e .            # with the host's CUDA build of torch already installed
#   OUT=results bash benchmarks/gpu_h200.sh
#
# Writes $OUT/cuda-16GiB.{md,json} and $OUT/cuda-64GiB.{md,json}, and on a host with an RDMA NIC
# $OUT/rdma-engines.{md,json} (issue 35: the transfer engines over the NIC; see the end of this script).
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

# Transfer engines over a NIC (issue 35): Mooncake's Transfer Engine with protocol "rdma" and NIXL's UCX
# over rc (ibv_reg_mr registrations, pinned), each reading a CUDA-registered pinpool pool's pages
# (pool.transfer_pieces) against the same engine reading a plain buffer of the same size (goal >= 0.95x),
# and the engines' registration overlapped with pinning (stand-ins at the field's ibv_reg_mr cost).
# PLANNED, NOT YET RUN: written on a host without a NIC (the CPU figures in docs/performance.md are TCP on
# loopback). Needs: pip install mooncake-transfer-engine nixl-cu12 (the CUDA builds), libibverbs1, an
# active port, and `ulimit -l` large enough for the pool twice over (or CAP_IPC_LOCK). Knobs:
#   ENGINES_HOST    Mooncake's local hostname: the NIC's IP address (default: the first from hostname -I)
#   ENGINES_DEVICE  Mooncake's device_name, e.g. mlx5_0 (default: every NIC it discovers)
#   UCX_TLS         NIXL/UCX transports (default rc: through the NIC even between two agents in one
#                   process); UCX_NET_DEVICES=mlx5_0:1 to pick the port
#   ENGINES_SIZE    default 16GiB
if ! ls /sys/class/infiniband/ 2>/dev/null | grep -q .; then
    echo "skipped: the transfer engines over RDMA (no RDMA device in /sys/class/infiniband)"
    exit 0
fi
"$py" -c 'import mooncake.engine, nixl_cu12' || {
    echo "skipped: the transfer engines over RDMA (pip install mooncake-transfer-engine nixl-cu12)"
    exit 0
}
host=${ENGINES_HOST:-$(hostname -I | awk '{print $1}')}
UCX_TLS=${UCX_TLS:-rc} timeout 300 "$py" benchmarks/bench_registrars.py --runtime cuda \
    --size "${ENGINES_SIZE:-16GiB}" --reps 3 --kinds device cpu --seconds-per-gib 0.1 \
    --engines mooncake nixl --transport rdma --host "$host" --device "${ENGINES_DEVICE:-}" \
    --json "$out/rdma-engines.json" --markdown "$out/rdma-engines.md"
cat "$out/rdma-engines.md"
