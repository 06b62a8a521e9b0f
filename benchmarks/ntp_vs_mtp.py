r"""Next-token quality of a jointly trained MTP model against a next-token-only model.

  python -m benchmarks.ntp_vs_mtp [--config=configs/code_small.py] \
      [--mtp_workdir=workdirs/code_small] [--ntp_workdir=workdirs/code_small_ntp]

Trains (or reuses, or resumes) both workdirs with the same config, trunk, data order and step
budget, the second with `model.mtp_num_heads=0`, then evaluates both on the validation split of
the training corpus and on held-out code from installed packages outside the standard library.
Gloeckle et al. (2024) found multi-token training costs small models a little next-token
quality; this measures how much here. Writes results/ntp_vs_mtp.json.
"""

from __future__ import annotations


import benchmarks
from absl import app
from absl import flags
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', 'configs/code_small.py', 'Shared training config.')
flags.DEFINE_string('mtp_workdir', 'workdirs/code_small', 'Workdir of the MTP model.')
flags.DEFINE_string('ntp_workdir', 'workdirs/code_small_ntp', 'Workdir of the NTP-only model.')
flags.DEFINE_integer('eval_batches', 16, 'Batches of each evaluation set.')
flags.DEFINE_string('output', 'results/ntp_vs_mtp.json', 'Where to write the figures.')


def main(argv):
  del argv
  import mtp
  from mtp.data import corpora
  from mtp.data import pipeline
  from mtp.train import evaluation
  from mtp.train import trainer

  base = FLAGS.config
  ntp_config = base.copy_and_resolve_references()
  ntp_config.model.mtp_num_heads = 0
  for config, workdir in ((base, FLAGS.mtp_workdir), (ntp_config, FLAGS.ntp_workdir)):
    print(f'== training {workdir} ({config.model.mtp_num_heads} heads, '
          f'{config.num_train_steps} steps)', flush=True)
    trainer.train_and_evaluate(config, workdir)

  heldout = [corpora.read_text(p) for p in corpora.heldout_files()]
  results = {}
  for name, workdir in (('mtp', FLAGS.mtp_workdir), ('ntp', FLAGS.ntp_workdir)):
    loaded = mtp.load(workdir)
    valid = pipeline.split_texts(loaded.config.data, 'valid')
    results[name] = {
        'workdir': workdir, 'step': loaded.step,
        'valid': evaluation.evaluate_texts(loaded.model, loaded.tokenizer, valid,
                                           base.data.seq_len, max_batches=FLAGS.eval_batches),
        'heldout': evaluation.evaluate_texts(loaded.model, loaded.tokenizer, heldout,
                                             base.data.seq_len, max_batches=FLAGS.eval_batches)}
  print(f'\n{"set":<10} {"model":<5} {"ntp loss":>9} {"ntp acc":>8}')
  for split in ('valid', 'heldout'):
    for name in ('ntp', 'mtp'):
      m = results[name][split]
      print(f'{split:<10} {name:<5} {m["ntp_loss"]:>9.4f} {m["ntp_acc"]:>8.4f}')
    delta = results['mtp'][split]['ntp_loss'] - results['ntp'][split]['ntp_loss']
    results[f'{split}_ntp_loss_delta'] = delta
    print(f'{split:<10} MTP - NTP next-token loss: {delta:+.4f} nats')
  benchmarks.write_json(FLAGS.output, results)


if __name__ == '__main__':
  app.run(main)
