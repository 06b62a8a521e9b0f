"""A decode request, validated once where it enters, before anything is compiled.

`make_request` turns a user's options into a `DecodeRequest`: hashable, so it is the static
identity of one compiled decoder. `check_prompts` checks the token ids. Both raise ValueError
naming the bad input. The loop behind them (`driver.py`) trusts what they return.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Callable, Sequence

import jax
import numpy as np

from mtp.decode import decoders
from mtp.decode import dynamic_trees
from mtp.decode import sampling as sampling_lib
from mtp.decode import trees as trees_lib

Array = jax.Array
# (drafts [B, N - 1], num_generated [B], hook_data) -> drafts [B, N - 1]; for tests and
# experiments (oracle or adversarial drafts). The function is part of the compiled decoder's
# identity; hook_data (any pytree of arrays) is traced, so new data does not recompile.
DraftHook = Callable[[Array, Array, object], Array]
TreeChoice = trees_lib.Tree | int | Sequence[Sequence[int]] | None
# Above this many lookup drafts the verification block alone outgrows any useful size (and XLA
# compiles ever larger programs): far past where verification stops paying on any hardware.
MAX_LOOKUP = 64
# The 'auto' decoder verifies its lookup chain only in steps where some row's lookup drafts
# matched a key of at least this many tokens (`lookup.propose_with_key`), else just the heads'
# block. Measured on the demo model's greedy continuations of validation-split code (8 prompts,
# 128 tokens): lookup drafts from keys of 0, 1, 2 and 3 tokens had 0.6, 1.4, 2.0 and 5.7 of
# their 8 tokens accepted on average; 1.4 falls short of what the 8 extra nodes cost there.
LOOKUP_MIN_KEY = 2
# What the 'auto' decoder may lose to one-token decoding in the worst case, where every draft
# fails: probes of drafting (`auto.probe_steps`) and retries of a kind of drafting step that
# stopped paying (`driver.LoopState`) are sized to lose at most this fraction.
FALLBACK_BUDGET = 0.05


@dataclasses.dataclass(frozen=True)
class DecodeRequest:
  """The static settings of one compiled decoder (hashable: a jit static argument).

  Attributes:
    max_new_tokens: tokens to generate per row at most.
    capacity: KV-cache slots per row.
    tree: the candidate block: node 0 is the newest token, the others are drafts. A root-only
      tree (one node) is autoregressive decoding.
    temperature, top_k, top_p: 0 = greedy; else the target distribution's shaping.
    draft_hook: replaces the drafts before each verification (tests); None in normal use.
    mesh: shard rows and the KV cache over it (None: one device).
    vocab_limit: ids >= this are never emitted nor drafted (the model's output layer may be
      wider than its tokenizer); None: every id.
    banned_ids: ids never emitted nor drafted (the pad id).
    row_mapped: run the model row by row (`row_mapped.py`): each row's tokens are bit-identical
      to a batch of one's, whatever else is in the batch (a server's promise), at the cost of
      rows not sharing matmuls.
    fallback: the 'auto' decoder: drafting stops (every row then decodes one token per pass,
      with a one-step retry now and then, `driver.LoopState`) once the batch, after a few
      probe steps, emits fewer tokens per step than drafting's break-even, the cost of one
      drafting step in one-token steps.
      The break-even and the probe are traced (`driver.decode(..., break_even=,
      probe_steps=)`; break-even 0: never stop), so measuring and using them share one
      compiled decoder.
    draft_vocab_size: N > 0: the heads draft over a draft vocabulary of N ids (FR-Spec,
      `draft_vocab.py`), which the decode call passes as a traced [N] array (a new vocabulary
      of the same size compiles nothing); 0: over the whole vocabulary.
    tree_budget: N > 0: a dynamic tree (`dynamic_trees.py`): every step, each row verifies
      the N nodes of `tree` (then a superset, heads' drafts only) that the heads' drafts make
      most probable; 0: `tree` itself, every step.
  """
  max_new_tokens: int
  capacity: int
  tree: trees_lib.Tree
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  draft_hook: DraftHook | None = None
  mesh: jax.sharding.Mesh | None = None
  vocab_limit: int | None = None
  banned_ids: tuple[int, ...] = ()
  row_mapped: bool = False
  fallback: bool = False
  draft_vocab_size: int = 0
  tree_budget: int = 0

  @property
  def block_size(self) -> int:
    """Tokens one drafting step verifies, root included."""
    return self.tree_budget or self.tree.num_nodes

  @property
  def masks_vocab(self) -> bool:
    """Whether some ids are never emitted (`vocab_limit`, `banned_ids`)."""
    return self.vocab_limit is not None or bool(self.banned_ids)

  @property
  def depth(self) -> int:
    """The deepest node of the tree (0 when nothing is drafted)."""
    return self.tree.max_depth

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  @property
  def drafts(self) -> bool:
    return self.tree.num_nodes > 1


def make_request(model_cfg, prompt_width: int, *, max_new_tokens: int,
                 decoder: str = 'speculative', tree: TreeChoice = None, lookup: int = 0,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 cache_capacity: int | None = None, draft_hook: DraftHook | None = None,
                 mesh: jax.sharding.Mesh | None = None, vocab_limit: int | None = None,
                 banned_ids: Sequence[int] = (), row_mapped: bool = False,
                 draft_vocab_size: int = 0, tree_budget: int = 0) -> DecodeRequest:
  """Checks a user's decode options and returns the request they describe.

  Args:
    model_cfg: the model's `ModelConfig`.
    prompt_width: P, the padded prompt width (it sizes the cache).
    max_new_tokens: tokens to generate per row at most.
    decoder: a name in `decoders.NAMES`.
    tree: drafting decoders: None (a chain of every head's top-1), an int k (a chain of k
      drafts), a `trees.Tree`, or Medusa-style choices (rank paths).
    lookup: drafting decoders, greedy only: also draft this many tokens by prompt lookup, as a
      chain below the tree's root (`trees.with_lookup`).
    temperature: 0 = greedy; else sample from softmax(logits / temperature).
    top_k: keep the k most likely tokens (0 = off). top_p: nucleus mass (1 = off).
    cache_capacity: KV slots (None: just enough); fix it to share compilations.
    draft_hook: replaces the drafts before each verification (tests).
    mesh: shard the rows and the KV cache over it.
    vocab_limit: never emit ids >= this (a tokenizer smaller than the output layer).
    banned_ids: never emit these ids (a pad id that is not also EOS).
    row_mapped: batch-invariant decoding, row by row (`DecodeRequest.row_mapped`).
    draft_vocab_size: drafting decoders with heads: the heads draft over a draft vocabulary of
      this many ids (`DecodeRequest.draft_vocab_size`); 0: over the whole vocabulary.
    tree_budget: drafting decoders with heads: verify a dynamic tree of this many nodes per
      step (root included), chosen each step from `tree` (None: `dynamic_trees.
      default_superset`); 0: the static `tree`. Not with lookup drafts.

  Raises:
    ValueError naming the bad option.
  """
  trunk = model_cfg.trunk
  spec = decoders.get(decoder)
  _check_positive_int('max_new_tokens', max_new_tokens)
  sampling_lib.validate_sampling(temperature, top_k, top_p, trunk.vocab_size)
  if isinstance(lookup, bool) or not isinstance(lookup, numbers.Integral) or lookup < 0:
    raise ValueError(f'lookup (--lookup) must be a non-negative integer, got {lookup!r}')
  longest_lookup = min(MAX_LOOKUP, trunk.max_seq_len)
  if lookup > longest_lookup:
    raise ValueError(f'lookup (--lookup) must be at most {longest_lookup} drafts, got {lookup}')
  vocab_limit, banned_ids = _check_vocab_mask(vocab_limit, banned_ids, trunk.vocab_size)
  if tree_budget is None:
    tree_budget = 0
  if (isinstance(tree_budget, bool) or not isinstance(tree_budget, numbers.Integral)
      or tree_budget < 0):
    raise ValueError(f'tree_budget must be a whole number of nodes (0: a static tree), got '
                     f'{tree_budget!r}')
  if tree_budget:
    candidates = _dynamic_superset(model_cfg.mtp_num_heads, tree, lookup, tree_budget, spec)
  elif spec.adaptive and model_cfg.mtp_num_heads == 0 and tree is None and not lookup:
    candidates = trees_lib.chain_tree(0)  # Nothing drafts: 'auto' is autoregressive.
  elif spec.drafts:
    candidates = resolve_tree(model_cfg.mtp_num_heads, tree, int(lookup))
  elif tree is not None or lookup:
    drafting = ', '.join(d.name for d in decoders.DECODERS.values() if d.drafts)
    raise ValueError(f'tree and lookup apply to the drafting decoders ({drafting}) only, not '
                     f'to {decoder!r}')
  else:
    candidates = trees_lib.chain_tree(0)
  if candidates.lookup_depth and temperature != 0:
    raise ValueError('lookup drafts are verified greedily only (temperature 0), got '
                     f'temperature {temperature}')
  if candidates.topk_per_depth and max(candidates.topk_per_depth) > trunk.vocab_size:
    raise ValueError(f'the tree needs the top-{max(candidates.topk_per_depth)} drafts of a '
                     f'head, more than the vocabulary size {trunk.vocab_size}')
  draft_vocab_size = _check_draft_vocab_size(draft_vocab_size, candidates, trunk.vocab_size,
                                             decoder)
  return DecodeRequest(
      max_new_tokens=int(max_new_tokens),
      capacity=_capacity(prompt_width, int(max_new_tokens),
                         int(tree_budget) or candidates.num_nodes, cache_capacity),
      tree=candidates, temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
      draft_hook=draft_hook, mesh=mesh, vocab_limit=vocab_limit, banned_ids=banned_ids,
      row_mapped=bool(row_mapped),
      fallback=spec.adaptive and candidates.num_nodes > 1, draft_vocab_size=draft_vocab_size,
      tree_budget=int(tree_budget))


def _dynamic_superset(num_heads: int, tree: TreeChoice, lookup, budget,
                      spec: decoders.Decoder) -> trees_lib.Tree:
  """The superset a dynamic tree of `budget` nodes chooses from, checked."""
  if not spec.drafts:
    raise ValueError(f'tree_budget (a dynamic tree) applies to the drafting decoders only, not '
                     f'to {spec.name!r}')
  if lookup:
    raise ValueError('a dynamic tree (tree_budget) drafts from the heads alone: give lookup=0 '
                     f'or a static tree, got lookup={lookup}')
  if tree is None:
    if num_heads == 0:
      raise ValueError('a dynamic tree (tree_budget) needs a model with MTP heads: this model '
                       'has mtp_num_heads=0')
    superset = dynamic_trees.default_superset(num_heads)
  else:
    superset = resolve_tree(num_heads, tree)
  dynamic_trees.check_superset(superset, budget)
  return dynamic_trees.reachable(superset, budget)


def _check_draft_vocab_size(size, tree: trees_lib.Tree, vocab_size: int, decoder: str) -> int:
  """The draft vocabulary's size, checked against the vocabulary and what the heads draft."""
  if (isinstance(size, bool) or not isinstance(size, numbers.Integral)
      or not 0 <= size <= vocab_size):
    raise ValueError(f'draft_vocab (--draft_vocab) must be an integer in [0, {vocab_size}] '
                     f'(0: the whole vocabulary), got {size!r}')
  if size and not tree.head_depth:
    raise ValueError(f'draft_vocab (--draft_vocab) applies to decoders whose heads draft; '
                     f'{decoder!r} drafts nothing with heads here (autoregressive, or a model '
                     'without MTP heads)')
  if size and tree.topk_per_depth and max(tree.topk_per_depth) > size:
    raise ValueError(f'the tree needs the top-{max(tree.topk_per_depth)} drafts of a head, more '
                     f'than the draft vocabulary\'s {size} ids (draft_vocab)')
  return int(size)


def check_fallback(break_even, probe_steps) -> tuple[tuple[float, float], tuple[int, int]]:
  """Drafting's break-even (tokens per step; 0: never stop drafting) and the steps drafted
  before the first check (`DecodeRequest.fallback`), checked: each one value, or a pair for
  the heads' block and the whole block (a tree with a lookup chain), returned as pairs."""
  break_even, probe_steps = _pair(break_even), _pair(probe_steps)
  for value in break_even:
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
        or not 0 <= value < float('inf')):
      raise ValueError(f'break_even must be a finite number >= 0 (or a pair), got {value!r}')
  for value in probe_steps:
    _check_positive_int('probe_steps', value)
  return tuple(map(float, break_even)), tuple(map(int, probe_steps))


def _pair(value) -> tuple:
  return tuple(value) if isinstance(value, (tuple, list)) and len(value) == 2 else (value, value)


def _check_vocab_mask(vocab_limit, banned_ids, vocab_size: int):
  if vocab_limit is not None:
    if (isinstance(vocab_limit, bool) or not isinstance(vocab_limit, numbers.Integral)
        or not 1 <= vocab_limit <= vocab_size):
      raise ValueError(f'vocab_limit must be an integer in [1, {vocab_size}], got '
                       f'{vocab_limit!r}')
    vocab_limit = None if vocab_limit == vocab_size else int(vocab_limit)
  banned = tuple(sorted({int(i) for i in banned_ids}))
  if any(not 0 <= i < vocab_size for i in banned):
    raise ValueError(f'banned_ids {list(banned)} reach outside the vocabulary [0, {vocab_size})')
  allowed = vocab_limit or vocab_size
  if len([i for i in banned if i < allowed]) >= allowed:
    raise ValueError('banned_ids and vocab_limit leave no token to emit')
  return vocab_limit, banned


def resolve_tree(num_heads: int, tree: TreeChoice, lookup: int = 0) -> trees_lib.Tree:
  """The candidate tree from a user's choice, checked against the model's `num_heads` heads.

  Args:
    num_heads: the model's MTP heads.
    tree: None (a chain of every head's top-1), an int k (a chain of k drafts), a
      `trees.Tree`, or Medusa-style choices (a sequence of rank paths).
    lookup: if > 0, hang a chain of this many prompt-lookup drafts below the root too.

  Raises:
    ValueError: the model has no heads, or the tree is empty or deeper than the heads.
  """
  if num_heads == 0:
    raise ValueError('speculative decoding needs a model with MTP heads: this model has '
                     'mtp_num_heads=0 (use the autoregressive decoder)')
  if tree is None:
    tree = trees_lib.chain_tree(num_heads)
  elif isinstance(tree, numbers.Integral) and not isinstance(tree, bool):
    if tree < 1:
      raise ValueError(f'chain length must be >= 1, got {tree}')
    if tree > num_heads:
      raise ValueError(f'chain length {tree} exceeds the number of MTP heads {num_heads}')
    tree = trees_lib.chain_tree(int(tree))
  elif not isinstance(tree, trees_lib.Tree):
    tree = trees_lib.tree_from_choices(tree)
  if tree.head_depth < 1:
    raise ValueError('the candidate tree has no drafted nodes')
  tree.check_num_heads(num_heads)
  if lookup:
    tree = trees_lib.with_lookup(tree, lookup)
  return tree


def check_prompts(prompts, prompt_lengths, *, max_new_tokens: int, vocab_size: int,
                  max_seq_len: int, eos_id: int | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
  """Checks right-padded prompts on the host; errors name the row (= the prompt's index).

  Args:
    prompts: [B, P] token ids, right-padded.
    prompt_lengths: [B] valid tokens per row, or None for all P.
    max_new_tokens, vocab_size, max_seq_len: the budget and the model's limits.
    eos_id: end-of-sequence id or None.

  Returns:
    (prompts [B, P] int32, prompt_lengths [B] int32) as numpy arrays.
  """
  tokens = np.asarray(prompts)
  if tokens.ndim != 2:
    raise ValueError(f'prompts must be [batch, length] token ids, got shape {tokens.shape}')
  if tokens.shape[0] == 0:
    raise ValueError('prompts is empty: give at least one prompt')
  if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f'prompts must hold integer token ids, got dtype {tokens.dtype}')
  if prompt_lengths is None:
    lengths = np.full(tokens.shape[0], tokens.shape[1], np.int32)
  else:
    lengths = np.asarray(prompt_lengths).astype(np.int32).reshape(-1)
    if lengths.shape[0] != tokens.shape[0]:
      raise ValueError(f'prompt_lengths has {lengths.shape[0]} entries for '
                       f'{tokens.shape[0]} prompts')
  if np.any(lengths <= 0):
    raise ValueError(f'empty prompt in row {int(np.argmax(lengths <= 0))}: every prompt needs '
                     'at least one token')
  if np.any(lengths > tokens.shape[1]):
    raise ValueError(f'prompt_lengths {lengths.tolist()} exceed the prompt width '
                     f'{tokens.shape[1]}')
  valid = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
  bad = valid & ((tokens < 0) | (tokens >= vocab_size))
  if np.any(bad):
    row, col = (int(i[0]) for i in np.nonzero(bad))
    raise ValueError(f'token id {int(tokens[row, col])} at prompt row {row}, position {col} is '
                     f'outside the vocabulary [0, {vocab_size})')
  _check_positive_int('max_new_tokens', max_new_tokens)
  longest = int(np.argmax(lengths))
  if lengths[longest] + max_new_tokens > max_seq_len:
    raise ValueError(f'prompt length {int(lengths[longest])} + max_new_tokens {max_new_tokens} '
                     f'= {int(lengths[longest]) + max_new_tokens} exceeds the model position '
                     f'limit max_seq_len={max_seq_len} (prompt {longest} is the longest)')
  if eos_id is not None and not 0 <= eos_id < vocab_size:
    raise ValueError(f'eos_id {eos_id} is outside the vocabulary [0, {vocab_size})')
  return tokens.astype(np.int32), lengths


def steps_per_chunk(value: int | None, decoder: str) -> int:
  """Loop steps per host round trip when streaming: `value`, or the decoder's default."""
  if value is None:
    return decoders.get(decoder).steps_per_chunk
  _check_positive_int('steps_per_chunk', value)
  return int(value)


def _check_positive_int(name: str, value) -> None:
  if (isinstance(value, bool) or not isinstance(value, numbers.Real) or int(value) != value
      or value < 1):
    raise ValueError(f'{name} must be a positive integer, got {value!r}')


def _capacity(prompt_width: int, max_new_tokens: int, block_size: int,
              requested: int | None) -> int:
  """Slots a decode needs: the padded prompt, every new token, and one verification block.

  A requested capacity that is too small is an error: a write past the end would be clamped
  onto committed slots, silently corrupting the cache.
  """
  needed = prompt_width + max_new_tokens + block_size
  if requested is None:
    return needed
  if requested < needed:
    raise ValueError(f'cache_capacity {requested} is too small: prompt width {prompt_width} + '
                     f'max_new_tokens {max_new_tokens} + block {block_size} = {needed} slots')
  return int(requested)
