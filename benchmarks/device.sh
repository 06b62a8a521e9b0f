#!/usr/bin/env bash
# The accelerator benchmark, prepared to run in one call on a lent GPU (no network there).
#
#   bash benchmarks/device.sh --prepare [WORKDIR]  # here: wheels into .whl/, and WORKDIR (a
#                                                  # trained code_small workdir) exported as a
#                                                  # bfloat16 params-only model to .device/demo
#   bash benchmarks/device.sh                      # there: install, run, results to
#                                                  # results/device/ (and $OUT when set)
#   bash benchmarks/device.sh --tiny               # a CPU smoke run of the same steps
#
# With the device tool: run(command="bash benchmarks/device.sh", carry=[".whl", ".device"],
# timeout_s=540). It takes about 5 minutes on one H200 (most of it compiling).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if [[ "${1:-}" == "--prepare" ]]; then
  # The GPU image has JAX, flax, optax, orbax, chex and tensorstore; what mtp.load needs
  # beyond them travels as wheels (pure Python, any platform).
  mkdir -p .whl
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: -d .whl ml-collections
  if [[ -n "${2:-}" ]]; then
    rm -rf .device/demo
    "$PYTHON" -m launch.export --workdir="$2" --format=params --dtype=bfloat16 \
        --output=.device/demo
  fi
  du -sh .whl .device 2>/dev/null || true
  exit 0
fi

ARGS=()
if [[ "${1:-}" == "--tiny" ]]; then
  ARGS+=(--tiny --repeats=1)
  shift
fi
if compgen -G ".whl/*.whl" >/dev/null && ! "$PYTHON" -c 'import ml_collections' 2>/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [[ -d .device/demo && "$*" != *--demo_workdir* ]]; then
  ARGS+=(--demo_workdir=.device/demo)
fi
"$PYTHON" -c 'import jax; print("jax", jax.__version__, jax.devices())'
RESULTS=${RESULTS:-results/device}
"$PYTHON" -m benchmarks.device --output_dir="$RESULTS" "${ARGS[@]}" "$@"
if [[ -n "${OUT:-}" ]]; then
  cp "$RESULTS/device.json" "$OUT/"
fi
