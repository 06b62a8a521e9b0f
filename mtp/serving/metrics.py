"""Server metrics in the Prometheus text format, written by `prometheus_client`.

The server keeps its own counts (updated from the event loop and the decode thread under one
lock) and `prometheus_client` writes them out on each scrape: it escapes label values and
formats every line, so no request can forge a series. Labels stay bounded: `endpoint` is a
route's template or `UNMATCHED`, never a raw path.
"""

from __future__ import annotations

import bisect
import threading
from typing import Callable

import prometheus_client
from prometheus_client import core
from prometheus_client import registry as registry_lib

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
UNMATCHED = 'unmatched'  # The endpoint label of requests no route matched.

_COUNTER_HELP = dict(prompt_tokens='Prompt tokens of decoded requests.',
                     completion_tokens='Tokens generated.',
                     verification_steps='Verification steps (decode loop passes) over all rows.',
                     batches='Prefills: a batch started or rows joining a running one.',
                     batch_rows='Requests put into batches.',
                     batch_failures='Failed prefills or chunks (their requests got 500).',
                     cancelled='Requests whose client left before the end.')


class Metrics(registry_lib.Collector):
  """Counters, gauges and histograms, updated from the event loop and the decode thread."""

  def __init__(self):
    self._lock = threading.Lock()
    self.requests: dict[tuple[str, int], int] = {}
    self.counters = {name: 0 for name in _COUNTER_HELP}
    self.latency = [0] * (len(LATENCY_BUCKETS) + 1)
    self.latency_sum = 0.0
    self.first_token = [0] * (len(LATENCY_BUCKETS) + 1)
    self.first_token_sum = 0.0
    self.gauges = dict(queue_depth=lambda: 0, active_rows=lambda: 0, warm=lambda: 0)
    # Counters kept elsewhere: name -> (help, a function reading it).
    self.external: dict[str, tuple[str, Callable[[], int]]] = {}
    self._registry = prometheus_client.CollectorRegistry(auto_describe=False)
    self._registry.register(self)

  def request(self, endpoint: str, status: int) -> None:
    """Counts a request answered with `status`; `endpoint` is a route template or UNMATCHED."""
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
    """The exposition (text format 0.0.4)."""
    return prometheus_client.generate_latest(self._registry).decode('utf-8')

  def collect(self):
    """`prometheus_client`'s collector protocol: every family, read under the lock."""
    with self._lock:
      requests = dict(self.requests)
      counters = dict(self.counters)
      histograms = (('request_latency_seconds', list(self.latency), self.latency_sum,
                     'Request latency, arrival to last token.'),
                    ('time_to_first_token_seconds', list(self.first_token),
                     self.first_token_sum, 'Arrival to first token.'))
    family = core.CounterMetricFamily('mtp_requests', 'HTTP requests by endpoint and status '
                                      'code.', labels=('endpoint', 'code'))
    for (endpoint, status), n in sorted(requests.items()):
      family.add_metric((endpoint, str(status)), n)
    yield family
    yield core.CounterMetricFamily(
        'mtp_request_errors', 'Requests answered with an error (4xx, 5xx).',
        value=sum(n for (_, s), n in requests.items() if s >= 400))
    help_ = dict(_COUNTER_HELP)
    for name, (what, read) in self.external.items():
      help_[name], counters[name] = what, read()
    for name, value in counters.items():
      yield core.CounterMetricFamily(f'mtp_{name}', help_[name], value=value)
    steps = counters['verification_steps']
    ratio = (counters['completion_tokens'] - counters['batch_rows']) / steps if steps else 0.0
    yield core.GaugeMetricFamily('mtp_tokens_per_step', 'Tokens emitted per verification step '
                                 '(the first token of each request, from the prefill, '
                                 'excluded).', value=ratio)
    for name, read in self.gauges.items():
      yield core.GaugeMetricFamily(f'mtp_{name}', name.replace('_', ' ').capitalize() + '.',
                                   value=read())
    for name, counts, total, what in histograms:
      cumulative, buckets = 0, []
      for bound, n in zip(LATENCY_BUCKETS + (float('inf'),), counts):
        cumulative += n
        buckets.append(('+Inf' if bound == float('inf') else repr(float(bound)), cumulative))
      yield core.HistogramMetricFamily(f'mtp_{name}', what, buckets=buckets, sum_value=total)
