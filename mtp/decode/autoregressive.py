"""Baseline decoding: prefill, then one token per forward pass in a jitted `lax.while_loop`.

The model is split with `nnx.split` on the host and merged inside the jitted functions (as in
the google/flax gemma sampler): the compiled code is cached by jax per (graph, static settings,
shapes), so a second call with the same shapes does not retrace. Pass a `state.PreparedModel`
to split once for many calls.

Two compiled pieces: `_start` (prefill of the right-padded prompts in one cached step, each
row's first token from its own last prompt position) and `_run` (the loop, for at most a given
number of steps, so a streaming caller can run it a chunk at a time with no per-token host work).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterator

import flax.struct
import jax
import jax.numpy as jnp

from mtp.decode import sampling as sampling_lib
from mtp.decode import state as state_lib
from mtp.model import kv_cache as kv_cache_lib

Array = jax.Array
DecodeResult = state_lib.DecodeResult


@dataclasses.dataclass(frozen=True)
class Settings:
  """Static settings of one compiled decoder (hashable: a jit static argument)."""
  max_new_tokens: int
  capacity: int
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0


@flax.struct.dataclass
class LoopState:
  """The decode loop's carry.

  Attributes:
    tokens: [B, max_new_tokens + 1] output buffer (one spare column: writes never clamp).
    num_generated: [B] tokens in the buffer.
    done: [B] rows that stopped (EOS or max_new_tokens); they no longer change.
    last_token: [B] the newest token, not yet in the cache.
    lengths: [B] committed cache slots (= position of last_token).
    num_steps: [B] loop forward passes that worked on the row.
    cache: the KV cache.
    rng: PRNG key.
    eos_id: [] int32 end-of-sequence id, -1 for none (traced: changing it does not recompile).
    pad_id: [] int32 filler after a row's end.
  """
  tokens: Array
  num_generated: Array
  done: Array
  last_token: Array
  lengths: Array
  num_steps: Array
  cache: kv_cache_lib.KVCache
  rng: Array
  eos_id: Array
  pad_id: Array


def _sample(rng: Array, logits: Array, s: Settings) -> Array:
  return sampling_lib.sample_tokens(rng, logits, s.temperature, s.top_k, s.top_p)


def _split(rng: Array, s: Settings) -> tuple[Array, Array]:
  """(next rng, key for this step); greedy decoding draws nothing, so it skips the split."""
  if s.temperature == 0:
    return rng, rng
  return tuple(jax.random.split(rng))


@functools.partial(jax.jit, static_argnames=('structure', 'settings'))
def _start(structure, leaves, prompts: Array, lengths: Array, rng: Array, eos_id: Array,
           pad_id: Array, settings: Settings) -> LoopState:
  """Prefills [B, P] right-padded prompts and samples each row's first token."""
  model = state_lib.merge(structure, leaves)
  b, p = prompts.shape
  cache = model.init_cache(b, settings.capacity)
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
  # Padding slots get written too, but they lie at or past each row's length: scratch.
  out, cache = model.step(prompts, positions, cache, jnp.zeros((b,), jnp.int32),
                          with_heads=False)
  logits = model.logits(state_lib.gather_rows(out.normed, lengths - 1))
  rng, key = jax.random.split(rng)
  first = _sample(key, logits, settings)
  buffer = jnp.full((b, settings.max_new_tokens + 1), pad_id, jnp.int32)
  buffer, num_generated, done, _ = state_lib.append_tokens(
      buffer, jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), first[:, None],
      jnp.ones((b,), jnp.int32), eos_id=eos_id, pad_id=pad_id,
      max_new_tokens=settings.max_new_tokens)
  return LoopState(tokens=buffer, num_generated=num_generated, done=done, last_token=first,
                   lengths=lengths, num_steps=jnp.zeros((b,), jnp.int32), cache=cache, rng=rng,
                   eos_id=eos_id, pad_id=pad_id)


@functools.partial(jax.jit, static_argnames=('structure', 'settings'), donate_argnames=('state',))
def _run(structure, leaves, state: LoopState, max_steps: Array,
         settings: Settings) -> LoopState:
  """Runs one-token steps until every row is done or `max_steps` steps were taken."""
  model = state_lib.merge(structure, leaves)

  def cond(carry):
    i, s = carry
    return (i < max_steps) & ~jnp.all(s.done)

  def body(carry):
    i, s = carry
    out, cache = model.step(s.last_token[:, None], s.lengths[:, None], s.cache, s.lengths,
                            with_heads=False)
    rng, key = _split(s.rng, settings)
    token = _sample(key, model.logits(out.normed[:, 0]), settings)
    active = ~s.done
    buffer, num_generated, done, _ = state_lib.append_tokens(
        s.tokens, s.num_generated, s.done, token[:, None], jnp.ones_like(s.lengths),
        eos_id=s.eos_id, pad_id=s.pad_id, max_new_tokens=settings.max_new_tokens)
    # Finished rows keep their length and token: their cache writes land in scratch slots.
    s = s.replace(tokens=buffer, num_generated=num_generated, done=done,
                  last_token=jnp.where(active, token, s.last_token),
                  lengths=s.lengths + active, num_steps=s.num_steps + active, cache=cache,
                  rng=rng)
    return i + 1, s

  _, state = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state))
  return state


def result(state: LoopState, max_new_tokens: int) -> DecodeResult:
  """The loop state as a `DecodeResult` (each loop step emits exactly one token)."""
  histogram = jnp.stack([jnp.zeros_like(state.num_steps), state.num_steps], axis=-1)
  return DecodeResult(tokens=state.tokens[:, :max_new_tokens],
                      num_generated=state.num_generated, num_steps=state.num_steps,
                      accepted_histogram=histogram)


def _prepare(model, prompts, prompt_lengths, *, max_new_tokens, eos_id, pad_id, temperature,
             top_k, top_p, rng, cache_capacity):
  cfg = model.cfg.trunk
  prompts, lengths = state_lib.check_request(
      prompts, prompt_lengths, max_new_tokens=max_new_tokens, vocab_size=cfg.vocab_size,
      max_seq_len=cfg.max_seq_len, temperature=temperature, top_k=top_k, top_p=top_p,
      eos_id=eos_id)
  capacity = state_lib.cache_capacity(prompts.shape[1], max_new_tokens, 1, cache_capacity)
  settings = Settings(max_new_tokens=int(max_new_tokens), capacity=capacity,
                      temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
  args = (jnp.asarray(prompts), jnp.asarray(lengths), state_lib.as_key(rng),
          jnp.int32(-1 if eos_id is None else eos_id), jnp.int32(pad_id))
  return state_lib.prepare(model), args, settings


def generate(model, prompts, prompt_lengths=None, *, max_new_tokens: int,
             eos_id: int | None = None, pad_id: int = 0, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, rng=None,
             cache_capacity: int | None = None) -> DecodeResult:
  """Decodes one token per forward pass.

  Args:
    model: an `MTPModel` (its heads are not used), or a `state.PreparedModel` (faster when
      reused: no per-call split).
    prompts: [B, P] int token ids, right-padded (see `state.pad_prompts`).
    prompt_lengths: [B] valid tokens per row (None: all P).
    max_new_tokens: tokens to generate per row at most.
    eos_id: a row stops after generating this token (kept in the output); None: never.
    pad_id: filler after a row's end in `tokens`.
    temperature: 0 = greedy; else sample from softmax(logits / temperature).
    top_k: keep the k most likely tokens (0 = off).
    top_p: nucleus mass (1 = off).
    rng: int seed or PRNG key (sampling only).
    cache_capacity: KV slots (default: just enough); fix it to share compilations.

  Returns:
    DecodeResult: tokens [B, max_new_tokens], num_generated [B], num_steps [B].
  """
  prepared, args, settings = _prepare(
      model, prompts, prompt_lengths, max_new_tokens=max_new_tokens, eos_id=eos_id,
      pad_id=pad_id, temperature=temperature, top_k=top_k, top_p=top_p, rng=rng,
      cache_capacity=cache_capacity)
  state = _start(prepared.structure, prepared.leaves, *args, settings)
  state = _run(prepared.structure, prepared.leaves, state, jnp.int32(max_new_tokens), settings)
  return result(state, settings.max_new_tokens)


def generate_chunks(model, prompts, prompt_lengths=None, *, max_new_tokens: int,
                    steps_per_chunk: int = 16, **kwargs) -> Iterator[DecodeResult]:
  """Like `generate`, but yields the partial result (numpy) after the prefill and each chunk.

  The loop runs `steps_per_chunk` steps per compiled call (the chunk size is not part of the
  compiled code), so streaming costs one host round trip per chunk, not per token.
  """
  if steps_per_chunk < 1:
    raise ValueError(f'steps_per_chunk must be >= 1, got {steps_per_chunk}')
  prepared, args, settings = _prepare(
      model, prompts, prompt_lengths, max_new_tokens=max_new_tokens, **_defaults(kwargs))
  state = _start(prepared.structure, prepared.leaves, *args, settings)
  # Host copies: the next `_run` donates (invalidates) the state's device buffers.
  yield jax.device_get(result(state, settings.max_new_tokens))
  while not bool(jnp.all(state.done)):
    state = _run(prepared.structure, prepared.leaves, state, jnp.int32(steps_per_chunk), settings)
    yield jax.device_get(result(state, settings.max_new_tokens))


def _defaults(kwargs):
  allowed = dict(eos_id=None, pad_id=0, temperature=0.0, top_k=0, top_p=1.0, rng=None,
                 cache_capacity=None)
  unknown = set(kwargs) - set(allowed)
  if unknown:
    raise TypeError(f'unexpected arguments: {", ".join(sorted(unknown))}')
  return {**allowed, **kwargs}
