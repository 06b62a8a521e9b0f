"""Pictures of training and decoding, for notebooks, the demo and benchmarks (matplotlib).

Every function takes numbers computed by the caller's own run and returns a `Figure` with
labelled axes and units; `title` should name the model and the hardware. Nothing here runs a
model, so any caller can plot what it measured.
"""

from __future__ import annotations

import pathlib
import textwrap
from typing import Mapping, Sequence

import numpy as np

from mtp.decode import trees as trees_lib


def _pyplot():
  # Inside a notebook IPython has chosen its inline backend; elsewhere, with no display,
  # matplotlib falls back to Agg by itself.
  import matplotlib.pyplot as plt
  return plt


def _wrapped(title: str, width: int) -> str:
  return '\n'.join(textwrap.wrap(title, width)) if title else title


def hardware() -> str:
  """A short name of the accelerator JAX runs on, for figure titles ('2-core CPU', 'H100')."""
  import os
  import jax
  device = jax.devices()[0]
  if device.platform == 'cpu':
    return f'{os.cpu_count()}-core CPU'
  count = len(jax.devices())
  return f'{count}x {device.device_kind}' if count > 1 else device.device_kind


def save(fig, path, dpi: int = 110) -> None:
  """Lays `fig` out, writes it to `path` (a .png; its folder is made) and closes it: a script
  that draws many figures keeps none of them in memory."""
  path = pathlib.Path(path)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=dpi)
  _pyplot().close(fig)


def learning_curves(records: Sequence[Mapping], num_heads: int, title: str):
  """Loss and top-1 accuracy per step: the next token and each head (train), and validation.

  Args:
    records: `metrics.jsonl` records (training ones hold `loss`, evaluation ones `eval_*`);
      series they lack (the next token's, when the trunk was frozen) are left out.
    num_heads: K, the heads to draw (`head_k_loss`, `head_k_acc`, k = 1..K).
    title: the figure's title.
  """
  plt = _pyplot()
  train = [r for r in records if 'loss' in r]
  evals = [r for r in records if any(k.startswith('eval_') for k in r)]
  fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
  steps = [r['step'] for r in train]
  colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
  series = [('ntp', 'next token (t+1)')] + [(f'head_{k}', f'head {k} (t+{k + 1})')
                                             for k in range(1, num_heads + 1)]
  for i, (key, label) in enumerate(series):
    if f'{key}_loss' not in train[0]:
      continue  # A frozen trunk logs no next-token loss: only its heads learn.
    color = colors[i % len(colors)]
    ax_loss.plot(steps, [r[f'{key}_loss'] for r in train], color=color, label=label)
    ax_acc.plot(steps, [r[f'{key}_acc'] for r in train], color=color, label=label)
    if evals and f'eval_{key}_loss' in evals[0]:
      eval_steps = [r['step'] for r in evals]
      ax_loss.plot(eval_steps, [r[f'eval_{key}_loss'] for r in evals], 'o--', color=color,
                   markersize=4)
      ax_acc.plot(eval_steps, [r[f'eval_{key}_acc'] for r in evals], 'o--', color=color,
                  markersize=4)
  ax_loss.set(xlabel='training step', ylabel='cross-entropy (nats/token)',
              title='Loss (lines: train, dots: validation)')
  ax_acc.set(xlabel='training step', ylabel='top-1 accuracy',
             title='Accuracy (lines: train, dots: validation)')
  ax_acc.set_ylim(0, min(1.0, 1.15 * max(y for line in ax_acc.lines for y in line.get_ydata())))
  ax_loss.legend(fontsize=8)
  ax_acc.legend(fontsize=8)
  for ax in (ax_loss, ax_acc):
    ax.grid(alpha=0.3)
  fig.suptitle(_wrapped(title, 110))
  fig.tight_layout()
  return fig


def accepted_histogram(histogram: Sequence[int], title: str):
  """Bars of how many verification steps emitted 1, 2, ... tokens, with the mean marked.

  Args:
    histogram: entry j counts the steps that emitted j tokens (`Generation.accepted_histogram`
      summed over prompts); entry 0 (steps of rows already finished) is not drawn.
    title: the figure's title.
  """
  plt = _pyplot()
  counts = np.asarray(histogram, np.int64)[1:]
  sizes = np.arange(1, len(counts) + 1)
  total = max(int(counts.sum()), 1)
  mean = float((sizes * counts).sum()) / total
  fig, ax = plt.subplots(figsize=(6.5, 4))
  ax.bar(sizes, counts / total, color='#4c72b0')
  ax.axvline(mean, color='#c44e52', linestyle='--', label=f'mean {mean:.2f} tokens per step')
  ax.set(xlabel='tokens emitted in one verification step', ylabel='fraction of steps',
         xticks=sizes, title=_wrapped(title, 60))
  ax.legend()
  ax.grid(axis='y', alpha=0.3)
  fig.tight_layout()
  return fig


def speed_bars(names: Sequence[str], tokens_per_sec: Sequence[float],
               tokens_per_step: Sequence[float], title: str, baseline: str | None = None):
  """Side-by-side bars of decoding speed (tokens/s) and tokens per step, one bar per decoder.

  Args:
    names: decoder labels.
    tokens_per_sec: measured throughput of each.
    tokens_per_step: mean tokens emitted per forward pass of each.
    title: the figure's title.
    baseline: a name in `names`: speed bars are annotated with their ratio to it.
  """
  plt = _pyplot()
  fig, (ax_speed, ax_step) = plt.subplots(1, 2, figsize=(11, 4))
  x = np.arange(len(names))
  ax_speed.bar(x, tokens_per_sec, color='#4c72b0')
  reference = tokens_per_sec[list(names).index(baseline)] if baseline else None
  for i, value in enumerate(tokens_per_sec):
    label = f'{value:.0f}' + (f'\n{value / reference:.2f}x' if reference else '')
    ax_speed.annotate(label, (i, value), ha='center', va='bottom', fontsize=9)
  ax_speed.set(ylabel='tokens per second', title='Speed (higher is faster)')
  ax_step.bar(x, tokens_per_step, color='#55a868')
  for i, value in enumerate(tokens_per_step):
    ax_step.annotate(f'{value:.2f}', (i, value), ha='center', va='bottom', fontsize=9)
  ax_step.set(ylabel='tokens per forward pass', title='Tokens per verification step')
  for ax, values in ((ax_speed, tokens_per_sec), (ax_step, tokens_per_step)):
    ax.set_xticks(x, names, rotation=15)
    ax.set_ylim(0, max(values) * 1.25 if len(values) else 1)
    ax.grid(axis='y', alpha=0.3)
  fig.suptitle(_wrapped(title, 110))
  fig.tight_layout()
  return fig


def tree_picture(tree: trees_lib.Tree, title: str, accuracies: np.ndarray | None = None):
  """A draft tree drawn top-down: the root (the last accepted token), then depth k (head k).

  A node's label is its rank among head k's candidates (0 = the head's top-1); 'L' marks the
  nodes of a prompt-lookup chain. Given the heads' top-k `accuracies` [K, k], a head node is
  shaded by the probability that its whole path is accepted (the product of its ranks'
  accuracies along the path); lookup nodes stay grey.
  """
  plt = _pyplot()
  parent = np.asarray(tree.parent)
  depth = np.asarray(tree.depth)
  rank = np.asarray(tree.rank)
  n = tree.num_nodes
  # Leaves get consecutive x positions; a parent sits above the middle of its children.
  children = {i: [j for j in range(n) if j != i and parent[j] == i] for i in range(n)}
  x = np.zeros(n)
  next_leaf = [0.0]

  def place(node):
    kids = sorted(children[node], key=lambda j: rank[j])
    if not kids:
      x[node] = next_leaf[0]
      next_leaf[0] += 1
      return
    for kid in kids:
      place(kid)
    x[node] = np.mean([x[k] for k in kids])

  place(0)
  lookup = (rank < 0) & (np.arange(n) > 0)
  reach = np.ones(n)
  if accuracies is not None:
    acc = np.asarray(accuracies)
    for i in range(1, n):  # Parents come before children in a tree's node order.
      d, r = int(depth[i]), int(rank[i])
      known = not lookup[i] and d <= acc.shape[0] and r < acc.shape[1]
      reach[i] = reach[parent[i]] * acc[d - 1, r] if known else 0.0
  fig, ax = plt.subplots(figsize=(max(7, 0.45 * next_leaf[0] + 2), 1.2 * tree.max_depth + 2.4))
  for i in range(1, n):
    ax.plot([x[parent[i]], x[i]], [-depth[parent[i]], -depth[i]], color='#999999', zorder=1)
  cmap = plt.get_cmap('Blues')
  colors = ['#dddddd' if lookup[i] else cmap(0.25 + 0.75 * reach[i]) for i in range(n)]
  ax.scatter(x, -depth, s=330, c=colors, edgecolors='#333333', zorder=2)
  for i in range(n):
    label = 'root' if i == 0 else 'L' if lookup[i] else str(rank[i])
    ax.annotate(label, (x[i], -depth[i]), ha='center',
                va='center', fontsize=7 if i == 0 else 8, zorder=3)
  ax.set_yticks([-d for d in range(tree.max_depth + 1)],
                ['accepted'] + [f'depth {d}' for d in range(1, tree.max_depth + 1)])
  ax.set_xticks([])
  for side in ('top', 'right', 'bottom'):
    ax.spines[side].set_visible(False)
  shading = '\nshade: probability that the path is accepted' if accuracies is not None else ''
  ax.set_title(f'{_wrapped(title, 70)}\n{n - 1} draft nodes; '
               f'label: the head\'s candidate rank (L: lookup){shading}', fontsize=10)
  fig.tight_layout()
  return fig
