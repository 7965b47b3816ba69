"""Llama-3 / Qwen2 decoder: pure functions over a parameter pytree.

Parameters are a nested dict whose layer weights are stacked on a leading layer axis
(`lax.scan` over layers: one compiled layer body whatever the depth):

    embed       [V, D]
    layers/attn_norm [L, D]      layers/wq [L, D, H, Dh]   layers/wk, wv [L, D, K, Dh]
    layers/bq   [L, H, Dh]       layers/bk, bv [L, K, Dh]      (qkv_bias only)
    layers/wo   [L, H, Dh, D]    layers/mlp_norm [L, D]
    layers/w_gate, w_up [L, D, F]    layers/w_down [L, F, D]
    final_norm  [D]
    lm_head     [D, V]           (absent with tied embeddings: the head is embed.T)

A tree without `layers/attn_norm` feeds each layer's input to attention unnormalised, one
without `final_norm` returns the last layer's output as is: the EAGLE drafter's layout
(`drafter.DrafterConfig.layout`); a checkpoint of a target always has both.

`decode` also reads the rollout engine's layouts of the same weights: per layer
(`unstack_layers`: `layers` a tuple of L dicts, an unrolled loop) and with fused
projections (`fuse_projections`: wq, wk, wv -> wqkv [.., D, K, H/K + 2, Dh], bq, bk,
bv -> bqkv [.., K, H/K + 2, Dh], w_gate, w_up -> w_gate_up [.., D, 2, F]).

Three entry points share one attention and one KV-cache layout:
  * `forward`  full sequences (training), returns final hidden states, never logits;
  * `prefill`  writes prompts into a preallocated cache;
  * `decode`   T >= 1 new tokens per sequence with explicit positions and an optional
               [B, T, T] mask among them (a draft tree is verified this way).
`prefill` is `decode` from an empty cache with the causal mask, so the two cannot
disagree. Attention is `tlt_jax.models.attention`: with the causal mask (forward,
prefill, causal decode) `attention_impl="auto"` tiles long sequences (online softmax,
or cuDNN on a GPU) instead of forming [B, H, T, S] scores. The output projection is
exposed (`lm_head_weight`) so that losses project blockwise; logits are formed only on
request, for the tokens asked for.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from tlt_jax import sharding
from tlt_jax.models.attention import CausalMask, attention
from tlt_jax.models.config import ModelConfig

Params = dict


# ----------------------------------------------------------------------------- init


def init_params(config: ModelConfig, key: jax.Array, init_std: float = 0.02) -> Params:
    """Random parameters with the layout above (normal(0, init_std), unit norms)."""
    c = config
    d, f, l, h, kv, dh, v = (c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads,
                             c.num_kv_heads, c.head_dim, c.vocab_size)
    dtype = c.jnp_param_dtype
    keys = iter(jax.random.split(key, 16))

    def normal(shape):
        # Drawn flat, then reshaped: the same values, but XLA:CPU compiles many-dimensional
        # random draws an order of magnitude slower.
        flat = jax.random.normal(next(keys), (math.prod(shape),), jnp.float32)
        return (flat.reshape(shape) * init_std).astype(dtype)

    layers = {
        "attn_norm": jnp.ones((l, d), dtype),
        "wq": normal((l, d, h, dh)),
        "wk": normal((l, d, kv, dh)),
        "wv": normal((l, d, kv, dh)),
        "wo": normal((l, h, dh, d)),
        "mlp_norm": jnp.ones((l, d), dtype),
        "w_gate": normal((l, d, f)),
        "w_up": normal((l, d, f)),
        "w_down": normal((l, f, d)),
    }
    if c.qkv_bias:
        layers["bq"] = normal((l, h, dh))
        layers["bk"] = normal((l, kv, dh))
        layers["bv"] = normal((l, kv, dh))
    params = {"embed": normal((v, d)), "layers": layers, "final_norm": jnp.ones((d,), dtype)}
    if not c.tie_embeddings:
        params["lm_head"] = normal((d, v))
    return params


def param_logical_axes(config: ModelConfig, per_layer: bool = False, fused: bool = False) -> Params:
    """Logical axis names of every parameter, same tree as `init_params` (or as its
    decode layouts: `unstack_layers` with per_layer, `fuse_projections` with fused)."""
    layers = {
        "attn_norm": ("layers", "embed"),
        "wq": ("layers", "embed", "heads", "head_dim"),
        "wk": ("layers", "embed", "kv_heads", "head_dim"),
        "wv": ("layers", "embed", "kv_heads", "head_dim"),
        "wo": ("layers", "heads", "head_dim", "embed"),
        "mlp_norm": ("layers", "embed"),
        "w_gate": ("layers", "embed", "mlp"),
        "w_up": ("layers", "embed", "mlp"),
        "w_down": ("layers", "mlp", "embed"),
    }
    if config.qkv_bias:
        layers.update(bq=("layers", "heads", "head_dim"), bk=("layers", "kv_heads", "head_dim"),
                      bv=("layers", "kv_heads", "head_dim"))
    axes = {"embed": ("vocab", "embed"), "layers": layers, "final_norm": ("embed",)}
    if not config.tie_embeddings:
        axes["lm_head"] = ("embed", "vocab")
    if fused:
        for name in ("wq", "wk", "wv", "w_gate", "w_up", "bq", "bk", "bv"):
            layers.pop(name, None)
        layers.update(wqkv=("layers", "embed", "kv_heads", None, "head_dim"),
                      w_gate_up=("layers", "embed", None, "mlp"))
        if config.qkv_bias:
            layers["bqkv"] = ("layers", "kv_heads", None, "head_dim")
    if per_layer:
        axes["layers"] = tuple({name: names[1:] for name, names in layers.items()} for _ in range(config.num_layers))
    return axes


def append_identity_layers(params: Params, config: ModelConfig, num_layers: int) -> tuple[ModelConfig, Params]:
    """The same function with `num_layers` layers: the new ones, appended after the last,
    copy the existing layers' weights cyclically but have zero output projections (wo,
    w_down), so each adds nothing to the residual stream. A cheap stand-in for a deeper
    trained model where only the cost of a forward matters (every matmul still runs)
    and the outputs must stay those of a trained one; training moves the new layers."""
    old = config.num_layers
    if num_layers < old:
        raise ValueError(f"num_layers={num_layers} is below the model's {old} layers; it can only grow.")
    source = jnp.arange(num_layers - old) % old
    zero_out = ("wo", "w_down")

    def grow(name, x):
        extra = x[source]
        return jnp.concatenate([x, jnp.zeros_like(extra) if name in zero_out else extra], axis=0)

    layers = {name: grow(name, x) for name, x in params["layers"].items()}
    return config.replace(num_layers=num_layers), {**params, "layers": layers}


def pad_mlp(params: Params, config: ModelConfig, intermediate_size: int) -> tuple[ModelConfig, Params]:
    """The same function with every layer's MLP `intermediate_size` units wide: the new
    units have zero gate, up and down weights, so they add exactly nothing to the residual
    stream, take zero gradient and stay dead through training (the model learns as the
    narrow one did). A stand-in for a model whose weights outgrow the CPU's caches, so a
    decode step reads its weights from memory as on a GPU; every matmul still runs at the
    full width. `params` in the stacked layout (a drafter's tree too, with its layer config)."""
    old = config.intermediate_size
    if intermediate_size < old:
        raise ValueError(f"intermediate_size={intermediate_size} is below the model's {old}; it can only grow.")
    layers = params["layers"]
    if not isinstance(layers, dict) or "w_gate" not in layers:
        raise ValueError("pad_mlp takes the stacked, unfused layout (layers.w_gate, w_up, w_down): pad before "
                         "unstack_layers and fuse_projections.")
    extra = intermediate_size - old
    pad = {"w_gate": ((0, 0), (0, 0), (0, extra)), "w_up": ((0, 0), (0, 0), (0, extra)),
           "w_down": ((0, 0), (0, extra), (0, 0))}
    layers = {name: jnp.pad(x, pad[name]) if name in pad else x for name, x in layers.items()}
    return config.replace(intermediate_size=intermediate_size), {**params, "layers": layers}


def narrow_mlp(params: Params, intermediate_size: int) -> Params:
    """`pad_mlp` undone: every layer's MLP cut to its first `intermediate_size` units, in any
    layout (stacked or per-layer, fused or not). Where the cut units are `pad_mlp`'s zeros,
    the same function from fewer weights."""
    last, second_last = (Ellipsis, slice(0, intermediate_size)), (Ellipsis, slice(0, intermediate_size), slice(None))
    cut = {"w_gate": last, "w_up": last, "w_gate_up": last, "w_down": second_last}  # the units' axis of each

    def narrow(layer):
        return {name: x[cut[name]] if name in cut else x for name, x in layer.items()}

    layers = params["layers"]
    return {**params, "layers": tuple(map(narrow, layers)) if has_per_layer_weights(params) else narrow(layers)}


def unstack_layers(params: Params) -> Params:
    """The same parameters with `layers` as a tuple of per-layer trees (decode's form).

    A scanned layer loop reads each layer's weights with a dynamic slice of the stack,
    which XLA:GPU materialises as a copy before the matmuls: every decode step would
    move the weights three times. Per-layer arrays, in an unrolled loop, are read once.
    """
    if has_per_layer_weights(params):
        return params
    num_layers = jax.tree.leaves(params["layers"])[0].shape[0]
    return {**params, "layers": tuple(jax.tree.map(lambda x, i=i: x[i], params["layers"]) for i in range(num_layers))}


def fuse_projections(params: Params, config: ModelConfig) -> Params:
    """The same parameters with each layer's q, k, v projections as one weight and its
    gate and up projections as another (decode's layout: 4 matmuls a layer, not 7).

    wqkv [.., D, K, H/K + 2, Dh]: for each kv head, its H/K query heads, then its key,
    then its value (the grouping `attention` uses), so that sharding the kv-head axis
    keeps each group on one device. w_gate_up [.., D, 2, F]. Stacked or per-layer alike.
    """
    if has_fused_projections(params):
        return params
    kv, group = config.num_kv_heads, config.num_heads // config.num_kv_heads

    def fuse(layer):
        layer = dict(layer)
        wq = layer.pop("wq")
        wq = wq.reshape(wq.shape[:-2] + (kv, group, wq.shape[-1]))
        layer["wqkv"] = jnp.concatenate([wq, layer.pop("wk")[..., None, :], layer.pop("wv")[..., None, :]], axis=-2)
        layer["w_gate_up"] = jnp.stack([layer.pop("w_gate"), layer.pop("w_up")], axis=-2)
        if "bq" in layer:
            bq = layer.pop("bq")
            bq = bq.reshape(bq.shape[:-2] + (kv, group, bq.shape[-1]))
            layer["bqkv"] = jnp.concatenate([bq, layer.pop("bk")[..., None, :], layer.pop("bv")[..., None, :]],
                                            axis=-2)
        return layer

    layers = params["layers"]
    return {**params, "layers": tuple(map(fuse, layers)) if has_per_layer_weights(params) else fuse(layers)}


def has_fused_projections(params: Params) -> bool:
    layers = params["layers"]
    return "wqkv" in (layers[0] if has_per_layer_weights(params) else layers)


def has_per_layer_weights(params: Params) -> bool:
    return isinstance(params["layers"], (tuple, list))


def param_shardings(config: ModelConfig, params_or_shapes: Params, mesh) -> Params:
    """NamedShardings of a parameter tree (arrays or ShapeDtypeStructs) in any of its
    layouts (stacked or per-layer, fused or not), from the parameters' logical axes."""
    axes = param_logical_axes(config, per_layer=has_per_layer_weights(params_or_shapes),
                              fused=has_fused_projections(params_or_shapes))
    return sharding.tree_shardings(axes, params_or_shapes, mesh)


def shard_params(config: ModelConfig, params: Params, mesh) -> Params:
    """Places a parameter tree on the mesh with its intended shardings."""
    return jax.device_put(params, param_shardings(config, params, mesh))


def lm_head_weight(params: Params, config: ModelConfig, dtype=None) -> jax.Array:
    """The output projection w_DV (embed.T when embeddings are tied), cast to `dtype` if
    given: the dtype of the hidden states it projects (float32 masters under a bfloat16
    forward project in bfloat16, as the forward computes)."""
    w_DV = params["embed"].T if config.tie_embeddings else params["lm_head"]
    return w_DV if dtype is None else w_DV.astype(dtype)


def logits_from_hidden(params: Params, config: ModelConfig, h_xD: jax.Array) -> jax.Array:
    """Float32 logits for the given hidden states only ([..., D] -> [..., V])."""
    return jnp.einsum("...d,dv->...v", h_xD.astype(config.jnp_dtype), lm_head_weight(params, config, config.jnp_dtype),
                      preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- pieces


def rms_norm(x, weight, eps):
    """RMSNorm in float32, scaled after casting back (Hugging Face's order)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * x32.astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> jax.Array:
    """Inverse frequencies [Dh/2] with optional Llama-3 frequency-dependent scaling."""
    dh = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def apply_rope(x_BTHD, positions_BT, inv_freq):
    """Rotary embedding, half-split layout (Hugging Face's rotate_half)."""
    angles = positions_BT.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles).astype(x_BTHD.dtype), jnp.sin(angles).astype(x_BTHD.dtype)
    x1, x2 = jnp.split(x_BTHD, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x_BTHD * cos + rotated * sin


def _qkv(layer, x_BTD, positions_BT, config, inv_freq):
    c = config
    dt = c.jnp_dtype
    h = rms_norm(x_BTD, layer["attn_norm"], c.rms_norm_eps) if "attn_norm" in layer else x_BTD
    if "wqkv" in layer:  # fuse_projections' layout
        qkv = jnp.einsum("btd,dkgh->btkgh", h, layer["wqkv"].astype(dt))
        if c.qkv_bias:
            qkv = qkv + layer["bqkv"].astype(dt)
        b, t = h.shape[:2]
        q, k, v = qkv[..., :-2, :].reshape(b, t, c.num_heads, c.head_dim), qkv[..., -2, :], qkv[..., -1, :]
    else:
        q = jnp.einsum("btd,dhk->bthk", h, layer["wq"].astype(dt))
        k = jnp.einsum("btd,dhk->bthk", h, layer["wk"].astype(dt))
        v = jnp.einsum("btd,dhk->bthk", h, layer["wv"].astype(dt))
        if c.qkv_bias:
            q, k, v = q + layer["bq"].astype(dt), k + layer["bk"].astype(dt), v + layer["bv"].astype(dt)
    return apply_rope(q, positions_BT, inv_freq), apply_rope(k, positions_BT, inv_freq), v


def _attn_out_and_mlp(layer, x_BTD, attn_BTHD, config):
    c = config
    dt = c.jnp_dtype
    x = x_BTD + jnp.einsum("bthk,hkd->btd", attn_BTHD, layer["wo"].astype(dt))
    h = rms_norm(x, layer["mlp_norm"], c.rms_norm_eps)
    if "w_gate_up" in layer:
        gate_up = jnp.einsum("btd,dxf->btxf", h, layer["w_gate_up"].astype(dt))
        gate, up = gate_up[:, :, 0], gate_up[:, :, 1]
    else:
        gate = jnp.einsum("btd,df->btf", h, layer["w_gate"].astype(dt))
        up = jnp.einsum("btd,df->btf", h, layer["w_up"].astype(dt))
    return x + jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, layer["w_down"].astype(dt))


def _final_norm(params, config, x_BTD):
    return rms_norm(x_BTD, params["final_norm"], config.rms_norm_eps) if "final_norm" in params else x_BTD


def embed_tokens(params, config, tokens_BT):
    return params["embed"][tokens_BT].astype(config.jnp_dtype)


def _inputs(params, config, tokens_BT, inputs_BTD):
    if (tokens_BT is None) == (inputs_BTD is None):
        raise ValueError("Pass exactly one of tokens_BT and inputs_BTD.")
    return embed_tokens(params, config, tokens_BT) if inputs_BTD is None else inputs_BTD.astype(config.jnp_dtype)


# ----------------------------------------------------------------------------- forward


def forward(params: Params, config: ModelConfig, tokens_BT: jax.Array | None, *,
            positions_BT: jax.Array | None = None, segment_ids_BT: jax.Array | None = None,
            layer_ids: Sequence[int] = (), remat: bool = False, inputs_BTD: jax.Array | None = None,
            attention_impl: str = "auto"):
    """Full-sequence forward (training).

    Args:
      tokens_BT: int32 token ids.
      positions_BT: RoPE positions; default 0..T-1.
      segment_ids_BT: packed sequences attend only within their segment.
      layer_ids: layers whose output residual stream is also returned (0-based).
      remat: rematerialise each layer in the backward pass.
      inputs_BTD: input vectors in place of the token embeddings (tokens_BT None): the
        drafter feeds its fused features through the same layers this way.
      attention_impl: `attention.attention`'s impl; "auto" keeps long sequences off
        [B, H, T, T] scores.
    Returns:
      h_BTD, the final-normed hidden states (what the LM head reads), and, when
      layer_ids is non-empty, a [len(layer_ids), B, T, D] stack of layer outputs.
    """
    c = config
    x = _inputs(params, c, tokens_BT, inputs_BTD)
    b, t = x.shape[:2]
    if positions_BT is None:
        positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = CausalMask(segment_ids_BT=segment_ids_BT)
    inv_freq = rope_inv_freq(c)
    selected = jnp.asarray(layer_ids, jnp.int32)

    def layer_fn(carry, xs):
        x, collected = carry
        layer, index = xs
        q, k, v = _qkv(layer, x, positions_BT, c, inv_freq)
        x = _attn_out_and_mlp(layer, x, attention(q, k, v, mask, impl=attention_impl), c)
        if layer_ids:
            collected = jnp.where((selected == index)[:, None, None, None], x[None], collected)
        return (x, collected), None

    if remat:
        layer_fn = jax.checkpoint(layer_fn)
    collected = jnp.zeros((len(layer_ids),) + x.shape, x.dtype)
    (x, collected), _ = lax.scan(layer_fn, (x, collected),
                                 (params["layers"], jnp.arange(c.num_layers, dtype=jnp.int32)))
    h = _final_norm(params, c, x)
    return (h, collected) if layer_ids else h


# ----------------------------------------------------------------------------- KV cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Preallocated per-layer keys and values with each sequence's committed length.

    k, v: [L, B, S, K, Dh]; lengths: int32 [B], the number of committed slots. Slots at
    or beyond a sequence's length are invisible to attention, whatever they hold. Code
    outside this module moves entries with the methods below, never by indexing k and v,
    so that the layout is this module's choice alone. (Head-major [L, B, K, S, Dh] spares
    XLA:CPU a transpose of each layer's cache per step, yet measured 18% slower decode
    steps there at batch 128; on the GPU it is untried.)

    attended (static; None: max_length): decode's attention reads only the first
    `attended` slots, since a step's cost grows with the slots it reads, not with those
    the cache holds. The holder keeps lengths + W <= attended for every sequence whose
    output it uses (W: the step's new slots); slots beyond still take writes. Every
    cache derived from this one keeps it (`with_lengths`, the methods below, decode).
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    attended: int | None = dataclasses.field(default=None, metadata={"static": True})

    @property
    def max_length(self) -> int:
        return self.k.shape[2]

    @property
    def attended_slots(self) -> int:
        return self.max_length if self.attended is None else self.attended

    def with_lengths(self, lengths_B: jax.Array) -> "KVCache":
        return dataclasses.replace(self, lengths=lengths_B)

    def attending(self, slots: int | None) -> "KVCache":
        """The same entries, attention reading the first `slots` (None: all)."""
        if slots is not None and not 0 < slots <= self.max_length:
            raise ValueError(f"attended slots {slots} must be in 1..{self.max_length} (the cache's slots).")
        return dataclasses.replace(self, attended=slots)

    def with_rows(self, rows_R: jax.Array, rows_cache: "KVCache", lengths_R: jax.Array,
                  sources_R: jax.Array | None = None) -> "KVCache":
        """Rows rows_R (out of range: dropped) take rows_cache's P slots as their first P
        and lengths_R as their lengths: prompts prefilled on their own, put in place. Row
        i takes rows_cache's row sources_R[i] (default i: one row each), so one prefill of a
        prompt fills every slot that samples it."""
        p = rows_cache.max_length
        take = (lambda a: a) if sources_R is None else (lambda a: a[:, sources_R])
        put = lambda a, v: a.at[:, rows_R, :p].set(take(v), mode="drop")
        return dataclasses.replace(self, k=put(self.k, rows_cache.k), v=put(self.v, rows_cache.v),
                                   lengths=self.lengths.at[rows_R].set(lengths_R, mode="drop"))

    def rows(self, rows_R: jax.Array) -> "KVCache":
        """Rows rows_R (in range) as a cache of their own, every slot and length kept:
        a few sequences extended apart from the rest, then put back with `with_rows`."""
        return dataclasses.replace(self, k=self.k[:, rows_R], v=self.v[:, rows_R], lengths=self.lengths[rows_R])

    def with_slots_copied(self, src_BT: jax.Array, dst_BT: jax.Array, lengths_B: jax.Array) -> "KVCache":
        """Each row's entries at slots src_BT copied to slots dst_BT (destinations out of
        range are dropped; sources are clipped into range), lengths set to lengths_B."""
        rows = jnp.arange(src_BT.shape[0])[:, None]
        src = jnp.minimum(src_BT, self.max_length - 1)

        def copy(a):  # the entries are [L, B, T, K, Dh]
            return a.at[:, rows, dst_BT].set(a[:, rows, src], mode="drop")

        return dataclasses.replace(self, k=copy(self.k), v=copy(self.v), lengths=lengths_B)


def init_cache(config: ModelConfig, batch_size: int, max_length: int, dtype=None) -> KVCache:
    shape = (config.num_layers, batch_size, max_length, config.num_kv_heads, config.head_dim)
    dtype = dtype or config.jnp_dtype
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch_size,), jnp.int32))


def decode(params: Params, config: ModelConfig, cache: KVCache, tokens_BT: jax.Array | None,
           positions_BT: jax.Array, *, mask_BTW: jax.Array | None = None,
           return_logits: bool = False, layer_ids: Sequence[int] = (), inputs_BTD: jax.Array | None = None,
           attention_impl: str = "auto"):
    """Runs T >= 1 new tokens per sequence against the cache.

    Slots from lengths[b] on are scratch: mask_BTW [B, T, W] (W >= T, default the causal
    [T, T]) says which of the W scratch slots lengths[b] .. lengths[b]+W-1 each new
    token sees, besides every committed slot; the new keys/values are written to the
    last T of them (the caller keeps lengths + W <= max_length), and lengths advance by
    W. W = T verifies a draft tree; W > T lets a drafter grow a tree level by level,
    each level seeing the earlier levels it descends from. positions_BT are the RoPE
    positions (a tree's nodes share positions by depth). The whole cache rides in the
    layer loop's carry and is updated in place (a scatter of T slots per layer):
    nothing proportional to the cache is copied. With per-layer weights
    (`unstack_layers`) the layer loop is unrolled instead of scanned: longer compiles,
    no per-step weight copies on the GPU. inputs_BTD replaces the token embeddings
    (tokens_BT None). attention_impl: `attention.attention`'s impl for the default
    causal mask (an explicit mask_BTW is always dense; "auto" is dense for short T).

    Returns (h_BTD, cache) — h final-normed — or (logits_BTV float32, h_BTD, cache)
    with return_logits; with layer_ids the layer stack [n, B, T, D] is appended.
    """
    return _decode(params, config, cache, tokens_BT, positions_BT, mask_BTW, return_logits, layer_ids, inputs_BTD,
                   attention_impl, from_empty=False)


def _decode(params, config, cache, tokens_BT, positions_BT, mask_BTW, return_logits, layer_ids, inputs_BTD,
            attention_impl, from_empty):
    """decode; from_empty: the cache holds nothing (prefill), so with the causal mask the
    new tokens attend to their own T slots only."""
    c = config
    x = _inputs(params, c, tokens_BT, inputs_BTD)
    b, t = x.shape[:2]
    s = cache.attended_slots  # the slots attention reads
    start_B = cache.lengths
    w = t if mask_BTW is None else mask_BTW.shape[2]
    if mask_BTW is None:
        # Slot s is visible to new token t iff s <= start + t: the committed slots and
        # the causal ones among the new tokens.
        mask = CausalMask() if from_empty else CausalMask(offset_B=start_B)
    else:
        if mask_BTW.shape != (b, t, w) or w < t:
            raise ValueError(f"mask_BTW has shape {mask_BTW.shape}; expected ({b}, {t}, W) with W >= {t}.")
        rel_BS = jnp.arange(s, dtype=jnp.int32)[None, :] - start_B[:, None]
        committed_BS = rel_BS < 0
        is_scratch_BS = (rel_BS >= 0) & (rel_BS < w)
        scratch_visible_BTS = jnp.take_along_axis(
            mask_BTW, jnp.broadcast_to(jnp.clip(rel_BS, 0, w - 1)[:, None, :], (b, t, s)), axis=2)
        mask = committed_BS[:, None, :] | (is_scratch_BS[:, None, :] & scratch_visible_BTS)
    slots_BT = start_B[:, None] + (w - t) + jnp.arange(t, dtype=jnp.int32)[None, :]
    rows_B1 = jnp.arange(b, dtype=jnp.int32)[:, None]
    inv_freq = rope_inv_freq(c)
    selected = jnp.asarray(layer_ids, jnp.int32)
    keys = t if from_empty and mask_BTW is None else s

    def layer_fn(carry, xs):
        x, k_all, v_all, collected = carry
        layer, index = xs
        q, k, v = _qkv(layer, x, positions_BT, c, inv_freq)
        k_all = k_all.at[index, rows_B1, slots_BT].set(k.astype(k_all.dtype), mode="drop")
        v_all = v_all.at[index, rows_B1, slots_BT].set(v.astype(v_all.dtype), mode="drop")
        attn = attention(q, k_all[index][:, :keys].astype(q.dtype), v_all[index][:, :keys].astype(q.dtype), mask,
                         impl=attention_impl)
        x = _attn_out_and_mlp(layer, x, attn, c)
        if isinstance(index, int):  # the unrolled loop knows which layer it is at
            if index in layer_ids:
                collected = collected.at[tuple(layer_ids).index(index)].set(x)
        elif layer_ids:
            collected = jnp.where((selected == index)[:, None, None, None], x[None], collected)
        return (x, k_all, v_all, collected), None

    carry = (x, cache.k, cache.v, jnp.zeros((len(layer_ids),) + x.shape, x.dtype))
    if has_per_layer_weights(params):
        for index, layer in enumerate(params["layers"]):
            carry, _ = layer_fn(carry, (layer, index))
    else:
        carry, _ = lax.scan(layer_fn, carry, (params["layers"], jnp.arange(c.num_layers, dtype=jnp.int32)))
    x, k_all, v_all, collected = carry
    h = _final_norm(params, c, x)
    cache = dataclasses.replace(cache, k=k_all, v=v_all, lengths=start_B + w)
    out = (logits_from_hidden(params, c, h), h, cache) if return_logits else (h, cache)
    return out + (collected,) if layer_ids else out


def prefill(params: Params, config: ModelConfig, cache: KVCache, tokens_BT: jax.Array,
            lengths_B: jax.Array, *, return_logits: bool = False, attention_impl: str = "auto"):
    """Writes right-padded prompts into an emptied cache; lengths become lengths_B.

    Returns the final-normed hidden state of each prompt's last token, h_BD (and its
    float32 logits_BV first with return_logits), and the cache. attention_impl as in
    `forward`.
    """
    b, t = tokens_BT.shape
    empty = cache.with_lengths(jnp.zeros((b,), jnp.int32))
    positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    h_BTD, cache = _decode(params, config, empty, tokens_BT, positions_BT, None, False, (), None, attention_impl,
                           from_empty=True)
    cache = cache.with_lengths(lengths_B.astype(jnp.int32))
    h_BD = jnp.take_along_axis(h_BTD, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
    if return_logits:
        return logits_from_hidden(params, config, h_BD), h_BD, cache
    return h_BD, cache
