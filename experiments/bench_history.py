r"""History drafts: acceptance length per epoch over the same prompts, beside n-gram and EAGLE.

  python -m experiments.bench_history --epochs=4 --out=docs/results/bench_history_accept.json

The same prompts (held-out task prompts, G samples each, temperature 1), sampled once per
epoch with a fresh key as RL would every time it reaches them, under each strategy alone
(every chunk speculative). A history strategy starts each strategy's run with an empty
store and searches, from the second epoch on, the answers of the epochs before. The policy
does not learn between epochs, so this is the case of a slowly moving policy; the figure
is acceptance length (tokens committed per sequence and verify step), not time: whether an
arm pays in tokens/s is what the RL job's tuner measures (`bench_tlt --modes=history`).
"""
import json

import jax
import numpy as np
from absl import app, flags

from configs.common import tasks_tiny
from tlt_jax import evaluation, sampling, sharding
from tlt_jax.data import tasks
from tlt_jax.drafter_training.io import load_drafter
from tlt_jax.models.hf_io import load_hf
from tlt_jax.rollout import speculative as spec_lib
from tlt_jax.rollout.engine import RolloutConfig, RolloutEngine
from tlt_jax.rollout.history import HistoryStore
from tlt_jax.tokenizer import load_tokenizer

_TARGET = flags.DEFINE_string("target", "assets/sft_tiny", "The target (Hugging Face checkpoint with tokenizer).")
_DRAFTER = flags.DEFINE_string("drafter", "assets/drafter_tiny", "Its EAGLE drafter export (for eagle arms).")
_STRATEGIES = flags.DEFINE_list("strategies", ["ngram-d4-b2", "history-d4-b2", "history-d6-b3", "eagle-d4"],
                                "Strategies, each run alone over every epoch.")
_EPOCHS = flags.DEFINE_integer("epochs", 4, "Passes over the same prompts.")
_PROMPTS = flags.DEFINE_integer("prompts", 8, "Prompts (held-out task prompts of the tiny SFT tasks).")
_SAMPLES = flags.DEFINE_integer("samples", 8, "Samples per prompt (G).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 96, "Answer budget.")
_OUT = flags.DEFINE_string("out", "", "Write the results as JSON here.")


def main(argv):
    del argv
    strategies = [spec_lib.Strategy.from_name(n) for n in _STRATEGIES.value]
    cfg, params = load_hf(_TARGET.value)
    dcfg, dparams = load_drafter(_DRAFTER.value, cfg) if any(s.drafter == "eagle" for s in strategies) else (None,
                                                                                                          None)
    examples = tasks.make_split(tasks.from_spec(tasks_tiny().to_dict()), "eval", _PROMPTS.value, seed=1,
                                unique=True)
    prompts = evaluation.encode_prompts(load_tokenizer(_TARGET.value), examples)
    n = _PROMPTS.value * _SAMPLES.value
    rc = RolloutConfig(num_slots=n, max_prompt_length=max(map(len, prompts)),
                       max_length=max(map(len, prompts)) + _MAX_TOKENS.value + 1, eos_token_id=cfg.eos_token_id,
                       max_draft_depth=max(s.depth for s in strategies))
    engine = RolloutEngine(cfg, params, sharding.make_mesh({"data": 1}, jax.devices()[:1]), rc, dcfg, dparams)
    sp = sampling.SamplingParams(temperature=1.0, max_tokens=_MAX_TOKENS.value)
    result = dict(target=_TARGET.value, prompts=_PROMPTS.value, samples=_SAMPLES.value, epochs=_EPOCHS.value,
                  acceptance_length={}, response_length_mean={})
    for strategy in strategies:
        store = HistoryStore() if strategy.drafter == "history" else None
        policy = spec_lib.FixedSpeculation(strategy, max_active=n, history=store)
        acceptance, lengths = [], []
        for epoch in range(_EPOCHS.value):
            if store is not None:
                store.begin_step(epoch)
            out = engine.generate(prompts, _SAMPLES.value, sp, jax.random.fold_in(jax.random.PRNGKey(0), epoch),
                                  speculation=policy)
            acceptance.append(out.timeline.summary()["acceptance_length"])
            lengths.append(float(np.mean(out.lengths)))
        result["acceptance_length"][strategy.name] = acceptance
        result["response_length_mean"][strategy.name] = lengths
        print(f"{strategy.name:16} acceptance per epoch " + " ".join(f"{a:.2f}" for a in acceptance)
              + f"  (mean answer {np.mean(lengths):.1f} tokens)", flush=True)
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    app.run(main)
