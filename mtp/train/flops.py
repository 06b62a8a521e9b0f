"""Model FLOPs of a train step, and what they make of a step's time: TFLOP/s per device and MFU.

Model FLOPs count the matrix products the model needs, the way pod users compare runs (PaLM's
MFU, MaxText's `calculate_tflops_training_per_device`): a multiply-add is 2 FLOPs, and a step
is one forward pass and a backward pass of twice its cost (3x the forward) for everything that
trains. Counted per global batch of B rows of T tokens:

  * trunk: each layer's q, k, v, o projections and its SwiGLU MLP (3 matrices);
  * attention: scores (QK^T) and values (PV) of the trunk's layers and of heads that attend.
    Causal attention needs T(T+1)/2 query-key pairs per row and head, and that is what is
    counted (`attention='causal'`, MaxText's convention); the program computes the full T x T
    square and masks it, which `attention='full'` counts (to compare with XLA). Packing several
    documents into a row masks more pairs but computes the same square, so packing does not
    change either count;
  * heads (`mtp.model.heads`): each family counts its own forward pass
    (`HeadFamily.train_flops`: its matmuls, its attention, and what remat recomputes of them),
    with the layer counts of `mtp.model.flops` that this module counts the trunk with;
  * output layer: the shared D x V unembedding over every row that reaches the loss: B*T for the
    next token plus K*B*(T / mtp_head_loss_stride) for the heads. The fused loss computes the
    logits, the input gradient and the weight gradient of each chunk once (3x the forward), or
    2x when the output layer is frozen; soft labels (`distill.soft_labels`) add the teacher's
    logits over the heads' rows (1x their forward). A draft vocabulary of N ids
    (`mtp_head_draft_vocab`) makes the heads' rows D x N.

What the count leaves out, on purpose:
  * elementwise work: norms, rotary embeddings, softmax, SiLU, the loss's exp/log, the
    optimizer's update. XLA's `cost_analysis()['flops']` counts those too, so it reads a few
    percent higher than the model FLOPs on small models (the gap shrinks as D and T grow);
  * remat's recomputation (`model.remat`): reported apart, as `StepFlops.remat_recompute`, and
    not part of `total` (MFU counts the model's FLOPs, not the ones spent saving memory).
  * Embedding lookups are gathers, not matmuls (0 FLOPs).

With `optim.mode='frozen_trunk'` the trunk runs forward only (its parameters get no gradient,
so no backward pass is computed through it), and with `distill.cache_trunk_states` not at all.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import ml_collections

from mtp.model import flops as model_flops
from mtp.model import mtp_model

# The layer counts and the head families' error, where the families (which must not import
# mtp.train) find them; re-exported for this module's callers.
AttentionCount = model_flops.AttentionCount
UnknownHeadFamily = model_flops.UnknownHeadFamily
block_matmul_flops = model_flops.block_matmul_flops
attention_flops = model_flops.attention_flops

# Peak dense bf16 matmul throughput per chip (one JAX device), TFLOP/s, keyed by
# `jax.devices()[0].device_kind` as JAX reports it. TPU kinds are those JAX's own Pallas TPU
# code matches (jax/_src/pallas/mosaic/tpu_info.py: "TPU v5 lite" is v5e, "TPU v5" is v5p,
# "TPU v6 lite" is v6e); GPU kinds are the CUDA device names, matched by prefix below.
# Sources: cloud.google.com/tpu/docs/v4 (275), /v5e (197), /v5p (459), /v6e (918); NVIDIA's
# A100 datasheet (312 bf16 dense), H100 datasheet (SXM 989, PCIe 756, NVL 835; the sheets'
# larger figures are with 2:4 sparsity) and H200 datasheet (989, the H100 SXM's Tensor Cores).
PEAK_TFLOPS_BY_DEVICE_KIND: Mapping[str, float] = {
    'TPU v4': 275.0,
    'TPU v5 lite': 197.0,
    'TPU v5e': 197.0,
    'TPU v5': 459.0,
    'TPU v5p': 459.0,
    'TPU v6 lite': 918.0,
    'TPU v6e': 918.0,
}
# CUDA names carry the board after the model ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB
# HBM3", "NVIDIA H100 PCIe"): the longest matching prefix decides.
PEAK_TFLOPS_BY_GPU_PREFIX: Mapping[str, float] = {
    'NVIDIA A100': 312.0,
    'NVIDIA H100': 989.0,
    'NVIDIA H100 PCIe': 756.0,
    'NVIDIA H100 NVL': 835.0,
    'NVIDIA H200': 989.0,
}

def peak_tflops(device_kind: str) -> float | None:
  """The chip's peak dense bf16 TFLOP/s, or None when it is not in the tables (CPU, others)."""
  if device_kind in PEAK_TFLOPS_BY_DEVICE_KIND:
    return PEAK_TFLOPS_BY_DEVICE_KIND[device_kind]
  prefixes = [p for p in PEAK_TFLOPS_BY_GPU_PREFIX if device_kind.startswith(p)]
  if not prefixes:
    return None
  return PEAK_TFLOPS_BY_GPU_PREFIX[max(prefixes, key=len)]


@dataclasses.dataclass(frozen=True)
class StepFlops:
  """Model FLOPs of one train step over the global batch, by part (forward + backward).

  Attributes:
    trunk: the trunk layers' projections and MLPs.
    attention: attention scores and values (trunk and attending heads).
    heads: the heads' own matmuls (their attention is under `attention`).
    output_layer: the shared unembedding over every row that reaches the loss.
    remat_recompute: forward work `model.remat` recomputes in the backward pass; not in `total`.
    tokens: B * T, the tokens of one step.
  """
  trunk: float
  attention: float
  heads: float
  output_layer: float
  remat_recompute: float
  tokens: int

  @property
  def total(self) -> float:
    return self.trunk + self.attention + self.heads + self.output_layer

  @property
  def per_token(self) -> float:
    return self.total / self.tokens


def _head_forward(model_cfg: mtp_model.ModelConfig, batch_size: int, seq_len: int,
                  count: AttentionCount, head_positions: int) -> model_flops.HeadFlops:
  """The heads' forward FLOPs, counted by their family (nothing without heads); a family that
  computes only the `head_positions` positions its losses read is told their number."""
  if not model_cfg.mtp_num_heads:
    return model_flops.HeadFlops(0.0, 0.0, 0.0)
  extra = {}
  if model_cfg.family.TRAINS_AT_HEAD_POSITIONS:
    extra['head_positions'] = head_positions
  return model_cfg.family.train_flops(model_cfg.trunk, model_cfg.mtp_num_heads,
                                      model_cfg.options, batch_size, seq_len, count, **extra)


def train_step_flops(config: ml_collections.ConfigDict,
                     attention: AttentionCount = 'causal') -> StepFlops:
  """Model FLOPs of one train step of `config` (see the module docstring for what counts).

  Args:
    config: a training config (configs/base.py).
    attention: 'causal' counts the query-key pairs causal attention needs (model FLOPs);
      'full' the T x T square the program computes.

  Raises:
    ValueError: an unknown attention count or head family; `UnknownHeadFamily` (a ValueError)
      for a family without a count.
  """
  if attention not in ('causal', 'full'):
    raise ValueError(f"attention must be 'causal' or 'full', got {attention!r}.")
  model_cfg = mtp_model.ModelConfig.from_config(config.model)
  cfg, num_heads = model_cfg.trunk, model_cfg.mtp_num_heads
  b, t = config.data.batch_size, config.data.seq_len
  tokens = b * t
  frozen_trunk = config.optim.mode == 'frozen_trunk'
  distill = config.get('distill')
  trunk_cached = frozen_trunk and distill is not None and distill.get('cache_trunk_states')
  trunk_is_teacher = frozen_trunk and distill is not None and distill.targets != 'text'

  # Forward and backward: 3x a trained part's forward, 1x a frozen one's, 0x a cached one's.
  trunk_passes = 0 if trunk_cached else (1 if frozen_trunk else 3)
  trunk_fwd = cfg.num_layers * block_matmul_flops(cfg, tokens)
  trunk_attention_fwd = cfg.num_layers * attention_flops(cfg, b, t, attention)
  stride = config.get('mtp_head_loss_stride', 1)
  head_fwd, head_attention_fwd, head_remat_fwd = _head_forward(model_cfg, b, t, attention,
                                                               t // stride)
  head_rows = num_heads * b * (t // stride)
  head_vocab = config.get('mtp_head_draft_vocab') or cfg.vocab_size
  soft_labels = bool(distill is not None and distill.get('soft_labels'))
  output_passes = 2 if frozen_trunk else 3  # A frozen output layer gets no weight gradient.
  trunk_rows = 0 if trunk_is_teacher else tokens
  output_layer = 2.0 * cfg.embed_dim * output_passes * (trunk_rows * cfg.vocab_size
                                                        + head_rows * head_vocab)
  teacher_fwd = 2.0 * cfg.embed_dim * head_vocab * head_rows if soft_labels else 0.0

  remat = 0.0
  if cfg.remat != 'none':  # Every policy recomputes the heads' transformer layers whole.
    remat += head_remat_fwd
  if cfg.remat == 'full' and trunk_passes == 3:  # 'dots_saveable' keeps the matmuls' outputs.
    remat += trunk_fwd + trunk_attention_fwd
  return StepFlops(trunk=trunk_passes * trunk_fwd,
                   attention=trunk_passes * trunk_attention_fwd + 3 * head_attention_fwd,
                   heads=3 * head_fwd,
                   output_layer=output_layer + teacher_fwd,
                   remat_recompute=remat, tokens=tokens)


def throughput_metrics(flops_per_token: float, tokens_per_sec: float, num_devices: int,
                       device_kind: str) -> dict[str, float]:
  """The training record's `tflops_per_sec_per_device`, and `mfu` (a fraction of the chip's
  peak) when `device_kind`'s peak is known.

  Args:
    flops_per_token: `StepFlops.per_token`.
    tokens_per_sec: tokens trained per second, all devices together.
    num_devices: devices the step runs on (all processes').
    device_kind: `jax.devices()[0].device_kind`.
  """
  tflops = flops_per_token * tokens_per_sec / num_devices / 1e12
  out = {'tflops_per_sec_per_device': tflops}
  peak = peak_tflops(device_kind)
  if peak is not None:
    out['mfu'] = tflops / peak
  return out
