r"""Trains on every worker of a Cloud TPU pod slice with one command.

  python -m launch.tpu_pod --tpu=NAME --zone=ZONE [--project=P] --workdir=gs://BUCKET/run \
      [--dry_run] [--install=source|none] [--env=KEY=VALUE ...] [--kill_stale] [--detach] \
      -- --config=configs/code_small.py [--config.num_train_steps=... other launch.train flags]

What it runs, in order (`--dry_run` prints these commands, one per line after a `#` line saying
what each does, and runs nothing, here or on the workers):
  1. packs this checkout (the files git tracks or would track, uncommitted edits included) into
     STAGING_DIR/mtp-src.tar.gz, with a file MTP_SOURCE_COMMIT naming it: `git rev-parse HEAD`,
     plus `+` and a hash of the packed files' contents when the checkout has uncommitted edits;
  2. `gcloud compute tpus tpu-vm scp` copies it to every worker (`--worker=all`);
  3. `gcloud compute tpus tpu-vm ssh --worker=all` unpacks it into ~/REMOTE_DIR on each worker
     and installs it there with JAX for TPUs and the extras the workdir's and data.source's
     storage needs (`required_extras`): `python3 -m pip install --upgrade 'jax[tpu]' '.[gcs]'`
     for gs://, plain `.` for paths;
  4. checks that every worker runs this checkout: each prints its MTP_SOURCE_COMMIT (workers
     hold no .git: the code travels as an archive), which must equal this checkout's; a worker
     that differs (e.g. `--install=none` after local edits) is named, and nothing starts;
  5. checks that every worker reaches the workdir (its bucket, or its parent directory on a
     shared filesystem) and `--config.data.source`: `python3 -m launch.pod_probe` stats them
     there with etils.epath, the library training uses, after step 3 installed its backend;
  6. `gcloud compute tpus tpu-vm ssh --worker=all` runs, in ~/REMOTE_DIR on every worker,
       python3 -m launch.train <your flags> --workdir=WORKDIR --num_processes=-1
     `--num_processes=-1` lets `jax.distributed.initialize()` find the pod's workers, its
     coordinator and each worker's place by itself.
The package is shipped as source rather than a wheel because `--config=configs/NAME.py` is a
file path: running from the unpacked tree makes it resolve on the workers as it does here.
`--install=none` skips steps 1-3 (the workers already hold ~/REMOTE_DIR, e.g. a second run).

All workers write the same workdir, so it must be shared storage: a `gs://` path (TensorStore,
Orbax and etils read it natively), or a filesystem mounted on every worker
(`--shared_workdir`). Runs resume from it: after a preemption, the same command continues.
`--config.data.source` is read by every worker too: a path that is not gs:// is refused unless
`--shared_data` says every worker mounts it there (this machine's disk is not theirs). Other
schemes (s3://, hdfs://, ...) are refused by name: nothing here installs or checks them.

Output. Without `--detach`, gcloud streams every worker's output here (and with
`--output_directory`, into one log file per worker); closing this terminal ends the run. With
`--detach` each worker runs under nohup, writing ~/REMOTE_DIR/train.log, and this command
returns at once. A worker that dies stops the others within launch.train's
`--heartbeat_timeout_s` (JAX's coordination service notices the missing heartbeats).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import pathlib
import shlex
import subprocess
import tarfile
import tempfile
from typing import Sequence

from absl import app
from absl import flags

from launch import cli
from mtp.checkpoint import paths as paths_lib  # No JAX: etils.epath only.

FLAGS = flags.FLAGS
PROGRAM = 'launch.tpu_pod'
ROOT = pathlib.Path(__file__).resolve().parents[1]
ARCHIVE = 'mtp-src.tar.gz'
COMMIT_FILE = 'MTP_SOURCE_COMMIT'  # In the archive: which checkout it holds.
# The extras of pyproject.toml a storage scheme needs on the workers ('' is a path).
SCHEME_EXTRAS = {'': (), 'gs': ('gcs',)}
# Flags this launcher sets on launch.train itself.
_OWN_TRAIN_FLAGS = ('--workdir', '--num_processes', '--process_id', '--coordinator_address')

flags.DEFINE_string('tpu', None, 'The TPU VM (pod slice) name.')
flags.DEFINE_string('zone', None, 'Its zone, e.g. us-central2-b.')
flags.DEFINE_string('project', None, 'Its Google Cloud project (default: gcloud\'s).')
flags.DEFINE_string('workdir', None, 'The run\'s workdir, shared by all workers (gs://...).')
flags.DEFINE_bool('shared_workdir', False,
                  'The workdir is not gs:// but a filesystem every worker mounts at that path.')
flags.DEFINE_bool('shared_data', False,
                  '--config.data.source is not gs:// but a path every worker mounts.')
flags.DEFINE_bool('dry_run', False, 'Print the checks and commands, run nothing.')
flags.DEFINE_enum('install', 'source', ['source', 'none'],
                  'source: copy this checkout to the workers and pip install it there; none: '
                  'the workers already hold REMOTE_DIR.')
flags.DEFINE_string('remote_dir', 'mtp', 'Where the package lives on the workers (relative to '
                    'the home directory).')
flags.DEFINE_string('jax_requirement', 'jax[tpu]', 'The pip requirement of JAX for TPUs '
                    '(pin a version here, e.g. "jax[tpu]==0.10.2").')
flags.DEFINE_string('staging_dir', os.path.join(tempfile.gettempdir(), 'mtp-tpu-pod'),
                    'Local directory for the source archive.')
flags.DEFINE_multi_string('env', [], 'KEY=VALUE set for launch.train on every worker '
                          '(repeatable), e.g. LIBTPU_INIT_ARGS=...')
flags.DEFINE_bool('internal_ip', False, 'Reach the workers by internal IP (from inside their '
                  'VPC).')
flags.DEFINE_string('output_directory', None, 'Also write each worker\'s output to a log file '
                    'in this local directory (gcloud --output-directory).')
flags.DEFINE_bool('kill_stale', False, 'First kill, on every worker, the processes holding the '
                  'TPU (a previous run that did not exit), which would make this one fail '
                  'with "TPU in use".')
flags.DEFINE_bool('detach', False, 'Run under nohup on the workers (log: REMOTE_DIR/train.log) '
                  'and return at once.')


class PodLaunchError(ValueError):
  """A launch request that cannot work, named before anything runs."""


@dataclasses.dataclass(frozen=True)
class PodTarget:
  """Which pod slice, and how gcloud reaches it."""
  tpu: str
  zone: str
  project: str | None = None
  internal_ip: bool = False

  def gcloud_flags(self) -> list[str]:
    out = ['--worker=all', f'--zone={self.zone}']
    if self.project:
      out.append(f'--project={self.project}')
    if self.internal_ip:
      out.append('--internal-ip')
    return out


@dataclasses.dataclass(frozen=True)
class Step:
  """One thing the launch does: a command, or (argv None) packing the source locally."""
  description: str
  argv: tuple[str, ...] | None = None
  # 'commit' or 'reach': a check whose output decides whether the launch goes on.
  check: str | None = None

  def render(self) -> str:
    """The description as a comment, then the command as a shell would take it."""
    return f'# {self.description}' + (
        f'\n{" ".join(shell_word(a) for a in self.argv)}' if self.argv else '')


def shell_word(arg: str) -> str:
  """`arg` quoted for a POSIX shell, readably: `--flag="a b"` where double quotes are safe
  (no $, `, \\, ! or " inside), else shlex's single quotes."""
  if shlex.quote(arg) == arg:
    return arg
  name, sep, value = arg.partition('=')
  if not any(c in arg for c in '"$`\\!'):
    if sep and name.startswith('--') and shlex.quote(name) == name:
      return f'{name}="{value}"'
    return f'"{arg}"'
  return shlex.quote(arg)


def check_train_flags(train_flags: Sequence[str]) -> None:
  """launch.train's flags as given after `--`: a config, and none of the ones set here."""
  names = [f.split('=', 1)[0] for f in train_flags]
  own = [n for n in names if n in _OWN_TRAIN_FLAGS]
  if own:
    raise PodLaunchError(f'{", ".join(own)} after "--" would override what {PROGRAM} sets on '
                         'every worker; pass --workdir before "--" and leave the process flags '
                         'to JAX\'s auto-detection.')
  if '--config' not in names:
    raise PodLaunchError('launch.train needs --config=configs/NAME.py after "--".')


def scheme(path: str) -> str:
  """`gs` for gs://..., '' for a path (`paths.scheme`, lower-cased)."""
  return paths_lib.scheme(path).lower()


def required_extras(*paths: str) -> tuple[str, ...]:
  """The pyproject extras the workers need to read and write `paths` (sorted, unique).

  Raises:
    PodLaunchError: a scheme this launcher cannot serve (s3://, hdfs://, ...), named.
  """
  extras = set()
  for path in paths:
    name = scheme(path)
    if name not in SCHEME_EXTRAS:
      raise PodLaunchError(f'{path}: the {name}:// scheme is not supported on a pod (use gs:// '
                           'or a path every worker mounts).')
    extras.update(SCHEME_EXTRAS[name])
  return tuple(sorted(extras))


def data_source(train_flags: Sequence[str]) -> str:
  """The last `--config.data.source` among launch.train's flags ('' if none)."""
  source = ''
  for i, arg in enumerate(train_flags):
    if arg.startswith('--config.data.source='):
      source = arg.split('=', 1)[1]
    elif arg == '--config.data.source' and i + 1 < len(train_flags):
      source = train_flags[i + 1]
  return source


def check_workdir(workdir: str, shared: bool) -> None:
  if not workdir:
    raise PodLaunchError('--workdir is required: the run\'s workdir, shared by all workers.')
  required_extras(workdir)
  if not scheme(workdir) and not shared:
    raise PodLaunchError(f'--workdir={workdir} is not on shared storage: each worker has its own '
                         'disk, so use a gs:// path, or pass --shared_workdir if it is a '
                         'filesystem every worker mounts.')


def check_data_source(source: str, shared: bool) -> None:
  """A data.source the workers can read: gs://, or a path they all mount (`shared`)."""
  if not source:
    return
  required_extras(source)
  if not scheme(source) and not shared:
    raise PodLaunchError(f'--config.data.source={source} is a path on this machine, which the '
                         'workers cannot see: copy it to gs:// (launch.prepare_data --output='
                         'gs://...), or pass --shared_data if every worker mounts it there.')


def workdir_probe(workdir: str) -> str:
  """What the reach check stats for the workdir, which a new run has not created yet: its
  bucket for gs://, its parent directory on a shared filesystem."""
  if scheme(workdir):
    name, rest = workdir.split('://', 1)
    return f'{name}://{rest.split("/", 1)[0]}'
  return os.path.dirname(workdir.rstrip('/')) or '/'


def _env_prefix(env: Sequence[str]) -> list[str]:
  for item in env:
    key, sep, _ = item.partition('=')
    if not sep or not key.isidentifier():
      raise PodLaunchError(f'--env takes KEY=VALUE, got {item!r}.')
  return ['env', *env] if env else []


# Processes holding a TPU's device files: /dev/accel* (v2-v4), /dev/vfio/<n> (v5e and later).
KILL_STALE = 'sudo fuser -k -KILL /dev/accel* /dev/vfio/[0-9]* 2>/dev/null; '


def train_command(train_flags: Sequence[str], workdir: str, remote_dir: str,
                  env: Sequence[str] = (), detach: bool = False,
                  kill_stale: bool = False) -> str:
  """The shell command every worker runs (quoted for its shell)."""
  argv = [*_env_prefix(env), 'python3', '-m', 'launch.train', *train_flags,
          f'--workdir={workdir}', '--num_processes=-1']
  command = (KILL_STALE if kill_stale else '') + f'cd {shlex.quote(remote_dir)} && '
  if detach:
    return command + f'nohup {shlex.join(argv)} > train.log 2>&1 < /dev/null &'
  return command + shlex.join(argv)


def install_command(remote_dir: str, jax_requirement: str,
                    extras: Sequence[str] = ()) -> str:
  """Unpack the archive into remote_dir and install it (with JAX for TPUs and `extras`) on a
  worker."""
  d = shlex.quote(remote_dir)
  package = f'.[{",".join(extras)}]' if extras else '.'
  return (f'set -e; mkdir -p {d}; tar -xzf {ARCHIVE} -C {d}; cd {d}; '
          f'python3 -m pip install --quiet --upgrade {shlex.quote(jax_requirement)} '
          f'{shlex.quote(package)}')


# Each worker's number in its slice (what JAX's TPU cluster detection reads too), or its
# hostname off a TPU VM.
WORKER_ID = ('W=$(curl -sf -H Metadata-Flavor:Google http://metadata.google.internal/'
             'computeMetadata/v1/instance/attributes/agent-worker-number || hostname); ')


def commit_check_command(remote_dir: str) -> str:
  """Every worker prints `mtp-check WORKER commit ID` (ID: its archive's MTP_SOURCE_COMMIT)."""
  path = shlex.quote(f'{remote_dir}/{COMMIT_FILE}')
  return WORKER_ID + f'echo "mtp-check $W commit $(cat {path} 2>/dev/null || echo none)"'


def reach_check_command(remote_dir: str, paths: Sequence[str]) -> str:
  """Every worker stats `paths` (launch.pod_probe) and prints a line for each."""
  return (WORKER_ID + f'cd {shlex.quote(remote_dir)} && python3 -m launch.pod_probe "$W" '
          + shlex.join(paths))


def _reports(output: str, kind: str) -> list[tuple[str, str]]:
  """(worker, rest) of each `mtp-check WORKER KIND rest` line."""
  out = []
  for line in output.splitlines():
    parts = line.strip().split(' ', 3)
    if len(parts) >= 3 and parts[0] == 'mtp-check' and parts[2] == kind:
      out.append((parts[1], parts[3] if len(parts) > 3 else ''))
  return out


def verify_commits(output: str, expected: str) -> None:
  """Every worker that reported runs `expected`.

  Raises:
    PodLaunchError: no report, or one line naming the first worker that differs.
  """
  reports = _reports(output, 'commit')
  if not reports:
    raise PodLaunchError('no worker reported the commit it holds.')
  for worker, commit in sorted(reports, key=lambda r: (len(r[0]), r[0])):
    if commit != expected:
      held = 'no launch.tpu_pod archive' if commit == 'none' else f'commit {commit}'
      raise PodLaunchError(f'worker {worker} holds {held}, not this checkout\'s {expected}: '
                           'run with --install=source to ship it to every worker.')


def verify_reach(output: str, roles: dict[str, str]) -> None:
  """No worker reported a path it cannot reach; `roles` names each path (e.g. '--workdir').

  Raises:
    PodLaunchError: one line naming the worker, the path, its role and why.
  """
  for worker, rest in _reports(output, 'unreachable'):
    path, _, why = rest.partition(': ')
    role = roles.get(path, 'path')
    raise PodLaunchError(f'worker {worker} cannot reach {path} ({role}): {why}.')
  if not _reports(output, 'reachable'):
    raise PodLaunchError('no worker reported whether it reaches the workdir and data.')


def plan(target: PodTarget, train_flags: Sequence[str], *, workdir: str, install: str,
         remote_dir: str, jax_requirement: str, staging_dir: str, env: Sequence[str] = (),
         detach: bool = False, output_directory: str | None = None,
         shared_workdir: bool = False, kill_stale: bool = False, shared_data: bool = False,
         commit: str = '') -> list[Step]:
  """Every step of the launch, in order (see the module docstring); `commit` is the source
  commit every worker must hold (`source_commit`).

  Raises:
    PodLaunchError: bad flags, before anything runs.
  """
  check_workdir(workdir, shared_workdir)
  check_train_flags(train_flags)
  source = data_source(train_flags)
  check_data_source(source, shared_data)
  extras = required_extras(workdir, *([source] if source else []))
  if not remote_dir or remote_dir.startswith(('/', '~')) or '..' in remote_dir.split('/'):
    raise PodLaunchError(f'--remote_dir must be a path inside the home directory, got '
                         f'{remote_dir!r}.')
  ssh = ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', target.tpu, *target.gcloud_flags()]
  steps = []
  if install == 'source':
    archive = os.path.join(staging_dir, ARCHIVE)
    steps += [
        Step(f'pack {ROOT} (files git tracks or would track) into {archive}'),
        Step('copy it to every worker',
             ('gcloud', 'compute', 'tpus', 'tpu-vm', 'scp', archive, f'{target.tpu}:{ARCHIVE}',
              *target.gcloud_flags())),
        Step(f'unpack and install it on every worker (~/{remote_dir})',
             (*ssh, f'--command={install_command(remote_dir, jax_requirement, extras)}')),
    ]
  probes = [workdir_probe(workdir), *([source] if source else [])]
  steps += [
      Step(f'check: every worker holds commit {commit}',
           (*ssh, f'--command={commit_check_command(remote_dir)}'), check='commit'),
      Step(f'check: every worker reaches {" and ".join(probes)}',
           (*ssh, f'--command={reach_check_command(remote_dir, probes)}'), check='reach'),
  ]
  command = train_command(train_flags, workdir, remote_dir, env, detach, kill_stale)
  run = [*ssh, f'--command={command}']
  if output_directory:
    run.append(f'--output-directory={output_directory}')
  steps.append(Step('train on every worker' + (
      f' (in the background; logs: ~/{remote_dir}/train.log)' if detach else ''), tuple(run)))
  return steps


def source_files(root: pathlib.Path) -> list[str]:
  """The files of the checkout git tracks or would track (not ignored), that exist."""
  listed = subprocess.run(
      ['git', '-C', str(root), 'ls-files', '-z', '--cached', '--others', '--exclude-standard'],
      check=True, capture_output=True).stdout.decode().split('\0')
  return sorted({f for f in listed if f and (root / f).is_file()})


def source_commit(root: pathlib.Path) -> str:
  """`git rev-parse HEAD`, plus `+` and a hash of the source files' contents when the checkout
  has uncommitted edits (which the archive ships too)."""
  def git(*args):
    return subprocess.run(['git', '-C', str(root), *args], check=True,
                          capture_output=True).stdout.decode().strip()
  head = git('rev-parse', 'HEAD')
  if not git('status', '--porcelain'):
    return head
  digest = hashlib.sha256()
  for name in source_files(root):
    digest.update(name.encode() + b'\0' + (root / name).read_bytes() + b'\0')
  return f'{head}+{digest.hexdigest()[:12]}'


def pack_source(root: pathlib.Path, archive: pathlib.Path, commit: str = '') -> int:
  """Writes the checkout's source files (and COMMIT_FILE holding `commit`, if given) into a
  .tar.gz; returns how many source files."""
  files = source_files(root)
  archive.parent.mkdir(parents=True, exist_ok=True)
  with tarfile.open(archive, 'w:gz') as tar:
    for name in files:
      tar.add(root / name, arcname=name)
    if commit:
      data = (commit + '\n').encode()
      info = tarfile.TarInfo(COMMIT_FILE)
      info.size, info.mode = len(data), 0o644
      tar.addfile(info, io.BytesIO(data))
  return len(files)


def main(argv):
  train_flags = argv[1:]
  try:
    flags_missing = [name for name in ('tpu', 'zone') if not FLAGS[name].value]
    if flags_missing:
      raise PodLaunchError(f'--{" and --".join(flags_missing)} required.')
    target = PodTarget(FLAGS.tpu, FLAGS.zone, FLAGS.project, FLAGS.internal_ip)
    # Once, so that the archive and the check agree (local: git and a hash of the files).
    commit = source_commit(ROOT)
    steps = plan(target, train_flags, workdir=FLAGS.workdir, install=FLAGS.install,
                 remote_dir=FLAGS.remote_dir, jax_requirement=FLAGS.jax_requirement,
                 staging_dir=FLAGS.staging_dir, env=FLAGS.env, detach=FLAGS.detach,
                 output_directory=FLAGS.output_directory, shared_workdir=FLAGS.shared_workdir,
                 kill_stale=FLAGS.kill_stale, shared_data=FLAGS.shared_data,
                 commit=commit)
  except PodLaunchError as e:
    cli.fail(PROGRAM, e, cli.USAGE)
  roles = {data_source(train_flags): '--config.data.source',
           workdir_probe(FLAGS.workdir): f'--workdir={FLAGS.workdir}'}
  for step in steps:
    print(step.render(), flush=True)
    if FLAGS.dry_run:
      continue
    if step.argv is None:
      count = pack_source(ROOT, pathlib.Path(FLAGS.staging_dir) / ARCHIVE, commit)
      print(f'# packed {count} files', flush=True)
      continue
    if step.check:
      done = subprocess.run(step.argv, check=False, capture_output=True, text=True)
      try:
        if step.check == 'commit':
          verify_commits(done.stdout, commit)
        else:
          verify_reach(done.stdout, roles)
      except PodLaunchError as e:
        last = (done.stderr.strip().splitlines() or [''])[-1]
        if done.returncode and 'no worker' in str(e):
          e = PodLaunchError(f'{e} gcloud exited with code {done.returncode}: {last}')
        cli.fail(PROGRAM, e)
      code = done.returncode
    else:
      code = subprocess.run(step.argv, check=False).returncode
    if code:
      cli.fail(PROGRAM, RuntimeError(f'"{step.description}" failed: {shlex.join(step.argv[:6])} '
                                     f'... exited with code {code}.'),
               code if 0 < code < 128 else cli.ERROR)


if __name__ == '__main__':
  app.run(main, flags_parser=cli.flags_parser(PROGRAM))
