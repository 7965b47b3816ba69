"""Fake teacher and a cache writer process for tests/distill/test_teacher_cache.py.

numpy + tensorstore only (no jax), so the subprocess of the SIGKILL test starts fast.
Run as `python -m tests.support.teacher_cache_writer PATH SLEEP_S` from the repository root.
"""

import sys
import time

import numpy as np

from tlt_jax import fingerprint
from tlt_jax.distill import teacher_cache as tc

NUM_SEQ, SEQ_LEN, TOP_K, VOCAB = 20, 6, 4, 32
ROWS_PER_SHARD, BATCH_SIZE = 2, 2


def make_tokens(num_seq: int = NUM_SEQ, seq_len: int = SEQ_LEN) -> np.ndarray:
    return np.random.default_rng(0).integers(0, VOCAB, (num_seq, seq_len), dtype=np.int32)


def fake_teacher(tokens_BT: np.ndarray, k: int = TOP_K,
                 temperature: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic causal 'teacher': logits depend on a hash of each position's prefix."""
    prefix_hash_BT = np.cumsum((tokens_BT.astype(np.int64) * 7919 + 13) % 1009, axis=1)
    logits_BTV = 4.0 * np.sin(prefix_hash_BT[..., None] * 0.0137 + np.arange(VOCAB) * 0.71)
    scaled_BTV = logits_BTV / temperature
    logp_BTV = scaled_BTV - np.log(np.exp(scaled_BTV).sum(-1, keepdims=True))
    ids_BTK = np.argsort(-logp_BTV, axis=-1, kind="stable")[..., :k].astype(np.int32)
    return ids_BTK, np.take_along_axis(logp_BTV, ids_BTK, -1).astype(np.float32)


def make_meta(tokens_NT: np.ndarray, logp_dtype: str = "bfloat16", **overrides) -> tc.CacheMeta:
    fields = dict(teacher_fingerprint="sha256:fake-teacher",
                  tokenizer_fingerprint="sha256:fake-tokenizer",
                  dataset_fingerprint=fingerprint.fingerprint_tokens(tokens_NT),
                  top_k=TOP_K, temperature=1.0, logp_dtype=logp_dtype)
    fields.update(overrides)
    return tc.CacheMeta(**fields)


def main(path: str, sleep_s: float) -> None:
    tokens_NT = make_tokens()

    def slow_teacher(tokens_BT):
        time.sleep(sleep_s)
        return fake_teacher(tokens_BT)

    tc.write_teacher_cache(path, tokens_NT, slow_teacher, make_meta(tokens_NT),
                           batch_size=BATCH_SIZE, rows_per_shard=ROWS_PER_SHARD,
                           progress=False)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
