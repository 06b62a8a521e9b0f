"""launch.generate end to end on a tiny model trained for 2 steps."""

import json
import re

import pytest
from absl import flags
from absl.testing import flagsaver

from launch import generate

FLAGS = flags.FLAGS
PROMPTS = ['def add(a, b):\n', 'import os\nimport sys\n', 'x = [']


@pytest.fixture(scope='module')
def workdir(tiny_workdir):
  return tiny_workdir


def _run(argv):
  FLAGS.unparse_flags()
  FLAGS(['generate'] + argv)
  generate.main(['generate'])


def _read(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


@flagsaver.flagsaver
def test_prompt_file_both_decoders_same_greedy_output(workdir, tmp_path):
  prompt_file = tmp_path / 'prompts.jsonl'
  prompt_file.write_text(''.join(json.dumps({'prompt': p}) + '\n' for p in PROMPTS) + '\n')
  outputs = {}
  for decoder in ('autoregressive', 'speculative'):
    outputs[decoder] = tmp_path / f'{decoder}.jsonl'
    _run([f'--workdir={workdir}', f'--prompt_file={prompt_file}', '--max_new_tokens=10',
          f'--decoder={decoder}', '--batch_size=2', f'--output={outputs[decoder]}'])
  ar, spec = _read(outputs['autoregressive']), _read(outputs['speculative'])
  assert [r['prompt'] for r in spec] == PROMPTS
  assert [r['tokens'] for r in spec] == [r['tokens'] for r in ar]
  for record in spec:
    for key in ('completion', 'num_steps', 'mean_accepted', 'tokens_per_sec',
                'accepted_histogram'):
      assert key in record
    assert record['tokens_per_sec'] > 0
    assert 1 <= len(record['tokens']) <= 10


@flagsaver.flagsaver
def test_stream_prints_the_completion(workdir, tmp_path, capsys):
  out = tmp_path / 'out.jsonl'
  _run([f'--workdir={workdir}', '--prompt=def f(x):', '--max_new_tokens=12', '--stream',
        '--steps_per_chunk=1', '--tree=[[0], [1], [0, 0]]', '--draft_vocab=32',
        f'--output={out}'])
  [record] = _read(out)
  printed = capsys.readouterr().out
  assert printed == f'=== prompt 0 ===\ndef f(x):{record["completion"]}\n'


@flagsaver.flagsaver
def test_stream_labels_every_prompt_at_batch_size_above_one(workdir, tmp_path, capsys):
  prompt_file = tmp_path / 'prompts.jsonl'
  prompt_file.write_text(''.join(json.dumps({'prompt': p}) + '\n' for p in PROMPTS))
  out = tmp_path / 'out.jsonl'
  _run([f'--workdir={workdir}', f'--prompt_file={prompt_file}', '--max_new_tokens=6',
        '--stream', '--batch_size=2', f'--output={out}'])
  records = _read(out)
  printed = capsys.readouterr().out
  # Each prompt under its own header, numbered as the output rows are ordered.
  assert printed == ''.join(f'=== prompt {i} ===\n{r["prompt"]}{r["completion"]}\n'
                            for i, r in enumerate(records))
  assert [r['prompt'] for r in records] == PROMPTS


def test_printer_keeps_prompts_in_order():
  lines = []

  class Out:
    write = lines.append

    def flush(self):
      pass

  printer = generate.OrderedPrinter(['a', 'b'], Out())
  printer(1, 'B1', False)  # Prompt 1's text waits for prompt 0 to finish.
  printer(0, 'A1', False)
  printer(1, 'B2', True)
  printer(0, 'A2', True)
  assert ''.join(lines) == '=== prompt 0 ===\naA1A2\n=== prompt 1 ===\nbB1B2\n'


def test_malformed_prompt_file_names_the_line(tmp_path):
  path = tmp_path / 'bad.jsonl'
  path.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
  with pytest.raises(ValueError, match=r'bad.jsonl:2: expected an object with a "prompt"'):
    generate.read_prompt_file(path)
  path.write_text('{"prompt": "ok"}\n\n{"prompt": "unterminated\n')
  with pytest.raises(ValueError, match=r'bad.jsonl:3: not valid JSON'):
    generate.read_prompt_file(path)


def test_tree_flag_parsing():
  assert generate.trees.parse(None) is None
  assert generate.trees.parse('auto') == 'auto'
  assert generate.trees.parse('dynamic') == 'dynamic'
  assert generate.trees.parse('[[0], [0, 1]]') == [(0,), (0, 1)]
  with pytest.raises(ValueError, match='JSON choices'):
    generate.trees.parse('bushy')


def test_non_utf8_prompt_file_names_the_line(tmp_path):
  path = tmp_path / 'latin1.jsonl'
  path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
  with pytest.raises(ValueError, match=r'latin1.jsonl:2: not UTF-8 text \(byte 0xe9'):
    generate.read_prompt_file(path)


def test_a_prompt_file_with_a_bom_and_crlf_line_ends_reads(tmp_path):
  path = tmp_path / 'windows.jsonl'
  path.write_bytes(b'\xef\xbb\xbf{"prompt": "def f():"}\r\n\r\n{"prompt": "caf\xc3\xa9"}\r\n')
  assert generate.read_prompt_file(path) == ['def f():', 'caf\u00e9']
  path.write_bytes(b'\xef\xbb\xbf\r\n{"prompt": "x"}\r\n{"prompt": "\xef\xbb\xbfkept"}')
  assert generate.read_prompt_file(path) == ['x', '\ufeffkept']  # Only the file's own BOM.


@pytest.mark.parametrize('argv,message', [
    # The output is checked before anything is decoded (the workdir does not even exist).
    (['--workdir=/nonexistent', '--prompt=x', '--output={tmp}/a_file/out.jsonl'],
     'launch.generate: .*a_file'),
    (['--workdir={workdir}', '--prompt=x', '--tree=[[0], [99999999999]]'],
     r'launch.generate: tree path \[99999999999\] has rank 99999999999 outside'),
    (['--workdir={workdir}', '--prompt=x', '--tree=[[0.5]]'],
     'launch.generate: tree path .* not an integer: 0.5'),
    (['--workdir={workdir}', '--prompt=x', '--lookup=65'],
     r'launch.generate: lookup \(--lookup\) must be at most 64'),
    (['--workdir={workdir}', '--prompt=x', '--lookup=65', '--decoder=autoregressive'],
     r'launch.generate: lookup \(--lookup\) must be at most 64'),
    (['--workdir={tmp}', '--prompt=x'], 'launch.generate: .*config.json does not exist'),
    (['--workdir={workdir}', '--prompt=x', '--draft_vocab=100000'],
     r'launch.generate: draft_vocab \(--draft_vocab\) must be an integer in \[0, 264\]'),
    (['--workdir={workdir}', '--prompt=x', '--draft_vocab=8', '--decoder=autoregressive'],
     r"launch.generate: draft_vocab \(--draft_vocab\) applies to decoders whose heads draft"),
])
@flagsaver.flagsaver
def test_errors_are_one_line_and_exit_non_zero(workdir, tmp_path, capsys, monkeypatch, argv,
                                               message):
  monkeypatch.delenv('MTP_TRACEBACK', raising=False)
  (tmp_path / 'a_file').write_text('not a directory')
  argv = [a.format(tmp=tmp_path, workdir=workdir) for a in argv]
  with pytest.raises(SystemExit) as exit_info:
    _run(argv)
  assert isinstance(exit_info.value.code, str)  # absl prints it to stderr and exits with 1.
  assert re.match(message, exit_info.value.code), exit_info.value.code
  assert '\n' not in exit_info.value.code and 'Traceback' not in capsys.readouterr().err
  assert not list(tmp_path.glob('a_file*/**/*.tmp'))


@flagsaver.flagsaver
def test_output_is_written_whole_or_not_at_all(workdir, tmp_path):
  out = tmp_path / 'deep' / 'out.jsonl'
  with pytest.raises(SystemExit):  # Fails after the output was checked: nothing is left.
    _run([f'--workdir={workdir}', '--prompt=x', f'--output={out}', '--temperature=-1'])
  assert not out.exists()


@flagsaver.flagsaver
def test_export_directories_decode_like_their_workdir(workdir, tmp_path, capsys):
  from mtp.export import writer
  writer.export(workdir, 'params', tmp_path / 'params')
  writer.export(workdir, 'jax_export', tmp_path / 'artifact', max_new_tokens=10)
  tokens = {}
  for name, directory in (('source', workdir), ('params', tmp_path / 'params'),
                          ('artifact', tmp_path / 'artifact')):
    out = tmp_path / f'{name}.jsonl'
    _run([f'--workdir={directory}', f'--prompt={PROMPTS[0]}', '--max_new_tokens=10',
          f'--output={out}'])
    tokens[name] = [r['tokens'] for r in _read(out)]
  assert tokens['params'] == tokens['source'] == tokens['artifact']
  assert 'jax_export artifact: loaded in' in capsys.readouterr().err
