"""The default demo model: trains on the standard library's source in minutes on 2 CPU cores.

Trunk: 4 layers, width 256, 8 query / 4 KV heads, BPE vocabulary of 4,096 trained on the train
split, sequences of 256 tokens. Four Medusa heads (one ResBlock each, loss weights 0.8**k)
trained jointly with the trunk: the cheapest heads to draft with, which matters on a CPU.
Small batches: on a short budget more updates beat bigger ones.
"""

from configs import base


def get_config():
  c = base.get_config()
  c.num_train_steps = 600
  c.log_every_steps = 25
  c.eval_every_steps = 150
  c.checkpoint_every_steps = 150
  c.data.batch_size = 8
  c.optim.learning_rate = 3e-3
  c.optim.warmup_steps = 50
  return c
