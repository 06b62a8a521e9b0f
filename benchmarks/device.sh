#!/usr/bin/env bash
# The accelerator benchmark, prepared to run in one call on a lent GPU (no network there).
#
#   bash benchmarks/device.sh --prepare [WORKDIR]  # here: wheels into .whl/, and WORKDIR (a
#                                                  # trained code_small workdir) exported as a
#                                                  # bfloat16 params-only model to .device/demo
#   bash benchmarks/device.sh                      # there: install, run, results to $OUT
#                                                  # when set (else results/device/)
#   bash benchmarks/device.sh --tiny               # a CPU smoke run of the same steps
#
# With the device tool: run(command="bash benchmarks/device.sh", carry=[".whl", ".device"],
# timeout_s=540). It takes about 7 minutes on one H200, most of it compiling: benchmarks.device
# runs in steps within --time_budget (450 s), prints each step's budget, skips a step that no
# longer fits and rewrites device.json after every measurement, so a failed or killed run keeps
# what ran (and device.log, its output, beside it in $OUT).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if [[ "${1:-}" == "--prepare" ]]; then
  # The GPU image has JAX, flax, optax, orbax, chex, tensorstore and transformers' tokenizers
  # (no grain, gguf or web server: decoding imports none, benchmarks/device_imports_test.py);
  # what mtp.load needs beyond them, ml-collections, travels as a wheel (pure Python).
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
RESULTS=${RESULTS:-${OUT:-results/device}}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1
status=0
"$PYTHON" -m benchmarks.device --output_dir="$RESULTS" "${ARGS[@]}" "$@" 2>&1 \
    | tee "$RESULTS/device.log" || status=$?
if [[ -n "${OUT:-}" && ! "$RESULTS" -ef "$OUT" ]]; then
  cp "$RESULTS/device.json" "$RESULTS/device.log" "$OUT/" 2>/dev/null || true
fi
exit "$status"
