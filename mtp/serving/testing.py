"""Test helpers: a tiny trained workdir with a chat template, and references to compare with."""

from __future__ import annotations

import pathlib

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def tiny_workdir(path: str | pathlib.Path, chat_template: str | None = TEMPLATE
                 ) -> pathlib.Path:
  """`train_tiny_workdir` (2 steps), with a chat template beside its tokenizer."""
  from mtp.data import tokenizer as tokenizer_lib
  from mtp.train import testing
  workdir = testing.train_tiny_workdir(path)
  if chat_template is not None:
    (workdir / tokenizer_lib.CHAT_TEMPLATE_FILENAME).write_text(chat_template)
  return workdir


def references(loaded, prompts: list[str], max_tokens: int, decoder: str = 'speculative'
               ) -> dict[str, list[int]]:
  """What `launch.generate` gives (greedy, batch size 1) for each prompt: its tokens."""
  import mtp
  unique = sorted(set(prompts))
  generations = mtp.generate(loaded, unique, max_new_tokens=max_tokens, decoder=decoder,
                             batch_size=1)
  return {p: g.tokens for p, g in zip(unique, generations)}
