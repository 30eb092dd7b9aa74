# Sourced by the GPU check scripts (benchmarks/gpu_check.sh, gpu_fsdp_check.sh, gpu_scale.sh), from the repository root.

gpu_setup() {  # gpu_setup NAME DEFAULT_DIR: $out ($OUT, else DEFAULT_DIR) and an empty $out/NAME.log ($log), the
    # environment (unbuffered output, this checkout first on PYTHONPATH, W&B off), $py (the machine's python3), $status
    out="${OUT:-$2}"
    mkdir -p "$out"
    log="$out/$1.log"
    export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE=disabled
    py=python3
    status=0
    : >"$log"
}

step() {  # step LIMIT_S NAME CMD...: run CMD under a time limit, append its output to the log
    local limit=$1 name=$2
    shift 2
    echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: rc=$rc" | tee -a "$log"
    [ "$rc" -eq 0 ] || status=1
}
