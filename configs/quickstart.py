"""The quickstart notebooks' model: `code_small.py` sized for where it runs.

  python -m launch.train --config=configs/quickstart.py:cpu --workdir=...

The argument picks the size: 'fast' (a 2-layer model for 40 steps: the notebooks' CI mode),
'cpu' (the demo model for 300 steps: about 15 minutes on 2 cores) or 'accelerator' (1,500 steps
at batch 32). Notebooks 01 and 03 read the same config, so a workdir one trains, the other
reuses.
"""

from configs import code_small

SIZES = ('fast', 'cpu', 'accelerator')


def get_config(size: str = 'cpu'):
  if size not in SIZES:
    raise ValueError(f'configs/quickstart.py takes one of {SIZES}, got {size!r}')
  c = code_small.get_config()
  c.progress_bar = False
  c.long_context.steps = 0  # The notebooks' prompts are short (the accelerator's run: below).
  if size == 'fast':
    c.model.num_layers, c.model.embed_dim, c.model.mlp_dim = 2, 128, 384
    c.model.vocab_size = 1024
    # Its prompts and completions fit in 256 positions. A server's lanes take prompts and budgets
    # up to max_seq_len: at 2048 its warm-up (batch 8) took 105 s against 62 s on 2 cores.
    c.model.max_seq_len = 256
    c.data.seq_len, c.data.max_corpus_bytes = 128, 1_500_000
    c.num_train_steps, c.log_every_steps = 40, 5
    c.eval_every_steps = c.checkpoint_every_steps = 20
    c.eval_steps = 2
  elif size == 'cpu':
    c.num_train_steps = 300
    c.eval_every_steps = c.checkpoint_every_steps = 100
  else:
    c.num_train_steps, c.data.batch_size = 1500, 32
    c.eval_every_steps = c.checkpoint_every_steps = 500
    c.long_context.steps, c.long_context.batch_size = 150, 8
  return c
