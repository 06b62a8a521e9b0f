"""Test helpers: decoding through the public door (`plan.resolve` and its `engine.Engine`)."""

from __future__ import annotations

import dataclasses

import numpy as np
from flax import nnx

from mtp.decode import plan as plan_lib
from mtp.decode import settings as settings_lib
from mtp.model import mtp_model
from mtp.model import testing as model_testing
from mtp.model.heads import eagle

# Head-type names that are option variants of a family: name -> (family, head_options).
VARIANTS = {'eagle3': ('eagle', tuple(eagle.EAGLE3.items()))}


def head_model(name: str, seed: int = 0, **kwargs) -> mtp_model.MTPModel:
  """`model.testing.tiny_model(seed, **kwargs)` of a family, or of a `VARIANTS` name, so that
  tests parametrised by head type cover the variants too. The heads are built after the trunk:
  every name shares the head-less tiny model's trunk."""
  if name not in VARIANTS:
    return model_testing.tiny_model(seed, head_type=name, **kwargs)
  family, options = VARIANTS[name]
  cfg = dataclasses.replace(model_testing.tiny_config(head_type=family, **kwargs),
                            head_options=options)
  return mtp_model.MTPModel(cfg, rngs=nnx.Rngs(seed))  # EAGLE has no zero-initialised kernels.


def engine(model, decoder: str = 'speculative', *, max_new_tokens: int, prompt_width: int = 64,
           greedy_only: bool = False, break_even=None, **options):
  """`plan.resolve` for a model, with a known break-even for `auto` (0: never stop drafting)
  unless given, so that tests measure nothing."""
  if decoder == 'auto' and break_even is None:
    break_even = 0.0
  return plan_lib.resolve(model, decoder, max_new_tokens=max_new_tokens,
                          prompt_width=prompt_width, greedy_only=greedy_only,
                          break_even=break_even, **options)


def settings(engine_, rows: int, *, max_new_tokens: int, temperature=0.0, top_k=0, top_p=1.0,
             seed=0, eos_id: int | None = None, indices=None):
  """The same settings for `rows` rows (each row its own index into the seed)."""
  sampling = settings_lib.Sampling(max_tokens=max_new_tokens, temperature=temperature,
                                   top_k=top_k, top_p=top_p, seed=seed,
                                   stop_ids=() if eos_id is None else (eos_id,))
  return engine_.settings([sampling] * rows, list(range(rows)) if indices is None else indices)


def decode(model, prompts, lengths=None, *, decoder: str = 'speculative', max_new_tokens: int,
           temperature=0.0, top_k=0, top_p=1.0, seed=0, eos_id: int | None = None,
           pad_id: int = 0, **options):
  """Decodes prompts [B, P] (right-padded; lengths [B], None: all P) to the end: the
  `DecodeResult` on the host."""
  prompts, lengths = plan_lib.check_prompts(prompts, lengths,
                                            vocab_size=model.cfg.trunk.vocab_size)
  e = engine(model, decoder, max_new_tokens=max_new_tokens,
             prompt_width=plan_lib.padded_width(prompts.shape[1]),
             greedy_only=temperature == 0, **options)
  rows = settings(e, len(prompts), max_new_tokens=max_new_tokens, temperature=temperature,
                  top_k=top_k, top_p=top_p, seed=seed, eos_id=eos_id)
  return e.generate(prompts, lengths, rows, pad_id=pad_id)


def reference_argmax(model, prompts, lengths, max_new_tokens: int) -> np.ndarray:
  """Greedy continuations by re-running whole sequences without a cache, token by token:
  [B, max_new_tokens] (slow; small models)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  prompts, lengths = np.asarray(prompts), np.asarray(lengths)
  b, width = prompts.shape[0], prompts.shape[1] + max_new_tokens
  forward = jax.jit(lambda seq: model.logits(model(seq, jnp.arange(width)[None])[0]))
  seq = np.zeros((b, width), np.int32)
  seq[:, :prompts.shape[1]] = prompts
  for i in range(max_new_tokens):
    best = np.asarray(jnp.argmax(forward(jnp.asarray(seq)), axis=-1))
    seq[np.arange(b), lengths + i] = best[np.arange(b), lengths + i - 1]
  return np.stack([seq[r, n:n + max_new_tokens] for r, n in enumerate(lengths)])
