r"""Per-request settings on a real server: what the engine promises, checked on a trained model.

  python -m benchmarks.serve_checks [--workdir=workdirs/code_small] [--requests=200]

Starts the server in this process (`mtp.serving.server.running`, the default decoder `auto`,
`--exact`), warms it, then:
  1. compilations: `--requests` completions with mixed settings, `--concurrency` at a time, each
     drawing its temperature (0, 0.3, 0.7, 1.0), top_p (0.9, 1), top_k (0, 20), max_tokens
     (16-128), seed, stream and decoder; `mtp_compilations_total` (/metrics) before and after:
     it must not move;
  2. seeds: one request at temperature 0.8 with a fixed seed, sent alone, then again among
     `--crowd` others sent at the same moment with other settings: the same tokens;
  3. logprobs: `--logprob_prompts` held-out prompts, greedy, `logprobs=5`, through the
     speculative and the autoregressive decoders: the same tokens, and the largest difference
     between their log-probabilities.
Prints each figure and writes results/serve_checks.json.
"""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import random
import time

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', 'workdirs/code_small', 'Trained workdir.')
flags.DEFINE_integer('requests', 200, 'Mixed requests for the compilation counter.')
flags.DEFINE_integer('concurrency', 16, 'Requests in flight at once.')
flags.DEFINE_integer('crowd', 31, 'Other requests around the seeded one.')
flags.DEFINE_integer('logprob_prompts', 16, 'Prompts of the logprobs check.')
flags.DEFINE_integer('max_batch', 8, 'The server\'s --max_batch.')
flags.DEFINE_enum('dtype', None, ['float32', 'bfloat16'], 'The server\'s --dtype (None: the '
                  'workdir\'s).')
flags.DEFINE_string('output', 'results/serve_checks.json', 'JSON results.')


def _prompts(loaded, n: int) -> list[str]:
  from mtp.data import corpora
  from mtp.decode import calibration
  return calibration.code_prompts(corpora.heldout_files(), loaded.tokenizer, n,
                                  max_tokens=48, min_tokens=8)


def _compilations(url: str) -> float:
  import httpx2 as httpx
  text = httpx.get(url + '/metrics', timeout=30).text
  return float(next(line.split()[1] for line in text.splitlines()
                    if line.startswith('mtp_compilations_total ')))


def run(workdir: str, *, requests: int, concurrency: int, crowd: int, logprob_prompts: int,
        max_batch: int, dtype: str | None = None) -> dict:
  import httpx2 as httpx
  import numpy as np
  import openai
  import mtp
  from mtp.serving import server
  loaded = mtp.load(workdir, dtype=dtype)
  prompts = _prompts(loaded, max(logprob_prompts, 8))
  out = {'workdir': workdir, 'dtype': dtype}
  with server.running(loaded, max_batch=max_batch, max_wait_ms=5) as (url, batcher):
    if not batcher.warm.wait(1800) or batcher.startup_error is not None:
      raise RuntimeError(f'the server did not warm up: {batcher.startup_error}')
    out['row_mapped'] = batcher.row_mapped
    client = openai.OpenAI(base_url=url + '/v1', api_key='unused', max_retries=0, timeout=600)
    draw = random.Random(0)

    def body(i):
      return {'prompt': prompts[i % len(prompts)], 'max_tokens': draw.randint(16, 128),
              'temperature': draw.choice([0, 0.3, 0.7, 1.0]), 'top_p': draw.choice([0.9, 1]),
              'top_k': draw.choice([0, 20]), 'seed': draw.randint(0, 2 ** 32),
              'stream': draw.random() < 0.25, 'decoder': draw.choice(batcher.decoders)}

    bodies = [body(i) for i in range(requests)]
    before = _compilations(url)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
      codes = list(pool.map(lambda b: httpx.post(url + '/v1/completions', json=b,
                                                 timeout=600).status_code, bodies))
    out['compilations'] = {'requests': requests, 'ok': codes.count(200),
                           'seconds': round(time.perf_counter() - start, 2),
                           'before': before, 'after': _compilations(url)}

    seeded = dict(model='m', prompt=prompts[0], max_tokens=64, temperature=0.8, seed=424242)
    alone = client.completions.create(**seeded).model_extra['mtp']['tokens']
    with concurrent.futures.ThreadPoolExecutor(crowd + 1) as pool:
      others = [pool.submit(httpx.post, url + '/v1/completions', timeout=600,
                            json=body(10_000 + i)) for i in range(crowd)]
      among = pool.submit(client.completions.create, **seeded)
      among = among.result().model_extra['mtp']['tokens']
      codes = [f.result().status_code for f in others]
    out['seeds'] = {'alone': alone, 'among': among, 'identical': alone == among,
                    'crowd_ok': codes.count(200), 'crowd': crowd}

    diffs, same = [], True
    for prompt in prompts[:logprob_prompts]:
      answers = [client.completions.create(model='m', prompt=prompt, max_tokens=32,
                                           temperature=0, logprobs=5,
                                           extra_body={'decoder': decoder})
                 for decoder in ('speculative', 'autoregressive')]
      tokens = [a.model_extra['mtp']['tokens'] for a in answers]
      same &= tokens[0] == tokens[1]
      values = [np.asarray(a.choices[0].logprobs.token_logprobs) for a in answers]
      diffs.append(float(np.max(np.abs(values[0] - values[1]))))
    out['logprobs'] = {'prompts': logprob_prompts, 'same_tokens': bool(same),
                       'max_abs_difference': max(diffs)}
  return out


def main(argv):
  del argv
  out = run(FLAGS.workdir, requests=FLAGS.requests, concurrency=FLAGS.concurrency,
            crowd=FLAGS.crowd, logprob_prompts=FLAGS.logprob_prompts,
            max_batch=FLAGS.max_batch, dtype=FLAGS.dtype)
  c, s, lp = out['compilations'], out['seeds'], out['logprobs']
  print(f'rows {"mapped one by one" if out["row_mapped"] else "in one shared batch"}')
  print(f'compilations: {c["before"]:.0f} before and {c["after"]:.0f} after {c["requests"]} '
        f'mixed requests ({c["ok"]} ok, {c["seconds"]} s)')
  print(f'seeds: the seeded request alone and among {s["crowd"]} others: '
        f'{"identical" if s["identical"] else "DIFFERENT"} ({len(s["alone"])} tokens)')
  print(f'logprobs: {lp["prompts"]} prompts, speculative against autoregressive: same tokens '
        f'{lp["same_tokens"]}, largest difference {lp["max_abs_difference"]:.2e}')
  path = pathlib.Path(FLAGS.output)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(out, indent=1))


if __name__ == '__main__':
  app.run(main)
