"""Forward, prefill and decode agree; tree-masked decode equals per-branch sequences; a cache
read up to its attended slots."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support import tiny
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import RopeScaling

CFG = tiny.config(vocab_size=61, intermediate_size=48, qkv_bias=True, rope_theta=500.0,
                  rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16))


@pytest.fixture(scope="module")
def params():
    return tfm.init_params(CFG, jax.random.PRNGKey(0), init_std=0.2)


# The library's callers run these jitted; run op by op, each operation (per shape) compiles
# a program of its own, most of these tests' CPU from an empty compilation cache.
_forward = jax.jit(tfm.forward, static_argnums=1, static_argnames=("layer_ids",))
_prefill = jax.jit(tfm.prefill, static_argnums=1, static_argnames=("return_logits",))
_decode = jax.jit(tfm.decode, static_argnums=1, static_argnames=("return_logits", "layer_ids"))
_logits_from_hidden = jax.jit(tfm.logits_from_hidden, static_argnums=1)


@jax.jit
def _last_logits(params, tokens):
    """The forward's logits at the last position of each sequence."""
    return tfm.logits_from_hidden(params, CFG, tfm.forward(params, CFG, tokens))[:, -1]


def _tokens(b, t, seed=1):
    return jax.random.randint(jax.random.PRNGKey(seed), (b, t), 0, CFG.vocab_size)


def test_prefill_and_decode_match_forward(params):
    b, t, s = 2, 9, 16
    tokens = _tokens(b, t)
    h_full = _forward(params, CFG, tokens)
    logits_full = _logits_from_hidden(params, CFG, h_full)

    # Prefill the first 4 tokens, then decode the rest one at a time.
    cache = tfm.init_cache(CFG, b, s)
    logits_last, _, cache = _prefill(params, CFG, cache, tokens[:, :4], jnp.full((b,), 4),
                                     return_logits=True)
    np.testing.assert_allclose(logits_last, logits_full[:, 3], atol=1e-5, rtol=1e-5)
    step = jax.jit(lambda c, tok, pos: tfm.decode(params, CFG, c, tok, pos, return_logits=True))
    for i in range(4, t):
        logits, _, cache = step(cache, tokens[:, i:i + 1], jnp.full((b, 1), i))
        np.testing.assert_allclose(logits[:, 0], logits_full[:, i], atol=1e-5, rtol=1e-5)
    assert cache.lengths.tolist() == [t, t]

    # Whole-sequence prefill equals forward at the last position.
    cache = tfm.init_cache(CFG, b, s)
    h_last, _ = _prefill(params, CFG, cache, tokens, jnp.full((b,), t))
    np.testing.assert_allclose(h_last, h_full[:, -1], atol=1e-5, rtol=1e-5)


def test_right_padded_prefill_ignores_padding(params):
    tokens = _tokens(2, 7)
    lengths = jnp.array([7, 4])
    cache = tfm.init_cache(CFG, 2, 12)
    padded = tokens.at[1, 4:].set(0)
    logits, _, cache = _prefill(params, CFG, cache, padded, lengths, return_logits=True)
    ref = _last_logits(params, tokens[1:, :4])[0]
    np.testing.assert_allclose(logits[1], ref, atol=1e-5, rtol=1e-5)
    # The next decode step of the short sequence sees only its 4 real tokens.
    nxt = jnp.array([[3], [5]])
    logits2, _, _ = _decode(params, CFG, cache, nxt, lengths[:, None], return_logits=True)
    seq = jnp.concatenate([tokens[1, :4], nxt[1]])[None]
    ref2 = _last_logits(params, seq)[0]
    np.testing.assert_allclose(logits2[1, 0], ref2, atol=1e-5, rtol=1e-5)


def test_tree_mask_decode_equals_each_branch(params):
    """A 5-node tree: root r, children a, b of r, child c of a, child d of b."""
    b, prompt_len = 1, 5
    prompt = _tokens(b, prompt_len, seed=3)
    tree_tokens = jnp.array([[11, 12, 13, 14, 15]])  # r, a, b, c, d
    parents = [-1, 0, 0, 1, 2]
    depth = [0, 1, 1, 2, 2]
    mask = np.zeros((5, 5), bool)
    for i in range(5):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    cache = tfm.init_cache(CFG, b, 16)
    _, cache = _prefill(params, CFG, cache, prompt, jnp.array([prompt_len]))
    positions = prompt_len + jnp.array([depth])
    logits, _, cache2 = _decode(params, CFG, cache, tree_tokens, positions,
                                mask_BTW=jnp.asarray(mask)[None], return_logits=True)
    assert int(cache2.lengths[0]) == prompt_len + 5
    for node in range(5):
        path, j = [], node
        while j >= 0:
            path.append(int(tree_tokens[0, j]))
            j = parents[j]
        seq = jnp.concatenate([prompt[0], jnp.array(path[::-1])])[None]
        ref = _last_logits(params, seq)[0]
        np.testing.assert_allclose(logits[0, node], ref, atol=1e-5, rtol=1e-5)


def test_tree_grown_level_by_level_equals_one_shot(params):
    """Scratch slots (W > T): the same tree decoded one level at a time, each level
    seeing only its ancestors among earlier levels, gives the one-shot logits."""
    prompt = _tokens(1, 4, seed=7)
    tree_tokens = jnp.array([[21, 22, 23, 24, 25]])  # r, a, b | c (of a), d (of b)
    parents = [-1, 0, 0, 1, 2]
    ancestors = np.zeros((5, 5), bool)
    for i in range(5):
        j = i
        while j >= 0:
            ancestors[i, j], j = True, parents[j]
    depth = jnp.array([[0, 1, 1, 2, 2]]) + 4
    cache = tfm.init_cache(CFG, 1, 16)
    _, cache = _prefill(params, CFG, cache, prompt, jnp.array([4]))
    one_shot, _, _ = _decode(params, CFG, cache, tree_tokens, depth, mask_BTW=jnp.asarray(ancestors)[None],
                             return_logits=True)
    pieces = []
    for lo, hi in [(0, 1), (1, 3), (3, 5)]:
        logits, _, grown = _decode(params, CFG, cache, tree_tokens[:, lo:hi], depth[:, lo:hi],
                                   mask_BTW=jnp.asarray(ancestors[lo:hi, :hi])[None], return_logits=True)
        cache = grown.with_lengths(cache.lengths)  # the levels stay scratch
        pieces.append(logits)
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), one_shot, atol=1e-5, rtol=1e-5)


def test_attended_slots_are_all_decode_reads(params):
    """A cache read up to `attended` slots: what lies beyond (NaN here) never reaches the
    outputs, which equal those of the whole cache; the writes past it still land."""
    b, s, attended = 2, 24, 13
    tokens = _tokens(b, 12)
    cache = tfm.init_cache(CFG, b, s)
    _, cache = _prefill(params, CFG, cache, tokens[:, :8], jnp.array([8, 5]))
    beyond = (jnp.arange(s) >= attended)[None, None, :, None, None]
    poisoned = dataclasses.replace(cache, k=jnp.where(beyond, jnp.nan, cache.k),
                                   v=jnp.where(beyond, jnp.nan, cache.v)).attending(attended)
    step = jax.jit(lambda c, tok, pos: tfm.decode(params, CFG, c, tok, pos, return_logits=True))
    lengths = cache.lengths[:, None]
    for t in (1, 4):  # lengths + 4 <= 13: a step of one token and one of four
        want, _, whole = step(cache, tokens[:, 8:8 + t], lengths + jnp.arange(t))
        got, _, part = step(poisoned, tokens[:, 8:8 + t], lengths + jnp.arange(t))
        np.testing.assert_allclose(got, want, atol=1e-6)
        assert part.attended == attended and part.lengths.tolist() == whole.lengths.tolist()
    tree = jnp.tril(jnp.ones((b, 4, 4), bool))
    want = step(cache, tokens[:, 8:12], lengths + jnp.arange(4))[0]
    got = jax.jit(lambda c: tfm.decode(params, CFG, c, tokens[:, 8:12], lengths + jnp.arange(4), mask_BTW=tree,
                                       return_logits=True)[0])(poisoned)
    np.testing.assert_allclose(got, want, atol=1e-5)  # an explicit mask reads the same slots
    with pytest.raises(ValueError, match="attended slots 25"):
        cache.attending(25)


def test_decode_layouts_equal_the_stacked_one(params):
    """decode's layouts (per-layer weights in an unrolled loop, fused projections, both)
    give the stacked, scanned path's logits, cache and layer outputs, tree mask included."""
    prompt = _tokens(2, 5, seed=3)
    cache = tfm.init_cache(CFG, 2, 12)
    _, cache = _prefill(params, CFG, cache, prompt, jnp.array([5, 3]))
    tokens = _tokens(2, 3, seed=4)
    mask = jnp.asarray(np.tril(np.ones((3, 3), bool)) & [[1, 0, 0], [1, 1, 0], [1, 0, 1]])
    positions = cache.lengths[:, None] + jnp.array([[0, 1, 1]])
    per_layer = tfm.unstack_layers(params)
    assert len(per_layer["layers"]) == CFG.num_layers and tfm.unstack_layers(per_layer) is per_layer
    layouts = [params, per_layer, tfm.fuse_projections(params, CFG), tfm.fuse_projections(per_layer, CFG)]
    assert tfm.fuse_projections(layouts[3], CFG) is layouts[3]
    assert layouts[3]["layers"][1]["wqkv"].shape == (32, 2, 4, 8) and "wq" not in layouts[2]["layers"]
    run = jax.jit(lambda p: tfm.decode(p, CFG, cache, tokens, positions, mask_BTW=jnp.broadcast_to(mask, (2, 3, 3)),
                                       return_logits=True, layer_ids=(0,)))
    expected = run(params)
    for layout in layouts[1:]:
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5), run(layout), expected)


def test_layer_outputs_and_segments(params):
    tokens = _tokens(1, 8, seed=5)
    h, layers = _forward(params, CFG, tokens, layer_ids=(0, 1))
    assert layers.shape == (2, 1, 8, CFG.hidden_size)
    # The last layer's output, normed, is the final hidden state.
    np.testing.assert_allclose(tfm.rms_norm(layers[1], params["final_norm"], CFG.rms_norm_eps), h,
                               atol=1e-6)
    # Two packed segments behave like two separate sequences.
    seg = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1]])
    pos = jnp.array([[0, 1, 2, 0, 1, 2, 3, 4]])
    h_packed = _forward(params, CFG, tokens, positions_BT=pos, segment_ids_BT=seg)
    np.testing.assert_allclose(h_packed[:, 3:], _forward(params, CFG, tokens[:, 3:]), atol=1e-5)


def test_bf16_runs_close_to_f32(params):
    cfg16 = CFG.replace(dtype="bfloat16", param_dtype="bfloat16")
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    tokens = _tokens(2, 6)
    h32 = _forward(params, CFG, tokens)
    h16 = _forward(p16, cfg16, tokens)
    assert h16.dtype == jnp.bfloat16
    rel = jnp.linalg.norm(h16.astype(jnp.float32) - h32) / jnp.linalg.norm(h32)
    assert rel < 3e-2


def test_bf16_decode_layouts_stay_near_forward(params):
    """In bfloat16 the layouts differ from the scanned forward only by rounding (XLA may
    keep float32 across fused operations): next-token log-probs within 0.05 nats."""
    cfg16 = CFG.replace(dtype="bfloat16", param_dtype="bfloat16")
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    tokens = _tokens(2, 12, seed=9)
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))

    @jax.jit
    def logp(logits):
        logq = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        return jnp.take_along_axis(logq[:, :-1], tokens[:, 1:, None], -1)[..., 0]

    expected = logp(_logits_from_hidden(p16, cfg16, _forward(p16, cfg16, tokens)))
    cache = tfm.init_cache(cfg16, 2, 12)
    for layout in (p16, tfm.fuse_projections(tfm.unstack_layers(p16), cfg16)):
        logits = jax.jit(lambda p: tfm.decode(p, cfg16, cache, tokens, positions, return_logits=True)[0])(layout)
        assert float(jnp.max(jnp.abs(logp(logits) - expected))) < 0.05


def test_config_errors():
    with pytest.raises(ValueError, match="model_type"):
        CFG.replace(model_type="gpt2")
    with pytest.raises(ValueError, match="num_kv_heads"):
        CFG.replace(num_kv_heads=3)


def test_appended_identity_layers_keep_the_function_and_train(params):
    """Deeper with the same outputs (the CPU TLT preset's target), and the new layers are
    real: they take gradient and, once moved, change the output."""
    deep_cfg, deep = tfm.append_identity_layers(params, CFG, 5)
    assert deep_cfg.num_layers == 5 and deep["layers"]["wq"].shape[0] == 5
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 9), 0, CFG.vocab_size)
    np.testing.assert_array_equal(_forward(deep, deep_cfg, tokens), _forward(params, CFG, tokens))
    np.testing.assert_array_equal(deep["layers"]["wq"][3], params["layers"]["wq"][1])  # copied cyclically
    grads = jax.jit(jax.grad(lambda p: jnp.sum(_forward(p, deep_cfg, tokens) ** 2)))(deep)
    assert float(jnp.abs(grads["layers"]["wo"][4]).max()) > 0
    moved = {**deep, "layers": {**deep["layers"], "w_down": deep["layers"]["w_down"].at[4].add(0.1)}}
    assert not np.allclose(_forward(moved, deep_cfg, tokens), _forward(params, CFG, tokens))
    with pytest.raises(ValueError, match="can only grow"):
        tfm.append_identity_layers(params, CFG, 1)


def test_padded_mlp_keeps_the_function_and_its_dead_units_stay_dead(params):
    """Wider MLPs with the same outputs (the CPU preset whose weights outgrow the cache):
    every layer's output, the final hidden state the drafter reads and the logits, equal to
    float rounding, in forward and in decode; the new units take no gradient."""
    wide_cfg, wide = tfm.pad_mlp(params, CFG, 200)
    assert wide_cfg.intermediate_size == 200 and wide["layers"]["w_down"].shape == (2, 200, CFG.hidden_size)
    tokens = _tokens(2, 9)
    h, layers = _forward(params, CFG, tokens, layer_ids=(0, 1))
    h_wide, layers_wide = _forward(wide, wide_cfg, tokens, layer_ids=(0, 1))
    np.testing.assert_allclose(h_wide, h, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(layers_wide, layers, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(_logits_from_hidden(wide, wide_cfg, h_wide), _logits_from_hidden(params, CFG, h),
                               atol=1e-5, rtol=1e-6)
    logits, _, _ = _prefill(params, CFG, tfm.init_cache(CFG, 2, 12), tokens, jnp.full((2,), 9), return_logits=True)
    logits_wide, _, _ = _prefill(tfm.fuse_projections(tfm.unstack_layers(wide), wide_cfg), wide_cfg,
                                 tfm.init_cache(wide_cfg, 2, 12), tokens, jnp.full((2,), 9), return_logits=True)
    np.testing.assert_allclose(logits_wide, logits, atol=1e-5, rtol=1e-6)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(_forward(p, wide_cfg, tokens) ** 2)))(wide)["layers"]
    for name, extra in (("w_gate", grads["w_gate"][..., 48:]), ("w_up", grads["w_up"][..., 48:]),
                        ("w_down", grads["w_down"][:, 48:])):
        assert not np.any(np.asarray(extra)), name
    assert float(jnp.abs(grads["w_down"][:, :48]).max()) > 0
    with pytest.raises(ValueError, match="can only grow"):
        tfm.pad_mlp(params, CFG, 47)
    with pytest.raises(ValueError, match="stacked, unfused"):
        tfm.pad_mlp(tfm.unstack_layers(params), CFG, 200)
    # narrow_mlp undoes it in every layout (the engine's prefill reads the model's own units).
    same = lambda a, b: jax.tree.map(np.testing.assert_array_equal, a, b)
    same(tfm.narrow_mlp(wide, CFG.intermediate_size), params)
    decode_layout = lambda p, cfg: tfm.fuse_projections(tfm.unstack_layers(p), cfg)
    same(tfm.narrow_mlp(decode_layout(wide, wide_cfg), CFG.intermediate_size), decode_layout(params, CFG))
