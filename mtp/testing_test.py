"""`child_env`: a child process keeps the session's XLA flags, not its simulated devices.
`built_once`: one build a session, whichever process asks first."""

import subprocess
import sys

from mtp import testing


def test_a_child_keeps_every_flag_but_the_device_count(monkeypatch):
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=8 --a=1 --b')
  assert testing.child_env()['XLA_FLAGS'] == '--a=1 --b'
  assert testing.child_env(devices=4)['XLA_FLAGS'] == (
      '--a=1 --b --xla_force_host_platform_device_count=4')
  assert testing.child_env(FOO='x')['FOO'] == 'x'


def test_a_child_of_a_session_with_only_a_device_count_gets_no_flags(monkeypatch):
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
  assert 'XLA_FLAGS' not in testing.child_env()
  monkeypatch.delenv('XLA_FLAGS')
  assert 'XLA_FLAGS' not in testing.child_env(XLA_FLAGS='')


def test_a_folder_is_built_once_and_a_half_built_one_again(tmp_path, monkeypatch):
  monkeypatch.setenv('MTP_TEST_SESSION_DIR', str(tmp_path))
  builds = []

  def build(folder):
    builds.append(folder)
    folder.mkdir()
    (folder / 'file').write_text(str(len(builds)))

  first = testing.built_once('thing', build)
  assert testing.built_once('thing', build) == first and len(builds) == 1
  (tmp_path / 'built' / 'thing.done').unlink()  # As if its builder died before the end.
  assert (testing.built_once('thing', build) / 'file').read_text() == '2'


def test_processes_asking_at_once_wait_for_one_build(tmp_path):
  script = ('import sys, time\n'
            'from mtp import testing\n'
            'def build(folder):\n'
            '  folder.mkdir()\n'
            '  time.sleep(1)\n'
            '  with open(sys.argv[1], "a") as log: log.write("built\\n")\n'
            'print(testing.built_once("thing", build))\n')
  env = testing.child_env(MTP_TEST_SESSION_DIR=str(tmp_path / 'session'))
  log = tmp_path / 'log'
  procs = [subprocess.Popen([sys.executable, '-c', script, str(log)], env=env,
                            stdout=subprocess.PIPE, text=True) for _ in range(3)]
  outputs = {p.communicate(timeout=60)[0].strip() for p in procs}
  assert all(p.returncode == 0 for p in procs)
  assert outputs == {str(tmp_path / 'session' / 'built' / 'thing')}
  assert log.read_text() == 'built\n'
