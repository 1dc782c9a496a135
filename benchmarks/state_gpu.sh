#!/usr/bin/env bash
# Stateful kernels and training parity on the GPU, one mode per device call (each fits the 10-minute limit):
#
#   bash benchmarks/state_gpu.sh OUTDIR checks      # cudnn-fp8: its GPU tests, the state family on the
#                                                   #   frozen configuration (must fail) and on the default
#                                                   #   (must pass), the quick suite on the default and with
#                                                   #   cuDNN's faster backward, the two backwards' speed
#   bash benchmarks/state_gpu.sh OUTDIR train       # train-parity of cudnn-fp8, -frozen and -current
#                                                   #   (small preset, 2 paired seeds, no floors)
#   bash benchmarks/state_gpu.sh OUTDIR resolution  # train-parity --preset resolution --ladder on the
#                                                   #   FLAMIA designs and a leaking kernel
#
# cudnn-fp8 needs nvidia-cudnn-frontend (a wheel in the carried .whl folder). Every step writes
# OUTDIR/<step>.log; OUTDIR.tar.gz holds everything at the end. The train-parity steps resume: a
# journal (OUTDIR/<step>/train-parity-runs.jsonl) of an earlier call copied into OUTDIR/<step>/ first
# (carried in a git-ignored folder) spares the trainings it holds, so that a run longer than one
# device call finishes over several.
set -u
out=${1:?usage: state_gpu.sh OUTDIR checks|train|resolution}
mode=${2:?usage: state_gpu.sh OUTDIR checks|train|resolution}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-deps --no-index .whl/*.whl >"$out/wheels.log" 2>&1 || tail -n 3 "$out/wheels.log"
fi
source benchmarks/gpu_steps.sh  # the installed package, step()
cli=(python3 -c 'import sys; from flamia_verify.cli import main; sys.exit(main(sys.argv[1:]))')
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader | tee -a "$out/summary.log"
git log -1 --format='commit %h %s' 2>/dev/null | tee -a "$out/summary.log"
case $mode in
checks)
    step cudnn_gpu_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cudnn_fp8.py
    step state_frozen 100 "${cli[@]}" check --kernel cudnn-fp8-frozen --only state --device cuda --out "$out/state_frozen"
    step state_default 100 "${cli[@]}" check --kernel cudnn-fp8 --only state --device cuda --out "$out/state_default"
    step quick_default 180 "${cli[@]}" check --kernel cudnn-fp8 --suite quick --device cuda --out "$out/quick_default"
    # cuDNN's faster, non-deterministic backward: its verdicts and its speed beside the deterministic one
    step quick_fast_backward 180 "${cli[@]}" check --kernel benchmarks/cudnn_backward.py:fast_backward --suite quick \
        --device cuda --out "$out/quick_fast_backward"
    step bench_backward 120 "${cli[@]}" bench --kernel bf16 cudnn-fp8 benchmarks/cudnn_backward.py:fast_backward \
        --seqlens 8192 16384 --causal true --rep-ms 30 --md "$out/bench_backward.md"
    ;;
train)
    step train_cudnn 560 "${cli[@]}" train-parity --kernel cudnn-fp8 cudnn-fp8-frozen cudnn-fp8-current --preset small \
        --seeds 2 --no-floors --device cuda --out "$out/train_cudnn" --resume
    ;;
resolution)
    step train_resolution 570 "${cli[@]}" train-parity --kernel flamia-mxfp8 flamia-nvfp4 fp8 \
        flamia_verify.training.demo_kernels:next_token_leak --preset resolution --ladder --device cuda \
        --out "$out/train_resolution" --resume
    ;;
esac
cat "$out/summary.log"
tar czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")" && echo "archive: $out.tar.gz"
