# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Export and serve: out of mtp, into transformers and an OpenAI-compatible server
#
# [![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/your-org/mtp/blob/main/notebooks/03_export_and_serve.ipynb)
#
# A trained mtp model leaves the package two ways. **Export** writes a Hugging Face Llama
# directory that `transformers` loads by itself, with the Medusa heads beside it in the format
# vLLM reads. **Serving** puts the model behind an OpenAI-compatible HTTP server that drafts and
# verifies with its own heads, so existing clients get exact speculative decoding with no draft
# model to host.

# %%
# Set-up. On Colab: clone the repository and install it with the jax build of the runtime's
# accelerator. Anywhere else: use the checkout this notebook belongs to.
import os
import pathlib
import shutil
import subprocess
import sys

REPOSITORY = 'your-org/mtp'  # GitHub owner/name (stamped by `python -m notebooks.execute`)
IN_COLAB = 'google.colab' in sys.modules
FAST = os.environ.get('MTP_NOTEBOOK_FAST') == '1'  # CI: tiny sizes, the same cells


def find_checkout():
  for folder in (pathlib.Path.cwd(), *pathlib.Path.cwd().parents):
    if (folder / 'mtp' / '__init__.py').exists() and (folder / 'pyproject.toml').exists():
      return folder
  return None


ROOT = find_checkout()
if ROOT is None and IN_COLAB:
  subprocess.run(['git', 'clone', '--depth=1', f'https://github.com/{REPOSITORY}', 'mtp'],
                 check=True)
  ROOT = pathlib.Path('mtp').resolve()
  if os.environ.get('COLAB_TPU_ADDR') or list(pathlib.Path('/dev').glob('accel*')):
    jax_build = ['jax[tpu]']
  elif shutil.which('nvidia-smi'):
    jax_build = ['jax[cuda12]']
  else:
    jax_build = []
  # Colab's own torch serves transformers here (the `peer` extra pins a CPU build).
  subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', '-e', f'{ROOT}[bench,serve]',
                  'transformers>=5', *jax_build], check=True)
if ROOT is None:
  raise RuntimeError('Open this notebook from a checkout of mtp, or on Colab.')
os.chdir(ROOT)  # configs/ and results/ are relative to the checkout.
sys.path.insert(0, str(ROOT))
WORKDIRS = pathlib.Path(os.environ.get('MTP_NOTEBOOK_WORKDIRS', ROOT / 'workdirs'))
FIGURES = ROOT / 'results' / 'notebooks' / '03_export_and_serve'
FIGURES.mkdir(parents=True, exist_ok=True)
print(f'checkout: {ROOT}  fast mode: {FAST}')

# %% [markdown]
# ## A model to ship
# The quickstart notebook's model when it has been trained here; otherwise the same run
# (`configs/quickstart.py`: a 4-layer code model with four Medusa heads, trained on the
# standard library).

# %%
import jax

import launch
import mtp
from configs import quickstart
from mtp.train import trainer

launch.quiet_library_logs()
BACKEND = jax.default_backend()
SIZE = 'fast' if FAST else 'cpu' if BACKEND == 'cpu' else 'accelerator'
SOURCE = WORKDIRS / f'notebook_quickstart_{"fast" if FAST else BACKEND}'
if not (SOURCE / 'checkpoints').exists():
  trainer.train_and_evaluate(quickstart.get_config(SIZE), SOURCE)
loaded = mtp.load(SOURCE)
print(f'{SOURCE.name}: step {loaded.step}, {loaded.model.cfg.mtp_num_heads} '
      f'{loaded.config.model.mtp_head_type} heads')

# %% [markdown]
# ## Export to Hugging Face + Medusa
# The same as `python -m launch.export --workdir=... --format=hf --output=...`. The directory is
# written beside its final place and renamed into it, so an interrupted export leaves nothing.

# %%
from mtp.export import writer

EXPORT = WORKDIRS / f'{SOURCE.name}_hf'
if EXPORT.exists():
  shutil.rmtree(EXPORT)
summary = writer.export(SOURCE, 'hf', EXPORT)
for path in sorted(EXPORT.rglob('*')):
  if path.is_file():
    print(f'{path.relative_to(EXPORT)!s:40s} {path.stat().st_size / 1e6:8.2f} MB')
print((EXPORT / 'medusa' / 'config.json').read_text())

# %% [markdown]
# ## Reload the trunk with transformers
# No mtp code: `AutoModelForCausalLM` and `AutoTokenizer` read the directory. Its greedy
# continuation is compared with mtp's own autoregressive decoding of the same prompt.

# %%
import torch
import transformers

transformers.utils.logging.disable_progress_bar()
hf_tokenizer = transformers.AutoTokenizer.from_pretrained(EXPORT)
hf_model = transformers.AutoModelForCausalLM.from_pretrained(EXPORT, dtype=torch.float32)
prompt = 'import os\n\n\ndef read_lines(path):\n'
NEW_TOKENS = 16 if FAST else 48
ids = hf_tokenizer(prompt, return_tensors='pt').input_ids
assert ids[0].tolist() == loaded.tokenizer.encode(prompt), 'the tokenizers disagree'
with torch.no_grad():
  hf_tokens = hf_model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                pad_token_id=hf_tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
(ours,) = mtp.generate(loaded, prompt, max_new_tokens=NEW_TOKENS, decoder='autoregressive')
same = sum(a == b for a, b in zip(hf_tokens, ours.tokens))
print(f'transformers and mtp agree on {same} of {len(ours.tokens)} greedy tokens')
print(prompt + hf_tokenizer.decode(hf_tokens))

# %% [markdown]
# ## Serve
# `python -m launch.serve` starts in the background on a free port; the last cell stops it
# (and so does the end of this kernel, should a cell fail on the way).

# %%
import atexit
import time

import httpx2 as httpx

LOG = FIGURES / 'server.log'  # A file, not a pipe: a full pipe would stall the server.
# CI's fast mode compiles the default decoder only (each one requests may name compiles first).
server = subprocess.Popen(
    [sys.executable, '-m', 'launch.serve', f'--workdir={SOURCE}', '--port=0',
     *(['--decoders=auto'] if FAST else [])],
    stdout=LOG.open('w'), stderr=subprocess.STDOUT, cwd=ROOT)
atexit.register(server.terminate)
URL, deadline = None, time.monotonic() + 300
while True:
  if server.poll() is not None:
    raise RuntimeError(f'the server exited:\n{LOG.read_text()[-2000:]}')
  if URL is None:  # It prints its address once the socket is bound.
    URL = next((line.split()[-1] for line in LOG.read_text().splitlines()
                if line.startswith('launch.serve: serving')), None)
  try:
    if URL and httpx.get(URL + '/health', timeout=5).status_code == 200:
      break
  except httpx.HTTPError:
    pass
  if time.monotonic() > deadline:
    raise RuntimeError(f'the server did not become healthy:\n{LOG.read_text()[-2000:]}')
  time.sleep(0.5)
print(f'healthy at {URL}')

# %% [markdown]
# ## Query it with the OpenAI client
# Any model name is served by the one model. Streamed chunks arrive one verification step at a
# time; mtp adds a non-standard `mtp` field to each with the step's accepted tokens.

# %%
import openai

client = openai.OpenAI(base_url=URL + '/v1', api_key='not-needed')
response = client.completions.create(model='mtp', prompt=prompt, max_tokens=NEW_TOKENS,
                                     temperature=0)
print(response.choices[0].text)
print(response.usage)

print('\nstreamed, one verification step per chunk:')
for chunk in client.completions.create(model='mtp', prompt=prompt, max_tokens=NEW_TOKENS,
                                       temperature=0, stream=True):
  step = (chunk.model_extra or {}).get('mtp', {})
  if chunk.choices and chunk.choices[0].text:
    print(f'[{step.get("accepted", 0)}]{chunk.choices[0].text!r}', end=' ', flush=True)
print()

# %% [markdown]
# ## Under load
# `benchmarks.serve_load` starts its own server, then sends greedy requests from closed-loop
# clients at several concurrency levels, with the speculative and autoregressive decoders taking
# turns so machine load hits them alike. Every speculative completion must equal the
# autoregressive one.

# %%
import json

from IPython.display import Image, display

levels, requests = ('1,4', 8) if FAST else ('1,8,32', 64)
# CI's fast mode: greedy clients and two decoders, a third of the compiles and requests.
narrower = ['--settings=identical', '--decoders=auto,autoregressive'] if FAST else []
load = subprocess.run(
    [sys.executable, '-m', 'benchmarks.serve_load', f'--workdir={SOURCE}',
     f'--concurrency={levels}', f'--requests={requests}', f'--max_tokens={NEW_TOKENS}',
     f'--output={FIGURES / "serve_load.json"}', f'--plot={FIGURES / "serve_load.png"}',
     *narrower],
    cwd=ROOT, capture_output=True, text=True)
print(load.stdout[-3000:])
if load.returncode:
  raise RuntimeError(load.stderr[-3000:])
display(Image(filename=str(FIGURES / 'serve_load.png')))

# %%
# Stop the server.
server.terminate()
try:
  server.wait(timeout=30)
except subprocess.TimeoutExpired:
  server.kill()
print(f'server stopped (exit status {server.returncode}: {-server.returncode} is SIGTERM)'
      if server.returncode < 0 else f'server exited with status {server.returncode}')
