#!/usr/bin/env bash
# The GPU checks of one device session, prepared as a single command (each step under its own time limit;
# at most ~7.5 minutes in all, so a 15-minute device budget leaves room for the machine's start and a rerun):
#
#   bash benchmarks/gpu_check.sh          # writes gpu_check.log and the JSON files to $OUT (else benchmarks/results/gpu)
#
# 1. the CUDA tests: tests/test_cuda.py (closed forms on CUDA vs CPU, host syncs of the Lanczos loop, a Lightning
#    run on the GPU) and the float16 mixed-precision test that needs CUDA;
# 2. bench_hvp (benchmark 2), bench_overhead (benchmark 3: the mid-size model's cadences and both models'
#    per-block breakdown) and bench_jacobians (benchmark 1) with --device cuda.
# It uses the machine's own python3 (its PyTorch and Lightning); curvwatch is imported from this checkout.
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/_gpu_step.sh  # gpu_setup NAME DIR; step LIMIT_S NAME CMD...
gpu_setup gpu_check benchmarks/results/gpu
step 30 env $py -c "import torch, lightning; print(torch.__version__, lightning.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee -a "$log"
step 120 tests $py -m pytest -q -p no:cacheprovider tests/test_cuda.py \
    "tests/test_reliability.py::test_mixed_precision_computed_in_float32"
step 150 bench_hvp $py -m benchmarks.bench_hvp --device cuda --out "$out/bench_hvp.json"
step 90 bench_overhead_mid $py -m benchmarks.bench_overhead --device cuda --models mid --out "$out/bench_overhead_mid.json"
step 30 bench_overhead_demo $py -m benchmarks.bench_overhead --device cuda --models demo --breakdown-only \
    --out "$out/bench_overhead_demo.json"
step 90 bench_jacobians $py -m benchmarks.bench_jacobians --device cuda --out "$out/bench_jacobians.json"
exit $status
