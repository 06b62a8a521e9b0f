r"""Streaming memory against corpus size, and launch.prepare_data throughput.

  python -m benchmarks.stream_memory [--scales=1,10] [--batches=500] [--workdir=/tmp/...]

For each scale k it writes a JSONL corpus holding every standard-library file k times (copy j
starts with a `# copy j` line, so no two documents are equal and the valid split hashes each
copy on its own), prepares it (byte tokenizer, every CPU), then streams `--batches` global
batches of configs/base.py's shape (16 x 256) from it in a fresh process and records that
process's peak RSS (`resource.getrusage`, after the imports and at the end). The in-memory
pipeline on the 1x corpus is measured the same way, for reference. It also times
`prepare_data` on the stdlib directory itself with the byte tokenizer and with BPE. Prints a
table and writes results/stream_memory.json.
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import subprocess
import sys
import time

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_list('scales', ['1', '10'], 'Corpus sizes, in copies of the standard library.')
flags.DEFINE_integer('batches', 500, 'Global batches streamed per measurement.')
flags.DEFINE_integer('seq_len', 256, 'Row length.')
flags.DEFINE_integer('batch_size', 16, 'Global batch.')
flags.DEFINE_integer('bpe_vocab_size', 4096, 'Vocabulary of the BPE throughput run.')
flags.DEFINE_string('workdir', '/tmp/mtp_stream_memory', 'Corpora and datasets go here.')
flags.DEFINE_string('output', 'results/stream_memory.json', 'Where to write the figures.')
flags.DEFINE_string('measure', '', 'Internal: stream from this dataset (or "memory") and print '
                    'the figures as JSON.')


def _peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB.


def write_corpus(path: pathlib.Path, copies: int) -> int:
  """A JSONL of the stdlib files, each `copies` times; returns its size in bytes."""
  from mtp.data import corpora  # pylint: disable=g-import-not-at-top
  root = corpora.stdlib_root()
  reader = corpora.TextReader()
  with path.open('w', encoding='utf-8') as f:
    for copy in range(copies):
      for file in corpora.stdlib_files():
        text = reader.read(file)
        if text is not None:
          name = file.relative_to(root).as_posix()
          f.write(json.dumps({'text': f'# copy {copy}\n{text}', 'id': f'{name}#{copy}'}) + '\n')
  return path.stat().st_size


def measure(source: str) -> dict:
  """Streams FLAGS.batches batches from a dataset (or the in-memory 1x stdlib) in this process."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from mtp.data import pipeline  # pylint: disable=g-import-not-at-top
  from mtp.data import shards  # pylint: disable=g-import-not-at-top
  from mtp.data import streaming  # pylint: disable=g-import-not-at-top
  from mtp.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  start_rss = _peak_rss_mb()
  start = time.perf_counter()
  if source == 'memory':
    import ml_collections  # pylint: disable=g-import-not-at-top
    config = ml_collections.ConfigDict(dict(
        corpus='stdlib', extensions=('.py',), valid_fraction=0.05, seq_len=FLAGS.seq_len,
        max_corpus_bytes=-1))
    cache = pathlib.Path(FLAGS.workdir) / 'memory_cache'
    rows = pipeline.load_or_build_split(config, tokenizer_lib.byte_tokenizer(), 'train', cache)
    num_tokens = int(rows['tokens'].size)
    prefetch = 0
  else:
    dataset = shards.open_dataset(source)
    rows = streaming.split_rows(dataset, 'train', FLAGS.seq_len, dataset.tokenizer())
    num_tokens = rows.num_rows * FLAGS.seq_len
    prefetch = 2
  ready = time.perf_counter()
  iterator = pipeline.make_train_iterator(rows, FLAGS.batch_size, 0, prefetch=prefetch)
  checksum = 0
  for _ in range(FLAGS.batches):
    checksum += int(np.sum(next(iterator)['tokens'][:, 0]))
  seconds = time.perf_counter() - ready
  return {'source': source, 'train_tokens': num_tokens, 'rss_after_imports_mb': start_rss,
          'peak_rss_mb': _peak_rss_mb(), 'open_seconds': ready - start,
          'batches': FLAGS.batches,
          'stream_tokens_per_sec': FLAGS.batches * FLAGS.batch_size * FLAGS.seq_len / seconds,
          'checksum': checksum}


def _measure_in_subprocess(source: str) -> dict:
  args = [sys.executable, '-m', 'benchmarks.stream_memory', f'--measure={source}',
          f'--batches={FLAGS.batches}', f'--seq_len={FLAGS.seq_len}',
          f'--batch_size={FLAGS.batch_size}', f'--workdir={FLAGS.workdir}']
  out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def main(argv):
  del argv
  if FLAGS.measure:
    print(json.dumps(measure(FLAGS.measure)))
    return
  from mtp.data import prepare  # pylint: disable=g-import-not-at-top
  workdir = pathlib.Path(FLAGS.workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  results: dict = {'cpus': os.cpu_count(), 'seq_len': FLAGS.seq_len,
                   'batch_size': FLAGS.batch_size, 'batches': FLAGS.batches,
                   'prepare': [], 'stream': []}
  for tokenizer in ('byte', 'bpe'):
    started = time.perf_counter()
    prepared = prepare.prepare('stdlib', workdir / f'stdlib_{tokenizer}', tokenizer=tokenizer,
                               vocab_size=FLAGS.bpe_vocab_size, overwrite=True)
    results['prepare'].append({
        'source': 'stdlib', 'tokenizer': tokenizer, 'num_tokens': prepared['num_tokens'],
        'tokenize_seconds': prepared['stats']['seconds'],
        'tokens_per_sec': prepared['stats']['tokens_per_sec'],
        'total_seconds': time.perf_counter() - started,  # BPE training included.
        'num_workers': prepared['stats']['num_workers']})
  for scale in map(int, FLAGS.scales):
    corpus = workdir / f'stdlib_x{scale}.jsonl'
    size = write_corpus(corpus, scale)
    prepared = prepare.prepare(str(corpus), workdir / f'x{scale}', id_field='id',
                               overwrite=True)
    corpus.unlink()
    results['prepare'].append({
        'source': f'stdlib x{scale} (JSONL)', 'tokenizer': 'byte', 'corpus_bytes': size,
        'num_tokens': prepared['num_tokens'], 'tokenize_seconds': prepared['stats']['seconds'],
        'tokens_per_sec': prepared['stats']['tokens_per_sec'],
        'num_workers': prepared['stats']['num_workers']})
    results['stream'].append({'scale': scale, **_measure_in_subprocess(str(workdir /
                                                                             f'x{scale}'))})
  results['stream'].append({'scale': 1, 'in_memory': True, **_measure_in_subprocess('memory')})

  print(f'{"corpus":<28}{"train tokens":>14}{"peak RSS MB":>13}{"after imports":>15}'
        f'{"tokens/s":>12}')
  for row in results['stream']:
    name = f'stdlib x{row["scale"]}' + (' in memory' if row.get('in_memory') else ' streamed')
    print(f'{name:<28}{row["train_tokens"]:>14,}{row["peak_rss_mb"]:>13.0f}'
          f'{row["rss_after_imports_mb"]:>15.0f}{row["stream_tokens_per_sec"]:>12,.0f}')
  print(f'\n{"prepare_data":<28}{"tokens":>14}{"tokens/s":>13}{"workers":>9}')
  for row in results['prepare']:
    name = f'{row["source"]} {row["tokenizer"]}'
    print(f'{name:<28}{row["num_tokens"]:>14,}{row["tokens_per_sec"]:>13,.0f}'
          f'{row["num_workers"]:>9}')
  output = pathlib.Path(FLAGS.output)
  output.parent.mkdir(parents=True, exist_ok=True)
  output.write_text(json.dumps(results, indent=2) + '\n')


if __name__ == '__main__':
  app.run(main)
