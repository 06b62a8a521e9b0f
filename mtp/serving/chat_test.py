"""Chat templates: Hugging Face variables, a sandbox, and clear 400s."""

import pytest

from mtp.data import tokenizer as tokenizer_lib
from mtp.serving import chat
from mtp.serving import schemas


def _tokenizer(template):
  base = tokenizer_lib.byte_tokenizer()
  return tokenizer_lib.Tokenizer(base.hf_tokenizer, chat_template=template)


def test_renders_messages_generation_prompt_and_special_tokens():
  tok = _tokenizer('{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}'
                   '{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<assistant>'
                   '{% endif %}')
  text = chat.render(tok, [{'role': 'user', 'content': 'hi'}])
  assert text == '<bos><user>hi<eos><assistant>'


def test_no_template_is_a_400_naming_the_alternative():
  with pytest.raises(schemas.RequestError) as e:
    chat.render(_tokenizer(None), [{'role': 'user', 'content': 'hi'}])
  assert e.value.status == 400 and '/v1/completions' in e.value.message


def test_raise_exception_and_unsafe_templates_are_400s():
  tok = _tokenizer("{{ raise_exception('roles must alternate') }}")
  with pytest.raises(schemas.RequestError, match='roles must alternate'):
    chat.render(tok, [{'role': 'user', 'content': 'hi'}])
  # The sandbox refuses attribute access to Python internals.
  tok = _tokenizer('{{ messages.__class__.__mro__[1].__subclasses__() }}')
  with pytest.raises(schemas.RequestError):
    chat.render(tok, [{'role': 'user', 'content': 'hi'}])


def test_message_content_parts_are_joined_and_bad_messages_refused():
  assert schemas.messages({'messages': [{'role': 'user', 'content': [
      {'type': 'text', 'text': 'a'}, {'type': 'text', 'text': 'b'}]}]})[0]['content'] == 'ab'
  for bad in ([], [{'content': 'x'}], [{'role': 'user', 'content': 3}],
              [{'role': 'user', 'content': [{'type': 'image_url'}]}]):
    with pytest.raises(schemas.RequestError):
      schemas.messages({'messages': bad})
