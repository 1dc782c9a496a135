# Sourced by the GPU scripts (gpu_run.sh, gpu_fp8_mma.sh) after they set $out: the environment of a
# device call, and `step NAME TIMEOUT_S COMMAND...`, which runs COMMAND under a time limit into
# $out/NAME.log, appends its exit status and seconds to $out/summary.log and prints the log's end.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
step() {
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "$name: exit $? in $((SECONDS - t0)) s" | tee -a "$out/summary.log"
    tail -n 3 "$out/$name.log"
}
