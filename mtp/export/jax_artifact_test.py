"""--format=jax_export: the serialized generate function decodes exactly as its workdir."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import mtp
from mtp.decode import loop
from mtp.export import ExportError
from mtp.export import runtime
from mtp.export import writer
from mtp.train import testing
from mtp.train import trainer as trainer_lib

PROMPTS = ['def add(a, b):\n    return', 'import os\n', 'class Point:\n    def __init__(self']
M = 16  # The most tokens per call the artifact is exported for.
SAMPLED = dict(temperature=0.8, top_p=0.9)


@pytest.fixture(scope='module')
def workdir(tiny_workdir):
  """The session's tiny workdir: exporting it, and training heads on it, only read it."""
  return tiny_workdir


@pytest.fixture(scope='module')
def exported(workdir, tmp_path_factory):
  output = tmp_path_factory.mktemp('exports') / 'artifact'
  return output, writer.export(workdir, 'jax_export', output, max_new_tokens=M, **SAMPLED)


@pytest.fixture(scope='module')
def source(workdir):
  return mtp.load(workdir)


@pytest.fixture(scope='module')
def loaded(exported):
  """One load for the module: its programs compile once per shape."""
  return mtp.load(exported[0])


def _fields(generations):
  return [(g.tokens, g.num_steps, g.accepted_histogram, g.finish_reason) for g in generations]


def test_manifest_files_and_platforms(exported):
  output, summary = exported
  artifact = summary['jax_export']
  assert json.loads((output / 'export.json').read_text())['jax_export'] == artifact
  programs = {(p['decoder'], p['temperature']) for p in artifact['programs']}
  assert programs == {('autoregressive', 0.0), ('speculative', 0.0),
                      ('autoregressive', 0.8), ('speculative', 0.8)}
  assert 'cpu' in artifact['platforms']
  # cuda and tpu lower without their hardware: recorded either way.
  assert set(artifact['platforms']) | set(artifact['lowering_failures']) == {'cpu', 'cuda', 'tpu'}
  # Prompts come padded to whole prefill chunks (the runtime pads them): widths are multiples.
  assert artifact['shapes'] == {'batch': 'symbolic',
                                'prompt_width': f'symbolic, {loop.PREFILL_CHUNK} * k'}
  assert artifact['outputs'] == ['tokens', 'num_generated', 'num_steps', 'accepted_histogram',
                                 'reason']
  assert artifact['baked']['max_new_tokens'] == M and artifact['baked']['banned_ids'] == [0]
  # The parameters are arguments: no program holds a copy of any of them (a constant's bytes
  # are stored raw). Their size is no proxy: the programs are half the tiny model's size.
  from safetensors import numpy as safetensors_numpy  # pylint: disable=import-outside-toplevel
  params = safetensors_numpy.load_file(str(output / artifact['params']['file']))
  largest = sorted(params.values(), key=lambda a: a.size)[-3:]
  windows = [a.reshape(-1)[a.size // 2:a.size // 2 + 16].tobytes() for a in largest]
  for program in artifact['programs']:
    text = (output / program['file']).read_bytes()
    assert len(text) == program['bytes']
    assert not any(window in text for window in windows), program['file']
    assert program['prompt_chunk'] == loop.PREFILL_CHUNK
  assert (output / 'tokenizer.json').is_file() and (output / 'config.json').is_file()


def test_greedy_tokens_equal_the_workdirs(loaded, source):
  assert isinstance(loaded, runtime.LoadedArtifact) and loaded.step == source.step
  # M tokens, and fewer (a traced limit) in batches of 2 + 1.
  for decoder, n, batch_size in (('autoregressive', M, None), ('speculative', M, None),
                                 ('speculative', 7, 2)):
    want = mtp.generate(source, PROMPTS, max_new_tokens=n, decoder=decoder,
                        batch_size=batch_size)
    got = mtp.generate(loaded, PROMPTS, max_new_tokens=n, decoder=decoder,
                       batch_size=batch_size)
    assert _fields(got) == _fields(want), (decoder, n)
    assert [g.completion for g in got] == [g.completion for g in want]
    # The programs return why each row stopped: 'stop' at EOS (it was 'eos'), else 'length'.
    eos = loaded.tokenizer.eos_id
    assert [g.finish_reason for g in got] == [
        'stop' if g.tokens[-1] == eos else 'length' for g in got]


def test_sampled_tokens_equal_the_workdirs_for_the_same_seed(loaded, source):
  want = mtp.generate(source, PROMPTS, max_new_tokens=M, seed=3, decoder='speculative',
                      **SAMPLED)
  got = mtp.generate(loaded, PROMPTS, max_new_tokens=M, seed=3, decoder='speculative',
                     **SAMPLED)
  assert _fields(got) == _fields(want)
  # 'auto', the default, runs an artifact's speculative program (exported loops hold no
  # fallback to one-token steps).
  assert _fields(mtp.generate(loaded, PROMPTS, max_new_tokens=M, seed=3, **SAMPLED)) == (
      _fields(got))


@pytest.mark.parametrize('kind', [
    'workdir',
    'artifact'])
def test_sampled_tokens_do_not_depend_on_the_batch_size(loaded, source, kind):
  """Prompt i samples with its own key from the seed and i (`mtp.generate`), from a workdir
  and from its artifact alike: batches of 2 + 1 give the tokens one batch of 3 gives."""
  want = mtp.generate(source, PROMPTS, max_new_tokens=M, seed=3, decoder='speculative',
                      **SAMPLED)
  got = mtp.generate(source if kind == 'workdir' else loaded, PROMPTS, max_new_tokens=M, seed=3,
                     decoder='speculative', batch_size=2, **SAMPLED)
  assert [g.tokens for g in got] == [g.tokens for g in want]


_MISMATCH = runtime.ArtifactMismatchError


@pytest.mark.parametrize('kwargs,error,message', [
    (dict(temperature=0.5), _MISMATCH, 'holds no speculative program for temperature=0.5.*it '
     'serves autoregressive greedy; autoregressive temperature=0.8'),
    (dict(temperature=0.8, top_p=1.0), _MISMATCH, 'no speculative program for temperature=0.8'),
    (dict(max_new_tokens=M + 1), _MISMATCH, f'max_new_tokens {M + 1} exceeds the {M}'),
    (dict(tree='default'), _MISMATCH, 'is not the one .* was exported with'),
    (dict(tree='auto'), _MISMATCH, "tree='auto' cannot be used with an exported artifact"),
    (dict(lookup=3), _MISMATCH, 'lookup=3: .* drafts 0 tokens by prompt lookup'),
    (dict(decoder='autoregressive', tree='chain'), ValueError, 'tree and lookup apply to the '
     r"drafting decoders \(auto, speculative\) only, not to 'autoregressive'"),
    (dict(decoder='autoregressive', lookup=3), ValueError, 'apply to the drafting decoders'),
    (dict(prompts=['x' * 253]), ValueError, 'max_seq_len'),
    (dict(decoder='beam'), ValueError, 'decoder must be one of'),
])
def test_requests_it_cannot_serve_are_named(loaded, kwargs, error, message):
  kwargs = dict(dict(prompts=PROMPTS[:1], max_new_tokens=4), **kwargs)
  with pytest.raises(error, match=message):
    mtp.generate(loaded, **kwargs)


def test_its_own_tree_named_is_served(loaded, source):
  want = mtp.generate(source, PROMPTS, max_new_tokens=M, decoder='speculative')
  got = mtp.generate(loaded, PROMPTS, max_new_tokens=M, tree='chain')
  assert _fields(got) == _fields(want)


def test_heads_of_another_family_on_a_frozen_base(workdir, tmp_path):
  """Sequential heads (their own KV-cache layers) trained on the workdir's frozen trunk: the
  export merges the two, and decodes as the heads workdir does."""
  heads = tmp_path / 'heads'
  config = testing.tiny_config(**{'init_from': str(workdir), 'optim.mode': 'frozen_trunk',
                                  'model.mtp_head_type': 'sequential', 'model.mtp_num_heads': 2,
                                  'num_train_steps': 1, 'eval_steps': 0})
  trainer_lib.train_and_evaluate(config, heads)
  writer.export(heads, 'jax_export', tmp_path / 'artifact', max_new_tokens=M, platforms=['cpu'])
  want = mtp.generate(mtp.load(heads), PROMPTS, max_new_tokens=M, decoder='speculative')
  got = mtp.generate(mtp.load(tmp_path / 'artifact'), PROMPTS, max_new_tokens=M)
  assert _fields(got) == _fields(want)
  assert len(got[0].accepted_histogram) == 2 + 2  # Two sequential heads drafted.


def test_bfloat16_decodes_as_the_bfloat16_params_export(workdir, tmp_path):
  writer.export(workdir, 'params', tmp_path / 'params', dtype='bfloat16')
  writer.export(workdir, 'jax_export', tmp_path / 'artifact', dtype='bfloat16',
                max_new_tokens=M, platforms=['cpu'])
  loaded = mtp.load(tmp_path / 'artifact')
  assert {str(a.dtype) for a in loaded.params.values()} == {'bfloat16'}
  want = mtp.generate(mtp.load(tmp_path / 'params'), PROMPTS, max_new_tokens=M,
                      decoder='autoregressive')
  got = mtp.generate(loaded, PROMPTS, max_new_tokens=M)
  assert [g.tokens for g in got] == [g.tokens for g in want]


def test_an_export_is_not_a_workdir_to_export(exported, tmp_path):
  with pytest.raises(ExportError, match='is a jax_export export, not a workdir'):
    writer.export(exported[0], 'params', tmp_path / 'again')


_WITHOUT_MODEL_CODE = textwrap.dedent('''
    import json, sys
    import numpy as np
    from mtp.export import runtime
    artifact, expected = runtime.load(sys.argv[1]), json.loads(sys.argv[2])
    program = artifact.program('speculative')
    tokens = [artifact.tokenizer.encode(p) for p in expected['prompts']]
    width = max(map(len, tokens))
    prompts = np.array([t + [0] * (width - len(t)) for t in tokens], np.int32)
    out = program.run(artifact.params, prompts, np.array([len(t) for t in tokens]),
                      key=artifact.key(0), max_new_tokens=expected['n'],
                      eos_id=artifact.tokenizer.eos_id, pad_id=artifact.tokenizer.pad_id)
    got = [out.tokens[i, :out.num_generated[i]].tolist() for i in range(len(tokens))]
    assert got == expected['tokens'], (got, expected['tokens'])
    loaded = sorted(m for m in sys.modules if m.startswith((
        'mtp.model', 'mtp.decode.loop', 'mtp.decode.engine', 'mtp.decode.plan',
        'mtp.decode.drafters', 'flax')))
    assert not loaded, loaded
    print('ok', artifact.load_seconds, program.first_call_seconds)
''')


def test_runs_without_the_model_code(exported, source):
  """A fresh process loads the runtime alone: no model, no decode loop, no Flax."""
  tokens = [g.tokens for g in mtp.generate(source, PROMPTS, max_new_tokens=M)]
  run = subprocess.run(
      [sys.executable, '-c', _WITHOUT_MODEL_CODE, str(exported[0]),
       json.dumps({'prompts': PROMPTS, 'tokens': tokens, 'n': M})],
      env=dict(os.environ, JAX_PLATFORMS='cpu'), capture_output=True, text=True, timeout=300,
      cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
  assert run.returncode == 0 and run.stdout.startswith('ok'), run.stderr[-3000:]
