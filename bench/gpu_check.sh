#!/usr/bin/env bash
# One CUDA GPU, sized to finish in 8 minutes: what a CPU-only run cannot show, as one table.
#
#   bash bench/gpu_check.sh            # from anywhere, with the repository's .venv set up
#
# 1. tests that run at world size 1 and take the accelerator when there is one
#    (tests/unit: the plain-python world-size-1 training of every stage, the fused
#    optimizer choice, the environment report);
# 2. bench/gpu_check.py: every stage, optimizer and parameter offload (pinned memory,
#    non_blocking copies) and bf16 trained on the GPU against a plain copy of the model
#    (NCCL process group of one), then each stage's step time and peak allocated memory
#    beside the ZeRO formula;
# 3. bench/step_time.py at world size 1, DDP and zerodp stages 0-3, small model;
# 4. bench/offload.py at world size 1: the offload overlap bench (host step share).
#
# Exits 2 at once, saying so, when there is no CUDA device; 1 when any check failed.
# Each part has its own time limit (100+150+80+110 s, 10 s grace each: 8 minutes at most),
# so a hang costs a row, not the table. docs/performance.md lists the CUDA-only code paths these exercise.
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
TORCHRUN=${TORCHRUN:-.venv/bin/torchrun}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check.sh: no CUDA device visible to $PY (torch.cuda.is_available() is False);" \
        "this check needs one NVIDIA GPU" >&2
    exit 2
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
ROWS=$WORK/rows.tsv
: >"$ROWS"
START=$(date +%s)

row() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$ROWS"; }

# part SLUG LABEL SECONDS COMMAND...: run it under a time limit into $WORK/SLUG.log, then
# add a row with the outcome and the log's last line (the log's tail on stderr if not ok).
part() {
    local slug=$1 label=$2 limit=$3
    shift 3
    local log=$WORK/$slug.log t0 rc result=ok last
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    rc=$?
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        result=TIMEOUT
    elif [ $rc -ne 0 ]; then
        result=FAIL
    fi
    last=$(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | cut -c1-150)
    row "$label" "$result" "rc $rc, $(($(date +%s) - t0)) s: $last"
    if [ "$result" != ok ]; then
        echo "---- $label: last lines ----" >&2
        tail -n 30 "$log" >&2
    fi
}

"$PY" -c 'import torch; print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| CUDA", torch.version.cuda)'

part pytest "pytest tests/unit (world size 1, on the GPU)" 100 \
    "$PY" -m pytest -q -x -p no:cacheprovider tests/unit

# gpu_check.py adds its own rows, one per check; this row says whether it ran to the end.
part gpu_check "bench/gpu_check.py (the rows above it)" 150 \
    "$TORCHRUN" --standalone --nproc_per_node 1 bench/gpu_check.py --rows "$ROWS"

part step_time "step_time.py, world size 1, small: ddp, zerodp 0-3" 80 \
    "$TORCHRUN" --standalone --nproc_per_node 1 bench/step_time.py --models small \
    --engines ddp,zerodp --steps 5 --repeats 3 --json "$WORK/step_time.json"
if [ -s "$WORK/step_time.json" ]; then
    "$PY" - "$WORK/step_time.json" >>"$ROWS" <<'PYEOF'
import json
import sys

for r in json.load(open(sys.argv[1])):
    ratio, state = r.get("ratio_median"), r.get("model_state_bytes")
    detail = f"median {r['median_s'] * 1e3:.2f} ms" + (f", {ratio:.2f}x DDP" if ratio else "")
    if state:
        ideal = r["ideal_model_state_bytes"]
        detail += f"; model states {state / 2**20:.1f} MiB, ZeRO formula {ideal / 2**20:.1f} MiB"
    print(f"  step_time {r['engine']} stage {r['stage']}\tinfo\t{detail}")
PYEOF
fi

part offload "offload.py, world size 1, small, stages 2-3 (offload overlap)" 110 \
    "$TORCHRUN" --standalone --nproc_per_node 1 bench/offload.py --model small --stages 2,3 \
    --steps 3 --repeats 2

echo
echo "gpu_check: $(($(date +%s) - START)) s"
"$PY" - "$ROWS" <<'PYEOF'
import sys

rows = [line.rstrip("\n").split("\t", 2) for line in open(sys.argv[1]) if line.strip()]
width = max(len(r[0]) for r in rows)
print(f"{'check':<{width}}  result   detail")
print(f"{'-' * width}  -------  {'-' * 40}")
for name, result, detail in rows:
    print(f"{name:<{width}}  {result:<7}  {detail}")
bad = [r for r in rows if r[1] not in ("ok", "info")]
print(f"\n{len(rows) - len(bad)} of {len(rows)} rows ok" + (f"; FAILED: {len(bad)}" if bad else ""))
PYEOF
echo
echo "offload.py's table (host step: share of the step in the host optimizer step):"
grep ' | ' "$WORK/offload.log" | sed 's/^/    /'
! grep -qP '\t(FAIL|TIMEOUT)\t' "$ROWS"
