"""Defaults shared by every config: each config file starts from `base.get_config()`.

Names follow the field where one exists: `mtp_loss_scaling_factor` and `mtp_num_heads` as in
MaxText, the per-head decay `mtp_head_weight_decay` (w_k = decay**k for k = 1..K) as in Medusa
(0.8). Attention heads are `model.num_attention_heads` (query) and `model.num_kv_heads`
(key/value); "heads" alone means the multi-token prediction heads. Configs saved with the old
key `model.num_heads` (attention heads) still load (`mtp.model.mtp_model.upgrade_legacy_config`).

A head family's own options are `model` keys too, named and documented by the family (`OPTIONS`
in mtp/model/heads/<name>.py). This file copies their defaults from the registry rather than
repeating them, so that a new family's options exist here, and on the command line, without
an edit.
"""

import ml_collections

from mtp.model import heads


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  # A workdir whose trunk (latest checkpoint) and tokenizer start a new run: heads on a
  # pretrained model, frozen (optim.mode='frozen_trunk', Medusa-1) or fine-tuned with it
  # (optim.mode='finetune', Medusa-2). Empty: train from scratch.
  c.init_from = ''
  # A workdir whose heads (latest checkpoint) a fresh run starts from instead of random ones, to
  # train them on: more data, rollouts after teacher-forced features, a new schedule. Its
  # heads and trunk must have this config's shapes; its draft vocabulary comes along.
  c.init_heads_from = ''

  # Loop.
  c.num_train_steps = 1000
  c.log_every_steps = 20
  c.eval_every_steps = 200
  c.eval_steps = 8
  c.checkpoint_every_steps = 200
  c.keep_checkpoints = 3           # the latest checkpoints kept (at least 1)
  # Divergence guard: a step whose loss or gradient norm is not finite is not applied; after
  # this many such steps, training stops with an error naming the step, saving nothing more
  # (the last good checkpoints stay). 0: stop at the first (launch.train exits with code 3).
  c.max_bad_steps = 0
  c.progress_bar = True
  # A jax.profiler trace of some train steps under workdir/profile (for TensorBoard's profile
  # plugin or xprof): 'N' traces steps N..N+2, 'N:M' steps N to M (both included), '' none.
  # Step 1 of a run compiles too: trace later steps to see a steady one.
  c.profile_steps = ''

  # Multi-token objective: total = ntp + λ · Σ_k w_k · loss_k, w_k = decay**k.
  c.mtp_loss_scaling_factor = 1.0
  c.mtp_head_weight_decay = 0.8
  c.loss_chunk_size = 1024  # tokens per cross-entropy chunk (bounds logits memory)
  # Heads' losses at every n-th position (rotating with the step): divides the heads' output
  # layer cost by n, which dominates with large vocabularies. 1 = every position.
  c.mtp_head_loss_stride = 1
  # The heads' losses over the N most frequent ids of the training corpus only (a draft
  # vocabulary: EAGLE-3's d2t, FR-Spec's ids): their output-layer cost falls by V/N, positions
  # whose label lies outside are skipped, and decoding drafts over the same N ids by default.
  # 0: the whole vocabulary.
  c.mtp_head_draft_vocab = 0

  # Heads on a pretrained trunk (`init_from`): what they learn from and how the trunk runs.
  c.distill = ml_collections.ConfigDict()
  # 'text': the corpus's own next tokens. 'teacher': self-distillation, the init_from trunk's
  # greedy next token at every position of the corpus. 'rollout': self-distillation on the
  # trunk's own greedy continuations of prompts cut from the corpus, the tokens decoding will
  # verify against (generated once, with a KV cache, under workdir/trunk_cache).
  c.distill.targets = 'text'
  # optim.mode='frozen_trunk' only: run the trunk once over the training rows, keep its last
  # hidden state (float32, D values per token, under workdir/trunk_cache), and the inputs of
  # the trunk layers the heads read (D more per layer: Speculative Streaming's streamed
  # layers), and train the heads on them, so a step costs the heads alone. Single-process runs.
  c.distill.cache_trunk_states = False
  # optim.mode='frozen_trunk' only: each head learns the trunk's whole distribution over its
  # token (cross-entropy against softmax of the trunk's logits there: EAGLE-3's soft labels)
  # instead of one label token. Costs one more output-layer product per head token.
  c.distill.soft_labels = False
  c.distill.batch_size = 8         # rows per trunk pass (or rollout) while building that cache
  # That pass's precision: 'model' (model.dtype), 'float32' or 'bfloat16' (twice float32's
  # speed on a CPU with AMX). The targets are then the greedy tokens of the trunk in it.
  c.distill.dtype = 'model'
  c.distill.prompt_len = 32        # 'rollout': prompt tokens per row; the trunk writes the rest

  c.model = ml_collections.ConfigDict()
  c.model.vocab_size = 4096
  c.model.embed_dim = 256
  c.model.num_layers = 4
  c.model.num_attention_heads = 8  # query heads of each attention layer
  c.model.num_kv_heads = 4         # key/value heads (grouped-query attention)
  c.model.head_dim = 32
  c.model.mlp_dim = 768
  c.model.max_seq_len = 2048
  c.model.rope_theta = 10_000.0
  c.model.norm_eps = 1e-5
  c.model.tie_embeddings = True
  c.model.dtype = 'float32'        # activations; 'bfloat16' on accelerators
  c.model.param_dtype = 'float32'
  c.model.mtp_num_heads = 4        # heads predicting t+2 .. t+1+K
  # The head family: a name registered in mtp.model.heads.FAMILIES ('medusa', 'eagle', ...).
  c.model.mtp_head_type = 'medusa'
  # Every family's own options (e.g. --config.model.<option>=...), with the family's defaults;
  # their comments stand beside the family's `OPTIONS`.
  for family in heads.FAMILIES.values():
    c.model.update(family.OPTIONS)
  # Recompute activations in the backward pass: 'none' | 'heads' (the heads' layers) | 'full'
  # (trunk blocks too) | 'dots_saveable' (trunk blocks keep their matmul outputs, recompute the
  # rest; heads as 'heads'). Measured on CPU (benchmarks/scan_compile.py): with scan_layers,
  # 'full' cuts the train step's temporaries 5.3x and 'dots_saveable' 1.7x; unrolled, XLA:CPU
  # hoists the recomputation and 'full' saves 1%.
  c.model.remat = 'none'
  # Stack the trunk's layers on a leading 'layers' axis and run them with jax.lax.scan: compile
  # time stops growing with depth, and remat applies in the scanned body. Checkpoints keep the
  # layout they were trained in; mtp.load, generation, export and init_from read either, and
  # python -m launch.convert_layout converts a workdir to resume it in the other.
  c.model.scan_layers = False

  c.data = ml_collections.ConfigDict()
  c.data.corpus = 'stdlib'         # 'stdlib' or a directory of text/code files
  c.data.extensions = ('.py',)     # file suffixes read from a directory corpus
  c.data.valid_fraction = 0.05     # by a stable hash of each file's path
  c.data.tokenizer = 'bpe'         # 'bpe' (trained on the train split) or 'byte'
  c.data.seq_len = 256
  c.data.batch_size = 16           # global batch, split over the mesh's data axes
  c.data.max_corpus_bytes = -1     # cap for quick runs; -1 reads everything
  # A dataset directory written by `python -m launch.prepare_data` (sharded, pre-tokenized,
  # streamed: memory stays flat whatever its size). Its tokenizer becomes the workdir's, and
  # corpus, extensions, valid_fraction, tokenizer and max_corpus_bytes above are then unused.
  # '': the corpus above, tokenized into memory (cached under workdir/data_cache).
  c.data.source = ''
  c.data.prefetch = 2              # data.source: batches read ahead, one thread each

  # A long-context phase: the last `long_context.steps` steps train on rows of
  # `long_context.seq_len` tokens, `long_context.batch_size` rows per batch (a context extension
  # stage, as pretraining recipes end with). Rows of data.seq_len are cheaper to train on, but
  # attention never sees a longer distance in them and reads longer prompts worse the longer
  # they are. 0 steps: no such phase. Evaluation stays at data.seq_len.
  c.long_context = ml_collections.ConfigDict()
  c.long_context.steps = 0
  c.long_context.seq_len = 1024
  c.long_context.batch_size = 2

  c.optim = ml_collections.ConfigDict()
  c.optim.mode = 'joint'           # 'joint' | 'frozen_trunk' (Medusa-1) | 'finetune' (Medusa-2)
  c.optim.learning_rate = 3e-3
  c.optim.head_lr_multiplier = 1.0
  c.optim.warmup_steps = 100
  c.optim.end_lr_fraction = 0.1
  # 0: cosine decay over the whole run; N: hold the peak, decay over the last N steps only
  # (warmup-stable-decay: a constant-rate run can be resumed and annealed).
  c.optim.decay_steps = 0
  c.optim.weight_decay = 0.1
  c.optim.b1 = 0.9
  c.optim.b2 = 0.95
  c.optim.grad_clip_norm = 1.0

  # Mesh: -1 takes the devices left over.
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  return c
