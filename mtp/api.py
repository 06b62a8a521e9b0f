"""The Python entry points: `mtp.load(workdir)`, `mtp.generate(...)` and `mtp.chat(...)`.

They take a training workdir or an export directory (`launch.export`): a params export loads
like a workdir; a jax_export directory loads as `export.runtime.LoadedArtifact`, and `generate`
then calls its serialized programs, running no model code. `generate` is thin: it checks and
encodes the prompts, resolves how to decode once per shape bucket (`decode.buckets`) and
decodes the batches through the engine that returns (`decode.engine`).
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from typing import Callable, Sequence

import numpy as np

from mtp.checkpoint import loading
from mtp.data import tokenizer as tokenizer_lib
from mtp.decode import buckets
from mtp.decode import decoders
from mtp.decode import plan as plan_lib
from mtp.decode import settings as settings_lib
from mtp.decode import state as state_lib
from mtp.decode import streaming
from mtp.export import runtime

LoadedModel = loading.LoadedModel
load = loading.load
DECODERS = decoders.NAMES


@dataclasses.dataclass
class Generation:
  """One prompt's completion and decoding statistics.

  Attributes:
    prompt: the prompt text.
    completion: the generated text (a stop id's text not included).
    tokens: generated token ids (the stop id included when one ended the completion).
    num_prompt_tokens: tokens in the prompt.
    num_steps: forward passes of the decode loop that worked on this prompt (the prefill,
      which gives the first token, is not counted).
    mean_accepted: tokens emitted per loop step (1 for autoregressive decoding).
    accepted_histogram: entry j counts the loop steps that emitted j tokens.
    tokens_per_sec: this prompt's tokens over the wall time of the batch that decoded it
      (prefill included, compilation excluded); a batch's throughput is the sum over its rows.
    seconds: that wall time.
    finish_reason: 'stop' (a stop id such as EOS) or 'length' (`decode.finish`).
    logprobs: with `logprobs=` set, the model's log-probability of each token.
    top_logprobs: with `logprobs=k > 0`, the k most likely [token id, log-probability] pairs
      at each position.
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
  logprobs: list[float] | None = None
  top_logprobs: list[list[list[float]]] | None = None

  def to_json(self) -> dict:
    return {k: v for k, v in dataclasses.asdict(self).items()
            if v is not None or k not in ('logprobs', 'top_logprobs')}


TextCallback = Callable[[int, str, bool], None]


def generate(loaded_or_workdir, prompts: str | Sequence[str], *, max_new_tokens: int,
             decoder: str = decoders.DEFAULT, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, batch_size: int | None = None,
             on_text: TextCallback | None = None, steps_per_chunk: int | None = None,
             special_tokens: bool = False, logprobs: int | None = None,
             **options) -> list[Generation]:
  """Completes text prompts: the Python twin of `launch.generate` (its flags, the same names).

  Prompts are decoded in batches of `batch_size` (None: all in one), in order, through one
  compiled decoder, compiled and warmed up on the first batch (`tokens_per_sec` excludes it)
  and kept for later calls whose prompts and budget fall in the same shape bucket.
  Everything is checked before anything compiles; errors name the prompt or option. Prompt i
  samples with its own key from `seed` and i, whatever the batching. `decoder`: 'auto' (the
  heads draft, and prompt lookup where the text repeats; each row stops each kind of drafting
  where it does not pay here, `decode.auto`), 'speculative' or 'autoregressive': all exact.
  `on_text(prompt_index, text, finished)` streams, a chunk of `steps_per_chunk` loop steps at a
  time. `special_tokens` reads a chat template's markers in the prompts as special ids.
  `logprobs`: keep each token's log-probability (0) and its k most likely alternatives' (k).
  **options: how to decode (`decode.plan.resolve`): tree, tree_budget, lookup, draft_vocab,
  drafters (None: the decoder's default). Returns one `Generation` per prompt, in order.
  """
  loaded = loaded_or_workdir
  if not isinstance(loaded, (LoadedModel, runtime.LoadedArtifact)):
    loaded = load(loaded_or_workdir)
  options = {k: v for k, v in options.items() if v is not None}  # None: the default.
  texts = _checked_texts(prompts)
  batch_size = _checked_batch_size(batch_size, len(texts))
  steps_per_chunk = _steps_per_chunk(steps_per_chunk, decoder)
  tokenizer = loaded.tokenizer
  sampling = settings_lib.Sampling(
      max_tokens=_checked_max_new_tokens(max_new_tokens), temperature=temperature, top_k=top_k,
      top_p=top_p, seed=seed, stop_ids=() if tokenizer.eos_id is None else (tokenizer.eos_id,))
  if isinstance(loaded, runtime.LoadedArtifact):
    return _generate_exported(loaded, texts, sampling, decoder, batch_size, on_text,
                              special_tokens, **options)
  trunk = loaded.model.cfg.trunk
  sampling.check(trunk.vocab_size)
  padded, lengths = plan_lib.check_prompts(*state_lib.pad_prompts(
      _encode(tokenizer, texts, special_tokens), tokenizer.pad_id), vocab_size=trunk.vocab_size)
  plan_lib.check_room(lengths, max_new_tokens, trunk.max_seq_len)
  engine, batches = _decoder(loaded, decoder, padded, lengths, batch_size, sampling,
                             -1 if logprobs is None else logprobs, options)
  results = []
  for rows, tokens, row_lengths in batches:
    indices = rows + [rows[-1]] * (batch_size - len(rows))  # Each prompt its own key.
    settings = engine.settings([sampling] * batch_size, indices)
    start = time.perf_counter()
    if on_text is None:
      out = engine.generate(tokens, row_lengths, settings, pad_id=tokenizer.pad_id)
    else:
      out = _stream(engine.chunks(tokens, row_lengths, settings, pad_id=tokenizer.pad_id,
                                  steps_per_chunk=steps_per_chunk), tokenizer, rows, on_text)
    seconds = time.perf_counter() - start
    results += [_generation(out, row, texts[i], int(row_lengths[row]), tokenizer, seconds)
                for row, i in enumerate(rows)]
  return results


def _decoder(loaded: LoadedModel, decoder: str, padded: np.ndarray, lengths: np.ndarray,
             batch_size: int, sampling: settings_lib.Sampling, logprobs: int, options: dict):
  """(the engine for prompts [N, P] and `sampling`'s budget, compiled and warm: kept from a
  call of their shape bucket, or resolved and warmed up here; the batches, at its width)."""
  engine, width, kept = buckets.engine(
      loaded, decoder, max_new_tokens=sampling.max_tokens, prompt_width=padded.shape[1],
      batch_size=batch_size, greedy_only=sampling.greedy, logprobs=logprobs,
      calibration=(padded[:batch_size], lengths[:batch_size]), **options)
  batches = _batches(np.pad(padded, ((0, 0), (0, width - padded.shape[1]))), lengths, batch_size)
  if not kept:  # A prefill and a step: compiles, warms up and waits.
    engine.result(engine.step(engine.prefill(*batches[0][1:], engine.settings(
        [sampling] * batch_size)), 1))
  return engine, batches


def _stream(chunks, tokenizer, rows: list[int], on_text: TextCallback):
  """Passes each row's new text on as chunks arrive; the final result."""
  out = None
  for update in streaming.text_updates(chunks, tokenizer):
    for row, prompt_index in enumerate(rows):
      if update.text[row] or (update.done[row] and len(update.new_tokens[row])):
        on_text(prompt_index, update.text[row], bool(update.done[row]))
    out = update.result
  return out


def _generate_exported(artifact: runtime.LoadedArtifact, texts: list[str],
                       sampling: settings_lib.Sampling, decoder: str, batch_size: int,
                       on_text: TextCallback | None, special_tokens: bool, tree=None,
                       lookup: int | None = None, **options) -> list[Generation]:
  """`generate` on a jax_export artifact: the same checks, batches, seeds and results. The
  whole loop is one call, so `on_text` gets each prompt's whole text at its end."""
  if options:
    raise ValueError(f'{", ".join(sorted(options))} apply to a workdir or params export, not to '
                     'a jax_export artifact (its programs are fixed)')
  tokenizer = artifact.tokenizer
  sampling.check(artifact.vocab_size)
  padded, lengths = plan_lib.check_prompts(*state_lib.pad_prompts(
      _encode(tokenizer, texts, special_tokens), tokenizer.pad_id),
      vocab_size=artifact.vocab_size)
  plan_lib.check_room(lengths, sampling.max_tokens, artifact.max_seq_len)
  program = artifact.program(decoder, temperature=sampling.temperature, top_k=sampling.top_k,
                             top_p=sampling.top_p, tree=tree, lookup=lookup or 0,
                             max_new_tokens=sampling.max_tokens)
  special = dict(eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
  batches = _batches(padded, lengths, batch_size)
  key = artifact.key(sampling.seed)
  program.run(artifact.params, *batches[0][1:], key=key, max_new_tokens=2,
              **special)  # Compiles and warms up.
  results = []
  for rows, tokens, row_lengths in batches:
    start = time.perf_counter()
    out = program.run(artifact.params, tokens, row_lengths, key=key, first_row=rows[0],
                      max_new_tokens=sampling.max_tokens, **special)
    seconds = time.perf_counter() - start
    for row, i in enumerate(rows):
      results.append(_generation(out, row, texts[i], int(row_lengths[row]), tokenizer, seconds))
      if on_text is not None:
        on_text(i, results[-1].completion, True)
  return results


def _encode(tokenizer: tokenizer_lib.Tokenizer, texts: list[str], special_tokens: bool
            ) -> list[list[int]]:
  if special_tokens:
    return [tokenizer.encode(t, special=True) for t in texts]
  return tokenizer.encode_batch(texts)


def chat(loaded_or_workdir, messages: Sequence[dict], *, max_new_tokens: int,
         **options) -> Generation:
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


def _generation(out, row: int, prompt: str, num_prompt_tokens: int,
               tokenizer: tokenizer_lib.Tokenizer, seconds: float) -> Generation:
  """Row `row` of a batch's (host) result, timed over the batch's `seconds`."""
  n = int(out.num_generated[row])
  generated = [int(t) for t in out.tokens[row, :n]]
  top = None
  if out.top_ids is not None and out.top_ids.shape[-1]:
    top = [[[int(i), float(v)] for i, v in zip(ids, values)]
           for ids, values in zip(out.top_ids[row, :n], out.top_logprobs[row, :n])]
  return Generation(
      prompt=prompt, completion=tokenizer.decode(generated), tokens=generated,
      num_prompt_tokens=num_prompt_tokens, num_steps=int(out.num_steps[row]),
      mean_accepted=float(np.asarray(out.mean_accepted)[row]),
      accepted_histogram=[int(c) for c in out.accepted_histogram[row]],
      tokens_per_sec=n / seconds, seconds=seconds,
      finish_reason=out.finish_reason(row) or 'length',
      logprobs=None if out.logprobs is None else [float(x) for x in out.logprobs[row, :n]],
      top_logprobs=top)


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


def _checked_max_new_tokens(value) -> int:
  """`value`, or ValueError naming it as the caller did (`Sampling` calls it max_tokens)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
    raise ValueError(f'max_new_tokens must be a positive integer, got {value!r}')
  return value


def _checked_batch_size(batch_size, num_prompts: int) -> int:
  if batch_size is None:
    return num_prompts
  if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
    raise ValueError(f'batch_size must be a positive integer, got {batch_size!r}')
  return min(int(batch_size), num_prompts)


def _steps_per_chunk(value, decoder: str) -> int:
  """Loop steps per host round trip when streaming: `value`, or the decoder's default."""
  if value is None:
    return decoders.get(decoder).steps_per_chunk
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f'steps_per_chunk must be a positive integer, got {value!r}')
  return value
