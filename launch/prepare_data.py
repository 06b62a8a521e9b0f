r"""Tokenizes a corpus once into sharded ArrayRecord files that training streams.

  python -m launch.prepare_data --source=stdlib --tokenizer=bpe --output=data/stdlib
  python -m launch.prepare_data --source=corpus.jsonl --text_field=content --output=data/c
  python -m launch.prepare_data --source='dumps/*.parquet' --tokenizer=workdirs/run --output=d
  python -m launch.train --config=configs/tiny.py --workdir=W --config.data.source=data/stdlib

--source is a directory of text or code files (--extensions), `stdlib`, a .jsonl or .parquet file,
or a glob of them. --tokenizer is `byte`, `bpe` (trained on the source's train split, --vocab_size
ids) or a directory with a tokenizer.json (a workdir or another dataset). The output holds train/
and valid/ shards, tokenizer.json and manifest.json (mtp/data/shards.py); it appears only when
complete. --output (and --tokenizer) may be on Cloud Storage (`gs://`, with the `gcs` extra
installed); --source is read from local files. A directory source reads only the files --extensions
names (default .py): the others are counted in a warning. While it runs the output is locked
(`<output>.lock`): a second run on it is refused. Failures print one line and exit with 1 (2 for bad
flags).
"""

import json
import sys

from absl import app
from absl import flags

from launch import cli
from mtp.data import prepare as prepare_lib

FLAGS = flags.FLAGS
flags.DEFINE_string('source', None, 'A directory, stdlib, a .jsonl / .parquet file or a glob.')
flags.DEFINE_string('output', None, 'The dataset directory to write (local or gs://).')
flags.DEFINE_string('text_field', 'text', 'JSONL field / Parquet column holding the text.')
flags.DEFINE_string('id_field', '', 'Record field the valid split hashes (default: the text).')
flags.DEFINE_list('extensions', ['.py'], 'File suffixes read from a directory source, e.g. '
                  '.py,.md,.txt; files with other suffixes are skipped (a warning counts them).')
flags.DEFINE_string('tokenizer', 'byte', "'byte', 'bpe', or a directory with a tokenizer.json.")
flags.DEFINE_integer('vocab_size', 4096, 'BPE vocabulary size (--tokenizer=bpe).')
flags.DEFINE_integer('bpe_sample_bytes', prepare_lib.DEFAULT_BPE_SAMPLE_BYTES,
                     'At most this much train text trains the BPE tokenizer.')
flags.DEFINE_float('valid_fraction', 0.05, 'Share of documents held out, by a hash of each.')
flags.DEFINE_integer('num_workers', 0, 'Tokenizing processes; 0: one per CPU.')
flags.DEFINE_integer('shard_tokens', prepare_lib.DEFAULT_SHARD_TOKENS,
                     'Tokens per shard (a shard closes at the document that reaches it).')
flags.DEFINE_bool('overwrite', False, 'Replace an existing dataset at --output.')
flags.mark_flags_as_required(['source', 'output'])


def main(argv):
  cli.begin(argv, warnings_only=True)
  with cli.UserErrors('launch.prepare_data'):
    result = prepare_lib.prepare(
        FLAGS.source, FLAGS.output, tokenizer=FLAGS.tokenizer, vocab_size=FLAGS.vocab_size,
        text_field=FLAGS.text_field, id_field=FLAGS.id_field,
        extensions=tuple(FLAGS.extensions), valid_fraction=FLAGS.valid_fraction,
        num_workers=FLAGS.num_workers, shard_tokens=FLAGS.shard_tokens,
        bpe_sample_bytes=FLAGS.bpe_sample_bytes, overwrite=FLAGS.overwrite)
  splits = result['splits']
  stats = result['stats']
  print(json.dumps({'output': FLAGS.output, 'tokenizer': result['tokenizer']['kind'],
                    'vocab_size': result['tokenizer']['vocab_size'],
                    **{f'{s}_{k}': splits[s][k] for s in splits
                       for k in ('num_documents', 'num_tokens')},
                    'num_shards': sum(len(s['shards']) for s in splits.values()),
                    'seconds': round(stats['seconds'], 2),
                    'tokens_per_sec': round(stats['tokens_per_sec']),
                    'num_workers': stats['num_workers']}))
  print(f'Train on it: python -m launch.train --config=configs/tiny.py --workdir=WORKDIR '
        f'--config.data.source={FLAGS.output}', file=sys.stderr)


if __name__ == '__main__':
  app.run(main, flags_parser=cli.flags_parser('launch.prepare_data'))
