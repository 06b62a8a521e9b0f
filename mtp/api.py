"""The Python entry points: `mtp.load(workdir)` and `mtp.generate(...)`.

Both take a training workdir or an export directory (`launch.export`): a params export loads
like a workdir; a jax_export directory loads as `export.runtime.LoadedArtifact`, and
`generate` then calls its serialized programs, running no model code.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import os
import time
from typing import Any, Callable, Sequence

import jax
import ml_collections
import numpy as np
from etils import epath
from flax import nnx

from mtp.checkpoint import checkpointing
from mtp.checkpoint import paths
from mtp.data import tokenizer as tokenizer_lib
from mtp.decode import decoders
from mtp.decode import draft_vocab as draft_vocab_lib
from mtp.decode import driver
from mtp.decode import request as request_lib
from mtp.decode import sampling as sampling_lib
from mtp.decode import state as state_lib
from mtp.decode import streaming
from mtp.decode import trees as trees_lib
from mtp.export import manifest as manifest_lib
from mtp.export import runtime
from mtp.model import mtp_model


@dataclasses.dataclass
class LoadedModel:
  """A trained model with what it needs to run: tokenizer, config, provenance."""
  model: mtp_model.MTPModel
  tokenizer: tokenizer_lib.Tokenizer
  config: ml_collections.ConfigDict
  step: int
  workdir: epath.Path
  # `prepared()`'s copy and the weights it was made from.
  _prepared: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)
  _prepared_from: tuple = dataclasses.field(default=(), init=False, repr=False, compare=False)

  def prepared(self) -> state_lib.PreparedModel:
    """`model` prepared for decoding (`state.prepare`: on CPU a copy with fused projections),
    made once and kept while `model` holds the same weight arrays; a new model or a replaced
    weight prepares again. (Preparing SmolLM2 copies about 280 MB of projections.)"""
    leaves = tuple(jax.tree.leaves(nnx.state(self.model)))
    if (self._prepared is None or len(leaves) != len(self._prepared_from)
        or any(a is not b for a, b in zip(leaves, self._prepared_from))):
      self._prepared = state_lib.prepare(self.model)
      self._prepared_from = leaves
    return self._prepared


def load(workdir: str | os.PathLike, step: int | None = None,
         device: jax.Device | None = None, scan_layers: bool | None = None
         ) -> LoadedModel | runtime.LoadedArtifact:
  """Loads the parameters of the latest (or the given) checkpoint of a training workdir.

  `workdir` may also be an export directory (`launch.export`): a params export loads as a
  workdir; a jax_export one as a `runtime.LoadedArtifact` (its programs, no model).

  The trunk's layers load in the layout `scan_layers` asks for (default: the config's
  `model.scan_layers`), whichever layout the checkpoint holds (`mtp.model.layout`); the returned
  config says which.

  Raises:
    checkpointing.CheckpointError: the workdir, its config, tokenizer or checkpoint is missing
      or unreadable (the message names which).
    ValueError: the tokenizer file is corrupt, or the directory is an export that `mtp` does
      not run (the message names it).
  """
  workdir = paths.as_path(workdir)  # Local, or on an object store (gs://...).
  exported = manifest_lib.read(workdir)
  if exported is not None and exported['format'] == runtime.FORMAT:
    artifact = runtime.load(workdir, device=device)
    if step is not None and step != artifact.step:
      raise checkpointing.CheckpointError(
          f'{workdir} is a jax_export of step {artifact.step}, not of step {step}.')
    return artifact
  if exported is not None and exported['format'] != 'params':
    raise ValueError(f'{workdir} is an export in the {exported["format"]} format, which mtp '
                     'does not run: load the training workdir, or a params or jax_export export')
  config = checkpointing.load_config(workdir)
  if not (workdir / tokenizer_lib.FILENAME).exists():
    raise checkpointing.CheckpointError(f'{workdir / tokenizer_lib.FILENAME} does not exist.')
  tokenizer = tokenizer_lib.Tokenizer.load(workdir)
  if scan_layers is not None:
    with config.unlocked():
      config.model.scan_layers = bool(scan_layers)
  model_config = mtp_model.ModelConfig.from_config(config.model)
  abstract = nnx.eval_shape(lambda: mtp_model.MTPModel(model_config, rngs=nnx.Rngs(0)))
  graphdef, abstract_params = nnx.split(abstract)
  sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                        abstract_params)
  # A heads-only workdir's trunk comes from its base workdir (base.json): restore_params knows.
  params, step = checkpointing.restore_params(workdir, target, step=step)
  return LoadedModel(model=nnx.merge(graphdef, params), tokenizer=tokenizer, config=config,
                     step=step, workdir=workdir)


# ------------------------------------------------------------------------------------------
# Generation.
# ------------------------------------------------------------------------------------------

DECODERS = decoders.NAMES
TREES = ('chain', 'default', 'auto', 'dynamic')
_PROMPT_WIDTH_MULTIPLE = 32  # Nearby prompt lengths share a compiled decoder.
_DYNAMIC_SUPERSET = 64  # Nodes a dynamic tree chooses from (tree='dynamic').
_ACCURACIES_FILE = 'head_accuracies.json'


@dataclasses.dataclass
class Generation:
  """One prompt's completion and decoding statistics.

  Attributes:
    prompt: the prompt text.
    completion: the generated text (EOS not included).
    tokens: generated token ids (EOS included when it ended the completion).
    num_prompt_tokens: tokens in the prompt.
    num_steps: forward passes of the decode loop that worked on this prompt (the prefill,
      which gives the first token, is not counted).
    mean_accepted: tokens emitted per loop step (1 for autoregressive decoding).
    accepted_histogram: entry j counts the loop steps that emitted j tokens.
    tokens_per_sec: this prompt's tokens over the wall time of the batch that decoded it
      (prefill included, compilation excluded); a batch's throughput is the sum over its rows.
    seconds: that wall time.
    finish_reason: 'eos' or 'length'.
  """
  prompt: str
  completion: str
  tokens: list[int]
  num_prompt_tokens: int
  num_steps: int
  mean_accepted: float
  accepted_histogram: list[int]
  tokens_per_sec: float
  seconds: float
  finish_reason: str

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


TextCallback = Callable[[int, str, bool], None]


def generate(loaded_or_workdir: LoadedModel | str | os.PathLike, prompts: str | Sequence[str],
             *, max_new_tokens: int, decoder: str = decoders.DEFAULT, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             tree: str | Sequence[Sequence[int]] | trees_lib.Tree | None = None,
             lookup: int | None = None, batch_size: int | None = None,
             on_text: TextCallback | None = None,
             steps_per_chunk: int | None = None, special_tokens: bool = False,
             draft_vocab: int | None = None, tree_budget: int | None = None
             ) -> list[Generation]:
  """Completes text prompts with a trained model: the Python twin of `launch.generate`.

  Prompts are decoded in batches of `batch_size` in their given order, right-padded to one
  width (rows have their own lengths), so one compiled decoder serves every batch; a short last
  batch is filled with copies of its last prompt. Before anything runs, the whole request is
  checked (empty or too long prompts, sampling settings, tree, decoder), and errors name the
  prompt. Then the decoder is compiled and warmed up on the first batch with a single loop step,
  so the timed runs, and `tokens_per_sec`, exclude compilation.

  Args:
    loaded_or_workdir: `mtp.load(...)`'s result, or a workdir or export directory to load.
    prompts: one prompt or a list.
    max_new_tokens: tokens to generate per prompt at most (EOS stops earlier).
    decoder: a name in `decoders.NAMES`: 'auto' (the default: speculative decoding, greedy
      with prompt-lookup drafts where the text repeats, that stops each kind of drafting step
      where it does not pay, judged against its break-even measured once on this hardware,
      `decode.auto`, and retries it now and then; its heads draft the tree 'auto' builds
      where the heads' accuracies can be measured, else a chain; autoregressive for a model
      without heads), 'speculative' (the model's heads draft, its trunk verifies; same output
      distribution) or 'autoregressive'.
    temperature: 0 = greedy; else sampling from softmax(logits / temperature).
    top_k: keep the k most likely tokens (0 = all).
    top_p: nucleus mass in (0, 1] (1 = all).
    seed: sampling seed (batch i uses fold_in(seed, i)).
    tree: speculative candidates: None or 'chain' (every head's top-1 in a chain), 'default'
      (a 24-node Medusa-style static tree cut to the model's heads), 'auto' (built from the
      heads' top-k accuracies, measured once per checkpoint on the training corpus's
      validation files and cached in the workdir, sized by the measured verification cost
      curve of this hardware and batch size), 'dynamic' (a dynamic tree, EAGLE-2 style:
      each step and row verifies the `tree_budget` nodes its heads' drafts make most
      probable, out of the best 64-node tree for the heads' measured accuracies),
      Medusa-style choices (rank paths), or a `trees.Tree`.
    tree_budget: nodes per step of a dynamic tree, root included (`tree` is then its
      superset, None a 64-node default; for tree='dynamic', None sizes it as 'auto' sizes a
      static tree: from the heads' measured accuracies and this hardware's cost curve). Not
      with lookup drafts.
    lookup: drafting decoders, greedy only: also draft this many tokens by prompt lookup, a
      copy of what followed the latest earlier occurrence of the text's last tokens, as one
      more chain below the tree's root (`trees.with_lookup`). Strong on repetitive text.
      None: the decoder's default (`decoders.default_lookup`): 8 for 'auto' when greedy,
      which verifies them only in steps where they look likely to pass; 0 otherwise.
    batch_size: prompts per batch (None: all in one).
    on_text: if given, the decode loop runs a chunk of steps at a time and
      `on_text(prompt_index, text, finished)` receives each prompt's text as it is accepted
      (`finished` marks the last call for that prompt); timings then include the per-chunk
      host round trips.
    steps_per_chunk: loop steps per chunk when streaming (None: the decoder's default).
    special_tokens: read special-token strings in the prompts (a rendered chat template's
      markers, as `chat` makes) as the model's special ids; by default they are plain text.
    draft_vocab: drafting decoders: the heads draft over only the N most frequent token ids
      of the training data (FR-Spec; counted once and cached in the workdir,
      `draft_vocabulary`), a cheaper projection than the whole vocabulary's; drafts of other
      ids are lost, output is unchanged (verification reads the whole vocabulary). 0: the
      whole vocabulary. None: the decoder's default (`decoders.default_draft_vocab`): 8,192
      ids for 'auto' when the vocabulary holds at least 32,768 (where the training corpus can
      be read; else the whole vocabulary), the whole vocabulary otherwise.

  Returns:
    One `Generation` per prompt, in order.

  Raises:
    ValueError: bad input, named, before anything is compiled.
  """
  loaded = loaded_or_workdir
  if not isinstance(loaded, (LoadedModel, runtime.LoadedArtifact)):
    loaded = load(loaded_or_workdir)
  texts = _checked_texts(prompts)
  spec = decoders.get(decoder)
  batch_size = _checked_batch_size(batch_size, len(texts))
  steps_per_chunk = request_lib.steps_per_chunk(steps_per_chunk, decoder)
  dynamic = spec.drafts and (tree == 'dynamic' or bool(tree_budget))
  if isinstance(loaded, runtime.LoadedArtifact):
    if dynamic:
      raise ValueError('dynamic trees apply to a workdir or params export, not to a jax_export '
                       'artifact (its programs are fixed)')
    if draft_vocab:
      raise ValueError('draft_vocab applies to a workdir or params export, not to a jax_export '
                       'artifact (its programs are fixed)')
    return _generate_exported(loaded, texts, max_new_tokens=max_new_tokens, decoder=decoder,
                              temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                              tree=tree, lookup=lookup or 0, batch_size=batch_size,
                              on_text=on_text,
                              special_tokens=special_tokens)

  model, tokenizer = loaded.model, loaded.tokenizer
  if dynamic and lookup is None:
    lookup = 0  # A dynamic tree drafts from the heads alone.
  lookup = decoders.default_lookup(decoder, lookup, temperature, model.cfg.mtp_num_heads)
  padded, lengths = state_lib.pad_prompts(_encode(tokenizer, texts, special_tokens),
                                          tokenizer.pad_id, multiple=_PROMPT_WIDTH_MULTIPLE)
  # The whole request at once, so a row index is the prompt's index.
  cfg = model.cfg.trunk
  padded, lengths = request_lib.check_prompts(
      padded, lengths, max_new_tokens=max_new_tokens, vocab_size=cfg.vocab_size,
      max_seq_len=cfg.max_seq_len, eos_id=tokenizer.eos_id)
  draft_vocab_size = decoders.default_draft_vocab(decoder, draft_vocab, cfg.vocab_size,
                                                  model.mtp_num_heads)
  options = dict(max_new_tokens=max_new_tokens, decoder=decoder, lookup=lookup,
                 temperature=temperature, top_k=top_k, top_p=top_p,
                 draft_vocab_size=draft_vocab_size, **_emittable(tokenizer, model.cfg))
  measures = spec.drafts and (tree in ('auto', 'dynamic') if isinstance(tree, str)
                              else spec.adaptive and tree is None)
  if measures or draft_vocab_size:
    # 'auto' and 'dynamic' trees (and the 'auto' decoder's default) measure the heads and the
    # hardware (compiling the model), a draft vocabulary counts the corpus: check the rest
    # first.
    request_lib.make_request(model.cfg, padded.shape[1], **options)
  special = dict(eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
  if draft_vocab_size:
    ids = (draft_vocabulary(loaded, draft_vocab_size) if draft_vocab is not None
           else _default_draft_vocabulary(loaded, draft_vocab_size))
    if ids is None:
      options['draft_vocab_size'] = 0
    else:
      special['draft_vocab'] = ids
  tree, tree_budget = resolve_tree(loaded, tree, decoder=decoder, batch_size=batch_size,
                                   tree_budget=tree_budget)
  request = request_lib.make_request(model.cfg, padded.shape[1], tree=tree,
                                     tree_budget=tree_budget, **options)

  prepared = loaded.prepared()
  batches = _batches(padded, lengths, batch_size)

  # Compile and warm up: the prefill and one loop step (the step count is not compiled in).
  warm = driver.decode_chunks(prepared, batches[0][1], batches[0][2], request,
                              steps_per_chunk=1, **special)
  for _ in itertools.islice(warm, 2):
    pass
  warm.close()
  fallback = {}
  if request.fallback:  # 'auto': what a drafting step costs here, timed on the same program.
    from mtp.decode import auto
    measure = functools.partial(auto.break_even, prepared, batches[0][1], batches[0][2],
                                request)
    whole = measure()
    if request.tree.lookup_depth:  # The heads' block alone is the other kind of step.
      heads = measure(heads_only=True)
      fallback = dict(break_even=(heads, whole), probe_steps=(
          auto.probe_steps(heads, max_new_tokens),
          auto.probe_steps(whole, max_new_tokens, least=auto.LOOKUP_LEAST_PROBE)))
    else:
      fallback = dict(break_even=whole, probe_steps=auto.probe_steps(whole, max_new_tokens))

  results = []
  root_key = jax.random.key(seed)
  for index, (rows, tokens, row_lengths) in enumerate(batches):
    rng = jax.random.fold_in(root_key, index)
    start = time.perf_counter()
    if on_text is None:
      out = jax.device_get(driver.decode(prepared, tokens, row_lengths, request, rng=rng,
                                         **fallback, **special))
    else:
      chunks = driver.decode_chunks(prepared, tokens, row_lengths, request,
                                    steps_per_chunk=steps_per_chunk, rng=rng, **fallback,
                                    **special)
      for update in streaming.text_updates(chunks, tokenizer, max_new_tokens=max_new_tokens,
                                           eos_id=tokenizer.eos_id):
        for row, prompt_index in enumerate(rows):
          if update.text[row] or (update.done[row] and len(update.new_tokens[row])):
            on_text(prompt_index, update.text[row], bool(update.done[row]))
        out = update.result
    seconds = time.perf_counter() - start
    results += [_generation(out, row, texts[prompt_index], int(row_lengths[row]), tokenizer,
                            seconds) for row, prompt_index in enumerate(rows)]
  return results


def _encode(tokenizer: tokenizer_lib.Tokenizer, texts: list[str], special_tokens: bool
            ) -> list[list[int]]:
  if special_tokens:
    return [tokenizer.encode(t, special=True) for t in texts]
  return tokenizer.encode_batch(texts)


def chat(loaded_or_workdir: LoadedModel | str | os.PathLike, messages: Sequence[dict], *,
         max_new_tokens: int, **options) -> Generation:
  """The model's reply to a conversation, through its own chat template.

  The template (Jinja, Hugging Face conventions, kept from the imported model) renders
  `messages` ([{'role': ..., 'content': ...}]) with the prompt of the assistant's turn, in
  jinja2's sandbox (the `serve` extra); its markers are read as special tokens.

  Args:
    loaded_or_workdir: `mtp.load(...)`'s result, or a workdir or export directory to load.
    messages: the conversation so far.
    max_new_tokens, options: as for `generate`.

  Raises:
    ValueError: the model has no chat template, or the template refuses the messages.
  """
  from mtp.serving import chat as chat_lib  # jinja2: only conversations need it.
  from mtp.serving import schemas
  loaded = loaded_or_workdir
  if not isinstance(loaded, (LoadedModel, runtime.LoadedArtifact)):
    loaded = load(loaded_or_workdir)
  try:
    prompt = chat_lib.render(loaded.tokenizer, list(messages))
  except schemas.RequestError as e:
    raise ValueError(str(e)) from None
  (reply,) = generate(loaded, prompt, max_new_tokens=max_new_tokens, special_tokens=True,
                      **options)
  return reply


def _batches(padded: np.ndarray, lengths: np.ndarray, batch_size: int) -> list[tuple]:
  """(prompt indices, tokens [batch_size, P], lengths [batch_size]) per batch, in order; a
  short last batch repeats its last prompt, so every batch has one shape."""
  batches = []
  for first in range(0, len(padded), batch_size):
    rows = list(range(first, min(first + batch_size, len(padded))))
    fill = rows + [rows[-1]] * (batch_size - len(rows))
    batches.append((rows, padded[fill], lengths[fill]))
  return batches


def _generate_exported(artifact: runtime.LoadedArtifact, texts: list[str], *,
                       max_new_tokens: int, decoder: str, temperature: float, top_k: int,
                       top_p: float, seed: int, tree, lookup: int, batch_size: int,
                       on_text: TextCallback | None, special_tokens: bool
                       ) -> list[Generation]:
  """`generate` on a jax_export artifact: the same checks, batches, seeds and results.

  The whole loop is one call, so `on_text` gets each prompt's whole text at its end.
  """
  tokenizer = artifact.tokenizer
  padded, lengths = state_lib.pad_prompts(_encode(tokenizer, texts, special_tokens),
                                          tokenizer.pad_id, multiple=_PROMPT_WIDTH_MULTIPLE)
  padded, lengths = request_lib.check_prompts(
      padded, lengths, max_new_tokens=max_new_tokens, vocab_size=artifact.vocab_size,
      max_seq_len=artifact.max_seq_len, eos_id=tokenizer.eos_id)
  sampling_lib.validate_sampling(temperature, top_k, top_p, artifact.vocab_size)
  if not decoders.get(decoder).drafts and (tree is not None or lookup):
    raise ValueError(f'tree and lookup apply to the drafting decoders only, not to {decoder!r}')
  if decoders.get(decoder).adaptive:  # Exported loops hold no fallback: their speculative one.
    decoder = 'speculative' if 'speculative' in artifact.decoders else 'autoregressive'
  program = artifact.program(decoder, temperature=temperature, top_k=top_k, top_p=top_p,
                             tree=tree, lookup=lookup, max_new_tokens=max_new_tokens)
  special = dict(eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
  batches = _batches(padded, lengths, batch_size)
  # Compile and warm up on the first batch's shape: the prefill and one loop step (a loop
  # body's first run costs more than its later ones).
  program.run(artifact.params, batches[0][1], batches[0][2], key=artifact.key(seed),
              max_new_tokens=2, **special)
  results = []
  for index, (rows, tokens, row_lengths) in enumerate(batches):
    start = time.perf_counter()
    out = program.run(artifact.params, tokens, row_lengths, key=artifact.key(seed, index),
                      max_new_tokens=max_new_tokens, **special)
    seconds = time.perf_counter() - start
    for row, prompt_index in enumerate(rows):
      results.append(_generation(out, row, texts[prompt_index], int(row_lengths[row]),
                                 tokenizer, seconds))
      if on_text is not None:
        on_text(prompt_index, results[-1].completion, True)
  return results


def _generation(out: state_lib.DecodeResult | runtime.Result, row: int, prompt: str,
                num_prompt_tokens: int, tokenizer: tokenizer_lib.Tokenizer,
                seconds: float) -> Generation:
  """Row `row` of a batch's (host) result, timed over the batch's `seconds`."""
  n = int(out.num_generated[row])
  generated = [int(t) for t in out.tokens[row, :n]]
  return Generation(
      prompt=prompt, completion=tokenizer.decode(generated), tokens=generated,
      num_prompt_tokens=num_prompt_tokens, num_steps=int(out.num_steps[row]),
      mean_accepted=float(np.asarray(out.mean_accepted)[row]),
      accepted_histogram=[int(c) for c in out.accepted_histogram[row]],
      tokens_per_sec=n / seconds, seconds=seconds,
      finish_reason='eos' if generated and generated[-1] == tokenizer.eos_id else 'length')


def _emittable(tokenizer: tokenizer_lib.Tokenizer, model_cfg) -> dict:
  """Every decoder emits only ids the tokenizer decodes: not the output layer's spare ids past
  the tokenizer's vocabulary, nor the pad id (unless it doubles as EOS, as in SmolLM2)."""
  banned = () if tokenizer.pad_id in (None, tokenizer.eos_id) else (tokenizer.pad_id,)
  return dict(vocab_limit=min(tokenizer.vocab_size, model_cfg.trunk.vocab_size),
              banned_ids=banned)


def _checked_texts(prompts) -> list[str]:
  if prompts is None or not isinstance(prompts, (str, Sequence)):
    raise ValueError(f'prompts must be a string or a list of strings, got '
                     f'{type(prompts).__name__}')
  texts = [prompts] if isinstance(prompts, str) else list(prompts)
  if not texts:
    raise ValueError('prompts is empty: give at least one prompt')
  for i, text in enumerate(texts):
    if not isinstance(text, str):
      raise ValueError(f'prompt {i} is not a string: {type(text).__name__}')
    if not text:
      raise ValueError(f'prompt {i} is empty: every prompt needs at least one token')
  return texts


def _checked_batch_size(batch_size, num_prompts: int) -> int:
  if batch_size is None:
    return num_prompts
  if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
    raise ValueError(f'batch_size must be a positive integer, got {batch_size!r}')
  return min(int(batch_size), num_prompts)


def _tree(loaded: LoadedModel, tree, batch_size: int):
  """A user's tree choice as something `request.make_request` accepts."""
  model = loaded.model
  if isinstance(tree, str):
    if tree not in TREES:
      raise ValueError(f'tree must be one of {TREES}, Medusa-style choices or None, got {tree!r}')
    if model.cfg.mtp_num_heads == 0:
      return None  # make_request names the real problem: no heads.
    if tree == 'chain':
      return None
    if tree == 'default':
      return trees_lib.medusa_default_tree(model.cfg.mtp_num_heads)
    from mtp.decode import cost_model  # Only 'auto' needs the cost curve.
    return cost_model.choose_tree(model, head_accuracies(loaded),
                                  cost=cost_model.step_cost(model, batch_size=batch_size))
  return tree


def resolve_tree(loaded: LoadedModel, tree, *, decoder: str, batch_size: int,
                 tree_budget: int | None = None) -> tuple[Any, int]:
  """A user's tree choice (`generate`'s `tree` and `tree_budget`) as `make_request` takes it.

  Named trees are built here: 'auto' and 'dynamic' from the heads' measured accuracies and this
  hardware's cost curve at `batch_size`, the 'auto' decoder's default (tree None) likewise.
  Anything a decoder cannot take is passed on for `request.make_request` to name.

  Returns:
    (tree, budget): a static tree (or None, a chain) and 0, or a dynamic tree's superset and
    its node budget.
  """
  spec = decoders.get(decoder)
  heads = loaded.model.cfg.mtp_num_heads
  if not spec.drafts:
    return tree, tree_budget or 0
  if heads == 0:  # make_request names the real problem: nothing drafts.
    return (None if isinstance(tree, str) else tree), tree_budget or 0
  if tree == 'dynamic' or tree_budget:
    if tree == 'dynamic':  # The superset and its budget from the heads' measured accuracies.
      superset = trees_lib.best_tree(head_accuracies(loaded)[:heads], _DYNAMIC_SUPERSET)
    elif tree is None:
      superset = None
    else:
      superset = _tree(loaded, tree, batch_size) or trees_lib.chain_tree(heads)
    return superset, tree_budget or _tree(loaded, 'auto', batch_size).num_nodes
  if spec.adaptive and tree is None:
    return _adaptive_default_tree(loaded, batch_size), 0
  return _tree(loaded, tree, batch_size), 0


def _adaptive_default_tree(loaded: LoadedModel, batch_size: int):
  """The 'auto' decoder's heads' block when the caller names none: the tree 'auto' builds
  (sized by this hardware's cost curve for the heads' measured accuracies), or None (a chain
  of every head) where the accuracies cannot be measured (no validation files).

  Measured on the demo model (8 held-out prompts, 128 new tokens, medians of 4 runs) against
  the chain of its 4 heads, both with 8 lookup drafts: 1.13x against 1.05x the autoregressive
  speed at batch 1, 1.04x against 0.92x at batch 8; the cost curve asks for short blocks on a
  CPU, where a step costs in proportion to the tokens it verifies."""
  if loaded.model.cfg.mtp_num_heads == 0:
    return None
  try:
    head_accuracies(loaded)
  except (OSError, ValueError) as e:
    logging.info('auto: no measured head accuracies (%s); the heads draft a chain', e)
    return None
  return _tree(loaded, 'auto', batch_size)


def draft_vocabulary(loaded: LoadedModel, size: int) -> np.ndarray:
  """[size] int32 token ids: the model's draft vocabulary of that size (FR-Spec).

  The `size` most frequent ids of the training split of the workdir's corpus (most frequent
  first; ties by id), ids the model never emits (the pad id, ids past the tokenizer's) last.
  The counts are made once and cached in `workdir/token_counts.npy`
  (`draft_vocab.workdir_counts`).
  """
  vocab_size = loaded.model.cfg.trunk.vocab_size
  draft_vocab_lib.check_size(size, vocab_size)
  counts = draft_vocab_lib.workdir_counts(loaded.workdir, loaded.config, loaded.tokenizer,
                                          vocab_size)
  emittable = _emittable(loaded.tokenizer, loaded.model.cfg)
  return draft_vocab_lib.top_ids(counts, size, excluded=emittable['banned_ids'],
                                 limit=emittable['vocab_limit'])


def _default_draft_vocabulary(loaded: LoadedModel, size: int) -> np.ndarray | None:
  """`draft_vocabulary(loaded, size)`, or None (the whole vocabulary, logged) where the training
  corpus that it counts cannot be read here: a decoder's default must not fail a request."""
  try:
    return draft_vocabulary(loaded, size)
  except (OSError, ValueError) as e:
    logging.warning('Drafting over the whole vocabulary: the default draft vocabulary of %d ids '
                    'counts the training corpus, which cannot be read here (%s: %s).', size,
                    type(e).__name__, e)
    return None


def head_accuracies(loaded: LoadedModel, num_prompts: int = 8, top_k: int = 4) -> np.ndarray:
  """[D, R] measured top-k accuracies of the heads (see `decode.calibration`), cached.

  Measured on greedy continuations of prompts from every other file of the training corpus's
  validation split (code the model did not train on), once per checkpoint step, and kept in
  `workdir/head_accuracies.json`. That file is only a cache: when it is unreadable or its entry
  is malformed, a warning names it and the accuracies are measured again and written over it.
  """
  from mtp.data import corpora
  from mtp.decode import calibration
  path = loaded.workdir / _ACCURACIES_FILE
  key = f'step{loaded.step}-R{top_k}-n{num_prompts}-even'
  table = {}
  try:
    table = json.loads(path.read_bytes())
    if not isinstance(table, dict):
      raise ValueError(f'expected a JSON object, got {type(table).__name__}')
  except FileNotFoundError:
    pass  # Not measured yet.
  except (OSError, ValueError) as e:
    logging.warning('Ignoring the head-accuracy cache %s (%s); measuring again.', path, e)
    table = {}
  if key in table:
    try:
      acc = np.asarray(table[key])
    except ValueError:  # Ragged lists.
      acc = np.zeros([0])
    # Accuracies of every head at each of the R ranks: probabilities (NaN fails), shape [D, R].
    if (acc.shape == (loaded.model.cfg.mtp_num_heads, top_k)
        and np.issubdtype(acc.dtype, np.number) and np.all((acc >= 0) & (acc <= 1))):
      return acc.astype(np.float64)
    logging.warning('Ignoring entry %r of the head-accuracy cache %s (not a [%d, %d] table of '
                    'probabilities); measuring again.', key, path,
                    loaded.model.cfg.mtp_num_heads, top_k)
  # Every other validation file: the rest stays unseen by the calibration for evaluations.
  files = corpora.corpus_splits(loaded.config.data)['valid'][::2]
  tokenizer = loaded.tokenizer
  prompts = calibration.code_prompts(files, tokenizer, num_prompts, max_tokens=96, min_tokens=16)
  if not prompts:
    raise ValueError(f'no validation files to measure head accuracies on for tree="auto"; '
                     'use tree="default" or "chain"')
  acc = calibration.calibrate(loaded.model, [tokenizer.encode(p) for p in prompts],
                              max_new_tokens=128, top_k=top_k, eos_id=tokenizer.eos_id,
                              pad_id=tokenizer.pad_id)
  table[key] = acc.tolist()
  tmp = path.with_name(f'.{path.name}.{os.getpid()}.tmp')
  try:  # Renamed into place, so a kill mid-write never leaves half a file.
    tmp.write_text(json.dumps(table, indent=1))
    tmp.replace(path)
  except OSError:
    tmp.unlink(missing_ok=True)  # A read-only workdir: measure again next time.
  return acc
