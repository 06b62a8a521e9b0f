"""The batcher's parts: stop sequences over streamed text, exact rows in a shared batch, and the
shared-matmul mode."""

import collections
import concurrent.futures

import openai
import pytest

import mtp
from mtp.serving import batcher as batcher_lib
from mtp.serving import server
from mtp.serving import testing


def test_stop_text_holds_back_what_could_become_a_stop_sequence():
  stop = batcher_lib._StopText(('END',))
  # The last len('END') - 1 characters might start 'END': held back.
  assert stop.push('abcE', final=False) == ('ab', False)
  assert stop.push('N', final=False) == ('c', False)
  assert stop.push('Dxyz', final=False) == ('', True)  # Cut right before END.
  free = batcher_lib._StopText(())
  assert free.push('abc', final=False) == ('abc', False)
  late = batcher_lib._StopText(('zz',))
  assert late.push('abz', final=False) == ('ab', False)
  assert late.push('', final=True) == ('z', False)  # The end releases what was held.


def test_a_batch_with_a_free_row_takes_shorter_chunks():
  """Requests join between chunks: while a row is free, chunks are short so that one arriving
  mid-chunk waits less; a full batch takes long ones (fewer host round trips); a stream takes
  one step; a steps_per_chunk set by the server's owner holds either way."""
  steps = batcher_lib._chunk_steps
  assert steps(False, True, None) == batcher_lib.STEPS_WHILE_A_ROW_IS_FREE
  assert steps(False, False, None) == batcher_lib.STEPS_PER_CHUNK
  assert batcher_lib.STEPS_WHILE_A_ROW_IS_FREE < batcher_lib.STEPS_PER_CHUNK
  assert steps(True, False, None) == steps(True, True, 8) == 1
  assert steps(False, True, 8) == steps(False, False, 8) == 8


def test_exact_rows_share_the_batch_where_products_are_row_invariant(tiny_workdir):
  """In bfloat16 on CPU a row's products have the same bits in any batch (`products`): there the
  exact server shares one batch instead of mapping rows one by one (float32 still maps them),
  and among concurrent requests each greedy one returns launch.generate's batch-of-one tokens,
  under every decoder, and a seeded sampled one draws the tokens it draws alone, whether it
  was prefilled with the whole batch or alone (up to half a batch joins one by one)."""
  assert batcher_lib.Batcher(mtp.load(tiny_workdir), decoders=('autoregressive',)).row_mapped
  loaded = mtp.load(tiny_workdir, dtype='bfloat16')
  decoders = ('auto', 'speculative', 'autoregressive')
  prompts = [f'def g{i}(y):' for i in range(6)]
  want = {d: testing.references(loaded, prompts, 8, decoder=d) for d in decoders}
  assert want['auto'] == want['speculative'] == want['autoregressive']
  with server.running(loaded, max_batch=4, max_wait_ms=50, decoders=decoders) as (url, batcher):
    assert batcher.warm.wait(300) and batcher.startup_error is None
    assert not batcher.row_mapped
    assert all(lane.engine.plan.row_mapped is False for lane in batcher._lanes.values())
    prefilled = {d: collections.Counter() for d in decoders}  # Rows per prefill, per decoder.

    def counted(decoder, prefill):
      def prefill_and_count(prompts, *args, **kwargs):
        prefilled[decoder][len(prompts)] += 1
        return prefill(prompts, *args, **kwargs)
      return prefill_and_count
    for decoder, lane in batcher._lanes.items():
      lane.engine.prefill = counted(decoder, lane.engine.prefill)
    client = openai.OpenAI(base_url=url + '/v1', api_key='unused', max_retries=0)

    def ask(prompt, decoder, **options):
      return client.completions.create(
          model='m', prompt=prompt, max_tokens=options.pop('max_tokens', 8),
          temperature=options.pop('temperature', 0), extra_body={'decoder': decoder},
          **options).model_extra['mtp']['tokens']
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
      for decoder in decoders:
        got = list(pool.map(lambda p, d=decoder: ask(p, d), prompts))
        assert got == [want[decoder][p] for p in prompts], decoder
      seeded = dict(temperature=0.9, seed=77, max_tokens=16)
      alone = ask(prompts[0], 'auto', **seeded)
      crowd = [pool.submit(ask, p, 'auto', temperature=0.5 * (i % 3), seed=i)
               for i, p in enumerate(prompts)]
      among = ask(prompts[0], 'auto', **seeded)
      assert all(len(f.result()) for f in crowd)
    assert among == alone
    assert all(prefilled[d][1] and prefilled[d][4] for d in decoders), prefilled


@pytest.fixture(scope='module')
def served(tiny_workdir):
  loaded = mtp.load(tiny_workdir)
  with server.running(loaded, max_batch=4, exact=False,
                      decoders=('autoregressive',)) as (url, batcher):
    yield url, loaded


def test_shared_matmul_mode_serves_concurrent_requests(served):
  """--noexact: rows share matmuls; equal to launch.generate up to float ties (none here)."""
  url, loaded = served
  prompts = [f'def g{i}(y):' for i in range(8)]
  want = testing.references(loaded, prompts, 6, decoder='autoregressive')
  client = openai.OpenAI(base_url=url + '/v1', api_key='unused', max_retries=0)

  def ask(prompt):
    response = client.completions.create(model='m', prompt=prompt, max_tokens=6,
                                          temperature=0, extra_body={'decoder': 'autoregressive'})
    return response.model_extra['mtp']['tokens']
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    got = list(pool.map(ask, prompts))
  assert got == [want[p] for p in prompts]


@pytest.mark.parametrize('tree,budget,nodes', [([(0,), (1,), (0, 0)], 0, 4), (None, 3, 3)])
def test_trees_are_served_exactly(tiny_workdir, tree, budget, nodes):
  """A static tree or a dynamic one (--tree, --tree_budget): greedy requests still return
  launch.generate's tokens, and a bad block is refused when the server is built."""
  loaded = mtp.load(tiny_workdir)
  prompts = ['def f(x):', 'import os']
  want = {p: g.tokens for p, g in zip(prompts, mtp.generate(
      loaded, prompts, max_new_tokens=6, decoder='speculative', batch_size=1, tree=tree,
      tree_budget=budget))}
  with server.running(loaded, max_batch=2, tree=tree, tree_budget=budget,
                      decoders=('speculative',)) as (url, batcher):
    assert batcher.warm.wait(300) and batcher.startup_error is None
    assert batcher._lanes['speculative'].engine.plan.block_size == nodes
    client = openai.OpenAI(base_url=url + '/v1', api_key='unused', max_retries=0)
    for prompt in prompts:
      response = client.completions.create(model='m', prompt=prompt, max_tokens=6,
                                            temperature=0, extra_body={'decoder': 'speculative'})
      assert response.model_extra['mtp']['tokens'] == want[prompt]
  with pytest.raises(ValueError, match='tree_budget'):
    batcher_lib.Batcher(loaded, tree=None, tree_budget=10_000, decoders=('speculative',))
