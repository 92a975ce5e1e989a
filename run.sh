#!/usr/bin/env bash
# One entry point for a fresh clone: creates (or reuses) a local virtual environment,
# installs the package with its test extras, then runs what was asked.
#   ./run.sh demo [options]   the main job: a small RL loop with graph-captured rollouts
#   ./run.sh test [pytest options]   the whole test suite
#   ./run.sh test-transformers-4.57   the cache, engine and rollout tests again on transformers 4.57
#                                     (in .venv-tf457), the oldest transformers we support
#   ./run.sh <hybrid-engine subcommand> [...]   e.g. ./run.sh info, ./run.sh bench decode
# HYBRID_ENGINE_VENV picks the venv folder (default .venv); HYBRID_ENGINE_TORCH the torch
# requirement installed when the venv has none (default torch==2.13.0).
set -euo pipefail
cd "$(dirname "$0")"

cmd="${1:-demo}"
[ $# -gt 0 ] && shift
if [ "$cmd" = "test-transformers-4.57" ]; then
  venv="${HYBRID_ENGINE_VENV:-.venv-tf457}"
  extras="dev"
  extra_req="transformers==4.57.*"
else
  venv="${HYBRID_ENGINE_VENV:-.venv}"
  extras="dev,deepspeed,trl"
  extra_req=""
fi
python_bin="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$python_bin" -m venv "$venv"
fi
py="$venv/bin/python"
stamp="$venv/.hybrid-engine-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  # torch first, pinned: an unpinned resolve would pull a multi-GB accelerator build.
  if ! "$py" -c "import torch" 2>/dev/null; then
    "$py" -m pip install -q --disable-pip-version-check "${HYBRID_ENGINE_TORCH:-torch==2.13.0}"
  fi
  if [[ ",$extras," == *",deepspeed,"* ]] && ! "$py" -c "import deepspeed" 2>/dev/null; then
    # DeepSpeed ships as a source archive whose build imports torch: build it against the torch
    # installed above (an isolated build would fetch another torch), with no C++ ops (DS_BUILD_OPS=0).
    DS_BUILD_OPS=0 "$py" -m pip install -q --disable-pip-version-check --no-build-isolation "deepspeed>=0.19"
  fi
  "$py" -m pip install -q --disable-pip-version-check -e ".[$extras]" $extra_req
  touch "$stamp"
fi

case "$cmd" in
  test) exec "$py" -m pytest -q "$@" ;;
  test-transformers-4.57)
    exec "$py" -m pytest -q tests/test_kv_cache.py tests/test_model_step.py tests/test_engine_generate.py \
      tests/test_engine_graphs.py tests/test_engine_training.py tests/test_inference_copy.py tests/test_graph_runner.py \
      tests/test_exact_kernels.py tests/rollout "$@" ;;
  *) exec "$py" -m hybrid_engine "$cmd" "$@" ;;
esac
