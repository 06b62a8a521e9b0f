"""An EAGLE-3 drafter for SmolLM2 trained on one GPU over millions of standard-library tokens.

  python -m launch.import_weights --source=smollm2 --workdir=workdirs/smollm2
  python -m launch.train --config=configs/smollm2_eagle3_gpu.py --workdir=workdirs/eagle3_gpu \
      --config.data.corpus=DIR/stdlib+DIR/stdlib_tests+DIR/stdlib_prose

`benchmarks/device_drafter.sh` runs it on a lent GPU: `--prepare` writes DIR here (the standard
library's code, its test suite and its prose, from `benchmarks.drafter_corpus`), since the
GPU machine's own interpreter may differ.

The recipe of `smollm2_demo.py` (EAGLE-3's drafter on the frozen base, teacher-forced labels,
an 8,192-id draft vocabulary) with the data and batch of an accelerator:
  * the whole corpus (about 9M tokens with the test suite), not 170k tokens;
  * no trunk-state cache: the frozen trunk runs inside each step (on a GPU that costs less than
    reading 7 KB of cached states per token back from disk, and the cache of 9M tokens would
    be 60 GB); only the teacher's labels are built ahead, one pass;
  * 64 rows of 256 tokens a step and a constant learning rate, as the data-scale curve of the
    README was trained (`--config.optim.end_lr_fraction=1.0` there), so every kept checkpoint
    is a point on that curve.
"""

from configs import smollm2_demo


def get_config():
  c = smollm2_demo.get_config()
  c.data.max_corpus_bytes = -1
  c.data.extensions = ('.py', '.txt')  # copies of the named sources are directories
  c.data.batch_size = 64
  c.distill.cache_trunk_states = False
  c.distill.batch_size = 128       # rows per pass of the teacher while its labels are built
  c.optim.learning_rate = 1e-3
  c.optim.warmup_steps = 20
  c.optim.end_lr_fraction = 1.0
  c.num_train_steps = 3000         # 49M tokens; device_drafter.sh stops it sooner by the clock
  c.log_every_steps = 25
  c.eval_every_steps = 1000         # held-out τ is measured where it decodes: data_scale
  c.eval_steps = 4
  c.checkpoint_every_steps = 125   # 2M tokens apart
  c.keep_checkpoints = 24
  return c
