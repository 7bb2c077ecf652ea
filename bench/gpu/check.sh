#!/usr/bin/env bash
# The device check: every GPU figure of the project in one command that fits a short lease of one GPU.
#
#   OUT=results-dir bash bench/gpu/check.sh            # on a machine with a CUDA GPU (about 7 minutes on an H100)
#   bash bench/gpu/check.sh --dry-run                  # anywhere: the same parts on CPU, tiny sizes
#
# Parts, most valuable first, each under its own time limit and the whole under CHECK_BUDGET_S (default 470 s):
#   health    real NVML checks, no nvidia-smi              bench/gpu/health.py
#   staging   CUDA save staging and restore onto the GPU   bench/gpu/staging.py
#   pytest    the CUDA-only tests (tests/gpu), fork server   python -m pytest tests/gpu ...
#   interference  background checkpoints beside GPU         bench/interference.py --device cuda
#             training: overhead per tier, every 1 and 10 steps
#   restart   kill -> first step, eager and compiled,      bench/gpu/restart.py
#             resilient-run against torchrun
#   titan     recipes/torchtitan's test on the GPU         tests/recipes/test_torchtitan.py
# A part that fails or runs out of time is recorded as such and the rest still run. What it writes under $OUT:
# gpu-<card>.json (every part's figures, the card, driver and torch version) and check.log (every part's output).
#
# Dependencies: the machine's own torch (a CUDA build) is used as it is. Missing needs of ours (crc32c,
# zstandard; isal, a speed-up with a fallback) and torchtitan's are installed into a private directory: from wheels
# in $CHECK_WHEELS (and $TITAN_WHEELS) where given (machines without network), else from the package registries.
# torchtitan's test also needs TORCHTITAN_ROOT: a directory with its tests/assets (tokenizer, c4_test).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD

DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
BUDGET=${CHECK_BUDGET_S:-470}
PARTS=${CHECK_PARTS:-health staging pytest restart interference titan}  # a rerun of some parts: CHECK_PARTS="restart titan"
mkdir -p "$OUT"
WORK=$(mktemp -d)
LOG="$OUT/check.log"
: >"$LOG"
START=$(date +%s)

say() { echo "[check $(($(date +%s) - START))s] $*" | tee -a "$LOG"; }

# part NAME LIMIT_S COMMAND...: runs COMMAND under `timeout`, unless fewer than LIMIT_S seconds of the whole
# budget are left (a part cut short measures nothing); writes WORK/NAME.status for the summary
part() {
  local name=$1 limit=$2
  shift 2
  if [[ " $PARTS " != *" $name "* ]]; then
    echo "{\"status\": \"skipped\", \"reason\": \"not in CHECK_PARTS\"}" >"$WORK/$name.status"
    return
  fi
  local left=$((BUDGET - ($(date +%s) - START)))
  if ((DRY == 0 && left < limit)); then
    say "$name: skipped ($left s of the budget left, it needs $limit s)"
    echo "{\"status\": \"skipped\", \"reason\": \"out of budget: $left s left, needs $limit s\"}" >"$WORK/$name.status"
    return
  fi
  say "$name: start (limit $limit s)"
  local t0=$EPOCHREALTIME rc=0
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1 || rc=$?
  local dt
  dt=$(awk "BEGIN {printf \"%.1f\", $EPOCHREALTIME - $t0}")
  local status=ok
  ((rc == 124 || rc == 137)) && status=timeout
  ((rc != 0 && rc != 124 && rc != 137)) && status=failed
  say "$name: $status (rc $rc, ${dt} s)"
  echo "{\"status\": \"$status\", \"rc\": $rc, \"seconds\": $dt}" >"$WORK/$name.status"
  # the summary so far, so that a check cut short by its lease still brings back what it measured
  "$PY" bench/gpu/summary.py --merge "$WORK" --out "$OUT" >/dev/null 2>&1 || true
}

SITE="$WORK/site"
install_into() {  # install_into DIR WHEEL_DIR PACKAGES...: wheels where given, else the registries
  local dir=$1 wheels=$2
  shift 2
  if [[ -n "$wheels" && -d "$wheels" ]]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$dir" "$wheels"/*.whl
  else
    "$PY" -m pip install -q --no-compile --target "$dir" "$@"
  fi
}

say "out: $OUT; python: $PY; dry run: $DRY; budget: $BUDGET s"
if ((DRY == 0)); then
  if ! "$PY" -c "import crc32c, zstandard, isal" 2>/dev/null; then
    install_into "$SITE" "${CHECK_WHEELS:-}" crc32c zstandard isal >>"$LOG" 2>&1 || say "installing crc32c, zstandard, isal failed"
  fi
fi
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" bench/gpu/summary.py --env "$WORK/env.json" >>"$LOG" 2>&1 || say "reading the machine failed"

DRYFLAG=()
((DRY)) && DRYFLAG=(--dry-run)
part health 30 "$PY" bench/gpu/health.py --out "$WORK" "${DRYFLAG[@]}"
part staging 150 "$PY" bench/gpu/staging.py --out "$WORK" "${DRYFLAG[@]}"
# tests/gpu, and the fork-server test that can only fail where CUDA libraries exist
# (CHECK_PYTEST: other test ids, for a rerun of some). A dry run leaves out the fork-server test: on CPU it is the
# suite's own, and `make test` runs it already.
DEFAULT_TESTS="tests/gpu"
((DRY)) || DEFAULT_TESTS+=" tests/launcher/test_fork_server_no_cuda.py::test_the_fork_server_after_preloading_torch_maps_no_cuda_or_nvml_library"
read -ra TESTS <<<"${CHECK_PYTEST:-$DEFAULT_TESTS}"
part pytest 150 "$PY" -m pytest -q -rs -p no:cacheprovider --timeout 80 --junitxml "$WORK/pytest.xml" "${TESTS[@]}"
# the GPT recipe's 4x256 model (37 MiB of state a rank), two ranks on the one GPU over gloo: about 70-100 s on an H200
if ((DRY)); then
  INTERF=(--device cpu --world 1 --tiers local --reps 1 --steps 2 --warmup 1 --intervals 1 --n-layer 1 --d-model 32
    --batch 2)
else
  INTERF=(--device cuda --reps 3 --steps 30 --intervals 1,10 --n-layer 4 --d-model 256 --batch 16)
fi
part interference 120 "$PY" bench/interference.py --writers record --levers 0 "${INTERF[@]}" \
  --out "$WORK/interference.json"
# after the interference part: the restarts take 125-155 s and were measured on three leases already
part restart 200 "$PY" bench/gpu/restart.py --out "$WORK" "${DRYFLAG[@]}"

if ((DRY == 0)) && [[ -n "${TORCHTITAN_ROOT:-}" && " $PARTS " == *" titan "* ]]; then
  TITAN="$WORK/titan-site"
  if ! "$PY" -c "import torchtitan" 2>/dev/null; then
    install_into "$TITAN" "${TITAN_WHEELS:-}" torchtitan==0.3.0 >>"$LOG" 2>&1 || say "installing torchtitan failed"
  fi
  # torchtitan's own dependencies first on the path (its datasets pins an older fsspec), ours after
  PYTHONPATH="$TITAN:$PYTHONPATH" HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 \
    part titan "${CHECK_TITAN_S:-130}" "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml "$WORK/titan.xml" tests/recipes/test_torchtitan.py
else
  say "titan: skipped (dry run, not in CHECK_PARTS, or TORCHTITAN_ROOT unset)"
  echo '{"status": "skipped", "reason": "dry run, not in CHECK_PARTS, or no TORCHTITAN_ROOT (a directory with torchtitan tests/assets)"}' \
    >"$WORK/titan.status"
fi

"$PY" bench/gpu/summary.py --merge "$WORK" --out "$OUT" --log "$LOG" | tee -a "$LOG"
rc=${PIPESTATUS[0]}
say "done in $(($(date +%s) - START)) s"
rm -rf "$WORK"
exit "$rc"
