# Sourced by the GPU check scripts (benchmarks/gpu_check.sh, benchmarks/gpu_fsdp_check.sh): needs $log and $status.
step() {  # step LIMIT_S NAME CMD...: run CMD under a time limit, append its output to the log
    local limit=$1 name=$2
    shift 2
    echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: rc=$rc" | tee -a "$log"
    [ "$rc" -eq 0 ] || status=1
}
