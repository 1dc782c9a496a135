#!/usr/bin/env bash
# FlashAttention-4 on the GPU: the adapters' checks and timings, one mode per device call (each fits the
# 10-minute limit; run benchmarks/fa4_install.sh first, in the call that carries the last wheel group).
#
#   bash benchmarks/fa4_gpu.sh OUTDIR smoke        # versions, availability, tests/test_fa4.py -m gpu (fa4 vs
#                                                  #   the reference, fwd+bwd, bf16/fp16, GQA, Lq != Lk, lse)
#   bash benchmarks/fa4_gpu.sh OUTDIR bench        # the speed table: bench_attention.py --preset fa4 (S = 8K
#                                                  #   and 16K, causal and not, B*S = 32K, H = 16, D = 128)
#   bash benchmarks/fa4_gpu.sh OUTDIR survey-fa4   # the quick suite on fa4 and the fa4-fp8 policies
#   bash benchmarks/fa4_gpu.sh OUTDIR survey-rest  # the same survey's other kernels, into the same store
#
# OUTDIR must outlive the call for the two survey halves to make one survey (a rerun into the same --out
# reuses stored results): use an ignored folder of the checkout, e.g. .fa4-run, and copy what comes
# back: every mode ends with OUTDIR.tar.gz (logs, the tables, survey.md/json/html, each kernel's
# report.md and report.json).
# The survey's kernels: fa4 fa4-fp8 fa4-fp8-current fa4-fp8-doc sdpa-cudnn sdpa-flash bf16 flamia-mxfp8
# cudnn-fp8 (--no-speed: the speed is the bench table's). On Hopper the fa4-fp8 rows say why they are
# not available (FA4's FP8 forward is Blackwell-only); cudnn-fp8 needs nvidia-cudnn-frontend (.whl-fa4/g3).
set -u
out=${1:?usage: fa4_gpu.sh OUTDIR smoke|bench|survey-fa4|survey-rest}
mode=${2:?usage: fa4_gpu.sh OUTDIR smoke|bench|survey-fa4|survey-rest}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
[ -f .fa4-site/env.sh ] && source .fa4-site/env.sh  # benchmarks/fa4_install.sh's PYTHONPATH and compile cache
source benchmarks/gpu_steps.sh                      # the installed package, step()
cli() { python3 -c 'import sys; from flamia_verify.cli import main; sys.exit(main(sys.argv[1:]))' "$@"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader | tee -a "$out/summary.log"
python3 - <<'EOF' 2>&1 | tee -a "$out/summary.log"
import torch
from flamia_verify.kernels.adapters import ADAPTERS
print("torch", torch.__version__, "cuda", torch.version.cuda, "capability", torch.cuda.get_device_capability())
for name in ("fa4", "fa4-fp8", "fa4-fp8-current", "fa4-fp8-doc", "cudnn-fp8"):
    a = ADAPTERS[name]
    print(f"{name}: {a.unavailable() or 'available'}; {a.library_versions()}")
EOF
survey_kernels_fa4="fa4 fa4-fp8 fa4-fp8-current fa4-fp8-doc"
survey_kernels_rest="sdpa-cudnn sdpa-flash bf16 flamia-mxfp8 cudnn-fp8"
survey() {  # survey NAME TIMEOUT KERNELS...: into one store, $out/survey
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" cli survey --kernel "$@" --device cuda --no-speed --workers-per-gpu 4 \
        --timeout $((limit - 60)) --out "$out/survey"
}
case "$mode" in
smoke)
    step fa4_gpu_tests 500 python3 -m pytest -q -m gpu -p no:cacheprovider -rs --durations=10 tests/test_fa4.py
    ;;
bench)
    step bench_fa4 560 python3 benchmarks/bench_attention.py --preset fa4 --rep-ms 50 \
        --md "$out/bench_fa4.md" --json "$out/bench_fa4.json"
    [ -f "$out/bench_fa4.md" ] && cat "$out/bench_fa4.md"
    ;;
survey-fa4)
    # shellcheck disable=SC2086  # the kernel names are words
    survey survey_fa4 540 $survey_kernels_fa4
    ;;
survey-rest)
    # shellcheck disable=SC2086
    survey survey_rest 540 $survey_kernels_rest
    # the whole survey (both halves) from the store, no kernel run again
    # shellcheck disable=SC2086
    survey survey_all 120 $survey_kernels_fa4 $survey_kernels_rest
    [ -f "$out/survey/survey.md" ] && cat "$out/survey/survey.md"
    ;;
*)
    echo "unknown mode $mode (smoke, bench, survey-fa4, survey-rest)" >&2
    exit 2
    ;;
esac
cat "$out/summary.log"
# one archive of the logs, tables and survey pages, and each kernel's report.md and report.json (not the
# store, not the per-kernel HTML pages: what comes back from a call is at most 16 MiB a file)
(cd "$(dirname "$out")" && find "$(basename "$out")" -type f \( -name '*.log' -o -name 'bench_fa4.*' \
    -o -name 'survey.md' -o -name 'survey.json' -o -name 'survey.html' -o -name 'report.md' -o -name 'report.json' \) \
    -not -path '*/cases/*' -not -path '*/speed/*' | tar czf "$out.tar.gz" -T -) && ls -l "$out.tar.gz"
