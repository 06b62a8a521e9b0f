"""The model: a Llama-style trunk (`transformer`), multi-token heads (`heads`), the two joined
(`mtp_model`), and the KV cache (`kv_cache`).

Shape letters, used in the docstrings of this package (and of `mtp.decode`):
  B  batch rows
  T  new tokens per row: a training sequence, or the block of one cached step (a prompt, a
     chain of drafts, or the nodes of a candidate tree)
  S  cache slots per row (the cache's capacity)
  D  model width (`embed_dim`)
  F  feed-forward width (`mlp_dim`)
  V  vocabulary
  L  trunk layers
  Q  attention (query) heads per layer (`num_attention_heads`)
  G  key/value heads per layer (`num_kv_heads`, grouped-query attention)
  H  width of one attention head (`head_dim`)
  K  multi-token prediction heads (`mtp_num_heads`); head k predicts token t+1+k
  P  tokens on an accepted path (root first)
  N  nodes of a candidate tree, root included (the T of a verification step)
  R  top-k ranks drafted per head
A tree's or chain's depth is spelled out as `depth` (heads read, 1..K), never a letter.
"""
