"""`--format=jax_export`: the whole generate function, serialized with `jax.export`.

One program per decoder (and per sampling setting asked for): the decode engine's prefill and
`while_loop` (`mtp.decode.engine.Engine.decode_function`), traced once and lowered to StableHLO
for every platform that lowers here (`cpu`, and `cuda` and `tpu` without their hardware).
Running it needs JAX and the files, not this package's model code (`runtime.py`).

Contract of each program (all arguments are arrays; none is donated):
  generate(params, prompts, lengths, key, eos_id, pad_id, max_new_tokens, first_row) -> dict(
      tokens [b, M] int32 (pad_id after each row's end), num_generated [b] int32,
      num_steps [b] int32, accepted_histogram [b, depth + 2] int32, reason [b] int32 (why
      each row stopped: `decode/finish.py`))
  params          {name: array}: the model's parameters, flat ('trunk/embed/embedding', ...),
                  as saved beside the programs in params.safetensors: arguments, not constants
  prompts         [b, p] int32, right-padded, p a multiple of 64 (the prefill's chunk);
                  lengths [b] int32: valid tokens per row
  key             the raw data of the request's PRNG key (`jax.random.key_data`; manifest:
                  prng_impl; `runtime.LoadedArtifact.key(seed)` makes it as mtp.generate does)
  first_row       [] int32: row r samples with the key folded by first_row + r (its prompt's
                  index in the request, so its tokens do not depend on the batching)
  eos_id, pad_id  [] int32 (eos_id -1: none)
  max_new_tokens  [] int32 in [1, M]: every row's token budget

Shapes: the batch b and the prompt width p are symbolic: one program serves every batch size
and prompt length, compiled for each concrete shape on first use (as `jax.jit` would). The KV
cache holds any prompt the model's positions allow; its chunked attention reads only the slots
a batch has filled, so the size costs memory, not time.

Baked in (the static part of a decode plan, recorded in the manifest), because they change the
traced program: the decoder and its tree (and lookup chain), greedy or the one sampling setting
(temperature, top_k, top_p), M = the most tokens a call may generate, and the ids never emitted
(the tokenizer's). Traced, so free per call: prompts, batch size, eos/pad ids, the seed, and
max_new_tokens up to M (a per-row budget in the loop, as in every decoder).
"""

from __future__ import annotations

import json
import pathlib
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp.checkpoint import fingerprint
from mtp.data import tokenizer as tokenizer_lib
from mtp.decode import loop
from mtp.decode import plan as plan_lib
from mtp.decode import settings as settings_lib
from mtp.decode import state as state_lib
from mtp.decode import trees as trees_lib
from mtp.decode.drafters import lookup as lookup_lib
from mtp.export import ExportError
from mtp.export import params as params_lib
from mtp.model import mtp_model

PARAMS_FILE = 'params.safetensors'
PLATFORMS = ('cpu', 'cuda', 'tpu')
KNOWN_PLATFORMS = ('cpu', 'cuda', 'rocm', 'tpu')
SUFFIX = '.jax_exported'
# Default M: enough for a completion, without sizing every cache for the whole context.
_DEFAULT_MAX_NEW_TOKENS = 256


def check_options(workdir: pathlib.Path, dtype: np.dtype, **options) -> None:
  """Checks jax_export's options against the workdir's model before anything loads."""
  del dtype  # Every float dtype traces.
  try:
    import flatbuffers  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    raise ExportError('--format=jax_export needs the flatbuffers package to serialize '
                      '(jax.export uses it): pip install flatbuffers') from None
  from mtp.checkpoint import checkpointing  # pylint: disable=import-outside-toplevel
  config = checkpointing.load_config(workdir)
  variants(mtp_model.ModelConfig.from_config(config.model), **options)


def variants(model_cfg: mtp_model.ModelConfig, *, max_new_tokens: int | None = None,
             tree=None, lookup: int = 0, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, platforms: Sequence[str] = PLATFORMS
             ) -> tuple[int, tuple[str, ...], list[dict[str, Any]]]:
  """(M, platforms, one program's settings per program), checked.

  The programs: autoregressive and (for a model with heads) speculative decoding, greedy,
  plus both sampled when `temperature` > 0. `tree`: a static name of `trees.NAMES` or
  Medusa-style choices; `lookup` hangs a prompt lookup chain below it in the greedy
  speculative program.

  Raises:
    ExportError naming the bad option.
  """
  trunk = model_cfg.trunk
  if max_new_tokens is None:
    max_new_tokens = min(_DEFAULT_MAX_NEW_TOKENS, trunk.max_seq_len // 2)
  if (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer))
      or not 1 <= max_new_tokens < trunk.max_seq_len):
    raise ExportError(f'max_new_tokens must be an integer in [1, {trunk.max_seq_len}) (the '
                      f'model\'s max_seq_len), got {max_new_tokens!r}')
  platforms = tuple(platforms)
  bad = [p for p in platforms if p not in KNOWN_PLATFORMS]
  if bad or not platforms:
    raise ExportError(f'platforms must be some of {", ".join(KNOWN_PLATFORMS)}, got '
                      f'{list(platforms)}')
  if isinstance(tree, str) and tree in trees_lib.MEASURED:
    raise ExportError(f'tree={tree!r} is measured at run time, which an export cannot do: '
                      'export the tree it picks as Medusa-style choices')
  settings = [dict(temperature=0.0, top_k=0, top_p=1.0)]
  if temperature:
    settings.append(dict(temperature=temperature, top_k=top_k, top_p=top_p))
  elif top_k or top_p != 1.0:
    raise ExportError('top_k and top_p shape sampling: give a temperature > 0 with them')
  decoders = ['autoregressive'] + (['speculative'] if model_cfg.mtp_num_heads else [])
  if model_cfg.mtp_num_heads == 0 and (tree is not None or lookup):
    raise ExportError('tree and lookup apply to speculative decoding, and this model has no '
                      'heads: it exports the autoregressive decoder only')
  out = []
  for decoder in decoders:
    for setting in settings:
      kwargs = dict(decoder=decoder, **setting)
      if decoder == 'speculative':
        try:
          kwargs['tree'] = trees_lib.static_tree(tree, model_cfg.mtp_num_heads)
        except ValueError as e:
          raise ExportError(f'cannot export the {decoder} decoder: {e}') from None
        if (isinstance(lookup, bool) or not isinstance(lookup, (int, np.integer))
            or not 0 <= lookup <= lookup_lib.MAX_LENGTH):
          raise ExportError(f'cannot export the {decoder} decoder: lookup (--lookup) must be an '
                            f'integer in [0, {lookup_lib.MAX_LENGTH}], got {lookup!r}')
        kwargs['lookup'] = int(lookup)
      out.append(kwargs)
  return int(max_new_tokens), platforms, out


def write(loaded, directory: pathlib.Path, dtype: np.dtype, **options) -> dict[str, Any]:
  """Writes the programs, the parameters, config.json and the tokenizer into `directory`.

  Returns the artifact's manifest section (`runtime.py` reads it): programs, platforms, M,
  the parameter file, and sizes and export times.
  """
  from safetensors import numpy as safetensors_numpy  # pylint: disable=import-outside-toplevel
  model, tokenizer = loaded.model, loaded.tokenizer
  max_new_tokens, platforms, programs = variants(model.cfg, **options)
  state = params_lib.cast_params(nnx.state(model), dtype)
  graphdef = nnx.graphdef(model)
  flat, treedef = jax.tree_util.tree_flatten_with_path(state)
  names = [fingerprint.path_name(path) for path, _ in flat]
  params = {name: np.asarray(leaf) for name, (_, leaf) in zip(names, flat)}
  safetensors_numpy.save_file(params, str(directory / PARAMS_FILE))
  tokenizer.save(directory)
  config = loaded.config.to_dict()
  config['model']['param_dtype'] = dtype.name
  config['init_from'] = ''
  (directory / 'config.json').write_text(json.dumps(config, indent=2, sort_keys=True,
                                                    default=list))

  vocab_limit, banned = tokenizer_lib.emittable(tokenizer, model.cfg.trunk.vocab_size)
  key_data = jax.random.key_data(jax.random.key(0))
  b, k = jax.export.symbolic_shape('b, k')
  # Prompts come padded to whole prefill chunks (`runtime.Program.run` pads them).
  specs = ({n: jax.ShapeDtypeStruct(a.shape, a.dtype) for n, a in params.items()},
           jax.ShapeDtypeStruct((b, loop.PREFILL_CHUNK * k), jnp.int32),
           jax.ShapeDtypeStruct((b,), jnp.int32),
           jax.ShapeDtypeStruct(key_data.shape, key_data.dtype),
           *(jax.ShapeDtypeStruct((), jnp.int32),) * 4)
  prng_impl = str(jax.config.jax_default_prng_impl)
  # The model's own layout: the program may run on another platform than this one.
  unfused = state_lib.PreparedModel(model, fuse=False)
  records, all_failures = [], {}
  for kwargs in programs:
    # The cache holds any prompt the model's positions allow (its attention reads only the
    # filled part); M bounds the tokens.
    engine = plan_lib.resolve(
        unfused, kwargs['decoder'], max_new_tokens=max_new_tokens,
        prompt_width=model.cfg.trunk.max_seq_len - max_new_tokens, tree=kwargs.get('tree'),
        lookup=kwargs.get('lookup'), draft_vocab=0, greedy_only=kwargs['temperature'] == 0,
        emittable_ids=(vocab_limit, banned))
    fn = jax.jit(_generate_fn(graphdef, treedef, names, engine, kwargs, prng_impl))
    start = time.perf_counter()
    exported, failures = _export(fn, specs, platforms)
    blob = exported.serialize()
    name = _program_name(kwargs)
    (directory / f'{name}{SUFFIX}').write_bytes(blob)
    all_failures.update(failures)
    block, _ = engine.plan.block(engine.plan.num_kinds)
    records.append({
        'file': f'{name}{SUFFIX}', 'decoder': kwargs['decoder'],
        'temperature': kwargs['temperature'], 'top_k': kwargs['top_k'],
        'top_p': kwargs['top_p'],
        'tree': [list(c) for c in block.choices] if engine.plan.num_kinds else None,
        'lookup': block.lookup_depth, 'histogram_width': engine.plan.depth + 2,
        'prompt_chunk': loop.PREFILL_CHUNK,
        'platforms': list(exported.platforms), 'bytes': len(blob),
        'export_seconds': round(time.perf_counter() - start, 3)})
  return {
      'programs': records, 'max_new_tokens': max_new_tokens,
      'platforms': sorted(set.intersection(*(set(r['platforms']) for r in records))),
      'lowering_failures': all_failures,
      'shapes': {'batch': 'symbolic', 'prompt_width': f'symbolic, {loop.PREFILL_CHUNK} * k'},
      'params': {'file': PARAMS_FILE, 'count': len(names),
                 'bytes': (directory / PARAMS_FILE).stat().st_size},
      'prng_impl': prng_impl, 'key_shape': list(key_data.shape),
      'key_dtype': str(key_data.dtype),
      'vocab_size': model.cfg.trunk.vocab_size, 'max_seq_len': model.cfg.trunk.max_seq_len,
      'calling_convention_version': exported.calling_convention_version,
      # What each program fixed when it was traced, and what a call still chooses.
      'baked': {'per_program': ['decoder', 'tree', 'lookup', 'temperature', 'top_k', 'top_p'],
                'max_new_tokens': max_new_tokens, 'vocab_limit': vocab_limit,
                'banned_ids': list(banned), 'devices': 1},
      'traced': ['batch size', 'prompt width', 'prompts', 'lengths', 'seed (key)', 'eos_id',
                 'pad_id', f'max_new_tokens in [1, {max_new_tokens}]', 'first_row'],
      'arguments': ['params', 'prompts', 'lengths', 'key', 'eos_id', 'pad_id',
                    'max_new_tokens', 'first_row'],
      'outputs': ['tokens', 'num_generated', 'num_steps', 'accepted_histogram', 'reason']}


def _program_name(kwargs: dict) -> str:
  if not kwargs['temperature']:
    return f'{kwargs["decoder"]}-greedy'
  return (f'{kwargs["decoder"]}-t{kwargs["temperature"]:g}-k{kwargs["top_k"]}'
          f'-p{kwargs["top_p"]:g}')


def _generate_fn(graphdef, treedef, names: list[str], engine, kwargs: dict, prng_impl: str):
  """The function exported: the engine's prefill and loop (`Engine.decode_function`), every
  row with the program's sampling settings, the call's stop id, seed and token budget."""
  m = engine.plan.max_new_tokens
  decode = engine.decode_function()

  def generate(params, prompts, lengths, key, eos_id, pad_id, max_new_tokens, first_row):
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, [params[n] for n in names]))
    b = prompts.shape[0]
    rows = (first_row + jnp.arange(b, dtype=jnp.int32)).astype(jnp.uint32)
    row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(
        jax.random.wrap_key_data(key, impl=prng_impl), rows)
    full = lambda value, dtype: jnp.full((b,), value, dtype)  # noqa: E731
    settings = settings_lib.RowSettings(
        temperature=full(kwargs['temperature'], jnp.float32),
        top_k=full(kwargs['top_k'], jnp.int32), top_p=full(kwargs['top_p'], jnp.float32),
        max_tokens=full(jnp.clip(max_new_tokens, 1, m), jnp.int32),
        stop_ids=jnp.broadcast_to(jnp.where(eos_id >= 0, eos_id, -1), (b, 1)).astype(jnp.int32),
        key=jax.random.key_data(row_keys))
    state = decode(model, prompts, lengths, settings)
    n = state.num_generated
    return {'tokens': jnp.where(jnp.arange(m)[None, :] < n[:, None], state.tokens[:, :m],
                                pad_id),
            'num_generated': n, 'num_steps': state.num_steps,
            'accepted_histogram': state.histogram, 'reason': state.reason}
  return generate


def _export(fn, specs, platforms: tuple[str, ...]):
  """(Exported for every platform of `platforms` that lowers, {platform: error} of others).

  All at once first (one lowering); if that fails, each alone, then the ones that lowered
  together.
  """
  try:
    return jax.export.export(fn, platforms=platforms)(*specs), {}
  except Exception:  # pylint: disable=broad-except  # Lowering raises many types.
    if len(platforms) == 1:
      raise
  failures = {}
  for platform in platforms:
    try:
      jax.export.export(fn, platforms=(platform,))(*specs)
    except Exception as e:  # pylint: disable=broad-except
      failures[platform] = f'{type(e).__name__}: {str(e).splitlines()[0][:300]}'
  lowered = tuple(p for p in platforms if p not in failures)
  if not lowered:
    raise ExportError(f'the generate function lowers for none of {list(platforms)}: {failures}')
  return jax.export.export(fn, platforms=lowered)(*specs), failures
