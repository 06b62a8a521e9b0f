"""What a benchmark reads off chain generations (`mtp.api.Generation`): no flags, no JAX."""


def chain_figures(generations, references) -> dict:
  """Tokens per step of chain generations, the share of steps whose draft d (1-based) was
  accepted (depth 1: the held-out first-draft acceptance), and whether each generation equals
  its greedy reference."""
  steps = sum(g.num_steps for g in generations)
  emitted = sum(sum(j * c for j, c in enumerate(g.accepted_histogram)) for g in generations)
  histogram = [sum(g.accepted_histogram[j] for g in generations)
               for j in range(len(generations[0].accepted_histogram))]
  # A step that emitted j + 1 tokens accepted drafts 1..j.
  accepted = [sum(histogram[d + 1:]) / max(steps, 1) for d in range(1, len(histogram) - 1)]
  return dict(tokens_per_step=emitted / max(steps, 1), accepted_at_depth=accepted, steps=steps,
              tokens=emitted,
              exact=all(g.tokens == r.tokens for g, r in zip(generations, references)))
