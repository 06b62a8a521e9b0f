"""launch.tpu_pod: the dry run's exact commands, their quoting, bad requests, the source
archive it ships, the extras each storage scheme installs, and (under a stand-in `gcloud` that
records its calls) the checks on the workers that stop a launch before training."""

import json
import os
import pathlib
import shlex
import stat
import subprocess
import sys
import tarfile
import textwrap

import pytest
from absl import flags
from absl.testing import flagsaver

from launch import cli
from launch import tpu_pod

FLAGS = flags.FLAGS
COMMIT = 'c0ffee'
_REAL_SOURCE_COMMIT = tpu_pod.source_commit
WORKER_ID = ('W=$(curl -sf -H Metadata-Flavor:Google http://metadata.google.internal/'
             'computeMetadata/v1/instance/attributes/agent-worker-number || hostname); ')


@pytest.fixture(autouse=True)
def _fixed_commit(monkeypatch):
  """The checkout's commit, fixed: the real one changes with every edit of the tree."""
  monkeypatch.setattr(tpu_pod, 'source_commit', lambda root: COMMIT)


def _dry_run(capsys, *args):
  FLAGS.unparse_flags()
  argv = FLAGS(['tpu_pod', *args])
  tpu_pod.main(argv)
  return capsys.readouterr().out


@flagsaver.flagsaver
def test_dry_run_prints_the_exact_commands(capsys, tmp_path):
  out = _dry_run(capsys, '--tpu=my-pod', '--zone=us-central2-b', '--project=proj',
                 '--workdir=gs://bucket/run', '--dry_run', f'--staging_dir={tmp_path}', '--',
                 '--config=configs/code_small.py', '--config.num_train_steps=2000',
                 '--config.data.corpus=/data/my corpus')
  archive = tmp_path / 'mtp-src.tar.gz'
  assert out.splitlines() == [
      f'# pack {tpu_pod.ROOT} (files git tracks or would track) into {archive}',
      '# copy it to every worker',
      f'gcloud compute tpus tpu-vm scp {archive} my-pod:mtp-src.tar.gz --worker=all '
      '--zone=us-central2-b --project=proj',
      '# unpack and install it on every worker (~/mtp)',
      'gcloud compute tpus tpu-vm ssh my-pod --worker=all --zone=us-central2-b --project=proj '
      '--command="set -e; mkdir -p mtp; tar -xzf mtp-src.tar.gz -C mtp; cd mtp; '
      'python3 -m pip install --quiet --upgrade \'jax[tpu]\' \'.[gcs]\'"',
      f'# check: every worker holds commit {COMMIT}',
      'gcloud compute tpus tpu-vm ssh my-pod --worker=all --zone=us-central2-b --project=proj '
      + shlex.quote(f'--command={WORKER_ID}echo "mtp-check $W commit '
                    '$(cat mtp/MTP_SOURCE_COMMIT 2>/dev/null || echo none)"'),
      '# check: every worker reaches gs://bucket',
      'gcloud compute tpus tpu-vm ssh my-pod --worker=all --zone=us-central2-b --project=proj '
      + shlex.quote(f'--command={WORKER_ID}cd mtp && python3 -m launch.pod_probe "$W" '
                    'gs://bucket'),
      '# train on every worker',
      'gcloud compute tpus tpu-vm ssh my-pod --worker=all --zone=us-central2-b --project=proj '
      '--command="cd mtp && python3 -m launch.train --config=configs/code_small.py '
      '--config.num_train_steps=2000 \'--config.data.corpus=/data/my corpus\' '
      '--workdir=gs://bucket/run --num_processes=-1"',
  ]
  assert not archive.exists()  # A dry run packs nothing.


@flagsaver.flagsaver
def test_printed_commands_are_what_the_shells_run(capsys):
  """Each printed line splits back into gcloud's argv, and the worker's shell splits its
  --command back into launch.train's argv, environment included."""
  train_flags = ['--config=configs/tiny.py', '--config.data.corpus=it\'s "quoted" $HOME']
  out = _dry_run(capsys, '--tpu=p', '--zone=z', '--workdir=gs://b/r', '--dry_run',
                 '--install=none', '--env=XLA_FLAGS=--a=1 --b', '--detach', '--internal_ip',
                 '--output_directory=logs dir', '--', *train_flags)
  lines = out.splitlines()[4:]  # After the two checks.
  assert lines[0] == '# train on every worker (in the background; logs: ~/mtp/train.log)'
  argv = shlex.split(lines[1])
  assert argv[:9] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', 'p', '--worker=all',
                      '--zone=z', '--internal-ip']
  assert argv[-1] == '--output-directory=logs dir'
  command = argv[9].removeprefix('--command=')
  assert command.startswith('cd mtp && nohup ') and command.endswith(
      ' > train.log 2>&1 < /dev/null &')
  worker_argv = shlex.split(command.removeprefix('cd mtp && nohup ').removesuffix(
      ' > train.log 2>&1 < /dev/null &'))
  assert worker_argv == ['env', 'XLA_FLAGS=--a=1 --b', 'python3', '-m', 'launch.train',
                         *train_flags, '--workdir=gs://b/r', '--num_processes=-1']


@pytest.mark.parametrize('args, message', [
    (['--workdir=/tmp/run', '--', '--config=c.py'], 'not on shared storage'),
    (['--workdir=gs://b/r', '--', '--config=c.py', '--num_processes=4'], '--num_processes'),
    (['--workdir=gs://b/r', '--', '--config=c.py', '--workdir=gs://x'], '--workdir'),
    (['--workdir=gs://b/r', '--', '--config.seed=1'], 'needs --config'),
    (['--workdir=gs://b/r', '--env=NOVALUE', '--', '--config=c.py'], 'KEY=VALUE'),
    (['--workdir=gs://b/r', '--remote_dir=/abs', '--', '--config=c.py'], 'remote_dir'),
    (['--workdir=s3://b/r', '--', '--config=c.py'], 's3://b/r: the s3:// scheme'),
    (['--workdir=hdfs://n/r', '--shared_workdir', '--', '--config=c.py'], 'hdfs:// scheme'),
    (['--workdir=gs://b/r', '--', '--config=c.py', '--config.data.source=s3://d'], 's3://'),
    (['--workdir=gs://b/r', '--', '--config=c.py', '--config.data.source=/data/tokens'],
     '--config.data.source=/data/tokens is a path on this machine'),
])
@flagsaver.flagsaver
def test_bad_requests_are_named_before_anything_runs(capsys, args, message):
  with pytest.raises(SystemExit) as e:
    _dry_run(capsys, '--tpu=p', '--zone=z', '--dry_run', *args)
  assert e.value.code == cli.USAGE
  err = capsys.readouterr().err
  assert err.startswith('launch.tpu_pod: ') and message in err


@flagsaver.flagsaver
def test_a_shared_filesystem_workdir_is_allowed_when_said(capsys):
  out = _dry_run(capsys, '--tpu=p', '--zone=z', '--dry_run', '--install=none',
                 '--workdir=/mnt/shared/run', '--shared_workdir', '--', '--config=c.py')
  assert '--workdir=/mnt/shared/run --num_processes=-1' in out


def test_the_archive_holds_the_checkout_source_and_nothing_ignored(tmp_path):
  archive = tmp_path / 'src.tar.gz'
  count = tpu_pod.pack_source(tpu_pod.ROOT, archive)
  with tarfile.open(archive) as tar:
    names = set(tar.getnames())
  assert count == len(names)
  for needed in ('launch/train.py', 'configs/tiny.py', 'mtp/train/trainer.py', 'pyproject.toml'):
    assert needed in names
  assert not any(n.startswith(('.venv/', '.git/')) or '__pycache__' in n for n in names)
  assert pathlib.Path(tpu_pod.ROOT / 'launch' / 'tpu_pod.py').name in {
      pathlib.Path(n).name for n in names}


@flagsaver.flagsaver
def test_kill_stale_frees_the_tpu_before_training(capsys):
  out = _dry_run(capsys, '--tpu=p', '--zone=z', '--dry_run', '--install=none',
                 '--workdir=gs://b/r', '--kill_stale', '--', '--config=c.py')
  command = shlex.split(out.splitlines()[5])[-1].removeprefix('--command=')
  assert command == (tpu_pod.KILL_STALE + 'cd mtp && python3 -m launch.train --config=c.py '
                     '--workdir=gs://b/r --num_processes=-1')


def test_required_extras_by_scheme():
  assert tpu_pod.required_extras('gs://b/run') == ('gcs',)
  assert tpu_pod.required_extras('/mnt/shared/run', 'gs://b/data') == ('gcs',)
  assert tpu_pod.required_extras('/mnt/shared/run', 'relative/data') == ()
  for bad in ('s3://b/r', 'hdfs://namenode/r', 'file:///tmp/r'):
    with pytest.raises(tpu_pod.PodLaunchError, match=bad.split(':')[0] + ':// scheme'):
      tpu_pod.required_extras('gs://b/ok', bad)


def _install_command(out):
  line = next(l for l in out.splitlines() if 'pip install' in l)
  return shlex.split(line)[-1]


@flagsaver.flagsaver
def test_the_gcs_extra_is_installed_only_for_gs_paths(capsys):
  common = ['--tpu=p', '--zone=z', '--dry_run']
  gs = _dry_run(capsys, *common, '--workdir=gs://b/r', '--', '--config=c.py')
  assert _install_command(gs).endswith("'jax[tpu]' '.[gcs]'")
  local = _dry_run(capsys, *common, '--workdir=/mnt/shared/r', '--shared_workdir', '--',
                   '--config=c.py')
  assert _install_command(local).endswith("'jax[tpu]' .")
  # A shared-filesystem workdir reading a gs:// data source still needs gcsfs.
  mixed = _dry_run(capsys, *common, '--workdir=/mnt/shared/r', '--shared_workdir', '--',
                   '--config=c.py', '--config.data.source', 'gs://b/tokens')
  assert _install_command(mixed).endswith("'.[gcs]'")
  assert '# check: every worker reaches /mnt/shared and gs://b/tokens' in mixed


@flagsaver.flagsaver
def test_a_shared_local_data_source_is_checked_on_the_workers(capsys):
  out = _dry_run(capsys, '--tpu=p', '--zone=z', '--dry_run', '--workdir=gs://b/r',
                 '--shared_data', '--', '--config=c.py', '--config.data.source=/mnt/d/tok')
  assert '# check: every worker reaches gs://b and /mnt/d/tok' in out
  assert _install_command(out).endswith("'.[gcs]'")


def test_source_commit_names_uncommitted_edits(tmp_path):
  def git(*args):
    subprocess.run(['git', '-C', str(tmp_path), '-c', 'user.name=t', '-c', 'user.email=t@t',
                    *args], check=True, capture_output=True)
  git('init', '-q')
  (tmp_path / 'a.py').write_text('a = 1\n')
  git('add', 'a.py')
  git('commit', '-q', '-m', 'a')
  head = subprocess.run(['git', '-C', str(tmp_path), 'rev-parse', 'HEAD'], check=True,
                        capture_output=True, text=True).stdout.strip()
  commit = _REAL_SOURCE_COMMIT  # Not the fixture's stand-in.
  assert commit(tmp_path) == head
  (tmp_path / 'a.py').write_text('a = 2\n')
  edited = commit(tmp_path)
  assert edited.startswith(head + '+') and len(edited) == len(head) + 13
  (tmp_path / 'a.py').write_text('a = 3\n')
  assert commit(tmp_path) not in (head, edited)



def test_the_archive_names_its_commit(tmp_path):
  archive = tmp_path / 'src.tar.gz'
  tpu_pod.pack_source(tpu_pod.ROOT, archive, 'abc+123')
  with tarfile.open(archive) as tar:
    assert tar.extractfile(tpu_pod.COMMIT_FILE).read() == b'abc+123\n'


# The stand-in gcloud: records its argv (one JSON line per call), and answers the checks as the
# workers would: FAKE_COMMITS lists each worker's commit, FAKE_UNREACHABLE a path no worker
# reaches.
_FAKE_GCLOUD = """
    import json, os, shlex, sys
    args = sys.argv[1:]
    with open(os.environ['FAKE_GCLOUD_CALLS'], 'a') as f:
      f.write(json.dumps(args) + '\\n')
    command = next((a[10:] for a in args if a.startswith('--command=')), '')
    commits = os.environ.get('FAKE_COMMITS', '').split(',')
    if 'MTP_SOURCE_COMMIT' in command:
      for w, c in enumerate(commits):
        print(f'mtp-check {w} commit {c}')
    elif 'launch.pod_probe' in command:
      paths = shlex.split(command.split('"$W"', 1)[1])
      code = 0
      for w in range(len(commits)):
        for p in paths:
          if p == os.environ.get('FAKE_UNREACHABLE'):
            code = 1
            print(f'mtp-check {w} unreachable {p}: PermissionError: 403 denied')
          else:
            print(f'mtp-check {w} reachable {p}')
      sys.exit(code)
"""


@pytest.fixture
def fake_gcloud(tmp_path, monkeypatch):
  """A `gcloud` first on PATH; returns a function giving the calls it recorded."""
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  path = bin_dir / 'gcloud'
  path.write_text(f'#!{sys.executable}\n' + textwrap.dedent(_FAKE_GCLOUD))
  path.chmod(path.stat().st_mode | stat.S_IEXEC)
  calls = tmp_path / 'calls.jsonl'
  monkeypatch.setenv('PATH', f'{bin_dir}{os.pathsep}{os.environ["PATH"]}')
  monkeypatch.setenv('FAKE_GCLOUD_CALLS', str(calls))
  monkeypatch.setenv('FAKE_COMMITS', f'{COMMIT},{COMMIT}')

  def recorded():
    if not calls.exists():
      return []
    return [json.loads(line) for line in calls.read_text().splitlines()]
  return recorded


def _launch(capsys, *args):
  """Runs the launcher (not a dry run); returns (exit code, stdout, stderr)."""
  try:
    _dry_run(capsys, '--tpu=p', '--zone=z', *args)
    code = 0
  except SystemExit as e:
    code = e.code
  captured = capsys.readouterr()
  return code, captured.out, captured.err


@flagsaver.flagsaver
def test_checks_pass_then_training_starts(capsys, tmp_path, fake_gcloud):
  code, out, _ = _launch(capsys, '--workdir=gs://b/r', f'--staging_dir={tmp_path}', '--',
                         '--config=c.py', '--config.data.source=gs://d/tok')
  assert code == 0, out
  calls = fake_gcloud()
  assert [c[3] for c in calls] == ['scp', 'ssh', 'ssh', 'ssh', 'ssh']
  assert "'.[gcs]'" in calls[1][-1]
  assert calls[3][-1].endswith('launch.pod_probe "$W" gs://b gs://d/tok')
  assert 'launch.train' in calls[4][-1]
  with tarfile.open(tmp_path / tpu_pod.ARCHIVE) as tar:
    assert tar.extractfile(tpu_pod.COMMIT_FILE).read().decode().strip() == COMMIT


@flagsaver.flagsaver
def test_a_worker_on_another_commit_stops_the_launch(capsys, monkeypatch, fake_gcloud):
  monkeypatch.setenv('FAKE_COMMITS', f'{COMMIT},{COMMIT},0ld,{COMMIT}')
  code, _, err = _launch(capsys, '--workdir=gs://b/r', '--install=none', '--', '--config=c.py')
  assert code != 0
  message = str(code) if isinstance(code, str) else err
  assert message.splitlines() == [
      f'launch.tpu_pod: worker 2 holds commit 0ld, not this checkout\'s {COMMIT}: run with '
      '--install=source to ship it to every worker.']
  assert len(fake_gcloud()) == 1  # Neither the reach check nor training ran.


@flagsaver.flagsaver
def test_a_worker_without_the_archive_is_named(capsys, monkeypatch, fake_gcloud):
  monkeypatch.setenv('FAKE_COMMITS', f'{COMMIT},none')
  code, _, _ = _launch(capsys, '--workdir=gs://b/r', '--install=none', '--', '--config=c.py')
  assert 'worker 1 holds no launch.tpu_pod archive' in str(code)


@flagsaver.flagsaver
def test_an_unreachable_path_stops_the_launch(capsys, monkeypatch, fake_gcloud):
  monkeypatch.setenv('FAKE_UNREACHABLE', 'gs://d/tok')
  code, _, _ = _launch(capsys, '--workdir=gs://b/r', '--install=none', '--', '--config=c.py',
                       '--config.data.source=gs://d/tok')
  assert str(code).splitlines() == [
      'launch.tpu_pod: worker 0 cannot reach gs://d/tok (--config.data.source): '
      'PermissionError: 403 denied.']
  assert [c[3] for c in fake_gcloud()] == ['ssh', 'ssh']  # No training.
  monkeypatch.setenv('FAKE_UNREACHABLE', 'gs://b')
  code, _, _ = _launch(capsys, '--workdir=gs://b/r', '--install=none', '--', '--config=c.py')
  assert 'worker 0 cannot reach gs://b (--workdir=gs://b/r)' in str(code)


@flagsaver.flagsaver
def test_a_dry_run_prints_the_checks_and_calls_no_gcloud(capsys, tmp_path, fake_gcloud):
  out = _dry_run(capsys, '--tpu=p', '--zone=z', '--dry_run', '--workdir=gs://b/r',
                 f'--staging_dir={tmp_path}', '--', '--config=c.py',
                 '--config.data.source=gs://d/tok')
  assert f'# check: every worker holds commit {COMMIT}' in out
  assert '# check: every worker reaches gs://b and gs://d/tok' in out
  assert len(out.splitlines()) == 11  # 6 steps, 5 of them with a command.
  assert fake_gcloud() == []
