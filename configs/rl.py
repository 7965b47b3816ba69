"""GRPO configs: `--config=configs/rl.py:tiny` (the main job) and presets for your own model.

Presets:
  tiny                       CPU, minutes: the shipped SFT checkpoint on synthetic additions.
  tiny-speculate-always      tiny with every rollout chunk speculative (the lossless check).
  hf                         any local Hugging Face Llama / Qwen2 checkpoint (--config.model_dir)
                             on a dataset from disk (--config.data.train / .eval) or a
                             reasoning-gym environment, in the tokenizer's chat template, with
                             TLT on at TLT's published defaults and a drafter trained from scratch.
  qwen2.5-math-1.5b-gsm8k    hf at GPU shapes: Qwen2.5-Math-1.5B-Instruct on GSM8K's parquet.
  qwen2.5-7b-math            hf at GPU shapes: Qwen2.5-7B(-Instruct) on MATH (boxed answers).
docs/your_model.md walks through the hf presets.

`tlt.enabled` turns TLT on: adaptive speculative rollouts (the BEG-MAB tuner of
`tlt.tuner` picks plain decode or a drafting strategy per chunk by active batch size)
and the drafter trained on the spot in the idle gaps of each RL step (`tlt.spot`,
`tlt.drafter`). `--config.tlt.enabled=False` is the baseline: the same run without them.

The model: `model_dir` names a Hugging Face checkpoint with its tokenizer;
`--config.model_dir=''` asks for the SFT run of `sft` to be trained first (into
<run_dir>/sft, once), in the presets that have one. A given path that does not exist is
an error, never a reason to train one.

Data (`data`): `source` is `tasks` (the synthetic generators of `data.tasks`), `files`
(`data.train` / `data.eval`: JSONL, JSON, Parquet, CSV or a save_to_disk directory, columns
`prompt_field`, `answer_field` by dotted path) or `reasoning_gym:NAME[=WEIGHT],...`;
`chat_template` applies the tokenizer's chat template (with `system_prompt`), else
`prompt_template` formats the example's fields. `reward` names a registered reward (task,
answer_correctness, format, gsm8k, math, reasoning_gym, code: programs run against tests,
options in `code`, docs/code.md) or any `module.path:function`.
"""
import ml_collections

from configs import sft
from configs.common import code_config, data_config, tasks_tiny

# The fields a resumed run may change (`launch.prepare_run_dir`): they alter neither what is
# learned nor how it is scored (speculation is lossless, so TLT's switch and its tuner are
# among them). A change to any other field, a new one included, is refused unless
# --config.resume_changes names it.
RESUME_INERT = ("steps", "eval_every", "checkpoint_every", "tlt.drafter.checkpoint_every", "tlt.drafter.eval_rows",
                "save_hf",
                "reward_workers", "reward_overlap", "code.max_parallel", "tlt.enabled", "tlt.tuner",
                "rollout.background_compiles", "rollout.min_refill_rows", "sft.run_dir", "wandb")


# The tiny job's arms: TLT's buckets with three strategies where the reference has eight.
# Each strategy compiles at the tuner's first pick (untried arms are pulled first), seconds
# apiece on 2 CPU cores, for a run that drafts ~2% of its tokens (docs/benchmarks.md, the
# main job from an empty cache); the GPU presets and the benchmarks keep the reference's.
TINY_ARMS = [["eagle-d6", "ngram-d4-b2", "plain"], ["eagle-d6", "ngram-d4-b2", "plain"],
             ["eagle-d4", "plain"], ["eagle-d4", "plain"]]


def tlt_config() -> ml_collections.ConfigDict:
    """TLT's knobs; the buckets follow the reference (DESIGN.md section 7), with plain
    decode an arm of every bucket; the arms are the tiny job's (`use_reference_rollout`
    gives the reference's)."""
    from tlt_jax.rollout import tuner

    return ml_collections.ConfigDict(dict(
        enabled=True,
        tuner=dict(tuner.default_arms_config(), arms=TINY_ARMS),
        # Catch-up steps keep the drafter training when every gap is shorter than a step
        # (one device: the host phases of the tiny job are milliseconds); their time is
        # reported, and catch_up_max_share < 1 caps it as a share of the run's wall time.
        spot=dict(max_steps_per_rl_step=50, catch_up_steps=2, catch_up_max_share=1.0, skip_short_gaps=True),
        drafter=dict(
            init="assets/drafter_tiny",  # an offline drafter export (experiments/train_drafter); "": from scratch
            num_layers=1, feature_layers=(),  # the architecture when starting from scratch
            layout="auto",  # one unfused layer: "eagle", which SGLang and vLLM load (its export writes eagle/)
            # seq_len 0: a buffer row holds a whole sample (prompt_tail + 1 + rollout.max_tokens),
            # so the drafter learns the late tokens of long responses, which the tail drafts.
            top_k=8, batch_size=16, seq_len=0, buffer_max_bytes=256 << 20, keep_steps=2, replay_share=0.0,
            prompt_tail=-1,  # prompt tokens a row keeps before the last one (-1: the whole prompt)
            feature_weight=1.0, kl_weight=1.0, feature_noise=0.2, ttt_steps=1, trust_region=0.0,
            # A warm start's recipe (docs/tlt.md): rate 3e-4 with the scored publish below. A
            # drafter from nothing learns at 1e-3 and publishes every version (hf_config).
            optimizer=dict(learning_rate=3e-4, warmup_steps=0, schedule="constant", decay_steps=1000,
                           weight_decay=0.01, b1=0.9, b2=0.95, max_grad_norm=1.0),
            checkpoint_every=5,
            eval_rows=16,  # each RL step's rows scoring the drafter that drafted it (0: none)
            # publish only the best, scored on the next step's samples, of the last step's
            # drafter, the served one and the starting one (OnlineDrafter._publish_best)
            publish_scored=True),
    ))


def use_reference_rollout(c: ml_collections.ConfigDict) -> None:
    """Undoes the tiny job's cold-start choices in c: the reference's arms
    (`tuner.default_arms_config`: eight strategies, an n-gram drafter and plain decode among
    them), kv buckets of 64 slots and refills of any size. The GPU presets run so, and every
    bench_tlt preset was measured so."""
    from tlt_jax.rollout import tuner

    c.tlt.tuner = tuner.default_arms_config()
    c.rollout.update(kv_bucket=64, min_refill_rows=1)


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.sft = sft.get_config("tiny")  # the warm start trained first when model_dir is ""
    c.model_dir = "assets/sft_tiny"  # a Hugging Face checkpoint with its tokenizer; "": train c.sft first
    # RL prompts come from their own seed: the SFT run drew its training problems from
    # seed 0, and a memorised problem gives no learning signal.
    c.data = data_config(tasks=tasks_tiny(), num_train=20000, num_eval=256, seed=1)
    # kv_bucket: attention reads the cache in buckets of kv_bucket, twice that, ... slots
    # (RolloutConfig.kv_bucket; 0: always every slot): one compiled chunk per bucket. 0 here:
    # at 120 slots of 128 wide the reads are a small share of a decode step, and buckets
    # would double the programs compiled (the GPU presets bucket). min_refill_rows: a refill
    # prefills at least that many slot rows (RolloutConfig.min_refill_rows): the evaluation's
    # refills compile at 8, 16, 32 rows rather than at 1, 2, 4, 8, ... (the GPU presets: 1).
    # decode_mlp_size: decode with every MLP padded by zero units to this width, the same
    # tokens from weights that outgrow the CPU's caches (RolloutConfig.decode_mlp_size; 0: off).
    # steps_per_sync / spec_steps_per_sync: plain / speculative decode steps per device loop.
    # spec_coupled: speculative steps emit exactly plain decode's samples for the same keys
    # (RolloutConfig.spec_coupled): runs that differ only in their drafter share one trajectory.
    # background_compiles: warm-ups on threads of their own (plain decode's during the starting
    # evaluation, the drafter's, a drafting strategy's at the tuner's first pick with plain decode
    # meanwhile: RolloutConfig.background_compiles). Off: on 2 CPU cores the threads' compiles
    # contend with the run's own work (docs/benchmarks.md, the main job from an empty cache).
    # partial_share: a step stops its rollout once this share of its samples has finished and
    # carries the rest, whole GRPO groups, to the next step (0: off; tlt_jax/rl/carry.py);
    # max_carry_steps: the most steps a carried token waits before it is learned.
    c.rollout = ml_collections.ConfigDict(dict(num_slots=128, max_prompt_length=24, max_tokens=96,
                                               steps_per_sync=16, spec_steps_per_sync=4, temperature=1.0,
                                               top_p=1.0, kv_bucket=0, min_refill_rows=8, decode_mlp_size=0,
                                               spec_coupled=False,
                                               background_compiles=False, partial_share=0.0, max_carry_steps=2))
    # 1: one-step-off, each step learns samples drawn by the policy one update older than the
    # learner's (needs grpo.tis_cap > 0; not with partial_share; tlt_jax/rl/off_policy.py);
    # 0: synchronous steps.
    c.off_policy_steps = 0
    c.num_samples = 8  # G
    c.prompts_per_step = 16
    c.balance_tasks = False  # True: every step's prompts take the data's tasks in turn (RLStepConfig)
    c.advantage = "grpo"
    c.reward = "task"
    c.reward_workers = 0  # > 0: score in that many worker processes (slow reward functions)
    c.reward_timeout_s = 600.0  # a batch not scored by then scores 0 and is counted (0: no deadline)
    # Each sample scored as it finishes, while the rest decode (the same rewards for a reward
    # that scores each sample on its own; False for one that reads the whole batch).
    c.reward_overlap = True
    c.code = code_config()  # the code reward's sandbox and scoring (reward="code"; docs/code.md), the python tool's
    # Multi-turn rollouts (docs/agents.md): name a built-in environment (python_tool,
    # tower_of_hanoi) or module.path:ClassName; "" keeps rollouts single-turn. max_turns:
    # model turns per sample; max_total_tokens: the transcript after the prompt, model and
    # observation tokens (0: rollout.max_tokens); stop_strings: text that ends a turn
    # besides the end tokens (empty: the environment's own); overlap: environments step
    # while the other samples decode (False: decoding waits for them, to measure the gain);
    # step_timeout_s: the rollout's wait for one step (0: no deadline). The python tool's
    # sandbox and limits are config.code's. With a name, reward="" scores by the
    # environment's step rewards alone.
    c.env = ml_collections.ConfigDict(dict(name="", max_turns=1, max_total_tokens=0, stop_strings=(),
                                           overlap=True, step_timeout_s=0.0))
    c.grpo = ml_collections.ConfigDict(dict(clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.0, tis_cap=2.0,
                                            aggregation="token_mean"))
    c.track_kl = True  # keep the reference policy to report KL even when kl_coef is 0
    c.learner = ml_collections.ConfigDict(dict(
        micro_batch_size=64, num_minibatches=2, remat=False,
        # auto: with one minibatch the update's own forward gives the old log-probs (ratio 1)
        # and the drafter's data; always: a separate old-policy forward first
        old_policy_pass="auto",
        attention_impl="auto",  # dense | blockwise | cudnn | auto (blockwise or cuDNN for long rows)
        logprob_impl="auto",  # the log-prob / entropy / drafter top-K projection: auto | dense | chunked_xla | pallas
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
    # Weights & Biases beside TensorBoard: --config.wandb.project=NAME (offline by default,
    # into <run_dir>/wandb for `wandb sync`; --config.wandb.mode=online streams).
    c.wandb = ml_collections.ConfigDict(dict(project="", name="", mode="offline"))
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
    if preset not in HF_PRESETS:
        raise ValueError(f"Unknown rl preset {preset!r}; presets: tiny, tiny-speculate-always, "
                         f"{', '.join(HF_PRESETS)}.")
    return hf_config(c, preset)


HF_PRESETS = ("hf", "qwen2.5-math-1.5b-gsm8k", "qwen2.5-7b-math")


def hf_config(c: ml_collections.ConfigDict, preset: str) -> ml_collections.ConfigDict:
    """Your checkpoint and data: the tiny config's run around a model from model_dir,
    prompts in its chat template, TLT at the reference's defaults (speculation while at
    most 32 sequences run, buckets 1/2/5/21, epsilon 0.1, window 300; exploring pulls drawn
    by reward) and a drafter that
    starts from nothing."""
    c.sft = None  # no warm start is trained: the model is the user's
    c.model_dir = ""  # required: --config.model_dir=DIR
    c.data = data_config(source="files", num_train=0, num_eval=256, seed=0, chat_template=True)
    c.reward = "math"
    use_reference_rollout(c)
    c.rollout.update(num_slots=64, max_prompt_length=256, max_tokens=512)
    c.prompts_per_step, c.num_samples = 8, 8
    c.learner.update(micro_batch_size=8, num_minibatches=1, remat=True)
    c.learner.optimizer.update(learning_rate=1e-6, warmup_steps=0, weight_decay=0.0)
    c.grpo.kl_coef = 0.0
    c.track_kl = False  # no reference copy of the policy in memory
    c.steps, c.eval_every, c.checkpoint_every = 100, 20, 20
    c.tlt.drafter.init = ""  # from scratch; or an offline export (experiments.train_drafter)
    # From nothing: a faster rate, and every version published (its starting drafter drafts
    # nothing worth scoring against). A warm start: the tiny config's recipe.
    c.tlt.drafter.update(seq_len=1024, batch_size=8, publish_scored=False)
    c.tlt.drafter.optimizer.learning_rate = 1e-3
    c.mesh.update(data=-1, fsdp=1, tensor=1)
    c.run_dir = "runs/rl_hf"
    if preset == "qwen2.5-math-1.5b-gsm8k":
        # Qwen2.5-Math-1.5B-Instruct on GSM8K's parquet (question, answer "... #### 72"), one
        # H200: rollout budgets of the GSM8K recipes (G=8, 1k new tokens), the learner in
        # micro-batches that `experiments.plan_memory` fits.
        c.data.update(prompt_field="question", answer_field="answer",
                      system_prompt="Please reason step by step, and put your final answer within \\boxed{}.")
        c.rollout.update(num_slots=512, max_prompt_length=512, max_tokens=1024, kv_bucket=256)  # 4 buckets
        c.prompts_per_step, c.num_samples = 64, 8
        c.learner.update(micro_batch_size=16, num_minibatches=4)
        c.steps, c.eval_every, c.checkpoint_every = 200, 20, 20
        c.run_dir = "runs/rl_qwen2.5-math-1.5b-gsm8k"
    elif preset == "qwen2.5-7b-math":
        # Qwen2.5-7B on MATH (problem, boxed solution), tensor-parallel over 2 devices a group.
        c.data.update(prompt_field="problem", answer_field="solution",
                      system_prompt="Please reason step by step, and put your final answer within \\boxed{}.")
        c.rollout.update(num_slots=256, max_prompt_length=1024, max_tokens=3072, kv_bucket=512)  # 4 buckets
        c.prompts_per_step, c.num_samples = 64, 8
        c.learner.update(micro_batch_size=4, num_minibatches=8)
        c.mesh.update(data=-1, fsdp=1, tensor=2)
        c.steps, c.eval_every, c.checkpoint_every = 300, 25, 25
        c.run_dir = "runs/rl_qwen2.5-7b-math"
    return c


def get_sweep(preset: str = "tiny") -> list[dict]:
    """TLT against the baseline over three sampling seeds: speculation is lossless, so the
    modes must agree within seed noise (`experiments/compare_runs.py` reports it).
    `tiny-speculate-always` sweeps the seeds of its TLT runs only; the baseline is tiny's."""
    from configs.common import grid

    if preset == "tiny-speculate-always":
        return grid(seed=[0, 1, 2])
    return grid(**{"tlt.enabled": [False, True], "seed": [0, 1, 2]})
