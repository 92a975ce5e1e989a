#!/usr/bin/env bash
# One entry point for a fresh clone: creates (or reuses) a local virtual environment,
# installs the package with its test extras at the versions locked in requirements/pyX.Y/
# (the open ranges of pyproject.toml, with a note, on a Python with no lock), then runs what
# was asked.
#   ./run.sh demo [options]   the main job: a small RL loop with graph-captured rollouts
#   ./run.sh test [pytest options]   the whole test suite (-m "not slow": the fast tier)
#   ./run.sh test-transformers-4.57   the cache, engine, rollout and family tests again on transformers 4.57
#                                     (in .venv-tf457), the oldest transformers we support
#   ./run.sh test-latest [pytest options]   the family matrix and the integrations on the newest
#                                     versions pyproject.toml allows (in .venv-latest, unlocked)
#   ./run.sh lock   rewrite requirements/pyX.Y/locked.txt from what test-latest installed (once it passes)
#   ./run.sh <hybrid-engine subcommand> [...]   e.g. ./run.sh info, ./run.sh bench decode
# HYBRID_ENGINE_VENV picks the venv folder; HYBRID_ENGINE_TORCH the torch requirement installed
# when the venv has none (default torch==2.13.0; torch is not in the lock, so it can be chosen).
set -euo pipefail
cd "$(dirname "$0")"

cmd="${1:-demo}"
[ $# -gt 0 ] && shift
pip_q=(-q --disable-pip-version-check)
case "$cmd" in
  test-transformers-4.57)
    venv="${HYBRID_ENGINE_VENV:-.venv-tf457}"; extras="dev"; lock_name="locked-transformers-4.57.txt" ;;
  test-latest|lock)
    venv="${HYBRID_ENGINE_VENV:-.venv-latest}"; extras="dev,deepspeed,trl"; lock_name="" ;;
  *)
    venv="${HYBRID_ENGINE_VENV:-.venv}"; extras="dev,deepspeed,trl"; lock_name="locked.txt" ;;
esac

python_bin="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$python_bin" -m venv "$venv"
fi
py="$venv/bin/python"
stamp="$venv/.hybrid-engine-installed"
lock_dir="requirements/py$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
lock=""
constraints=()
if [ -n "$lock_name" ]; then
  if [ -f "$lock_dir/$lock_name" ]; then
    lock="$lock_dir/$lock_name"; constraints=(-c "$lock")
  elif [ ! -f "$stamp" ]; then
    echo "run.sh: no $lock_dir/$lock_name for this Python: installing pyproject.toml's open ranges" >&2
  fi
fi
if [ "$cmd" = "lock" ]; then
  [ -f "$stamp" ] || { echo "run.sh lock: run ./run.sh test-latest first (it installs what is locked)" >&2; exit 2; }
  mkdir -p "$lock_dir"
  {
    echo "# Locked by ./run.sh lock on $(date -u +%F) from .venv-latest (./run.sh test-latest passed there)."
    echo "# CI and run.sh install exactly these; pyproject.toml keeps the open ranges for users. torch is"
    echo "# installed first, on its own (HYBRID_ENGINE_TORCH), and is not locked here."
    "$py" -m pip freeze --exclude-editable --disable-pip-version-check | grep -viE '^(torch|hybrid.engine)(==| @)'
  } > "$lock_dir/locked.txt"
  echo "wrote $lock_dir/locked.txt; check the diff, run ./run.sh test on it, and commit it with the date and why"
  exit 0
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || { [ -n "$lock" ] && [ "$lock" -nt "$stamp" ]; } \
   || [ "$cmd" = "test-latest" ]; then
  upgrade=()
  # torch first, pinned: an unpinned resolve would pull a multi-GB accelerator build.
  if ! "$py" -c "import torch" 2>/dev/null; then
    "$py" -m pip install "${pip_q[@]}" "${HYBRID_ENGINE_TORCH:-torch==2.13.0}"
  fi
  if [ "$cmd" = "test-latest" ]; then
    # Everything to its newest allowed version but torch: an eager upgrade would replace the CPU build with
    # a multi-GB accelerator one.
    upgrade=(--upgrade --upgrade-strategy eager)
    "$py" -c 'import torch; print("torch==" + torch.__version__)' > "$venv/torch-pin.txt"
    constraints=(-c "$venv/torch-pin.txt")
  fi
  if [[ ",$extras," == *",deepspeed,"* ]] && { [ ${#upgrade[@]} -gt 0 ] || ! "$py" -c "import deepspeed" 2>/dev/null; }; then
    # DeepSpeed ships as a source archive whose build imports torch: build it against the torch
    # installed above (an isolated build would fetch another torch), with no C++ ops (DS_BUILD_OPS=0).
    DS_BUILD_OPS=0 "$py" -m pip install "${pip_q[@]}" "${upgrade[@]}" --no-build-isolation "${constraints[@]}" \
      "deepspeed>=0.19"
  fi
  extra_req=()
  [ "$cmd" = "test-transformers-4.57" ] && extra_req=("transformers==4.57.*")
  "$py" -m pip install "${pip_q[@]}" "${upgrade[@]}" "${constraints[@]}" -e ".[$extras]" "${extra_req[@]}"
  touch "$stamp"
fi

case "$cmd" in
  test) exec "$py" -m pytest -q "$@" ;;
  test-transformers-4.57)
    exec "$py" -m pytest -q tests/decode/test_kv_cache.py tests/decode/test_cache_api.py tests/decode/test_model_step.py \
      tests/engine/test_engine_generate.py tests/engine/test_engine_graphs.py tests/engine/test_engine_training.py \
      tests/distributed/test_inference_copy.py tests/graphs/test_graph_runner.py tests/exact/test_exact_kernels.py tests/rollout \
      tests/decode/test_model_families.py "$@" ;;
  test-latest)
    "$py" -c "import torch, transformers, trl, deepspeed, peft; print('test-latest on torch', torch.__version__, \
'transformers', transformers.__version__, 'trl', trl.__version__, 'deepspeed', deepspeed.__version__, \
'peft', peft.__version__)"
    exec "$py" -m pytest -q tests/decode/test_cache_api.py tests/decode/test_kv_cache.py tests/decode/test_model_families.py \
      tests/integrations "$@" ;;
  *) exec "$py" -m hybrid_engine "$cmd" "$@" ;;
esac
