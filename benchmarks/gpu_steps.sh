# Sourced by benchmarks/gpu_run.sh (and experiments/gpu_fp8_mma.sh) after it sets $out: the environment
# of a device call, and `step NAME TIMEOUT_S COMMAND...`, which runs COMMAND under a time limit into
# $out/NAME.log (killed 20 s after the limit if it has not ended), appends its exit status and seconds to
# $out/summary.log and prints the log's end.
# The scripts run against the installed package: where `import flamia_verify` fails outside the
# checkout (a fresh device machine), the checkout is installed in editable mode, without its
# dependencies (torch and Triton are the machine's own).
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
if ! (cd / && python3 -c "import flamia_verify" 2>/dev/null); then
    python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 \
        || { echo "pip install -e . failed: $out/install.log" >&2; tail -n 5 "$out/install.log" >&2; }
fi
step() {
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    # SIGTERM at the limit (a check writes its finished checks, marked INCOMPLETE), SIGKILL 20 s later: a
    # kernel call still running can keep the process from ending, and must not hold the next steps
    timeout -k 20 "$limit" "$@" >"$out/$name.log" 2>&1
    echo "$name: exit $? in $((SECONDS - t0)) s" | tee -a "$out/summary.log"
    tail -n 3 "$out/$name.log"
}
