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
MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs.


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
class Options:
  """What a request asks of the decoder (its prompt aside).

  Attributes:
    max_tokens, temperature, top_p, top_k: as OpenAI's (top_k, 0 = off, is an extension).
    seed: the request's seed; None: a fresh one (`batcher` draws it).
    stop: stop strings (the text is cut before the first).
    decoder: this server's decoder to use (an extension).
    stream: server-sent events.
    n: completions of the prompt (rows of the request).
    logprobs: per token, the chosen token's log-probability and this many alternatives'
      (0: none but the chosen's); None: no log-probabilities.
    chat: a chat completion (its logprobs take chat's shape).
  """
  max_tokens: int
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0
  seed: int | None = None
  stop: tuple[str, ...] = ()
  decoder: str = 'auto'
  stream: bool = False
  n: int = 1
  logprobs: int | None = None
  chat: bool = False


# Fields the server refuses (400, named) unless they hold their no-op value: accepting them
# silently would return something other than what the client asked for.
_UNSUPPORTED = {'presence_penalty': 0, 'frequency_penalty': 0, 'repetition_penalty': 1,
                'logit_bias': None, 'echo': False, 'suffix': None, 'best_of': None,
                'tools': None, 'functions': None}


def parse_json(raw: bytes) -> dict:
  try:
    body = json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise RequestError(f'the request body is not valid JSON: {e}') from None
  except (ValueError, RecursionError) as e:  # A huge integer literal, deep nesting.
    raise RequestError(f'the request body cannot be read: {e}') from None
  if not isinstance(body, dict):
    raise RequestError(f'the request body must be a JSON object, got {type(body).__name__}')
  return body


def _int(body, name, default, low=None, high=None):
  value = body.get(name, default)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise RequestError(f'{name} must be an integer, got {_show(value)}', param=name)
  if low is not None and value < low:
    raise RequestError(f'{name} must be >= {low}, got {value}', param=name)
  if high is not None and value > high:
    raise RequestError(f'{name} must be <= {high}, got {value}', param=name)
  return int(value)


def _float(body, name, default, low, high, low_open=False):
  value = body.get(name, default)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise RequestError(f'{name} must be a number, got {_show(value)}', param=name)
  if value != value or value > high or value < low or (low_open and value == low):
    bracket = '(' if low_open else '['
    raise RequestError(f'{name} must be in {bracket}{low}, {high}], got {value}', param=name)
  return float(value)


def _show(value) -> str:
  """A value for an error message, kept short."""
  text = json.dumps(value)
  return text if len(text) <= 60 else text[:57] + '...'


def options(body: dict, *, default_max_tokens: int, decoders: tuple[str, ...],
            default_decoder: str, chat: bool = False, max_n: int = 1) -> Options:
  """The decoding fields of a completion or chat body, checked (400s name the field)."""
  for name, neutral in _UNSUPPORTED.items():
    value = body.get(name)
    if value is not None and value != neutral and not (name == 'best_of' and value == 1):
      raise RequestError(f'{name} is not supported by this server (got {_show(value)})',
                         param=name)
  n = _int(body, 'n', 1, low=1)
  if n > max_n:
    raise RequestError(f'n must be at most {max_n} (the server\'s batch), got {n}', param='n')
  stream = body.get('stream', False)
  if stream is None:
    stream = False
  if not isinstance(stream, bool):
    raise RequestError(f'stream must be a boolean, got {_show(stream)}', param='stream')
  max_tokens = body.get('max_tokens', body.get('max_completion_tokens'))
  max_tokens = _int({'max_tokens': max_tokens}, 'max_tokens', default_max_tokens, low=1)
  # Greedy unless asked (OpenAI's default is 1): greedy is what the server promises exact.
  temperature = _float(body, 'temperature', 0.0, 0.0, 2.0)
  top_p = _float(body, 'top_p', 1.0, 0.0, 1.0, low_open=True)
  top_k = _int(body, 'top_k', 0, low=0)
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
  stop = tuple(_text(s, 'stop') for s in stop)
  if chat:
    wants = body.get('logprobs', False)
    if wants is not None and not isinstance(wants, bool):
      raise RequestError(f'logprobs must be a boolean, got {_show(wants)}', param='logprobs')
    top = _int(body, 'top_logprobs', None, low=0, high=MAX_LOGPROBS)
    if top is not None and not wants:
      raise RequestError('top_logprobs needs logprobs: true', param='top_logprobs')
    logprobs = (top or 0) if wants else None
  else:
    logprobs = _int(body, 'logprobs', None, low=0, high=MAX_LOGPROBS)
  decoder = body.get('decoder', default_decoder)  # Not OpenAI's: this server's choice.
  if decoder not in decoders:
    raise RequestError(f'decoder must be one of {", ".join(decoders)}, got '
                       f'{_show(decoder)}', param='decoder')
  return Options(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                 seed=seed, stop=stop, decoder=decoder, stream=stream, n=n, logprobs=logprobs,
                 chat=chat)


def prompt(body: dict) -> str:
  """The `prompt` of a completion body: a string (or a list holding one string)."""
  value = body.get('prompt')
  if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
    value = value[0]
  if not isinstance(value, str):
    raise RequestError('prompt must be a string (one prompt per request)', param='prompt')
  if not value:
    raise RequestError('prompt is empty: give at least one character', param='prompt')
  return _text(value, 'prompt')


def _text(value: str, param: str) -> str:
  """`value`, or a 400 when it is not Unicode text (a lone surrogate from a JSON escape)."""
  try:
    value.encode('utf-8')
  except UnicodeEncodeError as e:
    raise RequestError(f'{param} is not valid Unicode text ({e.reason} at {e.start})',
                       param=param) from None
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
    out.append({**message, 'content': _text(content, 'messages')})
  return out


def new_id(prefix: str) -> str:
  return f'{prefix}-{uuid.uuid4().hex[:24]}'


def usage(prompt_tokens: int, completion_tokens: int, num_steps: int,
          tokens_per_step: float) -> dict:
  """OpenAI's usage, plus the decoder's verification steps and tokens per step."""
  return {'prompt_tokens': prompt_tokens, 'completion_tokens': completion_tokens,
          'total_tokens': prompt_tokens + completion_tokens, 'num_steps': num_steps,
          'tokens_per_step': round(tokens_per_step, 4)}


def completion_body(rid: str, model: str, choices: list[dict], *, chat: bool,
                    usage_: dict | None = None, extra: dict | None = None,
                    chunk: bool = False) -> dict:
  """A (chat) completion response, or one streamed chunk of it, from `choice` dicts."""
  kind = ('chat.completion.chunk' if chunk else 'chat.completion') if chat else 'text_completion'
  body = {'id': rid, 'object': kind, 'created': int(time.time()), 'model': model,
          'choices': choices}
  if usage_ is not None:
    body['usage'] = usage_
  if extra is not None:
    body['mtp'] = extra
  return body


def choice(index: int, text: str, finish_reason: str | None, *, chat: bool,
           chunk: bool = False, logprobs: dict | None = None, role: bool = True) -> dict:
  """One choice of a response: its text (a chat message or delta), finish reason, logprobs."""
  if chat:
    key = 'delta' if chunk else 'message'
    message = {'role': 'assistant', 'content': text} if role else {'content': text}
    return {'index': index, key: message, 'finish_reason': finish_reason,
            'logprobs': logprobs}
  return {'index': index, 'text': text, 'finish_reason': finish_reason, 'logprobs': logprobs}


def logprobs_body(tokenizer, tokens, chosen, top_ids, top_values, *, chat: bool,
                  offset: int = 0) -> dict | None:
  """OpenAI's logprobs of some emitted tokens (chat's `content` list, or the completions'
  parallel lists; `offset`: the text offset of the first token), from the model's
  log-probabilities (`decode` keeps them: temperature 1, before top-k and top-p)."""
  texts = [tokenizer.decode([int(t)]) for t in tokens]
  def alternatives(i):
    return [(tokenizer.decode([int(t)]), float(v)) for t, v in zip(top_ids[i], top_values[i])]
  if chat:
    return {'content': [
        {'token': text, 'logprob': float(lp), 'bytes': list(text.encode('utf-8')),
         'top_logprobs': [{'token': t, 'logprob': v, 'bytes': list(t.encode('utf-8'))}
                          for t, v in alternatives(i)]}
        for i, (text, lp) in enumerate(zip(texts, chosen))]}
  offsets, position = [], offset
  for text in texts:
    offsets.append(position)
    position += len(text)
  return {'tokens': texts, 'token_logprobs': [float(x) for x in chosen],
          'top_logprobs': [dict(alternatives(i)) for i in range(len(texts))],
          'text_offset': offsets}
