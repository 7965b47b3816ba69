"""Supervised fine-tuning: `--config=configs/sft.py:tiny` (the synthetic tasks' warm start).

Presets: tiny (0.8M parameters from random weights, the RL job's policy, minutes on a
CPU), gpu (180M parameters, the speculative-decoding target of
experiments/device_check.sh), long_tail (bench_tlt's warm start), drift_shift and
drift_learn (the warm starts of bench_tlt's cpu_drift_shift and cpu_drift_learn), code and plan
(the warm starts of its cpu_code and cpu_plan: experiments/make_seed_model.py's model on the
MBPP-style code set and on Tower of Hanoi plans), hf (your checkpoint,
--config.model_dir, on your data in its chat template) and example (the README's CPU
example: the small model of experiments.make_example_model on reasoning-gym tasks)."""
import ml_collections

from configs import models
from configs.common import (
    WARM_START_COUNTDOWN_WEIGHT,
    code_config,
    data_config,
    tasks_drift_learn,
    tasks_drift_shift,
    tasks_long_tail,
    tasks_tiny,
)

# The fields a resumed run may change (`launch.prepare_run_dir`); a change to any other, a
# new field included, is refused unless --config.resume_changes names it.
RESUME_INERT = ("steps", "eval_every", "checkpoint_every")


# The reasoning-gym tasks of the README's CPU example (`pip install -e '.[envs]'`).
EXAMPLE_SOURCE = "reasoning_gym:basic_arithmetic,chain_sum,leg_counting"


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = models.model_config("tiny")
    c.model.update(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32)
    c.model_dir = ""  # a Hugging Face checkpoint to start from; "": config.model from random weights
    c.data = data_config(tasks=tasks_tiny(), num_train=50000, num_eval=128, seq_len=128)
    c.reward = ""  # the eval's verifier ("": the source's own, `sources.default_reward`)
    c.code = code_config()  # the code reward's options, when it is the verifier (docs/code.md)
    c.eval = ml_collections.ConfigDict(dict(num_slots=64, max_prompt_length=24))
    c.optimizer = ml_collections.ConfigDict(dict(learning_rate=2e-3, warmup_steps=50, schedule="cosine",
                                                 decay_steps=400, weight_decay=0.01, b1=0.9, b2=0.98,
                                                 max_grad_norm=1.0))
    c.steps = 200  # a deliberately brief warm start (half the cosine horizon): RL has headroom
    c.batch_size = 32
    c.eval_every = 200
    c.checkpoint_every = 200
    c.seed = 0
    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
    c.run_dir = "runs/sft_tiny"
    c.resume_changes = ""  # "field,field": changes of what is learned a resumed run accepts
    if preset == "gpu":
        # The speculative-decoding target on the GPU: 180M parameters (16 layers of 1024),
        # large enough that a decode step moves more bytes than the 1-layer drafter's.
        c.model.update(hidden_size=1024, intermediate_size=2816, num_layers=16, num_heads=16, num_kv_heads=4,
                       head_dim=64, dtype="bfloat16")  # float32 master weights, bfloat16 compute
        c.optimizer.update(learning_rate=6e-4, warmup_steps=50, decay_steps=500)
        c.steps, c.eval_every, c.checkpoint_every = 500, 500, 500
        c.run_dir = "runs/sft_gpu"
    elif preset == "long_tail":
        # The tiny model on long-tailed traces: the warm start of bench_tlt's CPU preset.
        c.data.update(tasks=tasks_long_tail(), seq_len=352)  # the longest prompt (59) and answer (273)
        c.eval.max_prompt_length = 64
        c.optimizer.decay_steps = 300
        c.steps, c.eval_every, c.checkpoint_every = 300, 300, 100
        c.run_dir = "runs/sft_long_tail"
    elif preset == "drift_shift":
        # bench_tlt's cpu_drift_shift warm start: additions (A) with a small share of
        # countdowns (B), so that B's pass@G starts low and RL has B to learn.
        c.data.update(tasks=tasks_drift_shift(WARM_START_COUNTDOWN_WEIGHT), seq_len=272)
        c.eval.max_prompt_length = 48
        c.optimizer.decay_steps = 300
        c.steps, c.eval_every, c.checkpoint_every = 300, 300, 100
        c.run_dir = "runs/sft_drift_shift"
    elif preset == "drift_learn":
        # bench_tlt's cpu_drift_learn warm start: additions answered mostly bare, now and
        # then by the worked trace (configs/common.py: tasks_drift_learn). Trained to the
        # end of its cosine: RL's headroom is the format, not undertraining.
        # 1800 steps: at 500 (on 2-8 digits) it had learned neither format (docs/benchmarks.md).
        c.data.update(tasks=tasks_drift_learn(), seq_len=80)  # the longest prompt (16) and trace (57), <bos> and <eos>
        c.eval.max_prompt_length = 24
        c.optimizer.decay_steps = 1800
        c.steps, c.eval_every, c.checkpoint_every = 1800, 1800, 600
        c.run_dir = "runs/sft_drift_learn"
    elif preset in ("hf", "example"):
        # Your checkpoint on your data (docs/your_model.md): its tokenizer's chat template, the
        # answers (data.response_field, default data.answer_field) as targets.
        c.model_dir = ""  # required: --config.model_dir=DIR
        c.data = data_config(source="files", num_train=0, num_eval=64, chat_template=True, seq_len=1024)
        c.eval.update(num_slots=32, max_prompt_length=512)
        c.optimizer.update(learning_rate=1e-5, warmup_steps=10, decay_steps=1000)
        c.steps, c.eval_every, c.checkpoint_every, c.batch_size = 1000, 100, 100, 16
        c.run_dir = "runs/sft_hf"
        if preset == "example":
            # The README's CPU example: teaches the small model of experiments.make_example_model
            # reasoning-gym's answer format (<answer>...</answer>) before RL.
            c.model_dir = "runs/example/base"
            c.data.update(source=EXAMPLE_SOURCE, num_train=2000, num_eval=64, seq_len=160)
            c.eval.max_prompt_length = 128
            c.optimizer.update(learning_rate=3e-3, warmup_steps=20, decay_steps=300)
            c.steps, c.eval_every, c.checkpoint_every, c.batch_size = 300, 100, 100, 32
            c.run_dir = "runs/example/sft"
    elif preset in SEED_PRESETS:
        seed_preset(c, preset)
    elif preset != "tiny":
        raise ValueError(f"Unknown sft preset {preset!r}; presets: tiny, gpu, long_tail, drift_shift, drift_learn, hf, "
                         "example, code, plan.")
    return c


# bench_tlt's code and planning warm starts: (data directory of experiments/make_seed_model.py,
# the eval's reward, the longest solution in tokens, SFT steps).
SEED_PRESETS = {"code": ("assets/code_data", "code", 24, 120),
                "plan": ("assets/plan_data", "experiments.make_plan_dataset:plan_reward", 48, 150)}


def seed_preset(c: ml_collections.ConfigDict, preset: str) -> None:
    """experiments/make_seed_model.py's random model taught a task (code or plan) from its
    dataset's solutions. Briefly: RL's headroom is what SFT left untaught."""
    data_dir, reward, solution_tokens, steps = SEED_PRESETS[preset]
    c.model_dir = "runs/seeds/base"
    c.data = data_config(source="files", train=f"{data_dir}/train.parquet", eval=f"{data_dir}/eval.parquet",
                         answer_field="", response_field="solution", prompt_template="{prompt}\n", num_train=0,
                         num_eval=64, seq_len=40 + solution_tokens)
    c.reward = reward
    c.code.timeout_s = 2.0
    c.eval.update(num_slots=64, max_prompt_length=40)
    c.optimizer.update(learning_rate=3e-3, warmup_steps=20, decay_steps=steps)
    c.steps, c.eval_every, c.checkpoint_every, c.batch_size = steps, steps, steps, 32
    c.run_dir = f"runs/sft_{preset}"
