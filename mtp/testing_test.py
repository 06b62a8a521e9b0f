"""`child_env`: a child process keeps the session's XLA flags, not its simulated devices."""

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
