#!/usr/bin/env bash
# Prepared GPU check: everything the project must show on a CUDA machine, in one run of < 8 minutes
# on a fresh H200 (Python 3.12, torch and transformers preinstalled, no network).
#
#   1. install      the package with `pip install --no-deps --target` (pydantic and its deps from
#                   bench/wheels/ when the image lacks them; nothing is downloaded)
#   2. info         versions, GPU, graph API
#   3. parity       graph vs eager tokens identical, engine path and rollout path, greedy and sampled,
#                   tiny gpt2/opt/llama/qwen2 + the gpt2 (124M) shape, fp16      -> exits 1 on a mismatch
#   3a. kernel_check  `bench kernels --check`: every decode custom op (paged attention, layer ops, sampler,
#                   bookkeeping) through the implementation its probe chose on the GPU, against its reference
#                   at Qwen2.5-0.5B widths, 64 rows, 2k span, fp16                   -> exits 1 on a mismatch
#   3a'. sampler_check  bench/sampler_check.py: hybrid_engine::sample_rows' sort-free Triton kernel on the GPU:
#                   its uniform's bits, every draw the exact inverse CDF of the filtered distribution (vocab
#                   151936, bf16), chi-square, non-finite rows, kernel vs reference time -> exits 1 on a failure
#   3b. capture_faults  bench/capture_faults.py: failed captures (a host-reading hook, model code that syncs,
#                   ten failures in a row) leave the allocator out of capture mode (no pool left recording,
#                   empty_cache frees, the pools hold 0 bytes) and graphs capture again; two models in two
#                   threads capturing at every call get exact tokens                -> exits 1 otherwise
#   4. decode       `bench decode` for the gpt2 shape, fp16, batch 1,4,8,16,32, 256-token prompt,
#                   128 new tokens; engine path and rollout path
#   5. continuous   `bench continuous`, gpt2 shape, fp16: batch-1 graph reuse, the mixed-length workload,
#                   and the long-tailed workload (8 slots, one request in 8 wants 48 tokens, the rest 3-6;
#                   continuous vs static batching side by side: decode steps, prefills, host syncs, wall)
#   6. rlhf         `bench rlhf`, opt-1.3b shape, batch 8, fp16 (captures and capture time per iteration)
#   6b. handoff     `bench handoff`, gpt2 shape, fp16, 1 GiB K/V pool: an RL loop with and without
#                   sleep_between_phases, mem_get_info per phase, sleep/wake times, captures, identical
#                   tokens and losses (no VMM allocator yet: the pool is dropped and recaptured on CUDA)
#   6c. decode_qwen05b  issue 40's shape: a Qwen2.5-0.5B-shaped model, fp16, 64 rows x 2k span (1,984-token
#                   prompts, 64 new tokens), ms per decode step with the prefill left out (--per-step):
#                   engine eager and graphs next to transformers' generate on the same GPU
#   7. decode       the same for the opt-1.3b shape at batch 1, 8 and 32 (last: it gets what is left of the budget)
# After the steps, headlines.txt (also appended to summary.txt) lists the figures to read first
# (parity, long-tail step and wall ratios, rlhf captures per iteration), taken from the JSON files.
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
#   bench/gpu_check.sh --fetch-wheels
#                                   here, before the device run: download pydantic and its dependencies
#                                   for the GPU image's Python ($GPU_PYTHON_VERSION, default 3.12) into
#                                   bench/wheels/, which is git-ignored: carry it along (the device tool:
#                                   carry=["bench/wheels"]); a fresh work tree has to fetch again
# The real run and the dry run refuse at once, with one line and exit 3, while bench/wheels/ (or
# $GPU_CHECK_WHEELS) holds no pydantic wheel: run the dry run here first, and a device run never spends
# its start-up on that failure.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"

MODE=gpu
case "${1:-}" in
  --dry-run) MODE=dry ;;
  --cpu-mini) MODE=mini ;;
  --fetch-wheels) MODE=fetch ;;
  "") ;;
  *) echo "usage: $0 [--dry-run|--cpu-mini|--fetch-wheels]" >&2; exit 2 ;;
esac

OUT="${OUT:-$REPO/bench/results/gpu_check}"
WORK="${GPU_CHECK_WORK:-/tmp/gpu_check_work}"
BUDGET="${GPU_CHECK_BUDGET_S:-470}"
# $PYTHON, else (--cpu-mini and --fetch-wheels) the checkout's .venv, else python3 (the GPU image's).
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ "$MODE" = mini ] || [ "$MODE" = fetch ] && [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"
else PY=python3; fi
TARGET="${HYBRID_ENGINE_TARGET:-/tmp/hybrid-engine-site}"
WHEELS="${GPU_CHECK_WHEELS:-$REPO/bench/wheels}"
if { [ "$MODE" = gpu ] || [ "$MODE" = dry ]; } && ! ls "$WHEELS"/pydantic-*.whl >/dev/null 2>&1; then
  echo "gpu_check: $WHEELS holds no pydantic wheel: run bench/gpu_check.sh --fetch-wheels here first, then carry=[\"bench/wheels\"] to the device" >&2
  exit 3
fi
if [ "$MODE" = fetch ]; then
  "$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: \
    --python-version "${GPU_PYTHON_VERSION:-3.12}" --platform manylinux2014_x86_64 -d "$WHEELS" pydantic || exit 1
  ls "$WHEELS"
  echo "now run bench/gpu_check.sh on the device with carry=[\"bench/wheels\"]"
  exit 0
fi
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
  CONT_ARGS="--model tiny-gpt2 --prompt-len 8 --new-tokens 8 --measured 2 --mixed-requests 6 --mixed-max-batch 2 --mixed-max-new 8 --mixed-prompt-len 8 --mixed-repeats 1 --longtail-requests 64 --longtail-prompt-len 8 --longtail-repeats 1"
  RLHF_ARGS="--model tiny-opt --batch-size 2 --prompt-len 16 --new-tokens 8 --warmup 1 --iterations 1"
  FAULT_ARGS="--rounds 2"
  HANDOFF_ARGS="--model tiny-llama --iterations 2 --kv-cache-mb 64"
  QWEN_ARGS="--model tiny-qwen2 --batch-sizes 4 --prompt-len 24 --new-tokens 8 --repeats 1"
  SAMPLER=(env TRITON_INTERPRET=1 "$PY" -m bench.sampler_check --cpu-mini)  # the kernel on Triton's interpreter
else
  DEVICE=cuda
  DTYPE=fp16
  PARITY_ARGS="--models tiny-gpt2,tiny-opt,tiny-llama,tiny-qwen2,gpt2 --batch-size 4 --prompt-len 32 --new-tokens 32"
  DECODE_A="--model gpt2 --batch-sizes 1,4,8,16,32 --prompt-len 256 --new-tokens 128 --repeats 2"
  # Last, on what is left of the budget (its JSON is written at its end): three batch sizes, not five.
  DECODE_B="--model opt-1.3b --batch-sizes 1,8,32 --prompt-len 256 --new-tokens 128 --repeats 1"
  CONT_ARGS="--model gpt2 --prompt-len 32 --new-tokens 32 --warmup 2 --measured 5 --mixed-requests 64 --mixed-max-batch 16 --mixed-max-new 128 --mixed-prompt-len 64 --longtail-requests 64 --longtail-slots 8 --longtail-long 48 --longtail-short 3,6 --longtail-repeats 3 --longtail-model same"
  RLHF_ARGS="--model opt-1.3b --batch-size 8 --prompt-len 256 --new-tokens 128 --warmup 1 --iterations 4"
  FAULT_ARGS="--rounds 6"
  HANDOFF_ARGS="--model gpt2 --iterations 3 --batch-size 8 --samples 4 --new-tokens 32 --kv-cache-mb 1024"
  # Issue 40's shape: a Qwen2.5-0.5B-shaped model, 64 rows x 2k span, decode steps alone, next to transformers.
  QWEN_ARGS="--model qwen2.5-0.5b --batch-sizes 64 --prompt-len 1984 --new-tokens 64 --repeats 1"
  SAMPLER=("$PY" -m bench.sampler_check)
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
  # The default target is this script's own: start it empty, so no package of an earlier run (another
  # Python's pydantic_core, say) shadows what this Python needs.
  [ -z "${HYBRID_ENGINE_TARGET:-}" ] && rm -rf "$TARGET"
  mkdir -p "$TARGET"
  # pydantic 2 (a 1.x in the image would import, then fail on the v2 API the config uses).
  if ! "$PY" -c "import pydantic, sys; sys.exit(int(pydantic.VERSION.split('.')[0]) < 2)" 2>/dev/null; then
    if ! ls "$WHEELS"/pydantic-*.whl >/dev/null 2>&1; then
      echo "pydantic 2 is missing and $WHEELS holds no wheels; fetch them (see the header of $0)"
      return 1
    fi
    if ! "$PY" -m pip install -q --no-index --find-links "$WHEELS" --target "$TARGET" pydantic; then
      # No pip in the image: a wheel is a zip archive laid out as site-packages wants it.
      echo "pip could not install the wheels; unpacking them into $TARGET instead"
      for whl in "$WHEELS"/*.whl; do "$PY" -m zipfile -e "$whl" "$TARGET" || return 1; done
    fi
  fi
  # --no-build-isolation: the build backend (setuptools) comes from the image, not the network.
  # Every step runs `python -m hybrid_engine` from the repository root, which imports the source tree
  # anyway; the install proves the package installs, checked from outside the tree.
  local from=/
  if ! "$PY" -m pip install -q --no-deps --no-index --no-build-isolation --target "$TARGET" "$REPO"; then
    echo "pip could not build the package here (no setuptools?); the steps run from the source tree"
    from="$REPO"
  fi
  (cd "$from" && PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "import hybrid_engine, pydantic; print('hybrid_engine from', hybrid_engine.__file__, '; pydantic', pydantic.VERSION)")
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
    export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"  # only what this run installed
  fi
fi

HE=("$PY" -m hybrid_engine)
PLOT_OK=0
[ "$MODE" != dry ] && "$PY" -c "import matplotlib" 2>/dev/null && PLOT_OK=1
plot() { [ $PLOT_OK -eq 1 ] && echo "--plot $WORK/$1.png"; }

# ------------------------------------------------------------------ 2.-6.
if [ "$MODE" != dry ] && command -v nvidia-smi >/dev/null; then nvidia-smi >"$WORK/nvidia-smi.txt" 2>&1; fi
step info 60 "${HE[@]}" info
step parity 90 "${HE[@]}" bench parity $COMMON $PARITY_ARGS --json "$WORK/parity.json"
step kernel_check 60 "${HE[@]}" bench kernels --check $COMMON --json "$WORK/kernel_check.json"
step sampler_check 60 "${SAMPLER[@]}" $COMMON --json "$WORK/sampler_check.json"
step capture_faults 60 "$PY" -m bench.capture_faults --device $DEVICE --dtype $DTYPE $FAULT_ARGS --json "$WORK/capture_faults.json"
step decode_gpt2 100 "${HE[@]}" bench decode $COMMON $DECODE_A --json "$WORK/decode_gpt2.json" $(plot decode_gpt2)
step continuous 75 "${HE[@]}" bench continuous $COMMON $CONT_ARGS --json "$WORK/continuous.json" $(plot continuous)
step rlhf_opt13b 90 "${HE[@]}" bench rlhf $COMMON $RLHF_ARGS --json "$WORK/rlhf_opt13b.json" $(plot rlhf_opt13b)
step handoff 60 "${HE[@]}" bench handoff $COMMON $HANDOFF_ARGS --json "$WORK/handoff.json"
step decode_qwen05b 120 "${HE[@]}" bench decode $COMMON $QWEN_ARGS --paths engine,transformers --per-step --json "$WORK/decode_qwen05b.json"
step decode_opt13b 150 "${HE[@]}" bench decode $COMMON $DECODE_B --json "$WORK/decode_opt13b.json"

# headlines: the figures to read first, from the JSON files (missing ones are named, not fatal).
headlines() {
  "$PY" - "$WORK" <<'EOF'
import json, os, sys
work = sys.argv[1]
def load(name):
    try:
        with open(os.path.join(work, name + ".json")) as fh:
            return json.load(fh)
    except (OSError, ValueError) as exc:
        print(f"{name}: no result ({type(exc).__name__})")
        return None
if (d := load("parity")) is not None:
    a = d["token_agreement"]
    bad = [f"{r['model']}/{r['path']}/{r['mode']} (replayed={r.get('replayed')})" for r in d["rows"] if not r.get("ok")]
    print(f"parity: ok={d['ok']}, tokens identical {a['identical']}/{a['total']}"
          + (f"; not ok: {', '.join(bad)}" if bad else ""))
if (d := load("continuous")) is not None:
    lt = d.get("long_tail")
    if lt:
        c, s = lt["continuous"], lt["static"]
        print(f"long tail ({lt['model']}, {lt['requests']} requests, {lt['slots']} slots): decode steps "
              f"{s['decode_steps']} static / {c['decode_steps']} continuous = {lt['step_ratio']:.2f}x; wall "
              f"{s['ms']:.1f} / {c['ms']:.1f} ms = {lt['wall_ratio']:.2f}x (target >= {lt['wall_target']}x: "
              f"{'met' if lt['wall_target_met'] else 'NOT met'}); prefill forwards {c['prefill_forwards']} / "
              f"{s['prefill_forwards']}, admission rounds {c['admission_rounds']} / {s['admission_rounds']}, "
              f"host syncs {c['host_syncs']} / {s['host_syncs']} (continuous / static); "
              f"tokens identical {lt['agreement']['identical']}/{lt['agreement']['total']}")
    else:
        print("long tail: not run")
if (d := load("capture_faults")) is not None:
    fc, tt = d["failed_capture"], d["two_threads"]
    steps = "; ".join(f"{s['failure']} x{s['runs']}: stuck pools {s['stuck_pools']}, empty_cache frees "
                      f"{s['empty_cache_frees']}, pool bytes {s['pool_bytes_after']}" for s in fc["steps"])
    print(f"capture faults: failed captures ok={fc['ok']} ({steps}; graphs after: {fc['graphs_after']}); "
          f"two threads ok={tt['ok']} (x {tt['x']['captures']} captures exact={tt['x']['exact']}, "
          f"y {tt['y']['captures']} captures exact={tt['y']['exact']}, errors {tt['errors']})")
for name in ("decode_gpt2", "decode_opt13b"):
    if (d := load(name)) is not None:
        speedups = ", ".join(f"{r['path']} b{r['batch']} {r['speedup']:.2f}x" for r in d["rows"] if r["speedup"])
        print(f"{name}: graph vs eager per decode step: {speedups}")
if (d := load("kernel_check")) is not None:
    bad = [f"{r['op']} ({r['implementation']}): {r['error'] or r['max_abs_err']}" for r in d["rows"] if not r["ok"]]
    impls = sorted({f"{r['group']}: {r['implementation']}" for r in d["rows"]})
    print(f"kernel check: ok={d['ok']} ({'; '.join(impls)})" + (f"; FAILED: {'; '.join(bad)}" if bad else ""))
if (d := load("sampler_check")) is not None:
    times = ", ".join(f"{k} {v['kernel_ms']:.3f} vs {v['reference_ms']:.3f} ms" for k, v in d.items()
                      if isinstance(v, dict) and "kernel_ms" in v)
    print(f"sampler check: ok={d['ok']} implementation={d['implementation']}; kernel vs reference: {times}")
if (d := load("decode_qwen05b")) is not None:
    per = {r["path"]: r for r in d["rows"]}
    eng, hf = per.get("engine"), per.get("transformers")
    if eng and hf:
        print(f"decode_qwen05b (64 rows x 2k span, decode steps alone): engine eager {eng['eager_ms_per_step']:.2f} "
              f"ms, graphs {eng['graph_ms_per_step']:.2f} ms, transformers {hf['eager_ms_per_step']:.2f} ms per step")
for name in ("parity", "decode_gpt2", "continuous", "rlhf_opt13b", "decode_qwen05b", "decode_opt13b"):
    try:
        with open(os.path.join(work, name + ".json")) as fh:
            problems = json.load(fh).get("graph_side_problems") or []
    except (OSError, ValueError):
        continue
    if problems:
        print(f"{name}: NOT VALID, the graph side ran eagerly: {'; '.join(problems)}")
for name in ("rlhf_opt13b",):
    if (d := load(name)) is not None:
        cap = d["capture"]
        print(f"{name}: captures per iteration {cap['captures_per_iteration']}, capture ms per iteration "
              f"{[round(x * 1e3, 1) for x in cap['capture_seconds_per_iteration']]}, generate "
              f"{d['phases']['generate']['eager_ms']:.1f} -> {d['phases']['generate']['graph_ms']:.1f} ms")
EOF
}

[ "$MODE" = dry ] && { echo "step headlines: $WORK/headlines.txt from the JSON files above"; exit 0; }
headlines >"$WORK/headlines.txt" 2>&1
cat "$WORK/headlines.txt" | tee -a "$SUMMARY"
say "done in $(($(date +%s) - START))s; $([ $FAILED -eq 0 ] && echo 'all steps ok' || echo 'SOME STEPS FAILED')"
pack
exit $FAILED
