r"""The rollout engine's output for fixed keys on a tiny model, recorded and compared bit for bit.

A change that must leave the engine's samples as they are (a refactor, a new compile
schedule) records them before and checks them after:

  python -m experiments.engine_golden --write=/tmp/engine_golden.npz   # before the change
  python -m experiments.engine_golden --check=/tmp/engine_golden.npz   # after: exit 1 on any difference

Cases: plain decode (sampled, over two kv buckets); speculative with the policy pinned to
one arm (an EAGLE chain in the tail, an n-gram trie); coupled speculation with an EAGLE
tree, its draft and verify phases timed apart; a multi-turn episode with stop tokens and
a stop sequence, speculative in its tail. Tokens, log-probs, finish reasons and observation masks
are compared exactly (the log-probs' bits, not a tolerance).
"""
import sys

import jax
import numpy as np
from absl import app, flags

from tlt_jax import sampling, sharding
from tlt_jax.models import drafter as drafter_lib
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import ModelConfig
from tlt_jax.rollout import speculative as spec_lib
from tlt_jax.rollout.engine import RolloutConfig, RolloutEngine

_WRITE = flags.DEFINE_string("write", None, "Record the outputs to this .npz file.")
_CHECK = flags.DEFINE_string("check", None, "Compare the outputs with this recorded .npz file.")

CFG = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)
DCFG = drafter_lib.DrafterConfig(num_layers=1)
PROMPTS = [[1, 2, 3, 1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12, 11, 12], [13, 14, 15]]
SP = sampling.SamplingParams(temperature=1.0, top_k=8, max_tokens=24)
TURN_SP = sampling.SamplingParams(temperature=1.0, max_tokens=40, stop_tokens=tuple(range(30, 40)),
                                  stop_sequences=((20, 21),))


class _Episodes:
    """Fixed observations per turn; the episode ends after its third turn. Steps run on the
    group's own thread (overlap False): with worker threads, how many samples decode when a
    chunk starts depends on when the threads answer, and with it whether the chunk
    speculates, which (uncoupled) changes the samples."""

    overlap = False

    def step(self, request, action, finish_reason):
        del action, finish_reason
        self.turns[request] = self.turns.get(request, 0) + 1
        turn = self.turns[request]
        return [[41, 42, 43], [44, 45, 46, 47]][turn - 1] if turn <= 2 else ""

    def __init__(self):
        self.turns = {}


def _engine(params, dparams, **config):
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    rc = RolloutConfig(**{**dict(num_slots=4, max_prompt_length=6, max_length=48, steps_per_sync=4,
                                 eos_token_id=0, max_draft_depth=4, kv_bucket=32), **config})
    return RolloutEngine(CFG, params, mesh, rc, DCFG, dparams)


def _cases(params, dparams) -> dict:
    """name -> Rollouts, every case under its own fixed key."""
    key = jax.random.PRNGKey(7)
    chain = spec_lib.FixedSpeculation(spec_lib.Strategy("eagle", depth=3), max_active=2)
    tree = spec_lib.FixedSpeculation(spec_lib.Strategy("eagle", depth=3, topk=2, num_nodes=6))
    ngram = spec_lib.FixedSpeculation(spec_lib.Strategy("ngram", depth=3, topk=2), max_active=3)
    engine, coupled = _engine(params, dparams), _engine(params, dparams, spec_coupled=True, time_spec_phases=True)
    return {
        "plain": engine.generate(PROMPTS, 3, SP, key),
        "eagle_chain": engine.generate(PROMPTS, 3, SP, key, speculation=chain),
        "ngram": engine.generate(PROMPTS, 3, SP, key, speculation=ngram),
        "coupled_tree_phased": coupled.generate(PROMPTS, 2, SP, key, speculation=tree),
        "turns_chain": engine.generate(PROMPTS, 2, TURN_SP, key, episodes=_Episodes(), speculation=chain),
    }


def record() -> dict[str, np.ndarray]:
    params = tfm.init_params(CFG, jax.random.PRNGKey(0), init_std=0.3)
    dparams = drafter_lib.init_drafter(CFG, DCFG, jax.random.PRNGKey(1), init_std=0.3)
    out = {}
    for name, rollouts in _cases(params, dparams).items():
        tokens, logp, mask = rollouts.padded()
        out[f"{name}/tokens"], out[f"{name}/logp"], out[f"{name}/mask"] = tokens, logp, mask
        out[f"{name}/finish"] = np.asarray(rollouts.finish_reason)
        if rollouts.observation_mask is not None:
            out[f"{name}/observed"] = rollouts.padded(length=tokens.shape[1])[2] & np.stack(
                [np.pad(m, (0, tokens.shape[1] - len(m))) for m in rollouts.observation_mask])
    return out


def main(argv):
    del argv
    if (_WRITE.value is None) == (_CHECK.value is None):
        raise app.UsageError("Pass exactly one of --write=PATH and --check=PATH.")
    out = record()
    if _WRITE.value:
        np.savez(_WRITE.value, **out)
        print(f"recorded {len(out)} arrays to {_WRITE.value}")
        return
    recorded = dict(np.load(_CHECK.value))
    differ = sorted(k for k in recorded.keys() | out.keys()
                    if k not in out or k not in recorded or recorded[k].shape != out[k].shape
                    or recorded[k].tobytes() != out[k].tobytes())
    print(f"{len(recorded) - len(differ)} of {len(recorded)} arrays bit-identical" +
          (f"; differ: {differ}" if differ else ""))
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    app.run(main)
