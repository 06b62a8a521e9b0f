"""Model FLOPs against XLA's own count of the compiled train step, and the MFU arithmetic."""

import jax
import jax.numpy as jnp
import pytest

from mtp.model import heads
from mtp.parallel import mesh as mesh_lib
from mtp.train import flops
from mtp.train import step as step_lib
from mtp.train import testing

# XLA's count over the model FLOPs of the program it ran ('full' attention): XLA also counts
# elementwise work (norms, rotary, softmax, SiLU, the loss's exp/log, AdamW), which adds 5.2-5.4%
# on these tiny models (D=64); matmuls are all there is to the model count, so XLA is never
# below it.
XLA_OVER_MODEL = (1.0, 1.10)


def _xla_flops(config) -> float:
  mesh = mesh_lib.make_mesh(config.mesh, jax.devices()[:1])
  draft_ids = None
  if config.get('mtp_head_draft_vocab'):
    draft_ids = jnp.arange(config.mtp_head_draft_vocab)
  teacher = config.distill.targets != 'text'  # The batch holds the trunk's own tokens.
  trainer = step_lib.Trainer(config, mesh, ('targets',) if teacher else (),
                             draft_ids=draft_ids)
  rows = jax.ShapeDtypeStruct((config.data.batch_size, config.data.seq_len), jnp.int32)
  batch = step_lib.Batch(rows, rows, rows, targets=rows if teacher else None)
  compiled = trainer.train_step.lower(trainer.abstract_state, batch).compile()
  return compiled.cost_analysis()['flops']


def _tiny(**overrides):
  # One loss chunk: XLA's cost analysis counts a while loop's body once, whatever its trip
  # count, so a chunked loss (a scan over chunks) would read low by the number of chunks.
  return testing.tiny_config(**{'model.num_layers': 1, 'model.mtp_num_heads': 2,
                                'loss_chunk_size': 1 << 20, **overrides})


@pytest.mark.parametrize('overrides', [
    {'model.mtp_head_type': 'medusa', 'model.medusa_num_layers': 2},
    # One head each for the families that attend: each head is a transformer layer to compile.
    {'model.mtp_head_type': 'sequential', 'model.mtp_num_heads': 1},
    # Remat recomputes the parallel heads' and the trunk's layers: XLA runs those FLOPs too.
    {'model.mtp_head_type': 'parallel', 'model.mtp_num_heads': 1, 'model.remat': 'full',
     'mtp_head_loss_stride': 4},
    # Two depths: the second attends to the first's keys as well.
    pytest.param({'model.mtp_head_type': 'eagle'}, marks=pytest.mark.skipif(
        'eagle' not in heads.FAMILIES, reason='the eagle family is not registered')),
    # EAGLE-3: the fusion of both layers' inputs, then 2D-wide q/k/v at each of two depths.
    {'model.mtp_head_type': 'eagle', 'model.num_layers': 2, 'model.eagle_features': 'fused',
     'model.eagle_input': 'concat'},
    # Fused features into EAGLE-1's fc, depth 1 only; remat recomputes the drafter's layer.
    {'model.mtp_head_type': 'eagle', 'model.num_layers': 2, 'model.eagle_features': 'fused',
     'model.eagle_train_features': 'trunk', 'model.remat': 'full'},
    # Two streams in both layers, with adapters; remat recomputes the streamed layers.
    {'model.mtp_head_type': 'streaming', 'model.num_layers': 2, 'model.streaming_layers': 2,
     'model.streaming_adapter_rank': 2, 'model.remat': 'heads'},
    # Streams run at the strided positions the heads' losses read only.
    {'model.mtp_head_type': 'streaming', 'model.num_layers': 2, 'model.streaming_layers': 1,
     'mtp_head_loss_stride': 4},
    # Medusa-1: no trunk backward pass at all (XLA counted 1.61x when the trunk's gradients
    # were computed and thrown away).
    {'model.mtp_head_type': 'medusa', 'optim.mode': 'frozen_trunk'},
    # Soft labels (the teacher's logits over the heads' rows, forward only), as EAGLE-3 trains:
    # on the frozen trunk's own tokens, whose output rows are skipped.
    {'model.mtp_head_type': 'medusa', 'optim.mode': 'frozen_trunk', 'distill.soft_labels': True,
     'distill.targets': 'teacher'},
    # A draft vocabulary of a quarter of the ids, in joint training: the heads' rows through
    # those columns of the trained output layer. (Frozen, the ratio reads 0.96: the Medusa
    # heads' input gradient, counted but never computed on a frozen trunk, then outweighs the
    # elementwise work.)
    {'model.mtp_head_type': 'medusa', 'mtp_head_draft_vocab': 64},
], ids=['medusa', 'sequential', 'parallel-remat-stride', 'eagle', 'eagle3',
       'eagle-fused-trunk-remat', 'streaming-remat',
       'streaming-stride', 'medusa-frozen-trunk', 'medusa-soft-labels', 'medusa-draft-vocab'])
def test_model_flops_match_xla_cost_analysis_within_the_elementwise_gap(overrides):
  config = _tiny(**overrides)
  counted = flops.train_step_flops(config, attention='full')
  ratio = _xla_flops(config) / (counted.total + counted.remat_recompute)
  assert XLA_OVER_MODEL[0] <= ratio <= XLA_OVER_MODEL[1], (ratio, counted)


def test_counts_by_hand_on_a_small_shape():
  config = _tiny(**{'model.mtp_head_type': 'medusa', 'model.medusa_num_layers': 1})
  m, d = config.model, config.model.embed_dim
  b, t = config.data.batch_size, config.data.seq_len
  n = b * t
  q, kv = m.num_attention_heads * m.head_dim, m.num_kv_heads * m.head_dim
  layer = 2 * n * (2 * d * q + 2 * d * kv + 3 * d * m.mlp_dim)
  counted = flops.train_step_flops(config)
  assert counted.trunk == 3 * m.num_layers * layer
  causal_pairs = t * (t + 1) / 2
  assert counted.attention == 3 * m.num_layers * 4 * b * m.num_attention_heads * m.head_dim \
      * causal_pairs
  assert counted.heads == 3 * m.mtp_num_heads * 2 * n * d * d
  assert counted.output_layer == 3 * 2 * d * m.vocab_size * n * (1 + m.mtp_num_heads)
  assert counted.remat_recompute == 0
  assert counted.per_token == counted.total / n
  full = flops.train_step_flops(config, attention='full')
  assert full.attention / counted.attention == pytest.approx(t * t / causal_pairs)


def test_a_frozen_trunk_runs_forward_only_and_a_cached_one_not_at_all():
  joint = flops.train_step_flops(_tiny(**{'model.mtp_head_type': 'parallel'}))
  frozen = flops.train_step_flops(_tiny(**{'model.mtp_head_type': 'parallel',
                                           'optim.mode': 'frozen_trunk'}))
  assert frozen.trunk == joint.trunk / 3 and frozen.heads == joint.heads
  assert frozen.output_layer == joint.output_layer * 2 / 3  # No weight gradient.
  cached = flops.train_step_flops(_tiny(**{'model.mtp_head_type': 'parallel',
                                           'optim.mode': 'frozen_trunk',
                                           'distill.cache_trunk_states': True}))
  assert cached.trunk == 0 and cached.heads == joint.heads
  # Self-distillation targets skip the trunk's own output rows.
  teacher = flops.train_step_flops(_tiny(**{'optim.mode': 'frozen_trunk',
                                            'distill.targets': 'teacher'}))
  assert teacher.output_layer == frozen.output_layer * 2 / 3  # 2 head rows of 3.
  soft = flops.train_step_flops(_tiny(**{'optim.mode': 'frozen_trunk',
                                         'distill.targets': 'teacher',
                                         'distill.soft_labels': True}))
  assert soft.output_layer == teacher.output_layer * 3 / 2  # The teacher's forward: 1 of 2.


def test_stride_divides_the_heads_output_rows():
  every = flops.train_step_flops(_tiny())
  strided = flops.train_step_flops(_tiny(mtp_head_loss_stride=4))
  rows = lambda f: f.output_layer / every.output_layer  # noqa: E731
  assert rows(strided) == pytest.approx((1 + 2 / 4) / (1 + 2))


def test_bad_attention_count_is_named():
  with pytest.raises(ValueError, match='attention'):
    flops.train_step_flops(_tiny(), attention='half')


@pytest.mark.parametrize('kind, peak', [
    ('TPU v4', 275), ('TPU v5 lite', 197), ('TPU v5', 459), ('TPU v5p', 459),
    ('TPU v6 lite', 918), ('NVIDIA A100-SXM4-80GB', 312), ('NVIDIA H100 80GB HBM3', 989),
    ('NVIDIA H100 PCIe', 756), ('NVIDIA H200', 989), ('cpu', None), ('TPU v3', None),
    ('NVIDIA GeForce RTX 4090', None)])
def test_peaks_by_device_kind(kind, peak):
  assert flops.peak_tflops(kind) == peak


def test_mfu_only_where_the_peak_is_known():
  tpu = flops.throughput_metrics(1e9, 1e5, 4, 'TPU v4')
  assert tpu['tflops_per_sec_per_device'] == pytest.approx(1e9 * 1e5 / 4 / 1e12)
  assert tpu['mfu'] == pytest.approx(tpu['tflops_per_sec_per_device'] / 275)
  assert flops.throughput_metrics(1e9, 1e5, 4, 'cpu').keys() == {'tflops_per_sec_per_device'}
