#!/usr/bin/env bash
# One GPU session's measurements in two commands (each fits one 10-minute device call on an H200):
#   bash benchmarks/gpu_run.sh OUTDIR tests    # steps 1-3 and the quick suites of step 4
#   bash benchmarks/gpu_run.sh OUTDIR speed    # the standard suite twice (step 4), step 5 and the 8K table
#   bash benchmarks/gpu_run.sh OUTDIR standard # only the standard suite twice (cold, then warm Triton cache)
#   bash benchmarks/gpu_run.sh OUTDIR full     # everything, with the full speed table (longer)
# 1. the GPU test suite (fused kernels vs the emulation, bitwise properties, fuzzed packings, the
#    emulation and formats on CUDA), 2. the quantizer and exact-input tests again with E4M3 rounded
#    in fp32/int32 arithmetic instead of the hardware conversion (FLAMIA_VERIFY_NATIVE_E4M3=0),
#    3. head_dim 256 through the fused kernels (tests/test_triton_head_dim_256.py: the shared-memory
#    fallback of resources._launch),
#    4. the standard suite on a fused kernel, twice (the second with compiled kernels), and the quick
#    suite on the other fused designs and on fp16 inputs, 5. `flamia-verify bench` on a short
#    table (a built-in without fused kernels among them), 6. the speed table (S = 8K, or every S
#    with "full").
# Every step writes OUTDIR/<step>.log and the script goes on after a failing step; OUTDIR.tar.gz holds
# everything at the end (on the device machine: bash benchmarks/gpu_run.sh /tmp/gpu tests; cp /tmp/gpu.tar.gz $OUT).
set -u
out=${1:?usage: gpu_run.sh OUTDIR tests|speed|standard|full}
mode=${2:-full}
mkdir -p "$out"
cd "$(dirname "$0")/.."
source benchmarks/gpu_steps.sh  # the installed package, no interpreter, step()
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/summary.log"
if [ "$mode" != speed ] && [ "$mode" != standard ]; then
step gpu_tests 300 python3 -m pytest -q -n 12 -m gpu -p no:cacheprovider tests/test_triton_quant.py \
    tests/test_triton_attention.py tests/test_kernels_emulation.py tests/test_formats_blocks.py \
    tests/test_reference_properties.py tests/test_rounding_probes.py tests/test_fp8_mma.py tests/test_triton_nonfinite.py
step software_e4m3 150 python3 -m pytest -q -m gpu -p no:cacheprovider \
    "tests/test_triton_quant.py::test_software_e4m3_rounding_matches_formats_bit_for_bit_on_gpu"
step headdim_256 150 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_triton_head_dim_256.py
for spec in ${QUICK:-fp8:bf16 fp8-mma:bf16 flamia-nvfp4:bf16 flamia-mxfp8:fp16}; do  # QUICK="kernel:dtype ..."
    set -- ${spec/:/ }
    step "check_quick_$1_$2" 200 python3 -c 'import sys; from flamia_verify.cli import main; sys.exit(main(sys.argv[1:]))' \
        check --kernel "$1" --dtype "$2" --suite quick --device cuda --out "$out/quick_$1_$2"
done
fi
if [ "$mode" != tests ]; then
# run 1 with an empty Triton cache (every kernel compiled), run 2 in a new process over that cache
export TRITON_CACHE_DIR="$out/triton-cache"
rm -rf "$TRITON_CACHE_DIR"
for i in 1 2; do
    step "check_standard_$i" 300 python3 -c 'import sys; from flamia_verify.cli import main; sys.exit(main(sys.argv[1:]))' \
        check --kernel flamia-mxfp8 --suite standard --device cuda --out "$out/check_$i"
done
python3 -c "import json, sys; e = json.load(open(sys.argv[1]))['environment']; print('kernel_paths', e.get('kernel_paths'))" \
    "$out/check_2/report.json" | tee -a "$out/summary.log"
for i in 1 2; do  # each check's seconds, slowest first
    python3 -c "import json, sys; r = json.load(open(sys.argv[1])); c = sorted(r['checks'], key=lambda c: -c.get('duration_s', 0)); print(sys.argv[2], 'checks', round(sum(x.get('duration_s', 0) for x in c), 1), 's:', ', '.join(f\"{x['name']} {x.get('duration_s', 0):.1f}\" for x in c[:8]))" \
        "$out/check_$i/report.json" "standard run $i" | tee -a "$out/summary.log"
done
rm -rf "$TRITON_CACHE_DIR"
unset TRITON_CACHE_DIR
if [ "$mode" != standard ]; then
step cli_bench 90 python3 -c 'import sys; from flamia_verify.cli import main; sys.exit(main(sys.argv[1:]))' \
    bench --kernel bf16 fp8 fp8-tensor --seqlens 2048 --causal true --rep-ms 20 --md "$out/cli_bench.md"
if [ "$mode" = full ]; then
    step bench 330 python3 benchmarks/bench_attention.py --rep-ms 50 --md "$out/bench.md" --json "$out/bench.json"
else
    step bench 180 python3 benchmarks/bench_attention.py --seqlens 8192 --causal both --rep-ms 50 --md "$out/bench.md"
fi
fi
fi
cat "$out/summary.log"
# one archive of every log and report (the device tool brings back only a few files per call)
tar czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")" && echo "archive: $out.tar.gz"
