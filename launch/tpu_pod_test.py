"""launch.tpu_pod: the dry run's exact commands, their quoting, bad requests, and the source
archive it ships."""

import pathlib
import shlex
import tarfile

import pytest
from absl import flags
from absl.testing import flagsaver

from launch import cli
from launch import tpu_pod

FLAGS = flags.FLAGS


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
      'python3 -m pip install --quiet --upgrade \'jax[tpu]\' ."',
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
  lines = out.splitlines()
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
  command = shlex.split(out.splitlines()[1])[-1].removeprefix('--command=')
  assert command == (tpu_pod.KILL_STALE + 'cd mtp && python3 -m launch.train --config=c.py '
                     '--workdir=gs://b/r --num_processes=-1')
