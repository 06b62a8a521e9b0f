"""Measured head accuracies for building candidate trees, and code prompts to measure them on.

`trees.tree_from_accuracies` and `cost_model.choose_tree` need, for heads d = 1..depth and ranks
r = 0..R-1, the probability that head d's rank-r candidate is accepted given that the drafts
before it on the path were. Under greedy decoding a draft is accepted when it equals the trunk's
own greedy token, so the faithful place to count is the trunk's own greedy continuation:
`calibrate` decodes prompts greedily, then runs the model once, teacher-forced, over prompt and
continuation. On the continuation the trunk's argmax at every position is the next token, so a
head's candidate there is right exactly when greedy verification would accept it.
"""

from __future__ import annotations

import functools
import pathlib
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp.decode import measurements
from mtp.decode import settings as settings_lib
from mtp.decode import state as state_lib
from mtp.decode import trees as trees_lib


@functools.partial(jax.jit, static_argnames=('graphdef', 'top_k'))
def _head_topk(graphdef, params, tokens, top_k: int):
  """Top-k candidates of the trunk and every head at every position: [K + 1, B, T, top_k]."""
  model = nnx.merge(graphdef, params)
  b, t = tokens.shape
  out = model(tokens, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)))
  # One head at a time: only [B, T, V] logits live at once.
  return jnp.stack([jax.lax.top_k(model.logits(o), top_k)[1] for o in out])


def head_accuracies(model, tokens, starts, ends, top_k: int = 4) -> np.ndarray:
  """Conditional top-k accuracies of each head on the spans [starts, ends) of `tokens`.

  Head d's candidates at position p draft token p + 1 + d. The position counts for head d when
  every token up to p + 1 + d lies before ends[b], p >= starts[b] - 1 (the last prompt token
  drafts too), and heads 1..d-1 had their top-1 right at p (a chain's earlier drafts passed).

  Args:
    model: an `MTPModel` with heads.
    tokens: [B, T] int sequences (right-padded).
    starts: [B] first position of the span whose tokens are drafted (e.g. the prompt length).
    ends: [B] end of each row's valid tokens.
    top_k: R, candidates per head.

  Returns:
    [depth, R] float64: entry [d, r] = P(rank-r candidate of head d + 1 is right | heads 1..d had
    their top-1 right). Rows with nothing to count are 0.
  """
  if model.mtp_num_heads == 0:
    raise ValueError('the model has no MTP heads to measure')
  tokens = np.asarray(tokens, np.int32)
  starts, ends = np.asarray(starts).reshape(-1), np.asarray(ends).reshape(-1)
  graphdef, params = nnx.split(model)
  top = np.asarray(_head_topk(graphdef, params, jnp.asarray(tokens), top_k))  # [K+1, B, T, R]
  _, b, t, _ = top.shape
  position = np.arange(t)[None, :]
  chain_right = np.ones((b, t), bool)
  acc = np.zeros((model.mtp_num_heads, top_k))
  for d in range(1, model.mtp_num_heads + 1):
    target_index = position + 1 + d
    valid = (position >= starts[:, None] - 1) & (target_index < ends[:, None])
    target = np.take_along_axis(tokens, np.minimum(target_index, t - 1), axis=1)
    hits = top[d] == target[..., None]  # [B, T, R]
    counted = valid & chain_right
    if counted.any():
      acc[d - 1] = hits[counted].mean(axis=0)
    chain_right &= hits[..., 0]
  return acc


def calibrate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 128,
              top_k: int = 4, eos_id: int | None = None, pad_id: int = 0) -> np.ndarray:
  """[depth, R] accuracies of the heads on the trunk's greedy continuations of `prompts`.

  Args:
    model: an `MTPModel` with heads.
    prompts: token lists (one batch: keep them few and short).
    max_new_tokens: continuation length per prompt.
    top_k: R, candidates per head.
    eos_id, pad_id: as in decoding.
  """
  from mtp.decode import plan  # pylint: disable=import-outside-toplevel  # It reads calibration.
  padded, lengths = state_lib.pad_prompts(prompts, pad_id)
  engine = plan.resolve(model, 'autoregressive', max_new_tokens=max_new_tokens,
                        prompt_width=padded.shape[1], greedy_only=True)
  stop = () if eos_id is None else (eos_id,)
  out = engine.generate(padded, lengths, engine.settings(
      [settings_lib.Sampling(max_tokens=max_new_tokens, stop_ids=stop)] * len(prompts)),
      pad_id=pad_id)
  b = len(prompts)
  sequences = np.full((b, padded.shape[1] + max_new_tokens), pad_id, np.int32)
  for row, prompt in enumerate(prompts):
    n = int(out.num_generated[row])
    sequences[row, :len(prompt)] = prompt
    sequences[row, len(prompt):len(prompt) + n] = out.tokens[row, :n]
  return head_accuracies(model, sequences, lengths, lengths + out.num_generated, top_k)


def code_prompts(files: Sequence[str | pathlib.Path], tokenizer, num_prompts: int = 8,
                 max_tokens: int = 128, min_tokens: int = 64,
                 max_chars: int | None = None) -> list[str]:
  """Prompts from source files: their first lines of code, cut at a line boundary.

  Leading comment and blank lines (licence headers) are skipped, so a prompt starts where the
  code does. Files are picked evenly across the (sorted) list; a file whose code is shorter
  than `min_tokens` tokens is passed over.

  Args:
    files: source files.
    tokenizer: counts tokens.
    num_prompts: prompts wanted (fewer if the files run out).
    max_tokens: a prompt holds as many whole lines as fit in this many tokens.
    min_tokens: shorter prompts are not used.
    max_chars: if given, a prompt also holds at most this many characters (a budget that does
      not depend on the tokenizer, for comparing vocabularies).
  """
  files = list(files)
  if not files:
    raise ValueError('no files to take prompts from')
  stride = [int(k * len(files) / num_prompts) for k in range(num_prompts)]
  order = list(dict.fromkeys(stride + list(range(len(files)))))  # Evenly spread, then the rest.
  prompts = []
  for i in order:
    if len(prompts) == num_prompts:
      break
    lines = pathlib.Path(files[i]).read_text(encoding='utf-8', errors='replace').splitlines(True)
    first = next((j for j, line in enumerate(lines)
                  if line.strip() and not line.lstrip().startswith('#')), len(lines))
    text = ''
    for line in lines[first:]:
      if max_chars is not None and len(text) + len(line) > max_chars:
        break
      if len(tokenizer.encode(text + line)) > max_tokens:
        break
      text += line
    if len(tokenizer.encode(text)) >= min_tokens:
      prompts.append(text)
  return prompts


_TABLE = 'head_accuracies.json'


def workdir_accuracies(loaded, num_prompts: int = 8, top_k: int = 4) -> np.ndarray:
  """[D, R] measured top-k accuracies of a loaded model's heads (`calibrate`), cached.

  Measured on greedy continuations of prompts from every other file of the training corpus's
  validation split (code the model did not train on; the rest stays unseen for evaluations),
  once per set of weights, and kept in the measurement cache (`measurements.py`). An entry that
  is not a [D, R] table of probabilities is named in a warning and measured again.

  Raises:
    ValueError: the corpus has no validation files to measure on.
  """
  from mtp.data import corpora  # pylint: disable=import-outside-toplevel
  num_heads = loaded.model.cfg.mtp_num_heads
  weights = loaded.weight_fingerprints()
  key = f'{measurements.digest(weights)}-R{top_k}-n{num_prompts}-even'

  def valid(entry) -> bool:
    acc = np.asarray(entry, np.float64)
    return acc.shape == (num_heads, top_k) and bool(np.all((acc >= 0) & (acc <= 1)))

  cached = measurements.lookup(_TABLE, key, valid)
  if cached is not None:
    return np.asarray(cached, np.float64)
  files = corpora.corpus_splits(loaded.config.data)['valid'][::2]
  tokenizer = loaded.tokenizer
  prompts = code_prompts(files, tokenizer, num_prompts, max_tokens=96, min_tokens=16) \
      if files else []
  if not prompts:
    raise ValueError(f'no validation files to measure head accuracies on for '
                     f'tree={trees_lib.AUTO!r}; use tree={trees_lib.DEFAULT!r} or '
                     f'{trees_lib.CHAIN!r}')
  acc = calibrate(loaded.model, [tokenizer.encode(p) for p in prompts], max_new_tokens=128,
                  top_k=top_k, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
  measurements.store(_TABLE, key, acc.tolist())
  return acc
