#!/usr/bin/env bash
# The GPU check of sharded training (docs/strategies.md), prepared as a single command for a device session
# (each step under its own time limit; at most ~8 minutes in all, usually 2-3):
#
#   bash benchmarks/gpu_fsdp_check.sh   # the log and the runs' JSON go to $OUT, else benchmarks/results/gpu_fsdp
#
# On min(2, number of GPUs) CUDA devices (nccl), the tiny 2-layer GPT of tests/fsdp_script.py trains 5 steps with a
# CurvatureMonitor under strategy="ddp", under FSDP2 (ModelParallelStrategy, tensor_parallel_size=1) and under
# Lightning's FSDPStrategy (FSDP1, per-layer wrap policy, use_orig_params False and True). `compare` then prints, for each run, whether it logged the DDP run's keys and steps and its step-0
# numbers to float32 round-off, and the most read weights alive at once; it exits 1 otherwise. The real-loss keys
# are on: FSDP2 must log DDP's (compare also prints their worst difference at every step), FSDP1 none.
# With one GPU every run has one rank: it checks Lightning's wiring (hooks under FSDP's, the reader's units in
# Lightning's wrapped model, the collectives on nccl), not the cross-rank agreement, which the CPU tests
# (tests/test_sharded.py, gloo) cover.
# It uses the machine's own python3 (its PyTorch and Lightning); curvwatch is imported from this checkout.
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/_gpu_step.sh  # gpu_setup NAME DIR; step LIMIT_S NAME CMD...
gpu_setup gpu_fsdp_check benchmarks/results/gpu_fsdp
export PYTHONWARNINGS=ignore
unset LOCAL_RANK  # Lightning starts the ranks itself
step 60 env $py -c "import torch, lightning as L; print(torch.__version__, L.__version__, torch.cuda.device_count())"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee -a "$log"
gpus=$($py -c "import torch; print(min(2, torch.cuda.device_count()))")
hw=(--accelerator cuda --devices "$gpus")
step 120 ddp $py tests/fsdp_script.py "$out" ddp "${hw[@]}"
step 120 fsdp2 $py tests/fsdp_script.py "$out" fsdp2 "${hw[@]}"
step 180 fsdp1 $py tests/fsdp_script.py "$out" lightning-fsdp1 "${hw[@]}"
step 30 compare $py tests/fsdp_script.py "$out" compare
rm -rf "$out/fsdp2.ckpt" "$out"/*/logs "$out"/*/rank1.json  # rank 0's JSON and the log come back (8 files at most)
exit $status
