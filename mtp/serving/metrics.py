"""Server metrics in the Prometheus text format (no client library needed for a few series)."""

from __future__ import annotations

import bisect
import threading
from typing import Callable

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
  """Counters, gauges and histograms, updated from the event loop and the decode thread."""

  def __init__(self):
    self._lock = threading.Lock()
    self.requests: dict[tuple[str, int], int] = {}
    self.counters = dict(prompt_tokens=0, completion_tokens=0, verification_steps=0,
                         batches=0, batch_rows=0, batch_failures=0, cancelled=0)
    self.latency = [0] * (len(LATENCY_BUCKETS) + 1)
    self.latency_sum = 0.0
    self.first_token = [0] * (len(LATENCY_BUCKETS) + 1)
    self.first_token_sum = 0.0
    self.gauges = dict(queue_depth=lambda: 0, active_rows=lambda: 0, warm=lambda: 0)
    # Counters kept elsewhere: name -> (help, a function reading it).
    self.external: dict[str, tuple[str, Callable[[], int]]] = {}

  def request(self, endpoint: str, status: int) -> None:
    with self._lock:
      key = (endpoint, int(status))
      self.requests[key] = self.requests.get(key, 0) + 1

  def add(self, **counts) -> None:
    with self._lock:
      for name, value in counts.items():
        self.counters[name] += value

  def observe_latency(self, seconds: float, first_token: float | None = None) -> None:
    with self._lock:
      self.latency[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
      self.latency_sum += seconds
      if first_token is not None:
        self.first_token[bisect.bisect_left(LATENCY_BUCKETS, first_token)] += 1
        self.first_token_sum += first_token

  def render(self) -> str:
    with self._lock:
      lines = ['# HELP mtp_requests_total HTTP requests by endpoint and status code.',
               '# TYPE mtp_requests_total counter']
      for (endpoint, status), n in sorted(self.requests.items()):
        lines.append(f'mtp_requests_total{{endpoint="{endpoint}",code="{status}"}} {n}')
      errors = sum(n for (_, s), n in self.requests.items() if s >= 400)
      lines += ['# HELP mtp_request_errors_total Requests answered with an error (4xx, 5xx).',
                '# TYPE mtp_request_errors_total counter', f'mtp_request_errors_total {errors}']
      help_ = dict(prompt_tokens='Prompt tokens of decoded requests.',
                   completion_tokens='Tokens generated.',
                   verification_steps='Verification steps (decode loop passes) over all rows.',
                   batches='Prefills: a batch started or rows joining a running one.',
                   batch_rows='Requests put into batches.',
                   batch_failures='Failed prefills or chunks (their requests got 500).',
                   cancelled='Requests whose client left before the end.')
      counters = dict(self.counters)
      for name, (what, read) in self.external.items():
        help_[name], counters[name] = what, read()
      for name, value in counters.items():
        lines += [f'# HELP mtp_{name}_total {help_[name]}', f'# TYPE mtp_{name}_total counter',
                  f'mtp_{name}_total {value}']
      steps = self.counters['verification_steps']
      ratio = (self.counters['completion_tokens'] - self.counters['batch_rows']) / steps \
          if steps else 0.0
      lines += ['# HELP mtp_tokens_per_step Tokens emitted per verification step (the first '
                'token of each request, from the prefill, excluded).',
                '# TYPE mtp_tokens_per_step gauge', f'mtp_tokens_per_step {ratio:.4f}']
      for name, fn in self.gauges.items():
        lines += [f'# TYPE mtp_{name} gauge', f'mtp_{name} {fn()}']
      for name, counts, total, what in (
          ('request_latency_seconds', self.latency, self.latency_sum,
           'Request latency, arrival to last token.'),
          ('time_to_first_token_seconds', self.first_token, self.first_token_sum,
           'Arrival to first token.')):
        lines += [f'# HELP mtp_{name} {what}', f'# TYPE mtp_{name} histogram']
        cumulative = 0
        for bound, n in zip(LATENCY_BUCKETS + (float('inf'),), counts):
          cumulative += n
          le = '+Inf' if bound == float('inf') else repr(float(bound))
          lines.append(f'mtp_{name}_bucket{{le="{le}"}} {cumulative}')
        lines += [f'mtp_{name}_sum {total:.6f}', f'mtp_{name}_count {cumulative}']
      return '\n'.join(lines) + '\n'
