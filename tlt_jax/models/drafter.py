"""EAGLE-style drafter: one small decoder stack that reads the target's features.

For a sequence x_0 x_1 ... the target's feature f_t at position t (its final-normed
hidden state, or with EAGLE-3 fusion a projection of three of its layer outputs) is
what predicted x_{t+1}. The drafter's entry at position t reads (x_{t+1}, f_t):

    u_t = [embed(x_{t+1}); f_t] @ fc            (2D -> D)
    g_t = final_norm(layers(u)_t)               (its own causal attention and KV cache)
    logits_t = g_t @ lm_head                    (predicts x_{t+2})

and g_t is trained to regress the feature the drafter reads next, f_{t+1} (smooth L1;
with fusion, the fused feature of t+1 held fixed) and, through the LM head, to match
the target's next-token distribution (top-K KL). When
drafting past the committed text the drafter feeds its own g_t as the next feature.
The embedding, final norm and LM head are the target's, shared and frozen: drafter
parameters hold only `fc`, `layers` (the transformer's stacked layout) and, with
fusion, `fuse` (3D -> D); checkpoints therefore never store the shared weights.
The layers run through `transformer.forward` / `decode`, so the drafter has the same
attention, RoPE and KV-cache layout as the target.

With `layout="eagle"` the layer reads u_t unnormalised (no attn_norm) and g_t is its output
as is (no final norm): EAGLE-1/2 as SGLang and vLLM run it (`LlamaForCausalLMEagle`,
`Qwen2ForCausalLMEagle`, `EagleLlamaForCausalLM`), the layout those engines load
(`eagle_io`).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import ModelConfig

LAYOUTS = ("tlt", "eagle")


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """num_layers: decoder layers (EAGLE uses one). feature_layers: target layers
    (0-based) whose outputs are fused into the feature (EAGLE-3 uses a low, a middle
    and a high layer); empty: the target's final hidden state is the feature.
    layout: "tlt" normalises the layers' input (attn_norm) and their output (the
    target's final norm); "eagle" does neither, as the EAGLE-1/2 drafters of SGLang and
    vLLM (one layer: they skip the input norm of the first layer only); "auto" (the
    configs' default) is "eagle" for one layer reading the target's last hidden state,
    the drafter those engines load, and "tlt" otherwise. The default here stays "tlt":
    exports written before layouts existed record none and are "tlt"."""

    num_layers: int = 1
    feature_layers: tuple[int, ...] = ()
    layout: str = "tlt"

    def __post_init__(self):
        if self.num_layers < 1:
            raise ValueError(f"DrafterConfig.num_layers must be >= 1, got {self.num_layers}.")
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
        if self.layout == "auto":
            one_unfused_layer = self.num_layers == 1 and not self.feature_layers
            object.__setattr__(self, "layout", "eagle" if one_unfused_layer else "tlt")
        if self.layout not in LAYOUTS:
            raise ValueError(f"DrafterConfig.layout={self.layout!r}; choose one of {LAYOUTS} or 'auto'.")
        if self.layout == "eagle" and self.num_layers != 1:
            raise ValueError(f"DrafterConfig(layout='eagle') has one layer, got num_layers={self.num_layers}: "
                             "EAGLE drafters skip the input norm of their first layer only; use layout 'auto' "
                             "or 'tlt'.")

    def layer_config(self, target: ModelConfig) -> ModelConfig:
        """The transformer config of the drafter's own layers."""
        for i in self.feature_layers:
            if not 0 <= i < target.num_layers:
                raise ValueError(f"feature_layers has {i}, outside the target's {target.num_layers} layers.")
        return target.replace(num_layers=self.num_layers)


def init_drafter(target_config: ModelConfig, config: DrafterConfig, key: jax.Array, init_std: float = 0.02):
    """Random drafter parameters (the shared embedding and head are not among them)."""
    d = target_config.hidden_size
    k_layers, k_fc, k_fuse = jax.random.split(key, 3)
    dtype = target_config.jnp_param_dtype
    params = {
        "fc": (jax.random.normal(k_fc, (2 * d, d), jnp.float32) / math.sqrt(2 * d)).astype(dtype),
        "layers": _own_layers(config, tfm.init_params(config.layer_config(target_config), k_layers, init_std)),
    }
    if config.feature_layers:
        n = len(config.feature_layers)
        params["fuse"] = (jax.random.normal(k_fuse, (n * d, d), jnp.float32) / math.sqrt(n * d)).astype(dtype)
    return params


def drafter_logical_axes(target_config: ModelConfig, config: DrafterConfig):
    """Logical axis names of the drafter parameters (same tree as `init_drafter`)."""
    axes = {"fc": (None, "embed"),
            "layers": _own_layers(config, tfm.param_logical_axes(config.layer_config(target_config)))}
    if config.feature_layers:
        axes["fuse"] = (None, "embed")
    return axes


def _own_layers(config: DrafterConfig, tree):
    """The `layers` of a transformer tree, without attn_norm in layout "eagle"."""
    layers = tree["layers"]
    return {k: v for k, v in layers.items() if k != "attn_norm"} if config.layout == "eagle" else layers


SHARED_TARGET_KEYS = ("embed", "final_norm", "lm_head")  # the target weights a drafter reads, frozen


def model_params(drafter_params, target_params, config: DrafterConfig | None = None):
    """The transformer parameter tree the drafter's layers run as: its own layers under
    the target's embedding, final norm (not with layout "eagle") and LM head."""
    skip = ("final_norm",) if config is not None and config.layout == "eagle" else ()
    shared = {k: target_params[k] for k in SHARED_TARGET_KEYS if k in target_params and k not in skip}
    return {**shared, "layers": drafter_params["layers"]}


def target_features(drafter_params, config: DrafterConfig, h_xD: jax.Array, layers_nxD: jax.Array | None = None):
    """The feature the drafter reads for target positions: h (final-normed hidden state)
    or, with fusion, the selected layer outputs ([n, ..., D], in feature_layers order)
    concatenated and projected."""
    if not config.feature_layers:
        return h_xD
    if layers_nxD is None or layers_nxD.shape[0] != len(config.feature_layers):
        raise ValueError(f"This drafter fuses target layers {config.feature_layers}; pass their outputs "
                         "(layer_ids=feature_layers in the target's forward/decode).")
    stacked = jnp.concatenate(list(layers_nxD), axis=-1)
    return stacked @ drafter_params["fuse"].astype(stacked.dtype)


def _fc_inputs(drafter_params, target_params, target_config, tokens_BT, features_BTD):
    e = tfm.embed_tokens(target_params, target_config, tokens_BT)
    u = jnp.concatenate([e, features_BTD.astype(e.dtype)], axis=-1)
    return u @ drafter_params["fc"].astype(e.dtype)


def forward(drafter_params, target_params, target_config: ModelConfig, config: DrafterConfig,
            tokens_BT: jax.Array, features_BTD: jax.Array, *, positions_BT: jax.Array | None = None,
            segment_ids_BT: jax.Array | None = None, remat: bool = False) -> jax.Array:
    """Teacher-forced drafter over whole sequences (training): entry t reads
    tokens_BT[t] = x_{t+1} and features_BTD[t] = f_t; returns g_BTD (final-normed in
    layout "tlt")."""
    u = _fc_inputs(drafter_params, target_params, target_config, tokens_BT, features_BTD)
    return tfm.forward(model_params(drafter_params, target_params, config), config.layer_config(target_config), None,
                       positions_BT=positions_BT, segment_ids_BT=segment_ids_BT, remat=remat, inputs_BTD=u)


def forward_unrolled(drafter_params, target_params, target_config: ModelConfig, config: DrafterConfig,
                     tokens_BT: jax.Array, features_BTD: jax.Array, steps: int, *, positions_BT: jax.Array,
                     segment_ids_BT: jax.Array) -> list[jax.Array]:
    """Training-time test (EAGLE-3): `forward`, then steps - 1 more passes in which every
    entry reads the drafter's own previous-pass prediction in place of the target's feature,
    each seeing exactly what a chain draft sees at that depth. Pass i (0-based) at entry t
    is the i-th draft past committed entry t - i: it reads (x_{t+1}, g^{i-1}_{t-1}) and
    attends to pass 0's entries up to t - i (those catch-up writes from target features)
    and to pass j's entry t - i + j for 0 < j <= i (the chain's own). Returns
    [g^0_BTD, ..., g^{steps-1}_BTD]; an entry of pass i whose chain leaves its segment
    (t - i before the segment's first entry) reads a neighbour's output: mask it.
    """
    if steps < 1:
        raise ValueError(f"forward_unrolled needs steps >= 1, got {steps}.")
    b, t = tokens_BT.shape
    layer_cfg = config.layer_config(target_config)
    params = model_params(drafter_params, target_params, config)
    cache = tfm.init_cache(layer_cfg, b, steps * t)
    e = jnp.arange(t)
    same_BTT = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]  # [B, query t, key p]
    outputs, features = [], features_BTD
    for i in range(steps):
        # Pass 0's entries up to t - i, then pass j's entry t - i + j (j = i: the entry itself).
        blocks = [same_BTT & (e[None, :] <= e[:, None] - i)[None]]
        blocks += [same_BTT & (e[None, :] == e[:, None] - i + j)[None] for j in range(1, i)]
        if i:
            blocks.append(jnp.broadcast_to(jnp.eye(t, dtype=bool), (b, t, t)))
        u = _fc_inputs(drafter_params, target_params, target_config, tokens_BT, features)
        # The passes so far hold (i + 1) T slots: attention reads those only.
        start = cache.with_lengths(jnp.zeros((b,), jnp.int32)).attending((i + 1) * t)
        g, cache = tfm.decode(params, layer_cfg, start, None, positions_BT, mask_BTW=jnp.concatenate(blocks, axis=2),
                              inputs_BTD=u)
        outputs.append(g)
        features = jnp.concatenate([features_BTD[:, :1], g[:, :-1].astype(features_BTD.dtype)], axis=1)
    return outputs


def init_cache(target_config: ModelConfig, config: DrafterConfig, batch_size: int, max_length: int,
               dtype=None) -> tfm.KVCache:
    return tfm.init_cache(config.layer_config(target_config), batch_size, max_length, dtype)


def decode(drafter_params, target_params, target_config: ModelConfig, config: DrafterConfig, cache: tfm.KVCache,
           tokens_BT: jax.Array, features_BTD: jax.Array, positions_BT: jax.Array, *,
           mask_BTW: jax.Array | None = None, return_logits: bool = True):
    """Drafter entries against its KV cache, with `transformer.decode`'s scratch-slot
    semantics. Returns (logits_BTV float32, g_BTD, cache), or (g_BTD, cache)."""
    u = _fc_inputs(drafter_params, target_params, target_config, tokens_BT, features_BTD)
    # Per-layer form: an unrolled loop over static slices (a bitcast for one layer) in
    # place of a scan whose dynamic weight slices are copies on the GPU.
    params = tfm.unstack_layers(model_params(drafter_params, target_params, config))
    return tfm.decode(params, config.layer_config(target_config), cache, None,
                      positions_BT, mask_BTW=mask_BTW, return_logits=return_logits, inputs_BTD=u)


@functools.lru_cache(maxsize=16)
def _drafter_shapes(target_config: ModelConfig, config: DrafterConfig):
    """The parameter shapes `init_drafter` gives (tracing it costs milliseconds, and every
    drafter the spot trainer publishes is checked)."""
    expected = jax.eval_shape(lambda: init_drafter(target_config, config, jax.random.PRNGKey(0)))
    return jax.tree.map(lambda x: tuple(x.shape), expected)


def check_drafter_params(drafter_params, target_config: ModelConfig, config: DrafterConfig) -> None:
    """Raises if the drafter parameters do not fit this target and drafter config."""
    got = jax.tree.map(lambda x: (tuple(x.shape)), drafter_params)
    want = _drafter_shapes(target_config, config)
    if got != want:
        raise ValueError(f"Drafter parameters do not match the target (hidden {target_config.hidden_size}) "
                         f"and {config}: got shapes {got}, expected {want}. Was the drafter trained for "
                         "another target or with another DrafterConfig?")

