"""OpenAI request validation and response bodies, as plain dicts.

Bodies are checked by hand rather than by pydantic models so that every mistake becomes one
OpenAI-style 400 error naming the field (FastAPI's own validation answers 422 in its own shape).
Unknown fields are ignored, as OpenAI clients send some the server has no use for.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import time
import uuid

MAX_STOP_SEQUENCES = 4


class RequestError(Exception):
  """A request the server refuses: HTTP status, message, the OpenAI error type and field."""

  def __init__(self, message: str, status: int = 400, kind: str = 'invalid_request_error',
               param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.message, self.status, self.kind, self.param, self.code = (message, status, kind, param,
                                                                    code)

  def body(self) -> dict:
    return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None):
  return {'error': {'message': message, 'type': kind, 'param': param, 'code': code}}


@dataclasses.dataclass(frozen=True)
class Sampling:
  """What a request asks of the decoder (prompt aside)."""
  max_tokens: int
  temperature: float
  top_p: float
  seed: int | None
  stop: tuple[str, ...]
  decoder: str
  stream: bool


def parse_json(raw: bytes) -> dict:
  try:
    body = json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise RequestError(f'the request body is not valid JSON: {e}') from None
  if not isinstance(body, dict):
    raise RequestError(f'the request body must be a JSON object, got {type(body).__name__}')
  return body


def _int(body, name, default, low=None):
  value = body.get(name, default)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise RequestError(f'{name} must be an integer, got {json.dumps(value)}', param=name)
  if low is not None and value < low:
    raise RequestError(f'{name} must be >= {low}, got {value}', param=name)
  return int(value)


def _float(body, name, default, low, high, low_open=False):
  value = body.get(name, default)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise RequestError(f'{name} must be a number, got {json.dumps(value)}', param=name)
  if value != value or value > high or value < low or (low_open and value == low):
    bracket = '(' if low_open else '['
    raise RequestError(f'{name} must be in {bracket}{low}, {high}], got {value}', param=name)
  return float(value)


def sampling(body: dict, *, default_max_tokens: int, decoders: tuple[str, ...],
             default_decoder: str) -> Sampling:
  """The decoding fields of a completion or chat body, checked."""
  n = _int(body, 'n', 1, low=1)
  if n != 1:
    raise RequestError('n must be 1: one completion per request', param='n')
  stream = body.get('stream', False)
  if stream is None:
    stream = False
  if not isinstance(stream, bool):
    raise RequestError(f'stream must be a boolean, got {json.dumps(stream)}', param='stream')
  max_tokens = body.get('max_tokens', body.get('max_completion_tokens'))
  max_tokens = _int({'max_tokens': max_tokens}, 'max_tokens', default_max_tokens, low=1)
  # Greedy unless asked (OpenAI's default is 1): greedy is what the server promises exact.
  temperature = _float(body, 'temperature', 0.0, 0.0, 2.0)
  top_p = _float(body, 'top_p', 1.0, 0.0, 1.0, low_open=True)
  seed = body.get('seed')
  if seed is not None:
    seed = _int(body, 'seed', None)
  stop = body.get('stop')
  if stop is None:
    stop = ()
  elif isinstance(stop, str):
    stop = (stop,)
  elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
    stop = tuple(stop)
  else:
    raise RequestError('stop must be a string or a list of strings', param='stop')
  if len(stop) > MAX_STOP_SEQUENCES or any(not s for s in stop):
    raise RequestError(f'stop takes at most {MAX_STOP_SEQUENCES} non-empty strings',
                       param='stop')
  decoder = body.get('decoder', default_decoder)  # Not OpenAI's: this server's choice.
  if decoder not in decoders:
    raise RequestError(f'decoder must be one of {", ".join(decoders)}, got '
                       f'{json.dumps(decoder)}', param='decoder')
  return Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                  stop=stop, decoder=decoder, stream=stream)


def prompt(body: dict) -> str:
  """The `prompt` of a completion body: a string (or a list holding one string)."""
  value = body.get('prompt')
  if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
    value = value[0]
  if not isinstance(value, str):
    raise RequestError('prompt must be a string (one prompt per request)', param='prompt')
  if not value:
    raise RequestError('prompt is empty: give at least one character', param='prompt')
  return value


def messages(body: dict) -> list[dict]:
  """The `messages` of a chat body: [{role, content}], content a string or text parts."""
  value = body.get('messages')
  if not isinstance(value, list) or not value:
    raise RequestError('messages must be a non-empty list of {role, content} objects',
                       param='messages')
  out = []
  for i, message in enumerate(value):
    if not isinstance(message, dict) or not isinstance(message.get('role'), str):
      raise RequestError(f'messages[{i}] must be an object with a string role',
                         param='messages')
    content = message.get('content', '')
    if isinstance(content, list):  # Content parts: only text is understood.
      if not all(isinstance(p, dict) and p.get('type') == 'text'
                 and isinstance(p.get('text'), str) for p in content):
        raise RequestError(f'messages[{i}].content: only text parts are supported',
                           param='messages')
      content = ''.join(p['text'] for p in content)
    if content is None:
      content = ''
    if not isinstance(content, str):
      raise RequestError(f'messages[{i}].content must be a string', param='messages')
    out.append({**message, 'content': content})
  return out


def new_id(prefix: str) -> str:
  return f'{prefix}-{uuid.uuid4().hex[:24]}'


def usage(prompt_tokens: int, completion_tokens: int, num_steps: int,
          tokens_per_step: float) -> dict:
  """OpenAI's usage, plus the decoder's verification steps and tokens per step."""
  return {'prompt_tokens': prompt_tokens, 'completion_tokens': completion_tokens,
          'total_tokens': prompt_tokens + completion_tokens, 'num_steps': num_steps,
          'tokens_per_step': round(tokens_per_step, 4)}


def completion_body(rid: str, model: str, text: str, finish_reason: str | None, *,
                    chat: bool, usage_: dict | None = None, extra: dict | None = None,
                    chunk: bool = False) -> dict:
  """A (chat) completion response, or one streamed chunk of it."""
  if chat:
    key = 'delta' if chunk else 'message'
    choice = {'index': 0, key: {'role': 'assistant', 'content': text},
              'finish_reason': finish_reason, 'logprobs': None}
    kind = 'chat.completion.chunk' if chunk else 'chat.completion'
  else:
    choice = {'index': 0, 'text': text, 'finish_reason': finish_reason, 'logprobs': None}
    kind = 'text_completion'
  body = {'id': rid, 'object': kind, 'created': int(time.time()), 'model': model,
          'choices': [choice]}
  if usage_ is not None:
    body['usage'] = usage_
  if extra is not None:
    body['mtp'] = extra
  return body
