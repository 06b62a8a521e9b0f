"""Cost curve: measured, cached per device and model shape; tree size follows the curve."""

import numpy as np
import pytest

from mtp.decode import cost_model
from mtp.decode import measurements
from mtp.decode import trees
from mtp.model import testing

ACCURACIES = [[0.7, 0.1, 0.05], [0.6, 0.1, 0.05], [0.5, 0.1, 0.05]]


def test_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path))
  model = testing.tiny_model(0, num_layers=1)
  curve = cost_model.step_cost(model, token_counts=(4,), iterations=2, repeats=1)
  assert sorted(curve) == [1, 4] and curve[1] == 1.0 and curve[4] > 0
  (key, entry), = measurements.read_table('step_cost.json').items()
  assert cost_model.device_kind() in key and cost_model.model_key(model) in key
  assert set(entry['seconds']) == {'1', '4'}

  def fail(*args, **kwargs):
    raise AssertionError('measured again')

  monkeypatch.setattr(cost_model, 'step_timer', fail)
  assert cost_model.step_cost(model, token_counts=(4,)) == curve
  # Another model shape is another entry.
  with pytest.raises(AssertionError, match='measured again'):
    cost_model.step_cost(testing.tiny_model(0, num_layers=1, head_type='parallel'),
                         token_counts=(4,))


def test_a_curve_timed_under_load_is_measured_again_once_quiet(tmp_path, monkeypatch):
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path))
  measured = []

  def timer(model, counts, **kwargs):
    measured.append(counts)
    return lambda: {t: 1e-3 * t for t in counts}

  class Busy:

    def cores(self):
      return 1.5

  monkeypatch.setattr(cost_model, 'step_timer', timer)
  monkeypatch.setattr(measurements, 'OtherWork', Busy)
  model = testing.tiny_model(0)
  cost_model.step_cost(model, token_counts=(2,))
  cost_model.step_cost(model, token_counts=(2,))
  assert len(measured) == 1  # The machine is still busy (conftest): read from the cache.
  monkeypatch.setattr(measurements, 'machine_quiet', lambda: True)
  cost_model.step_cost(model, token_counts=(2,))
  assert len(measured) == 2


def test_a_corrupt_cache_file_is_measured_again(tmp_path, monkeypatch):
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path))
  measurements.root().mkdir(parents=True)
  (measurements.root() / 'step_cost.json').write_text('{not json')
  monkeypatch.setattr(cost_model, 'step_timer',
                      lambda model, counts, **kw: lambda: {t: 1e-3 * t for t in counts})
  curve = cost_model.step_cost(testing.tiny_model(0), token_counts=(2, 8))
  assert curve == {1: 1.0, 2: 2.0, 8: 8.0}


def test_tree_size_follows_the_cost_curve():
  model = testing.tiny_model(0)
  flat = {1: 1.0, 32: 1.0}  # Memory-bound accelerator: verifying 32 tokens costs one.
  steep = {1: 1.0, 32: 32.0}  # Compute-bound: cost grows with every token.
  big = cost_model.choose_tree(model, ACCURACIES, cost=flat)
  small = cost_model.choose_tree(model, ACCURACIES, cost=steep)
  assert big.num_nodes > 16 and small.num_nodes <= 3
  assert big.max_depth <= 3
  assert cost_model.choose_tree(model, None).is_chain
  # Accuracies of more heads than the model has are cut to its heads.
  deep = cost_model.choose_tree(model, ACCURACIES + [[0.9, 0.05, 0.01]], cost=flat)
  assert deep.max_depth <= 3


@pytest.mark.parametrize('slope, measured', [(0.3, [cost_model.FIRST_TOKEN_COUNTS]), (
    0.0, [cost_model.FIRST_TOKEN_COUNTS, cost_model.DEFAULT_TOKEN_COUNTS])])
def test_the_drafting_curve_goes_as_far_as_a_tree_could_use_it(monkeypatch, slope, measured):
  asked = []

  def step_cost(model, *, token_counts, **kwargs):
    assert kwargs == dict(batch_size=4, drafting=True, draft_vocab_size=16)
    asked.append(tuple(token_counts))
    return {t: 1 + slope * (t - 1) for t in token_counts}
  monkeypatch.setattr(cost_model, 'step_cost', step_cost)
  model = testing.tiny_model(0)
  curve = cost_model.drafting_curve(model, ACCURACIES, batch_size=4, draft_vocab_size=16)
  # A steep curve (a CPU's) stops at 8 tokens: the best tree on it is smaller. On a flat one
  # the best tree fills it, so the whole curve is measured.
  assert asked == measured and sorted(curve) == list(measured[-1])
  tree = cost_model.choose_tree(model, ACCURACIES, cost=curve)
  assert (tree.num_nodes < 8) == bool(slope)


def test_choose_tree_errors():
  with pytest.raises(ValueError, match='without MTP heads'):
    cost_model.choose_tree(testing.tiny_model(0, mtp_num_heads=0), ACCURACIES, cost={1: 1.0})
  with pytest.raises(ValueError, match='no tree size'):
    cost_model.choose_tree(testing.tiny_model(0), ACCURACIES, cost={1: 1.0})
  with pytest.raises(ValueError, match='needs T = 1'):
    cost_model.relative({2: 1.0})
  np.testing.assert_allclose(list(cost_model.relative({1: 2.0, 4: 3.0}).values()), [1, 1.5])


def test_steps_are_timed_on_a_binary_tree():
  tree = cost_model._binary_tree(5)
  mask = tree.attention_mask
  np.testing.assert_array_equal(tree.depth, [0, 1, 1, 2, 2])
  # Node 4's ancestors are 1 and 0; node 3 is its sibling, not an ancestor.
  np.testing.assert_array_equal(mask[4], [True, True, False, False, True])
  assert mask.sum() == 1 + 2 + 2 + 3 + 3


def test_a_cpu_is_named_by_its_model_features_and_cores():
  kind = cost_model.device_kind()
  assert kind.startswith('cpu:') and kind.endswith(' cores') and kind != 'cpu:cpu'


@pytest.mark.parametrize('head_type,options', [
    ('eagle', dict(eagle_features='fused', eagle_input='concat')),  # Drafts depth by depth.
    ('medusa', {})])  # Drafts from the verification pass's state.
def test_whole_drafting_steps_are_timed_and_kept_apart(tmp_path, monkeypatch, head_type,
                                                       options):
  import dataclasses
  from flax import nnx
  from mtp.model import mtp_model
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path))
  cfg = dataclasses.replace(testing.tiny_config(head_type=head_type),
                            head_options=tuple(sorted(options.items())))
  model = mtp_model.MTPModel(cfg, rngs=nnx.Rngs(0))
  kwargs = dict(token_counts=(2, 5), iterations=2, repeats=1)
  drafting = cost_model.step_cost(model, drafting=True, draft_vocab_size=16, **kwargs)
  assert sorted(drafting) == [1, 2, 5] and drafting[1] == 1.0 and min(drafting.values()) > 0
  cost_model.step_cost(model, **kwargs)  # Verification alone: an entry of its own.
  cost_model.step_cost(model, drafting=True, **kwargs)  # The whole vocabulary: another.
  assert len(measurements.read_table('step_cost.json')) == 3

  def fail(*args, **kwargs):
    raise AssertionError('measured again')
  monkeypatch.setattr(cost_model, 'step_timer', fail)
  assert cost_model.step_cost(model, drafting=True, draft_vocab_size=16, **kwargs) == drafting


def test_a_drafting_step_needs_heads():
  with pytest.raises(ValueError, match='without MTP heads has no drafting step'):
    cost_model.measure_step_cost(testing.tiny_model(0, mtp_num_heads=0), (2,), drafting=True)


@pytest.mark.parametrize('nodes,heads', [(2, 1), (5, 4), (8, 4), (32, 4), (32, 1)])
def test_drafting_is_timed_on_a_tree_the_heads_can_draft(nodes, heads):
  tree = cost_model._drafted_tree(nodes, heads)
  assert tree.num_nodes == nodes and tree.max_depth <= heads
  assert tree.node_paths[np.argmax(tree.depth)][1] == 1  # Deepest along the top-1 path.


@pytest.mark.parametrize('platform_name,flags,native', [
    ('gpu', None, True), ('tpu', '', True),
    ('cpu', 'fpu sse avx2 avx512f avx512_bf16 avx512_vnni', True),
    ('cpu', 'fpu avx2 avx512f amx_tile amx_bf16', True),
    ('cpu', 'fpu avx2 avx512f avx512_vnni', False), ('cpu', 'fpu avx2', False),
    ('cpu', 'avx512_bf16x', False),  # Whole flags only.
])
def test_native_bfloat16_is_an_accelerator_or_a_cpu_with_bfloat16_instructions(
    platform_name, flags, native):
  assert cost_model.native_bfloat16(platform_name, flags) is native


def test_a_curve_that_falls_is_measured_again_and_never_kept_falling(tmp_path, monkeypatch):
  """Other work on the machine can slow some T more than others; such a curve once made `auto`
  pick a larger tree. It is measured again, each T's fastest counting; a cached one that falls
  is not read."""
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path))
  disturbed = {1: 1.0, 2: 1.34, 4: 1.04, 8: 1.29}
  quiet = {1: 1.0, 2: 1.08, 4: 1.25, 8: 1.51}
  runs, compiles = [disturbed, quiet], []

  def timer(model, counts, **kwargs):
    compiles.append(counts)
    return lambda: {t: 0.03 * c for t, c in runs.pop(0).items()}
  monkeypatch.setattr(cost_model, 'step_timer', timer)
  model = testing.tiny_model(0)
  curve = cost_model.step_cost(model, token_counts=(2, 4, 8))
  assert not runs and curve == pytest.approx({1: 1.0, 2: 1.08, 4: 1.08, 8: 1.29})
  assert len(compiles) == 1  # Timed again on the programs compiled for the first time.
  assert cost_model.step_cost(model, token_counts=(2, 4, 8)) == curve  # Kept: it rises.

  runs = [disturbed] * (1 + cost_model.REMEASURES)  # Disturbed every time: kept rising.
  curve = cost_model.step_cost(model, token_counts=(2, 4, 8), refresh=True)
  assert not runs and curve == pytest.approx({1: 1.0, 2: 1.34, 4: 1.34, 8: 1.34})

  table = measurements.read_table('step_cost.json')
  (key, entry), = table.items()
  entry['relative'] = {str(t): c for t, c in disturbed.items()}  # As an older version kept.
  measurements.store('step_cost.json', key, entry)
  runs = [quiet]
  assert cost_model.step_cost(model, token_counts=(2, 4, 8)) == pytest.approx(quiet)


def test_a_given_block_is_timed_in_place_of_a_binary_tree_and_must_match_its_size():
  model = testing.tiny_model()
  chain = trees.chain_tree(3)
  costs = cost_model.measure_step_cost(model, [1, 4], blocks={4: chain}, context=8,
                                       iterations=2, repeats=1)
  assert set(costs) == {1, 4} and all(c > 0 for c in costs.values())
  with pytest.raises(ValueError, match='blocks must map T to a tree of T nodes'):
    cost_model.measure_step_cost(model, [1, 3], blocks={3: chain}, context=8, repeats=1)
