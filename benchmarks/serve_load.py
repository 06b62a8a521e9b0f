r"""The server under load: throughput and latency, its decoders side by side.

  python -m benchmarks.serve_load [--workdir=workdirs/code_small] [--concurrency=1,8,32] \
      [--settings=identical,mixed]

Starts `launch.serve`'s server in this process on a free localhost port (its batcher compiles
every served decoder at start), then for each concurrency level C, each kind of client
(`--settings`) and the two decoders taking turns (so machine load hits them alike): C clients
send `--requests` non-streamed completions of held-out code prompts (the first lines of
installed non-stdlib packages, at most `--prompt_tokens`), each waiting for its answer before
sending the next. Clients of kind
  * identical: every request greedy, `--max_tokens` tokens;
  * mixed: each request draws its own settings (the same draws for both decoders): a
    temperature of `--mixed_temperatures`, a top_p of `--mixed_top_p`, max_tokens in
    [`--mixed_min_tokens`, `--mixed_max_tokens`] and a seed: settings are row data in the
    server's batches, so any mix shares one compiled decoder.
Reported per level, kind and decoder: completion tokens/s over the wall time, p50 and p99
request latency, tokens per verification step, and whether every greedy speculative completion
equals the autoregressive one (sampled ones are equal in distribution only). Compilation is
excluded: the server's compilation counter (`mtp_compilations_total` in /metrics) is read once
it is warm and after every run, and must not move (reported, and printed as a warning if it
does).

Writes results/serve_load.json and results/serve_load.png.
"""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import random
import re
import statistics
import time

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', 'workdirs/code_small', 'Trained workdir.')
flags.DEFINE_list('concurrency', ['1', '8', '32'], 'Concurrent clients, one level each.')
flags.DEFINE_list('settings', ['identical', 'mixed'], 'Kinds of clients (see the module '
                  'docstring): identical (greedy, --max_tokens) and/or mixed (drawn per '
                  'request).')
flags.DEFINE_integer('requests', 64, 'Requests per level, kind of client and decoder.')
flags.DEFINE_integer('num_prompts', 16, 'Distinct prompts (requests cycle through them).')
flags.DEFINE_integer('prompt_tokens', 32, 'Prompts hold as many whole lines as fit.')
flags.DEFINE_integer('max_tokens', 64, 'max_tokens of every request of identical clients.')
flags.DEFINE_list('mixed_temperatures', ['0', '0.3', '0.7', '1.0'],
                  'Temperatures mixed clients draw from.')
flags.DEFINE_list('mixed_top_p', ['0.9', '1'], 'top_p values mixed clients draw from.')
flags.DEFINE_integer('mixed_min_tokens', 16, 'Mixed clients\' max_tokens: at least this.')
flags.DEFINE_integer('mixed_max_tokens', 128, 'Mixed clients\' max_tokens: at most this.')
flags.DEFINE_integer('max_batch', 8, 'The server\'s --max_batch.')
flags.DEFINE_float('max_wait_ms', 5.0, 'The server\'s --max_wait_ms.')
flags.DEFINE_bool('exact', True, 'The server\'s --exact (rows mapped one by one where a '
                  'shared batch is not exact: float32, GPUs).')
flags.DEFINE_enum('dtype', None, ['float32', 'bfloat16'], 'The server\'s --dtype (None: the '
                  'workdir\'s).')
flags.DEFINE_integer('steps_per_chunk', None, 'The server\'s --steps_per_chunk (None: each '
                     'decoder\'s own).')
flags.DEFINE_string('output', 'results/serve_load.json', 'JSON results.')
flags.DEFINE_string('plot', 'results/serve_load.png', 'Plot.')

flags.DEFINE_list('decoders', ['auto', 'speculative', 'autoregressive'],
                  'Decoders the server serves and the clients take turns with; '
                  'autoregressive is the reference of the others\' speedups and outputs.')
SETTINGS = ('identical', 'mixed')


def prompts_for(loaded) -> list[str]:
  """Held-out code prompts: whole lines when they fit the budget, else a cut first line."""
  from mtp.data import corpora
  from mtp.decode import calibration
  files = corpora.heldout_files()
  tokenizer = loaded.tokenizer
  prompts = calibration.code_prompts(files, tokenizer, FLAGS.num_prompts,
                                     max_tokens=FLAGS.prompt_tokens,
                                     min_tokens=max(1, FLAGS.prompt_tokens // 2))
  for path in files[::max(1, len(files) // (4 * FLAGS.num_prompts))]:
    if len(prompts) >= FLAGS.num_prompts:
      break
    lines = [line for line in pathlib.Path(path).read_text(errors='replace').splitlines()
             if line.strip() and not line.lstrip().startswith('#')]
    if not lines:
      continue
    text = lines[0]
    while text and len(tokenizer.encode(text)) > FLAGS.prompt_tokens:
      text = text[:-1]
    if text and text not in prompts:
      prompts.append(text)
  return prompts


def request_settings(kind: str, i: int) -> dict:
  """Request i's decoding fields for clients of `kind`: the same for every decoder and level
  (mixed draws are seeded by i)."""
  if kind == 'identical':
    return dict(max_tokens=FLAGS.max_tokens, temperature=0)
  rng = random.Random(i)
  return dict(temperature=float(rng.choice(FLAGS.mixed_temperatures)),
              top_p=float(rng.choice(FLAGS.mixed_top_p)),
              max_tokens=rng.randint(FLAGS.mixed_min_tokens, FLAGS.mixed_max_tokens), seed=i)


def compilations(url: str) -> int:
  """The server's `mtp_compilations_total`: decoder programs compiled since it started."""
  import httpx2 as httpx
  text = httpx.get(url + '/metrics', timeout=60).text
  found = re.search(r'^mtp_compilations_total ([\d.]+)$', text, re.MULTILINE)
  return int(float(found.group(1)))


def run_level(url: str, prompts: list[str], decoder: str, clients: int, kind: str,
              requests: int | None = None) -> dict:
  """`requests` (default `FLAGS.requests`) requests from `clients` closed-loop clients of
  `kind`; figures and outputs (request index -> (temperature, tokens))."""
  import httpx2 as httpx
  requests = FLAGS.requests if requests is None else requests
  sessions = [httpx.Client(base_url=url, timeout=600) for _ in range(clients)]
  latencies, outputs, errors = [], {}, 0
  tokens = steps = 0
  next_index = iter(range(requests))

  def client_loop(session):
    nonlocal errors, tokens, steps
    for i in next_index:  # Shared iterator: clients take the next request as they free up.
      prompt = prompts[i % len(prompts)]
      fields = request_settings(kind, i)
      start = time.perf_counter()
      r = session.post('/v1/completions', json=dict(model='mtp', prompt=prompt,
                                                     decoder=decoder, **fields))
      latencies.append(time.perf_counter() - start)
      if r.status_code != 200:
        errors += 1
        continue
      body = r.json()
      outputs[i] = (fields['temperature'], body['mtp']['tokens'])
      tokens += body['usage']['completion_tokens']
      steps += body['usage']['num_steps']

  before = compilations(url)
  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    list(pool.map(client_loop, sessions))
  wall = time.perf_counter() - start
  for s in sessions:
    s.close()
  latencies.sort()
  return dict(decoder=decoder, settings=kind, concurrency=clients, requests=requests,
              errors=errors, seconds=wall, completion_tokens=tokens,
              tokens_per_sec=tokens / wall,
              p50_latency_s=statistics.median(latencies),
              p99_latency_s=latencies[min(len(latencies) - 1,
                                          int(round(0.99 * (len(latencies) - 1))))],
              # The first token of each request comes from the prefill, not a step.
              tokens_per_step=(tokens - (requests - errors)) / max(steps, 1),
              compilations=compilations(url) - before, outputs=outputs)


def measure() -> dict:
  import mtp
  from mtp.serving import server
  unknown = [k for k in FLAGS.settings if k not in SETTINGS]
  if unknown or not FLAGS.settings:
    raise app.UsageError(f'--settings takes {", ".join(SETTINGS)}, got {FLAGS.settings}')
  loaded = mtp.load(FLAGS.workdir, dtype=FLAGS.dtype)
  prompts = prompts_for(loaded)
  lengths = [len(loaded.tokenizer.encode(p)) for p in prompts]
  print(f'{len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens, max_tokens '
        f'{FLAGS.max_tokens} (identical) or {FLAGS.mixed_min_tokens}-{FLAGS.mixed_max_tokens} '
        f'(mixed), {FLAGS.requests} requests per level', flush=True)
  levels = [int(c) for c in FLAGS.concurrency]
  rows = []
  decoders = list(dict.fromkeys(FLAGS.decoders + ['autoregressive']))
  with server.running(loaded, decoders=decoders, max_batch=FLAGS.max_batch,
                      max_wait_ms=FLAGS.max_wait_ms, max_queue=max(levels) * 4,
                      exact=FLAGS.exact, steps_per_chunk=FLAGS.steps_per_chunk
                      ) as (url, batcher):
    start = time.perf_counter()
    batcher.warm.wait()
    if batcher.startup_error is not None:
      raise RuntimeError('the server could not compile its decoders') from batcher.startup_error
    warm_seconds = time.perf_counter() - start
    warm = compilations(url)
    row_mapped = batcher.row_mapped
    print(f'server warm in {warm_seconds:.0f}s: {warm} programs compiled, rows '
          f'{"mapped one by one" if row_mapped else "in one shared batch"}', flush=True)
    for kind in FLAGS.settings:  # Untimed: the first requests' one-off costs (connections).
      for decoder in decoders:
        run_level(url, prompts, decoder, min(levels), kind, requests=min(levels))
    for clients in levels:
      for kind in FLAGS.settings:
        for decoder in decoders:
          row = run_level(url, prompts, decoder, clients, kind)
          rows.append(row)
          print(f'C={clients:>3} {kind:<9} {decoder:<15} {row["tokens_per_sec"]:>8.1f} '
                f'tokens/s  p50 {row["p50_latency_s"] * 1e3:>7.1f} ms  p99 '
                f'{row["p99_latency_s"] * 1e3:>7.1f} ms  {row["tokens_per_step"]:.2f} '
                f'tokens/step  errors {row["errors"]}  compilations {row["compilations"]}',
                flush=True)
    end = compilations(url)
  if end != warm:
    print(f'WARNING: the server compiled {end - warm} programs after its warm-up', flush=True)
  for clients in levels:
    for kind in FLAGS.settings:
      ar = next(r for r in rows if (r['concurrency'], r['settings'], r['decoder'])
                == (clients, kind, 'autoregressive'))
      greedy = [i for i, (temperature, _) in ar['outputs'].items() if temperature == 0]
      for spec in (r for r in rows if (r['concurrency'], r['settings']) == (clients, kind)
                   and r['decoder'] != 'autoregressive'):
        spec['speedup'] = spec['tokens_per_sec'] / ar['tokens_per_sec']
        spec['greedy_requests'] = len(greedy)
        spec['outputs_match_autoregressive'] = all(
            spec['outputs'].get(i) == ar['outputs'][i] for i in greedy)
  for row in rows:  # Lengths only in JSON.
    row['outputs'] = {i: len(t) for i, (_, t) in sorted(row['outputs'].items())}
  return dict(workdir=str(FLAGS.workdir), step=loaded.step,
              num_heads=loaded.model.cfg.mtp_num_heads, max_tokens=FLAGS.max_tokens,
              mixed=dict(temperatures=[float(t) for t in FLAGS.mixed_temperatures],
                         top_p=[float(p) for p in FLAGS.mixed_top_p],
                         max_tokens=[FLAGS.mixed_min_tokens, FLAGS.mixed_max_tokens]),
              max_batch=FLAGS.max_batch, max_wait_ms=FLAGS.max_wait_ms, exact=FLAGS.exact,
              row_mapped=row_mapped,
              steps_per_chunk=FLAGS.steps_per_chunk,
              prompt_tokens=[min(lengths), max(lengths)], warm_seconds=warm_seconds,
              compilations_after_warmup=warm, compilations_at_end=end, rows=rows)


def plot(result: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  from mtp import plotting
  fig, (ax_tps, ax_lat) = plt.subplots(1, 2, figsize=(12, 4.2))
  kinds = list(dict.fromkeys(r['settings'] for r in result['rows']))
  decoders = list(dict.fromkeys(r['decoder'] for r in result['rows']))
  for decoder, color in zip(decoders, ('tab:green', 'tab:blue', 'tab:orange', 'tab:red')):
    for kind, style in zip(kinds, ('-', ':')):
      rows = [r for r in result['rows'] if r['decoder'] == decoder and r['settings'] == kind]
      c = [r['concurrency'] for r in rows]
      label = f'{decoder}, {kind}'
      ax_tps.plot(c, [r['tokens_per_sec'] for r in rows], 'o' + style, color=color,
                  label=label)
      ax_lat.plot(c, [r['p50_latency_s'] for r in rows], 'o' + style, color=color,
                  label=f'{label} p50')
      ax_lat.plot(c, [r['p99_latency_s'] for r in rows], 's' + style, color=color, alpha=0.5,
                  label=f'{label} p99')
  name = pathlib.Path(result['workdir']).name
  ax_tps.set(xscale='log', xlabel='concurrent clients', ylabel='completion tokens/s',
             title=f'{name}: server throughput (max_batch {result["max_batch"]})')
  ax_lat.set(xscale='log', yscale='log', xlabel='concurrent clients',
             ylabel='request latency (s)', title=f'{name}: latency ({result["max_tokens"]} '
             'tokens per identical request)')
  for ax in (ax_tps, ax_lat):
    ax.legend(fontsize=7)
  plotting.save(fig, path)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  import launch
  from absl import logging
  launch.quiet_library_logs()
  logging.set_verbosity(logging.WARNING)
  start = time.perf_counter()
  result = measure()
  output = pathlib.Path(FLAGS.output)
  output.parent.mkdir(parents=True, exist_ok=True)
  output.write_text(json.dumps(result, indent=1))
  plot(result, pathlib.Path(FLAGS.plot))
  print(f'wrote {output} and {FLAGS.plot} ({time.perf_counter() - start:.0f}s)')


if __name__ == '__main__':
  app.run(main)
