"""Old head parameter paths (before the families named their lists `layers`) are upgraded."""

import jax
import numpy as np
import pytest
from flax import nnx

from mtp.model import heads
from mtp.model import testing


def _params(head_type):
  model = testing.tiny_model(head_type=head_type, mtp_num_heads=2)
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def _old_layout(params, head_type, key=lambda i: i):
  """The same values nested as the old modules did (git show 905a8ac:mtp/model/heads.py):
  MedusaHeads.heads[i][j], ParallelHeads.blocks[i] and .norms[i]; written out by hand."""
  layers = params['heads']['layers']
  if head_type == 'medusa':
    old = {'heads': {key(i): {key(j): block for j, block in head['blocks'].items()}
                     for i, head in layers.items()}}
  else:
    old = {'blocks': {key(i): layer['block'] for i, layer in layers.items()},
           'norms': {key(i): layer['norm'] for i, layer in layers.items()}}
  return {'trunk': params['trunk'], 'heads': old}


def _assert_same(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x is y


@pytest.mark.parametrize('head_type', ['medusa', 'parallel'])
def test_old_params_are_upgraded(head_type):
  params = _params(head_type)
  old = _old_layout(params, head_type)
  assert heads.is_legacy_tree(old) and not heads.is_legacy_tree(params)
  _assert_same(heads.upgrade_legacy_tree(old), params)


@pytest.mark.parametrize('head_type', ['medusa', 'parallel'])
def test_raw_orbax_trees_with_str_indices_and_optimizer_states(head_type):
  params = _params(head_type)
  as_str = jax.tree.map(lambda x: x, params)
  as_str['heads']['layers'] = {str(i): layer for i, layer in params['heads']['layers'].items()}
  if head_type == 'medusa':
    for layer in as_str['heads']['layers'].values():
      layer['blocks'] = {str(j): block for j, block in layer['blocks'].items()}
  old = _old_layout(params, head_type, key=str)
  # Optimizer states mirror the parameters deeper down, beside other entries.
  state = {'params': old, 'opt_state': {'inner_states': {'heads': {'inner_state': [
      {'count': np.zeros(()), 'mu': old, 'nu': old}]}}}}
  assert heads.is_legacy_tree(state)
  upgraded = heads.upgrade_legacy_tree(state)
  assert not heads.is_legacy_tree(upgraded)
  _assert_same(upgraded['params'], as_str)
  inner = upgraded['opt_state']['inner_states']['heads']['inner_state'][0]
  _assert_same(inner['mu'], as_str)
  assert inner['count'] is state['opt_state']['inner_states']['heads']['inner_state'][0]['count']


def test_list_containers_are_upgraded():
  leaf = lambda n: np.full((1,), n)  # noqa: E731
  old = {'heads': {'heads': [[{'w': leaf(0)}, {'w': leaf(1)}], [{'w': leaf(2)}, {'w': leaf(3)}]]}}
  upgraded = heads.upgrade_legacy_tree(old)
  assert [[b['w'][0] for b in layer['blocks']] for layer in upgraded['heads']['layers']] == [
      [0, 1], [2, 3]]


@pytest.mark.parametrize('head_type', ['medusa', 'parallel', 'sequential'])
def test_new_trees_are_left_alone(head_type):
  params = _params(head_type)
  assert not heads.is_legacy_tree(params)
  _assert_same(heads.upgrade_legacy_tree(params), params)
