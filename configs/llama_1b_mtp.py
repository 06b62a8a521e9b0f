"""A ~1.1B-parameter Llama trunk with four Medusa heads, sharded for a 32-chip slice.

  python -m launch.train --config=configs/llama_1b_mtp.py --workdir=gs://BUCKET/llama_1b_mtp \
      --config.data.source=gs://BUCKET/tokens   # shards written by launch.prepare_data

Trunk: Llama-3.2-1B's shape (16 layers, width 2048, 32 query heads of 64 with 8 KV heads, a
SwiGLU MLP of 8192) over a 32,768-id BPE vocabulary, tied embeddings: 1.04B parameters, plus
four Medusa heads of one 2048x2048 ResBlock each (16.8M) sharing the output layer.

Sharding: pure FSDP (`mesh.fsdp=-1`: 32 on a 32-chip slice, such as TPU v4-64 or v5p-64):
every matrix's width is split 32 ways, the batch's rows too (8 rows of 1024 tokens a chip); a
2048-wide model gains nothing from tensor parallelism at this size. `mesh.tensor=2` (with
fsdp=16) is the alternative where per-chip batches get too small. Activations are bf16 with
float32 master parameters, optimizer state and loss; the 16 layers are scanned, each
rematerialised keeping its matmul outputs ('dots_saveable').

Memory per chip, projected from shapes by `python -m benchmarks.memory_1b` (which also compiles
this step scaled down on 8 simulated devices and reports XLA's figure): 0.5 GiB of parameters,
gradients and Adam state, and about 20 GiB in all with 'dots_saveable' (the attention scores
it keeps are most of it): it fits 32 GiB (v4) and 95 GiB (v5p) chips. On 16 GiB chips (v5e)
use `--config.model.remat=full`: about 6 GiB.
"""

from configs import base


def get_config():
  c = base.get_config()
  c.num_train_steps = 20_000        # 5.2B tokens at 256 x 1024 tokens a step
  c.log_every_steps = 50
  c.eval_every_steps = 1000
  c.eval_steps = 16
  c.checkpoint_every_steps = 1000
  c.loss_chunk_size = 2048

  c.model.vocab_size = 32_768
  c.model.embed_dim = 2048
  c.model.num_layers = 16
  c.model.num_attention_heads = 32
  c.model.num_kv_heads = 8
  c.model.head_dim = 64
  c.model.mlp_dim = 8192
  c.model.max_seq_len = 4096
  c.model.rope_theta = 500_000.0
  c.model.tie_embeddings = True
  c.model.dtype = 'bfloat16'
  c.model.param_dtype = 'float32'
  c.model.mtp_num_heads = 4
  c.model.mtp_head_type = 'medusa'
  c.model.scan_layers = True
  c.model.remat = 'dots_saveable'

  c.data.tokenizer = 'bpe'
  c.data.seq_len = 1024
  c.data.batch_size = 256           # 8 rows a chip on 32 chips

  c.optim.learning_rate = 3e-4
  c.optim.warmup_steps = 1000
  c.optim.end_lr_fraction = 0.1
  c.optim.weight_decay = 0.1

  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.tensor = 1
  return c
