"""tlt_jax.losses against a float64 torch reference: values, and gradients of h and w
under a random cotangent, for every implementation (pallas in interpret mode)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pallas_kernels import fused_linear_kl
from tlt_jax import losses

# Odd sizes with small explicit blocks so several token blocks, vocab tiles and D
# chunks (and their padding) are exercised.
N, D, V = 37, 24, 203
BLOCKS = {"dense": None, "chunked_xla": {"tokens": 16, "vocab": 64}, "pallas": {"tokens": 16, "vocab": 64, "depth": 16}}
IMPLS = tuple(BLOCKS)


@pytest.fixture(autouse=True)
def _small_sparse_blocks(monkeypatch):
    # Several row blocks in the pallas engine's XLA gather/scatter of W columns too.
    monkeypatch.setattr(fused_linear_kl, "_SPARSE_ROWS", 16)


def _inputs(seed, k, dtype, masked):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(N, D)), dtype)
    w = jnp.asarray(rng.normal(size=(D, V)) / np.sqrt(D) * 2.0, dtype)
    ids = np.stack([rng.choice(V, size=k, replace=False) for _ in range(N)]).astype(np.int32)
    logits = rng.normal(size=(N, k)) * 2.0
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True)) - 0.3  # M = e^-0.3
    mask = np.ones(N, bool)
    if masked:
        mask[[3, 17, 36]] = False
        logp[3] = np.nan  # masked rows may hold garbage teacher entries
        ids[17, 0] = -5
        if k > 1:
            ids[5, 0], ids[8, 1] = -1, V + 3  # absent entries in unmasked rows
    return h, w, ids, logp.astype(np.float32), mask


def _t64(x):
    return torch.tensor(np.asarray(jnp.asarray(x, jnp.float32)), dtype=torch.float64)


def _torch_kl(h, w, ids, logp, mask, temperature, tail):
    """Reference loss_N from the definition, float64; masked / absent entries dropped."""
    logq = torch.log_softmax(h @ w / temperature, dim=1)
    valid = (ids >= 0) & (ids < V) & mask[:, None]
    logq_k = torch.gather(logq, 1, torch.where(valid, ids, 0))
    logp = torch.where(valid, logp, torch.zeros_like(logp))
    p = torch.where(valid, logp.exp(), torch.zeros_like(logp))
    loss = (p * (logp - logq_k)).sum(1)
    if tail:
        one_m_mass = 1 - p.sum(1)
        one_m_q = 1 - torch.where(valid, logq_k.exp(), torch.zeros_like(logp)).sum(1)
        loss = loss + one_m_mass * torch.log(one_m_mass / one_m_q)
    return torch.where(mask, loss, torch.zeros_like(loss))


def _rel_err(got, want):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = want.detach().numpy() if isinstance(want, torch.Tensor) else np.asarray(want)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


# (name, dtype, K, tail, temperature, reduction, masked)
KL_CASES = [
    ("f32_k7_masked", jnp.float32, 7, False, 1.0, "none", True),
    ("f32_k7_tail_t07", jnp.float32, 7, True, 0.7, "none", False),
    ("bf16_k100_tail_mean", jnp.bfloat16, 100, True, 1.3, "mean", True),
    ("f32_k1_sum", jnp.float32, 1, False, 1.0, "sum", True),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", KL_CASES, ids=[c[0] for c in KL_CASES])
def test_topk_kl_matches_float64_reference(impl, case):
    _, dtype, k, tail, temperature, reduction, masked = case
    h, w, ids, logp, mask = _inputs(seed=k, k=k, dtype=dtype, masked=masked)
    cot = np.random.default_rng(1).normal(size=N).astype(np.float32)
    if reduction != "none":
        cot = cot[:1]  # one scalar cotangent

    def objective(h, w):
        loss = losses.linear_topk_kl(
            h,
            w,
            ids,
            logp,
            mask_N=mask,
            temperature=temperature,
            tail=tail,
            reduction=reduction,
            impl=impl,
            block_sizes=BLOCKS[impl],
        )
        return jnp.sum(loss * cot), loss

    (_, loss), (dh, dw) = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))(h, w)

    th, tw = _t64(h).requires_grad_(), _t64(w).requires_grad_()
    ref_n = _torch_kl(
        th,
        tw,
        torch.tensor(ids, dtype=torch.long),
        torch.tensor(np.nan_to_num(logp), dtype=torch.float64),
        torch.tensor(mask),
        temperature,
        tail,
    )
    ref = {"none": ref_n, "sum": ref_n.sum(), "mean": ref_n.sum() / mask.sum()}[reduction]
    (ref * torch.tensor(cot, dtype=torch.float64)).sum().backward()

    assert loss.dtype == jnp.float32 and loss.shape == ref.shape
    assert dh.dtype == dtype and dw.dtype == dtype
    value_tol, grad_tol = (2e-6, 2e-6) if dtype == jnp.float32 else (2e-3, 1e-2)
    np.testing.assert_allclose(
        np.asarray(loss), ref.detach().numpy(), rtol=value_tol, atol=value_tol * float(ref.detach().abs().max())
    )
    assert _rel_err(dh, th.grad) < grad_tol
    assert _rel_err(dw, tw.grad) < grad_tol
    if masked and reduction == "none":
        assert np.all(np.asarray(loss)[~mask] == 0) and np.all(np.asarray(dh)[~mask] == 0)


def test_param_dtype_dw_accumulation_bf16():
    h, w, ids, logp, mask = _inputs(seed=0, k=7, dtype=jnp.bfloat16, masked=False)
    grad = jax.jit(
        jax.grad(
            lambda h, w, accum: losses.linear_topk_kl(
                h, w, ids, logp, reduction="sum", impl="chunked_xla",
                block_sizes={"tokens": 8, "vocab": 64, "dw_accum": accum}),
            argnums=(0, 1),
        ),
        static_argnums=2,
    )
    th, tw = _t64(h).requires_grad_(), _t64(w).requires_grad_()
    _torch_kl(
        th, tw, torch.tensor(ids, dtype=torch.long), _t64(logp), torch.ones(N, dtype=bool), 1.0, False
    ).sum().backward()
    for accum in ("float32", "param"):  # 5 bf16 partial sums of dW in "param"
        dh, dw = grad(h, w, accum)
        assert dw.dtype == jnp.bfloat16
        assert _rel_err(dh, th.grad) < 1e-2 and _rel_err(dw, tw.grad) < 2e-2


@pytest.mark.parametrize("with_entropy", [True, False], ids=["entropy", "logp_only"])
@pytest.mark.parametrize("impl", IMPLS)
def test_logprob_and_entropy_match_log_softmax(impl, with_entropy):
    """Values and gradients of h and w against float64; without entropy this is the
    gradient GRPO and SFT train through (its own backward branch)."""
    h, w, _, _, _ = _inputs(seed=3, k=1, dtype=jnp.float32, masked=False)
    targets = np.random.default_rng(4).integers(0, V, size=N).astype(np.int32)
    targets[[2, 9]] = [-1, V]  # padding: logp 0, no gradient
    temperature = 0.8
    c_lp, c_ent = np.random.default_rng(5).normal(size=(2, N)).astype(np.float32)

    def objective(h, w):
        out = losses.linear_logprob(
            h, w, targets, temperature=temperature, with_entropy=with_entropy, impl=impl, block_sizes=BLOCKS[impl]
        )
        logp, ent = out if with_entropy else (out, jnp.zeros(N))
        return jnp.sum(logp * c_lp + ent * c_ent), (logp, ent)

    (_, (logp, ent)), (dh, dw) = jax.jit(jax.value_and_grad(objective, (0, 1), has_aux=True))(h, w)

    th, tw = _t64(h).requires_grad_(), _t64(w).requires_grad_()
    logq = torch.log_softmax(th @ tw / temperature, dim=1)
    valid = torch.tensor((targets >= 0) & (targets < V))
    ref_lp = torch.where(
        valid,
        torch.gather(logq, 1, torch.tensor(np.clip(targets, 0, V - 1), dtype=torch.long)[:, None])[:, 0],
        torch.zeros(N, dtype=torch.float64),
    )
    ref_ent = -(logq.exp() * logq).sum(1) if with_entropy else torch.zeros(N, dtype=torch.float64)
    (ref_lp * _t64(c_lp) + ref_ent * _t64(c_ent)).sum().backward()

    np.testing.assert_allclose(np.asarray(logp), ref_lp.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), ref_ent.detach().numpy(), rtol=1e-5, atol=1e-5)
    assert _rel_err(dh, th.grad) < 2e-5 and _rel_err(dw, tw.grad) < 2e-5
    if not with_entropy:
        assert not np.asarray(dh)[[2, 9]].any()  # padding rows: no log-prob, no gradient


def test_logprob_without_entropy_is_kl_with_k1():
    h, w, _, _, _ = _inputs(seed=6, k=1, dtype=jnp.float32, masked=False)
    targets = np.random.default_rng(7).integers(0, V, size=N).astype(np.int32)
    # One jitted program, as the learner runs them (op by op, each operation compiles a program of its own).
    logp, kl = jax.jit(lambda h, w: (
        losses.linear_logprob(h, w, targets, block_sizes={"tokens": 16}),
        losses.linear_topk_kl(h, w, targets[:, None], np.zeros((N, 1), np.float32), block_sizes={"tokens": 16})))(h, w)
    np.testing.assert_allclose(np.asarray(logp), -np.asarray(kl), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["chunked_xla", "pallas"])
def test_logprob_topk_matches_float64_reference(impl):
    """The drafter's data from the learner's forward: top-k ids and log-probs per row from
    the same blockwise projection, against log_softmax in float64; the log-probs and
    entropy are linear_logprob's, bit for bit, and so are their gradients (the on-policy
    update trains through them), while the top-k log-probs carry none."""
    h, w, _, _, _ = _inputs(seed=11, k=1, dtype=jnp.float32, masked=False)
    targets = np.random.default_rng(12).integers(0, V, size=N).astype(np.int32)
    targets[4] = -1  # padding: logp 0
    k, temperature, blocks = 7, 0.7, BLOCKS[impl]
    logp, ent, ids, top_logp = jax.jit(lambda h, w: losses.linear_logprob_topk(
        h, w, targets, k, temperature=temperature, impl=impl, block_sizes=blocks))(h, w)
    plain = jax.jit(lambda h, w: losses.linear_logprob(h, w, targets, temperature=temperature, with_entropy=True,
                                                       impl=impl, block_sizes=blocks))(h, w)
    np.testing.assert_array_equal(np.asarray(logp), np.asarray(plain[0]))
    np.testing.assert_array_equal(np.asarray(ent), np.asarray(plain[1]))
    logq = torch.log_softmax(_t64(h) @ _t64(w) / temperature, dim=1).numpy()
    order = np.argsort(-logq, axis=1)[:, :k]
    np.testing.assert_array_equal(np.asarray(ids), order)
    np.testing.assert_allclose(np.asarray(top_logp), np.take_along_axis(logq, order, 1), rtol=1e-5, atol=1e-5)
    assert ids.dtype == jnp.int32 and top_logp.shape == (N, k)

    c_lp, c_ent, c_top = (jnp.asarray(c) for c in np.random.default_rng(13).normal(size=(3, N)).astype(np.float32))
    grad = lambda fn: jax.jit(jax.grad(fn, argnums=(0, 1)))(h, w)
    dh, dw = grad(lambda h, w: (lambda lp, ent, _, top: jnp.sum(lp * c_lp + ent * c_ent + top.sum(1) * c_top))(
        *losses.linear_logprob_topk(h, w, targets, k, temperature=temperature, impl=impl, block_sizes=blocks)))
    plain_dh, plain_dw = grad(lambda h, w: (lambda lp, ent: jnp.sum(lp * c_lp + ent * c_ent))(*losses.linear_logprob(
        h, w, targets, temperature=temperature, with_entropy=True, impl=impl, block_sizes=blocks)))
    np.testing.assert_array_equal(np.asarray(dh), np.asarray(plain_dh))
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(plain_dw))
    th, tw = _t64(h).requires_grad_(), _t64(w).requires_grad_()
    logq = torch.log_softmax(th @ tw / temperature, dim=1)
    picked = torch.gather(logq, 1, torch.tensor(np.clip(targets, 0, V - 1), dtype=torch.long)[:, None])[:, 0]
    ref_lp = torch.where(torch.tensor(targets >= 0), picked, torch.zeros(N, dtype=torch.float64))
    (ref_lp * _t64(c_lp) - (logq.exp() * logq).sum(1) * _t64(c_ent)).sum().backward()
    assert _rel_err(dh, th.grad) < 2e-5 and _rel_err(dw, tw.grad) < 2e-5


def _tied_inputs(seed):
    """h, w with entries in {-1, 0, 1}: every logit is an integer in [-D, D], exact in
    float32 and under the temperature's scaling, so each row holds many ties."""
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.integers(-1, 2, size=(N, D)), jnp.float32),
            jnp.asarray(rng.integers(-1, 2, size=(D, V)), jnp.float32))


# (name, inputs, k): k past one vocabulary tile (64) fills the top-k from several tiles
# while the first one has fewer columns than k.
TOPK_CASES = [("normal_k7", "normal", 7), ("ties_k7", "tied", 7), ("ties_k70", "tied", 70), ("normal_k1", "normal", 1)]


@pytest.mark.parametrize("impl", ["chunked_xla", "pallas"])
@pytest.mark.parametrize("case", TOPK_CASES, ids=[c[0] for c in TOPK_CASES])
def test_teacher_topk_matches_float64_reference(impl, case):
    """A teacher's top-k from the blockwise projection (`linear_topk`, the cache's and the
    offline drafter's targets) on fresh random inputs at odd sizes, against float64: ids
    best first with ties to the lower id (lax.top_k's order), ties at the k-th value
    included, and full-vocabulary log-probs at them."""
    _, inputs, k = case
    seed = int(np.random.SeedSequence().generate_state(1)[0])  # fresh inputs each run, printed on failure
    if inputs == "tied":
        h, w = _tied_inputs(seed)
    else:
        h, w, _, _, _ = _inputs(seed, k=1, dtype=jnp.float32, masked=False)
    temperature = 0.7
    ids, logp = jax.jit(lambda h, w: losses.linear_topk(h, w, k, temperature=temperature, impl=impl,
                                                         block_sizes=BLOCKS[impl]))(h, w)
    logq = torch.log_softmax(_t64(h) @ _t64(w) / temperature, dim=1).numpy()
    order = np.argsort(-logq, axis=1, kind="stable")[:, :k]  # equal values: the lower id first
    if inputs == "tied":  # the k-th value is tied with the (k+1)-th in some rows
        sorted_q = np.take_along_axis(logq, np.argsort(-logq, axis=1, kind="stable"), 1)
        assert np.sum(sorted_q[:, k - 1] == sorted_q[:, k]) >= 3, f"seed {seed}"
    np.testing.assert_array_equal(np.asarray(ids), order, err_msg=f"seed {seed}")
    np.testing.assert_allclose(np.asarray(logp), np.take_along_axis(logq, order, 1), rtol=1e-5, atol=1e-5,
                               err_msg=f"seed {seed}")
    assert ids.dtype == jnp.int32 and logp.dtype == jnp.float32 and ids.shape == logp.shape == (N, k)


@pytest.mark.parametrize("impl", ["dense", "chunked_xla"])
def test_tail_is_finite_when_top_k_holds_all_mass(impl):
    # M = 1 exactly and a student that puts ~all its mass on the same K ids: 1 - M = 0
    # and 1 - Q underflows the f32 cancellation.
    k = 4
    rng = np.random.default_rng(8)
    ids = np.tile(np.arange(k, dtype=np.int32), (N, 1))
    logp = np.log(np.full((N, k), 1.0 / k, np.float32))
    h = jnp.asarray(np.abs(rng.normal(size=(N, D))) + 1.0, jnp.float32)
    w = np.full((D, V), -5.0, np.float32)
    w[:, :k] = 5.0
    loss, (dh, dw) = jax.jit(
        jax.value_and_grad(
            lambda h, w: losses.linear_topk_kl(
                h, w, ids, logp, tail=True, reduction="sum", impl=impl, block_sizes=BLOCKS[impl]
            ),
            argnums=(0, 1),
        )
    )(h, jnp.asarray(w))
    assert np.isfinite(float(loss)) and abs(float(loss)) < 1e-3
    assert np.all(np.isfinite(np.asarray(dh))) and np.all(np.isfinite(np.asarray(dw)))


def test_auto_resolves_per_backend():
    assert losses.resolve_impl("auto", "cpu") == "chunked_xla"
    assert losses.resolve_impl("pallas") == "pallas"


def test_bad_inputs_raise():
    h, w, ids, logp, _ = _inputs(seed=9, k=3, dtype=jnp.float32, masked=False)
    kl = losses.linear_topk_kl
    with pytest.raises(ValueError, match=r"\(37, 24\).*\(25, 203\)"):
        kl(h, jnp.zeros((D + 1, V)), ids, logp)
    with pytest.raises(ValueError, match="dtype"):
        kl(h, w.astype(jnp.bfloat16), ids, logp)
    with pytest.raises(ValueError, match=r"\(37, 2\).*\(37, 3\)"):
        kl(h, w, ids, logp[:, :2])
    with pytest.raises(ValueError, match="integer"):
        kl(h, w, ids.astype(np.float32), logp)
    with pytest.raises(ValueError, match="K <= V"):
        kl(h, w[:, :2], ids, logp)
    with pytest.raises(ValueError, match="mask_N"):
        kl(h, w, ids, logp, mask_N=np.ones(N - 1, bool))
    with pytest.raises(ValueError, match="reduction"):
        kl(h, w, ids, logp, reduction="max")
    with pytest.raises(ValueError, match="impl"):
        kl(h, w, ids, logp, impl="cuda")
    with pytest.raises(ValueError, match="temperature"):
        kl(h, w, ids, logp, temperature=0.0)
    with pytest.raises(ValueError, match="tokens"):
        kl(h, w, ids, logp, block_sizes={"tokens": 0})
    with pytest.raises(ValueError, match="targets_N"):
        losses.linear_logprob(h, w, ids)
    targets = ids[:, 0]
    with pytest.raises(ValueError, match=r"k=204 must lie in \[1, 203\] \(the vocabulary size\); set k <= 203"):
        losses.linear_logprob_topk(h, w, targets, V + 1)
    with pytest.raises(ValueError, match="k=0 must lie in"):
        losses.linear_logprob_topk(h, w, targets, 0)
    with pytest.raises(ValueError, match=r"k=204 must lie in \[1, 203\]"):
        losses.linear_topk(h, w, V + 1)
    with pytest.raises(ValueError, match=r"top_k=204 must lie in \[0, 203\] \(the vocabulary size\); lower top_k"):
        fused_linear_kl.row_stats("pallas", h, w, ids, temperature=1.0, with_ez=False, blocks=None, top_k=V + 1)


def test_pallas_without_a_lowering_names_the_backends_impls(monkeypatch):
    with pytest.raises(ValueError, match="impl='pallas' has no lowering on the tpu backend; pass one of auto, "
                                         "dense, chunked_xla."):
        losses.resolve_impl("pallas", "tpu")
    monkeypatch.setattr(fused_linear_kl, "_pltriton", None)  # a jax build without the Triton backend
    with pytest.raises(ValueError, match="no lowering on the gpu backend; pass one of auto, dense, chunked_xla"):
        losses.resolve_impl("pallas", "gpu")
    assert losses.resolve_impl("pallas", "cpu") == "pallas"  # the interpreter


@pytest.mark.skipif(fused_linear_kl._pltriton is None,
                    reason="this jax has no Pallas Triton backend: the fused KL kernel's lowering for CUDA is "
                           "unchecked (its math is checked in interpret mode; experiments/device_check.sh runs it)")
def test_pallas_lowers_to_triton_for_cuda():
    # Pallas -> Triton IR needs no GPU: catches ops the Triton lowering rejects. (PTX
    # compilation and speed are checked by experiments/bench_kl.py on the GPU.)
    blocks = {"tokens": 32, "vocab": 128, "depth": 64, "num_warps": 4, "num_stages": 2, "interpret": False}
    shapes = [
        jax.ShapeDtypeStruct(s, dt)
        for s, dt in (
            ((N, 192), jnp.bfloat16),
            ((192, 1000), jnp.bfloat16),
            ((N, 5), jnp.int32),
            ((N, 5), jnp.float32),
            ((N,), jnp.int32),
        )
    ]

    def objective(h, w, ids, logp, targets):
        kl = losses.linear_topk_kl(h, w, ids, logp, tail=True, temperature=0.5, impl="pallas", block_sizes=blocks)
        lp, ent = losses.linear_logprob(h, w, targets, with_entropy=True, impl="pallas", block_sizes=blocks)
        # The running top-k (k = 5: a block of P = 8 slots) beside the lse, as the learner runs it.
        lp_k, ent_k, _, top = losses.linear_logprob_topk(h, w, targets, 5, impl="pallas", block_sizes=blocks)
        return jnp.sum(kl) + jnp.sum(lp + ent) + jnp.sum(lp_k + ent_k) + jnp.sum(top)

    lowered = jax.jit(jax.grad(objective, argnums=(0, 1))).trace(*shapes).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    for kernel in ("fused_linear_lse", "fused_linear_stats", "fused_linear_dh", "fused_linear_dw"):
        assert f'name = "{kernel}"' in text


def test_no_implementation_but_dense_materialises_the_logits():
    """XLA's temp bytes (compile time, no allocation) of each loss's forward and backward,
    at a shape where [N, V] float32 logits are 128 MiB: dense holds them, chunked_xla a
    fraction (token blocks by vocabulary tiles)."""
    n, d, v, k = 16384, 32, 2048, 8
    f32, i32 = jnp.float32, jnp.int32
    h, w = jax.ShapeDtypeStruct((n, d), f32), jax.ShapeDtypeStruct((d, v), f32)
    ids, logp = jax.ShapeDtypeStruct((n, k), i32), jax.ShapeDtypeStruct((n, k), f32)
    targets = jax.ShapeDtypeStruct((n,), i32)
    grad = lambda loss: jax.grad(loss, argnums=(0, 1))
    cases = {
        "topk_kl": (lambda impl: grad(
            lambda h, w, i, p: losses.linear_topk_kl(h, w, i, p, reduction="mean", impl=impl)), (h, w, ids, logp)),
        "logprob": (lambda impl: grad(
            lambda h, w, t: losses.linear_logprob(h, w, t, impl=impl).sum()), (h, w, targets)),
        "logprob_entropy": (lambda impl: grad(lambda h, w, t: sum(
            x.sum() for x in losses.linear_logprob(h, w, t, with_entropy=True, impl=impl))), (h, w, targets)),
    }
    logits = n * v * 4
    temp = lambda fn, args: jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes
    for name, (make, args) in cases.items():
        dense, chunked = temp(make("dense"), args), temp(make("chunked_xla"), args)
        assert dense >= logits, (name, dense)  # the measure sees logits where they are
        assert chunked < logits / 4, (name, chunked / logits)
    # The old-policy pass: log-probs, entropy and top-k from the same blocks; and the
    # on-policy update, which trains through that pass's log-probs.
    topk = temp(lambda h, w, t: losses.linear_logprob_topk(h, w, t, k), (h, w, targets))
    assert topk < logits / 4, topk / logits
    topk_grad = temp(grad(lambda h, w, t: losses.linear_logprob_topk(h, w, t, k)[0].sum()), (h, w, targets))
    assert topk_grad < logits / 4, topk_grad / logits
    # A teacher's top-k alone (the cache, the offline drafter's targets).
    teacher = temp(lambda h, w: losses.linear_topk(h, w, k), (h, w))
    assert teacher < logits / 4, teacher / logits
    assert temp(lambda h, w: losses.linear_topk(h, w, k, impl="dense"), (h, w)) >= logits
