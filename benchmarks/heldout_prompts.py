"""Held-out prompts for the decoding benchmarks: code and prose that no shipped model trained on.

  * code: the first lines of code of installed non-stdlib packages (`corpora.heldout_files`),
    cut at a line boundary (`calibration.code_prompts`);
  * prose: plain-text paragraphs of installed packages' long descriptions (the README in their
    *.dist-info/METADATA; markdown, lists, code and links left out), cut after a sentence.

Every prompt holds at most `prompt_tokens` tokens of the given tokenizer and at least half.
"""

from __future__ import annotations

import importlib.metadata
import re

KINDS = ('code', 'prose')
# Distributions whose description is not held-out prose: this project's own README.
EXCLUDED_DISTRIBUTIONS = frozenset({'mtp'})
# Markdown / reStructuredText markup, code, links, lists, tables: not plain prose.
_MARKUP = re.compile(r'[`*_#<>|\[\]{}=\\~^@$]|https?://|www\.|::|\.\. |^\s*([-+>.]|\d+[.)])',
                     re.MULTILINE)


def code(tokenizer, num_prompts: int, prompt_tokens: int) -> list[str]:
  """The first lines of code of held-out files (absl, ml_collections), as in benchmarks.decode."""
  from mtp.data import corpora
  from mtp.decode import calibration
  return calibration.code_prompts(corpora.heldout_files(), tokenizer, num_prompts,
                                  max_tokens=prompt_tokens, min_tokens=prompt_tokens // 2)


def is_plain_prose(paragraph: str) -> bool:
  """Sentences of ordinary text: no markup or indented code, few capitals (licence shouting)."""
  text = ' '.join(paragraph.split())
  if len(text) < 150 or _MARKUP.search(paragraph) or text[-1] not in '.!?':
    return False
  if any(line.startswith((' ', '\t')) for line in paragraph.splitlines()):
    return False
  wordy = sum(c.isalpha() or c.isspace() for c in text)
  return wordy > 0.9 * len(text) and sum(c.isupper() for c in text) < 0.08 * len(text)


def _description(dist: importlib.metadata.Distribution) -> str:
  """The long description: the METADATA body, or the legacy `Description` header."""
  metadata = dist.metadata
  body = metadata.get_payload() if hasattr(metadata, 'get_payload') else ''
  return body or metadata.get('Description') or ''


def prose_paragraphs() -> dict[str, list[str]]:
  """Plain-prose paragraphs (whitespace normalised) of each installed distribution's README.

  A paragraph already taken from another distribution (shared boilerplate) is skipped.
  """
  dists, found, seen = {}, {}, set()
  for dist in importlib.metadata.distributions():
    name = re.sub(r'[-_.]+', '-', (dist.metadata['Name'] or '').lower())
    if name and name not in EXCLUDED_DISTRIBUTIONS:
      dists.setdefault(name, dist)
  for name in sorted(dists):
    paragraphs = []
    for paragraph in re.split(r'\n\s*\n', _description(dists[name])):
      text = ' '.join(paragraph.split())
      if is_plain_prose(paragraph) and text not in seen:
        seen.add(text)
        paragraphs.append(text)
    if paragraphs:
      found[name] = paragraphs
  return found


def _sentences(paragraphs: list[str]):
  """(separator, sentence) pairs: a blank line before each paragraph, else a space."""
  for paragraph in paragraphs:
    for j, sentence in enumerate(re.split(r'(?<=[.!?])\s+', paragraph)):
      yield ('\n\n' if j == 0 else ' '), sentence


def prose(tokenizer, num_prompts: int, prompt_tokens: int) -> list[str]:
  """One prompt per distribution, those with the most prose first: as many whole sentences
  of its paragraphs as fit in `prompt_tokens`."""
  prompts = []
  by_length = sorted(prose_paragraphs().items(), key=lambda kv: (-sum(map(len, kv[1])), kv[0]))
  for _, paragraphs in by_length:
    text = ''
    for separator, sentence in _sentences(paragraphs):
      longer = text + separator + sentence if text else sentence
      if len(tokenizer.encode(longer)) > prompt_tokens:
        break
      text = longer
    if len(tokenizer.encode(text)) >= prompt_tokens // 2:
      prompts.append(text)
    if len(prompts) == num_prompts:
      break
  return prompts


def of_kind(kind: str, tokenizer, num_prompts: int, prompt_tokens: int) -> list[str]:
  """`code` or `prose` prompts by name; ValueError for another name or when none are found."""
  builders = dict(code=code, prose=prose)
  if kind not in builders:
    raise ValueError(f'prompt kind must be one of {", ".join(KINDS)}, got {kind!r}')
  prompts = builders[kind](tokenizer, num_prompts, prompt_tokens)
  if not prompts:
    raise ValueError(f'no {kind} prompts of at least {prompt_tokens // 2} tokens found')
  return prompts
