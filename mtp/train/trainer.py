"""Jitted train and eval steps over a device mesh, and the training loop around them.

The model is split once with `nnx.split`: the graph definition stays static and the parameters
travel as an `nnx.State` pytree with explicit shardings, so each step is a plain `jax.jit`
function with the train state donated.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import shutil
import signal
import time
from typing import Any, Callable, Iterator

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax import nnx

from mtp.checkpoint import checkpointing
from mtp.data import pipeline
from mtp.data import tokenizer as tokenizer_lib
from mtp.model import mtp_model
from mtp.parallel import mesh as mesh_lib
from mtp.train import loss as loss_lib
from mtp.train import optim
from mtp.train import trunk_cache
from mtp.train import writers

Array = jax.Array


@flax.struct.dataclass
class TrainState:
  step: Array
  params: nnx.State
  opt_state: Any


def validate_config(config: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
  """Raises ValueError naming the first invalid value, before anything is compiled."""
  model_cfg = mtp_model.ModelConfig.from_config(config.model)
  model_cfg.validate()
  optim.validate(config.optim, config.num_train_steps)
  for key in ('log_every_steps', 'eval_every_steps', 'checkpoint_every_steps'):
    if config[key] <= 0:
      raise ValueError(f'{key} must be positive, got {config[key]}.')
  if config.eval_steps < 0:
    raise ValueError(f'eval_steps must be >= 0, got {config.eval_steps}.')
  if config.mtp_loss_scaling_factor < 0:
    raise ValueError('mtp_loss_scaling_factor must be >= 0, got '
                     f'{config.mtp_loss_scaling_factor}.')
  if not 1 <= config.mtp_head_loss_stride <= config.data.seq_len:
    raise ValueError('mtp_head_loss_stride must be between 1 and data.seq_len, got '
                     f'{config.mtp_head_loss_stride}.')
  if config.data.seq_len < 2:
    raise ValueError(f'data.seq_len must be at least 2, got {config.data.seq_len}.')
  if config.data.seq_len > config.model.max_seq_len:
    raise ValueError(f'data.seq_len ({config.data.seq_len}) exceeds the model\'s maximum '
                     f'sequence length model.max_seq_len ({config.model.max_seq_len}).')
  _validate_distill(config)
  if config.data.tokenizer not in ('bpe', 'byte'):
    raise ValueError(f"data.tokenizer must be 'bpe' or 'byte', got {config.data.tokenizer!r}.")
  if num_devices is not None:
    shape = dict(zip(mesh_lib.MESH_AXES, mesh_lib.resolve_mesh_shape(config.mesh, num_devices)))
    shards = shape['data'] * shape['fsdp']
    if config.data.batch_size % shards:
      raise ValueError(f'data.batch_size ({config.data.batch_size}) must be divisible by the '
                       f'mesh\'s data x fsdp size ({shards}).')


# 'text': the corpus; 'teacher': the base trunk's greedy next token on the corpus; 'rollout': the
# base trunk's greedy continuations of prompts cut from the corpus (see `trunk_cache`).
DISTILL_TARGETS = ('text', 'teacher', 'rollout')


def _validate_distill(config: ml_collections.ConfigDict) -> None:
  distill = config.get('distill')
  if distill is None:
    return
  if distill.targets not in DISTILL_TARGETS:
    raise ValueError(f'distill.targets must be one of {DISTILL_TARGETS}, got '
                     f'{distill.targets!r}.')
  if distill.targets != 'text' and not config.get('init_from'):
    raise ValueError(f"distill.targets={distill.targets!r} needs init_from: the pretrained "
                     'workdir whose trunk is the teacher.')
  if distill.targets == 'rollout':
    if not 1 <= distill.get('prompt_len', 0) < config.data.seq_len:
      raise ValueError('distill.prompt_len must be in [1, data.seq_len), got '
                       f'{distill.get("prompt_len")} for seq_len {config.data.seq_len}.')
    if jax.process_count() > 1:
      raise ValueError("distill.targets='rollout' runs in a single process only.")
  if distill.cache_trunk_states:
    if config.optim.mode != 'frozen_trunk' or not config.get('init_from'):
      raise ValueError('distill.cache_trunk_states needs optim.mode=\'frozen_trunk\' and '
                       f'init_from (got mode {config.optim.mode!r}, init_from '
                       f'{config.get("init_from")!r}): only a frozen trunk\'s states can be '
                       'reused.')
    if jax.process_count() > 1:
      raise ValueError('distill.cache_trunk_states runs in a single process only.')
  if distill.batch_size <= 0:
    raise ValueError(f'distill.batch_size must be positive, got {distill.batch_size}.')


def _uses_trunk_cache(config: ml_collections.ConfigDict) -> bool:
  distill = config.get('distill')
  return distill is not None and (distill.targets != 'text' or distill.cache_trunk_states)


class Trainer:
  """Compiled initialisation, train and eval steps for one config on one mesh."""

  def __init__(self, config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh):
    self.config = config
    self.mesh = mesh
    self.model_config = mtp_model.ModelConfig.from_config(config.model)
    abstract_model = nnx.eval_shape(
        lambda: mtp_model.MTPModel(self.model_config, rngs=nnx.Rngs(config.seed)))
    self.graphdef, abstract_params = nnx.split(abstract_model)
    self.param_shardings = mesh_lib.state_shardings(abstract_params, mesh)
    self.optimizer = optim.make_optimizer(config.optim, config.num_train_steps, abstract_params)
    self._is_head = jax.tree.map(lambda g: g == 'heads', optim.param_groups(abstract_params))
    self.batch_sharding = mesh_lib.batch_sharding(mesh)
    # A frozen trunk learning from its own greedy tokens has a constant loss: skip it.
    distill = config.get('distill')
    self._trunk_is_teacher = (config.optim.mode == 'frozen_trunk' and distill is not None
                              and distill.targets != 'text')
    self.loss_weights = loss_lib.head_weights(self.model_config.mtp_num_heads,
                                              config.mtp_head_weight_decay)

    # Compiling initialisation yields the optimizer state's shardings too (propagated from the
    # parameters') without allocating anything.
    self._init_compiled = jax.jit(self._init).lower().compile()
    self.state_shardings = self._init_compiled.output_shardings
    self.abstract_state = jax.eval_shape(self._init)
    self.train_step = jax.jit(self._train_step, donate_argnums=0,
                              in_shardings=(self.state_shardings, self.batch_sharding),
                              out_shardings=(self.state_shardings, None))
    self.eval_step = jax.jit(self._eval_step,
                             in_shardings=(self.state_shardings.params, self.batch_sharding))

  def init_state(self) -> TrainState:
    return self._init_compiled()

  def abstract_state_with_shardings(self) -> TrainState:
    return checkpointing.abstract_with_shardings(self.abstract_state, self.state_shardings)

  def model(self, params: nnx.State) -> mtp_model.MTPModel:
    return nnx.merge(self.graphdef, params)

  def _init(self) -> TrainState:
    model = mtp_model.MTPModel(self.model_config, rngs=nnx.Rngs(self.config.seed))
    params = nnx.state(model)
    params = jax.lax.with_sharding_constraint(params, self.param_shardings)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=self.optimizer.init(params))

  def _loss(self, params: nnx.State, batch: dict[str, Array], step: Array | None = None):
    """Training (step given) computes the heads' losses at every `mtp_head_loss_stride`-th
    position, rotating with the step; evaluation (step None) at every position."""
    model = nnx.merge(self.graphdef, params)
    if trunk_cache.HIDDEN in batch:  # The frozen trunk ran once, ahead of training.
      hidden = model.outputs_from_trunk(batch[trunk_cache.HIDDEN], batch['tokens'],
                                        batch['positions'], batch['segment_ids'])
    else:
      hidden = model(batch['tokens'], batch['positions'], batch['segment_ids'])
    labels = batch.get(trunk_cache.TARGETS, batch['tokens'])
    stride = self.config.mtp_head_loss_stride
    positions = None
    if step is not None and stride > 1:
      positions = loss_lib.head_positions(batch['tokens'].shape[1], stride, step)
    out = loss_lib.mtp_loss(hidden, model.unembedding(), labels, batch['segment_ids'],
                            loss_scaling_factor=self.config.mtp_loss_scaling_factor,
                            weights=self.loss_weights, chunk_size=self.config.loss_chunk_size,
                            positions=positions, head_mask=batch.get(trunk_cache.HEAD_MASK),
                            trunk_is_teacher=self._trunk_is_teacher
                            and trunk_cache.TARGETS in batch,
                            train_unembedding=self.config.optim.mode != 'frozen_trunk')
    return out.total, out.metrics

  def _train_step(self, state: TrainState, batch: dict[str, Array]):
    params = state.params
    if self.config.optim.mode == 'frozen_trunk':
      # No gradient flows into the trunk, so its backward pass is never computed.
      params = jax.tree.map(lambda p, head: p if head else jax.lax.stop_gradient(p),
                            params, self._is_head)
    (_, metrics), grads = jax.value_and_grad(self._loss, has_aux=True)(params, batch,
                                                                        state.step)
    updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    metrics['grad_norm'] = optax.global_norm(grads)
    return TrainState(step=state.step + 1, params=new_params, opt_state=opt_state), metrics

  def _eval_step(self, params: nnx.State, batch: dict[str, Array]):
    return self._loss(params, batch)[1]

  def evaluate(self, params: nnx.State, batches: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """Token-weighted means of the eval metrics over `batches`."""
    totals: dict[str, float] = {}
    weight = 0.0
    for batch in batches:
      metrics = jax.device_get(self.eval_step(params, mesh_lib.shard_batch(batch, self.mesh)))
      n = float(metrics['num_tokens'])
      weight += n
      for k, v in metrics.items():
        if k != 'num_tokens':
          totals[k] = totals.get(k, 0.0) + float(v) * n
    return {k: v / max(weight, 1.0) for k, v in totals.items()}


@dataclasses.dataclass
class _Interval:
  """Metrics accumulated on device between two log steps."""
  start_time: float
  metrics: list = dataclasses.field(default_factory=list)
  tokens: int = 0

  def summary(self) -> dict[str, float]:
    fetched = jax.device_get(self.metrics)
    out = {k: float(np.mean([m[k] for m in fetched])) for k in fetched[0] if k != 'num_tokens'}
    out['tokens_per_sec'] = self.tokens / max(time.perf_counter() - self.start_time, 1e-9)
    return out


# Model settings that change how it runs, not what its parameters are.
_RUNTIME_MODEL_KEYS = frozenset({'remat', 'dtype'})


def check_workdir_matches(workdir: pathlib.Path, config: ml_collections.ConfigDict) -> None:
  """A workdir's saved model and tokenizer settings must match the config resuming it."""
  path = workdir / checkpointing.CONFIG_FILENAME
  if not path.exists():
    return
  saved = checkpointing.load_config(workdir)
  mismatched = [f'model.{k}: {saved.model[k]!r} in the workdir, {config.model[k]!r} now'
                for k in config.model if k in saved.model and k not in _RUNTIME_MODEL_KEYS and
                _normalise(saved.model[k]) != _normalise(config.model[k])]
  for key in ('tokenizer', 'seq_len', 'corpus'):
    if _normalise(saved.data.get(key)) != _normalise(config.data.get(key)):
      mismatched.append(f'data.{key}: {saved.data.get(key)!r} in the workdir, '
                        f'{config.data.get(key)!r} now')
  if mismatched:
    raise ValueError(f'The config does not match the existing workdir {workdir}: '
                     + '; '.join(mismatched) + '. Use a new --workdir or the saved config.')


def _normalise(value):
  return json.loads(json.dumps(value, default=list))


def _prepare_tokenizer(config, workdir: pathlib.Path):
  if jax.process_index() == 0:
    tokenizer = pipeline.load_or_build_tokenizer(config.data, config.model.vocab_size, workdir)
  _sync('tokenizer')
  if jax.process_index() != 0:
    tokenizer = pipeline.load_or_build_tokenizer(config.data, config.model.vocab_size, workdir)
  if tokenizer.vocab_size > config.model.vocab_size:
    raise ValueError(f'The tokenizer in {workdir} has {tokenizer.vocab_size} ids but '
                     f'model.vocab_size is {config.model.vocab_size}: the vocabulary does not '
                     'match this workdir.')
  return tokenizer


def _adopt_tokenizer(source: pathlib.Path, workdir: pathlib.Path) -> None:
  """A workdir initialised from another one starts with that workdir's tokenizer (and its
  special ids, for an imported pretrained model)."""
  target = workdir / tokenizer_lib.FILENAME
  if jax.process_index() == 0 and not target.exists():
    if not (source / tokenizer_lib.FILENAME).exists():
      raise checkpointing.CheckpointError(f'init_from: {source / tokenizer_lib.FILENAME} does '
                                          'not exist.')
    specials = source / tokenizer_lib.SPECIAL_IDS_FILENAME
    if specials.exists():  # First: whoever sees tokenizer.json sees its special ids too.
      shutil.copyfile(specials, workdir / tokenizer_lib.SPECIAL_IDS_FILENAME)
    shutil.copyfile(source / tokenizer_lib.FILENAME, target)
  _sync('adopt-tokenizer')


def _same_trunk(a, b) -> bool:
  """Equal trunk settings; floats need only agree to float32 precision (1e-5 vs the float32
  9.9999997e-06 read from a GGUF file are the same epsilon)."""
  for field in dataclasses.fields(a):
    x, y = getattr(a, field.name), getattr(b, field.name)
    if isinstance(x, float) or isinstance(y, float):
      if not math.isclose(x, y, rel_tol=1e-6):
        return False
    elif x != y:
      return False
  return True


def _with_pretrained_trunk(params: nnx.State, source: str, trainer: Trainer) -> nnx.State:
  """`params` with the trunk replaced by the one in workdir `source` (its latest step).

  The source may have other heads or none; its trunk must have the same shape.
  """
  source_config = checkpointing.load_config(source)
  source_model = mtp_model.ModelConfig.from_config(source_config.model)
  runtime = {k: getattr(trainer.model_config.trunk, k) for k in _RUNTIME_MODEL_KEYS}
  if not _same_trunk(dataclasses.replace(source_model.trunk, **runtime),
                     trainer.model_config.trunk):
    raise ValueError(f'init_from: the trunk in {source} ({source_model.trunk}) does not match '
                     f'the configured trunk ({trainer.model_config.trunk}).')
  abstract = nnx.eval_shape(lambda: mtp_model.MTPModel(source_model, rngs=nnx.Rngs(0)))
  _, abstract_params = nnx.split(abstract)
  shardings = mesh_lib.state_shardings(abstract_params, trainer.mesh)
  target = checkpointing.abstract_with_shardings(abstract_params, shardings)
  checkpointer = checkpointing.Checkpointer(source, read_only=True)
  try:
    step = checkpointer.latest_step()
    if step is None:
      raise checkpointing.CheckpointError(f'init_from: {source} holds no checkpoint.')
    restored, _ = checkpointer.restore(step, target)
  finally:
    checkpointer.close()
  values = nnx.to_pure_dict(params)
  values['trunk'] = nnx.to_pure_dict(restored)['trunk']
  nnx.replace_by_pure_dict(params, values)
  return params


def _with_trunk_cache(config, workdir: pathlib.Path, trainer: Trainer,
                      arrays: dict[str, np.ndarray], base_params: Callable[[], nnx.State],
                      max_rows: int | None = None) -> dict[str, np.ndarray]:
  """The rows plus what `distill` asks of the init_from trunk, built once under the workdir.

  With distill.targets='rollout' the rows themselves are replaced: at most `max_rows` prompts
  cut from them, each continued greedily by the trunk. `base_params` gives the parameters with
  the base trunk (called only when something has to be built).
  """
  source = pathlib.Path(config.init_from).absolute()
  checkpointer = checkpointing.Checkpointer(source, read_only=True)
  try:
    source_step = checkpointer.latest_step()
  finally:
    checkpointer.close()
  distill = config.distill
  store_hidden = bool(distill.cache_trunk_states)
  description = f'{trainer.model_config.trunk}|{source}|step {source_step}'
  hidden = [trunk_cache.HIDDEN] if store_hidden else []
  if distill.targets == 'rollout':
    prompts = trunk_cache.rollout_prompts(arrays, distill.prompt_len)[:max_rows]
    seq_len = arrays['tokens'].shape[1]
    key = trunk_cache.cache_key({'prompts': prompts}, f'{description}|rollout to {seq_len}',
                                store_hidden)
    names = ['tokens', 'segment_ids', 'positions', trunk_cache.TARGETS,
             trunk_cache.HEAD_MASK] + hidden
  else:
    key = trunk_cache.cache_key(arrays, description, store_hidden)
    names = [trunk_cache.TARGETS] + hidden
  directory = workdir / 'trunk_cache' / key
  if all((directory / f'{name}.npy').exists() for name in names):
    cached = trunk_cache.load(directory, names)
  elif distill.targets == 'rollout':
    # The teacher is always the source's trunk, also when resuming a fine-tuned one.
    rollout = functools.partial(trunk_cache.rollout_forward(trainer.graphdef, seq_len),
                                base_params())
    logging.info('Greedy continuations by the trunk of %s of %d prompts of %d tokens, to %d '
                 'tokens -> %s.', source, prompts.shape[0], prompts.shape[1], seq_len,
                 directory)
    cached = trunk_cache.build_rollouts(prompts, rollout, directory, seq_len=seq_len,
                                        batch_size=distill.batch_size,
                                        store_hidden=store_hidden)
  else:
    forward = functools.partial(trunk_cache.trunk_forward(trainer.graphdef), base_params())
    logging.info('One pass of the trunk of %s over %d rows -> %s.', source,
                 arrays['tokens'].shape[0], directory)
    cached = trunk_cache.build(arrays, forward, directory, batch_size=distill.batch_size,
                               store_hidden=store_hidden)
  if distill.targets == 'rollout':
    return cached
  if distill.targets == 'text':
    del cached[trunk_cache.TARGETS]
  return {**arrays, **cached}


def _saves_heads_only(config) -> bool:
  """A frozen pretrained trunk is already saved in its own workdir: keep only the heads."""
  return bool(config.get('init_from')) and config.optim.mode == 'frozen_trunk'


def _heads_of(params: nnx.State) -> nnx.State:
  return nnx.State({'heads': params['heads']})


def _with_heads(params: nnx.State, heads: nnx.State) -> nnx.State:
  """`params` with its heads replaced by those of `heads` (a state holding 'heads')."""
  values = nnx.to_pure_dict(params)
  values['heads'] = nnx.to_pure_dict(heads)['heads']
  nnx.replace_by_pure_dict(params, values)
  return params


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


class _StopRequest:
  """Turns SIGTERM into a request to save and stop at the next step boundary."""

  def __init__(self):
    self.requested = False
    self._previous = None

  def __enter__(self):
    try:
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # Not the main thread: no signal handling.
      self._previous = None
    return self

  def _handle(self, signum, frame):
    del signum, frame
    logging.warning('SIGTERM received: saving a checkpoint and stopping.')
    self.requested = True

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | pathlib.Path, *,
                       stop_after_step: int | None = None,
                       on_metrics: Callable[[dict], None] | None = None) -> dict[str, float]:
  """Trains (or resumes training) in `workdir` and returns the last logged metrics.

  Args:
    config: see configs/base.py.
    workdir: checkpoints, config.json, tokenizer.json, metrics.jsonl and TensorBoard events.
    stop_after_step: stop (with a checkpoint) after this step, as if preempted; for tests.
    on_metrics: called with every logged metrics dict.
  """
  workdir = pathlib.Path(workdir)
  validate_config(config, jax.device_count())
  workdir.mkdir(parents=True, exist_ok=True)
  check_workdir_matches(workdir, config)
  checkpointing.save_config(workdir, config)
  if config.get('init_from'):
    _adopt_tokenizer(pathlib.Path(config.init_from), workdir)
  heads_only = _saves_heads_only(config)
  if heads_only:
    checkpointing.write_base_reference(workdir, config.init_from)
  tokenizer = _prepare_tokenizer(config, workdir)
  cache_dir = workdir / 'data_cache'
  train_arrays = pipeline.load_or_build_split(config.data, tokenizer, 'train', cache_dir)
  valid_arrays = pipeline.load_or_build_split(config.data, tokenizer, 'valid', cache_dir)

  mesh = mesh_lib.make_mesh(config.mesh)
  trainer = Trainer(config, mesh)
  if _uses_trunk_cache(config):
    base_params = functools.cache(lambda: _with_pretrained_trunk(
        trainer.init_state().params, config.init_from, trainer))
    train_arrays = _with_trunk_cache(config, workdir, trainer, train_arrays, base_params)
    if config.distill.targets == 'rollout' and config.eval_steps:
      # Held-out continuations: the eval metrics then measure what decoding will accept.
      valid_arrays = _with_trunk_cache(config, workdir, trainer, valid_arrays, base_params,
                                       max_rows=config.eval_steps * config.data.batch_size)
    base_params.cache_clear()
  iterator = pipeline.make_train_iterator(train_arrays, config.data.batch_size, config.seed,
                                          jax.process_index(), jax.process_count())
  eval_batches = pipeline.make_eval_batches(valid_arrays, config.data.batch_size,
                                            config.eval_steps, jax.process_index(),
                                            jax.process_count()) if config.eval_steps else []
  checkpointer = checkpointing.Checkpointer(workdir, config.keep_checkpoints)
  start_step = checkpointer.latest_step() or 0
  if start_step:
    abstract = trainer.abstract_state_with_shardings()
    saved = _heads_of(abstract.params) if heads_only else abstract.params
    params, opt_state = checkpointer.restore(start_step, saved, abstract.opt_state, iterator)
    if heads_only:  # The frozen trunk comes from the base workdir, as it did at step 0.
      params = _with_heads(
          _with_pretrained_trunk(trainer.init_state().params, config.init_from, trainer), params)
    state = TrainState(step=jax.device_put(jnp.asarray(start_step, jnp.int32),
                                           trainer.state_shardings.step),
                       params=params, opt_state=opt_state)
    logging.info('Resumed from step %d in %s.', start_step, workdir)
  elif config.get('init_from'):
    state = trainer.init_state()
    state = state.replace(params=_with_pretrained_trunk(state.params, config.init_from, trainer))
    logging.info('Initialised the trunk from %s.', config.init_from)
  else:
    state = trainer.init_state()
  num_params = sum(x.size for x in jax.tree.leaves(state.params))
  logging.info('Model: %s parameters, %s.', f'{num_params:,}', trainer.model_config)

  writer = writers.MetricWriter(workdir, resume_from_step=start_step,
                                progress_total=config.num_train_steps, initial=start_step,
                                show_progress=config.progress_bar and jax.process_index() == 0)
  tokens_per_batch = config.data.batch_size * config.data.seq_len
  last_metrics: dict[str, float] = {}
  last_step = config.num_train_steps
  if stop_after_step is not None:
    last_step = min(last_step, stop_after_step)
  if start_step >= last_step:
    logging.info('%s is already trained to step %d (num_train_steps=%d).', workdir, start_step,
                 config.num_train_steps)
  interval = None
  try:
    with _StopRequest() as stop:
      for step in range(start_step + 1, last_step + 1):
        batch = mesh_lib.shard_batch(next(iterator), mesh)
        state, metrics = trainer.train_step(state, batch)
        if interval is None:  # Leave compilation out of the throughput.
          jax.block_until_ready(metrics)
          interval = _Interval(time.perf_counter())
        else:
          interval.metrics.append(metrics)
          interval.tokens += tokens_per_batch
        if step % config.log_every_steps == 0 or step == last_step:
          if not interval.metrics:
            interval.metrics.append(metrics)
          last_metrics = {'step': step, **interval.summary()}
          writer.write(last_metrics)
          if on_metrics:
            on_metrics(last_metrics)
          interval = _Interval(time.perf_counter())
        if eval_batches and (step % config.eval_every_steps == 0 or step == last_step):
          eval_start = time.perf_counter()
          eval_metrics = {f'eval_{k}': v for k, v in
                          trainer.evaluate(state.params, eval_batches).items()}
          writer.write({'step': step, **eval_metrics})
          last_metrics.update(eval_metrics)
          interval.start_time += time.perf_counter() - eval_start  # Not training time.
        writer.advance()
        if (step % config.checkpoint_every_steps == 0 or step == last_step or stop.requested):
          checkpointer.save(step, _heads_of(state.params) if heads_only else state.params,
                            state.opt_state, iterator, force=True)
        if stop.requested:
          break
  finally:
    checkpointer.close()
    writer.close()
  return last_metrics
