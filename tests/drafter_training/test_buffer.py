"""The drafter buffer: one packing rule (`pack_spans`) with SFT, segment ids that isolate
samples in the target's forward, online rows equal to offline ones, the span rule,
eviction, deterministic and resumable sampling, and rows the drafter trainer takes."""
import jax
import numpy as np
import pytest

from tests.support import tiny
from tlt_jax import checkpoint, sharding
from tlt_jax.data import packing, tasks
from tlt_jax.data.packing import pack_examples, pack_spans
from tlt_jax.drafter_training import trainer as dt
from tlt_jax.drafter_training.buffer import DrafterBuffer
from tlt_jax.models import drafter as drafter_lib
from tlt_jax.models import transformer as tfm
from tlt_jax.train_state import OptimizerConfig

CFG = tiny.config(vocab_size=40, num_layers=3)  # three layers: a fused drafter reads several
FUSED = drafter_lib.DrafterConfig(num_layers=1, feature_layers=(0, 2))
K = 4
PAD = -7  # padding token of the fake learner batches: it must never reach a row


# ----------------------------------------------------------------------------- packing


def test_pack_spans_is_greedy_and_lays_out_rows():
    packing = pack_spans([5, 4, 9, 3, 20, 7], seq_len=10)
    np.testing.assert_array_equal(packing.row_N, [0, 0, 1, 2, -1, 2])  # 20 > 10: dropped
    np.testing.assert_array_equal(packing.offset_N[packing.row_N >= 0], [0, 5, 0, 0, 3])
    np.testing.assert_array_equal(packing.segment_N[packing.row_N >= 0], [1, 2, 1, 1, 2])
    assert packing.num_rows == 3 and packing.dropped == 1

    spans = [10 * (i + 1) + np.arange(n) for i, n in enumerate(packing.lengths_N)]
    rows = packing.rows(spans, [np.ones(n, bool) for n in packing.lengths_N], pad_id=-1)
    assert tuple(rows) == dt.ROW_FIELDS
    np.testing.assert_array_equal(rows["tokens"], [[10, 11, 12, 13, 14, 20, 21, 22, 23, -1],
                                                   [30, 31, 32, 33, 34, 35, 36, 37, 38, -1],
                                                   [40, 41, 42, 60, 61, 62, 63, 64, 65, 66]])
    np.testing.assert_array_equal(rows["positions"], [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0],
                                                      [0, 1, 2, 3, 4, 5, 6, 7, 8, 0],
                                                      [0, 1, 2, 0, 1, 2, 3, 4, 5, 6]])
    np.testing.assert_array_equal(rows["segment_ids"], [[1, 1, 1, 1, 1, 2, 2, 2, 2, 0],
                                                        [1, 1, 1, 1, 1, 1, 1, 1, 1, 0],
                                                        [1, 1, 1, 2, 2, 2, 2, 2, 2, 2]])
    # Every token is a target, but never a segment's first: nothing predicts across samples.
    T, F = True, False
    np.testing.assert_array_equal(rows["mask"], [[T, T, T, T, F, T, T, T, F],
                                                 [T, T, T, T, T, T, T, T, F],
                                                 [T, T, F, T, T, T, T, T, T]])
    features = packing.scatter([np.full((n, 2), i + 1.0) for i, n in enumerate(packing.lengths_N)], np.float32)
    np.testing.assert_array_equal(features[..., 0], (rows["segment_ids"] > 0) * (rows["tokens"] // 10))


def test_pack_spans_edges():
    """Spans exactly filling a row, of one token, none, all dropped, and bad lengths."""
    np.testing.assert_array_equal(pack_spans([1, 1], 2).row_N, [0, 0])
    np.testing.assert_array_equal(pack_spans(np.array([[5], [4]]), 10).row_N, [0, 0])
    assert pack_spans([5.0, 4.0], 10).lengths_N.dtype == np.int64
    empty = pack_spans([], 8)
    assert empty.num_rows == 0 and empty.rows([], [])["tokens"].shape == (0, 8)
    dropped = pack_spans([20], 10)
    assert dropped.num_rows == 0 and dropped.rows([np.arange(20)], [np.ones(20, bool)])["mask"].shape == (0, 9)
    with pytest.raises(ValueError, match=r"at least one token long, got lengths \[0\]"):
        pack_spans([0, 1], 4)
    with pytest.raises(ValueError, match="at least one token"):
        pack_spans([3, 0], 10)


def _pack_examples_before_pack_spans(tokenizer, examples, seq_len):
    """`sft.pack_examples` as it was before it used `pack_spans` (logging left out)."""
    rows, row = [], []
    for example in examples:
        ids, mask = packing.encode_for_sft(tokenizer, example)
        if len(ids) > seq_len:
            continue
        if sum(len(i) for i, _ in row) + len(ids) > seq_len:
            rows.append(row)
            row = []
        row.append((ids, mask))
    rows.append(row)
    n = len(rows)
    out = {k: np.zeros((n, seq_len), np.int32) for k in ("tokens", "positions", "segment_ids")}
    out["tokens"][:] = tokenizer.pad_token_id
    target = np.zeros((n, seq_len), bool)
    for i, row in enumerate(rows):
        at = 0
        for segment, (ids, mask) in enumerate(row, start=1):
            span = slice(at, at + len(ids))
            out["tokens"][i, span], out["positions"][i, span] = ids, np.arange(len(ids))
            out["segment_ids"][i, span], target[i, span] = segment, mask
            at += len(ids)
    out["mask"] = target[:, 1:]
    return out


def test_pack_examples_output_is_unchanged(tmp_path):
    tokenizer = tasks.build_task_tokenizer(str(tmp_path / "tok"))
    mixture = tasks.from_spec({"addition": {"max_digits": 3}, "collatz": {}, "countdown": {}})
    examples = tasks.make_split(mixture, "train", 40, seed=0)  # 25 to 532 tokens
    for seq_len in (128, 600):
        want = _pack_examples_before_pack_spans(tokenizer, examples, seq_len)
        got = pack_examples(tokenizer, examples, seq_len)
        assert list(got) == list(want) and want["segment_ids"].max() > 2
        for k in want:
            assert got[k].dtype == want[k].dtype, k
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{k}, seq_len {seq_len}")
    with pytest.raises(ValueError, match="Every example is longer than seq_len=8"):
        pack_examples(tokenizer, examples, 8)


# ----------------------------------------------------------------------------- against the target

PROMPTS, RESPONSES = np.array([4, 3, 5, 2]), np.array([6, 3, 7, 3])  # sequences of 10, 6, 12, 5 tokens
T, S = 12, 16  # learner batch length; row length: rows [10 + 6], [12], [5]


@pytest.fixture(scope="module")
def model():
    """The tiny target's outputs over the same sequences in two layouts: the learner's
    right-padded batch [4, T] (each sample alone, causal attention only) and the offline
    trainer's packed rows [3, S] (`pack_spans`, segment ids)."""
    params = tfm.init_params(CFG, jax.random.PRNGKey(0), init_std=0.3)
    run = jax.jit(lambda p, rows: dt.target_outputs(p, CFG, FUSED, rows, top_k=K))
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, CFG.vocab_size, (4, T)).astype(np.int32)  # padding too: it must not matter
    lengths = PROMPTS + RESPONSES
    learner_rows = {"tokens": tokens, "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (4, T)),
                    "segment_ids": np.ones((4, T), np.int32)}
    packing = pack_spans(lengths, S)
    rows = packing.rows([tokens[i, :n] for i, n in enumerate(lengths)],
                        [np.arange(n) >= p for n, p in zip(lengths, PROMPTS)])
    return {"params": params, "run": run, "tokens": tokens, "lengths": lengths, "packing": packing, "rows": rows,
            "online": jax.device_get(run(params, learner_rows)), "offline": jax.device_get(run(params, rows))}


def test_segment_ids_keep_packed_samples_apart(model):
    """Each sample's outputs in a packed row equal its outputs alone; without segment ids
    the second sample of row 0 would attend to the first."""
    packing, online, offline = model["packing"], model["online"], model["offline"]
    assert packing.num_rows == 3 and model["rows"]["segment_ids"][0].max() == 2
    for i, n in enumerate(model["lengths"]):
        at = slice(packing.offset_N[i], packing.offset_N[i] + n)
        for k in ("hidden", "layers", "logp"):
            np.testing.assert_allclose(offline[k][packing.row_N[i], at], online[k][i, :n], rtol=1e-5, atol=1e-5,
                                       err_msg=f"{k} of sample {i}")
    crossing = dict(model["rows"], segment_ids=np.ones((3, S), np.int32))
    h = jax.device_get(model["run"](model["params"], crossing))["hidden"]
    assert not np.allclose(h[0, 10:16], online["hidden"][1, :6], atol=1e-3)


@pytest.fixture(scope="module")
def online_buffer(model):
    buffer = DrafterBuffer(S, CFG.hidden_size, K, max_bytes=10 ** 7, num_feature_layers=2, prompt_tail=100)
    o = model["online"]
    buffer.add(0, model["tokens"], PROMPTS, RESPONSES, o["hidden"], o["ids"], o["logp"], o["layers"])
    return buffer


def test_online_rows_equal_offline_rows(model, online_buffer):
    """The buffer's rows from the learner's batch (one target forward over right-padded
    samples) are the offline trainer's rows of the same sequences, outputs included."""
    got, want = online_buffer.state_dict()["rows"], {**model["rows"], **model["offline"]}
    assert set(got) == set(want)
    for k in dt.ROW_FIELDS:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    real = model["rows"]["segment_ids"] > 0
    np.testing.assert_array_equal(got["ids"][real], want["ids"][real])
    for k in ("hidden", "logp", "layers"):
        np.testing.assert_allclose(got[k][real], want[k][real], rtol=1e-5, atol=1e-5, err_msg=k)
        assert not got[k][~real].any(), k


def test_trainer_steps_on_a_sampled_batch(model, online_buffer):
    trainer = dt.DrafterTrainer(CFG, FUSED, OptimizerConfig(learning_rate=1e-3), sharding.make_mesh({"data": -1}),
                                top_k=K, feature_weight=1.0, kl_weight=1.0)
    state = trainer.init_state(drafter_lib.init_drafter(CFG, FUSED, jax.random.PRNGKey(1)))
    batch = online_buffer.sample(8)  # 3 rows held: each once, then 5 that train nothing
    state, out = trainer.step(state, trainer.place_target(model["params"]), batch, jax.random.PRNGKey(2))
    out = jax.device_get(out)
    assert np.isfinite(out["loss"]) and float(out["skipped"]) == 0 and int(out["count"]) > 0


# ----------------------------------------------------------------------------- span rule, eviction, sampling


def _learner_batch(prompts, responses, t, d=3, k=2, layers=0, dtype=np.float32, first=0):
    """A fake learner batch whose every output names its token: sample i's token at t is
    100 (first + i + 1) + t, and hidden / ids / logp / layers at t are that token too.
    Padding is PAD."""
    n = len(prompts)
    tokens = 100 * (first + np.arange(n)[:, None] + 1) + np.arange(t)
    tokens = np.where(np.arange(t) < (np.asarray(prompts) + responses)[:, None], tokens, PAD)
    out = {"tokens": tokens, "hidden": np.repeat(tokens[..., None], d, -1).astype(dtype),
           "ids": np.repeat(tokens[..., None], k, -1), "logp": np.repeat(tokens[..., None], k, -1) / 1000.0}
    if layers:
        out["layers"] = np.repeat(out["hidden"][:, :, None], layers, 2)
    return out


def _add(buffer, step, prompts, responses, t, **kwargs):
    b = _learner_batch(prompts, responses, t, buffer.hidden_size, buffer.top_k, buffer.num_feature_layers,
                       buffer.feature_dtype, **kwargs)
    buffer.add(step, b["tokens"], prompts, responses, b["hidden"], b["ids"], b["logp"], b.get("layers"))


def _segments(rows):
    """{token of the segment's first entry: (tokens, positions, targets, entries)} of every
    segment; targets[j] says whether token j of the segment is a target."""
    out = {}
    for r in range(len(rows["tokens"])):
        for s in range(1, rows["segment_ids"][r].max() + 1):
            at = np.flatnonzero(rows["segment_ids"][r] == s)
            np.testing.assert_array_equal(at, np.arange(at[0], at[-1] + 1))
            targets = np.append(rows["mask"][r], False)[at - 1] & (at > 0)
            out[int(rows["tokens"][r, at[0]])] = (rows["tokens"][r, at], rows["positions"][r, at], targets, at, r)
    return out


@pytest.mark.parametrize("prompt_tail", [0, 2, 100])
def test_spans_keep_the_response_and_the_prompt_tail(prompt_tail):
    prompts, responses = np.array([5, 3, 2, 1, 4]), np.array([4, 1, 0, 3, 2])  # sample 2 has no response
    buffer = DrafterBuffer(16, 3, 2, max_bytes=10 ** 6, num_feature_layers=2, prompt_tail=prompt_tail)
    _add(buffer, 0, prompts, responses, 10)
    rows = buffer.state_dict()["rows"]
    assert not (rows["tokens"] == PAD).any()
    segments = _segments(rows)
    assert buffer.stats()["samples"] == len(segments) == 4
    for i in (0, 1, 3, 4):
        start = max(prompts[i] - 1 - prompt_tail, 0)
        tokens, positions, targets, at, r = segments[100 * (i + 1) + start]
        original = np.arange(start, prompts[i] + responses[i])
        np.testing.assert_array_equal(positions, original)
        np.testing.assert_array_equal(tokens, 100 * (i + 1) + original)
        np.testing.assert_array_equal(targets, original >= prompts[i])  # the response, nothing else
        for k in ("hidden", "ids", "logp", "layers"):  # each output at its own token
            np.testing.assert_allclose(np.moveaxis(rows[k][r, at], 0, -1).reshape(-1, len(at))[0],
                                       tokens / (1000.0 if k == "logp" else 1.0), rtol=1e-6, err_msg=k)
    padding = rows["segment_ids"] == 0
    assert padding.any() and not any(rows[k][padding].any() for k in ("tokens", "hidden", "ids", "logp", "layers"))


def test_overlong_spans_lose_prompt_context_then_the_response_end():
    buffer = DrafterBuffer(8, 3, 2, max_bytes=10 ** 6, prompt_tail=3)
    _add(buffer, 0, np.array([6, 3]), np.array([5, 9]), 12)
    segments = _segments(buffer.state_dict()["rows"])
    # Sample 0: [2, 11) is 9 tokens; the prompt context shrinks to [3, 11).
    np.testing.assert_array_equal(segments[103][1], np.arange(3, 11))
    # Sample 1: [0, 12) is 12; only the last prompt token is left, and the response is cut.
    np.testing.assert_array_equal(segments[202][1], np.arange(2, 10))
    assert buffer.stats()["truncated"] == 1


def test_rows_of_the_last_keep_steps_are_kept():
    buffer = DrafterBuffer(8, 3, 2, max_bytes=10 ** 6, keep_steps=2)
    for step in (0, 1, 1, 2):  # two adds of step 1
        _add(buffer, step, [1, 1], [7, 3], 8, first=10 * step)
    assert set(buffer.state_dict()["steps"]) == {1, 2} and buffer.stats()["steps"] == 2
    _add(buffer, 4, [1], [7], 8)
    np.testing.assert_array_equal(buffer.state_dict()["steps"], [4])
    with pytest.raises(ValueError, match="RL step 3 after step 4"):
        _add(buffer, 3, [1], [7], 8)


def test_bytes_bound_drops_the_oldest_rows():
    row_bytes = 8 * (12 + 3 * 4 + 8 * 2) + 7  # S (12 + D b + 8 K) + S - 1
    with pytest.raises(ValueError, match=rf"tlt\.drafter\.buffer_max_bytes=100 cannot hold one row.*>= {row_bytes}"):
        DrafterBuffer(8, 3, 2, max_bytes=100)
    buffer = DrafterBuffer(8, 3, 2, max_bytes=3 * row_bytes + row_bytes // 2, keep_steps=10)
    assert buffer.row_bytes == row_bytes
    _add(buffer, 0, [1, 1], [7, 7], 8)  # a full row each
    _add(buffer, 1, [1, 1], [7, 7], 8, first=2)
    first_tokens = lambda: buffer.state_dict()["rows"]["tokens"][:, 0].tolist()
    assert first_tokens() == [200, 300, 400] and buffer.nbytes == 3 * row_bytes
    _add(buffer, 2, [1, 1, 1, 1], [7, 7, 7, 7], 8, first=4)
    assert first_tokens() == [600, 700, 800] and buffer.stats()["dropped_rows"] == 5


def test_add_checks_what_it_is_given():
    buffer = DrafterBuffer(8, 3, 2, max_bytes=10 ** 6, feature_dtype="bfloat16")
    assert not buffer.ready(2)
    with pytest.raises(ValueError, match="empty"):
        buffer.sample(2)
    b = _learner_batch([2], [3], 6, dtype=np.float32)
    with pytest.raises(ValueError, match=r"hidden is float32 \(1, 6, 3\); this buffer expects bfloat16"):
        buffer.add(0, b["tokens"], [2], [3], b["hidden"], b["ids"], b["logp"])
    with pytest.raises(ValueError, match="layers given"):
        buffer.add(0, b["tokens"], [2], [3], b["hidden"], b["ids"], b["logp"], b["hidden"][:, :, None])
    with pytest.raises(ValueError, match="fitting T=6"):
        buffer.add(0, b["tokens"], [4], [3], b["hidden"], b["ids"], b["logp"])
    _add(buffer, 0, [2], [3], 6)
    assert buffer.ready(8) and len(buffer) == 1 and buffer.state_dict()["rows"]["hidden"].dtype == np.dtype("bfloat16")


def test_rows_of_a_step_are_spread_over_it_and_draw_nothing():
    buffer = DrafterBuffer(8, 3, 2, max_bytes=10 ** 6, keep_steps=3, seed=5)
    _add(buffer, 0, [1] * 3, [7] * 3, 8)  # a full row per sample
    _add(buffer, 1, [1] * 5, [7] * 5, 8, first=3)
    twin = DrafterBuffer(8, 3, 2, max_bytes=10 ** 6, keep_steps=3, seed=5)
    twin.load_state_dict(buffer.state_dict())
    first = lambda rows: rows["tokens"][:, 0].tolist()
    assert first(buffer.rows_of_step(1, 3)) == [400, 600, 800]  # rows 0, 2, 4 of the five
    rows = buffer.rows_of_step(0, 5)  # three held: all of them, then rows that train nothing
    assert first(rows)[:3] == [100, 200, 300] and not rows["mask"][3:].any() and not rows["segment_ids"][3:].any()
    assert not buffer.rows_of_step(7, 2)["mask"].any()
    jax.tree.map(np.testing.assert_array_equal, buffer.sample(4), twin.sample(4))


def test_sampling_is_deterministic_and_resumes_exactly(tmp_path):
    def filled(seed):
        buffer = DrafterBuffer(8, 3, 2, max_bytes=10 ** 6, num_feature_layers=1, feature_dtype="bfloat16", seed=seed)
        _add(buffer, 0, [1, 1, 2], [7, 7, 6], 8)
        _add(buffer, 1, [1, 1], [7, 3], 8, first=3)
        return buffer

    a, b = filled(seed=3), filled(seed=3)
    draws = [a.sample(4) for _ in range(3)]
    for draw in draws:
        assert draw["hidden"].dtype == np.dtype("bfloat16")
        jax.tree.map(np.testing.assert_array_equal, b.sample(4), draw)
    assert len(set(draws[0]["tokens"][:, 0])) == 4  # 5 rows held: without replacement
    assert any((d["tokens"] != draws[0]["tokens"]).any() for d in draws[1:])  # each draw is new
    assert (filled(seed=4).sample(4)["tokens"] != draws[0]["tokens"]).any()

    with checkpoint.Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, a.state_dict())
        ckpt.wait()
        restored, _ = ckpt.restore()
    resumed = DrafterBuffer(8, 3, 2, max_bytes=10 ** 6, num_feature_layers=1, feature_dtype="bfloat16", seed=3)
    resumed.load_state_dict(restored)
    assert resumed.stats() == a.stats()
    for buffer in (a, resumed):
        _add(buffer, 2, [1], [7], 8, first=9)  # evicts step 0 from both
    for _ in range(3):
        jax.tree.map(np.testing.assert_array_equal, resumed.sample(6), a.sample(6))
    assert resumed.stats() == a.stats()


def test_fewer_rows_than_a_batch_are_each_drawn_once_then_padded():
    buffer = DrafterBuffer(8, 3, 2, max_bytes=10 ** 6, seed=1)
    _add(buffer, 0, [1, 1, 2], [7, 7, 6], 8)  # three rows
    first = lambda rows: rows["tokens"][:, 0].tolist()
    for rows in (8, 4, 3):
        draw = buffer.sample(8, rows)
        assert len(draw["tokens"]) == rows and sorted(first(draw)[:3]) == [100, 200, 301]
        assert not draw["mask"][3:].any() and not draw["segment_ids"][3:].any()
        assert draw["mask"][:3].any(axis=1).all()
    assert sorted(first(buffer.sample(2))) in ([100, 200], [100, 301], [200, 301])  # without replacement
    with pytest.raises(ValueError, match="rows must hold them"):
        buffer.sample(8, 2)


def test_replay_keeps_a_uniform_sample_of_evicted_rows_and_draws_its_share_from_them(tmp_path):
    """With replay_share 0.5 and a window of one RL step, each batch of 4 draws 2 rows from
    the reservoir of rows the window evicted (first tokens below 100 * step) and 2 from the
    newest step; the reservoir is capped at half the rows and resumes exactly."""
    with pytest.raises(ValueError, match=r"tlt\.drafter\.replay_share=1\.5 must be in \[0, 1\]"):
        DrafterBuffer(8, 3, 2, max_bytes=10 ** 6, replay_share=1.5)
    row_bytes = 8 * (12 + 3 * 4 + 8 * 2) + 7
    made = lambda: DrafterBuffer(8, 3, 2, max_bytes=16 * row_bytes, keep_steps=1, seed=2, replay_share=0.5)
    buffer = made()
    for step in range(6):  # 4 full rows a step, first tokens 100 * (4 step + i)
        _add(buffer, step, [1] * 4, [7] * 4, 8, first=4 * step)
    assert buffer.num_rows == 4 and buffer.num_replay_rows == 8  # half of the 16 rows max_bytes holds
    replay_firsts = set(buffer.state_dict()["replay"]["tokens"][:, 0].tolist())
    assert replay_firsts <= {100 * i for i in range(20)} and len(replay_firsts) == 8
    assert max(replay_firsts) >= 400  # not only the first rows evicted: a sample of all of them
    for _ in range(3):
        firsts = buffer.sample(4)["tokens"][:, 0].tolist()
        assert sorted(firsts[:2]) == sorted(set(firsts[:2])) and all(f >= 2000 for f in firsts[:2])
        assert all(f in replay_firsts for f in firsts[2:])
    twin = made()
    with checkpoint.Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, buffer.state_dict())
        ckpt.wait()
        twin.load_state_dict(ckpt.restore()[0])
    for b in (buffer, twin):
        _add(b, 6, [1] * 4, [7] * 4, 8, first=24)
    assert twin.stats() == buffer.stats()
    jax.tree.map(np.testing.assert_array_equal, twin.sample(4), buffer.sample(4))
    # Without replay nothing older than the window is kept or drawn.
    plain = DrafterBuffer(8, 3, 2, max_bytes=16 * row_bytes, keep_steps=1, seed=2)
    for step in range(3):
        _add(plain, step, [1] * 4, [7] * 4, 8, first=4 * step)
    assert plain.num_replay_rows == 0 and all(f >= 800 for f in plain.sample(4)["tokens"][:, 0])


def test_observation_tokens_are_context_never_targets():
    """Multi-turn samples: the environment's observation tokens stay in the rows, in place
    with their outputs (the drafter reads them, as when it drafts the next turn), but no
    entry learns to predict one; with no observation the rows are those of a single-turn
    add, bit for bit."""
    prompts, responses, t = np.array([3, 2, 4]), np.array([6, 5, 3]), 10
    observed = np.zeros((3, t), bool)
    observed[0, 5:7] = True  # after a 2-token turn, a 2-token observation, then the next turn
    observed[1, 3:7] = True  # a turn of one token, then an observation that ends the transcript
    b = _learner_batch(prompts, responses, t)
    fields = (b["tokens"], prompts, responses, b["hidden"], b["ids"], b["logp"])
    single, none_observed, multi = (DrafterBuffer(16, 3, 2, max_bytes=10 ** 6) for _ in range(3))
    single.add(0, *fields)
    none_observed.add(0, *fields, observed_nT=np.zeros((3, t), bool))
    multi.add(0, *fields, observed_nT=observed)
    jax.tree.map(np.testing.assert_array_equal, single.state_dict(), none_observed.state_dict())
    rows, plain = multi.state_dict()["rows"], single.state_dict()["rows"]
    for k in ("tokens", "positions", "segment_ids", "hidden", "ids", "logp"):
        np.testing.assert_array_equal(rows[k], plain[k], err_msg=k)
    segments = _segments(rows)
    for i in range(3):
        tokens, positions, targets, _, _ = segments[100 * (i + 1) + prompts[i] - 1]
        np.testing.assert_array_equal(targets, (positions >= prompts[i]) & ~observed[i, positions])
    assert rows["mask"].sum() == plain["mask"].sum() - observed.sum()
    with pytest.raises(ValueError, match="observed_nT is"):
        multi.add(1, *fields, observed_nT=observed[:, :5])
