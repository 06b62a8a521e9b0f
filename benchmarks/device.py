r"""One accelerator benchmark: the verification cost curve and decoding speeds, in one run.

  python -m benchmarks.device [--output_dir=results/device] [--demo_workdir=.device/demo]
  python -m benchmarks.device --tiny        # a CPU smoke run of the same code (its test)

Run by `benchmarks/device.sh` on a lent GPU (or TPU), where it has to finish in a few minutes.
Two models, both decoded in bfloat16 (weights and activations), greedy, batch 1 and 8:

  * SmolLM2-135M's shape (30 layers, d 576, 49,152 tokens, 4 Medusa heads) with random
    weights: its 98 MB GGUF cannot travel to an offline accelerator, and the shape alone fixes
    the speed. Measured:
      - the cost of one cached verification pass over T tokens relative to T = 1
        (`cost_model.measure_step_cost`), the curve every speculative choice rests on;
      - autoregressive decoding, a chain of the heads' own drafts (random heads: nearly all
        rejected, so this is the overhead of drafting), and the same chain with oracle drafts
        (the autoregressive output fed in as drafts: every draft accepted). The oracle row is
        the ceiling of what any drafter of that depth could give on this hardware.
  * The demo model (`--demo_workdir`, a params export of `launch.train
    --config=configs/code_small.py`, see device.sh), when given: autoregressive, the heads'
    chain, the default tree and chain + prompt lookup, on held-out code prompts.

Every speculative output is compared token for token with autoregressive decoding at the same
precision and batch size, and the rows that match are counted. With random weights in bfloat16
the logits are nearly flat, so a T-token pass and a 1-token pass that round differently can
pick different argmaxes: count mismatches there as the precision's near-ties, not as a broken
verifier (the float32 test suite checks exactness). Prints tables; writes `device.json` to
--output_dir.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import platform
import statistics
import time

from absl import app
from absl import flags

from benchmarks import NUM_HEADS, SMOLLM2_SHAPE, random_model

FLAGS = flags.FLAGS
flags.DEFINE_bool('tiny', False, 'A tiny random model and few tokens: a CPU smoke run.')
flags.DEFINE_string('output_dir', 'results/device', 'Where device.json goes.')
flags.DEFINE_string('demo_workdir', None, 'A trained workdir or params export to decode with '
                    '(held-out code prompts); skipped when unset.')
flags.DEFINE_list('batch_sizes', ['1', '8'], 'Batch sizes.')
flags.DEFINE_list('token_counts', ['1', '2', '4', '8', '16', '32', '64'],
                  'Verification sizes T of the cost curve.')
flags.DEFINE_integer('prompt_tokens', 128, 'Prompt length.')
flags.DEFINE_integer('max_new_tokens', 128, 'Tokens generated per row.')
flags.DEFINE_integer('repeats', 3, 'Timed runs per decoder (the fastest counts).')
flags.DEFINE_integer('lookup', 8, 'Prompt-lookup drafts in the demo model\'s lookup row.')


@dataclasses.dataclass(frozen=True)
class OracleChain:
  """Draft hook: a chain of `depth` drafts copied from a known continuation (every one right).

  Hashable, so equal hooks share a compiled decoder. hook_data: {'ref': [B, >= max_new_tokens
  + depth] int32}, the autoregressive output.
  """
  depth: int

  def __call__(self, drafts, num_generated, data):
    import jax.numpy as jnp
    # Draft i (depth i + 1) is output token num_generated + i.
    index = num_generated[:, None] + jnp.arange(self.depth)[None, :]
    return jnp.take_along_axis(data['ref'], index, axis=1)


def _timed(run, repeats: int):
  """(best seconds, output) of `run()` after one warm-up call (compilation)."""
  import jax
  out = jax.block_until_ready(run())
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    out = jax.block_until_ready(run())
    best = min(best, time.perf_counter() - start)
  return best, out


def decode_rows(source, prompts, lengths, decoders: dict, *, max_new_tokens: int,
                repeats: int) -> list[dict]:
  """Times each decoder on one batch; the first must be autoregressive (the reference).

  source: a model or a `LoadedModel` (`plan.resolve`'s source).
  decoders: name -> `plan.resolve` options, 'decoder' among them (plus 'oracle': True to feed
    the reference as drafts). Rows are greedy and never stop early (no stop id): every
    decoder makes `max_new_tokens` per row. The time is the prefill and the loop on the
    device (`Engine.prefill`, `Engine.step`), not the copy of the result to the host.
  Returns one row per decoder: tokens/s, tokens per step, speedup, whether outputs match.
  """
  import jax
  import numpy as np
  from mtp.decode import plan as plan_lib
  from mtp.decode import settings as settings_lib
  b = int(prompts.shape[0])
  rows, reference, ref_seconds = [], None, None
  for name, options in decoders.items():
    options = dict(options)
    decoder = options.pop('decoder')
    if options.pop('oracle', False):
      depth = int(options['tree'])
      options['draft_hook'] = OracleChain(depth)
      pad = np.zeros((reference.shape[0], depth + 1), np.int32)
      ref = np.concatenate([reference, pad], axis=1)
      options['hook_data'] = {'ref': jax.numpy.asarray(ref)}
    engine = plan_lib.resolve(source, decoder, max_new_tokens=max_new_tokens,
                              prompt_width=prompts.shape[1], batch_size=b, greedy_only=True,
                              **options)
    settings = engine.settings([settings_lib.Sampling(max_tokens=max_new_tokens)] * b)
    seconds, state = _timed(
        lambda: engine.step(engine.prefill(prompts, lengths, settings), max_new_tokens),
        repeats)
    out = engine.result(state)
    tokens = np.asarray(out.tokens)
    generated = int(np.sum(out.num_generated))
    steps = int(np.sum(out.num_steps))
    if reference is None:
      reference, ref_seconds = tokens, seconds
    rows.append(dict(decoder=name, batch_size=b, seconds=seconds,
                     tokens_per_sec=generated / seconds,
                     tokens_per_step=(generated - b) / max(steps, 1),
                     speedup=ref_seconds / seconds,
                     outputs_match=bool(np.array_equal(tokens, reference)),
                     rows_matching=int(np.sum(np.all(tokens == reference, axis=1)))))
  return rows


def measure_random_model(tiny: bool, batch_sizes, token_counts, prompt_tokens: int,
                         max_new_tokens: int, repeats: int) -> dict:
  import numpy as np
  from mtp.decode import cost_model
  model = random_model(tiny)
  vocab = model.cfg.trunk.vocab_size
  result = {'model': cost_model.model_key(model), 'cost': {}, 'decoding': []}
  for b in batch_sizes:
    seconds = cost_model.measure_step_cost(model, token_counts, batch_size=b,
                                           context=prompt_tokens, iterations=8,
                                           repeats=repeats)
    result['cost'][b] = dict(seconds=seconds, relative=cost_model.relative(seconds))
    print(f'cost of verifying T tokens, batch {b} (x T=1): ' + ', '.join(
        f'{t}: {c:.2f}' for t, c in result['cost'][b]['relative'].items())
        + f'   (T=1: {seconds[1] * 1e3:.2f} ms)', flush=True)
  rng = np.random.default_rng(1)
  for b in batch_sizes:
    prompts = rng.integers(0, vocab, (b, prompt_tokens)).astype(np.int32)
    lengths = np.full([b], prompt_tokens, np.int32)
    decoders = {'autoregressive': dict(decoder='autoregressive'),
                f'heads chain {NUM_HEADS} (random heads)': dict(decoder='speculative',
                                                                  tree=NUM_HEADS),
                f'oracle chain {NUM_HEADS}': dict(decoder='speculative', tree=NUM_HEADS,
                                                  oracle=True)}
    result['decoding'] += decode_rows(model, prompts, lengths, decoders,
                                      max_new_tokens=max_new_tokens, repeats=repeats)
  return result


def measure_demo_model(workdir: str, batch_sizes, prompt_tokens: int, max_new_tokens: int,
                       repeats: int, lookup: int) -> dict:
  import mtp
  from mtp.data import corpora
  from mtp.decode import calibration
  from mtp.decode import state as state_lib
  loaded = mtp.load(workdir)
  model, tokenizer = loaded.model, loaded.tokenizer
  try:
    files = corpora.heldout_files()
  except ValueError:  # Neither held-out package installed there: any non-stdlib package.
    files = corpora.heldout_files(('numpy', 'jax', 'flax'))
  prompts = calibration.code_prompts(files, tokenizer, max(batch_sizes),
                                     max_tokens=prompt_tokens, min_tokens=prompt_tokens // 2)
  num_heads = model.mtp_num_heads
  decoders = {'autoregressive': dict(decoder='autoregressive'),
              f'heads chain {num_heads}': dict(decoder='speculative', tree=num_heads),
              'default tree': dict(decoder='speculative', tree='default'),
              f'chain + lookup {lookup}': dict(decoder='speculative', tree=num_heads,
                                               lookup=lookup)}
  result = {'workdir': str(workdir), 'step': loaded.step,
            'dtype': str(model.cfg.trunk.dtype), 'decoding': []}
  for b in batch_sizes:
    encoded = [tokenizer.encode(p) for p in prompts[:b]]
    padded, lengths = state_lib.pad_prompts(encoded, tokenizer.pad_id)
    result['decoding'] += decode_rows(loaded, padded, lengths, decoders,
                                      max_new_tokens=max_new_tokens, repeats=repeats)
  return result


def _print_rows(title: str, rows) -> None:
  print(f'\n{title}\n{"batch":>5}  {"decoder":<34} {"tokens/s":>10} {"tok/step":>8} '
        f'{"speedup":>7}  exact')
  for r in rows:
    print(f'{r["batch_size"]:>5}  {r["decoder"]:<34} {r["tokens_per_sec"]:>10.1f} '
          f'{r["tokens_per_step"]:>8.2f} {r["speedup"]:>6.2f}x  '
          f'{r["rows_matching"]}/{r["batch_size"]} rows')


def main(argv):
  del argv
  import jax
  batch_sizes = [int(b) for b in FLAGS.batch_sizes]
  token_counts = sorted({int(t) for t in FLAGS.token_counts} | {1})
  prompt_tokens, max_new = FLAGS.prompt_tokens, FLAGS.max_new_tokens
  if FLAGS.tiny:
    token_counts = [t for t in token_counts if t <= 8]
    prompt_tokens, max_new = min(prompt_tokens, 48), min(max_new, 16)
  device = jax.devices()[0]
  report = {'device': f'{device.platform}:{device.device_kind}',
            'device_count': jax.device_count(), 'jax': jax.__version__,
            'python': platform.python_version(), 'tiny': FLAGS.tiny}
  print(f'devices: {jax.devices()}', flush=True)
  start = time.perf_counter()
  report['random_smollm2_shape'] = measure_random_model(
      FLAGS.tiny, batch_sizes, token_counts, prompt_tokens, max_new, FLAGS.repeats)
  _print_rows('SmolLM2 shape, random weights, bfloat16', report['random_smollm2_shape']
              ['decoding'])
  if FLAGS.demo_workdir:
    report['demo'] = measure_demo_model(FLAGS.demo_workdir, batch_sizes, prompt_tokens,
                                        max_new, FLAGS.repeats, FLAGS.lookup)
    _print_rows(f'demo model ({FLAGS.demo_workdir}), held-out code', report['demo']['decoding'])
  report['seconds'] = time.perf_counter() - start
  rows = report['random_smollm2_shape']['decoding'] + report.get('demo', {}).get('decoding', [])
  report['all_exact'] = all(r['outputs_match'] for r in rows)
  report['median_speedup'] = statistics.median(r['speedup'] for r in rows)
  out = pathlib.Path(FLAGS.output_dir)
  out.mkdir(parents=True, exist_ok=True)
  (out / 'device.json').write_text(json.dumps(report, indent=2, default=str))
  print(f'\nall outputs exact: {report["all_exact"]}; {report["seconds"]:.0f} s; '
        f'-> {out / "device.json"}', flush=True)


if __name__ == '__main__':
  app.run(main)
