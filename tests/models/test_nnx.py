"""The flax NNX view: our tree -> nnx -> our tree is the same arrays in every layout, the
Params carry the logical axes, and the module's forward (eager, or nnx.split / nnx.merge
inside jit, gradients included) is ours to the bit, on random weights and on a loaded
Hugging Face checkpoint."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.support import tiny
from tlt_jax.models import hf_io
from tlt_jax.models import nnx as tlt_nnx
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import ModelConfig

TINY = dict(tiny.HF_SHAPES, head_dim=8)
CONFIGS = {
    "llama_untied": ModelConfig(**TINY),
    "qwen2_bias_tied": ModelConfig(**TINY, model_type="qwen2", qkv_bias=True, tie_embeddings=True),
}
LAYOUTS = {
    "stacked": lambda p, c: p,
    "per_layer": lambda p, c: tfm.unstack_layers(p),
    "fused": lambda p, c: tfm.fuse_projections(p, c),
    "per_layer_fused": lambda p, c: tfm.fuse_projections(tfm.unstack_layers(p), c),
}
TOKENS_BT = jnp.asarray(np.random.default_rng(1).integers(0, TINY["vocab_size"], (2, 12)), jnp.int32)
SEGMENTS_BT = jnp.asarray([[0] * 5 + [1] * 7, [0] * 12], jnp.int32)


def _random_params(config, seed=0):
    """N(0, 0.2) device arrays in init_params' layout (numpy draws: no slow CPU compile)."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: tfm.init_params(config, jax.random.PRNGKey(0)))
    return jax.tree.map(lambda s: jnp.asarray((0.2 * rng.standard_normal(s.shape)).astype(np.float32)), shapes)


def _our_logits(params, config, tokens_BT, **kwargs):
    return tfm.logits_from_hidden(params, config, tfm.forward(params, config, tokens_BT, **kwargs))


def _assert_bitwise_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def _path(key_path):
    """A jax key path as nnx spells state paths: dict keys and list indices."""
    return tuple(getattr(k, "key", getattr(k, "idx", None)) for k in key_path)


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return tree


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_round_trip_is_the_same_arrays_with_their_logical_axes(name, layout):
    config = CONFIGS[name]
    params = LAYOUTS[layout](_random_params(config), config)
    model = tlt_nnx.from_params(config, params)
    back = tlt_nnx.to_params(model)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        assert y is x  # no copy either way
        _assert_bitwise_equal(x, y)

    # The Params are our tree's arrays at our tree's paths, one each, carrying the logical axes
    # of transformer.param_logical_axes where nnx.get_partition_spec reads them.
    axes = tfm.param_logical_axes(config, per_layer=tfm.has_per_layer_weights(params),
                                  fused=tfm.has_fused_projections(params))
    state = nnx.state(model, nnx.Param)
    flat = list(nnx.to_flat_state(state))
    specs = dict(nnx.to_flat_state(nnx.get_partition_spec(state)))
    assert len(flat) == len(jax.tree.leaves(params)) == len(jax.tree.leaves(state))
    assert sorted(p for p, _ in flat) == sorted(_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0])
    for path, param in flat:
        assert isinstance(param, nnx.Param) and param.get_value() is _at(params, path)
        assert specs[path].get_value() == jax.sharding.PartitionSpec(*_at(axes, path))

    # And back: the state of a view rebuilt from to_params is the same arrays.
    again = nnx.state(tlt_nnx.from_params(config, back), nnx.Param)
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(again)):
        assert y is x


@pytest.mark.parametrize("layout", ["stacked", "fused"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_is_ours_to_the_bit_eager_and_split_merge_in_jit(name, layout):
    config = CONFIGS[name]
    params = LAYOUTS[layout](_random_params(config), config)
    model = tlt_nnx.from_params(config, params)
    kwargs = dict(segment_ids_BT=SEGMENTS_BT)
    logits_BTV = model(TOKENS_BT, **kwargs)
    assert logits_BTV.shape == TOKENS_BT.shape + (config.vocab_size,) and logits_BTV.dtype == jnp.float32
    _assert_bitwise_equal(logits_BTV, _our_logits(params, config, TOKENS_BT, **kwargs))

    # The hot-loop pattern: split once, merge inside the jitted function.
    graphdef, state = nnx.split(model)

    @jax.jit
    def nnx_logits(graphdef, state, tokens_BT):
        return nnx.merge(graphdef, state)(tokens_BT, **kwargs)

    ours = jax.jit(lambda p, t: _our_logits(p, config, t, **kwargs))(params, TOKENS_BT)
    _assert_bitwise_equal(nnx_logits(graphdef, state, TOKENS_BT), ours)


def test_gradients_through_split_merge_are_ours():
    config = CONFIGS["qwen2_bias_tied"]
    params = _random_params(config)
    graphdef, state = nnx.split(tlt_nnx.from_params(config, params))

    def nnx_loss(state):
        return jnp.mean(nnx.merge(graphdef, state)(TOKENS_BT) ** 2)

    nnx_grads = tlt_nnx.to_params(nnx.merge(graphdef, jax.jit(jax.grad(nnx_loss))(state)))
    our_grads = jax.jit(jax.grad(lambda p: jnp.mean(_our_logits(p, config, TOKENS_BT) ** 2)))(params)
    assert jax.tree.structure(nnx_grads) == jax.tree.structure(our_grads)
    for x, y in zip(jax.tree.leaves(nnx_grads), jax.tree.leaves(our_grads)):
        _assert_bitwise_equal(x, y)


def test_a_model_made_the_nnx_way_is_ours():
    config = CONFIGS["llama_untied"]
    model = tlt_nnx.Transformer(config, rngs=nnx.Rngs(params=0))
    params = tlt_nnx.to_params(model)
    expected = jax.eval_shape(lambda: tfm.init_params(config, jax.random.PRNGKey(0)))
    assert jax.tree.structure(params) == jax.tree.structure(expected)
    assert all(x.shape == s.shape and x.dtype == s.dtype
               for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(expected)))
    _assert_bitwise_equal(model(TOKENS_BT), _our_logits(params, config, TOKENS_BT))


def test_bad_trees_and_layouts_fail_clearly():
    config = CONFIGS["llama_untied"]
    params = _random_params(config)
    with pytest.raises(ValueError, match="not one of transformer's layouts"):
        tlt_nnx.from_params(config, {k: v for k, v in params.items() if k != "lm_head"})
    with pytest.raises(ValueError, match="not one of transformer's layouts"):
        tlt_nnx.from_params(CONFIGS["qwen2_bias_tied"], params)
    with pytest.raises(ValueError, match="exactly one of"):
        tlt_nnx.Transformer(config)
    with pytest.raises(ValueError, match="per-layer"):
        tlt_nnx.from_params(config, tfm.unstack_layers(params))(TOKENS_BT)


def test_a_loaded_hugging_face_checkpoint_viewed_as_nnx(tmp_path):
    from experiments.make_random_hf import write_random_checkpoint

    path = write_random_checkpoint(str(tmp_path / "qwen2"), "qwen2", tokenizer=False, tie_embeddings=True,
                                   **{k: v for k, v in TINY.items() if k != "head_dim"})
    config, host_params = hf_io.load_hf(path)
    params = jax.device_put(host_params)
    model = tlt_nnx.from_params(config, params)
    assert model.config == config and config.qkv_bias and config.tie_embeddings
    for x, y in zip(jax.tree.leaves(host_params), jax.tree.leaves(tlt_nnx.to_params(model))):
        _assert_bitwise_equal(x, y)
    _assert_bitwise_equal(model(TOKENS_BT), _our_logits(params, config, TOKENS_BT))
