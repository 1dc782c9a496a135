#!/usr/bin/env bash
# Install FlashAttention-4 (flash-attn-4 4.0.0b40, the extra flamia-verify[fa4]) and what it imports on a
# machine without a package index (the device machine: Python 3.12, torch 2.11 cu130), from wheels that
# were downloaded where pip works:
#
#   mkdir -p .whl-fa4 && cd .whl-fa4 && python3 -m pip download --platform manylinux_2_28_x86_64 \
#       --python-version 3.12 --only-binary=:all: --no-deps flash-attn-4==4.0.0b40 nvidia-cutlass-dsl==4.8.1 \
#       nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 \
#       apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5 einops==0.8.2
#   (and nvidia-cudnn-frontend==1.32.0 for the cudnn-fp8 rows, with --platform manylinux_2_27_x86_64)
#
# (cuda-bindings, protobuf, typing-extensions and packaging, which they need too, are on the device image.)
# The CUDA 13 libraries' wheel is 88 MiB, more than one device call carries (64 MiB with the working tree),
# so it is split into parts (`split -b 44M NAME.whl NAME.whl.part-`) kept in carry groups, each a folder
# of .whl-fa4 carried by its own call, back to back (the machine keeps ignored paths while it stays warm;
# each call also carries the working tree, 5.5 MiB for this checkout):
#
#   .whl-fa4/g1   nvidia_cutlass_dsl_libs_cu13-...whl.part-aa                     44.0 MiB
#   .whl-fa4/g2   ...whl.part-ab, the 8 other wheels, SHA256SUMS                   53.5 MiB
#   .whl-fa4/g3   nvidia-cudnn-frontend 1.32.0 (only for cudnn-fp8), SHA256SUMS   11.1 MiB (with g1: 55.1 MiB)
#
# This script gathers every wheel and part under .whl-fa4/ (any depth), joins each wheel's parts in
# order, checks every wheel against the SHA256SUMS files (a missing part fails here, naming the wheel),
# installs them with pip --no-index --no-deps into .fa4-site, and writes .fa4-site/env.sh, which puts
# them on PYTHONPATH. `pip --target` does not run the .pth file by which nvidia-cutlass-dsl adds its
# dsl_packages folder (where `cutlass` lives) to sys.path, so env.sh adds that folder itself; it also
# turns on FA4's on-disk compile cache in .fa4-cache (kept between calls while the machine is warm).
#
#   bash benchmarks/fa4_install.sh && source .fa4-site/env.sh
#
# FA4_WHEELS, FA4_SITE and PYTHON override the folders and the interpreter; FA4_PIP_ARGS adds pip options
# (to try the script where the interpreter is not 3.12: "--python-version 3.12 --only-binary=:all:
# --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64"). Run again with more wheels (g3
# later): it installs everything found again, idempotently.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
wheels=${FA4_WHEELS:-.whl-fa4}
site=${FA4_SITE:-.fa4-site}
py=${PYTHON:-python3}
[ -d "$wheels" ] || { echo "fa4_install: no folder $wheels (carry its groups first)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# every wheel whole, every split wheel joined from its parts in suffix order (part-aa, part-ab, ...)
find "$wheels" -name '*.whl' -exec cp {} "$work"/ \;
find "$wheels" -name '*.whl.part-*' | sed 's/\.part-[^.]*$//' | sort -u | while read -r first; do
    name=$(basename "$first")
    find "$wheels" -name "$name.part-*" | awk -F'.part-' '{print $NF "\t" $0}' | sort | cut -f2- \
        | xargs cat >"$work/$name"
    echo "fa4_install: joined $name from $(find "$wheels" -name "$name.part-*" | wc -l) parts"
done
find "$wheels" -name SHA256SUMS -exec cat {} + | sort -u >"$work/SHA256SUMS"
# every wheel listed must be here and whole; a wheel that is here but not listed is refused too
if ! (cd "$work" && sha256sum --quiet -c SHA256SUMS); then
    echo "fa4_install: a wheel is missing or incomplete (a carry group not carried?): see above" >&2
    exit 1
fi
for w in "$work"/*.whl; do
    grep -q " $(basename "$w")\$" "$work/SHA256SUMS" || { echo "fa4_install: $(basename "$w") is in no SHA256SUMS" >&2; exit 1; }
done
ls "$work"/*.whl | xargs -n1 basename

# shellcheck disable=SC2086  # FA4_PIP_ARGS: words
"$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade ${FA4_PIP_ARGS:-} --target "$site" "$work"/*.whl
dsl="$root/$site/nvidia_cutlass_dsl/dsl_packages"
[ -d "$dsl" ] || { echo "fa4_install: $dsl is missing (nvidia-cutlass-dsl-libs-core not installed?)" >&2; exit 1; }
mkdir -p "$root/.fa4-cache"
cat >"$site/env.sh" <<EOF
# FlashAttention-4 and its dependencies from benchmarks/fa4_install.sh: source this file
export PYTHONPATH="$root/$site:$dsl\${PYTHONPATH:+:\$PYTHONPATH}"
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR="$root/.fa4-cache"
EOF
echo "fa4_install: installed into $site; put it on the path with:  source $site/env.sh"
cat "$site/env.sh"
# one import of what the adapters load, and the versions the report will name
source "$site/env.sh"
"$py" - <<'EOF'
import importlib.metadata as md
import time

t = time.time()
import flash_attn.cute.interface as fa4  # noqa: E402

print(f"import flash_attn.cute.interface: {time.time() - t:.1f} s; TensorwiseScales: {hasattr(fa4, 'TensorwiseScales')}")
for dist in ("flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-cu13", "quack-kernels", "apache-tvm-ffi",
             "torch-c-dlpack-ext", "cuda-bindings", "nvidia-cudnn-frontend", "torch"):
    try:
        print(f"  {dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"  {dist} not installed")
EOF
