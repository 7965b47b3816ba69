"""configs/rl.py:tiny made small and deterministic for tests/test_multihost.py, where a run
of one process and a run of two must learn exactly alike (pass the warm start with
--config.model_dir: a small random policy compiles fast).

TLT is on with one arm, an EAGLE chain, for every active batch size: the tuner draws
nothing and what it measures decides nothing; the drafter keeps its weights (learning
rate 0) while its steps, versions, checkpoints and publishing all run. The samples, and
with them every learning metric, then depend only on the seed. The reward, the share of
an answer's length cap a completion fills, gives a random policy a learning signal.
"""
from configs import rl
from tlt_jax import rewards

MAX_TOKENS = 24


def length_reward(prompts, completions, **_):
    return [min(len(c), MAX_TOKENS) / MAX_TOKENS for c in completions]


rewards.REWARDS["test_length"] = length_reward  # importing the config registers it in the launcher


def get_config(preset: str = "tlt"):
    if preset not in ("tlt", "baseline"):
        raise ValueError(f"Unknown preset {preset!r}; presets: tlt, baseline.")
    c = rl.get_config("tiny")
    c.data.update(num_train=64, num_eval=8)
    c.rollout.update(num_slots=16, max_tokens=MAX_TOKENS)
    c.prompts_per_step, c.num_samples, c.reward = 4, 4, "test_length"
    c.learner.update(micro_batch_size=8, num_minibatches=2)
    # No reference policy (kl_coef is 0) and no served-drafter scoring: programs the
    # comparison never reads, compiled in each of its processes.
    c.update(steps=3, eval_every=3, checkpoint_every=1, save_hf=False, track_kl=False)
    c.mesh.update(data=2, fsdp=4, tensor=1)  # two rollout groups, the learner over all 8 devices
    c.tlt.enabled = preset == "tlt"
    c.tlt.tuner.update(buckets=[1], arms=[["eagle-d3"]], max_active=16)
    # Two drafter steps an RL step, whatever the gaps hold (catch-up makes up what they did not
    # run): the count is then a function of the seed too, not of the machine's load.
    c.tlt.spot.update(catch_up_steps=2, max_steps_per_rl_step=2)
    c.tlt.drafter.update(init="", batch_size=4, seq_len=48, checkpoint_every=1, eval_rows=0, publish_scored=False)
    c.tlt.drafter.optimizer.learning_rate = 0.0
    return c
