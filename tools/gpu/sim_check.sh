#!/usr/bin/env bash
# The simulator against the real engine on one device, without Ray (issue 54):
# calibrate a cost profile on CONFIG's engine, then replay TRACE's first
# requests on the same engine in process and simulate them with that profile
# (pdserve bench sim-accuracy --in-process). From the repository root:
#
#   tools/gpu/sim_check.sh OUT.tar.xz CONFIG TRACE [REQUESTS PROMPT_LEN MAX_TOKENS]
#
# Defaults 32 requests, prompts cut at 2,048 tokens, 64 new tokens each. The
# archive holds profile.yaml, calibrate.txt, sim_accuracy.json and
# sim_accuracy.txt, whatever of them was written, even when a command failed.
# Back here, `pdserve bench sim-accuracy --replay sim_accuracy.json --profile
# profile.yaml` simulates the same runs again, and `pdserve plan --profile
# profile.yaml` asks where P/D beats fused on that card (docs/operations.md).
set -uo pipefail
[[ $# -ge 3 ]] || { sed -n '2,14p' "$0" >&2; exit 2; }
ARCHIVE=$1 CONFIG=$2 TRACE=$3 N=${4:-32} PROMPT=${5:-2048} NEW=${6:-64}
PY=${PYTHON:-python3}
D=$(mktemp -d)
trap 'tar -C "$D" -cJf "$ARCHIVE" . ; rm -rf "$D"' EXIT

"$PY" -m pdserve.cli.main calibrate --config "$CONFIG" --contexts 256 1024 "$PROMPT" \
    --out "$D/profile.yaml" 2>&1 | tee "$D/calibrate.txt" || exit 1
"$PY" -m pdserve.cli.main bench sim-accuracy --config "$CONFIG" --profile "$D/profile.yaml" \
    --in-process --trace "$TRACE" --requests "$N" --alone 8 --prompt-len "$PROMPT" \
    --max-tokens "$NEW" --out "$D/sim_accuracy.json" 2>&1 | tee "$D/sim_accuracy.txt"
