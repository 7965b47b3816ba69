"""GRPO on the synthetic reasoning tasks: `--config=configs/rl.py:tiny` (the main job).

Presets: tiny (CPU, minutes: warm-started from the shipped SFT checkpoint), qwen2.5-0.5b
and qwen2.5-1.5b (GPU shapes; their SFT warm start is trained first unless --config.sft_dir
names a checkpoint).

`tlt.enabled` turns TLT on: adaptive speculative rollouts (the BEG-MAB tuner of
`tlt.tuner` picks plain decode or a drafting strategy per chunk by active batch size)
and the drafter trained on the spot in the idle gaps of each RL step (`tlt.spot`,
`tlt.drafter`). `--config.tlt.enabled=False` is the baseline: the same run without them.

Warm start: `sft_dir` names a Hugging Face checkpoint; `--config.sft_dir=''` asks for the
SFT run of `sft` to be trained first (into <run_dir>/sft, once). A given path that does
not exist is an error, never a reason to train one.
"""
import ml_collections

from configs import models, sft

# The fields a resumed run may change (`launch.prepare_run_dir`): they alter neither what is
# learned nor how it is scored (speculation is lossless, so TLT's switch and its tuner are
# among them). A change to any other field, a new one included, is refused unless
# --config.resume_changes names it.
RESUME_INERT = ("steps", "eval_every", "checkpoint_every", "tlt.drafter.checkpoint_every", "save_hf",
                "reward_workers", "tlt.enabled", "tlt.tuner", "sft.run_dir")


def tlt_config() -> ml_collections.ConfigDict:
    """TLT's knobs; the arms and buckets follow the reference (DESIGN.md section 7), with
    plain decode and an n-gram drafter as arms of every bucket."""
    from tlt_jax.rollout import tuner

    return ml_collections.ConfigDict(dict(
        enabled=True,
        tuner=tuner.default_arms_config(),
        # Catch-up steps keep the drafter training when every gap is shorter than a step
        # (one device: the host phases of the tiny job are milliseconds); their time is reported.
        spot=dict(max_steps_per_rl_step=50, catch_up_steps=2, skip_short_gaps=True),
        drafter=dict(
            init="assets/drafter_tiny",  # an offline drafter export (experiments/train_drafter); "": from scratch
            num_layers=1, feature_layers=(),  # the architecture when starting from scratch
            top_k=8, batch_size=16, seq_len=128, buffer_max_bytes=256 << 20, keep_steps=2, prompt_tail=0,
            feature_weight=1.0, kl_weight=1.0, feature_noise=0.2,
            optimizer=dict(learning_rate=1e-3, warmup_steps=0, schedule="constant", decay_steps=1000,
                           weight_decay=0.01, b1=0.9, b2=0.95, max_grad_norm=1.0),
            checkpoint_every=5),
    ))


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.sft = sft.get_config("tiny")  # the warm start trained first when sft_dir is ""
    c.sft_dir = "assets/sft_tiny"  # a Hugging Face checkpoint with its tokenizer; "": train c.sft first
    # RL prompts come from their own seed: the SFT run drew its training problems from
    # seed 0, and a memorised problem gives no learning signal.
    c.data = ml_collections.ConfigDict(dict(tasks=sft.tasks_tiny(), num_train=20000, num_eval=256, seed=1))
    c.rollout = ml_collections.ConfigDict(dict(num_slots=128, max_prompt_length=24, max_tokens=96,
                                               steps_per_sync=16, temperature=1.0, top_p=1.0))
    c.num_samples = 8  # G
    c.prompts_per_step = 16
    c.advantage = "grpo"
    c.reward = "task"
    c.reward_workers = 0  # > 0: score in that many worker processes (slow reward functions)
    c.reward_timeout_s = 600.0  # a batch not scored by then scores 0 and is counted (0: no deadline)
    c.grpo = ml_collections.ConfigDict(dict(clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.0, tis_cap=2.0,
                                            aggregation="token_mean"))
    c.track_kl = True  # keep the reference policy to report KL even when kl_coef is 0
    c.learner = ml_collections.ConfigDict(dict(
        micro_batch_size=64, num_minibatches=2, remat=False,
        attention_impl="auto",  # dense | blockwise | cudnn | auto (blockwise or cuDNN for long rows)
        optimizer=dict(learning_rate=5e-5, warmup_steps=2, schedule="constant", decay_steps=1000,
                       weight_decay=0.0, b1=0.9, b2=0.99, max_grad_norm=1.0)))
    c.steps = 60
    c.eval_every = 10
    c.checkpoint_every = 5
    c.max_consecutive_skips = 3
    c.save_hf = True
    c.seed = 0
    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
    c.run_dir = "runs/rl_tiny"
    c.resume_changes = ""  # "field,field": changes of what is learned a resumed run accepts
    c.tlt = tlt_config()
    if preset == "tiny":
        return c
    if preset == "tiny-speculate-always":
        # Every chunk speculative at any batch size, with no plain arm: the RL-level check
        # that speculation leaves learning unchanged (the tuned default mostly decodes
        # plainly on this small model, where speculation does not pay).
        from tlt_jax.rollout.tuner import PLAIN

        c.tlt.tuner.arms = [[a for a in arms if a != PLAIN] for arms in c.tlt.tuner.arms]
        c.tlt.tuner.max_active = c.rollout.num_slots
        c.run_dir = "runs/rl_tiny_speculate_always"
        return c
    if preset not in ("qwen2.5-0.5b", "qwen2.5-1.5b"):
        raise ValueError(f"Unknown rl preset {preset!r}; presets: tiny, tiny-speculate-always, "
                         "qwen2.5-0.5b, qwen2.5-1.5b.")
    c.sft.model = models.model_config(preset)
    c.sft.run_dir = f"runs/sft_{preset}"
    c.sft_dir = ""
    c.rollout.update(num_slots=256, max_tokens=512)
    c.sft.data.seq_len = 24 + 512
    c.prompts_per_step, c.num_samples = 64, 8
    c.learner.micro_batch_size = 16
    c.learner.remat = True
    c.learner.optimizer.learning_rate = 1e-6
    c.steps = 200
    c.run_dir = f"runs/rl_{preset}"
    c.tlt.drafter.init = ""
    return c


def get_sweep(preset: str = "tiny") -> list[dict]:
    """TLT against the baseline over three sampling seeds: speculation is lossless, so the
    modes must agree within seed noise (`experiments/compare_runs.py` reports it).
    `tiny-speculate-always` sweeps the seeds of its TLT runs only; the baseline is tiny's."""
    from configs.common import grid

    if preset == "tiny-speculate-always":
        return grid(seed=[0, 1, 2])
    return grid(**{"tlt.enabled": [False, True], "seed": [0, 1, 2]})
