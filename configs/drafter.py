r"""Offline drafter training (the warm start of the drafter): `--config=configs/drafter.py:tiny`.

The target is a Hugging Face checkpoint with its tokenizer (`target_dir`; by default the
shipped SFT model `assets/sft_tiny`); the drafter, an EAGLE layer on the target's frozen
embedding and LM head, learns the target's top-K distribution (and, unfused, its next
hidden state) on the traces of `data` (by default the RL tasks; any source SFT reads, in
the target's prompt format). The export lands in <run_dir>/drafter
(`tlt_jax.drafter_training.io.load_drafter`).

Presets:
  tiny   one layer reading the target's final hidden state (EAGLE); K = 8 of the 37-token
         vocabulary. A few minutes on two CPU cores, then acceptance through the rollout
         engine with a 4-deep chain at temperature 1.
  fused  the same with EAGLE-3 fusion of a low, a middle and the last target layer; the
         regression target is then the fused feature of the next position.
  gpu    tiny's recipe for the 180M target of `configs/sft.py:gpu` (runs/sft_gpu/hf).
  long_tail, drift_shift, drift_learn   tiny's recipe for the target of the same name in
         `configs/sft.py`, on its tasks (bench_tlt's warm starts).
  code, plan   for the warm starts of bench_tlt's cpu_code and cpu_plan (configs/sft.py:code,
         :plan), on their own answers to the training prompts (experiments/sample_outputs.py
         --outputs=runs/sft_<preset>/outputs.parquet).
"""
import ml_collections

from configs import sft as sft_configs
from configs.common import (
    WARM_START_COUNTDOWN_WEIGHT,
    data_config,
    tasks_drift_learn,
    tasks_drift_shift,
    tasks_long_tail,
    tasks_tiny,
)

# The fields a resumed run may change (`launch.prepare_run_dir`); a change to any other, a
# new field included, is refused unless --config.resume_changes names it.
RESUME_INERT = ("steps", "eval_every", "checkpoint_every")


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
    if preset not in ("tiny", "fused", "gpu", "long_tail", "drift_shift", "drift_learn", "code", "plan"):
        raise ValueError(f"Unknown drafter preset {preset!r}; presets: tiny, fused, gpu, long_tail, drift_shift, "
                         "drift_learn, code, plan.")
    c = ml_collections.ConfigDict()
    c.target_dir = "assets/sft_tiny"
    c.tokenizer_dir = ""  # "": the target's directory
    # layout "auto": "eagle" for one layer on the last hidden state, the drafter SGLang and vLLM
    # load (the export then also writes eagle/; it drafted better than "tlt" here,
    # docs/benchmarks.md), else "tlt" (normed input and output; `models/drafter.py`).
    c.drafter = ml_collections.ConfigDict(dict(num_layers=1, feature_layers=(), layout="auto"))
    # Any source of tlt_jax.data.sources (the synthetic tasks, files from disk, reasoning-gym),
    # prompts in the target's format: --config.data.source=files --config.data.train=...
    # --config.data.chat_template=True for a chat model on your data.
    c.data = data_config(tasks=tasks_tiny(), num_train=20000, num_eval=256, seq_len=128, seed=0)
    c.top_k = 8  # target ids kept per position; <= the vocabulary size
    c.temperature = 1.0  # of the target's distribution and the drafter's alike
    c.kl_weight = 1.0
    # Smooth L1 of the drafter's output to the next feature it reads (what it is fed back in
    # drafting); 0 leaves drafts past the first token to chance.
    c.feature_weight = 1.0
    # Width of the uniform noise on the features the drafter reads in training (EAGLE: 0.2
    # wide); the final-normed features of the tiny target have RMS about 1.
    c.feature_noise = 0.2
    # Training-time test (EAGLE-3): passes past the first in which the drafter reads its own
    # earlier predictions, as in drafting past the first token (1: none; each pass costs
    # about one more forward and loss).
    c.ttt_steps = 1
    # Positions of every row per block of the target's blockwise top-K (its [B, block, V] float32
    # logits are the pass's temporary memory); 0: the backend's default token block.
    c.topk_block = 0
    c.loss_impl = "auto"
    c.remat = False
    c.optimizer = ml_collections.ConfigDict(dict(learning_rate=6e-3, warmup_steps=20, schedule="cosine",
                                                 decay_steps=600, weight_decay=0.01, b1=0.9, b2=0.98,
                                                 max_grad_norm=1.0))
    c.steps = 600
    c.batch_size = 16
    c.eval_every = 150
    c.eval_batch_size = 32
    c.checkpoint_every = 300
    c.seed = 0
    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
    # Speculative rollouts of held-out prompts with the trained drafter; num_prompts 0 skips it.
    c.acceptance = ml_collections.ConfigDict(dict(num_prompts=32, num_samples=2, depth=4, temperature=1.0,
                                                  max_tokens=96, num_slots=32, max_prompt_length=24))
    c.run_dir = "runs/drafter_tiny"
    c.resume_changes = ""  # "field,field": changes of what is learned a resumed run accepts
    if preset == "fused":
        c.drafter.feature_layers = (0, 2, 3)
        c.run_dir = "runs/drafter_fused"
    if preset == "gpu":  # for the target of configs/sft.py:gpu
        c.target_dir = "runs/sft_gpu/hf"
        c.optimizer.learning_rate = 2e-3
        c.batch_size = 32
        c.run_dir = "runs/drafter_gpu"
    if preset == "long_tail":  # for the target of configs/sft.py:long_tail
        c.target_dir = "runs/sft_long_tail/hf"
        c.data.update(tasks=tasks_long_tail(), seq_len=352)
        c.acceptance.update(max_tokens=288, max_prompt_length=64)
        c.run_dir = "runs/drafter_long_tail"
    if preset == "drift_shift":  # for the target of configs/sft.py:drift_shift, on the same mix of tasks
        c.target_dir = "runs/sft_drift_shift/hf"
        c.data.update(tasks=tasks_drift_shift(WARM_START_COUNTDOWN_WEIGHT), seq_len=272)
        c.acceptance.update(max_tokens=224, max_prompt_length=48)
        c.run_dir = "runs/drafter_drift_shift"
    if preset == "drift_learn":  # for the target of configs/sft.py:drift_learn
        c.target_dir = "runs/sft_drift_learn/hf"
        # The bare answers the warm start mostly writes, with a trace 1 time in 100: on its SFT
        # mix (15 in 100) the drafter drafted traces nearly as well as bare answers
        # (teacher-forced 0.86 against 0.94), which leaves nothing to go stale as RL moves
        # the policy to the trace; at 1 in 100, 0.67 against 0.94 (docs/benchmarks.md).
        c.data.update(tasks=tasks_drift_learn(trace_share=0.01), seq_len=80)
        c.acceptance.update(max_tokens=64, max_prompt_length=24)
        c.run_dir = "runs/drafter_drift_learn"
    if preset in ("code", "plan"):
        # The warm start's own answers, right or wrong, as a drafter trained before RL sees them:
        # RL then moves the policy away from its wrong ones (on the reference solutions, the
        # drafter would draft RL's destination from the start).
        sft = sft_configs.get_config(preset)
        c.target_dir = f"runs/sft_{preset}/hf"
        c.data = data_config(source="files", train=f"runs/sft_{preset}/outputs.parquet", eval=sft.data.eval,
                             answer_field="", response_field="solution", prompt_template=sft.data.prompt_template,
                             num_train=0, num_eval=64, seq_len=sft.data.seq_len)
        c.steps, c.eval_every, c.checkpoint_every = 300, 150, 300
        c.optimizer.decay_steps = 300
        c.acceptance.update(max_tokens=sft.data.seq_len - sft.eval.max_prompt_length,
                            max_prompt_length=sft.eval.max_prompt_length)
        c.run_dir = f"runs/drafter_{preset}"
    return c


def get_sweep(preset: str = "tiny") -> list[dict]:
    """Drafter recipes side by side, all drafting the same chain at inference: the plain
    EAGLE recipe, training-time test over 3 passes, and EAGLE-3 fusion of a low, a middle
    and the last target layer (`experiments.compare_drafters` tabulates them):

      python -m experiments.sweep --launcher=experiments.train_drafter \
          --config=configs/drafter.py:long_tail --sweep_dir=runs/drafter_recipes
    """
    last = 15 if preset == "gpu" else 3  # the last layer of the preset's own target (not of a --set target_dir)
    return [{"ttt_steps": 1}, {"ttt_steps": 3}, {"drafter.feature_layers": (0, last // 2, last)}]
