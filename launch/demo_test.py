"""`python -m launch.demo` as the README runs it, on the tiny config: train, evaluate on
held-out code, plot, and decode with each decoder (the demo exits 1 if their outputs differ)."""

import re
import subprocess
import sys

from absl import flags
from absl.testing import flagsaver
import pytest

from configs import tiny
from launch import cli
from launch import demo
from mtp import testing as mtp_testing
from mtp.checkpoint import checkpointing
from mtp.checkpoint import workdir_lock
from mtp.train import divergence
from mtp.train import preemption
from mtp.train import trainer


def _demo(tmp_path, *flags_):
  env = mtp_testing.child_env(JAX_PLATFORMS='cpu')  # One device, as a user's machine.
  env['MTP_CACHE_DIR'] = str(tmp_path / 'cache')  # 'auto' measures its break-even there.
  run = subprocess.run(
      [sys.executable, '-m', 'launch.demo', '--config=configs/tiny.py',
       f'--workdir={tmp_path / "wd"}', '--config.num_train_steps=2', '--config.eval_steps=0',
       '--heldout_batches=1', '--decode_prompts=2', '--decode_tokens=8',
       # 2 steps read 16 rows: a 40 kB corpus (625 rows) keeps a frozen trunk's pass over them
       # to 2 s, not 20 s for the config's 400 kB.
       '--config.data.max_corpus_bytes=40000', *flags_],
      env=env, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  assert 'Held-out code' in run.stdout
  assert (tmp_path / 'wd' / 'learning_curve.png').stat().st_size > 0
  # Where the minutes went, the decoding's split into tokens and the rest.
  took = r'(?:\d+ min )?\d+ s'
  assert re.search(rf'== Done in {took}: (start-up {took}, )?training {took}, held-out '
                   rf'evaluation {took}, decoding {took} \({took} of it making tokens; the rest '
                   'compiled', run.stdout), run.stdout[-1000:]
  return run.stdout


def test_the_demo_runs_end_to_end_on_a_tiny_config(tmp_path):
  """From scratch, decoded in bfloat16 (trained in float32): exact there too."""
  out = _demo(tmp_path, '--decode_kinds=code', '--decoders=speculative,auto',
              '--decode_repeats=2', '--dtype=bfloat16')
  assert 'best of 2 runs' in out and 'Decoding in bfloat16' in out
  for decoder in ('speculative', 'auto'):
    assert re.search(rf'{decoder} .* outputs matched: yes \(2/2 prompts\)', out), out[-2000:]


def test_the_demo_trains_a_drafter_on_a_frozen_base_and_decodes_code_and_prose(tiny_workdir,
                                                                              tmp_path):
  """The default demo's path (configs/smollm2_demo.py) on the tiny trunk: an EAGLE-3 drafter
  over a draft vocabulary, teacher targets, cached states; code and prose prompts."""
  out = _demo(tmp_path, f'--config.init_from={tiny_workdir}', '--config.optim.mode=frozen_trunk',
              '--config.distill.targets=teacher', '--config.distill.cache_trunk_states=True',
              '--config.model.mtp_head_type=eagle', '--config.model.eagle_features=fused',
              '--config.model.eagle_input=concat', '--config.mtp_head_draft_vocab=64',
              f'--base={tmp_path / "never_read"}', '--dtype=bfloat16')
  assert 'on the frozen trunk of' in out and 'Importing' not in out
  assert 'bfloat16 activations' in out and 'Decoding in bfloat16' in out
  saved = checkpointing.load_config(tmp_path / 'wd').model  # Mixed precision: float32 weights.
  assert (saved.dtype, saved.param_dtype) == ('bfloat16', 'float32')
  for kind in ('code', 'prose'):
    assert f'held-out {kind} prompts' in out
  assert len(re.findall(r'outputs matched: yes \(2/2 prompts\)', out)) == 2, out[-2000:]
  assert re.search(r'auto .* outputs matched', out) and not re.search(r'speculative .* matched',
                                                                        out)


def test_a_drafter_trains_in_the_precision_asked_for_or_its_workdirs_or_the_machines(
    tmp_path, monkeypatch):
  from mtp.decode import cost_model
  for native, expected in ((True, 'bfloat16'), (False, 'float32')):
    monkeypatch.setattr(cost_model, 'native_bfloat16', lambda native=native: native)
    assert demo.drafter_training_dtype('float32', tmp_path, None) == expected
    assert demo.drafter_training_dtype('float32', tmp_path, 'float32') == 'float32'
  trained = tiny.get_config()
  trained.model.dtype = 'bfloat16'
  checkpointing.save_config(tmp_path, trained)
  assert demo.drafter_training_dtype('float32', tmp_path, None) == 'bfloat16'  # Its pass.
  assert demo.drafter_training_dtype('float32', tmp_path, 'float32') == 'float32'


def test_a_missing_base_is_imported_once(tmp_path, monkeypatch):
  from mtp.pretrained import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
  calls = []
  monkeypatch.setattr(workdir_lib, 'resolve_source', lambda source: f'resolved {source}')
  monkeypatch.setattr(workdir_lib, 'import_weights',
                      lambda source, base: calls.append((source, base)) or
                      (base / 'checkpoints').mkdir(parents=True))
  assert demo.import_base(tmp_path / 'base', 'smollm2')
  assert not demo.import_base(tmp_path / 'base', 'smollm2')
  assert calls == [('resolved smollm2', tmp_path / 'base')]


@pytest.mark.parametrize('error,code', [
    (preemption.Preempted(4), cli.PREEMPTED),
    (divergence.DivergenceError('Training diverged at step 7 (loss nan)', 7), cli.DIVERGED),
    (workdir_lock.WorkdirLockedError('/w is in use by pid 7 on h (lock /w.lock)'), cli.ERROR),
    (ValueError('keep_checkpoints must be at least 1, got 0'), cli.ERROR),
])
@flagsaver.flagsaver
def test_a_failed_training_is_one_line_and_the_launchers_exit_code(tmp_path, monkeypatch, capsys,
                                                                   error, code):
  def fails(config, workdir):
    raise error
  monkeypatch.setattr(trainer, 'train_and_evaluate', fails)
  monkeypatch.delenv('MTP_TRACEBACK', raising=False)
  flags.FLAGS.unparse_flags()
  flags.FLAGS(['demo', '--config=configs/tiny.py', f'--workdir={tmp_path}'])
  with pytest.raises(SystemExit) as e:
    demo.main(['demo'])
  line = f'launch.demo: {error}'
  if code == cli.ERROR:
    assert e.value.code == line
  else:
    assert e.value.code == code and capsys.readouterr().err.strip() == line


@pytest.mark.parametrize('flag,message', [
    ('--decoders=autoregressive,beam', "--decoders takes autoregressive, speculative and auto, "
     "got ['beam']"),
    ('--decode_repeats=0', '--decode_repeats must be at least 1, got 0'),
])
@flagsaver.flagsaver
def test_bad_decoding_flags_are_named_before_training(tmp_path, monkeypatch, flag, message):
  monkeypatch.setattr(trainer, 'train_and_evaluate', lambda *_: pytest.fail('trained'))
  monkeypatch.delenv('MTP_TRACEBACK', raising=False)
  flags.FLAGS.unparse_flags()
  flags.FLAGS(['demo', '--config=configs/tiny.py', f'--workdir={tmp_path}', flag])
  with pytest.raises(SystemExit) as e:
    demo.main(['demo'])
  assert e.value.code == f'launch.demo: {message}'


def test_wall_times_read_in_seconds_then_minutes_and_leave_out_what_took_none(capsys):
  demo.print_wall_times({'start-up': 0.3, 'training': 595.0, 'held-out evaluation': 54.4,
                         'decoding': 331.0}, token_seconds=79.6)
  out = capsys.readouterr().out
  assert out.startswith('\n== Done in 16 min 21 s: training 9 min 55 s, held-out evaluation '
                        '54 s, decoding 5 min 31 s (80 s of it making tokens; the rest compiled '
                        'the decoders and, on first use, measured what `auto` keeps in '), out
