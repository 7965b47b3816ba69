"""The sampled teacher cache (Random-Sampling KD): its draws give an unbiased estimate of the
full-vocabulary KL gradient and a top-K cache of the same bytes does not; its storage as
distinct ids with counts, its kind in the cache's metadata, and its bad inputs."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from tests.support import teacher_cache_writer as fake
from tlt_jax import logprobs, losses
from tlt_jax.distill import teacher_cache as tc

# A small vocabulary, so the full KL gradient is exact and a top-K of it visibly biased.
N, D, V, SAMPLES, TEMPERATURE = 3, 4, 11, 4, 0.7
CACHES = 3000
FAMILY_ALPHA = 1e-3  # chance that some component of a correct estimator lands outside its band


def _full_kl_grads(h_ND, w_DV, p_NV):
    """d/d(h, w) of sum_n KL(p_n || softmax(h_n w / T)) in float64: dL/dz = (q - p) / T."""
    h, w = h_ND.astype(np.float64), w_DV.astype(np.float64)
    z = h @ w / TEMPERATURE
    q = np.exp(z - z.max(1, keepdims=True))
    q /= q.sum(1, keepdims=True)
    dz = (q - p_NV) / TEMPERATURE
    return dz @ w.T, h.T @ dz


def _grads_per_cache(h_ND, w_DV, ids_RNK, logp_RNK):
    """The student's gradient from each cache: the fused top-K KL (tail off) it trains with."""
    def one(ids_NK, logp_NK):
        loss = lambda h, w: losses.linear_topk_kl(h, w, ids_NK, logp_NK, temperature=TEMPERATURE, reduction="sum",
                                                  impl="chunked_xla")
        return jax.grad(loss, argnums=(0, 1))(h_ND, w_DV)

    dh, dw = jax.jit(jax.vmap(one))(jnp.asarray(ids_RNK), jnp.asarray(logp_RNK))
    return np.concatenate([np.asarray(dh, np.float64).reshape(len(ids_RNK), -1),
                           np.asarray(dw, np.float64).reshape(len(ids_RNK), -1)], axis=1)


def test_the_sampled_cache_is_unbiased_and_a_top_k_cache_of_its_bytes_is_not():
    """Over 3000 independently drawn caches (4 draws a position, teacher at T = 0.7 over 11
    tokens), the mean of the student's gradient equals the full-vocabulary KL gradient in
    every one of its 56 components within the standard error of that mean, at a family-wise
    level of 1e-3 (Bonferroni over the components). A top-K cache of the same bytes (its 4
    most likely ids with their exact log-probs) has no variance; its gradient lies outside
    the same bands."""
    rng = np.random.default_rng(0)
    h_t, w_t = rng.normal(size=(N, D)).astype(np.float32), rng.normal(size=(D, V)).astype(np.float32)
    h, w = jnp.asarray(rng.normal(size=(N, D)), jnp.float32), jnp.asarray(rng.normal(size=(D, V)), jnp.float32)
    z_t = h_t.astype(np.float64) @ w_t.astype(np.float64) / TEMPERATURE
    p_NV = np.exp(z_t - z_t.max(1, keepdims=True))
    p_NV /= p_NV.sum(1, keepdims=True)
    full = np.concatenate([g.reshape(-1) for g in _full_kl_grads(np.asarray(h), np.asarray(w), p_NV)])

    # Cache r, row n draws with key fold_in(key(r), n), as a cache's rows do.
    keys = jax.vmap(lambda r: jax.vmap(lambda n: jax.random.fold_in(jax.random.fold_in(jax.random.key(7), r), n))(
        jnp.arange(N)))(jnp.arange(CACHES)).reshape(-1)
    ids, counts = jax.jit(lambda h, w, keys: logprobs.linear_samples(
        h, w, SAMPLES, keys, width=SAMPLES, temperature=TEMPERATURE))(jnp.tile(h_t, (CACHES, 1)), w_t, keys)
    ids, counts = np.asarray(ids), np.asarray(counts)
    assert (counts.sum(1) == SAMPLES).all() and (np.diff(counts, axis=1) <= 0).all()  # every draw kept, most first
    assert all(len(set(row[row >= 0])) == (row >= 0).sum() for row in ids) and ((ids >= 0) == (counts > 0)).all()
    grads = _grads_per_cache(h, w, ids.reshape(CACHES, N, SAMPLES),
                             tc.empirical_logp(counts, SAMPLES).reshape(CACHES, N, SAMPLES))

    se = grads.std(0, ddof=1) / np.sqrt(CACHES)
    band = stats.norm.ppf(1 - FAMILY_ALPHA / (2 * full.size))  # Bonferroni, two-sided
    z = (grads.mean(0) - full) / se
    assert np.abs(z).max() < band, f"max |z| {np.abs(z).max():.2f} >= {band:.2f}: the sampled gradient is biased"

    top_ids = np.argsort(-p_NV, axis=1, kind="stable")[:, :SAMPLES]
    top_logp = np.log(np.take_along_axis(p_NV, top_ids, 1)).astype(np.float32)
    top = _grads_per_cache(h, w, top_ids[None], top_logp[None])[0]
    assert np.abs((top - full) / se).max() > band, "a top-K cache passed the unbiasedness test"


def test_a_sampled_cache_stores_ids_with_counts_and_reads_as_the_empirical_distribution(tmp_path):
    tokens_NT = fake.make_tokens(num_seq=4)
    meta = fake.make_meta(tokens_NT, logp_dtype="bfloat16", cache_kind="sampled", samples=6, top_k=fake.TOP_K)
    rng = np.random.default_rng(1)

    def teacher(tokens_BT, rows_B):  # a sampled cache's teacher is also given the rows' indices
        assert rows_B.shape == tokens_BT.shape[:1]
        draws = rng.integers(0, fake.VOCAB, (*tokens_BT.shape, 6))
        ids, counts = logprobs._distinct_counts(jnp.asarray(draws.reshape(-1, 6)), fake.TOP_K, fake.VOCAB)
        return (np.asarray(ids).reshape(*tokens_BT.shape, fake.TOP_K),
                np.asarray(counts).reshape(*tokens_BT.shape, fake.TOP_K))

    reader = tc.write_teacher_cache(tmp_path / "c", tokens_NT, teacher, meta, batch_size=2, progress=False)
    with open(tmp_path / "c" / "store.json") as f:
        store = json.load(f)
    assert store["metadata"]["cache_kind"] == "sampled" and store["metadata"]["samples"] == 6
    assert store["layout"]["fields"]["counts"]["dtype"] == "uint16"  # the bytes of the bf16 log-probs it replaces
    assert set(store["layout"]["fields"]) == {"ids", "counts"}
    ids, logp = reader.read(np.arange(4))
    raw = reader._store.read_rows(np.arange(4))
    np.testing.assert_array_equal(ids, raw["ids"])
    np.testing.assert_array_equal(logp, np.log(raw["counts"] / 6.0).astype(np.float32))
    assert logp.dtype == np.float32 and np.isneginf(logp[ids < 0]).all()
    assert tc.read_cache_meta(tmp_path / "c") == meta


def test_a_cache_of_the_other_kind_is_refused_by_name(tmp_path):
    tokens_NT = fake.make_tokens(num_seq=4)
    topk = fake.make_meta(tokens_NT)
    tc.write_teacher_cache(tmp_path / "c", tokens_NT, fake.fake_teacher, topk, batch_size=2, progress=False)
    sampled = dataclasses.replace(topk, cache_kind="sampled", samples=fake.TOP_K)
    with pytest.raises(tc.MetadataMismatchError, match="cache_kind is 'topk' on disk, 'sampled' expected"):
        tc.TeacherCacheReader(tmp_path / "c", sampled)
    with pytest.raises(tc.MetadataMismatchError, match="cache_kind is 'topk' on disk, 'sampled' expected"):
        tc.write_teacher_cache(tmp_path / "c", tokens_NT, lambda *a: pytest.fail("the teacher ran"), sampled,
                               batch_size=2, progress=False)


def test_a_cache_from_before_cache_kind_reads_and_resumes_as_top_k(tmp_path):
    tokens_NT = fake.make_tokens(num_seq=4)
    meta = fake.make_meta(tokens_NT)
    legacy = {k: v for k, v in meta.store_metadata().items() if k not in ("cache_kind", "samples", "sample_seed")}
    store = tc.ShardedArrayStore.open_or_create(tmp_path / "old", fields=meta.fields(fake.SEQ_LEN), num_rows=4,
                                                metadata=legacy, rows_per_shard=2)
    ids, logp = fake.fake_teacher(tokens_NT[:2])
    store.write_shard(0, {"ids": ids, "logp": logp})
    reader = tc.write_teacher_cache(tmp_path / "old", tokens_NT, fake.fake_teacher, meta, batch_size=2,
                                    progress=False)  # resumed: shard 1 only
    np.testing.assert_array_equal(reader.read(np.arange(4))[0], fake.fake_teacher(tokens_NT)[0])
    assert tc.read_cache_meta(tmp_path / "old") == meta
    with open(os.path.join(tmp_path, "old", "store.json")) as f:
        assert "cache_kind" not in json.load(f)["metadata"]  # written once, never changed


def test_bad_cache_settings_name_the_field_and_the_fix():
    tokens_NT = fake.make_tokens(num_seq=2)
    with pytest.raises(ValueError, match="cache_kind='dense' is not one of topk, sampled; set cache_kind to"):
        fake.make_meta(tokens_NT, cache_kind="dense")
    with pytest.raises(ValueError, match="a sampled cache needs 1 <= top_k <= samples"):
        fake.make_meta(tokens_NT, cache_kind="sampled", samples=0)
    with pytest.raises(ValueError, match="width=5 must lie in \\[1, samples=4\\]"):
        logprobs.linear_samples(jnp.zeros((2, 3)), jnp.zeros((3, 7)), 4, jax.random.split(jax.random.key(0), 2),
                                width=5)
