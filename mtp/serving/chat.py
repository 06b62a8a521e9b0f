"""Chat prompts: the model's own chat template (Jinja, Hugging Face conventions), sandboxed.

A template is code that came with the weights: it runs in jinja2's immutable sandbox, with the
variables Hugging Face templates expect (`messages`, `add_generation_prompt`, `bos_token`,
`eos_token`) and its `raise_exception` helper.
"""

from __future__ import annotations

import functools

import jinja2
from jinja2 import sandbox

from mtp.serving import schemas


class TemplateError(Exception):
  pass


def _raise(message):
  raise TemplateError(message)


@functools.lru_cache(maxsize=8)
def _compiled(source: str) -> jinja2.Template:
  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  env.globals['raise_exception'] = _raise
  return env.from_string(source)


def special_token_text(tokenizer, token_id: int) -> str:
  """The text of a special token (what templates write for bos/eos)."""
  text = tokenizer.hf_tokenizer.id_to_token(int(token_id))
  return text or ''


def render(tokenizer, messages: list[dict]) -> str:
  """The prompt text of a conversation; RequestError (400) when it cannot be made."""
  source = tokenizer.chat_template
  if not source:
    raise schemas.RequestError(
        'this model has no chat template (chat_template.jinja beside its tokenizer): use '
        '/v1/completions with a plain prompt', param='messages', code='no_chat_template')
  try:
    return _compiled(source).render(
        messages=messages, add_generation_prompt=True,
        bos_token=special_token_text(tokenizer, tokenizer.bos_id),
        eos_token=special_token_text(tokenizer, tokenizer.eos_id))
  except TemplateError as e:
    raise schemas.RequestError(f'the chat template refused the messages: {e}',
                               param='messages') from None
  except jinja2.TemplateError as e:
    raise schemas.RequestError(f'the chat template failed: {e}', param='messages') from None


def encode(tokenizer, text: str) -> list[int]:
  """Ids of a rendered chat prompt, the template's special tokens as their own ids.

  `Tokenizer.encode(text)` spells special-token text out as plain text (user text must not
  forge them); a chat template writes them on purpose (SmolLM2's `<|im_start|>`), and Hugging
  Face encodes them as their ids, as this does. As there, a marker typed inside a message
  becomes a marker too.
  """
  return tokenizer.encode(text, special=True)
