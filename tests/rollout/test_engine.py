"""Rollout engine: reported log-probs, determinism, slot refill, groups, bad input."""
import dataclasses
import functools
import random
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tests.support import tiny
from tlt_jax import metrics, sampling
from tlt_jax.models import transformer as tfm
from tlt_jax.rollout import speculative as spec_lib
from tlt_jax.rollout.engine import RolloutConfig, shape_bucket
from tlt_jax.rollout.timeline import Chunk, GroupTimeline, RolloutTimeline, SpecChunk

CFG = tiny.config()
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12]]
SP = sampling.SamplingParams(temperature=1.0, top_k=20, max_tokens=24)


@pytest.fixture(scope="module")
def params(tiny_params):
    return tiny_params


_engine = functools.partial(tiny.engine, CFG, max_length=40)


@pytest.fixture(scope="module")
def engine(params):
    """The module's engines, one per configuration: the tests that run the same one share
    its compiled programs rather than tracing and compiling them again."""
    built = {}

    def get(num_slots, **kw):
        key = (num_slots, *sorted(kw.items()))
        if key not in built:
            built[key] = _engine(params, num_slots, **kw)
        return built[key]

    return get


@pytest.fixture(scope="module")
def reference(engine):
    return engine(4).generate(PROMPTS, 3, SP, jax.random.PRNGKey(7))


def test_every_request_once_and_logprobs_match_forward(params, reference):
    r = reference
    assert len(r) == 15
    assert sorted(zip(r.prompt_index.tolist(), r.sample_index.tolist())) == [(p, s) for p in range(5) for s in range(3)]
    assert set(r.finish_reason) <= {"eos", "max_tokens"} and "max_tokens" in r.finish_reason
    # One forward over every transcript, right-padded to one length (causal: the padding
    # changes no earlier position's logits), so it compiles once.
    seqs = [PROMPTS[r.prompt_index[i]] + r.tokens[i].tolist() for i in range(len(r))]
    batch = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for i, seq in enumerate(seqs):
        batch[i, :len(seq)] = seq
    logp_all = np.asarray(jax.jit(lambda p, x: sampling.processed_logprobs(
        tfm.logits_from_hidden(p, CFG, tfm.forward(p, CFG, x)), SP))(params, batch))
    for i in range(len(r)):
        prompt, answer = PROMPTS[r.prompt_index[i]], r.tokens[i]
        assert len(answer) == len(r.logprobs[i]) >= 1
        assert (r.finish_reason[i] == "eos") == (answer[-1] == 0)
        assert (answer[:-1] != 0).all()
        logp = logp_all[i, len(prompt) - 1:len(prompt) - 1 + len(answer)]
        expected = np.take_along_axis(logp, answer[:, None], axis=1)[:, 0]
        np.testing.assert_allclose(r.logprobs[i], expected, atol=1e-4)
    tokens, logp, mask = r.padded()
    assert tokens.shape == (15, r.lengths.max()) and mask.sum() == r.lengths.sum()


def test_same_output_alone_with_few_or_many_slots_and_same_key(engine, reference):
    stacked = dict(per_layer_weights=False, fused_projections=False)
    for e in (engine(1, steps_per_sync=3), engine(8, steps_per_sync=5, **stacked), engine(4)):
        other = e.generate(PROMPTS, 3, SP, jax.random.PRNGKey(7))
        for a, b, la, lb in zip(reference.tokens, other.tokens, reference.logprobs, other.logprobs):
            np.testing.assert_array_equal(a, b)
            # Float32 sums in another order (another slot count, the stacked layout): the tests
            # compile at XLA's lowest effort (conftest), which reorders them more than the default.
            np.testing.assert_allclose(la, lb, rtol=2e-5, atol=1e-5)
    # Named by its id, a prompt run alone (or beside another, in another order) gives the
    # answers it gave in the full batch; unnamed, it is request 0 and draws other tokens.
    # (The reference's engine: its programs are compiled.)
    for prompts, ids in (([PROMPTS[2]], [2]), ([PROMPTS[4], PROMPTS[2]], [4, 2])):
        alone = engine(4).generate(prompts, 3, SP, jax.random.PRNGKey(7), prompt_ids=ids)
        for p, s, tokens in zip(alone.prompt_index, alone.sample_index, alone.tokens):
            np.testing.assert_array_equal(tokens, reference.tokens[ids[p] * 3 + s])
    unnamed = engine(4).generate([PROMPTS[2]], 3, SP, jax.random.PRNGKey(7))
    assert any(len(a) != len(b) or (a != b).any() for a, b in zip(unnamed.tokens, reference.tokens[6:9]))
    with pytest.raises(ValueError, match="prompt_ids must name each"):
        engine(4).generate(PROMPTS[:2], 3, SP, jax.random.PRNGKey(7), prompt_ids=[1, 1])
    different = engine(4).generate(PROMPTS, 3, SP, jax.random.PRNGKey(8))
    assert any(len(a) != len(b) or (a != b).any() for a, b in zip(reference.tokens, different.tokens))


def test_the_samples_of_a_prompt_share_one_prefill(engine):
    """Each distinct prompt is prefilled once for all the samples it starts, and they
    sample what they sample with one slot (one prefill each)."""
    group = engine(4).groups[0]
    prefilled, insert = [], group.insert
    group.insert = lambda state, prompts_UP, *a, **k: prefilled.append(len(prompts_UP)) or insert(
        state, prompts_UP, *a, **k)
    try:
        out = engine(4).generate(PROMPTS[:2], 3, SP, jax.random.PRNGKey(7))
    finally:
        del group.insert  # the shared engine's own again
    # The first insert starts prompt 0's three samples and one of prompt 1's: two rows.
    assert prefilled[0] == 2 and sum(prefilled) < len(out)
    alone = engine(1, steps_per_sync=3).generate(PROMPTS[:2], 3, SP, jax.random.PRNGKey(7))
    for a, b, la, lb in zip(alone.tokens, out.tokens, alone.logprobs, out.logprobs):
        np.testing.assert_array_equal(a, b)
        # float32 log-probs of the same tokens at another batch shape: the matmuls sum in
        # another order (on a 2-core AMD EPYC, 1.07e-5 apart at -1.64)
        np.testing.assert_allclose(la, lb, rtol=1e-5, atol=1e-5)


def _prefill_rows(engine, *args):
    """engine.generate(*args) and the (slot rows, prompt rows) of each of its prefills."""
    group = engine.groups[0]
    shapes, insert = [], group.insert
    group.insert = lambda state, prompts_UP, lengths_R, *a, **k: shapes.append((len(lengths_R), len(prompts_UP))) or \
        insert(state, prompts_UP, lengths_R, *a, **k)
    try:
        return engine.generate(*args), shapes
    finally:
        del group.insert  # the engine's own again


def test_min_refill_rows_pads_every_prefill_and_keeps_the_samples(engine, reference):
    """min_refill_rows: no prefill runs fewer slot or prompt rows (fewer prefill programs),
    and the samples are the ones drawn without it."""
    _, shapes = _prefill_rows(engine(4, steps_per_sync=2), PROMPTS, 1, SP, jax.random.PRNGKey(7))
    assert min(min(s) for s in shapes) < 4  # refills of one or two freed slots
    padded, shapes = _prefill_rows(engine(4, steps_per_sync=2, min_refill_rows=4), PROMPTS, 3, SP,
                                   jax.random.PRNGKey(7))
    assert len(shapes) > 1 and min(min(s) for s in shapes) == 4
    for a, b, la, lb in zip(reference.tokens, padded.tokens, reference.logprobs, padded.logprobs):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(la, lb, rtol=2e-5, atol=1e-5)  # prefill rows summed at another shape
    with pytest.raises(ValueError, match="min_refill_rows must be positive"):
        RolloutConfig(min_refill_rows=0)


def test_decode_with_padded_mlps_gives_the_same_samples(params, reference):
    """decode_mlp_size: the rollout's weights are wider (zero units) and its samples the model's."""
    engine = _engine(params, 4, decode_mlp_size=160)
    layer = engine.local_groups[0].params["layers"][0]
    assert layer["w_down"].shape == (160, CFG.hidden_size) and not np.asarray(layer["w_down"])[64:].any()
    padded = engine.generate(PROMPTS, 3, SP, jax.random.PRNGKey(7))
    for a, b, la, lb in zip(reference.tokens, padded.tokens, reference.logprobs, padded.logprobs):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(la, lb, atol=1e-5)
    with pytest.raises(ValueError, match="decode_mlp_size=32 is below the model's MLP width 64"):
        _engine(params, 4, decode_mlp_size=32)
    with pytest.raises(ValueError, match="decode_mlp_size=-1 must be >= 0"):
        RolloutConfig(decode_mlp_size=-1)


def test_warm_up_without_a_policy_compiles_every_plain_chunk(params, reference):
    """What a run with speculation off (the baseline) warms up: plain decode's chunk for each
    kv bucket, for the state `generate` without a policy decodes, so no rollout compiles one;
    each chunk runs steps (on live slots), since XLA:CPU finishes a program on its first run."""
    engine = _engine(params, 4, kv_bucket=16)
    assert engine.rollout_config.kv_buckets == (16, 32, 40)
    group = engine.local_groups[0]
    run_chunk, attended = group.run_chunk, []
    group.run_chunk = lambda *a: (lambda out: attended.append((a[-1], int(out[1]))) or out)(run_chunk(*a))
    engine.warm_up(SP)
    group.run_chunk = run_chunk
    assert sorted(n for n, _ in attended) == [16, 32, 40] and min(s for _, s in attended) > 0, attended
    warm = group.chunk_programs()
    r = engine.generate(PROMPTS, 3, SP, jax.random.PRNGKey(7))
    assert group.chunk_programs() == warm
    assert max(len(p) + len(t) for p, t in zip([PROMPTS[i] for i in r.prompt_index], r.tokens)) > 16
    for a, b in zip(reference.tokens, r.tokens):
        np.testing.assert_array_equal(a, b)


def test_data_parallel_groups_signal_done(engine, reference):
    engine = engine(2, data=2, tensor=2)  # fused q/k/v split by kv head across the tensor axis
    assert engine.num_groups == 2
    assert engine.groups[0].params["layers"][0]["wqkv"].sharding.spec == P(None, "tensor", None, None)
    done, lock = [], threading.Lock()

    def on_done(g):
        with lock:
            done.append(g)

    finished = []  # (request, tokens, groups done by then)

    def on_sample(i, tokens):
        with lock:
            finished.append((i, tokens, len(done)))

    r = engine.generate(PROMPTS, 3, SP, jax.random.PRNGKey(7), on_group_done=on_done, on_sample_done=on_sample)
    assert sorted(done) == [0, 1]
    # Each sample is handed on once, with its tokens, before the last group is done.
    assert sorted(i for i, _, _ in finished) == list(range(len(r)))
    for i, tokens, groups_done in finished:
        np.testing.assert_array_equal(tokens, r.tokens[i])
        assert groups_done < 2
    assert set(r.group.tolist()) == {0, 1}
    for a, b in zip(reference.tokens, r.tokens):
        np.testing.assert_array_equal(a, b)
    s = r.timeline.summary()
    assert s["tokens"] == r.lengths.sum() - len(r)  # first tokens come from prefill
    assert 0 <= s["group_idle_fraction"] < 1 and 0 <= s["slot_idle_fraction"] < 1
    # Every group prefilled and harvested outside its chunks.
    for g in r.timeline.groups:
        between = g.between_s()
        assert between["prefill"] > 0 and between["harvest"] > 0 and between["other"] >= 0


def test_two_groups_compile_a_program_met_mid_rollout_once(engine):
    """Groups decode on threads of their own; a program first met during a rollout (here an
    n-gram strategy's chunk at a temperature no run compiled before) is compiled by one
    group, and the other loads it from the persistent compilation cache (`FirstCalls`). At
    once, both would miss the cache and compile it."""
    two = engine(2, data=2, tensor=2)
    assert two.first_calls.enabled
    sp = dataclasses.replace(SP, temperature=1.0 + random.random() / 1000)
    chunks, hit = [], threading.local()  # per chunk compile: loaded from the cache?

    def on_event(event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            hit.value = True

    def on_compile(event, _, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            if "chunk" in kw.get("fun_name", ""):
                chunks.append(getattr(hit, "value", False))
            hit.value = False

    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_compile)
    try:
        ngram = spec_lib.FixedSpeculation(spec_lib.Strategy("ngram", depth=2, topk=2), max_active=64)
        two.generate(PROMPTS, 3, sp, jax.random.PRNGKey(7), speculation=ngram)
    finally:
        jax.monitoring.unregister_event_listener(on_event)
        jax.monitoring.unregister_event_duration_listener(on_compile)
    assert sorted(chunks) == [False, True], chunks


def test_projections_stay_unfused_when_kv_heads_do_not_split(params, engine):
    split = _engine(params, 2, tensor=4).groups[0].params["layers"][0]  # 2 kv heads, 4 devices
    assert "wqkv" not in split and split["wq"].sharding.spec == P(None, "tensor", None)
    # 2 kv heads, 2 devices: fused (the data-parallel test's engine, built once).
    assert "wqkv" in engine(2, data=2, tensor=2).groups[0].params["layers"][0]


def test_cache_full_and_update_params(params, tmp_path):
    engine = _engine(params, 2, max_length=9)
    greedy = sampling.SamplingParams(temperature=0.0, max_tokens=50)
    r = engine.generate([[1, 2, 3, 4]], 2, greedy, jax.random.PRNGKey(0))
    for tokens, reason in zip(r.tokens, r.finish_reason):
        assert reason == "cache_full" and len(tokens) == 9 - 4 + 1 or reason == "eos"
    engine.update_params(jax.tree.map(jnp.zeros_like, params))
    # The same sampling parameters and prefill shape (2 samples of one prompt): no new program.
    r = engine.generate([[1, 2]], 2, greedy, jax.random.PRNGKey(0))
    # All-zero logits: argmax 0 = eos.
    assert [t.tolist() for t in r.tokens] == [[0], [0]] and r.finish_reason == ["eos"] * 2
    metrics.plot_rollout_timeline(r.timeline, tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 0


def test_every_end_token_stops_a_sequence(params):
    """With two end tokens (a chat model's <|im_end|> and <|endoftext|>), each answer is
    the unstopped greedy answer cut after its first end token, whichever of the two it
    is, with finish reason "eos"; both tokens end some answer here."""
    assert RolloutConfig(eos_token_id=5).eos_token_id == (5,) and RolloutConfig().eos_token_id == ()
    assert RolloutConfig(eos_token_id=[5, 3]) == RolloutConfig(eos_token_id=(5, 3))
    sp = sampling.SamplingParams(temperature=0.0, max_tokens=20)
    free = _engine(params, 4, eos_token_id=None).generate(PROMPTS, 1, sp, jax.random.PRNGKey(0))
    assert set(free.finish_reason) == {"max_tokens"}
    ends = (int(free.tokens[0][3]), int(free.tokens[1][3]))  # the second ends answer 1 sooner, at its 2nd token
    r = _engine(params, 4, eos_token_id=ends).generate(PROMPTS, 1, sp, jax.random.PRNGKey(0))
    ended_by = []
    for full, tokens, reason in zip(free.tokens, r.tokens, r.finish_reason):
        hits = np.flatnonzero(np.isin(full, ends))
        np.testing.assert_array_equal(tokens, full[:hits[0] + 1] if len(hits) else full)
        assert reason == ("eos" if len(hits) else "max_tokens")
        ended_by += [int(full[hits[0]])] if len(hits) else []
    assert set(ended_by) == set(ends)


def test_bad_input(engine):
    engine = engine(4)
    assert len(engine.generate([], 4, SP, jax.random.PRNGKey(0))) == 0
    with pytest.raises(ValueError, match="num_samples"):
        engine.generate(PROMPTS, 0, SP, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="has 9 tokens .* max_prompt_length=6 .*KV cache length 40"):
        engine.generate([list(range(1, 10))], 1, SP, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], 1, SP, jax.random.PRNGKey(0))


def test_timeline_summary_of_a_scripted_rollout():
    """Two groups: group 0 decodes 2 plain steps then 1 speculative one over 4 s; group 1
    prefills, one plain step, harvests, done after 1 s (and idle for 3)."""
    slow = GroupTimeline(0, 4, start=0.0, end=4.0, chunks=[
        Chunk(0.0, 2.0, active_per_step=[4, 4], tokens_per_step=[4, 4]),
        SpecChunk(2.0, 4.0, active_per_step=[2], tokens_per_step=[5], committed_per_sequence=[3, 2],
                  draft_s=0.5, verify_s=1.0)])
    fast = GroupTimeline(1, 4, start=0.0, end=1.0, chunks=[Chunk(0.25, 0.75, [3], [3])], prefill_s=0.2,
                         harvest_s=0.1)
    assert slow.steps() == [(0.5, 4, 4), (1.5, 4, 4), (3.0, 2, 5)]
    assert slow.tokens == 13 and slow.slot_utilisation() == 10 / 12
    s = RolloutTimeline([slow, fast], origin=0.0).summary()
    assert fast.between_s() == pytest.approx(dict(prefill=0.2, harvest=0.1, other=0.2))
    assert s == pytest.approx(dict(
        wall_s=4.0, tokens=16, tokens_per_s=4.0, group_idle_s=3.0, group_idle_fraction=3 / 8,
        slot_idle_fraction=1 - 13 / 16, decode_steps=3, speculative_steps=1, speculative_tokens=5,
        acceptance_length=2.5, draft_s=0.5, verify_s=1.0, chunks_s=4.5, prefill_s=0.2, harvest_s=0.1, host_s=0.2))


def test_acceptance_by_depth_of_scripted_chunks():
    """Committed tokens are accepted drafts plus the bonus; a position is reached when every
    draft before it was accepted, and counts only under strategies drafting that deep."""
    chain3 = SpecChunk(0.0, 1.0, [4], [10], depth=3, committed_per_sequence=[1, 2, 3, 4])  # 0..3 accepted
    chain1 = SpecChunk(1.0, 2.0, [2], [3], depth=1, committed_per_sequence=[2, 1])
    group = GroupTimeline(0, 4, start=0.0, end=2.0, chunks=[Chunk(0.0, 0.5, [4], [4]), chain3, chain1])
    # d=1: chain3 reaches it 4 times (3 passed), chain1 twice (1 passed); d=2: 3 reached, 2
    # passed; d=3: 2 reached, 1 passed.
    assert RolloutTimeline([group], origin=0.0).acceptance_by_depth() == [4 / 6, 2 / 3, 1 / 2]
    assert RolloutTimeline([GroupTimeline(0, 4, chunks=[Chunk(0.0, 1.0, [4], [4])])]).acceptance_by_depth() == []


def test_shape_bucket_is_the_smallest_unit_power_of_two_that_holds_n():
    assert [shape_bucket(n, 64) for n in (0, 1, 2, 3, 5, 9, 64, 65)] == [1, 1, 2, 4, 8, 16, 64, 64]
    assert [shape_bucket(n, 64, unit=2) for n in (0, 1, 2, 3, 5, 9)] == [2, 2, 2, 4, 8, 16]
    assert [shape_bucket(n, 12, unit=3) for n in (1, 3, 4, 7, 13)] == [3, 3, 6, 12, 12]
