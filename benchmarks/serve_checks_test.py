"""benchmarks.serve_checks end to end on the tiny model: the promises hold there too."""

from benchmarks import serve_checks


def test_the_checks_run_and_hold_on_a_tiny_model(tiny_workdir):
  out = serve_checks.run(str(tiny_workdir), requests=12, concurrency=6, crowd=5,
                         logprob_prompts=2, max_batch=4)
  assert out['compilations']['ok'] == 12
  assert out['compilations']['after'] == out['compilations']['before']
  assert out['seeds']['identical'] and out['seeds']['crowd_ok'] == 5
  assert out['logprobs']['same_tokens'] and out['logprobs']['max_abs_difference'] < 1e-4
