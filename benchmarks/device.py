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

`--norandom_shape` leaves the random model out, and `--demo_auto` adds mtp's default decoder
(`auto`, after timing this machine's break-evens): `benchmarks/device_drafter.sh --decode` so
decodes SmolLM2 with its GPU-trained EAGLE-3 drafter, a real model's figures.

Every speculative output is compared token for token with autoregressive decoding at the same
precision and batch size, and the rows that match are counted. With random weights in bfloat16
the logits are nearly flat, so a T-token pass and a 1-token pass that round differently can
pick different argmaxes: count mismatches there as the precision's near-ties, not as a broken
verifier (the float32 test suite checks exactness). Prints tables; writes `device.json` to
--output_dir after every measurement (a failed or killed run keeps what ran).

The run fits in --time_budget (default 7.5 minutes, compiles included): it runs in steps, each
with a budget it prints (`Steps`), every measurement at the first batch size before any at the
next. A step whose budget does not fit in the time left is skipped, one that fails is reported
and the next runs; `device.json`'s `steps` says which ran. Budgets on one H200, estimated from
compile times on CPU (compiling is nearly all of it): batch 1 cost curve (T = 1..64, 7
programs) 80 s, SmolLM2-shaped decoding (3 decoders) 75 s, demo model (4 decoders) 50 s; at
batch 8 70 s, 75 s, 40 s: 390 s in all, with JAX's start about 6.5 minutes (the 60 s left
absorb a step that overruns its budget).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import platform
import statistics
import time
import traceback

from absl import app
from absl import flags

from benchmarks import NUM_HEADS, SMOLLM2_SHAPE, random_model

FLAGS = flags.FLAGS
flags.DEFINE_bool('tiny', False, 'A tiny random model and few tokens: a CPU smoke run.')
flags.DEFINE_string('output_dir', 'results/device', 'Where device.json goes.')
flags.DEFINE_string('demo_workdir', None, 'A trained workdir or params export to decode with '
                    '(held-out code prompts); skipped when unset.')
flags.DEFINE_bool('random_shape', True, 'Measure the random SmolLM2-shaped model (cost curve '
                  'and decoders); --norandom_shape measures --demo_workdir alone.')
flags.DEFINE_bool('demo_auto', False, 'Also decode the demo model with mtp\'s default decoder '
                  '(`auto`), which first times this machine\'s break-evens.')
flags.DEFINE_list('batch_sizes', ['1', '8'], 'Batch sizes.')
flags.DEFINE_list('token_counts', ['1', '2', '4', '8', '16', '32', '64'],
                  'Verification sizes T of the cost curve.')
flags.DEFINE_integer('prompt_tokens', 128, 'Prompt length.')
flags.DEFINE_integer('max_new_tokens', 128, 'Tokens generated per row.')
flags.DEFINE_integer('repeats', 2, 'Timed runs per decoder (the fastest counts).')
flags.DEFINE_integer('lookup', 8, 'Prompt-lookup drafts in the demo model\'s lookup row.')
flags.DEFINE_integer('time_budget', 450, 'Seconds the run may take, compiles included: a step '
                     'whose budget does not fit in what is left is skipped. 0: no limit.')


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
                repeats: int, on_row=None) -> list[dict]:
  """Times each decoder on one batch; the first must be autoregressive (the reference).

  source: a model or a `LoadedModel` (`plan.resolve`'s source).
  decoders: name -> `plan.resolve` options, 'decoder' among them (plus 'oracle': True to feed
    the reference as drafts). Rows are greedy and never stop early (no stop id): every
    decoder makes `max_new_tokens` per row. The time is the prefill and the loop on the
    device (`Engine.prefill`, `Engine.step`), not the copy of the result to the host.
  on_row: called with each row as soon as it is measured.
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
    if on_row is not None:
      on_row(rows[-1])
  return rows


# Seconds each step may take on one H200, compiles included (nearly all of it): on 2 CPU cores
# a program of SmolLM2's 30-layer shape compiles in 5-7 s (a verification pass) or 12 s (a
# decoder); the GPU's compiles are budgeted at 1.5-2x that, its runs take under a second.
SECONDS_PER_COST_PROGRAM = 10    # One verification size T of the cost curve.
SECONDS_PER_RANDOM_DECODER = 25  # One SmolLM2-shaped decoder: compile, warm-up, timed runs.
SECONDS_PER_DEMO_DECODER = 10    # One decoder of the demo model (code_small: 4 layers).
SECONDS_TO_BUILD = 10            # The random model's weights, or loading the demo model.


class Steps:
  """Runs the benchmark's steps, each in its time budget, and writes the report after each.

  A step whose budget does not fit in what is left of `time_budget` (seconds since `start`;
  0: no limit) is skipped; one that raises is reported (its traceback printed) and the next
  one runs. `report['steps']` records each step's name, budget, seconds and status ('done',
  'skipped', or 'failed' with its error). Steps call `save` after each measurement too: what
  ran survives a step that fails and a run that is killed.
  """

  def __init__(self, report: dict, path: pathlib.Path, time_budget: float, start: float):
    self.report, self.path, self.time_budget, self.start = report, path, time_budget, start
    self.failed = False
    report['time_budget'] = time_budget or None
    report['steps'] = []

  def left(self) -> float:
    """Seconds left of the time budget (infinite without one)."""
    if not self.time_budget:
      return float('inf')
    return self.time_budget - (time.perf_counter() - self.start)

  def run_all(self, steps) -> None:
    """Runs `steps`, (name, budget seconds, function) each, in order."""
    steps = list(steps)
    total = sum(budget for _, budget, _ in steps)
    print(f'{len(steps)} steps, their budgets {total:.0f} s in all'
          + (f'; time budget {self.time_budget:.0f} s, {self.left():.0f} s left'
             if self.time_budget else ''), flush=True)
    self.save()
    for index, (name, budget, fn) in enumerate(steps, 1):
      self._run(f'[{index}/{len(steps)}]', name, budget, fn)

  def _run(self, label: str, name: str, budget: float, fn) -> None:
    left = self.left()
    print(f'\n{label} {name}: budget {budget:.0f} s'
          + (f' ({left:.0f} s left)' if self.time_budget else ''), flush=True)
    record = dict(name=name, budget_s=budget)
    self.report['steps'].append(record)
    if budget > left:
      record.update(status='skipped', seconds=0.0)
      print(f'{label} skipped: its budget does not fit in the time left', flush=True)
      self.save()
      return
    started = time.perf_counter()
    try:
      fn()
      record['status'] = 'done'
    except Exception as e:  # pylint: disable=broad-except  # The other steps still run.
      traceback.print_exc()
      record.update(status='failed', error=f'{type(e).__name__}: {e}'[:1000])
      self.failed = True
    record['seconds'] = time.perf_counter() - started
    print(f'{label} {record["status"]} in {record["seconds"]:.0f} s (budget {budget:.0f} s)',
          flush=True)
    self.save()

  def save(self) -> None:
    """Writes the report as it stands to `path` (atomically: a kill leaves the last one)."""
    report = self.report
    report['seconds'] = time.perf_counter() - self.start
    rows = _all_rows(report)
    report['all_exact'] = all(r['outputs_match'] for r in rows)
    report['median_speedup'] = statistics.median(r['speedup'] for r in rows) if rows else None
    self.path.parent.mkdir(parents=True, exist_ok=True)
    partial = self.path.with_name(self.path.name + '.partial')
    partial.write_text(json.dumps(report, indent=2, default=str))
    partial.replace(self.path)


def _all_rows(report: dict) -> list[dict]:
  return (report.get('random_smollm2_shape', {}).get('decoding', [])
          + report.get('demo', {}).get('decoding', []))


def random_model_steps(tiny: bool, batch_sizes, token_counts, prompt_tokens: int,
                       max_new_tokens: int, repeats: int, result: dict, save) -> dict:
  """The random SmolLM2-shaped model's steps: {('cost' | 'random', batch size): (name, budget
  seconds, function)}, the cost curve and the decoders. They fill `result` (the model is built
  by the first that runs) and call `save()` after each measurement."""
  import numpy as np
  from mtp.decode import cost_model
  built = {}

  def build():
    if not built:
      model = built['model'] = random_model(tiny)
      vocab = model.cfg.trunk.vocab_size
      rng = np.random.default_rng(1)
      built['prompts'] = {b: rng.integers(0, vocab, (b, prompt_tokens)).astype(np.int32)
                          for b in batch_sizes}
      result.update(model=cost_model.model_key(model), cost={}, decoding=[])
    return built['model']

  def cost(b):
    seconds = cost_model.measure_step_cost(build(), token_counts, batch_size=b,
                                           context=prompt_tokens, iterations=8,
                                           repeats=repeats)
    result['cost'][b] = dict(seconds=seconds, relative=cost_model.relative(seconds))
    save()
    print(f'cost of verifying T tokens, batch {b} (x T=1): ' + ', '.join(
        f'{t}: {c:.2f}' for t, c in result['cost'][b]['relative'].items())
        + f'   (T=1: {seconds[1] * 1e3:.2f} ms)', flush=True)

  def decode(b):
    model = build()
    lengths = np.full([b], prompt_tokens, np.int32)
    decoders = {'autoregressive': dict(decoder='autoregressive'),
                f'heads chain {NUM_HEADS} (random heads)': dict(decoder='speculative',
                                                                  tree=NUM_HEADS),
                f'oracle chain {NUM_HEADS}': dict(decoder='speculative', tree=NUM_HEADS,
                                                  oracle=True)}
    rows = decode_rows(model, built['prompts'][b], lengths, decoders,
                       max_new_tokens=max_new_tokens, repeats=repeats,
                       on_row=lambda row: (result['decoding'].append(row), save()))
    _print_rows('SmolLM2 shape, random weights, bfloat16', rows)

  steps = {}
  for i, b in enumerate(batch_sizes):
    first = SECONDS_TO_BUILD if i == 0 else 0
    steps['cost', b] = (f'cost curve, SmolLM2 shape, batch {b}, T = '
                        + ','.join(map(str, token_counts)),
                        first + SECONDS_PER_COST_PROGRAM * len(token_counts),
                        lambda b=b: cost(b))
    steps['random', b] = (f'decoding, SmolLM2 shape, batch {b}: autoregressive, heads chain, '
                          'oracle chain', 3 * SECONDS_PER_RANDOM_DECODER, lambda b=b: decode(b))
  return steps


def demo_model_steps(workdir: str, batch_sizes, prompt_tokens: int, max_new_tokens: int,
                     repeats: int, lookup: int, result: dict, save, auto: bool = False) -> dict:
  """The demo model's steps: {('demo', batch size): (name, budget seconds, function)},
  autoregressive, the heads' chain, `auto` (if `auto`), the default tree and chain + lookup on
  held-out code prompts. They fill `result` (the model is loaded by the first that runs) and
  call `save()` after each measurement."""
  loaded = {}

  def load():
    if not loaded:
      import mtp
      from mtp.data import corpora
      from mtp.decode import calibration
      model = loaded['model'] = mtp.load(workdir)
      try:
        files = corpora.heldout_files()
      except ValueError:  # Neither held-out package installed there: any non-stdlib package.
        files = corpora.heldout_files(('numpy', 'jax', 'flax'))
      loaded['prompts'] = calibration.code_prompts(
          files, model.tokenizer, max(batch_sizes), max_tokens=prompt_tokens,
          min_tokens=prompt_tokens // 2)
      result.update(workdir=str(workdir), step=model.step,
                    dtype=str(model.model.cfg.trunk.dtype), decoding=[])
    return loaded['model'], loaded['prompts']

  def decode(b):
    from mtp.decode import state as state_lib
    model, prompts = load()
    tokenizer, num_heads = model.tokenizer, model.model.mtp_num_heads
    decoders = {'autoregressive': dict(decoder='autoregressive'),
                f'heads chain {num_heads}': dict(decoder='speculative', tree=num_heads)}
    if auto:
      decoders['auto (default)'] = dict(decoder='auto')
    decoders.update({'default tree': dict(decoder='speculative', tree='default'),
                     f'chain + lookup {lookup}': dict(decoder='speculative', tree=num_heads,
                                                      lookup=lookup)})
    encoded = [tokenizer.encode(p) for p in prompts[:b]]
    padded, lengths = state_lib.pad_prompts(encoded, tokenizer.pad_id)
    rows = decode_rows(model, padded, lengths, decoders, max_new_tokens=max_new_tokens,
                       repeats=repeats,
                       on_row=lambda row: (result['decoding'].append(row), save()))
    _print_rows(f'demo model ({workdir}), held-out code', rows)

  return {('demo', b): (f'decoding, demo model, batch {b}: autoregressive, heads chain, '
                        + ('auto, ' if auto else '') + f'default tree, chain + lookup {lookup}',
                        (SECONDS_TO_BUILD if i == 0 else 0)
                        + (5 if auto else 4) * SECONDS_PER_DEMO_DECODER,
                        lambda b=b: decode(b))
          for i, b in enumerate(batch_sizes)}


def _print_rows(title: str, rows) -> None:
  print(f'\n{title}\n{"batch":>5}  {"decoder":<34} {"tokens/s":>10} {"tok/step":>8} '
        f'{"speedup":>7}  exact')
  for r in rows:
    print(f'{r["batch_size"]:>5}  {r["decoder"]:<34} {r["tokens_per_sec"]:>10.1f} '
          f'{r["tokens_per_step"]:>8.2f} {r["speedup"]:>6.2f}x  '
          f'{r["rows_matching"]}/{r["batch_size"]} rows', flush=True)


def main(argv):
  del argv
  start = time.perf_counter()
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
            'python': platform.python_version(), 'tiny': FLAGS.tiny,
            'random_smollm2_shape': {}}
  print(f'jax {jax.__version__}, devices: {jax.devices()}', flush=True)
  out = pathlib.Path(FLAGS.output_dir) / 'device.json'
  runner = Steps(report, out, FLAGS.time_budget, start)
  steps = {}
  if FLAGS.random_shape:
    steps.update(random_model_steps(FLAGS.tiny, batch_sizes, token_counts, prompt_tokens,
                                    max_new, FLAGS.repeats, report['random_smollm2_shape'],
                                    runner.save))
  if FLAGS.demo_workdir:
    report['demo'] = {}
    steps.update(demo_model_steps(FLAGS.demo_workdir, batch_sizes, prompt_tokens, max_new,
                                  FLAGS.repeats, FLAGS.lookup, report['demo'], runner.save,
                                  auto=FLAGS.demo_auto))
  # Every measurement at the first batch size before any at the next: when time runs short,
  # the later batch sizes go.
  runner.run_all(steps[kind, b] for b in batch_sizes for kind in ('cost', 'random', 'demo')
                 if (kind, b) in steps)
  for title, rows in (('SmolLM2 shape, random weights, bfloat16',
                       report['random_smollm2_shape'].get('decoding')),
                      (f'demo model ({FLAGS.demo_workdir}), held-out code',
                       report.get('demo', {}).get('decoding'))):
    if rows:
      _print_rows(title, rows)
  runner.save()
  not_done = [f'{s["name"]} ({s["status"]})' for s in report['steps'] if s['status'] != 'done']
  print(f'\nall outputs exact: {report["all_exact"]}; {report["seconds"]:.0f} s; -> {out}'
        + ''.join(f'\n  not done: {s}' for s in not_done), flush=True)
  return 1 if runner.failed else 0


if __name__ == '__main__':
  app.run(main)
