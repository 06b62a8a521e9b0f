"""Speculative Streaming (Bhendawade et al. 2024, arXiv 2402.11131): γ speculative streams in the
trunk's top N_s layers, sharing the trunk's weights (training half of issue 27).

In the top N_s = `model.streaming_layers` layers every position t also carries γ =
`model.mtp_num_heads` stream tokens. Stream j (1..γ) at t starts as the main stream's residual
state entering layer L - N_s plus a learned stream embedding e_j [D]; each streamed layer runs
the trunk's own block on it, its queries attending to

  * the main stream's keys/values of that layer at positions s <= t (computed by the main stream
    itself; the trunk's training mask decides which of them, so packing and any future window
    rule apply to the streams as they apply to the main stream), and
  * the streams 1..j of its own position t (itself included), never other positions' streams.

Stream j's output after the last layer, through the trunk's final norm and the shared output
layer, predicts token t + 1 + j: it is this project's "head j". The main stream is the trunk's
own pass, untouched: its outputs are bit-identical with or without the family (so the family
attaches to a frozen pretrained trunk without changing it).

Choices the paper leaves open:
  * Rotary position of stream j at t: t + j. The stream stands in for the (unknown) token at
    t + j whose next token, t + 1 + j, it predicts; so its distance to a main key s is t + j - s
    and to stream i of its position j - i, as if the future tokens were in the text.
  * Stream embeddings: [γ, D], normal(0.02), added in units of the token's own scale: stream j
    starts as x + rms(x) · e_j (x: the main stream's input to the first streamed layer at t,
    rms over D). A pretrained trunk's residual stream is large and its scale varies by layer
    and model (SmolLM2's, entering layer 28: about 30 in RMS, single dimensions past 20,000),
    so unscaled embeddings, which Adam moves by about the learning rate per step, barely move
    its streams: on SmolLM2's frozen trunk their loss stayed at 28.4-28.7 over 150 steps, and
    fell from 27.1 to 19.1 in 200 steps with the scale (the demo trunk's residual has RMS ~12).
    At init stream j starts close to the main stream at t (predicting t + 1, as Medusa's heads
    start as the trunk), and the rotary positions and the streams' attention to each other
    separate them from the first step on.
  * Adapters (`model.streaming_adapter_rank` = r, 0: none): per stream and streamed layer,
    low-rank updates (LoRA, Hu et al. 2021) of the query and value projections, which LoRA found
    enough, applied to stream tokens only: q += (x A_q) B_q, v += (x A_v) B_v with A ~
    normal(D^-1/2) and B = 0 at init (no effect until trained). They give a frozen trunk's
    streams capacity of their own. Parameters: γ·D + γ·N_s·r·(2D + Q·H + G·H) (Q query and G
    key/value heads of width H). Medusa's K ResBlocks hold K·(D² + D), so the embeddings
    alone are 1/(D + 1) of that (0.17% at SmolLM2's D=576, 1.5% at configs/tiny.py's D=64);
    rank-r adapters cost N_s·r·(2D + Q·H + G·H) per stream more (SmolLM2, N_s=1, r=1: 0.75%
    in all).
  * Attention: stream queries score the main keys [B, T] and their own position's γ stream
    keys apart and take one softmax over both (`stream_attention`): T·γ·(T + γ) scores, not the
    T·γ·(T + T·γ) of one concatenated key buffer. `stream_mask` is that layout's mask written
    out (the definition, and the tests' reference).
  * The main stream's keys/values of a streamed layer are recomputed from that layer's input
    (two projections of B·T tokens per layer) rather than taken out of the trunk's pass, so the
    trunk needs to return its layer inputs only (`HeadFamily.trunk_layer_inputs`).
  * Drafting: the paper builds each next tree from the accepted node's streams' top-k; here
    they go to the heads' drafter (`mtp/decode/drafters/heads.py`) like any family's draft
    logits: a chain of every stream's top-1, a Medusa-style tree of their top candidates, or a
    dynamic tree scored by them. So streams mix with prompt lookup, and `auto` weighs their
    steps, as it does every family's.
  * Early-exit tree pruning (the paper's section 3.3) is not built yet.
    `benchmarks/streaming_pruning.py` bounds what it could save: on 2 CPU cores, halving a
    tree of 4-16 nodes cuts the streaming step by less than 17-45% on the demo trunk (N_s = 2
    of 4 layers) and 16-24% on SmolLM2 (2 of 30; 26-39% at batch 8): the bottom layers still
    run every node, and the early-exit logits cost a projection per node.
  * Training: the trunk's loss and the streams' losses as for any family (`mtp.train.loss`);
    joint training updates the shared layers (the paper fine-tunes the whole model), and
    `optim.mode='frozen_trunk'` trains the embeddings (and adapters) alone. Only the positions
    whose head losses count run their streams (`mtp_head_loss_stride`: a position's streams
    read the main stream only, so the others are never needed), and a frozen trunk's cache
    keeps the streamed layers' inputs (`distill.cache_trunk_states`), so Medusa-1-style
    training runs the trunk once.

Decoding: the streams ride the pass that verifies a block (`verify`). Every block token (tree
node) carries its γ streams through the streamed layers, attending to what that node's main
query sees in the cache the trunk has just written in the same pass (the committed text and the
node's ancestors in the block) and to its own streams; so the pass that verifies the block also
drafts, at every node, the continuation that follows it. The decode loop accepts a path and
hands the accepted node's streams to the heads' drafter (`draft` only projects them): the
next block's chain, or a tree of each stream's top candidates, costs no pass of its own.
Decoding is exact like every family's: the main stream is the trunk's own.

Serving format (`hf_export`): Speculative Streaming has no public one, so the layout is this
project's, in the export's `speculative_streaming/` directory, beside the Llama directory of
the trunk (whose files stay a plain Llama model any loader reads):
  * `config.json`: `model_type` "mtp_speculative_streaming", `num_streams` γ,
    `streaming_layers` N_s (Llama layers L - N_s .. L - 1 carry the streams),
    `adapter_rank` r, `hidden_size`, and the rules above in `description`;
  * `model.safetensors`: `stream_embeddings` [γ, D]; with adapters, for each streamed Llama
    layer i, `model.layers.{i}.self_attn.{q,v}_proj.lora_A.weight` [γ, r, D] and
    `lora_B.weight` [γ, out, r] (PEFT's orientation with a leading stream axis: stream j's
    update of the projection is x A_j^T B_j^T, added for stream tokens only).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from mtp.model import flops
from mtp.model import heads
from mtp.model import kv_cache as kv_cache_lib
from mtp.model import transformer

Array = jax.Array



def stream_mask(mask: Array, num_streams: int) -> Array:
  """The stream tokens' attention mask over [main keys; stream keys], written out.

  Stream token (t, j) (position t, stream j = 1..γ) sees main position s where the trunk's own
  query t does (`mask`: s <= t in t's document), and the streams (t, i), i <= j, of its own
  position. For T = 3, γ = 2, one document (x: visible):

                    main keys  stream keys (s, i)
      query (t, j)  0 1 2      (0,1) (0,2) (1,1) (1,2) (2,1) (2,2)
      (0, 1)        x . .        x     .     .     .     .     .
      (0, 2)        x . .        x     x     .     .     .     .
      (1, 1)        x x .        .     .     x     .     .     .
      (1, 2)        x x .        .     .     x     x     .     .
      (2, 1)        x x x        .     .     .     .     x     .
      (2, 2)        x x x        .     .     .     .     x     x

  Packed rows (segment ids 1 1 2): queries (2, j) see main key 2 only; their stream keys are
  unchanged (a position's streams are always of its document).

  Args:
    mask: [B, 1, T, T] the trunk's training mask (`transformer.training_mask`).
    num_streams: γ.

  Returns:
    [B, 1, T·γ, T + T·γ] bool: query row t·γ + (j - 1) is stream j at t; key columns are the
    main positions 0..T-1, then stream i at s in column T + s·γ + (i - 1).
  """
  b, _, t, _ = mask.shape
  main = jnp.repeat(mask, num_streams, axis=2)  # Row (t, j) is the main row t.
  own = jnp.kron(jnp.eye(t, dtype=jnp.int32),
                 jnp.tril(jnp.ones((num_streams, num_streams), jnp.int32))).astype(bool)
  own = jnp.broadcast_to(own, (b, 1, t * num_streams, t * num_streams))
  return jnp.concatenate([main, own], axis=-1)


def stream_attention(q: Array, k_main: Array, v_main: Array, k_streams: Array,
                     v_streams: Array, mask: Array) -> Array:
  """Attention of stream queries over the main keys and their own position's streams.

  Equal to `jax.nn.dot_product_attention` over the concatenated keys with `stream_mask` (one
  softmax over both parts), without scoring the T·γ other positions' stream keys.

  Args:
    q: [B, P, γ, Q, H] stream queries (rotated) at P of the T positions (P = T: all).
    k_main, v_main: [B, T, G, H] the main stream's keys (rotated) and values.
    k_streams, v_streams: [B, P, γ, G, H] the streams' keys (rotated) and values.
    mask: [B, 1, P, T] the trunk's training mask at the queries' positions (main query t's row
      serves its streams).

  Returns:
    [B, P, γ, Q, H] in q's dtype.
  """
  b, p, gamma, num_q, h = q.shape
  t, g = k_main.shape[1:3]
  q = q.reshape(b, p, gamma, g, num_q // g, h)  # Query heads grouped by their key/value head.
  scale = h ** -0.5
  main = jnp.einsum('btjgrh,bsgh->bgrtjs', q, k_main,
                    preferred_element_type=jnp.float32) * scale  # [B, G, R, P, γ, T]
  own = jnp.einsum('btjgrh,btigh->bgrtji', q, k_streams,
                   preferred_element_type=jnp.float32) * scale  # [B, G, R, P, γ, γ]
  lowest = jnp.finfo(jnp.float32).min
  main = jnp.where(mask[:, :, None, :, None, :], main, lowest)
  own = jnp.where(jnp.tril(jnp.ones((gamma, gamma), bool)), own, lowest)
  probs = jax.nn.softmax(jnp.concatenate([main, own], axis=-1), axis=-1).astype(v_main.dtype)
  out = (jnp.einsum('bgrtjs,bsgh->btjgrh', probs[..., :t], v_main)
         + jnp.einsum('bgrtji,btigh->btjgrh', probs[..., t:], v_streams))
  return out.reshape(b, p, gamma, num_q, h).astype(q.dtype)


class StreamAdapters(nnx.Module):
  """One streamed layer's per-stream low-rank updates of the query and value projections."""

  def __init__(self, cfg: transformer.TransformerConfig, num_streams: int, rank: int, *,
               rngs: nnx.Rngs):
    d, dtype = cfg.embed_dim, transformer.dtype_of(cfg.param_dtype)
    down = transformer.partitioned(nnx.initializers.normal(d ** -0.5), None, 'embed', None)
    zeros = nnx.initializers.zeros_init()
    self.q_down = nnx.Param(down(rngs.params(), (num_streams, d, rank), dtype))
    self.q_up = nnx.Param(transformer.partitioned(zeros, None, None, 'heads')(
        rngs.params(), (num_streams, rank, cfg.num_attention_heads * cfg.head_dim), dtype))
    self.v_down = nnx.Param(down(rngs.params(), (num_streams, d, rank), dtype))
    self.v_up = nnx.Param(transformer.partitioned(zeros, None, None, 'kv_heads')(
        rngs.params(), (num_streams, rank, cfg.num_kv_heads * cfg.head_dim), dtype))

  @staticmethod
  def _update(x: Array, down: Array, up: Array) -> Array:
    """x [B, T, γ, D] -> stream j's (x A_j) B_j, [B, T, γ, out]."""
    low = jnp.einsum('btjd,jdr->btjr', x, down.astype(x.dtype))
    return jnp.einsum('btjr,jro->btjo', low, up.astype(x.dtype))

  def query(self, x: Array) -> Array:
    return self._update(x, self.q_down[...], self.q_up[...])

  def value(self, x: Array) -> Array:
    return self._update(x, self.v_down[...], self.v_up[...])


def _stream_layer(block: transformer.Block, adapters: StreamAdapters | None, main_x: Array,
                  main_positions: Array, streams: Array, stream_positions: Array,
                  mask: Array) -> Array:
  """One streamed layer: the trunk's `block` run on the stream tokens of P positions.

  Args:
    block: the trunk's layer (its weights, shared).
    adapters: this layer's adapters, or None.
    main_x: [B, T, D] the main stream's input to this layer (for its keys and values).
    main_positions: [B, T] the main stream's positions.
    streams: [B, P, γ, D] the streams' input to this layer, at P of the T positions.
    stream_positions: [B, P] those positions t (stream j sits at t + j).
    mask: [B, 1, P, T] the trunk's training mask at those positions' rows.

  Returns:
    [B, P, γ, D] the streams after the layer.
  """
  cfg = block.attn.cfg
  b, p, gamma, _ = streams.shape
  t = main_x.shape[1]
  hd, nq, g = cfg.head_dim, cfg.num_attention_heads, cfg.num_kv_heads
  _, k_main, v_main = block.attn.projections(block.attn_norm(main_x))
  k_main = transformer.rotary_embedding(k_main.reshape(b, t, g, hd), main_positions,
                                        cfg.rope_theta)
  v_main = v_main.reshape(b, t, g, hd)
  q, k, v = _stream_projections(block, adapters, streams, stream_positions)
  out = stream_attention(q.reshape(b, p, gamma, nq, hd), k_main, v_main, k, v, mask)
  return _stream_layer_output(block, streams, out)


def _stream_projections(block: transformer.Block, adapters: StreamAdapters | None,
                        streams: Array, positions: Array) -> tuple[Array, Array, Array]:
  """The streams' queries [B, T·γ, Q, H] (rotated; row t·γ + j - 1 is stream j at t) and
  keys and values [B, T, γ, G, H] (keys rotated), at rotary positions t + j."""
  cfg = block.attn.cfg
  b, t, gamma, _ = streams.shape
  hd, nq, g = cfg.head_dim, cfg.num_attention_heads, cfg.num_kv_heads
  x = block.attn_norm(streams)
  q, k, v = block.attn.projections(x)
  if adapters is not None:
    q, v = q + adapters.query(x), v + adapters.value(x)
  # Streams flattened into the time axis for `rotary_embedding`.
  stream_positions = (positions[:, :, None] + jnp.arange(1, gamma + 1, dtype=positions.dtype)
                      ).reshape(b, t * gamma)
  q = transformer.rotary_embedding(q.reshape(b, t * gamma, nq, hd), stream_positions,
                                   cfg.rope_theta)
  k = transformer.rotary_embedding(k.reshape(b, t * gamma, g, hd), stream_positions,
                                   cfg.rope_theta).reshape(b, t, gamma, g, hd)
  return q, k, v.reshape(b, t, gamma, g, hd)


def _stream_layer_output(block: transformer.Block, streams: Array, attended: Array) -> Array:
  """The layer's residual updates: streams [B, T, γ, D], attended [B, T, γ, Q, H]."""
  b, t, gamma = streams.shape[:3]
  streams = streams + block.attn.o_proj(attended.reshape(b, t, gamma, -1))
  return streams + block.mlp(block.mlp_norm(streams))


def _cached_stream_layer(block: transformer.Block, adapters: StreamAdapters | None,
                         streams: Array, positions: Array, block_mask: Array,
                         layer_cache: tuple[Array, Array], lengths: Array) -> Array:
  """One streamed layer in a cached step (prefill or verification) of T new tokens.

  Stream j at new token t attends to what the main stream's query t sees in this layer's
  cache (every committed slot, and the block's tokens its `block_mask` row allows: a tree
  node's ancestors and itself) and to its own token's streams 1..j: `stream_mask`'s rule,
  with the main keys read from the cache the trunk just wrote instead of recomputed.

  Args:
    block, adapters: as `_stream_layer`.
    streams: [B, T, γ, D] the streams' input to this layer.
    positions: [B, T] the new tokens' positions (stream j sits at t + j).
    block_mask: [T, T] or [B, T, T] visibility inside the new block.
    layer_cache: this layer's (keys, values), the block's entries written at `lengths`.
    lengths: [B] committed slots before the block.

  Returns:
    [B, T, γ, D] the streams after the layer.
  """
  b, t, gamma, _ = streams.shape
  q, k, v = _stream_projections(block, adapters, streams, positions)
  # Query (t, j) sees its token's stream keys (t, i), i <= j: each query's own γ keys.
  own_k, own_v = (jnp.broadcast_to(x[:, :, None], (b, t, gamma) + x.shape[2:]).reshape(
      (b, t * gamma) + x.shape[2:]) for x in (k, v))
  own_visible = jnp.tile(jnp.tril(jnp.ones((gamma, gamma), bool)), (t, 1))  # [T·γ, γ]
  out = kv_cache_lib.attend(q, layer_cache[0], layer_cache[1], lengths,
                            jnp.repeat(block_mask, gamma, axis=-2),
                            own=(own_k, own_v, own_visible))
  return _stream_layer_output(block, streams, out.reshape((b, t, gamma) + out.shape[2:]))


# The streamed layers recomputed in the backward pass (any `model.remat` but 'none').
_rematerialised_stream_layer = nnx.remat(_stream_layer)


def _check_count(options: Mapping[str, Any], key: str, low: int) -> int:
  value = options[key]
  if isinstance(value, bool) or not isinstance(value, int) or value < low:
    raise ValueError(f'model.{key} must be an integer >= {low}, got {value!r}.')
  return value


class StreamingHeads(heads.HeadFamily):
  """γ = K speculative streams in the trunk's top `streaming_layers` layers (see the module
  docstring); parameters: the stream embeddings and, optionally, per-stream adapters."""
  OPTIONS = {
      # N_s: the trunk's top layers that carry the streams (1..model.num_layers). The paper
      # streams the top layers only (e.g. 4 of 32 on Vicuna-7B): lower layers stay shared,
      # and the streams' cost grows with N_s.
      'streaming_layers': 2,
      # Rank of the per-stream low-rank adapters on the streamed layers' query and value
      # projections, for stream tokens only (0: none, the stream embeddings alone train).
      'streaming_adapter_rank': 0,
  }
  # The streams ride the pass that verifies a block (`verify`); they write no cache layers.
  RUNS_IN_VERIFICATION = True
  # Training runs the streams of the positions whose losses count only (`mtp_head_loss_stride`).
  TRAINS_AT_HEAD_POSITIONS = True

  def __init__(self, trunk_cfg: transformer.TransformerConfig, num_heads: int,
               options: Mapping[str, Any], *, rngs: nnx.Rngs):
    self.num_streams = num_heads
    self.num_layers = _check_layers(trunk_cfg, options)
    rank = options['streaming_adapter_rank']
    self.embeddings = nnx.Param(transformer.partitioned(nnx.initializers.normal(0.02), None,
                                                        'embed')(
        rngs.params(), (num_heads, trunk_cfg.embed_dim),
        transformer.dtype_of(trunk_cfg.param_dtype)))
    self.adapters = (nnx.List([StreamAdapters(trunk_cfg, num_heads, rank, rngs=rngs)
                               for _ in range(self.num_layers)]) if rank else None)

  @classmethod
  def validate_options(cls, options: Mapping[str, Any]) -> None:
    _check_count(options, 'streaming_layers', 1)
    _check_count(options, 'streaming_adapter_rank', 0)

  @classmethod
  def trunk_layer_inputs(cls, trunk_cfg, num_heads, options) -> tuple[int, ...]:
    """The inputs of the streamed layers L - N_s .. L - 1 (the first one starts the streams;
    each gives its layer's main keys and values)."""
    n = _check_layers(trunk_cfg, options)
    return tuple(range(trunk_cfg.num_layers - n, trunk_cfg.num_layers))

  @classmethod
  def train_flops(cls, trunk_cfg, num_heads, options, batch_size, seq_len, count='causal',
                  head_positions=None):
    """Per streamed layer: the trunk's layer over B·P·γ stream tokens (P = head_positions
    positions of T, all by default), the main keys and values over B·T tokens again, the
    adapters; attention of P·γ queries to the main keys (causal: s <= t, P·(T+1)/2 pairs per
    stream on average over the stride's offsets) and their position's streams (i <= j).
    Remat recomputes it all."""
    cfg, gamma = trunk_cfg, num_heads
    n, rank = options['streaming_layers'], options['streaming_adapter_rank']
    p = seq_len if head_positions is None else head_positions
    tokens, queried = batch_size * seq_len, batch_size * p
    q_width, kv_width = cfg.num_attention_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = (flops.block_matmul_flops(cfg, queried * gamma)
                 + 2.0 * 2 * cfg.embed_dim * kv_width * tokens
                 + 2.0 * rank * (2 * cfg.embed_dim + q_width + kv_width) * queried * gamma)
    if count == 'causal':
      pairs = gamma * p * (seq_len + 1) / 2 + p * gamma * (gamma + 1) / 2
    else:
      pairs = float(gamma * p * seq_len + p * gamma * gamma)
    attention = 4.0 * batch_size * cfg.num_attention_heads * cfg.head_dim * pairs
    return flops.HeadFlops(n * per_layer, n * attention, n * (per_layer + attention))

  def __call__(self, trunk, hidden, normed, tokens, positions, mask, *,
               layer_inputs: Mapping[int, Array], head_positions: Array | None = None
               ) -> list[Array]:
    """The streams' outputs; with `head_positions` [P] computed at those positions only (the
    ones the loss reads) and zero elsewhere: the streams of a position depend on the main
    stream alone, never on other positions' streams, so skipping them changes nothing else."""
    del hidden, normed, tokens  # The streams start from a layer input.
    main = layer_inputs[self._streamed_layers(trunk.cfg)[0]]
    stream_positions, stream_mask_rows, start = positions, mask, main
    if head_positions is not None:
      stream_positions = positions[:, head_positions]
      stream_mask_rows = mask[:, :, head_positions]
      start = main[:, head_positions]
    streams = self.start_streams(start)
    streams = self.run_streams(trunk, streams, layer_inputs, positions, stream_positions,
                               stream_mask_rows)
    outputs = [trunk.final_norm(streams[:, :, j]) for j in range(self.num_streams)]
    if head_positions is not None:
      outputs = [jnp.zeros(main.shape, x.dtype).at[:, head_positions].set(x) for x in outputs]
    return outputs

  def start_streams(self, main: Array) -> Array:
    """The streams entering the first streamed layer: main [B, T, D] (that layer's input) ->
    [B, T, γ, D], main + rms(main) · e_j (the embedding in units of the token's own scale)."""
    rms = jnp.sqrt(jnp.mean(jnp.square(main.astype(jnp.float32)), axis=-1, keepdims=True))
    offsets = rms[:, :, None, :] * self.embeddings[...].astype(jnp.float32)
    return main[:, :, None, :] + offsets.astype(main.dtype)

  def run_streams(self, trunk: transformer.Transformer, streams: Array,
                  layer_inputs: Mapping[int, Array], positions: Array,
                  stream_positions: Array, mask: Array) -> Array:
    """The streamed layers: streams [B, P, γ, D] entering layer L - N_s -> leaving layer L - 1
    (before the final norm).

    Args:
      trunk: the trunk (its streamed layers' weights).
      streams: [B, P, γ, D] at P of the T positions.
      layer_inputs: {i: [B, T, D]} the main stream's input to each streamed layer.
      positions: [B, T] the main stream's positions.
      stream_positions: [B, P] the streams' positions.
      mask: [B, 1, P, T] the training mask's rows at the streams' positions.
    """
    layer_fn = _rematerialised_stream_layer if trunk.cfg.remat != 'none' else _stream_layer
    for n, i in enumerate(self._streamed_layers(trunk.cfg)):
      adapters = self.adapters[n] if self.adapters is not None else None
      streams = layer_fn(trunk.layer(i), adapters, layer_inputs[i], positions, streams,
                         stream_positions, mask)
    return streams

  def hf_export(self, context: heads.HFExportContext) -> heads.HFExport:
    """The layout in the module docstring (`speculative_streaming/`)."""
    cfg = context.trunk_cfg
    rank = 0 if self.adapters is None else self.adapters[0].q_down.shape[-1]
    tensors = {'stream_embeddings': heads.as_numpy(self.embeddings)}
    for i, adapters in zip(self._streamed_layers(cfg),
                           [] if self.adapters is None else self.adapters):
      for name, down, up in (('q_proj', adapters.q_down, adapters.q_up),
                             ('v_proj', adapters.v_down, adapters.v_up)):
        prefix = f'model.layers.{i}.self_attn.{name}'
        tensors[f'{prefix}.lora_A.weight'] = heads.as_numpy(down).transpose(0, 2, 1)
        tensors[f'{prefix}.lora_B.weight'] = heads.as_numpy(up).transpose(0, 2, 1)
    config = {
        'model_type': 'mtp_speculative_streaming', 'architectures': ['MTPSpeculativeStreaming'],
        'num_streams': self.num_streams, 'streaming_layers': self.num_layers,
        'adapter_rank': rank, 'hidden_size': cfg.embed_dim,
        'description': (
            'Speculative Streaming (arXiv 2402.11131) on the base Llama model: in its top '
            'streaming_layers layers each position t carries num_streams stream tokens; stream '
            'j (1-based) enters the first streamed layer as the base model\'s input to that '
            'layer at t, x_t, plus sqrt(mean(x_t ** 2)) * stream_embeddings[j - 1] (the '
            'embedding scaled by x_t\'s root mean square), runs the base layers (with its lora '
            'updates of q_proj and v_proj, if any) at rotary position t + j, attending to the '
            'base model\'s keys and values at positions <= t and to streams 1..j of t, then '
            'the base final norm and lm_head: it predicts token t + 1 + j.'),
    }
    return heads.HFExport(format='mtp-speculative-streaming', subdirectories={
        'speculative_streaming': heads.HFSubdirectory(config, tensors)})

  @classmethod
  def hf_import(cls, source: heads.HFImportSource) -> heads.HFImport | None:
    """`speculative_streaming/` in the layout of the module docstring."""
    sub = source.subdirectory('speculative_streaming')
    if sub is None:
      return None
    config = sub.config
    keys = ('num_streams', 'streaming_layers', 'adapter_rank')
    if config.get('model_type') != 'mtp_speculative_streaming' or any(k not in config
                                                                       for k in keys):
      raise ValueError('speculative_streaming/config.json is not an mtp_speculative_streaming '
                       f'config (model_type and {", ".join(keys)}).')
    where = 'speculative_streaming/: '
    num_streams, rank = int(config['num_streams']), int(config['adapter_rank'])
    options = {'streaming_layers': int(config['streaming_layers']),
               'streaming_adapter_rank': rank}
    layers = _check_layers(source.trunk_cfg, options)
    embeddings = heads.take(sub.tensors, 'stream_embeddings', where)
    if embeddings.shape != (num_streams, source.trunk_cfg.embed_dim):
      raise ValueError(f'{where}stream_embeddings has shape {embeddings.shape}, expected '
                       f'({num_streams}, {source.trunk_cfg.embed_dim}).')
    params: dict[str, Any] = {'embeddings': embeddings}
    if rank:
      params['adapters'] = {}
      first = source.trunk_cfg.num_layers - layers
      for n in range(layers):
        adapter = {}
        for name, short in (('q_proj', 'q'), ('v_proj', 'v')):
          prefix = f'model.layers.{first + n}.self_attn.{name}'
          adapter[f'{short}_down'] = heads.take(sub.tensors, f'{prefix}.lora_A.weight',
                                                where).transpose(0, 2, 1)
          adapter[f'{short}_up'] = heads.take(sub.tensors, f'{prefix}.lora_B.weight',
                                              where).transpose(0, 2, 1)
        params['adapters'][n] = adapter
    return heads.HFImport(num_heads=num_streams, options=options, params=params)

  def _streamed_layers(self, trunk_cfg: transformer.TransformerConfig) -> range:
    """The trunk layers L - N_s .. L - 1 that carry the streams."""
    return range(trunk_cfg.num_layers - self.num_layers, trunk_cfg.num_layers)

  def verify(self, hidden, normed, positions, block_mask, cache, lengths, first_layer, *,
             trunk: transformer.Transformer, layer_inputs: Mapping[int, Array]):
    """The streams of every new token, in the pass that verifies them: features [B, T, γ, D],
    stream j's normalised output at token t (predicting token t + 1 + j). The main keys come
    from the cache the trunk wrote in this pass; the streams write nothing."""
    del hidden, normed, first_layer
    layers = self._streamed_layers(trunk.cfg)
    streams = self.start_streams(layer_inputs[layers[0]])
    for n, i in enumerate(layers):
      adapters = self.adapters[n] if self.adapters is not None else None
      streams = _cached_stream_layer(trunk.layer(i), adapters, streams, positions, block_mask,
                                     heads.layer_cache(cache, i), lengths)
    return trunk.final_norm(streams), cache

  def draft(self, trunk, features, tokens, last_index, cache, lengths, depth, first_layer,
            vocab=None):
    """Streams 1..depth of the last accepted token, projected: no pass of their own."""
    del tokens, lengths, first_layer
    at = kv_cache_lib.gather_rows(features, last_index)[:, :depth]  # [B, depth, D]
    logits = heads.DraftProjection(trunk, vocab).logits(at)
    return jnp.transpose(logits, (1, 0, 2)), cache


def _check_layers(trunk_cfg: transformer.TransformerConfig, options: Mapping[str, Any]) -> int:
  """N_s, or ValueError naming `model.streaming_layers` when it is not in [1, L]."""
  n = _check_count(options, 'streaming_layers', 1)
  if n > trunk_cfg.num_layers:
    raise ValueError(f'model.streaming_layers must be in [1, model.num_layers = '
                     f'{trunk_cfg.num_layers}], got {n}.')
  return n
