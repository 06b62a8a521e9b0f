r"""float32 against bfloat16: train step time and decoding speed, side by side in one run.

  python -m benchmarks.precision [--config=configs/tiny.py] [--steps=5]
  python -m benchmarks.precision --workdir=workdirs/smollm2   # + a trained model's cost curve

Training: the joint train step of the config with `model.dtype` float32 and bfloat16 (float32
parameters and optimizer state in both), the fastest of `--steps` timed steps after compilation,
as tokens/s. Decoding: a randomly initialised model of the config with float32, then bfloat16
weights and activations, greedy autoregressive and speculative (chain of its heads), tokens/s
of the best of three calls after a warm-up call (compilation excluded).

With --workdir, also the verification cost curve of that trained model loaded in each
precision (`mtp.load(dtype=)`): seconds per cached step of T tokens (`cost_model`), at batch 1.

On XLA:CPU a bfloat16 product is fast only with 3+ rows accumulating in float32, which
`mtp.model.products` arranges: on an AMX machine a one-token bf16 step costs about 1.2x
float32's, but 8 tokens cost 1.2x one token against float32's 2x (see the README). Training
steps and random tiny models show little of it: their products are small.
"""

from __future__ import annotations

import json
import pathlib
import time

from absl import app
from absl import flags
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', 'configs/tiny.py', 'Model and batch config.')
flags.DEFINE_integer('steps', 10, 'Timed train steps per precision.')
flags.DEFINE_integer('new_tokens', 64, 'Tokens decoded per row.')
flags.DEFINE_integer('decode_batch', 4, 'Rows decoded at once.')
flags.DEFINE_string('workdir', None, 'Also the cost curve of this trained workdir, per dtype.')
flags.DEFINE_list('token_counts', ['1', '2', '4', '8', '16', '32'], 'T of the cost curve.')
flags.DEFINE_string('output', 'results/precision.json', 'Where to write the figures.')


def train_step_seconds(config, mesh, steps: int) -> tuple[float, int]:
  """(the fastest of `steps` compiled train steps on a random batch, in seconds; its peak
  bytes). The fastest: a shared machine's noise only slows a step down."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from mtp.train import step as step_lib  # pylint: disable=import-outside-toplevel
  trainer = step_lib.Trainer(config, mesh)
  state = trainer.init_state()
  b, t = config.data.batch_size, config.data.seq_len
  batch = trainer.train_batch({
      'tokens': np.random.default_rng(0).integers(0, config.model.vocab_size, (b, t)
                                                  ).astype(np.int32),
      'segment_ids': np.ones((b, t), np.int32),
      'positions': np.broadcast_to(np.arange(t), (b, t)).astype(np.int32)})
  compiled = trainer.train_step.lower(state, batch).compile()
  m = compiled.memory_analysis()
  peak = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes)
  times = []
  for _ in range(steps + 1):  # The first call warms up.
    start = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  return min(times[1:]), int(peak)


def decode_speed(config, dtype: str, decoder: str, new_tokens: int, batch: int) -> float:
  """Tokens/s of greedy decoding with `dtype` weights and activations (compilation excluded)."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from mtp.decode import plan as plan_lib  # pylint: disable=import-outside-toplevel
  from mtp.decode import settings as settings_lib  # pylint: disable=import-outside-toplevel
  from mtp.model import mtp_model  # pylint: disable=import-outside-toplevel
  model_config = config.model.copy_and_resolve_references()
  model_config.dtype = model_config.param_dtype = dtype
  model = mtp_model.MTPModel(mtp_model.ModelConfig.from_config(model_config), rngs=nnx.Rngs(0))
  prompts = np.random.default_rng(0).integers(0, config.model.vocab_size, (batch, 16))
  prompts = prompts.astype(np.int32)
  lengths = np.full((batch,), prompts.shape[1], np.int32)
  engine = plan_lib.resolve(model, decoder, max_new_tokens=new_tokens,
                            prompt_width=prompts.shape[1], batch_size=batch, greedy_only=True)
  settings = engine.settings([settings_lib.Sampling(max_tokens=new_tokens)] * batch)

  def run():
    return engine.step(engine.prefill(prompts, lengths, settings), new_tokens)
  jax.block_until_ready(run())  # Compiles.
  best = float('inf')
  for _ in range(3):  # The best of three: a shared machine's noise only slows a run down.
    start = time.perf_counter()
    out = jax.block_until_ready(run())
    best = min(best, time.perf_counter() - start)
  return float(np.sum(out.num_generated)) / best


def cost_curves(workdir: str, token_counts: list[int]) -> dict:
  """{dtype: {T: seconds per verification step}} of the workdir's model at batch 1, printed."""
  import mtp  # pylint: disable=import-outside-toplevel
  from mtp.decode import cost_model  # pylint: disable=import-outside-toplevel
  curves = {}
  for dtype in ('float32', 'bfloat16'):
    model = mtp.load(workdir, dtype=dtype).model
    curves[dtype] = cost_model.measure_step_cost(model, token_counts)
  print(f'\nVerification step of T tokens, {workdir}, batch 1 (ms; relative to T = 1):')
  for dtype, seconds in curves.items():
    print(f'{dtype:>9} ' + '  '.join(f'T={t}: {s * 1e3:.1f} ({s / seconds[1]:.2f})'
                                      for t, s in seconds.items()))
  return {dtype: {str(t): s for t, s in seconds.items()} for dtype, seconds in curves.items()}


def main(argv):
  del argv
  import jax  # pylint: disable=import-outside-toplevel
  from mtp.parallel import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  base = FLAGS.config
  mesh = mesh_lib.make_mesh(dict(data=1, fsdp=1, tensor=1), jax.devices()[:1])
  tokens = base.data.batch_size * base.data.seq_len
  rows = []
  for dtype in ('float32', 'bfloat16'):
    config = base.copy_and_resolve_references()
    config.model.dtype = dtype
    seconds, peak = train_step_seconds(config, mesh, FLAGS.steps)
    row = {'dtype': dtype, 'train_step_seconds': seconds, 'train_tokens_per_sec': tokens / seconds,
           'train_peak_bytes': int(peak)}
    for decoder in ('autoregressive', 'speculative'):
      row[f'{decoder}_tokens_per_sec'] = decode_speed(base, dtype, decoder, FLAGS.new_tokens,
                                                      FLAGS.decode_batch)
    rows.append(row)
  print(f'\n{jax.devices()[0].device_kind}: batch {base.data.batch_size}x{base.data.seq_len}, '
        f'width {base.model.embed_dim}, {base.model.num_layers} layers, vocab '
        f'{base.model.vocab_size}')
  print(f'{"dtype":>9} {"s/step":>8} {"train tok/s":>12} {"peak MiB":>9} {"AR tok/s":>9} '
        f'{"spec tok/s":>11}')
  for r in rows:
    print(f'{r["dtype"]:>9} {r["train_step_seconds"]:>8.4f} {r["train_tokens_per_sec"]:>12.0f} '
          f'{r["train_peak_bytes"] / 2**20:>9.1f} {r["autoregressive_tokens_per_sec"]:>9.0f} '
          f'{r["speculative_tokens_per_sec"]:>11.0f}')
  token_counts = sorted({1} | {int(t) for t in FLAGS.token_counts})
  curves = cost_curves(FLAGS.workdir, token_counts) if FLAGS.workdir else {}
  output = pathlib.Path(FLAGS.output)
  output.parent.mkdir(parents=True, exist_ok=True)
  output.write_text(json.dumps({'backend': jax.default_backend(), 'rows': rows,
                                'cost_curves': curves}, indent=2))
  print(f'\nWrote {output}.')


if __name__ == '__main__':
  app.run(main)
