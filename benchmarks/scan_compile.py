r"""Train-step compile time against depth, scanned against unrolled, and the memory remat saves.

  python -m benchmarks.scan_compile [--depths=4,16,32] [--output=results/scan_compile.json]

Compile time: the joint train step (trunk, Medusa heads, fused loss, AdamW update) of a narrow
model (`--width`) at each depth, with `model.scan_layers` False and True. Tracing and lowering
(`lower`) and XLA's compilation (`compile`) are timed apart, in wall seconds and in this
process's CPU seconds (steadier on a shared machine); the persistent compilation cache is off,
so every program compiles from scratch.

Remat memory: the compiled train step's `memory_analysis()` temporaries (bytes XLA allocates
beyond arguments and outputs) of a scanned trunk at `--memory_depth` layers and a longer
sequence, for each `model.remat` policy. XLA:CPU may schedule recomputation early (hoist it),
which gives memory back; the figures are what this backend's compiler does.
"""

from __future__ import annotations

import json
import pathlib
import time

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_list('depths', ['4', '16', '32'], 'Trunk depths whose train step is compiled.')
flags.DEFINE_integer('width', 64, 'Model width (embed_dim) of the compile-time runs.')
flags.DEFINE_integer('memory_depth', 8, 'Trunk depth of the remat-memory runs.')
flags.DEFINE_integer('memory_seq_len', 512, 'Sequence length of the remat-memory runs.')
flags.DEFINE_string('output', 'results/scan_compile.json', 'Where to write the figures.')

POLICIES = ('none', 'heads', 'full', 'dots_saveable')


def make_config(num_layers: int, width: int, scan_layers: bool, remat: str = 'none',
                seq_len: int = 64, batch_size: int = 4):
  """configs/tiny.py at the given depth and width on one device."""
  from configs import tiny  # pylint: disable=import-outside-toplevel
  c = tiny.get_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 1, 1
  c.model.num_layers = num_layers
  c.model.embed_dim = width
  c.model.head_dim = width // c.model.num_attention_heads
  c.model.mlp_dim = 2 * width
  c.model.scan_layers = scan_layers
  c.model.remat = remat
  c.model.mtp_num_heads = 2
  c.data.seq_len = seq_len
  c.model.max_seq_len = max(c.model.max_seq_len, seq_len)
  c.data.batch_size = batch_size
  return c


def compiled_step(config):
  """(seconds to trace and lower, seconds to compile, CPU seconds to compile, the compiled
  train step)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from mtp.parallel import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  from mtp.train import step as step_lib  # pylint: disable=import-outside-toplevel
  trainer = step_lib.Trainer(config, mesh_lib.make_mesh(config.mesh, jax.devices()[:1]))
  b, t = config.data.batch_size, config.data.seq_len
  batch = step_lib.Batch(tokens=jax.ShapeDtypeStruct((b, t), jnp.int32),
                         positions=jax.ShapeDtypeStruct((b, t), jnp.int32),
                         segment_ids=jax.ShapeDtypeStruct((b, t), jnp.int32))
  start = time.perf_counter()
  lowered = trainer.train_step.lower(trainer.abstract_state_with_shardings(), batch)
  lowered_at, cpu_start = time.perf_counter(), time.process_time()
  compiled = lowered.compile()
  return (lowered_at - start, time.perf_counter() - lowered_at, time.process_time() - cpu_start,
          compiled)


def main(argv):
  del argv
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update('jax_enable_compilation_cache', False)
  rows = []
  print(f'Train-step compile time, width {FLAGS.width} (seconds: trace+lower / compile)')
  print(f'{"layers":>7} {"unrolled lower":>15} {"compile":>8} {"(cpu)":>7} {"scanned lower":>14} '
        f'{"compile":>8} {"(cpu)":>7} {"cpu ratio":>10}')
  for depth in [int(d) for d in FLAGS.depths]:
    row = {'num_layers': depth}
    for scanned in (False, True):
      lower_s, compile_s, cpu_s, _ = compiled_step(make_config(depth, FLAGS.width, scanned))
      name = 'scanned' if scanned else 'unrolled'
      row[f'{name}_lower_s'] = round(lower_s, 3)
      row[f'{name}_compile_s'] = round(compile_s, 3)
      row[f'{name}_compile_cpu_s'] = round(cpu_s, 3)
    rows.append(row)
    print(f'{depth:>7} {row["unrolled_lower_s"]:>15.2f} {row["unrolled_compile_s"]:>8.2f} '
          f'{row["unrolled_compile_cpu_s"]:>7.2f} {row["scanned_lower_s"]:>14.2f} '
          f'{row["scanned_compile_s"]:>8.2f} {row["scanned_compile_cpu_s"]:>7.2f} '
          f'{row["unrolled_compile_cpu_s"] / row["scanned_compile_cpu_s"]:>9.1f}x', flush=True)

  memory = []
  print(f'\nRemat: compiled train step memory, {FLAGS.memory_depth} layers, seq '
        f'{FLAGS.memory_seq_len}, width {FLAGS.width} (MiB)')
  print(f'{"layout":>9} {"remat":>14} {"temp":>8} {"peak":>8}')
  for scanned, policy in [(True, p) for p in POLICIES] + [(False, 'none'), (False, 'full')]:
    config = make_config(FLAGS.memory_depth, FLAGS.width, scanned, policy,
                         seq_len=FLAGS.memory_seq_len)
    *_, compiled = compiled_step(config)
    m = compiled.memory_analysis()
    peak = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)
    record = {'scan_layers': scanned, 'remat': policy, 'temp_bytes': int(m.temp_size_in_bytes),
              'peak_bytes': int(peak)}
    memory.append(record)
    print(f'{"scanned" if scanned else "unrolled":>9} {policy:>14} '
          f'{m.temp_size_in_bytes / 2**20:>8.2f} {peak / 2**20:>8.2f}')

  output = pathlib.Path(FLAGS.output)
  output.parent.mkdir(parents=True, exist_ok=True)
  output.write_text(json.dumps({
      'backend': jax.default_backend(), 'device': str(jax.devices()[0].device_kind),
      'width': FLAGS.width, 'compile': rows,
      'memory': {'num_layers': FLAGS.memory_depth, 'seq_len': FLAGS.memory_seq_len,
                 'rows': memory}}, indent=2))
  print(f'\nWrote {output}.')


if __name__ == '__main__':
  app.run(main)
