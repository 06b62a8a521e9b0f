r"""The server under load: throughput and latency, speculative and autoregressive side by side.

  python -m benchmarks.serve_load [--workdir=workdirs/code_small] [--concurrency=1,8,32]

Starts `launch.serve`'s server in this process on a free localhost port, then for each
concurrency level C, with the two decoders taking turns (so machine load hits them alike):
C clients send `--requests` greedy, non-streamed completions of held-out code prompts (the
first lines of installed non-stdlib packages, at most `--prompt_tokens`, so one prompt-width
bucket), each waiting for its answer before sending the next. Reported per level and decoder:
completion tokens/s over the wall time, p50 and p99 request latency, tokens per verification
step, and whether every speculative completion equals the autoregressive one. Compilation is
excluded (the server compiles both decoders before the timed runs).

Writes results/serve_load.json and results/serve_load.png.
"""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import statistics
import time

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', 'workdirs/code_small', 'Trained workdir.')
flags.DEFINE_list('concurrency', ['1', '8', '32'], 'Concurrent clients, one level each.')
flags.DEFINE_integer('requests', 64, 'Requests per level and decoder.')
flags.DEFINE_integer('num_prompts', 16, 'Distinct prompts (requests cycle through them).')
flags.DEFINE_integer('prompt_tokens', 32, 'Prompts hold as many whole lines as fit.')
flags.DEFINE_integer('max_tokens', 64, 'max_tokens of every request.')
flags.DEFINE_integer('max_batch', 8, 'The server\'s --max_batch.')
flags.DEFINE_float('max_wait_ms', 5.0, 'The server\'s --max_wait_ms.')
flags.DEFINE_bool('exact', True, 'The server\'s --exact (row-mapped batches).')
flags.DEFINE_string('output', 'results/serve_load.json', 'JSON results.')
flags.DEFINE_string('plot', 'results/serve_load.png', 'Plot.')

DECODERS = ('speculative', 'autoregressive')


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


def run_level(url: str, prompts: list[str], decoder: str, clients: int) -> dict:
  """`FLAGS.requests` requests from `clients` closed-loop clients; figures and outputs."""
  import httpx2 as httpx
  sessions = [httpx.Client(base_url=url, timeout=600) for _ in range(clients)]
  latencies, outputs, errors = [], {}, 0
  tokens = steps = 0
  next_index = iter(range(FLAGS.requests))

  def client_loop(session):
    nonlocal errors, tokens, steps
    for i in next_index:  # Shared iterator: clients take the next request as they free up.
      prompt = prompts[i % len(prompts)]
      start = time.perf_counter()
      r = session.post('/v1/completions', json=dict(
          model='mtp', prompt=prompt, max_tokens=FLAGS.max_tokens, temperature=0,
          decoder=decoder))
      latencies.append(time.perf_counter() - start)
      if r.status_code != 200:
        errors += 1
        continue
      body = r.json()
      outputs[prompt] = body['mtp']['tokens']
      tokens += body['usage']['completion_tokens']
      steps += body['usage']['num_steps']

  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    list(pool.map(client_loop, sessions))
  wall = time.perf_counter() - start
  for s in sessions:
    s.close()
  latencies.sort()
  return dict(decoder=decoder, concurrency=clients, requests=FLAGS.requests, errors=errors,
              seconds=wall, completion_tokens=tokens, tokens_per_sec=tokens / wall,
              p50_latency_s=statistics.median(latencies),
              p99_latency_s=latencies[min(len(latencies) - 1,
                                          int(round(0.99 * (len(latencies) - 1))))],
              # The first token of each request comes from the prefill, not a step.
              tokens_per_step=(tokens - (FLAGS.requests - errors)) / max(steps, 1),
              outputs=outputs)


def measure() -> dict:
  import mtp
  from mtp.serving import server
  loaded = mtp.load(FLAGS.workdir)
  prompts = prompts_for(loaded)
  lengths = [len(loaded.tokenizer.encode(p)) for p in prompts]
  print(f'{len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens, max_tokens '
        f'{FLAGS.max_tokens}, {FLAGS.requests} requests per level', flush=True)
  levels = [int(c) for c in FLAGS.concurrency]
  rows = []
  with server.running(loaded, max_batch=FLAGS.max_batch, max_wait_ms=FLAGS.max_wait_ms,
                      max_queue=max(levels) * 4, exact=FLAGS.exact,
                      warmup=[(d, FLAGS.max_tokens) for d in DECODERS]) as (url, batcher):
    batcher.warm.wait()
    for decoder in DECODERS:  # Untimed: any remaining compilation (other prompt widths).
      run_level(url, prompts, decoder, min(levels))
    for clients in levels:
      for decoder in DECODERS:
        row = run_level(url, prompts, decoder, clients)
        rows.append(row)
        print(f'C={clients:>3} {decoder:<15} {row["tokens_per_sec"]:>8.1f} tokens/s  p50 '
              f'{row["p50_latency_s"] * 1e3:>7.1f} ms  p99 {row["p99_latency_s"] * 1e3:>7.1f} '
              f'ms  {row["tokens_per_step"]:.2f} tokens/step  errors {row["errors"]}',
              flush=True)
  for clients in levels:
    spec, ar = (next(r for r in rows if r['concurrency'] == clients and r['decoder'] == d)
                for d in DECODERS)
    spec['speedup'] = spec['tokens_per_sec'] / ar['tokens_per_sec']
    spec['outputs_match_autoregressive'] = spec['outputs'] == ar['outputs']
  for row in rows:
    row['outputs'] = {p: len(t) for p, t in row['outputs'].items()}  # Lengths only in JSON.
  return dict(workdir=str(FLAGS.workdir), step=loaded.step,
              num_heads=loaded.model.cfg.mtp_num_heads, max_tokens=FLAGS.max_tokens,
              max_batch=FLAGS.max_batch, max_wait_ms=FLAGS.max_wait_ms, exact=FLAGS.exact,
              prompt_tokens=[min(lengths), max(lengths)], rows=rows)


def plot(result: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, (ax_tps, ax_lat) = plt.subplots(1, 2, figsize=(12, 4.2))
  for decoder, color in zip(DECODERS, ('tab:blue', 'tab:orange')):
    rows = [r for r in result['rows'] if r['decoder'] == decoder]
    c = [r['concurrency'] for r in rows]
    ax_tps.plot(c, [r['tokens_per_sec'] for r in rows], 'o-', color=color, label=decoder)
    ax_lat.plot(c, [r['p50_latency_s'] for r in rows], 'o-', color=color, label=f'{decoder} p50')
    ax_lat.plot(c, [r['p99_latency_s'] for r in rows], 's--', color=color,
                label=f'{decoder} p99')
  name = pathlib.Path(result['workdir']).name
  ax_tps.set(xscale='log', xlabel='concurrent clients', ylabel='completion tokens/s',
             title=f'{name}: server throughput (max_batch {result["max_batch"]})')
  ax_lat.set(xscale='log', yscale='log', xlabel='concurrent clients',
             ylabel='request latency (s)', title=f'{name}: latency, {result["max_tokens"]} '
             'tokens per request')
  for ax in (ax_tps, ax_lat):
    ax.legend(fontsize=8)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


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
