"""Speculative sampling keeps the target's distribution: on a model of 6 tokens, every answer
of up to 6 tokens enumerated with its exact probability, against 20,000 sampled answers of
rollouts that speculate with each kind of drafter (EAGLE chain and tree, n-gram, history), or
switch between plain and speculative chunks mid-run."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.rollout.test_speculative import _Band, _mimic_drafter, _modes
from tests.support import tiny
from tlt_jax import sampling
from tlt_jax.models import transformer as tfm
from tlt_jax.rollout import speculative as spec_lib
from tlt_jax.rollout.history import HistoryStore
from tlt_jax.rollout.timeline import SpecChunk

SMALL = tiny.config(vocab_size=6, hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1)


def _exact_answer_probabilities(params, prompt, sp, eos_id):
    """(keys, probabilities) of every answer the engine can return: up to max_tokens
    tokens, ended by the first eos, each encoded by `_answer_keys`, with its exact
    probability under the processed target distribution (enumerated, float64)."""
    m, v = sp.max_tokens, SMALL.vocab_size
    answers = np.stack(np.meshgrid(*[np.arange(v)] * m, indexing="ij"), -1).reshape(-1, m)
    seqs = jnp.asarray(np.concatenate([np.tile(prompt, (len(answers), 1)), answers], 1))
    logp = _processed_logprobs(params, seqs, sp)
    logp = np.take_along_axis(np.asarray(logp[:, len(prompt) - 1:-1], np.float64), answers[..., None], 2)[..., 0]
    after_eos = np.cumsum(answers == eos_id, 1) - (answers == eos_id) > 0
    keys, first = np.unique(_answer_keys(np.where(after_eos, v, answers)), return_index=True)
    return keys, np.exp(np.where(after_eos, 0.0, logp).sum(1))[first]


@functools.partial(jax.jit, static_argnums=2)
def _processed_logprobs(params, seqs, sp):
    """The processed target log-probs after every position of seqs (one program, not one per operation)."""
    return sampling.processed_logprobs(tfm.logits_from_hidden(params, SMALL, tfm.forward(params, SMALL, seqs)), sp)


def _answer_keys(tokens_NM):
    """Answers [N, M] (vocabulary ids, V past the end) as integers, base V + 1."""
    base = SMALL.vocab_size + 1
    return tokens_NM @ base ** np.arange(tokens_NM.shape[1] - 1, -1, -1)


def _likely_answers(keys, exact, m, n):
    """The n most probable answers (token lists), decoded from `_answer_keys`."""
    base = SMALL.vocab_size + 1
    digits = (keys[np.argsort(-exact)[:n], None] // base ** np.arange(m - 1, -1, -1)) % base
    return [[int(t) for t in d if t < SMALL.vocab_size] for d in digits]


EXACT_T07 = sampling.SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, max_tokens=6)
EXACT_T1 = sampling.SamplingParams(temperature=1.0, top_k=4, max_tokens=6)
N_EXACT = 20000
# case: (strategy, band (lo, hi) of a plain -> speculative -> plain run or None for every
# step speculative, sampling, slots, least acceptance length, least sequence-steps that
# accepted a node 3 or more deep). Measured at these seeds, 20000 answers: acceptance
# 1.72 / 1.63 / 1.42 / 1.84 and 3549 / 678 / 583 / 2978 such steps. The n-gram drafter
# matches every pair of slots of a prompt's samples, so a step costs slots squared: 256
# slots drafted as well as 1024 (acceptance 1.42 both) in 0.6x the time. The history
# drafter searches, besides, the 32 likeliest answers as the prompt's earlier completions:
# acceptance 1.44, 617 such steps.
EXACT_CASES = {
    "eagle-d4": (spec_lib.Strategy("eagle", depth=4), None, EXACT_T07, N_EXACT, 1.5, 2000),
    "eagle-d4-k2-t8": (spec_lib.Strategy("eagle", depth=4, topk=2, num_nodes=8), None, EXACT_T07, N_EXACT, 1.5, 400),
    "ngram-d4-b2": (spec_lib.Strategy("ngram", depth=4, topk=2), None, EXACT_T1, 256, 1.2, 300),
    "history-d4-b2": (spec_lib.Strategy("history", depth=4, topk=2), None, EXACT_T1, 256, 1.2, 300),
    "plain-eagle-plain": (spec_lib.Strategy("eagle", depth=4), (N_EXACT // 2, N_EXACT * 9 // 10), EXACT_T07, N_EXACT,
                          1.5, 1500),
}


@pytest.mark.costly
@pytest.mark.parametrize("case", sorted(EXACT_CASES))
def test_sampled_sequences_follow_the_target_distribution(case):
    """Every answer of up to 6 tokens of a 6-token vocabulary (eos ends it), enumerated:
    rollouts that speculate (chains and trees 4 deep, at temperature 0.7 with top-p and
    min-p, or 1 with top-k), or switch plain -> speculative -> plain mid-run, match the
    target's exact answer probabilities; drafts are accepted, 3 and 4 deep too, so the
    verification under test is the one that made the tokens."""
    from scipy import stats

    strategy, band, sp, num_slots, least_acceptance, least_deep = EXACT_CASES[case]
    params = tfm.init_params(SMALL, jax.random.PRNGKey(5), init_std=0.3)
    prompt, eos_id = [1, 2], 0
    keys, exact = _exact_answer_probabilities(params, prompt, sp, eos_id)
    assert abs(exact.sum() - 1) < 1e-5

    dcfg, dparams = _mimic_drafter(params, SMALL)
    engine = tiny.engine(SMALL, params, num_slots, max_prompt_length=2, max_length=2 + sp.max_tokens + 1,
                         max_draft_depth=4, eos_token_id=eos_id, steps_per_sync=16, drafter_config=dcfg,
                         drafter_params=dparams)
    history = None
    if strategy.drafter == "history":
        history = HistoryStore(max_tokens=256)
        history.add(prompt, _likely_answers(keys, exact, sp.max_tokens, 32))
    policy = (spec_lib.FixedSpeculation(strategy, max_active=num_slots, history=history) if band is None
              else _Band(strategy, *band))
    out = engine.generate([prompt], N_EXACT, sp, jax.random.PRNGKey(7), speculation=policy)
    assert _modes(out) == ("S" if band is None else "PSP")
    committed = np.asarray([n for c in out.timeline.groups[0].chunks if isinstance(c, SpecChunk)
                            for n in c.committed_per_sequence])
    acceptance = out.timeline.summary()["acceptance_length"]
    assert acceptance >= least_acceptance and np.sum(committed >= 4) >= least_deep, (acceptance,
                                                                                    np.bincount(committed))
    sampled = _answer_keys(np.stack([np.pad(t, (0, sp.max_tokens - len(t)), constant_values=SMALL.vocab_size)
                                     for t in out.tokens]))
    index = np.searchsorted(keys, sampled)
    assert np.all(keys[np.minimum(index, len(keys) - 1)] == sampled)
    counts = np.bincount(index, minlength=len(keys))
    assert counts[exact == 0].sum() == 0  # nothing outside the filters' support
    support = exact > 0
    expected = exact[support] * N_EXACT
    # Pool the rare outcomes so every cell expects at least 5 samples.
    rare = expected < 5
    observed = np.append(counts[support][~rare], counts[support][rare].sum())
    expected = np.append(expected[~rare], expected[rare].sum())
    p_value = stats.chisquare(observed, expected / expected.sum() * observed.sum()).pvalue
    assert p_value > 1e-3, p_value
