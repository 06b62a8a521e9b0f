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
# # mtp quickstart: train a multi-token model, then decode it faster, exactly
#
# [![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/your-org/mtp/blob/main/notebooks/01_quickstart.ipynb)
#
# A small transformer learns the Python standard library's source together with four extra
# **heads** that predict the tokens two to five places ahead. At decoding time the heads draft
# several tokens, the trunk checks them all in one forward pass, and the longest correct prefix
# is kept: the output is exactly the one of plain greedy decoding, in fewer steps.
#
# This notebook trains the model, plots how the heads learn, decodes code the model never saw
# with both decoders and checks that they agree token for token, then streams and samples.
# It runs unchanged on CPU, GPU and TPU runtimes; sizes follow the backend.

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
  subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', '-e', f'{ROOT}[bench]',
                  *jax_build], check=True)
if ROOT is None:
  raise RuntimeError('Open this notebook from a checkout of mtp, or on Colab.')
os.chdir(ROOT)  # configs/ and results/ are relative to the checkout.
sys.path.insert(0, str(ROOT))
WORKDIRS = pathlib.Path(os.environ.get('MTP_NOTEBOOK_WORKDIRS', ROOT / 'workdirs'))
FIGURES = ROOT / 'results' / 'notebooks' / '01_quickstart'
FIGURES.mkdir(parents=True, exist_ok=True)
print(f'checkout: {ROOT}  fast mode: {FAST}')

# %% [markdown]
# ## The model and its training run
#
# `configs/code_small.py` is the README demo's model: 4 layers of width 256, a 4,096-token BPE
# vocabulary trained on the corpus, and four Medusa heads (one residual block each) trained
# jointly with the trunk. `configs/quickstart.py` sizes its run for the backend: 300 steps on a
# CPU, 1,500 at a larger batch on an accelerator, and a tiny model in fast mode (CI).

# %%
import jax
import matplotlib.pyplot as plt

import launch
from configs import quickstart
from mtp import plotting

launch.quiet_library_logs()

BACKEND = jax.default_backend()
SIZE = 'fast' if FAST else 'cpu' if BACKEND == 'cpu' else 'accelerator'
config = quickstart.get_config(SIZE)
WORKDIR = WORKDIRS / f'notebook_quickstart_{"fast" if FAST else BACKEND}'
NUM_HEADS = config.model.mtp_num_heads
MODEL = (f'{config.model.num_layers}-layer d{config.model.embed_dim} model, '
         f'{NUM_HEADS} {config.model.mtp_head_type} heads')
HARDWARE = plotting.hardware()
print(f'{MODEL}; {config.num_train_steps} steps of {config.data.batch_size} x '
      f'{config.data.seq_len} tokens on {HARDWARE}; workdir {WORKDIR}')

# %% [markdown]
# ## Train
# Checkpoints, `config.json`, the tokenizer and `metrics.jsonl` go to the workdir. Running the
# cell again resumes where it stopped (and does nothing once training is done). The same run
# from a terminal: `python -m launch.train --config=configs/quickstart.py:cpu --workdir=...`.

# %%
import time

from mtp.train import trainer
from mtp.train import writers

start = time.perf_counter()
trainer.train_and_evaluate(config, WORKDIR)
print(f'training took {time.perf_counter() - start:.0f} s (0 if the workdir was already trained)')
records = writers.read_metrics(WORKDIR)
last = [r for r in records if 'loss' in r][-1]
print(f'step {last["step"]}: next-token accuracy {last["ntp_acc"]:.3f}, ' + ', '.join(
    f'head {k} {last[f"head_{k}_acc"]:.3f}' for k in range(1, NUM_HEADS + 1)))

# %% [markdown]
# ## How the heads learn
# Head *k* predicts the token *k + 1* places ahead, a harder task the further it looks: its loss
# sits above the next-token loss, and its accuracy below. Those accuracies are what decoding
# will accept.

# %%
fig = plotting.learning_curves(records, NUM_HEADS, f'{MODEL} on the standard library, '
                                                  f'{HARDWARE}')
fig.savefig(FIGURES / 'learning_curves.png', dpi=110)
plt.show()

# %% [markdown]
# ## Decode code the model never saw
# The prompts are the first lines of installed packages outside the standard library. Each is
# completed greedily, once by plain autoregressive decoding (one forward pass per token) and
# once by speculative decoding (the heads draft a chain, the trunk verifies it). Compilation is
# excluded from the timings; the outputs must match token for token.

# %%
import mtp
from mtp.data import corpora
from mtp.decode import calibration

loaded = mtp.load(WORKDIR)
NUM_PROMPTS, NEW_TOKENS = (3, 32) if FAST else (8, 128)
prompts = calibration.code_prompts(corpora.heldout_files(), loaded.tokenizer, NUM_PROMPTS,
                                   max_tokens=128, min_tokens=32)
runs = {
    'autoregressive': dict(decoder='autoregressive'),
    'speculative, chain': dict(decoder='speculative', tree='chain'),
    'speculative, tree': dict(decoder='speculative', tree='default'),
}
results = {name: mtp.generate(loaded, prompts, max_new_tokens=NEW_TOKENS, batch_size=1, **kw)
           for name, kw in runs.items()}
reference = results['autoregressive']
for name, generations in results.items():
  same = all(g.tokens == r.tokens for g, r in zip(generations, reference))
  tokens = sum(len(g.tokens) for g in generations)
  steps = sum(g.num_steps for g in generations)
  print(f'{name:20s} {tokens / sum(g.seconds for g in generations):7.1f} tokens/s  '
        f'{tokens / max(steps, 1):.2f} tokens per step  identical to autoregressive: {same}')
  assert same, f'{name} differs from autoregressive decoding'

# %%
print(prompts[0][-300:] + '\033[1m' + results['speculative, chain'][0].completion + '\033[0m')

# %% [markdown]
# The completion is in bold after the prompt's last lines. How it reads depends on the training
# budget: the CPU setting trains 300 steps, and such a short-trained model's greedy
# continuations soon fall into blank lines or repeated tokens. Its heads predict those
# perfectly, which inflates the tokens per step below: read the speed-up with the completion
# in view. The accelerator setting trains five times as many steps.

# %% [markdown]
# ## Several tokens per step
# Each verification step emits the accepted drafts plus one token of the trunk's own. The
# histogram counts steps by how many tokens they emitted; the bars compare the decoders.

# %%
import numpy as np

histogram = np.sum([np.pad(g.accepted_histogram, (0, 8 - len(g.accepted_histogram)))
                    for g in results['speculative, chain']], axis=0)
fig = plotting.accepted_histogram(histogram, f'Speculative chain decoding, {MODEL}, '
                                             f'held-out code, {HARDWARE}')
fig.savefig(FIGURES / 'accepted_histogram.png', dpi=110)
plt.show()

names = list(results)
speeds = [sum(len(g.tokens) for g in results[n]) / sum(g.seconds for g in results[n])
          for n in names]
per_step = [sum(len(g.tokens) for g in results[n]) / max(sum(g.num_steps for g in results[n]), 1)
            for n in names]
fig = plotting.speed_bars(names, speeds, per_step, f'Greedy decoding at batch 1, {MODEL}, '
                                                   f'{HARDWARE}', baseline='autoregressive')
fig.savefig(FIGURES / 'decoder_speeds.png', dpi=110)
plt.show()

# %% [markdown]
# ## Stream a completion
# `on_text` receives each prompt's new text as soon as the loop accepts it.

# %%
print(prompts[1][-200:], end='')
mtp.generate(loaded, prompts[1], max_new_tokens=NEW_TOKENS,
             on_text=lambda index, text, finished: print(text, end='', flush=True))
print()

# %% [markdown]
# ## Sample
# With a temperature, speculative decoding uses rejection sampling: the tokens follow the
# model's own distribution exactly, as plain sampling would. Different seeds, different code.

# %%
for seed in range(3):
  (sample,) = mtp.generate(loaded, 'def ', max_new_tokens=NEW_TOKENS, temperature=0.8,
                           top_p=0.95, seed=seed)
  print(f'--- seed {seed} ({sample.mean_accepted:.2f} tokens per step)\ndef {sample.completion}')
