r"""Per-device memory of a large config's train step: compiled scaled down, projected full size.

  python -m benchmarks.memory_1b [--config=configs/llama_1b_mtp.py] [--chips=32]
      [--width_divisor=8] [--seq_divisor=4] [--output=results/memory_1b.json]

1. Compiles the train step of `--config` on this machine's devices (8 simulated CPU devices
   under XLA_FLAGS=--xla_force_host_platform_device_count=8) with the config's mesh settings
   and axis names, its widths (embedding, attention heads, MLP, vocabulary) divided by
   `--width_divisor` and its sequence by `--seq_divisor`, keeping the depth, the heads, the
   rows per device, dtypes, scanning and remat. Nothing is allocated: the step is lowered from
   abstract arrays. Reports XLA's per-device `memory_analysis()`.
2. Projects the full-size config on `--chips` chips from shapes (`projection`):
   * parameters, gradients and optimizer state: every array's per-device shard under the
     logical-axis rules on the mesh the config resolves to on that many chips (exact);
   * activations: an estimate from the layer shapes and the remat policy: what the backward
     pass keeps per scanned layer (its input; under 'dots_saveable' also every matmul output,
     attention scores included; without trunk remat also the elementwise intermediates), one
     layer's full working set while it is recomputed, the layer's weights gathered by FSDP, the
     trunk and heads' hidden states and the loss's logits chunks. It leaves out XLA's fusion and
     scheduling, which move it either way; the same estimate for the scaled-down config sits
     beside XLA's figure for it, to read its error from.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

from absl import app
from absl import flags
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', 'configs/llama_1b_mtp.py', 'The full-size config.')
flags.DEFINE_integer('chips', 32, 'Chips of the slice the projection is for.')
flags.DEFINE_integer('width_divisor', 8, 'Widths of the compiled model: full size / this.')
flags.DEFINE_integer('seq_divisor', 4, 'Sequence length of the compiled step: full / this.')
flags.DEFINE_string('output', 'results/memory_1b.json', 'Where to write the figures.')

GIB = 2 ** 30
_BYTES = {'float32': 4, 'bfloat16': 2, 'float16': 2}


class ScaleError(ValueError):
  """A divisor that does not divide the config's shapes."""


def scaled_down(config, width_divisor: int, seq_divisor: int, num_devices: int, rows: int):
  """`config` with widths / width_divisor and sequences / seq_divisor, `rows` batch rows per
  device on `num_devices` devices; depth, heads, dtypes, scanning and remat unchanged."""
  from mtp.parallel import mesh as mesh_lib

  model = config.model
  for key in ('embed_dim', 'num_attention_heads', 'num_kv_heads', 'mlp_dim', 'vocab_size'):
    if model[key] % width_divisor:
      raise ScaleError(f'--width_divisor={width_divisor} does not divide model.{key} '
                       f'({model[key]}).')
  if config.data.seq_len % seq_divisor:
    raise ScaleError(f'--seq_divisor={seq_divisor} does not divide data.seq_len '
                     f'({config.data.seq_len}).')
  small = config.copy_and_resolve_references()
  for key in ('embed_dim', 'num_attention_heads', 'num_kv_heads', 'mlp_dim', 'vocab_size'):
    small.model[key] = model[key] // width_divisor
  small.data.seq_len = config.data.seq_len // seq_divisor
  small.loss_chunk_size = max(1, config.loss_chunk_size // seq_divisor)
  small.data.batch_size = rows * _batch_shards(mesh_lib.resolve_mesh_shape(small.mesh,
                                                                           num_devices))
  return small


def _batch_shards(mesh_shape) -> int:
  from mtp.parallel import mesh as mesh_lib
  shape = dict(zip(mesh_lib.MESH_AXES, mesh_shape))
  return math.prod(shape[axis] for axis in mesh_lib.BATCH_AXES)


def rows_per_device(config, chips: int) -> int:
  """Batch rows each device holds when `config` runs on `chips` chips."""
  from mtp.parallel import mesh as mesh_lib
  shape = mesh_lib.resolve_mesh_shape(config.mesh, chips)
  mesh_lib.check_batch_fits(config.data.batch_size, shape)
  return config.data.batch_size // _batch_shards(shape)


def compile_train_step(config, mesh):
  """The train step of `config` on `mesh`, lowered from abstract arrays and compiled."""
  import jax
  import jax.numpy as jnp
  from mtp.train import step as step_lib

  trainer = step_lib.Trainer(config, mesh)
  rows = jax.ShapeDtypeStruct((config.data.batch_size, config.data.seq_len), jnp.int32,
                              sharding=trainer.batch_sharding)
  batch = step_lib.Batch(tokens=rows, positions=rows, segment_ids=rows)
  return trainer.train_step.lower(trainer.abstract_state_with_shardings(), batch).compile()


def xla_memory(compiled) -> dict[str, int]:
  """Per-device bytes of a compiled program, from XLA's buffer assignment."""
  memory = compiled.memory_analysis()
  out = {'arguments': memory.argument_size_in_bytes, 'outputs': memory.output_size_in_bytes,
         'aliased': memory.alias_size_in_bytes, 'temporaries': memory.temp_size_in_bytes}
  out['peak'] = out['arguments'] + out['outputs'] - out['aliased'] + out['temporaries']
  return out


def state_bytes_per_device(config, chips: int) -> dict[str, int]:
  """Per-device bytes of the parameters, their gradients and the optimizer state of `config`
  on `chips` chips, from each array's shard under the logical-axis rules."""
  import jax
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P
  from mtp.model import mtp_model
  from mtp.parallel import mesh as mesh_lib
  from mtp.train import optim

  model_config = mtp_model.ModelConfig.from_config(config.model)
  _, params = nnx.split(nnx.eval_shape(
      lambda: mtp_model.MTPModel(model_config, rngs=nnx.Rngs(0))))
  opt_state = jax.eval_shape(
      optim.make_optimizer(config.optim, config.num_train_steps, params).init, params)
  mesh = jax.sharding.AbstractMesh(mesh_lib.resolve_mesh_shape(config.mesh, chips),
                                   mesh_lib.MESH_AXES)

  def per_device(tree) -> int:
    def one(spec, leaf):
      if not hasattr(leaf, 'shape'):  # optax's MaskedNode: no array.
        return 0
      logical = tuple(spec) if isinstance(spec, P) else ()
      logical += (None,) * (len(leaf.shape) - len(logical))
      sharding = NamedSharding(mesh, mesh_lib.logical_to_mesh_spec(logical, leaf.shape, mesh))
      return math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    return sum(jax.tree.leaves(jax.tree.map(one, nnx.get_partition_spec(tree), tree,
                                            is_leaf=lambda x: isinstance(x, P))))
  param_bytes = per_device(params)
  return {'num_params': sum(leaf.size for leaf in jax.tree.leaves(params)),
          'params': param_bytes, 'gradients': param_bytes,
          'optimizer_state': per_device(opt_state)}


@dataclasses.dataclass(frozen=True)
class _Shapes:
  rows: int        # batch rows per device
  seq: int
  embed: int
  heads: int       # attention query heads
  kv_heads: int
  head_dim: int
  mlp: int
  vocab: int
  layers: int
  mtp_heads: int
  loss_chunk: int
  act_bytes: int   # bytes of an activation (model.dtype)
  param_bytes: int


def activation_bytes_per_device(config, chips: int) -> dict[str, int]:
  """An estimate of the activation memory per device of `config`'s train step on `chips` chips
  (see the module docstring for what it counts)."""
  m = config.model
  s = _Shapes(rows=rows_per_device(config, chips), seq=config.data.seq_len, embed=m.embed_dim,
              heads=m.num_attention_heads, kv_heads=m.num_kv_heads, head_dim=m.head_dim,
              mlp=m.mlp_dim, vocab=m.vocab_size, layers=m.num_layers,
              mtp_heads=m.mtp_num_heads, loss_chunk=config.loss_chunk_size,
              act_bytes=_BYTES[m.dtype], param_bytes=_BYTES[m.param_dtype])
  tokens = s.rows * s.seq
  carry = tokens * s.embed
  scores = s.rows * s.heads * s.seq * s.seq
  matmul_outputs = (tokens * (s.heads + 2 * s.kv_heads) * s.head_dim + scores
                    + tokens * s.heads * s.head_dim + 2 * tokens * s.embed + 2 * tokens * s.mlp)
  # Norm outputs, rotated q and k, softmax probabilities, silu(gate) and its product with up.
  elementwise = (2 * tokens * s.embed + tokens * (s.heads + s.kv_heads) * s.head_dim + scores
                 + 2 * tokens * s.mlp)
  kept_per_layer = {'full': carry, 'dots_saveable': carry + matmul_outputs}.get(
      m.remat, carry + matmul_outputs + elementwise)
  layer_params = (s.embed * (s.heads + 2 * s.kv_heads) * s.head_dim
                  + s.heads * s.head_dim * s.embed + 3 * s.embed * s.mlp)
  out = {
      'kept_by_layers': s.layers * kept_per_layer * s.act_bytes,
      # One layer recomputed during the backward pass, with the gradients flowing through it.
      'layer_working_set': 2 * (carry + matmul_outputs + elementwise) * s.act_bytes,
      # FSDP gathers a layer's weights whole before using them (forward and backward).
      'gathered_layer_weights': 2 * layer_params * s.param_bytes,
      # The trunk's and heads' last hidden states (float32) and each head's ResBlock input.
      'hidden_states': (1 + s.mtp_heads) * carry * 4 + s.mtp_heads * carry * s.act_bytes,
      # Logits and their gradient of one cross-entropy chunk, float32.
      'loss_chunk': 2 * min(s.loss_chunk, tokens) * s.vocab * 4,
  }
  out['total'] = sum(out.values())
  return out


def projection(config, chips: int) -> dict:
  """Per-device bytes of `config`'s train step on `chips` chips, from shapes."""
  state = state_bytes_per_device(config, chips)
  activations = activation_bytes_per_device(config, chips)
  total = state['params'] + state['gradients'] + state['optimizer_state'] + activations['total']
  return {'chips': chips, 'rows_per_device': rows_per_device(config, chips), **state,
          'activations': activations, 'total': total}


def _gib(n: float) -> str:
  return f'{n / GIB:.2f} GiB'


def main(argv):
  del argv
  import jax
  from mtp.parallel import mesh as mesh_lib

  config = FLAGS.config
  devices = jax.device_count()
  small = scaled_down(config, FLAGS.width_divisor, FLAGS.seq_divisor, devices,
                      rows_per_device(config, FLAGS.chips))
  mesh = mesh_lib.make_mesh(small.mesh)
  compiled = compile_train_step(small, mesh)
  measured = xla_memory(compiled)
  small_estimate = projection(small, devices)
  full = projection(config, FLAGS.chips)
  mesh_shape = dict(mesh.shape)
  print(f'Compiled on {devices} {jax.devices()[0].platform} devices, mesh {mesh_shape}: '
        f'{small.model.num_layers} layers, width {small.model.embed_dim}, '
        f'{small.data.batch_size} x {small.data.seq_len} tokens, vocab {small.model.vocab_size}.')
  print('  XLA per device: ' + ', '.join(f'{k} {_gib(v)}' for k, v in measured.items()))
  # XLA's arguments are the parameters and optimizer state; its temporaries the gradients and
  # activations.
  print(f'  the estimate for it: parameters + optimizer state '
        f'{_gib(small_estimate["params"] + small_estimate["optimizer_state"])}, gradients + '
        f'activations {_gib(small_estimate["gradients"] + small_estimate["activations"]["total"])}'
        f', total {_gib(small_estimate["total"])}')
  full_mesh = dict(zip(mesh_lib.MESH_AXES, mesh_lib.resolve_mesh_shape(config.mesh, FLAGS.chips)))
  print(f'Full size on {FLAGS.chips} chips, mesh {full_mesh}: {full["num_params"]:,} parameters, '
        f'{full["rows_per_device"]} x {config.data.seq_len} tokens per device.')
  for key in ('params', 'gradients', 'optimizer_state'):
    print(f'  {key}: {_gib(full[key])}')
  for key, value in full['activations'].items():
    print(f'  activations, {key}: {_gib(value)}')
  print(f'  total per device: {_gib(full["total"])}')
  record = {'compiled': {'devices': devices, 'platform': jax.devices()[0].platform,
                         'mesh': mesh_shape, 'config': small.to_dict(), 'xla': measured,
                         'estimate': small_estimate},
            'full': {'mesh': full_mesh, **full}}
  output = pathlib.Path(FLAGS.output)
  output.parent.mkdir(parents=True, exist_ok=True)
  output.write_text(json.dumps(record, indent=2, default=list))
  print(f'Wrote {output}.')


if __name__ == '__main__':
  app.run(main)
