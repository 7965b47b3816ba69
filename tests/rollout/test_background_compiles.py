"""`RolloutConfig.background_compiles`: a drafting strategy's chunk warms on a thread of
its own when the policy first picks it, and plain decode runs in its place meanwhile."""
import jax
import numpy as np

from tests.rollout.test_speculative import (  # noqa: F401 (params: a fixture)
    CFG,
    PROMPTS,
    STRATEGIES,
    _engine,
    _mimic_drafter,
    _Recording,
    params,
)
from tlt_jax import sampling
from tlt_jax.rollout.timeline import SpecChunk


def test_a_pick_decodes_plain_until_its_program_is_warm_then_speculates(params):  # noqa: F811
    """With coupled verification the samples are plain decode's, token for token, whether a
    chunk ran the pick or plain decode in its place; the pick's first chunk runs plain (its
    program only starts compiling), the policy never hears a chunk that did not run its
    pick, and once the warm-up ended the same engine's chunks speculate."""
    sp = sampling.SamplingParams(temperature=1.0, top_k=8, max_tokens=16)
    key = jax.random.PRNGKey(8)
    plain = _engine(params).generate(PROMPTS, 2, sp, key)
    engine = _engine(params, *_mimic_drafter(params, CFG), spec_coupled=True, background_compiles=True)
    runs = []
    for _ in range(2):
        policy = _Recording(STRATEGIES[2])
        out = engine.generate(PROMPTS, 2, sp, key, speculation=policy)
        for a, b in zip(plain.tokens, out.tokens):
            np.testing.assert_array_equal(a, b)
        chunks = out.timeline.groups[0].chunks
        assert len(policy.heard) <= sum(isinstance(c, SpecChunk) for c in chunks)
        runs.append(chunks)
        for future in engine.groups[0]._warming.values():
            future.result()  # the warm-up ends (and raises nothing)
    assert not isinstance(runs[0][0], SpecChunk)
    assert all(isinstance(c, SpecChunk) for c in runs[1])
