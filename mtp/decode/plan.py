"""How to decode, resolved once: the decode plan.

`resolve(model, decoder, ...)` turns a decoder's name (`decoders.py`) and a user's options
into an `engine.Engine` holding
  * a `DecodePlan`: everything static about decoding, the compiled decoder's identity: the
    drafters in block order (`DRAFTERS` builds them: the heads' tree, named trees from one
    registry, `trees.NAMES`; prompt lookup; n-grams), the `auto` policy, the ids that may be
    emitted, the token budget, the cache's capacity, whether rows are mapped one by one;
  * its `PlanData`: the arrays the compiled loop reads (the draft vocabulary's ids, the
    policy's break-evens), traced, so new values compile nothing.
What it measures (the heads' accuracies, the hardware's cost curve and break-evens, a corpus's
token counts) goes through one cache (`measurements.py`). Every caller decodes through what
it returns: `mtp.generate`, streaming, the server, the jax_export artifact and the benchmarks.
Options are checked before anything is compiled; errors name the option.

The rules every caller shares are written here once: `emittable` (the ids a model's tokenizer
can decode), `padded_width` (prompts are padded to whole prefill chunks), `check_room` (a
prompt and its budget must fit the model's positions). What ends a row and why is the loop's,
named once in `finish.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import numbers
from typing import Any, Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mtp.data import tokenizer as tokenizer_lib
from mtp.decode import auto
from mtp.decode import decoders
from mtp.decode import draft_vocab as draft_vocab_lib
from mtp.decode import drafters as drafters_lib
from mtp.decode import dynamic_trees
from mtp.decode import loop
from mtp.decode import row_mapped
from mtp.decode import trees as trees_lib
from mtp.decode.drafters import dynamic as dynamic_lib
from mtp.decode.drafters import heads as heads_lib
from mtp.decode.drafters import lookup as lookup_lib
from mtp.model import kv_cache as kv_cache_lib

# Draft hook: (drafts [B, N - 1], num_generated [B], hook_data) -> drafts [B, N - 1]; for tests
# and experiments (oracle or adversarial drafts). Part of the compiled decoder's identity;
# hook_data (any pytree of arrays) is traced.
DraftHook = Callable[[jax.Array, jax.Array, Any], jax.Array]
# Nodes a dynamic tree chooses from (`trees.DYNAMIC`).
DYNAMIC_SUPERSET = 64
# Top logprobs a request may ask for (OpenAI's limit).
MAX_LOGPROBS = 20


@flax.struct.dataclass
class PlanData:
  """The arrays a plan's compiled loop reads (traced: new values compile nothing).

  Attributes:
    drafters: one entry per drafter (its data; the draft vocabulary's ids for a heads drafter
      with one).
    costs: [2, K] the `auto` policy's break-even of each kind of drafting step, for greedy
      rows (row 0) and sampled rows (row 1) ([2, 0] without a policy).
    force: [] a kind of step to run every step (-1: the policy's choice; measurements).
    hook: the plan's draft hook's data (tests), or None.
    expected: [K] each kind's tokens per step predicted from measured accuracies (inf where
      none predicts them); `auto` does not probe a kind predicted below its break-even.
  """
  drafters: tuple
  costs: Array
  force: Array
  hook: object = None
  expected: Array | None = None


@dataclasses.dataclass(frozen=True)
class DecodePlan:
  """Everything static about decoding: the compiled decoder's identity (hashable).

  Attributes:
    max_new_tokens: the most tokens a row may generate (rows have their own budgets up to it).
    capacity: KV-cache slots per row.
    drafters: the drafters, in block order (empty: autoregressive decoding).
    policy: the `auto` policy, or None: every step verifies every drafter's nodes.
    greedy_only: every row decodes greedily (the sampler is not compiled).
    vocab_limit: ids >= this are never emitted nor drafted (None: every id).
    banned_ids: ids never emitted nor drafted (a pad id).
    max_stop_ids: stop ids a row may have.
    logprobs: top log-probabilities kept per emitted token; -1: none, 0: the chosen one's.
    row_mapped: run the model row by row (`row_mapped.py`): each row's tokens are those of a
      batch of one, whatever else is in the batch.
    mesh: shard rows and the KV cache over it (None: one device).
    draft_hook: replaces the drafts before each verification (tests); None in normal use.
  """
  max_new_tokens: int
  capacity: int
  drafters: tuple[drafters_lib.Drafter, ...] = ()
  policy: auto.AutoPolicy | None = None
  greedy_only: bool = False
  vocab_limit: int | None = None
  banned_ids: tuple[int, ...] = ()
  max_stop_ids: int = 1
  logprobs: int = -1
  row_mapped: bool = False
  mesh: jax.sharding.Mesh | None = None
  draft_hook: DraftHook | None = None

  @property
  def num_kinds(self) -> int:
    """Kinds of drafting step: kind k verifies the first k drafters."""
    return len(self.drafters)

  def block(self, kind: int) -> tuple[trees_lib.Tree, np.ndarray]:
    """(the block a step of `kind` verifies, owner [N]: each node's drafter, -1 the root)."""
    return _block(self.drafters[:kind])

  @property
  def depth(self) -> int:
    """The deepest node of any block (0 when nothing is drafted)."""
    return max([0] + [self.block(k)[0].max_depth for k in range(1, self.num_kinds + 1)])

  @property
  def block_size(self) -> int:
    """Nodes of the largest block, root included."""
    return self.block(self.num_kinds)[0].num_nodes

  @property
  def heads_drafter(self) -> int | None:
    """The index of the drafter that reads the MTP heads, if any."""
    return next((i for i, d in enumerate(self.drafters) if d.head_depth), None)

  @property
  def head_depth(self) -> int:
    i = self.heads_drafter
    return 0 if i is None else self.drafters[i].head_depth

  @property
  def draft_vocab_size(self) -> int:
    i = self.heads_drafter
    return 0 if i is None else self.drafters[i].vocab_size

  def wrap(self, model, active):
    """The model as the loop calls it: row by row when rows are mapped, inactive rows
    skipped."""
    return row_mapped.RowMapped(model, active) if self.row_mapped else model


@functools.lru_cache(maxsize=None)
def _block(drafters: tuple[drafters_lib.Drafter, ...]) -> tuple[trees_lib.Tree, np.ndarray]:
  if not drafters:
    return trees_lib.chain_tree(0), np.full((1,), -1, np.int32)
  return trees_lib.join([d.tree for d in drafters])


# ------------------------------------------------------------------------------------------
# Rules every caller shares.
# ------------------------------------------------------------------------------------------


def padded_width(length: int) -> int:
  """The prompt width a prompt of `length` tokens is padded to: whole prefill chunks."""
  chunk = loop.PREFILL_CHUNK
  return max(1, -(-int(length) // chunk)) * chunk


def check_room(lengths, max_new_tokens, max_seq_len: int) -> None:
  """ValueError naming the prompt whose length and token budget (one for all, or [B]) most
  exceed the model's positions."""
  lengths = np.asarray(lengths).reshape(-1)
  if not lengths.size:
    return
  budgets = np.broadcast_to(np.asarray(max_new_tokens), lengths.shape)
  worst = int(np.argmax(lengths + budgets))
  length, budget = int(lengths[worst]), int(budgets[worst])
  if length + budget > max_seq_len:
    raise ValueError(f'prompt length {length} + max_new_tokens {budget} = {length + budget} '
                     f'exceeds the model position limit max_seq_len={max_seq_len} (prompt '
                     f'{worst} is the longest)')


def check_prompts(prompts, prompt_lengths, *, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-padded prompts [B, P] and lengths [B] (None: all P), checked on the host; errors
  name the row (= the prompt's index). Returns int32 numpy arrays."""
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
  return tokens.astype(np.int32), lengths


# ------------------------------------------------------------------------------------------
# Drafters, by name.
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Options:
  """A user's drafting options, as `resolve` received them (see its docstring)."""
  source: Any
  cfg: Any
  decoder: decoders.Decoder
  tree: Any
  tree_budget: int | None
  lookup: int | None
  draft_vocab: int | None
  batch_size: int
  capacity: int
  # The drafting cost curve that sized the heads' tree, where `auto` sized it.
  curve: dict[int, float] | None = None


def _heads(o: Options):
  """The heads' drafter (static or dynamic tree) and its data (draft vocabulary ids)."""
  heads = o.cfg.mtp_num_heads
  dynamic = o.tree == trees_lib.DYNAMIC or bool(o.tree_budget)
  given = None  # Ids given as they are (an array), not counted from the corpus.
  if o.draft_vocab is not None and np.ndim(o.draft_vocab) == 1:
    given = o.draft_vocab
    size = int(np.shape(given)[0])
  else:
    size = decoders.default_draft_vocab(o.decoder.name, _trained_draft_vocab(o),
                                        o.cfg.trunk.vocab_size, heads)
  if dynamic:
    if o.tree == trees_lib.DYNAMIC:
      superset = trees_lib.best_tree(_accuracies(o.source)[:heads], DYNAMIC_SUPERSET)
    elif o.tree is None:
      superset = dynamic_trees.default_superset(heads) if heads else None
    else:
      superset = _heads_tree(o, o.tree, size)
    if superset is None:
      raise ValueError('a dynamic tree (tree_budget) needs a model with MTP heads: this model '
                       'has mtp_num_heads=0')
    budget = o.tree_budget or _heads_tree(o, trees_lib.AUTO, size).num_nodes
    dynamic_trees.check_superset(superset, budget)
    tree = dynamic_trees.reachable(superset, budget)
    _check_draft_vocab_size(size, tree, o)
    drafter = dynamic_lib.DynamicHeadsDrafter(superset=tree, budget=int(budget),
                                              draft_vocab=size)
  else:
    tree = _heads_tree(o, o.tree, size)
    _check_draft_vocab_size(size, tree, o)
    drafter = heads_lib.HeadsDrafter(heads_tree=tree, draft_vocab=size)
  if not size:
    return drafter, None
  if given is not None:
    return drafter, jnp.asarray(draft_vocab_lib.check_ids(given, size, o.cfg.trunk.vocab_size))
  ids = _draft_vocabulary(o, size)
  if ids is None:  # The default's corpus is unreadable here: the whole vocabulary.
    return dataclasses.replace(drafter, draft_vocab=0), None
  return drafter, jnp.asarray(ids)


def _lookup(o: Options):
  length = o.lookup if o.lookup is not None else o.decoder.lookup
  return lookup_lib.LookupDrafter(length=int(length), capacity=o.capacity), None


def _ngram(o: Options):
  from mtp.decode.drafters import ngram  # pylint: disable=import-outside-toplevel
  return ngram.build(o)


# name -> builder(Options) -> (drafter, its data). A new drafter is one line here.
DRAFTERS: dict[str, Callable[[Options], tuple[drafters_lib.Drafter, Any]]] = {
    'heads': _heads,
    'lookup': _lookup,
    'ngram': _ngram,
}


def _heads_draft(cfg) -> bool:
  """Whether the model has heads to draft with."""
  return bool(cfg.mtp_num_heads)


def _drafter_names(o: Options, drafters: Sequence[str] | None) -> list[str]:
  """The drafters to mix, in block order: the decoder's own unless named, with `lookup`
  added (lookup > 0) or removed (lookup 0); heads only where the model has them."""
  spec = o.decoder
  if drafters is None:
    names = list(spec.drafters) if spec.drafts else []
    if not _heads_draft(o.cfg) and 'heads' in names:
      # A model without heads (or with heads that cannot draft yet) drafts by lookup alone.
      names.remove('heads')
      if 'lookup' not in names and spec.drafts:
        names.append('lookup')
  else:
    names = list(drafters)
    unknown = [n for n in names if n not in DRAFTERS]
    if unknown or len(set(names)) != len(names):
      raise ValueError(f'drafters must be distinct names of {", ".join(DRAFTERS)}, got '
                       f'{list(drafters)}')
  if not spec.drafts and (names or o.tree is not None or o.lookup or o.tree_budget):
    drafting = ', '.join(d.name for d in decoders.DECODERS.values() if d.drafts)
    what = 'tree_budget (a dynamic tree)' if o.tree_budget else 'tree and lookup'
    raise ValueError(f'{what} apply to the drafting decoders ({drafting}) only, not to '
                     f'{spec.name!r}')
  dynamic = o.tree == trees_lib.DYNAMIC or bool(o.tree_budget)
  if (o.lookup == 0 or (dynamic and o.lookup is None)) and 'lookup' in names:
    names.remove('lookup')  # Named off, or beside a dynamic tree, which drafts alone.
  elif o.lookup and 'lookup' not in names:
    names.append('lookup')
  if dynamic and 'heads' in names and len(names) > 1:
    # Named before the heads are built: a dynamic tree may measure their accuracies first.
    raise ValueError('a dynamic tree (tree_budget) drafts from the heads alone: give lookup=0 '
                     f'or a static tree, got lookup={o.lookup}')
  if 'heads' in names and names.index('heads'):
    names.remove('heads')
    names.insert(0, 'heads')  # The heads' tree keeps its ranks as node 1 ..
  return names


def _build_drafters(o: Options, names: list[str]) -> tuple[tuple, tuple]:
  built = [DRAFTERS[name](o) for name in names]
  return tuple(d for d, _ in built), tuple(data for _, data in built)


def _heads_tree(o: Options, choice, draft_vocab_size: int) -> trees_lib.Tree:
  """The heads' static tree for `choice` (names measured where they need it: 'auto' prices
  whole drafting steps, the heads drafting over `draft_vocab_size` ids, 0: all of them)."""
  heads = o.cfg.mtp_num_heads
  if choice == trees_lib.AUTO:
    from mtp.decode import cost_model  # pylint: disable=import-outside-toplevel
    model = _model(o.source)
    accuracies = _accuracies(o.source)
    o.curve = cost_model.drafting_curve(model, accuracies, batch_size=o.batch_size,
                                        draft_vocab_size=draft_vocab_size)
    return cost_model.choose_tree(model, accuracies, cost=o.curve)
  if choice is None and o.decoder.adaptive and heads:
    return _adaptive_default_tree(o, draft_vocab_size)
  return trees_lib.static_tree(choice, heads)


def _adaptive_default_tree(o: Options, draft_vocab_size: int) -> trees_lib.Tree:
  """The `auto` decoder's heads' tree when the caller names none: the tree 'auto' builds (sized
  by this hardware's cost curve for the heads' measured accuracies), or a chain of every head
  where the accuracies cannot be measured (no workdir, no validation files).

  Measured on the demo model (8 held-out prompts, 128 new tokens, medians of 4 runs) against
  the chain of its 4 heads, both with 8 lookup drafts: 1.13x against 1.05x the autoregressive
  speed at batch 1, 1.04x against 0.92x at batch 8; the cost curve asks for short blocks on a
  CPU, where a step costs in proportion to the tokens it verifies."""
  try:
    _accuracies(o.source)
  except (OSError, ValueError) as e:
    logging.info('auto: no measured head accuracies (%s); the heads draft a chain', e)
    return trees_lib.chain_tree(o.cfg.mtp_num_heads)
  return _heads_tree(o, trees_lib.AUTO, draft_vocab_size)


def _accuracies(source) -> np.ndarray:
  from mtp.decode import calibration  # pylint: disable=import-outside-toplevel
  if not hasattr(source, 'workdir'):
    raise ValueError('measuring the heads\' accuracies needs a loaded workdir (mtp.load): give '
                     'a static tree')
  return calibration.workdir_accuracies(source)


def _trained_draft_vocab(o: Options) -> int | None:
  """`o.draft_vocab`, or where it is unset the size of the draft vocabulary the heads trained
  on (`mtp_head_draft_vocab`: they draft over the same ids), or None (the decoder's default)."""
  if o.draft_vocab is not None:
    return o.draft_vocab
  config = getattr(o.source, 'config', None)
  trained = config.get('mtp_head_draft_vocab') if hasattr(config, 'get') else None
  return int(trained) if trained else None


def _draft_vocabulary(o: Options, size: int) -> np.ndarray | None:
  """The draft vocabulary's ids; None (logged) where the default cannot count the corpus."""
  if not hasattr(o.source, 'workdir'):
    if o.draft_vocab is None:
      return None
    raise ValueError('a draft vocabulary counts the training corpus: give a loaded workdir')
  try:
    return draft_vocab_lib.draft_vocabulary(o.source, size)
  except (OSError, ValueError) as e:
    if o.draft_vocab is not None:
      raise
    logging.warning('Drafting over the whole vocabulary: the default draft vocabulary of %d ids '
                    'counts the training corpus, which cannot be read here (%s: %s).', size,
                    type(e).__name__, e)
    return None


def _check_draft_vocab_size(size, tree: trees_lib.Tree, o: Options) -> None:
  vocab_size = o.cfg.trunk.vocab_size
  if (isinstance(size, bool) or not isinstance(size, numbers.Integral)
      or not 0 <= size <= vocab_size):
    raise ValueError(f'draft_vocab (--draft_vocab) must be an integer in [0, {vocab_size}] '
                     f'(0: the whole vocabulary), got {size!r}')
  if size and tree.topk_per_depth and max(tree.topk_per_depth) > size:
    raise ValueError(f'the tree needs the top-{max(tree.topk_per_depth)} drafts of a head, more '
                     f'than the draft vocabulary\'s {size} ids (draft_vocab)')


def _check_int(name: str, value, low: int, high: int | None = None, flag: str = '') -> int:
  if (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low
      or (high is not None and value > high)):
    bound = f'in [{low}, {high}]' if high is not None else f'>= {low}'
    raise ValueError(f'{name}{flag} must be an integer {bound}, got {value!r}')
  return int(value)


def _model(source):
  return source.model if hasattr(source, 'model') else source


# ------------------------------------------------------------------------------------------
# Resolution.
# ------------------------------------------------------------------------------------------


def resolve(source, decoder: str = decoders.DEFAULT, *, max_new_tokens: int,
            prompt_width: int = loop.PREFILL_CHUNK, batch_size: int = 1, tree=None,
            tree_budget: int | None = None, lookup: int | None = None,
            draft_vocab: int | None = None, drafters: Sequence[str] | None = None,
            greedy_only: bool = False, exact: bool = False, continuous: bool = False,
            logprobs: int = -1,
            max_stop_ids: int = 1, capacity: int | None = None, mesh=None,
            draft_hook: DraftHook | None = None, hook_data=None, emittable_ids=None,
            calibration=None, break_even: Sequence[float] | None = None):
  """The engine that decodes with `decoder` and these options, resolved once.

  Args:
    source: a `LoadedModel` (`mtp.load`), an `MTPModel` or a `state.PreparedModel` (measured
      trees, draft vocabularies and the emittable ids need a loaded workdir).
    decoder: a name in `decoders.NAMES`.
    max_new_tokens: the most tokens a row may generate.
    prompt_width: the widest padded prompt to decode (`padded_width`): sizes the cache.
    batch_size: rows decoded together (sizes measured trees and break-evens).
    tree: the heads' candidates: None (the decoder's default), a name of `trees.NAMES`, a
      chain length, Medusa-style choices (or their JSON text) or a `trees.Tree`.
    tree_budget: nodes per step of a dynamic tree (`tree` is its superset).
    lookup: prompt-lookup drafts per step (None: the decoder's default; 0: none).
    draft_vocab: the heads draft over the N most frequent ids of the training data (None: the
      decoder's default; 0: every id), or over these [N] ids.
    drafters: names of `DRAFTERS` to mix, in order (None: the decoder's).
    greedy_only: every row will decode greedily (the sampler is not compiled).
    exact: map rows one by one (`DecodePlan.row_mapped`).
    continuous: rows join and leave a batch that never ends (a server): `auto` chooses each
      step for the batch's throughput (`AutoPolicy.throughput`).
    logprobs: top log-probabilities kept per token (-1: none; at most `MAX_LOGPROBS`).
    max_stop_ids: stop ids a row may have.
    capacity: KV slots per row (None: just enough for prompt_width and max_new_tokens).
    mesh: shard rows and the cache over it.
    draft_hook, hook_data: replace the drafts before each verification (tests).
    emittable_ids: (vocab_limit, banned_ids) (None: `emittable` of the loaded tokenizer, or
      every id for a bare model).
    calibration: (prompts [B, P], lengths [B]) to time the `auto` policy's break-evens on
      (None: random prompts of `prompt_width` tokens).
    break_even: the `auto` policy's break-even of each kind of drafting step, if known (tests,
      experiments): [K] for every row, or [2, K] for greedy rows and sampled rows; None:
      measured (`auto.break_even`, cached; sampled rows' too unless greedy_only).

  Returns:
    An `engine.Engine`.

  Raises:
    ValueError naming the bad option, before anything is compiled.
  """
  from mtp.decode import engine as engine_lib  # pylint: disable=import-outside-toplevel
  spec = decoders.get(decoder)
  model = _model(source)
  cfg = model.cfg
  trunk = cfg.trunk
  max_new_tokens = _check_int('max_new_tokens', max_new_tokens, 1)
  prompt_width = padded_width(_check_int('prompt_width', prompt_width, 1))
  batch_size = _check_int('batch_size', batch_size, 1)
  logprobs = _check_int('logprobs', logprobs, -1, MAX_LOGPROBS)
  if lookup is not None:
    longest = min(lookup_lib.MAX_LENGTH, trunk.max_seq_len)
    if (isinstance(lookup, bool) or not isinstance(lookup, numbers.Integral)) or lookup < 0:
      raise ValueError(f'lookup (--lookup) must be a non-negative integer, got {lookup!r}')
    if lookup > longest:
      raise ValueError(f'lookup (--lookup) must be at most {longest} drafts, got {lookup}')
  if tree_budget is not None and tree_budget != 0:
    _check_int('tree_budget', tree_budget, 2)
  if isinstance(tree, str):
    tree = trees_lib.parse(tree)  # A name, or JSON rank paths as the --tree flag takes them.
  if emittable_ids is None:
    tokenizer = getattr(source, 'tokenizer', None)
    emittable_ids = (tokenizer_lib.emittable(tokenizer, trunk.vocab_size)
                     if tokenizer is not None else (None, ()))
  vocab_limit, banned = emittable_ids
  options = Options(source=source, cfg=cfg, decoder=spec, tree=tree, tree_budget=tree_budget,
                    lookup=lookup, draft_vocab=draft_vocab, batch_size=batch_size,
                    capacity=0)
  names = _drafter_names(options, drafters)
  if spec.drafts and not names and not spec.adaptive:
    raise ValueError(f'{spec.name} decoding needs drafts: this model has no MTP heads '
                     '(mtp_num_heads=0) and lookup is 0')
  # The positions a row reaches: its padded prompt, and its prompt and budget, which the
  # model's positions bound (`check_room`).
  options.capacity = max(prompt_width, min(prompt_width + max_new_tokens, trunk.max_seq_len))
  built, data = _build_drafters(options, names)
  wants_vocab = draft_vocab is not None and (np.ndim(draft_vocab) == 1 or draft_vocab != 0)
  if wants_vocab and not any(d.head_depth for d in built):
    raise ValueError(f'draft_vocab (--draft_vocab) applies to decoders whose heads draft; '
                     f'{decoder!r} drafts nothing with heads here (autoregressive, or a model '
                     'without MTP heads)')
  if capacity is not None:
    _check_int('capacity', capacity, options.capacity + _block(built)[0].num_nodes)

  def assemble(built, data):
    """The engine of these drafters (built by `_build_drafters`) and the options."""
    needed = options.capacity + _block(built)[0].num_nodes
    policy = None
    if spec.adaptive and built:
      policy = auto.AutoPolicy(num_kinds=len(built), least_probe=tuple(
          auto.ALL_OR_NOTHING_LEAST_PROBE if d.all_or_nothing else 1 for d in built),
          evidence_kinds=tuple(d.has_evidence for d in built), throughput=bool(continuous))
    plan = DecodePlan(
        max_new_tokens=max_new_tokens, capacity=kv_cache_lib.round_capacity(
            needed if capacity is None else capacity), drafters=built, policy=policy,
        greedy_only=bool(greedy_only), vocab_limit=vocab_limit, banned_ids=tuple(banned),
        max_stop_ids=_check_int('max_stop_ids', max_stop_ids, 1), logprobs=logprobs,
        row_mapped=bool(exact), mesh=mesh, draft_hook=draft_hook)
    plan_data = PlanData(drafters=data, costs=jnp.zeros((2, len(built)), jnp.float32),
                         force=jnp.int32(-1), hook=hook_data,
                         expected=jnp.full((len(built),), jnp.inf, jnp.float32))
    return engine_lib.Engine(source, plan, plan_data)

  engine = assemble(built, data)
  if engine.plan.policy is not None:
    if break_even is None:
      prompts, lengths = calibration if calibration is not None else _random_prompts(
          trunk.vocab_size, batch_size, min(prompt_width, trunk.max_seq_len - max_new_tokens))
      engine = _tree_checked_on_the_loop(options, names, engine, assemble, prompts, lengths)
      kinds = range(1, engine.plan.num_kinds + 1)
      greedy = [auto.break_even(engine, prompts, lengths, kind) for kind in kinds]
      # Greedy-only plans never hold a sampled row.
      break_even = [greedy, greedy if greedy_only else [
          auto.break_even(engine, prompts, lengths, kind, sampled=True) for kind in kinds]]
    built = engine.plan.drafters
    costs = np.broadcast_to(np.asarray(break_even, np.float32), (2, len(built)))
    if not np.all(np.isfinite(costs) & (costs >= 0)):
      raise ValueError(f'break_even must be finite numbers >= 0, got {break_even!r}')
    engine = engine.with_data(costs=jnp.asarray(costs), expected=jnp.asarray(
        _expected_tokens(options, built), jnp.float32))
  return engine


# The loop may price `auto`'s heads' tree this much above the cost curve before a smaller tree
# is priced on the loop too (`_tree_checked_on_the_loop`): it read SmolLM2's demo drafter's
# trees of 2 to 6 nodes 3-5% above the curve (AMD EPYC, 2 cores), and a curve measured in a
# slower stretch priced a 4-node tree at 1.19 one-token steps that the loop read at 1.40.
LOOP_OVER_CURVE = 1.1


def _tree_checked_on_the_loop(o: Options, names: list[str], engine, assemble, prompts,
                              lengths):
  """`engine`, or one whose heads draft a smaller tree: where the heads' tree is the one
  `auto` sized from the cost curve and the decoding loop prices it (its break-even, cached)
  more than `LOOP_OVER_CURVE` times the curve's price, the best smaller tree by the curve is
  priced on the loop too, and the tree that makes more tokens per unit of the loop's cost
  drafts. (The curve is timed in a small loop of its own, measured once; a disturbed one
  that survives its checks would otherwise size every later decoding's tree.)"""
  first, curve = engine.plan.drafters[0], o.curve
  if curve is None or not first.head_depth or first.dynamic or first.tree.num_nodes <= 2:
    return engine
  from mtp.decode import cost_model  # pylint: disable=import-outside-toplevel
  model, accuracies, chosen = _model(o.source), _accuracies(o.source), first.tree
  price = auto.break_even(engine, prompts, lengths, 1)
  counts = sorted(curve)
  priced = float(np.interp(chosen.num_nodes, counts, [curve[t] for t in counts]))
  if price <= LOOP_OVER_CURVE * priced:
    return engine
  smaller = cost_model.choose_tree(model, accuracies, cost=curve,
                                   candidates=range(2, chosen.num_nodes))
  other = assemble(*_build_drafters(dataclasses.replace(o, tree=smaller), names))
  other_price = auto.break_even(other, prompts, lengths, 1)
  tokens = lambda tree: 1 + trees_lib.expected_accepted_length(tree, accuracies)  # noqa: E731
  if tokens(smaller) / other_price <= tokens(chosen) / price:
    return engine
  logging.info('auto: the heads draft a tree of %d nodes (%.2f one-token steps on the loop), '
               'not the cost curve\'s %d (%.2f on the loop, %.2f on the curve)',
               smaller.num_nodes, other_price, chosen.num_nodes, price, priced)
  return other


def _expected_tokens(o: Options, built) -> list[float]:
  """Each kind's tokens per step predicted by the heads' measured accuracies: a kind that is
  the heads' static tree alone (measured where the tree was: `auto` trees); inf elsewhere.
  (The demo model's trees read 1.57 and 1.32 predicted, 1.53 and 1.43 decoded.)"""
  expected = [np.inf] * len(built)
  first = built[0] if built else None
  if hasattr(o.source, 'workdir') and first is not None and first.head_depth and (
      not first.dynamic):
    try:
      expected[0] = 1 + trees_lib.expected_accepted_length(first.tree, _accuracies(o.source))
    except (OSError, ValueError):  # No validation code to measure on: no prediction.
      pass
  return expected


def _random_prompts(vocab_size: int, batch_size: int, width: int):
  width = max(1, width)
  prompts = np.random.default_rng(0).integers(0, vocab_size, (batch_size, width), np.int32)
  return prompts, np.full((batch_size,), width, np.int32)
