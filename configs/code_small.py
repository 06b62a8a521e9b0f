"""The default demo model: trains on the standard library's source in minutes on 2 CPU cores.

Trunk: 4 layers, width 256, 8 query / 4 KV heads, BPE vocabulary of 4,096 trained on the train
split. Four Medusa heads (ResBlock, decay 0.8**k) trained jointly with the trunk.
"""

from configs import base


def get_config():
  c = base.get_config()
  c.num_train_steps = 1200
  c.log_every_steps = 25
  c.eval_every_steps = 300
  c.checkpoint_every_steps = 300
  return c
