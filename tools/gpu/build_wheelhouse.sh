#!/usr/bin/env bash
# Build .whl/, the packages an offline GPU host needs beyond its own image
# (Python 3.12, torch, nvcc; no registry, no ray), in at most 60 MiB:
#
#   flashinfer-trim.tar.xz  flashinfer-python 0.7.4 without data/csrc/<subdirs>
#                           (the wheel is 97 MiB; the kernels pdserve JIT-compiles
#                           need only the Python package, data/include, cutlass,
#                           cccl, spdlog and the top-level data/csrc files)
#   nixl-cu13-trim.tar.xz   nixl-cu13 1.5.1's agent, its bundled libraries and the
#                           hidden .nixl_cu13.mesonpy.libs (libnixl.so, plugins)
#   nixl-1.5.1-*.whl        the `nixl` import name, which picks nixl_cu13
#   apache_tvm_ffi-*.whl    flashinfer's FFI (cp312)
#   mooncake-slice.jsonl    the Mooncake conversation trace's first 256 rows (from
#                           ../shared/data/traces; its licence beside it, as
#                           mooncake-LICENSE-APACHE), for the device's sim step
#   SHA256SUMS              what tools/gpu/run_device_checks.sh installs
#
# Needs pip that reaches a registry, unzip, tar and xz. Usage:
#   tools/gpu/build_wheelhouse.sh [--check | --check-only]
# --check also imports flashinfer from the trimmed tree with this machine's
# Python (and a tvm-ffi wheel for it, in a scratch folder) and generates the
# JIT sources of the modules pdserve uses, without compiling them;
# --check-only checks the .whl/ already built. PYTHON picks the interpreter.
set -euo pipefail

FLASHINFER=0.7.4
NIXL=1.5.1
TVM_FFI=0.1.15.post2
LIMIT_MIB=60
TRACE_ROWS=256
PY=${PYTHON:-python3}
# absolute (it runs from a scratch folder), its links kept: a venv's python is one
[[ $PY == */* ]] && PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=$REPO/.whl
CHECK=0
BUILD=1
for arg in "$@"; do
    case $arg in
        --check) CHECK=1 ;;
        --check-only) CHECK=1 BUILD=0 ;;
        -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
        *) echo "build_wheelhouse.sh: unknown argument $arg (use --check)" >&2; exit 2 ;;
    esac
done

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"

build() {
    HOST=(--only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64
          --platform manylinux_2_17_x86_64)
    "$PY" -m pip download -q --no-deps -d . "flashinfer-python==$FLASHINFER"
    "$PY" -m pip download -q --no-deps "${HOST[@]}" -d . "nixl-cu13==$NIXL" "nixl==$NIXL" \
        "apache-tvm-ffi==$TVM_FFI"

    rm -rf "$OUT.new" && mkdir -p "$OUT.new"
    mkdir fi nx
    (cd fi && unzip -q ../flashinfer_python-"$FLASHINFER"-py3-none-any.whl)
    (cd fi && { find flashinfer -path flashinfer/data/csrc -prune -o -type f -print
                find flashinfer/data/csrc -maxdepth 1 -type f
                find flashinfer_python-"$FLASHINFER".dist-info -type f; } |
        LC_ALL=C sort | tar -cf - --no-recursion -T - | xz -T0 -9) > "$OUT.new/flashinfer-trim.tar.xz"
    (cd nx && unzip -q ../nixl_cu13-"$NIXL"-*.whl &&
        tar -cf - .nixl_cu13.mesonpy.libs nixl_cu13 nixl_cu13.libs "nixl_cu13-$NIXL.dist-info" |
        xz -T0 -9) > "$OUT.new/nixl-cu13-trim.tar.xz"
    cp nixl-"$NIXL"-py3-none-any.whl apache_tvm_ffi-"$TVM_FFI"-cp312-*.whl "$OUT.new/"
    # the device's sim step replays a Mooncake slice; the GPU host has no ../shared
    local mc=$REPO/../shared/data/traces/mooncake
    if [[ -f $mc/conversation_trace.jsonl ]]; then
        head -n "$TRACE_ROWS" "$mc/conversation_trace.jsonl" > "$OUT.new/mooncake-slice.jsonl"
        cp "$mc/LICENSE-APACHE" "$OUT.new/mooncake-LICENSE-APACHE"
    else
        echo "build_wheelhouse.sh: no $mc/conversation_trace.jsonl: the device's sim step" \
             "will have no trace" >&2
    fi
    (cd "$OUT.new" && sha256sum -- * > SHA256SUMS)

    local total
    total=$(du -cb "$OUT.new"/* | tail -1 | cut -f1)
    if (( total > LIMIT_MIB * 1024 * 1024 )); then
        echo "build_wheelhouse.sh: $((total / 1048576)) MiB is over the ${LIMIT_MIB} MiB limit" >&2
        exit 1
    fi
    rm -rf "$OUT" && mv "$OUT.new" "$OUT"
    ls -l "$OUT"
    echo "wheelhouse: $OUT, $(awk -v b="$total" 'BEGIN {printf "%.1f", b / 1048576}') MiB"
}

(( BUILD )) && build
if (( CHECK )); then
    (cd "$OUT" && sha256sum --quiet -c SHA256SUMS)
    SITE=$WORK/site
    mkdir -p "$SITE"
    tar -xJf "$OUT/flashinfer-trim.tar.xz" -C "$SITE"
    # flashinfer's import needs these; the GPU host's image has them
    "$PY" -m pip install -q --no-deps --target "$SITE" "apache-tvm-ffi==$TVM_FFI" \
        einops ninja nvidia-ml-py tabulate
    export FLASHINFER_WORKSPACE_BASE=$WORK/ws FLASHINFER_CUDA_ARCH_LIST=9.0a   # no GPU here: say which
    PYTHONPATH=$SITE "$PY" - <<'EOF'
import re
from pathlib import Path

import torch

import flashinfer
from flashinfer.jit import attention as jit

print("import flashinfer", flashinfer.__version__, "from", Path(flashinfer.__file__).parent)
data = Path(flashinfer.__file__).parent / "data"
incs = [data / "include", data / "csrc", data / "cutlass/include",
        data / "cutlass/tools/util/include", data / "spdlog/include", data / "cccl/libcudacxx/include",
        data / "cccl/cub", data / "cccl/thrust"]
specs = []
for dtype in (torch.float16, torch.bfloat16):
    for swa in (False, True):
        specs.append(jit.gen_batch_prefill_module("fa2", dtype, dtype, dtype, torch.int32,
                                                  128, 128, 0, swa, False, False))
        specs.append(jit.gen_batch_decode_module(dtype, dtype, dtype, torch.int32, 128, 128,
                                                 0, swa, False))
missing = set()
for spec in specs:
    for src in spec.sources:
        src = Path(src)
        assert src.is_file(), src
        for inc in re.findall(r'#include\s+[<"]([^>"]+)[>"]', src.read_text()):
            local = src.parent / inc
            if inc.startswith(("tvm/ffi", "cuda", "cub", "thrust")) or local.is_file():
                continue
            if not any((d / inc).is_file() for d in incs) and "/" in inc:
                missing.add(inc)
    print("generated", spec.name, len(spec.sources), "sources")
assert not missing, f"includes the trimmed tree lacks: {sorted(missing)}"
print("every pdserve module's sources generate; their project includes resolve")
EOF
fi
