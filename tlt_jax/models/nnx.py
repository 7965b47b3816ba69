"""A flax NNX view of our decoder: the same arrays as `nnx.Param`s, no copy.

`from_params(config, params)` wraps each array of a `transformer` parameter tree (any of
its layouts: stacked, per-layer, fused) in an `nnx.Param` at the same path: attributes
`embed`, `layers`, `final_norm`, `lm_head` (untied only), `layers` an `nnx.Dict` of
stacked weights or an `nnx.List` of per-layer `nnx.Dict`s. Each Param's value is the very
array of the tree, and `to_params(model)` hands those arrays back, so the round trip is
the identity. Each Param carries its logical axes (`transformer.param_logical_axes`) as
`out_sharding` metadata, which `nnx.get_partition_spec` reads; `eager_sharding=False`
keeps flax from resharding (copying) the arrays when the view is built.

`Transformer.__call__` is `transformer.forward` + `transformer.logits_from_hidden`: one
implementation of the math. In a hot loop split once and merge inside the jitted
function, as the flax NNX examples do (`nnx.jit` walks the object graph every call):

    graphdef, state = nnx.split(model)

    @jax.jit
    def logits(graphdef, state, tokens_BT):
        return nnx.merge(graphdef, state)(tokens_BT)
"""
from __future__ import annotations

import jax
from flax import nnx

from tlt_jax.models import transformer
from tlt_jax.models.config import ModelConfig


def _is_axis_names(node) -> bool:
    return isinstance(node, tuple) and all(isinstance(n, (str, type(None))) for n in node)


def _view(tree, axes):
    if isinstance(tree, dict):
        return nnx.Dict({name: _view(x, axes[name]) for name, x in tree.items()})
    if isinstance(tree, (tuple, list)):
        return nnx.List([_view(x, a) for x, a in zip(tree, axes)])
    return nnx.Param(tree, out_sharding=axes, eager_sharding=False)


def _tree(node):
    if isinstance(node, nnx.Param):
        return node.get_value()
    if isinstance(node, nnx.List):
        return tuple(_tree(x) for x in node)
    return {name: _tree(x) for name, x in node.items()}


class Transformer(nnx.Module):
    """Our Llama / Qwen2 decoder as an NNX module; `config` is a static attribute.

    Built from our parameter tree (`params`, wrapped without a copy) or, as NNX models
    are, from `rngs` (`transformer.init_params` with `rngs.params()`).
    """

    def __init__(self, config: ModelConfig, params: transformer.Params | None = None, *,
                 rngs: nnx.Rngs | None = None):
        if (params is None) == (rngs is None):
            raise ValueError("Pass exactly one of params (our parameter tree) and rngs.")
        if params is None:
            params = transformer.init_params(config, rngs.params())
        axes = transformer.param_logical_axes(config, per_layer=transformer.has_per_layer_weights(params),
                                              fused=transformer.has_fused_projections(params))
        expected = jax.tree.structure(axes, is_leaf=_is_axis_names)
        if jax.tree.structure(params) != expected:
            raise ValueError(f"The parameter tree {jax.tree.structure(params)} is not one of transformer's "
                             f"layouts for this config; expected {expected}.")
        self.config = config
        for name, tree in params.items():
            setattr(self, name, _view(tree, axes[name]))

    def __call__(self, tokens_BT: jax.Array, *, positions_BT: jax.Array | None = None,
                 segment_ids_BT: jax.Array | None = None, attention_impl: str = "auto") -> jax.Array:
        """Float32 logits [B, T, V] of int32 tokens_BT (arguments as `transformer.forward`'s)."""
        params = to_params(self)
        if transformer.has_per_layer_weights(params):
            raise ValueError("forward scans stacked layers; this view holds decode's per-layer layout "
                             "(build it from the stacked tree).")
        h_BTD = transformer.forward(params, self.config, tokens_BT, positions_BT=positions_BT,
                                    segment_ids_BT=segment_ids_BT, attention_impl=attention_impl)
        return transformer.logits_from_hidden(params, self.config, h_BTD)


def from_params(config: ModelConfig, params: transformer.Params) -> Transformer:
    """The NNX view of our parameter tree: its very arrays, as `nnx.Param`s."""
    return Transformer(config, params)


def to_params(model: Transformer) -> transformer.Params:
    """Our parameter tree of an NNX view (its very arrays): the inverse of `from_params`."""
    names = ("embed", "layers", "final_norm") + (() if model.config.tie_embeddings else ("lm_head",))
    return {name: _tree(getattr(model, name)) for name in names}
