"""The default demo model: trains on the standard library's source in about 20 minutes on 2 CPU
cores, and reads prompts of 2,000 characters (about 700 tokens).

Trunk: 4 layers, width 256, 8 query / 4 KV heads, BPE vocabulary of 4,096 trained on the train
split. Four Medusa heads (one ResBlock each, loss weights 0.8**k), the cheapest heads to draft
with, which matters on a CPU, trained jointly with the trunk. Small batches: on a short budget
more updates beat bigger ones. Chosen by measurement (`benchmarks/demo_recipe.py`, the closing
note of issue 11 has the figures):

- The heads' losses weigh 0.05 against the next token's (`mtp_loss_scaling_factor`). At 1.0,
  four heads predicting far tokens pull the trunk of a model this small away from the next one:
  validation next-token loss after 150 steps 5.79 (1.0), 5.41 (0.3), 5.10 (0.05), 5.07 (no
  heads). Adam normalises each parameter's update, so the heads' own parameters learn at the
  same pace whatever the weight; it sets how much they steer the shared trunk.
- The heads' losses at every 4th position (`mtp_head_loss_stride`): a step costs 1.35x a
  next-token-only step instead of 1.65x.
- Rows of 256 tokens, then a last phase of 100 steps on rows of 1,024 (`long_context`): trained
  on 256 alone, held-out loss rose from 4.66 (positions 0-127) to 5.16 (768-1023); after the
  phase it is 4.76 there. Training on 1,024 throughout runs at half the tokens per second.
"""

from configs import base


def get_config():
  c = base.get_config()
  c.num_train_steps = 1300
  c.log_every_steps = 25
  c.eval_every_steps = 325
  c.checkpoint_every_steps = 325
  c.mtp_loss_scaling_factor = 0.05
  c.mtp_head_loss_stride = 4
  c.data.batch_size = 8
  c.long_context.steps = 100
  c.long_context.seq_len = 1024
  c.long_context.batch_size = 2
  c.optim.learning_rate = 3e-3
  c.optim.warmup_steps = 50
  return c
