"""The pictures draw from given numbers without error, with the labels a reader needs."""

import matplotlib

matplotlib.use('Agg')

import numpy as np  # noqa: E402

from mtp import plotting  # noqa: E402
from mtp.decode import trees  # noqa: E402


def _records(num_heads):
  train = [{'step': s, 'loss': 3.0 - s / 10, 'ntp_loss': 2.0, 'ntp_acc': 0.4,
            **{f'head_{k}_loss': 2.5 + k for k in range(1, num_heads + 1)},
            **{f'head_{k}_acc': 0.3 / k for k in range(1, num_heads + 1)}} for s in range(5)]
  evals = [{'step': 4, 'eval_ntp_loss': 2.1, 'eval_ntp_acc': 0.38,
            **{f'eval_head_{k}_loss': 2.7 + k for k in range(1, num_heads + 1)},
            **{f'eval_head_{k}_acc': 0.25 / k for k in range(1, num_heads + 1)}}]
  return train + evals


def test_learning_curves_draw_every_head_and_validation():
  fig = plotting.learning_curves(_records(3), 3, 'tiny on CPU')
  loss, acc = fig.axes
  assert len(loss.lines) == 2 * 4 and len(acc.lines) == 2 * 4  # train + validation, 1 + K
  assert 'nats' in loss.get_ylabel() and fig._suptitle.get_text() == 'tiny on CPU'


def test_learning_curves_of_heads_on_a_frozen_trunk_leave_the_next_token_out():
  records = [{k: v for k, v in r.items() if 'ntp' not in k} for r in _records(2)]
  fig = plotting.learning_curves(records, 2, 'heads')
  labels = [line.get_label() for line in fig.axes[0].lines]
  assert labels[::2] == ['head 1 (t+2)', 'head 2 (t+3)']  # Each with its validation dots.
  assert len(labels) == 4


def test_accepted_histogram_marks_the_mean():
  fig = plotting.accepted_histogram([3, 5, 3, 2], 'x')
  (ax,) = fig.axes
  assert [p.get_height() for p in ax.patches] == [0.5, 0.3, 0.2]
  assert 'mean 1.70' in ax.get_legend().get_texts()[0].get_text()


def test_speed_bars_annotate_ratios_to_the_baseline():
  fig = plotting.speed_bars(['ar', 'spec'], [100.0, 150.0], [1.0, 2.0], 'x', baseline='ar')
  texts = [t.get_text() for t in fig.axes[0].texts]
  assert texts == ['100\n1.00x', '150\n1.50x']


def test_tree_picture_draws_every_node_with_lookup():
  tree = trees.with_lookup(trees.medusa_default_tree(3), 2)
  accuracies = np.array([[0.6, 0.1, 0.05, 0.02]] * 3)[:, :max(tree.topk_per_depth)]
  fig = plotting.tree_picture(tree, 'default tree', accuracies)
  (ax,) = fig.axes
  assert len(ax.texts) == tree.num_nodes
  assert len(ax.lines) == tree.num_nodes - 1


def test_save_writes_into_a_new_folder_and_closes_the_figure(tmp_path):
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig = plotting.speed_bars(['autoregressive', 'auto'], [10.0, 15.0], [1.0, 2.0], 'tiny on CPU',
                            baseline='autoregressive')
  path = tmp_path / 'figures' / 'speed.png'
  plotting.save(fig, path)
  assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  assert fig.number not in plt.get_fignums()  # A script drawing many keeps none open.
