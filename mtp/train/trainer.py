"""The training loop: `train_and_evaluate` runs the jitted steps of `step.Trainer` over the data,
logs metrics, evaluates, and checkpoints (also on SIGTERM or SIGUSR1, at the same step on
every process of a multi-process run).

Its parts live beside it: `config_checks` (the config and the workdir it resumes),
`workdir_tokenizer`, `init` (fresh, resumed or init_from state), `distill` (self-distillation
caches), `step` (the jitted steps and the batch type), `preemption` (stop signals) and
`divergence` (non-finite losses). The workdir is locked for the run (`workdir_lock`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import pathlib
import time
from typing import Callable

import jax
import ml_collections
import numpy as np
from absl import logging

from mtp.checkpoint import checkpointing
from mtp.checkpoint import paths
from mtp.checkpoint import workdir_lock
from mtp.data import pipeline
from mtp.data import shards
from mtp.data import streaming
from mtp.decode import draft_vocab
from mtp.parallel import mesh as mesh_lib
from mtp.train import distill
from mtp.train import divergence
from mtp.train import flops
from mtp.train import init
from mtp.train import long_context
from mtp.train import preemption
from mtp.train import profiling
from mtp.train import step as step_lib
from mtp.train import workdir_tokenizer
from mtp.train import writers
from mtp.train.config_checks import check_workdir_matches, validate_config  # noqa: F401


@dataclasses.dataclass
class _Interval:
  """Metrics accumulated on device between two log steps."""
  start_time: float
  metrics: list = dataclasses.field(default_factory=list)
  tokens: int = 0

  def summary(self) -> dict[str, float]:
    fetched = jax.device_get(self.metrics)
    # Steps the divergence guard skipped (max_bad_steps > 0) are left out of the means.
    fetched = [m for m in fetched if all(np.isfinite(m[k]) for k in divergence.WATCHED
                                         if k in m)] or fetched
    out = {k: float(np.mean([m[k] for m in fetched])) for k in fetched[0] if k != 'num_tokens'}
    out['tokens_per_sec'] = self.tokens / max(time.perf_counter() - self.start_time, 1e-9)
    return out


def _draft_ids(config: ml_collections.ConfigDict, tokenizer, workdir) -> np.ndarray:
  """The heads' draft vocabulary: the one this workdir keeps (a resumed run trains on the same
  ids, whatever the corpus holds now), else counted from the corpus and kept for decoding."""
  size = config.mtp_head_draft_vocab
  saved = checkpointing.load_draft_ids(workdir, config.model.vocab_size)
  if saved is None and config.get('init_heads_from'):  # The ids those heads learnt.
    saved = checkpointing.load_draft_ids(config.init_heads_from, config.model.vocab_size)
    if saved is not None:
      checkpointing.save_draft_ids(workdir, saved)
    else:
      logging.warning('init_heads_from=%s keeps no %s: its heads\' draft vocabulary is counted '
                      'from this corpus, which may differ from the one they learnt.',
                      config.init_heads_from, checkpointing.DRAFT_IDS_FILENAME)
  if saved is not None:
    if saved.shape[0] != size:
      raise ValueError(f'mtp_head_draft_vocab={size}, but this workdir\'s heads train on the '
                       f'{saved.shape[0]} ids of its {checkpointing.DRAFT_IDS_FILENAME}.')
    return saved
  ids = draft_vocab.corpus_draft_vocabulary(config, tokenizer, config.model.vocab_size, size,
                                            workdir, name='mtp_head_draft_vocab')
  checkpointing.save_draft_ids(workdir, ids)
  return ids


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | pathlib.Path, *,
                       stop_after_step: int | None = None,
                       on_metrics: Callable[[dict], None] | None = None) -> dict[str, float]:
  """Trains (or resumes training) in `workdir` and returns the last logged metrics.

  Args:
    config: see configs/base.py.
    workdir: checkpoints, config.json, tokenizer.json, metrics.jsonl and TensorBoard events.
    stop_after_step: stop (with a checkpoint) after this step, as if preempted; for tests.
    on_metrics: called with every logged metrics dict.

  Raises:
    ValueError: an invalid config, or one that does not match the workdir.
    workdir_lock.WorkdirLockedError: another process holds the workdir.
    checkpointing.CheckpointError: an unreadable checkpoint (left untouched).
    divergence.DivergenceError: a non-finite loss or gradient norm (more than
      `max_bad_steps` times); nothing is saved after the last good checkpoint.
    preemption.Preempted: SIGTERM or SIGUSR1 (to any process of a multi-process run), after
      saving a checkpoint.
  """
  preemption.begin()  # Several processes: agree on stop signals from here on, setup included.
  workdir = paths.as_path(workdir)  # Local, or on an object store (gs://...).
  validate_config(config, jax.device_count())
  profiling.parse_profile_steps(config.get('profile_steps', ''))  # A bad value fails here.
  with _workdir_held(workdir):
    return _train(config, workdir, stop_after_step, on_metrics)


@contextlib.contextmanager
def _workdir_held(workdir: pathlib.Path):
  """Process 0 holds the workdir's lock for the run (for all the processes of a multi-host one,
  which write through it)."""
  if jax.process_index() != 0:
    yield
    return
  with workdir_lock.WorkdirLock(workdir):
    yield


def _throughput_metrics(config: ml_collections.ConfigDict) -> Callable[[float], dict]:
  """tokens/s -> the record's `tflops_per_sec_per_device` (and `mfu` where the chip's peak is
  known), from the model FLOPs of a step (`flops`); nothing for a family it cannot count."""
  try:
    step_flops = flops.train_step_flops(config)
  except flops.UnknownHeadFamily as e:
    logging.warning('%s No TFLOP/s in the metrics.', e)
    return lambda tokens_per_sec: {}
  logging.info('Model FLOPs per step: %.4g (%.4g per token; remat recomputes %.4g more).',
               step_flops.total, step_flops.per_token, step_flops.remat_recompute)
  return functools.partial(flops.throughput_metrics, step_flops.per_token,
                           num_devices=jax.device_count(),
                           device_kind=jax.devices()[0].device_kind)


@dataclasses.dataclass(frozen=True)
class _Phase:
  """Steps reading one kind of row: the run's rows, or the long-context phase's."""
  iterator: pipeline.BatchIterator
  tokens_per_batch: int
  throughput: Callable[[float], dict]

  @classmethod
  def make(cls, config: ml_collections.ConfigDict, data: ml_collections.ConfigDict, arrays,
           seed: int, prefetch: int) -> _Phase:
    iterator = pipeline.make_train_iterator(arrays, data.batch_size, seed, jax.process_index(),
                                            jax.process_count(), prefetch=prefetch)
    flops_config = config.copy_and_resolve_references()
    flops_config.data = data
    return cls(iterator, data.batch_size * data.seq_len, _throughput_metrics(flops_config))


def _train(config: ml_collections.ConfigDict, workdir: pathlib.Path,
           stop_after_step: int | None, on_metrics: Callable[[dict], None] | None
           ) -> dict[str, float]:
  workdir.mkdir(parents=True, exist_ok=True)
  check_workdir_matches(workdir, config)
  if config.get('init_from'):
    workdir_tokenizer.adopt(config.init_from, workdir)
  dataset = shards.open_dataset(config.data.source) if config.data.get('source') else None
  if dataset is not None:  # A fresh workdir takes the dataset's tokenizer.
    workdir_tokenizer.adopt(dataset.directory, workdir)
  tokenizer = workdir_tokenizer.prepare(config, workdir)
  if dataset is not None:
    streaming.check_tokenizer(dataset, tokenizer, str(workdir))
    train_arrays = streaming.split_rows(dataset, 'train', config.data.seq_len, tokenizer)
    valid_arrays = (streaming.split_rows(dataset, 'valid', config.data.seq_len, tokenizer)
                    if config.eval_steps else None)
  else:
    cache_dir = paths.local_dir(workdir, 'data_cache')
    train_arrays = pipeline.load_or_build_split(config.data, tokenizer, 'train', cache_dir)
    valid_arrays = pipeline.load_or_build_split(config.data, tokenizer, 'valid', cache_dir)
  long_arrays = None
  if long_context.num_steps(config):
    long_data = long_context.data_config(config)
    long_arrays = (streaming.split_rows(dataset, 'train', long_data.seq_len, tokenizer)
                   if dataset is not None else
                   pipeline.load_or_build_split(long_data, tokenizer, 'train', cache_dir))
  # Only now that the corpus and tokenizer check out: a run that failed on them leaves no
  # config.json, so a corrected config may start in the same workdir.
  checkpointing.save_config(workdir, config)
  if init.saves_heads_only(config):
    checkpointing.write_base_reference(workdir, config.init_from)

  mesh = mesh_lib.make_mesh(config.mesh)
  draft_ids = _draft_ids(config, tokenizer, workdir) if config.get('mtp_head_draft_vocab') else None
  trainer = step_lib.Trainer(config, mesh, *distill.batch_fields(config), draft_ids=draft_ids)
  # A fresh run's starting heads are restored now: a misfit costs no trunk pass.
  heads = init.pretrained_heads(config, trainer, workdir)
  if distill.uses_trunk_cache(config):
    base_params = functools.cache(lambda: trainer.init_state(
        trunk=init.pretrained_trunk(config.init_from, trainer)).params)
    train_arrays = distill.with_trunk_cache(config, workdir, trainer, train_arrays, base_params)
    if config.distill.targets == 'rollout' and config.eval_steps:
      # Held-out continuations: the eval metrics then measure what decoding will accept.
      valid_arrays = distill.with_trunk_cache(config, workdir, trainer, valid_arrays,
                                              base_params,
                                              max_rows=config.eval_steps * config.data.batch_size)
    base_params.cache_clear()
  prefetch = config.data.get('prefetch', 2) if dataset is not None else 0  # Streamed reads.
  phases = [_Phase.make(config, config.data, train_arrays, config.seed, prefetch)]
  if long_arrays is not None:  # Its own seed: its rows are shuffled apart from the first's.
    phases.append(_Phase.make(config, long_context.data_config(config), long_arrays,
                              config.seed + 1, prefetch))

  def phase_of(step: int) -> _Phase:
    return phases[-1] if long_context.in_phase(config, step) else phases[0]

  eval_batches = pipeline.make_eval_batches(valid_arrays, config.data.batch_size,
                                            config.eval_steps, jax.process_index(),
                                            jax.process_count()) if config.eval_steps else []
  checkpointer = checkpointing.Checkpointer(workdir, config.keep_checkpoints)
  # A checkpoint holds the position of the iterator that fed its own step.
  resumed_phase = phase_of(checkpointer.latest_step() or 1)
  state, start_step = init.initial_state(config, workdir, trainer, checkpointer,
                                         resumed_phase.iterator, heads)
  num_params = sum(x.size for x in jax.tree.leaves(state.params))
  logging.info('Model: %s parameters, %s.', f'{num_params:,}', trainer.model_config)

  writer = writers.MetricWriter(workdir, resume_from_step=start_step,
                                progress_total=config.num_train_steps, initial=start_step,
                                show_progress=config.progress_bar and jax.process_index() == 0)
  profiler = profiling.StepProfiler(config.get('profile_steps', ''), workdir / 'profile')
  last_metrics: dict[str, float] = {}
  last_step = config.num_train_steps
  if stop_after_step is not None:
    last_step = min(last_step, stop_after_step)
  if start_step >= last_step:
    logging.info('%s is already trained to step %d (num_train_steps=%d).', workdir, start_step,
                 config.num_train_steps)
  interval = None
  # Looks at the metrics where they are fetched anyway: the first step, log steps, saves.
  guard = divergence.Guard(config.get('max_bad_steps', 0))
  preempted_at = None
  try:
    with preemption.StopRequest(start_step) as stop:
      for step in range(start_step + 1, last_step + 1):
        phase = phase_of(step)
        if phase is not phase_of(step - 1) and interval is not None:
          interval = None  # The new row shape compiles: leave that out of the throughput.
        profiler.before_step(step)
        state, metrics = trainer.train_step(state, trainer.train_batch(next(phase.iterator)))
        profiler.after_step(step, state)
        guard.add(step, metrics)
        if interval is None:  # Leave compilation out of the throughput.
          jax.block_until_ready(metrics)
          guard.check()
          interval = _Interval(time.perf_counter())
        else:
          interval.metrics.append(metrics)
          interval.tokens += phase.tokens_per_batch
        if step % config.log_every_steps == 0 or step == last_step:
          guard.check()
          if not interval.metrics:
            interval.metrics.append(metrics)
          last_metrics = {'step': step, **interval.summary()}
          last_metrics.update(phase.throughput(last_metrics['tokens_per_sec']))
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
        stopping = stop.at(step)  # Every step, on every process (the agreed stop step).
        if step % config.checkpoint_every_steps == 0 or step == last_step or stopping:
          guard.check()  # Never save a diverged state (nor rotate good checkpoints out for it).
          checkpointer.save(step, init.saved_params(config, state.params), state.opt_state,
                            phase.iterator, force=True)
        if stopping:
          if step < config.num_train_steps:  # Else it finished all the same.
            preempted_at, reason = step, stop.reason
          break
  finally:
    profiler.close()
    checkpointer.close()
    writer.close()
  if preempted_at is not None:
    raise preemption.Preempted(preempted_at, reason)
  return last_metrics
