"""A model that trains in seconds: for tests and smoke runs (byte tokenizer, small corpus slice)."""

from configs import base


def get_config():
  c = base.get_config()
  c.num_train_steps = 20
  c.log_every_steps = 5
  c.eval_every_steps = 10
  c.eval_steps = 2
  c.checkpoint_every_steps = 10
  c.progress_bar = False
  c.loss_chunk_size = 128
  c.model.vocab_size = 264  # 259 byte-level ids padded to a multiple of 8
  c.model.embed_dim = 64
  c.model.num_layers = 2
  c.model.num_attention_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 16
  c.model.mlp_dim = 128
  c.model.max_seq_len = 256
  c.model.mtp_num_heads = 3
  c.data.tokenizer = 'byte'
  c.data.seq_len = 64
  c.data.batch_size = 8
  c.data.max_corpus_bytes = 400_000
  c.optim.warmup_steps = 5
  return c
