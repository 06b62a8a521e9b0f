"""Checks of a training config before anything is compiled: its values, that it matches the
workdir it resumes, and that a fresh run fits the base workdir it starts from (`init_from`)."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import ml_collections

from mtp.checkpoint import checkpointing
from mtp.checkpoint import paths
from mtp.data import shards
from mtp.data import streaming
from mtp.data import tokenizer as tokenizer_lib
from mtp.model import layout
from mtp.model import mtp_model
from mtp.model import transformer
from mtp.parallel import mesh as mesh_lib
from mtp.train import distill
from mtp.train import long_context
from mtp.train import optim

# Model settings that change how it runs, not what its parameters are. (`scan_layers` changes
# their layout only: loading converts it, resuming training does not; see check_workdir_matches.)
RUNTIME_MODEL_KEYS = frozenset({'remat', 'dtype', 'scan_layers'})


def validate_config(config: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
  """Raises ValueError naming the first invalid value, before anything is compiled."""
  model_cfg = mtp_model.ModelConfig.from_config(config.model)
  model_cfg.validate()
  optim.validate(config.optim, config.num_train_steps)
  for key in ('log_every_steps', 'eval_every_steps', 'checkpoint_every_steps'):
    if config[key] <= 0:
      raise ValueError(f'{key} must be positive, got {config[key]}.')
  if config.keep_checkpoints < 1:
    raise ValueError(f'keep_checkpoints must be at least 1, got {config.keep_checkpoints} (it '
                     'is how many of the latest checkpoints rotation keeps).')
  if config.get('max_bad_steps', 0) < 0:
    raise ValueError(f'max_bad_steps must be >= 0, got {config.max_bad_steps}.')
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
  long_context.validate(config, num_devices)
  if long_context.num_steps(config) and distill.uses_trunk_cache(config):
    raise ValueError('long_context trains on rows of another length than the distill caches '
                     'hold: set long_context.steps=0 with distill.targets or '
                     'distill.cache_trunk_states.')
  distill.validate(config)
  if config.data.get('source') and distill.uses_trunk_cache(config):
    raise ValueError('distill.cache_trunk_states reads the in-memory corpus: it cannot be used '
                     f'with data.source ({config.data.source}).')
  if config.data.tokenizer not in ('bpe', 'byte'):
    raise ValueError(f"data.tokenizer must be 'bpe' or 'byte', got {config.data.tokenizer!r}.")
  if num_devices is not None:
    mesh_lib.check_batch_fits(config.data.batch_size,
                              mesh_lib.resolve_mesh_shape(config.mesh, num_devices))


def check_workdir_matches(workdir: pathlib.Path, config: ml_collections.ConfigDict) -> None:
  """A workdir's saved model and tokenizer settings must match the config resuming it; a fresh
  workdir's config must fit the base workdir `init_from` names (`check_init_from`).

  The mesh (`mesh.*`) may differ: checkpoints restore onto any mesh and process count
  (tests/cross_mesh_test.py)."""
  path = workdir / checkpointing.CONFIG_FILENAME
  if not path.exists():
    # Checked once, at the start: a resumed full fine-tune no longer needs its base.
    check_init_from(config)
    check_init_heads_from(config)
    return
  saved = checkpointing.load_config(workdir)
  saved_scanned = bool(saved.model.get('scan_layers', False))
  if saved_scanned != bool(config.model.get('scan_layers', False)):
    raise layout.LayoutMismatchError(layout.mismatch_message(
        f'The workdir {workdir}', layout.layout_name(saved_scanned),
        layout.layout_name(not saved_scanned), workdir))
  mismatched = [f'model.{k}: {saved.model[k]!r} in the workdir, {config.model[k]!r} now'
                for k in config.model if k in saved.model and k not in RUNTIME_MODEL_KEYS and
                _normalise(saved.model[k]) != _normalise(config.model[k])]
  # The batch size too: the saved data position counts batches.
  saved_data = saved.get('data') or {}
  for key in ('tokenizer', 'seq_len', 'corpus', 'batch_size'):
    if _normalise(saved_data.get(key)) != _normalise(config.data.get(key)):
      mismatched.append(f'data.{key}: {saved_data.get(key)!r} in the workdir, '
                        f'{config.data.get(key)!r} now')
  # Its position too, once the phase has a saved config to compare with.
  saved_long = saved.get('long_context') or {}
  for key in ('steps', 'seq_len', 'batch_size'):
    if key in saved_long and config.get('long_context') is not None and _normalise(
        saved_long[key]) != _normalise(config.long_context.get(key)):
      mismatched.append(f'long_context.{key}: {saved_long[key]!r} in the workdir, '
                        f'{config.long_context.get(key)!r} now')
  if mismatched:
    raise ValueError(f'The config does not match the existing workdir {workdir}: '
                     + '; '.join(mismatched) + '. Use a new --workdir or the saved config.')


def _normalise(value):
  return json.loads(json.dumps(value, default=list))


def check_init_from(config: ml_collections.ConfigDict) -> None:
  """The base workdir `init_from` must hold the configured trunk, and a prepared dataset
  (`data.source`) must be tokenized with its tokenizer: checked from their config.json and
  tokenizer.json before anything is written, tokenized, compiled or cached.

  Raises:
    ValueError: naming the mismatched settings or the two tokenizers.
    checkpointing.CheckpointError: the base is not an mtp workdir (no config.json).
  """
  source = config.get('init_from')
  if not source:
    return
  configured = mtp_model.ModelConfig.from_config(config.model).trunk
  check_same_trunk(source, configured)
  if not config.data.get('source'):
    return
  dataset = shards.open_dataset(config.data.source)
  path = paths.as_path(source) / tokenizer_lib.FILENAME
  if not path.exists():
    raise checkpointing.CheckpointError(f'init_from: {path} does not exist.')
  streaming.check_tokenizer(dataset, tokenizer_lib.Tokenizer.load(path), source,
                            dataset_name=f'data.source={dataset.directory}',
                            tokenizer_name=f'the base workdir init_from={source}',
                            remedy=f'prepare the data with --tokenizer={source}')


def check_init_heads_from(config: ml_collections.ConfigDict) -> None:
  """The workdir `init_heads_from` must hold heads of the configured family, number and draft
  vocabulary size, on a trunk of the configured shape: checked from its config.json before
  anything is written or computed (their parameters are then restored by shape).

  Raises:
    ValueError: naming each mismatched setting.
    checkpointing.CheckpointError: the source is not an mtp workdir (no config.json).
  """
  source = config.get('init_heads_from')
  if not source:
    return
  saved = checkpointing.load_config(source)
  configured = mtp_model.ModelConfig.from_config(config.model)
  if not configured.mtp_num_heads:
    raise ValueError(f'init_heads_from={source}, but model.mtp_num_heads=0: there are no heads '
                     'to start from it.')
  theirs = mtp_model.ModelConfig.from_config(saved.model)
  differ = [f'model.{key}: {getattr(theirs, key)!r} there, {getattr(configured, key)!r} '
            'configured' for key in ('mtp_head_type', 'mtp_num_heads')
            if getattr(theirs, key) != getattr(configured, key)]
  differ += [f'model.{k}: {getattr(theirs.trunk, k)!r} there, {getattr(configured.trunk, k)!r} '
             'configured' for k in _trunk_differences(theirs.trunk, configured.trunk)]
  size, their_size = config.get('mtp_head_draft_vocab', 0), saved.get('mtp_head_draft_vocab', 0)
  if size != their_size:
    differ.append(f'mtp_head_draft_vocab: {their_size} there, {size} configured')
  if differ:
    raise ValueError(f'init_heads_from: the heads in {source} do not fit this config: '
                     + '; '.join(differ) + '.')


def check_same_trunk(source: str | pathlib.Path,
                     configured: transformer.TransformerConfig) -> None:
  """Raises ValueError naming each trunk setting (`model.KEY`) in which workdir `source`
  differs from `configured`, runtime settings aside."""
  saved = mtp_model.ModelConfig.from_config(checkpointing.load_config(source).model).trunk
  differ = _trunk_differences(saved, configured)
  if differ:
    raise ValueError(f'init_from: the trunk in {source} does not match the configured trunk: '
                     + '; '.join(f'model.{k}: {getattr(saved, k)!r} there, '
                                 f'{getattr(configured, k)!r} configured' for k in differ)
                     + '.')


def _trunk_differences(a: transformer.TransformerConfig,
                      b: transformer.TransformerConfig) -> list[str]:
  """The trunk settings in which `a` and `b` differ, runtime settings aside; floats need only
  agree to float32 precision (1e-5 vs the float32 9.9999997e-06 read from a GGUF file are the
  same epsilon)."""
  differ = []
  for field in dataclasses.fields(a):
    if field.name in RUNTIME_MODEL_KEYS:
      continue
    x, y = getattr(a, field.name), getattr(b, field.name)
    if isinstance(x, float) or isinstance(y, float):
      if not math.isclose(x, y, rel_tol=1e-6):
        differ.append(field.name)
    elif x != y:
      differ.append(field.name)
  return differ
