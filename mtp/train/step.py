"""Jitted train and eval steps over a device mesh, and the batch type they read.

The model is split once with `nnx.split`: the graph definition stays static and the parameters
travel as an `nnx.State` pytree with explicit shardings, so each step is a plain `jax.jit`
function with the train state donated.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from mtp.checkpoint import checkpointing
from mtp.checkpoint import param_tree
from mtp.model import mtp_model
from mtp.parallel import mesh as mesh_lib
from mtp.train import divergence
from mtp.train import loss as loss_lib
from mtp.train import optim

Array = jax.Array

# The fields a batch may carry beside tokens, positions and segment ids (see `Batch`).
OPTIONAL_FIELDS = ('targets', 'head_mask', 'trunk_hidden', 'trunk_layer_inputs')


@flax.struct.dataclass
class TrainState:
  step: Array
  params: nnx.State
  opt_state: Any


@flax.struct.dataclass
class Batch:
  """One global batch of packed rows; B rows of T tokens.

  The optional fields are None or present for a whole run (the config decides which, see
  `distill.batch_fields`); being part of the pytree's structure, they are static under `jit`.

  Attributes:
    tokens, positions, segment_ids: [B, T] int32.
    targets: [B, T] int32 labels read in place of `tokens` (self-distillation), or None.
    head_mask: [B, T] bool, the positions whose heads' losses count, or None for all.
    trunk_hidden: [B, T, D] float32, the frozen trunk's last hidden state computed ahead of
      training, or None to run the trunk.
    trunk_layer_inputs: [B, T, M, D] float32, with `trunk_hidden` for families that read
      trunk layer inputs: those of the model's M `trunk_layer_inputs` layers, in order.
  """
  tokens: Array
  positions: Array
  segment_ids: Array
  targets: Array | None = None
  head_mask: Array | None = None
  trunk_hidden: Array | None = None
  trunk_layer_inputs: Array | None = None

  @classmethod
  def from_arrays(cls, arrays: Mapping[str, np.ndarray], fields: Sequence[str],
                  mesh: jax.sharding.Mesh) -> Batch:
    """This process's rows of `arrays` placed on the mesh: exactly the optional `fields`."""
    names = ('tokens', 'positions', 'segment_ids') + tuple(fields)
    missing = [name for name in names if name not in arrays]
    if missing:
      raise KeyError(f'The batch lacks {missing}; it has {sorted(arrays)}.')
    return cls(**mesh_lib.shard_batch({name: arrays[name] for name in names}, mesh))


class Trainer:
  """Compiled initialisation, train and eval steps for one config on one mesh.

  Args:
    config: see configs/base.py.
    mesh: the device mesh.
    train_fields, eval_fields: the optional `Batch` fields of train and eval batches.
    draft_ids: [N] the heads' draft vocabulary (`mtp_head_draft_vocab`), or None.
  """

  def __init__(self, config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh,
               train_fields: Sequence[str] = (), eval_fields: Sequence[str] = (),
               draft_ids: np.ndarray | None = None):
    if bool(config.get('mtp_head_draft_vocab')) != (draft_ids is not None):
      raise ValueError(f'mtp_head_draft_vocab is {config.get("mtp_head_draft_vocab")}: the '
                       'trainer needs its ids exactly then (draft_vocab.corpus_draft_vocabulary).')
    self.config = config
    self._draft_ids = None if draft_ids is None else np.asarray(draft_ids, np.int32)
    self.mesh = mesh
    self.train_fields, self.eval_fields = tuple(train_fields), tuple(eval_fields)
    self.model_config = mtp_model.ModelConfig.from_config(config.model)
    abstract_model = nnx.eval_shape(
        lambda: mtp_model.MTPModel(self.model_config, rngs=nnx.Rngs(config.seed)))
    self.graphdef, abstract_params = nnx.split(abstract_model)
    self.param_shardings = mesh_lib.state_shardings(abstract_params, mesh)
    self.optimizer = optim.make_optimizer(config.optim, config.num_train_steps, abstract_params)
    # The optimizer state is sharded as the parameters it mirrors: propagation alone leaves it
    # replicated (its zeros depend on no parameter), 2x the parameters' memory on every device.
    self.opt_state_shardings = mesh_lib.state_shardings(
        jax.eval_shape(self.optimizer.init, abstract_params), mesh)
    self._is_head = jax.tree.map(lambda part: part == param_tree.HEADS,
                                 param_tree.labels(abstract_params))
    self.batch_sharding = mesh_lib.batch_sharding(mesh)
    # A frozen trunk learning from its own greedy tokens has a constant loss: skip it.
    distill = config.get('distill')
    self._trunk_is_teacher = (config.optim.mode == 'frozen_trunk' and distill is not None
                              and distill.targets != 'text')
    self._soft_labels = bool(distill is not None and distill.get('soft_labels'))
    self.loss_weights = loss_lib.head_weights(self.model_config.mtp_num_heads,
                                              config.mtp_head_weight_decay)

    # XLA:GPU inlines the threefry hash into every fused kernel of the random initialisation:
    # compiling SmolLM2 with an EAGLE-3 drafter ran over 7 minutes on an H200 without this
    # lowering (a kernel of its own, the same bits) and 13 s with it. Other backends ignore it.
    jax.config.update('jax_threefry_gpu_kernel_lowering', True)
    # The state's shardings follow from the parameters' (the step replicated), so nothing
    # compiles until a state is drawn: a resumed run never draws one, and a run from a
    # pretrained trunk draws its heads only (compiling SmolLM2's whole draw took 13 s on 2 CPU
    # cores, only to read its output shardings).
    self.state_shardings = TrainState(
        step=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
        params=self.param_shardings, opt_state=self.opt_state_shardings)
    self._init_fresh = jax.jit(self._init, out_shardings=self.state_shardings)
    self._init_on_trunk = jax.jit(self._init, out_shardings=self.state_shardings,
                                  donate_argnums=0)
    self.abstract_state = jax.eval_shape(self._init)
    self.train_step = jax.jit(self._train_step, donate_argnums=0,
                              in_shardings=(self.state_shardings, self.batch_sharding),
                              out_shardings=(self.state_shardings, None))
    self.eval_step = jax.jit(self._eval_step,
                             in_shardings=(self.state_shardings.params, self.batch_sharding))

  def init_state(self, trunk: nnx.State | None = None) -> TrainState:
    """A fresh train state: every parameter drawn at random, or the trunk's taken from `trunk`
    (a pretrained one, `init.pretrained_trunk`; donated), whose draw XLA then drops as dead
    code. (SmolLM2's draw, replicated over 8 simulated CPU devices, took 16 s, twice a run.)"""
    if trunk is None:
      return self._init_fresh()
    return self._init_on_trunk(trunk)

  def abstract_state_with_shardings(self) -> TrainState:
    return checkpointing.abstract_with_shardings(self.abstract_state, self.state_shardings)

  def train_batch(self, arrays: Mapping[str, np.ndarray]) -> Batch:
    """A host batch (numpy rows from the pipeline) as the train step reads it."""
    return Batch.from_arrays(arrays, self.train_fields, self.mesh)

  def eval_batch(self, arrays: Mapping[str, np.ndarray]) -> Batch:
    return Batch.from_arrays(arrays, self.eval_fields, self.mesh)

  def _init(self, trunk: nnx.State | None = None) -> TrainState:
    model = mtp_model.MTPModel(self.model_config, rngs=nnx.Rngs(self.config.seed))
    params = nnx.state(model)
    if trunk is not None:
      params = param_tree.replace(params, trunk)
    params = jax.lax.with_sharding_constraint(params, self.param_shardings)
    opt_state = jax.lax.with_sharding_constraint(self.optimizer.init(params),
                                                 self.opt_state_shardings)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state)

  def _loss(self, params: nnx.State, batch: Batch, step: Array | None = None):
    """Training (step given) computes the heads' losses at every `mtp_head_loss_stride`-th
    position, rotating with the step; evaluation (step None) at every position."""
    model = nnx.merge(self.graphdef, params)
    stride = self.config.mtp_head_loss_stride
    positions = None
    if step is not None and stride > 1:
      positions = loss_lib.head_positions(batch.tokens.shape[1], stride, step)
    with mesh_lib.activations_on(self.mesh):  # Every device computes its own rows only.
      if batch.trunk_hidden is not None:  # The frozen trunk ran once, ahead of training.
        layer_inputs = None
        if batch.trunk_layer_inputs is not None:
          layer_inputs = {i: batch.trunk_layer_inputs[:, :, m]
                          for m, i in enumerate(model.cfg.trunk_layer_inputs)}
        hidden = model.outputs_from_trunk(batch.trunk_hidden, batch.tokens, batch.positions,
                                          batch.segment_ids, layer_inputs, positions)
      else:
        hidden = model(batch.tokens, batch.positions, batch.segment_ids, positions)
      hidden = mesh_lib.constrain_batch(hidden, row_axis=1)  # [K+1, B, T, D]
    labels = batch.tokens if batch.targets is None else batch.targets
    out = loss_lib.mtp_loss(hidden, model.unembedding(), labels, batch.segment_ids,
                            loss_scaling_factor=self.config.mtp_loss_scaling_factor,
                            weights=self.loss_weights, chunk_size=self.config.loss_chunk_size,
                            positions=positions, head_mask=batch.head_mask,
                            trunk_is_teacher=self._trunk_is_teacher
                            and batch.targets is not None,
                            train_unembedding=self.config.optim.mode != 'frozen_trunk',
                            feature_loss_weight=model.feature_loss_weight,
                            soft_labels=self._soft_labels,
                            draft_ids=None if self._draft_ids is None
                            else jnp.asarray(self._draft_ids))
    return out.total, out.metrics

  def _train_step(self, state: TrainState, batch: Batch):
    def loss(params):
      if self.config.optim.mode == 'frozen_trunk':
        # Inside the differentiated function, so no gradient flows into the trunk and XLA
        # never computes its backward pass (applied to the arguments, it would change nothing).
        params = jax.tree.map(lambda p, head: p if head else jax.lax.stop_gradient(p),
                              params, self._is_head)
      return self._loss(params, batch, state.step)

    (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
    updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    metrics['grad_norm'] = optax.global_norm(grads)
    # A non-finite loss or gradient norm leaves the state as it was (see `divergence`).
    new_params, opt_state = divergence.keep_if_finite(
        divergence.finite(metrics), (new_params, opt_state), (state.params, state.opt_state))
    return TrainState(step=state.step + 1, params=new_params, opt_state=opt_state), metrics

  def _eval_step(self, params: nnx.State, batch: Batch):
    return self._loss(params, batch)[1]

  def evaluate(self, params: nnx.State, batches: list[Mapping[str, np.ndarray]]
               ) -> dict[str, float]:
    """Token-weighted means of the eval metrics over `batches` (host rows)."""
    totals: dict[str, float] = {}
    weight = 0.0
    for batch in batches:
      metrics = jax.device_get(self.eval_step(params, self.eval_batch(batch)))
      n = float(metrics['num_tokens'])
      weight += n
      for k, v in metrics.items():
        if k != 'num_tokens':
          totals[k] = totals.get(k, 0.0) + float(v) * n
    return {k: v / max(weight, 1.0) for k, v in totals.items()}
