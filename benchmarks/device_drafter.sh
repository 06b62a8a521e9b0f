#!/usr/bin/env bash
# An EAGLE-3 drafter for SmolLM2 trained on a lent GPU (configs/smollm2_eagle3_gpu.py), in two
# calls: the 98 MB GGUF file is more than one call carries (64 MiB), so each carries half.
#
#   bash benchmarks/device_drafter.sh --prepare     # here: .devdrafter/a (half the GGUF, the
#                                                   # corpus, wheels) and .devdrafter/b (the rest)
#   run(command="bash benchmarks/device_drafter.sh --stage", carry=[".devdrafter/a"])
#   run(command="bash benchmarks/device_drafter.sh --train 560", carry=[".devdrafter/b"],
#       timeout_s=590)                              # within 30 s: the machine stays warm that long
#   bash benchmarks/device_drafter.sh --unpack DIR  # here: the files that came back (DIR) into
#                                                   # workdirs/eagle3_gpu, over workdirs/smollm2
#
# Then that drafter decoded on the GPU (benchmarks.device on held-out code, batch 1 and 8):
#   bash benchmarks/device_drafter.sh --prepare-decode   # here: .devdrafter/c (19 MB)
#   run(command="bash benchmarks/device_drafter.sh --stage", carry=[".devdrafter/a"])
#   run(command="bash benchmarks/device_drafter.sh --stage-drafter", carry=[".devdrafter/c"])
#   run(command="bash benchmarks/device_drafter.sh --decode 330", carry=[".devdrafter/b"],
#       timeout_s=345)                              # batch 1 took 255 s of it on an H200
#
# On an H200 (2026-12-04): the first call takes 15 s; the second 372 s, of which the import 10
# s and the config's 4,000 steps (65M tokens, evaluations and 32 checkpoints included) 4 min
# 56 s. Both took 7 minutes of device time, the machine's start included.
#
# --train N [FLAG...] imports SmolLM2, trains the drafter until N seconds after its own start
# (less a minute to save and pack: SIGTERM makes launch.train save a checkpoint and stop), returns
# three checkpoints' parameters (about 19 MB each: the first past 4M tokens, the last before the
# learning rate decays, or the first past one epoch if it never does, and the last) with the
# run's config, metrics and log, as chunks under 16 MiB. FLAGs go
# to launch.train (a CPU dry run: PYTHON=... --train 300 --config.data.max_corpus_bytes=...).
# `python -m benchmarks.data_scale --workdirs=gpu=workdirs/eagle3_gpu` then decodes them here.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
STAGE=/tmp/mtp_drafter
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
FIRST_HALF_BYTES=48000000

# The two halves of the GGUF file joined and checked, imported into workdirs/smollm2.
import_smollm2() {
  export PYTHONPATH=$STAGE/site XDG_CACHE_HOME=$STAGE/cache PYTHONUNBUFFERED=1
  cat "$STAGE/gguf.part1" .devdrafter/b/gguf.part2 >"$STAGE/cache/mtp/$GGUF"
  (cd "$STAGE/cache/mtp" && sha256sum -c "$OLDPWD/.devdrafter/b/gguf.sha256")
  mkdir -p workdirs
  rm -rf workdirs/smollm2
  "$PYTHON" -m launch.import_weights --source=smollm2 --workdir=workdirs/smollm2
}

case "${1:-}" in
--prepare)
  rm -rf .devdrafter && mkdir -p .devdrafter/a/whl .devdrafter/b
  gguf=$(.venv/bin/python -c 'from mtp.pretrained import smollm2; print(smollm2.fetch_gguf())')
  head -c $FIRST_HALF_BYTES "$gguf" >.devdrafter/a/gguf.part1
  tail -c +$((FIRST_HALF_BYTES + 1)) "$gguf" >.devdrafter/b/gguf.part2
  (cd "$(dirname "$gguf")" && sha256sum "$GGUF") >.devdrafter/b/gguf.sha256
  # The GPU image (Python 3.12, JAX 0.11.2) lacks the first six; flax, orbax, optax and chex
  # are pinned to the versions this recipe was tried with on CPU under JAX 0.11.2.
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
      -d .devdrafter/a/whl ml-collections==1.1.0 grain==0.2.18 array-record==0.8.6 \
      gguf==0.19.0 tensorboardX==2.6.5 portpicker==1.6.0 flax==0.12.12 \
      orbax-checkpoint==0.12.8 optax==0.2.8 chex==0.1.92
  # The corpus as directories: the GPU machine's interpreter may differ or lack its test suite.
  rm -rf "$STAGE/corpus_prepare" && mkdir -p "$STAGE/corpus_prepare"
  .venv/bin/python -c "from configs import smollm2_eagle3_gpu; from mtp.data import corpora
data = smollm2_eagle3_gpu.get_config().data
print(corpora.copy_corpus(data.corpus, data.extensions, '$STAGE/corpus_prepare/corpus'))" \
      >.devdrafter/a/corpus.txt
  tar cf - -C "$STAGE/corpus_prepare" corpus | xz -T2 -6 >.devdrafter/a/corpus.tar.xz
  rm -rf "$STAGE/corpus_prepare"
  du -sh .devdrafter/a .devdrafter/b
  ;;
--stage)
  # First call: keep half the GGUF, the corpus and the wheels outside the tree (/tmp stays
  # while the machine is warm) and check that JAX sees the GPU.
  rm -rf "$STAGE" && mkdir -p "$STAGE/cache/mtp"
  cp .devdrafter/a/gguf.part1 "$STAGE/"
  sed "s#$STAGE/corpus_prepare/corpus#$STAGE/corpus#g" .devdrafter/a/corpus.txt >"$STAGE/corpus.txt"
  tar xJf .devdrafter/a/corpus.tar.xz -C "$STAGE"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$STAGE/site" .devdrafter/a/whl/*.whl
  PYTHONPATH=$STAGE/site "$PYTHON" -c 'import jax, flax, numpy as np, orbax.checkpoint as ocp
from mtp.train import trainer  # everything training imports
print("jax", jax.__version__, "flax", flax.__version__, "orbax", ocp.__version__,
      jax.devices())
with ocp.StandardCheckpointer() as c:  # orbax over this image'"'"'s tensorstore
  c.save("/tmp/mtp_drafter/orbax_check", {"x": np.arange(4.0)})
  c.wait_until_finished()
  print("orbax round trip:", c.restore("/tmp/mtp_drafter/orbax_check")["x"].tolist())'
  du -sh "$STAGE"/*
  ;;
--train)
  start=$SECONDS
  budget=${2:-560}
  [[ -f "$STAGE/gguf.part1" && -d "$STAGE/site" ]] || {
    echo "device_drafter: $STAGE is missing: run --stage first, on the same (warm) machine" >&2
    exit 1
  }
  import_smollm2
  RESULTS=$(realpath -m "${OUT:-results/device_drafter}")
  mkdir -p "$RESULTS"
  rm -rf "$STAGE/eagle3_gpu"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
  seconds=$((budget - (SECONDS - start) - 60))
  echo "device_drafter: training for at most $seconds s"
  status=0
  timeout --preserve-status -s TERM --kill-after=45 "$seconds" "$PYTHON" -m launch.train \
      --config=configs/smollm2_eagle3_gpu.py --workdir="$STAGE/eagle3_gpu" \
      --config.data.corpus="$(cat "$STAGE/corpus.txt")" "${@:3}" >"$RESULTS/train.log" 2>&1 \
      || status=$?
  echo "device_drafter: launch.train exited with $status after $((SECONDS - start)) s"
  tail -c 1500 "$RESULTS/train.log"; echo
  # 143: stopped by the clock, after saving a checkpoint. Any other failure still returns the
  # checkpoints saved before it (every 2M tokens), then exits with its status.
  compgen -G "$STAGE/eagle3_gpu/checkpoints/*/commit_success.txt" >/dev/null || exit "$status"
  cd "$STAGE/eagle3_gpu"
  picked=$("$PYTHON" - "$RESULTS/train.log" <<'EOF'
import json, pathlib, re, sys
config = json.loads(pathlib.Path('config.json').read_text())
data = config['data']
per_step = data['batch_size'] * data['seq_len']
steps = sorted(int(p.parent.name) for p in pathlib.Path('checkpoints').glob('*/commit_success.txt'))
# One epoch: the train split's tokens, as the data pipeline logged them (else 9M).
built = re.search(r'Built train split: \d+ files, (\d+) rows of (\d+) tokens',
                  pathlib.Path(sys.argv[1]).read_text())
epoch = int(built[1]) * int(built[2]) if built else 9e6
picks = {steps[-1]} if steps else set()
past = [s for s in steps if s * per_step >= 4e6]
picks.update(past[:1])
stable_end = config['num_train_steps'] - config['optim'].get('decay_steps', 0)
if stable_end < config['num_train_steps']:  # the last checkpoint before the annealing
  picks.update([s for s in steps if s <= stable_end][-1:])
else:
  picks.update([s for s in steps if s * per_step >= epoch][:1])
print(' '.join(str(s) for s in sorted(picks)))
EOF
)
  echo "device_drafter: returning checkpoints $picked"
  files=(config.json base.json draft_vocab.json special_tokens.json tokenizer.json metrics.jsonl)
  for s in $picked; do
    files+=(checkpoints/$s/_CHECKPOINT_METADATA checkpoints/$s/commit_success.txt
            checkpoints/$s/fingerprints checkpoints/$s/params)
  done
  tar cf - "${files[@]}" | split -b 15m -d - "$RESULTS/eagle3_gpu.tar."
  ls -la "$RESULTS"
  [[ $status == 0 || $status == 143 ]] || exit "$status"
  ;;
--prepare-decode)
  # The trained drafter (workdirs/eagle3_gpu's last checkpoint, 19 MB) for --decode.
  rm -rf .devdrafter/c && mkdir -p .devdrafter/c
  step=$(find workdirs/eagle3_gpu/checkpoints -name commit_success.txt | xargs -n1 dirname \
         | xargs -n1 basename | sort -n | tail -1)
  tar cf .devdrafter/c/drafter.tar -C workdirs/eagle3_gpu config.json base.json \
      draft_vocab.json special_tokens.json tokenizer.json "checkpoints/$step"
  du -sh .devdrafter/c
  ;;
--stage-drafter)
  # After --stage, on the same warm machine: the drafter, carried alone (the GGUF's second
  # half and the drafter are more than one call carries).
  [[ -d "$STAGE/site" ]] || { echo "device_drafter: run --stage first" >&2; exit 1; }
  cp .devdrafter/c/drafter.tar "$STAGE/"
  ;;
--decode)
  # After --stage and --stage-drafter: SmolLM2 with its drafter, decoded on held-out code by
  # benchmarks.device (autoregressive, the drafter's chain, auto, trees, lookup; batch 1, 8).
  start=$SECONDS
  budget=${2:-400}
  [[ -f "$STAGE/drafter.tar" ]] || { echo "device_drafter: run --stage-drafter first" >&2; exit 1; }
  import_smollm2
  rm -rf workdirs/eagle3_gpu && mkdir -p workdirs/eagle3_gpu
  tar xf "$STAGE/drafter.tar" -C workdirs/eagle3_gpu
  "$PYTHON" -c 'import json, pathlib, sys
path, base = pathlib.Path("workdirs/eagle3_gpu/base.json"), str(pathlib.Path(sys.argv[1]))
path.write_text(json.dumps(dict(json.loads(path.read_text()), base_workdir=base,
                                base_workdir_absolute=base)))' "$(realpath workdirs/smollm2)"
  RESULTS=$(realpath -m "${OUT:-results/device_drafter}")
  mkdir -p "$RESULTS"
  status=0
  # device.json is rewritten after every row: a run stopped by the clock keeps what ran.
  timeout -s TERM --kill-after=10 $((budget - (SECONDS - start) - 15)) "$PYTHON" \
      -m benchmarks.device --norandom_shape --demo_workdir=workdirs/eagle3_gpu --demo_auto \
      --time_budget=0 --output_dir="$RESULTS" "${@:3}" 2>&1 | tee "$RESULTS/decode.log" \
      || status=$?
  echo "device_drafter: benchmarks.device exited with $status after $((SECONDS - start)) s"
  ;;
--unpack)
  if [[ ! -d "${2:-}" ]]; then
    echo "device_drafter: --unpack needs the returned files' folder" >&2
    exit 2
  fi
  if [[ -e workdirs/eagle3_gpu ]]; then
    echo "device_drafter: workdirs/eagle3_gpu exists" >&2
    exit 1
  fi
  mkdir -p workdirs/eagle3_gpu
  cat "$2"/eagle3_gpu.tar.* | tar xf - -C workdirs/eagle3_gpu
  cp "$2/train.log" workdirs/eagle3_gpu/ 2>/dev/null || true
  ls workdirs/eagle3_gpu/checkpoints
  ;;
*)
  echo "usage: $0 --prepare | --stage | --train SECONDS | --unpack DIR" \
       "| --prepare-decode | --stage-drafter | --decode SECONDS" >&2
  exit 2
  ;;
esac
