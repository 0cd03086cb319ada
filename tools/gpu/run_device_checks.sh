#!/usr/bin/env bash
# pdserve's first checks on a bare CUDA host: Python 3.12, torch and nvcc, but
# no package registry and no ray. From the repository root, with .whl/ built
# by tools/gpu/build_wheelhouse.sh beside it:
#
#   tools/gpu/run_device_checks.sh OUTDIR [--dry-run] [--steps NAME,NAME...]
#
# Steps, each under its own `timeout`, all inside a 9-minute budget (later
# steps shrink or are skipped when it runs out; PDSERVE_CHECK_BUDGET_S), most
# wanted first:
#   install   .whl/ into /tmp/site (PDSERVE_SITE), pdserve linked in; versions. A
#             past run's flashinfer-jit.tar.xz copied into .whl/ goes into
#             flashinfer's AOT folder, so its modules load without a compile
#   import    torch sees the GPU; flashinfer and nixl import
#   warm      flashinfer's kernels compiled, every module the later steps use
#             (tools/gpu/warm_kernels.py: the loader's warm_up, in parallel)
#   keep      the compiled flashinfer modules, for a later run to reuse
#   bench-gpu pdserve bench gpu (issue 54): Llama-3-8B's and SmolLM2's shapes,
#             decode and prefill against the card's measured limits, the peer
#   capture-fi  flashinfer's decode captured (issue 54), bfloat16: the device test
#             and bench capture --attention flashinfer
#   bench-transfer  pdserve bench transfer --device cuda (NIXL VRAM pools)
#   sim       tools/gpu/sim_check.sh (issue 54): a profile calibrated on the
#             Llama-3-8B-shaped random preset, and the simulator against that
#             engine, in process, on the Mooncake slice .whl/ carries
#   capture   the same with torch's attention (issue 40's GPU figures)
#   tests     pytest -m device: test_device.py, test_fused_ops.py, test_mla_flashinfer.py,
#             test_experts_paths.py
#   per-row   tools/gpu/per_row_check.py: the teacher-forced logits, as numbers
#   bench-llm pdserve bench llm --device cuda (llama-110m, uniform workload)
# OUTDIR receives at most 8 files: log.txt (everything, the tests' results,
# warm's timings and bench-llm's table too), steps.tsv (step, exit status,
# seconds), flashinfer-jit.tar.xz, bench_gpu.txt, bench_capture.txt,
# bench_transfer.txt, sim.tar.xz and per_row.json.
#
# --dry-run runs the same steps on this machine's CPU: the wheelhouse's
# archives are verified instead of installed, flashinfer is the stand-in
# tests/support/flashinfer_fake.py, ray is made unimportable (as on the GPU host),
# the device tests are collected rather than run, and each benchmark with
# --device cuda must fail with its one-line error. It exits 0 when every
# step did what it should. --steps runs only the steps named.
set -uo pipefail

usage() { echo "usage: $0 OUTDIR [--dry-run] [--steps NAME,NAME...]" >&2; exit 2; }
OUT="" DRY=0 STEPS=""
while (($#)); do
    case $1 in
        --dry-run) DRY=1 ;;
        --steps) STEPS=",${2:?--steps needs a list},"; shift ;;
        -h|--help) sed -n '2,41p' "$0"; exit 0 ;;
        -*) usage ;;
        *) [[ -z $OUT ]] && OUT=$1 || usage ;;
    esac
    shift
done
[[ -n $OUT ]] || usage
REPO=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
: > "$OUT/steps.tsv"
exec > >(tee "$OUT/log.txt") 2>&1
cd "$REPO"

PY=${PYTHON:-python3}
BUDGET=${PDSERVE_CHECK_BUDGET_S:-530}
START=$(date +%s)
FAILED=0
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

step() {   # step NAME LIMIT_S COMMAND...: run it under timeout, record rc and seconds
    local name=$1 limit=$2
    shift 2
    [[ -z $STEPS || $STEPS == *",$name,"* ]] || return 0
    local left=$((BUDGET - ($(date +%s) - START)))
    ((left < limit)) && limit=$left
    if ((limit < 5)); then
        echo "== $name: skipped, the ${BUDGET}s budget is spent"
        printf '%s\tskipped\t0\n' "$name" >> "$OUT/steps.tsv"
        FAILED=1
        return 1
    fi
    echo "== $name (limit ${limit}s): $*"
    local t0 rc
    t0=$(date +%s)
    timeout -k 5 "$limit" "$@"
    rc=$?
    echo "== $name: rc=$rc in $(($(date +%s) - t0))s"
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" >> "$OUT/steps.tsv"
    ((rc == 0)) || FAILED=1
    return $rc
}

cuda_refused() {   # cuda_refused FILE COMMAND...: exits 2 with one line, "pdserve: error: device 'cuda'..."
    local file=$1 rc
    shift
    "$@" > "$file" 2>&1
    rc=$?
    cat "$file"
    [[ $rc == 2 && $(wc -l < "$file") == 1 ]] && grep -q "^pdserve: error: device 'cuda'" "$file"
}
export -f cuda_refused

echo "pdserve device checks: $(date -u +%FT%TZ), repo $REPO, commit" \
     "$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?'), dry run $DRY"

if ((DRY)); then
    # the GPU host has no ray: neither may the checks, here
    NORAY=$(mktemp -d)
    mkdir -p "$NORAY/ray"
    echo 'raise ImportError("ray is not installed on the GPU host (a --dry-run stand-in)")' \
        > "$NORAY/ray/__init__.py"
    export PYTHONPATH=$NORAY${PYTHONPATH:+:$PYTHONPATH}
    FAKE=(--fake --device cpu)
    if [[ -f .whl/SHA256SUMS ]]; then
        step install 60 bash -c 'cd .whl && sha256sum -c SHA256SUMS && for a in *.tar.xz; do
            xz -t "$a" && echo "$a: $(tar -tJf "$a" | wc -l) files"; done &&
            for w in *.whl; do unzip -tq "$w"; done && du -ch . | tail -1'
    else
        echo "== install: no .whl/ here (tools/gpu/build_wheelhouse.sh builds it); skipped"
    fi
    step import 60 "$PY" -c 'import torch, pdserve.kernels.attention as a
try:
    import ray
except ImportError as e:
    print("ray:", e)
else:
    raise SystemExit("ray imported, but the GPU host has none")
print("torch", torch.__version__, "cuda available:", torch.cuda.is_available())'
    step warm 120 bash -c "'$PY' tools/gpu/warm_kernels.py --fake --device cpu \
        --out /tmp/pdserve-warm.json && cat /tmp/pdserve-warm.json"
    step bench-gpu 180 bash -c "'$PY' -m pdserve.cli.main bench gpu --dry-run \
        > '$OUT/bench_gpu.txt' && cat '$OUT/bench_gpu.txt' && cuda_refused /tmp/pdserve-gpu.txt \
        '$PY' -m pdserve.cli.main bench gpu --device cuda"
    step capture-fi 60 bash -c "'$PY' -m pytest -p no:cacheprovider -q -m device -k flashinfer \
        tests/kernels/test_capture_device.py --collect-only && cuda_refused '$OUT/bench_capture.txt' \
        '$PY' -m pdserve.cli.main bench capture --device cuda --attention flashinfer"
    step bench-transfer 60 bash -c 'cuda_refused "$@"' _ "$OUT/bench_transfer.txt" \
        "$PY" -m pdserve.cli.main bench transfer --device cuda
    TRACE=.whl/mooncake-slice.jsonl
    [[ -f $TRACE ]] || TRACE=deploy/demo-trace.jsonl
    step sim 60 env PYTHON="$PY" tools/gpu/sim_check.sh "$OUT/sim.tar.xz" \
        deploy/local-tiny.yaml "$TRACE" 16 512 8
    step capture 60 bash -c "'$PY' -m pytest -p no:cacheprovider -q -m device \
        tests/kernels/test_capture_device.py --collect-only && cuda_refused '$OUT/bench_capture.txt' \
        '$PY' -m pdserve.cli.main bench capture --device cuda"
    step tests 120 "$PY" -m pytest -p no:cacheprovider -q -m device tests/kernels/test_device.py \
        tests/kernels/test_fused_ops.py tests/kernels/models/test_mla_flashinfer.py \
        tests/kernels/models/test_experts_paths.py --collect-only
    step per-row 180 "$PY" tools/gpu/per_row_check.py "${FAKE[@]}" --quick \
        --out "$OUT/per_row.json"
    step bench-llm 60 bash -c 'cuda_refused "$@"' _ /tmp/pdserve-llm.txt \
        "$PY" -m pdserve.cli.main bench llm --device cuda
else
    SITE=${PDSERVE_SITE:-/tmp/site}
    export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/pdserve-flashinfer}
    # four modules build at once (warm_kernels.py): a few nvcc each, not one a core each
    export MAX_JOBS=${MAX_JOBS:-5}
    if [[ -z ${CUDA_HOME:-} ]] && command -v nvcc > /dev/null; then
        CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")
        export CUDA_HOME
    fi
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    step install 60 bash -c "set -e; cd .whl; sha256sum -c SHA256SUMS; mkdir -p '$SITE'
        '$PY' -m pip install -q --no-index --no-deps --no-compile --target '$SITE' *.whl
        for a in *.tar.xz; do [[ \$a == flashinfer-jit.tar.xz ]] || tar -xJf \"\$a\" -C '$SITE'; done
        ln -sfn '$REPO/src/pdserve' '$SITE/pdserve'
        if [[ -f flashinfer-jit.tar.xz ]]; then    # a past run's kept modules: loaded as AOT
            rm -rf /tmp/pdserve-jit; mkdir -p /tmp/pdserve-jit
            tar -xJf flashinfer-jit.tar.xz -C /tmp/pdserve-jit
            for so in \$(find /tmp/pdserve-jit -name '*.so'); do n=\$(basename \$so .so)
                mkdir -p '$SITE'/flashinfer/data/aot/\$n && cp \$so '$SITE'/flashinfer/data/aot/\$n/
                echo \"kept module \$n\"; done
        fi
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
        nvcc --version | tail -2 || true" || { echo "install failed: nothing else can run"; exit 1; }
    step import 60 "$PY" -c 'import sys, torch
assert torch.cuda.is_available(), "torch sees no GPU"
print(sys.version.split()[0], "torch", torch.__version__, torch.version.cuda,
      torch.cuda.get_device_name(0), "sm%d%d" % torch.cuda.get_device_capability(0))
import flashinfer, nixl, pdserve
print("flashinfer", flashinfer.__version__, "nixl", nixl.__file__, "pdserve", pdserve.__file__)'
    step warm 240 bash -c "'$PY' tools/gpu/warm_kernels.py --out /tmp/pdserve-warm.json;
        r=\$?; cat /tmp/pdserve-warm.json; exit \$r"
    step keep 30 bash -c "cd '$FLASHINFER_WORKSPACE_BASE' && find . -name '*.so' -printf '%s %p\n' &&
        find . -name '*.so' -print0 | tar -cf - --null -T - | xz -T0 -6 > '$OUT/flashinfer-jit.tar.xz' &&
        ls -l '$OUT/flashinfer-jit.tar.xz' &&
        if (( \$(stat -c %s '$OUT/flashinfer-jit.tar.xz') > 15 * 1048576 )); then
            echo 'over 15 MiB: not kept'; rm '$OUT/flashinfer-jit.tar.xz'; fi"
    step bench-gpu 300 bash -c "set -o pipefail; '$PY' -m pdserve.cli.main bench gpu \
        --peer-batches 1 8 2>&1 | tee '$OUT/bench_gpu.txt'"
    step capture-fi 120 bash -c "set -o pipefail; '$PY' -m pytest -p no:cacheprovider -m device \
        -rA -s -k flashinfer tests/kernels/test_capture_device.py; t=\$?; '$PY' -m pdserve.cli.main \
        bench capture --device cuda --attention flashinfer --dtype bfloat16 \
        --models smollm2-135m llama-110m 2>&1 | tee '$OUT/bench_capture.txt'; b=\$?; exit \$((t || b))"
    step bench-transfer 60 bash -c "'$PY' -m pdserve.cli.main bench transfer --device cuda \
        2>&1 | tee '$OUT/bench_transfer.txt'"
    step sim 240 env PYTHON="$PY" tools/gpu/sim_check.sh "$OUT/sim.tar.xz" \
        deploy/gpu-llama3-8b-random.yaml .whl/mooncake-slice.jsonl
    step capture 150 bash -c "set -o pipefail; '$PY' -m pytest -p no:cacheprovider -m device \
        -rA -s -k 'not flashinfer' tests/kernels/test_capture_device.py; t=\$?; '$PY' -m \
        pdserve.cli.main bench capture --device cuda 2>&1 | tee -a '$OUT/bench_capture.txt'
        b=\$?; exit \$((t || b))"
    step tests 150 "$PY" -m pytest -p no:cacheprovider -m device tests/kernels/test_device.py \
        tests/kernels/test_fused_ops.py tests/kernels/models/test_mla_flashinfer.py \
        tests/kernels/models/test_experts_paths.py -rA
    step per-row 60 "$PY" tools/gpu/per_row_check.py --out "$OUT/per_row.json"
    step bench-llm 90 bash -c "'$PY' -m pdserve.cli.main bench llm --device cuda \
        --models llama-110m --dtype bfloat16 float32 --workload uniform --batches 1 8 32 \
        --capture auto off"
fi

echo "== steps (name, rc, seconds), $(($(date +%s) - START))s in all:"
cat "$OUT/steps.tsv"
exit $FAILED
