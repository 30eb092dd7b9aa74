#!/usr/bin/env bash
# Issues 23 and 24's GPU check, one command (each step under its own time limit; ~10 minutes in all on one H200):
#
#   bash benchmarks/gpu_scale.sh      # writes gpu_scale.log and JSON files to $OUT (else benchmarks/results/gpu)
#
# 1. the CUDA tests (tests/test_cuda.py: closed forms on CUDA equal the CPU ones, the Lanczos loop's syncs, a
#    Lightning run on the GPU) and the float16 mixed-precision test that needs CUDA;
# 2. benchmarks/bench_dispatch.py --device cuda: the plain training step and the step with a full evaluation (every
#    default key, real-loss keys included), with one without the real-loss keys and with a terms-only evaluation,
#    side by side, with peak memory, on the GPT-2-small-shaped curvwatch GPT (12 layers, d 768, 12 heads, vocabulary
#    50304, B 8, L 1024, bf16-mixed, AdamW) and on a LLaMA-style HF LlamaForCausalLM (12 layers, d 768, 12 / 4 heads,
#    ff 2048, vocabulary 32000) built from a config (the machine's own transformers). Each prints the cost goals
#    met or not (evaluations in training steps; the monitor's default schedule on a clock of the measured costs,
#    curvwatch.schedule.simulate); then benchmarks/cost_model.py --compare prints each measured row beside the cost
#    model's estimate (the counts of benchmarks/results/cost_model.json, priced for the card) and writes the run's
#    calibration points to $out/cost_model_compare_<arch>.json, to be added to benchmarks/results/calibration.json;
# 3. benchmarks/bench_sharpness.py --cost --device cuda: the real-loss part of a full
#    evaluation (held-out HF GPT-2, 2 layers, d 768, vocabulary 50257, B 8, L 128) at 16 and at 64 samples (64: what
#    15% accuracy needs on the FFN W2 blocks), wall-clock seconds and operators, side by side in one process.
# It uses the machine's own python3 (its PyTorch, Lightning, transformers); curvwatch comes from this checkout.
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/_gpu_step.sh  # gpu_setup NAME DIR; step LIMIT_S NAME CMD...
gpu_setup gpu_scale benchmarks/results/gpu
step 30 env $py -c "import torch, lightning; print(torch.__version__, lightning.__version__, torch.cuda.get_device_name())"
step 150 tests $py -m pytest -q -p no:cacheprovider tests/test_cuda.py \
    "tests/test_reliability.py::test_mixed_precision_computed_in_float32"
for arch in gpt llama; do
    step 170 "dispatch_$arch" $py -m benchmarks.bench_dispatch --device cuda --arch $arch --tiers full,full_nrl,terms \
        --out "$out/dispatch_$arch.json"
    step 30 "estimate_$arch" $py -m benchmarks.cost_model --compare "$out/dispatch_$arch.json" \
        --out "$out/cost_model_compare_$arch.json"
done
step 150 real_loss_cost $py -m benchmarks.bench_sharpness --cost --device cuda --width 768 --batch 8 --seq 128 \
    --samples 16 64 --repeats 2 --out "$out/real_loss_cost.md"
exit $status
