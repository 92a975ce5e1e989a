#!/usr/bin/env bash
# Prepared GPU check: everything the project must show on a CUDA machine, in one run of < 8 minutes
# on a fresh H200 (Python 3.12, torch and transformers preinstalled, no network).
#
#   1. install      the package with `pip install --no-deps --target` (pydantic and its deps from
#                   bench/wheels/ when the image lacks them; nothing is downloaded)
#   2. info         versions, GPU, graph API
#   3. parity       graph vs eager tokens identical, engine path and rollout path, greedy and sampled,
#                   tiny gpt2/opt/llama/qwen2 + the gpt2 (124M) shape, fp16      -> exits 1 on a mismatch
#   4. decode       `bench decode` for the gpt2 and opt-1.3b shapes, fp16, batch 1,4,8,16,32,
#                   256-token prompt, 128 new tokens
#   5. continuous   `bench continuous`, gpt2 shape, fp16
#   6. rlhf         `bench rlhf`, opt-1.3b shape, batch 8, fp16
# Reports: every step's text log, JSON and (when matplotlib is there) PNG go to a work folder
# ($GPU_CHECK_WORK, default /tmp/gpu_check_work), which is packed into $OUT/gpu_check_results.tgz
# after every step (so a run cut short still returns what it did); the JSON files and summary.txt
# (step statuses and times) are also copied to $OUT itself. $OUT defaults to bench/results/gpu_check.
# The steps share one time budget ($GPU_CHECK_BUDGET_S, default 470 s): each step's limit is cut to
# what is left of it, so the whole run stays under 8 minutes.
#
# Usage:
#   bench/gpu_check.sh              the real run (needs a CUDA device)
#   bench/gpu_check.sh --dry-run    print the steps and the exact commands, run nothing
#   bench/gpu_check.sh --cpu-mini   the same steps on CPU with tiny models and tiny sizes (checks the script)
#
# The pydantic wheels are not in git (bench/wheels/ is ignored). Fetch them once, on a machine with
# network access, from the repository root:
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d bench/wheels pydantic
# and carry bench/wheels along (the device tool: carry=["bench/wheels"]).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"

MODE=gpu
case "${1:-}" in
  --dry-run) MODE=dry ;;
  --cpu-mini) MODE=mini ;;
  "") ;;
  *) echo "usage: $0 [--dry-run|--cpu-mini]" >&2; exit 2 ;;
esac

OUT="${OUT:-$REPO/bench/results/gpu_check}"
WORK="${GPU_CHECK_WORK:-/tmp/gpu_check_work}"
BUDGET="${GPU_CHECK_BUDGET_S:-470}"
PY="${PYTHON:-python3}"
TARGET="${HYBRID_ENGINE_TARGET:-/tmp/hybrid-engine-site}"
WHEELS="$REPO/bench/wheels"
START=$(date +%s)
FAILED=0
if [ "$MODE" != dry ]; then
  mkdir -p "$OUT" "$WORK"
  rm -f "$WORK"/*
fi
SUMMARY="$WORK/summary.txt"

if [ "$MODE" = mini ]; then
  DEVICE=cpu
  DTYPE=fp32
  PARITY_ARGS="--models tiny-gpt2,tiny-llama --batch-size 2 --prompt-len 8 --new-tokens 6"
  DECODE_A="--model tiny-gpt2 --batch-sizes 1,2 --prompt-len 16 --new-tokens 8 --repeats 1"
  DECODE_B="--model tiny-opt --batch-sizes 1,2 --prompt-len 16 --new-tokens 8 --repeats 1"
  CONT_ARGS="--model tiny-gpt2 --prompt-len 8 --new-tokens 8 --measured 2 --mixed-requests 6 --mixed-max-batch 2 --mixed-max-new 8 --mixed-prompt-len 8 --mixed-repeats 1"
  RLHF_ARGS="--model tiny-opt --batch-size 2 --prompt-len 16 --new-tokens 8 --warmup 1 --iterations 1"
else
  DEVICE=cuda
  DTYPE=fp16
  PARITY_ARGS="--models tiny-gpt2,tiny-opt,tiny-llama,tiny-qwen2,gpt2 --batch-size 4 --prompt-len 32 --new-tokens 32"
  DECODE_A="--model gpt2 --batch-sizes 1,4,8,16,32 --prompt-len 256 --new-tokens 128 --repeats 2"
  DECODE_B="--model opt-1.3b --batch-sizes 1,4,8,16,32 --prompt-len 256 --new-tokens 128 --repeats 1"
  CONT_ARGS="--model gpt2 --prompt-len 32 --new-tokens 32 --warmup 2 --measured 5 --mixed-requests 64 --mixed-max-batch 16 --mixed-max-new 128 --mixed-prompt-len 64"
  RLHF_ARGS="--model opt-1.3b --batch-size 8 --prompt-len 256 --new-tokens 128 --warmup 1 --iterations 4"
fi
COMMON="--device $DEVICE --dtype $DTYPE"

say() { echo "[gpu_check $(($(date +%s) - START))s] $*" | tee -a "$SUMMARY"; }

# pack: what the device returns (at most 8 files): summary, JSON files, and one tarball of everything.
pack() {
  cp -f "$SUMMARY" "$WORK"/*.json "$OUT"/ 2>/dev/null
  tar czf "$OUT/gpu_check_results.tgz" -C "$WORK" . 2>/dev/null
  return 0
}

# step NAME TIMEOUT_S COMMAND...: runs with a time limit, logs to $OUT/NAME.log, records the status.
step() {
  local name="$1" limit="$2"
  shift 2
  if [ "$MODE" = dry ]; then
    echo "step $name (limit ${limit}s): $*"
    return 0
  fi
  local left=$((BUDGET - ($(date +%s) - START)))
  if [ $left -lt 20 ]; then
    say "step $name: SKIPPED (time budget of ${BUDGET}s spent)"
    FAILED=1
    return 0
  fi
  [ $limit -gt $left ] && limit=$left
  say "step $name (limit ${limit}s): $*"
  timeout "$limit" "$@" >"$WORK/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$WORK/$name.log"
  if [ $rc -eq 0 ]; then
    say "step $name: ok"
  else
    [ $rc -eq 124 ] && say "step $name: TIMED OUT after ${limit}s" || say "step $name: FAILED (exit $rc)"
    FAILED=1
  fi
  pack
  return 0
}

# ---------------------------------------------------------------- 1. install
install() {
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" || {
    echo "torch and transformers must be installed in $PY"; return 1; }
  mkdir -p "$TARGET"
  if ! "$PY" -c "import pydantic" 2>/dev/null; then
    if ! ls "$WHEELS"/pydantic-*.whl >/dev/null 2>&1; then
      echo "pydantic is missing and $WHEELS holds no wheels; fetch them (see the header of $0)"
      return 1
    fi
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" --target "$TARGET" pydantic || return 1
  fi
  # --no-build-isolation: the build backend (setuptools) comes from the image, not the network.
  if ! "$PY" -m pip install -q --no-deps --no-index --no-build-isolation --target "$TARGET" "$REPO"; then
    # Every step runs `python -m hybrid_engine` from the repository root, which imports the
    # source tree anyway; the install only proves the package installs.
    echo "pip could not build the package here (no setuptools?); the steps run from the source tree"
  fi
  PYTHONPATH="$TARGET" "$PY" -c "import hybrid_engine, pydantic; print('hybrid_engine from', hybrid_engine.__file__, '; pydantic', pydantic.VERSION)"
}

if [ "$MODE" = dry ]; then
  echo "mode: dry run (nothing is executed); OUT=$OUT PYTHON=$PY target=$TARGET"
  echo "step install: pip install --no-deps --no-index --no-build-isolation --target $TARGET $REPO (+ pydantic from $WHEELS if missing)"
else
  say "mode $MODE, OUT=$OUT"
  if [ "$MODE" = mini ] && [ -z "${GPU_CHECK_FORCE_INSTALL:-}" ] && "$PY" -c "import hybrid_engine, pydantic" 2>/dev/null; then
    say "step install: skipped (--cpu-mini and hybrid_engine already importable)"
  else
    install >"$WORK/install.log" 2>&1
    rc=$?
    cat "$WORK/install.log"
    [ $rc -eq 0 ] || { say "step install: FAILED"; pack; exit 1; }
    say "step install: ok"
  fi
  export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
fi

HE=("$PY" -m hybrid_engine)
PLOT_OK=0
[ "$MODE" != dry ] && "$PY" -c "import matplotlib" 2>/dev/null && PLOT_OK=1
plot() { [ $PLOT_OK -eq 1 ] && echo "--plot $WORK/$1.png"; }

# ------------------------------------------------------------------ 2.-6.
if [ "$MODE" != dry ] && command -v nvidia-smi >/dev/null; then nvidia-smi >"$WORK/nvidia-smi.txt" 2>&1; fi
step info 60 "${HE[@]}" info
step parity 90 "${HE[@]}" bench parity $COMMON $PARITY_ARGS --json "$WORK/parity.json"
step decode_gpt2 100 "${HE[@]}" bench decode $COMMON $DECODE_A --json "$WORK/decode_gpt2.json" $(plot decode_gpt2)
step continuous 50 "${HE[@]}" bench continuous $COMMON $CONT_ARGS --json "$WORK/continuous.json" $(plot continuous)
step rlhf_opt13b 90 "${HE[@]}" bench rlhf $COMMON $RLHF_ARGS --json "$WORK/rlhf_opt13b.json" $(plot rlhf_opt13b)
step decode_opt13b 150 "${HE[@]}" bench decode $COMMON $DECODE_B --json "$WORK/decode_opt13b.json"

[ "$MODE" = dry ] && exit 0
say "done in $(($(date +%s) - START))s; $([ $FAILED -eq 0 ] && echo 'all steps ok' || echo 'SOME STEPS FAILED')"
pack
exit $FAILED
