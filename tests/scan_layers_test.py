"""Scanned and unrolled workdirs of the same weights: conversion, resume, decoding, export.

One tiny unrolled run is trained; `convert_layout` gives its scanned twin (same step, optimizer
state and data position). Everything downstream must not tell the two apart, and resuming in
the wrong layout is a named error.
"""

import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

import mtp
from mtp.checkpoint import checkpointing
from mtp.checkpoint import convert_layout
from mtp.export import writer
from mtp.model import layout
from mtp.parallel import mesh as mesh_lib
from mtp.train import init as init_lib
from mtp.train import step as step_lib
from mtp.train import testing as train_testing
from mtp.train import trainer as trainer_lib

PROMPTS = ['def add(a, b):\n    return', 'import os\n']


@pytest.fixture(scope='module')
def workdirs(tmp_path_factory):
  root = tmp_path_factory.mktemp('scan')
  unrolled = train_testing.train_tiny_workdir(root / 'unrolled', num_train_steps=2)
  convert_layout.convert_workdir(unrolled, root / 'scanned', scan_layers=True)
  return unrolled, root / 'scanned'


def _flat(state):
  return layout.flatten(layout.to_layout(nnx.to_pure_dict(state), False, layer_key=str))


def test_the_converted_workdir_holds_the_same_weights_stacked(workdirs):
  unrolled, scanned = workdirs
  assert checkpointing.load_config(scanned).model.scan_layers is True
  a, b = mtp.load(unrolled), mtp.load(scanned)
  assert not a.model.cfg.trunk.scan_layers and b.model.cfg.trunk.scan_layers
  assert b.step == a.step == 2
  assert b.model.trunk.blocks.attn.q_proj.kernel.shape[0] == 2  # [L, D, H*Dh]
  flat_a, flat_b = _flat(nnx.state(a.model)), _flat(nnx.state(b.model))
  assert flat_a.keys() == flat_b.keys()
  for path in flat_a:
    np.testing.assert_array_equal(flat_a[path], flat_b[path])
  # Either layout loads into either model: the scanned checkpoint unrolled, and back.
  c = mtp.load(scanned, scan_layers=False)
  assert not c.model.cfg.trunk.scan_layers and c.config.model.scan_layers is False
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(c.model)),
               nnx.to_pure_dict(nnx.state(a.model)))


def test_resuming_in_the_other_layout_is_a_named_error_that_says_how_to_convert(workdirs):
  unrolled, scanned = workdirs
  config = train_testing.tiny_config(**{'num_train_steps': 3, 'eval_steps': 0,
                                        'model.scan_layers': True})
  with pytest.raises(layout.LayoutMismatchError, match='launch.convert_layout'):
    trainer_lib.train_and_evaluate(config, unrolled)
  target = mtp.load(scanned)
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      nnx.state(target.model))
  with pytest.raises(layout.LayoutMismatchError, match='scan_layers=False'):
    checkpointing.restore_params(unrolled, abstract, convert_layout=False)
  with pytest.raises(ValueError, match='scanned already'):
    convert_layout.convert_workdir(scanned, scanned.parent / 'again', scan_layers=True)


def test_the_converted_workdir_resumes_training_where_the_source_would(workdirs, tmp_path):
  unrolled, scanned = workdirs
  losses = []
  for source, scan in ((unrolled, False), (scanned, True)):
    copy = tmp_path / source.name  # Resume a copy: the fixture's workdirs stay at step 2.
    shutil.copytree(source, copy)
    config = train_testing.tiny_config(**{'num_train_steps': 3, 'eval_steps': 0,
                                          'log_every_steps': 1, 'model.scan_layers': scan})
    trainer_lib.train_and_evaluate(config, copy)
    records = [json.loads(line) for line in (copy / 'metrics.jsonl').read_text().splitlines()]
    losses.append([r['loss'] for r in records if r.get('step') == 3 and 'loss' in r])
  assert losses[0] and losses[1]
  np.testing.assert_allclose(losses[1][-1], losses[0][-1], rtol=1e-5)


def test_decoding_a_scanned_workdir_gives_the_unrolled_tokens(workdirs):
  unrolled, scanned = workdirs
  a, b = mtp.load(unrolled), mtp.load(scanned)
  want = [g.tokens for g in mtp.generate(a, PROMPTS, max_new_tokens=10, decoder='speculative',
                                         tree='chain')]
  # The speculative loop (KV cache, chain verification) on scanned parameters, and their own
  # autoregressive decoding.
  for options in (dict(decoder='speculative', tree='chain'), dict(decoder='autoregressive')):
    got = [g.tokens for g in mtp.generate(b, PROMPTS, max_new_tokens=10, **options)]
    assert got == want, options


def test_export_of_a_scanned_workdir_equals_the_export_of_its_unrolled_twin(workdirs, tmp_path):
  unrolled, scanned = workdirs
  writer.export(unrolled, 'params', tmp_path / 'from_unrolled')
  writer.export(scanned, 'params', tmp_path / 'from_scanned')
  assert checkpointing.load_config(tmp_path / 'from_scanned').model.scan_layers is False
  a, b = mtp.load(tmp_path / 'from_unrolled'), mtp.load(tmp_path / 'from_scanned')
  assert not b.model.cfg.trunk.scan_layers  # Per-layer weights, as serving reads them.
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(b.model)),
               nnx.to_pure_dict(nnx.state(a.model)))


def test_init_from_reads_a_trunk_of_the_other_layout(workdirs):
  unrolled, scanned = workdirs
  config = train_testing.tiny_config(**{'init_from': str(scanned), 'model.mtp_num_heads': 1})
  trainer = step_lib.Trainer(config, mesh_lib.make_mesh(config.mesh, jax.devices()[:1]))
  params = trainer.init_state(trunk=init_lib.pretrained_trunk(scanned, trainer)).params
  want = nnx.to_pure_dict(nnx.state(mtp.load(unrolled).model.trunk))
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(params)['trunk'], want)
