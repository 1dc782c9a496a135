#!/usr/bin/env bash
# fp8-mma on the GPU in one device call (H200, about 8 minutes):
#   bash experiments/gpu_fp8_mma.sh OUTDIR
# 1. the accumulator's worst case (experiments/probe_fp8_mma.py --quick), 2. the fused kernels'
# distance to their specification (experiments/fp8_mma_gpu.py), 3. the GPU tests of fp8-mma,
# 4. the speed table at S = 8K beside bf16 and fp8, 5. the quick suite on the fused kernel,
# 6. a forward tile sweep. Each step writes OUTDIR/<step>.log and the script goes on after a failure.
set -u
out=${1:?usage: gpu_fp8_mma.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
source benchmarks/gpu_steps.sh  # the installed package, no interpreter, step()
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/summary.log"
step adversarial 60 python3 experiments/probe_fp8_mma.py --quick --json "$out/adversarial.json"
step spec 120 python3 experiments/fp8_mma_gpu.py "$out/spec.json"
step tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 tests/test_triton_attention.py tests/test_fp8_mma.py -k "mma"
step bench 200 python3 benchmarks/bench_attention.py --kernels bf16 fp8 fp8-mma --seqlens 8192 --causal both \
    --rep-ms 40 --md "$out/bench.md" --json "$out/bench.json"
step check_quick 120 python3 -c 'import sys; from flamia_verify.cli import main; sys.exit(main(sys.argv[1:]))' \
    check --kernel fp8-mma --suite quick --device cuda --out "$out/quick_fp8_mma"
step tune_fwd 100 python3 benchmarks/tune_tiles.py --kernels fp8-mma fp8 --phases fwd --md "$out/tune_fwd.md"
cat "$out/summary.log"
