r"""Distillation from a cached teacher: `--config=configs/distill.py:tiny`.

The teacher is a Hugging Face checkpoint directory with its tokenizer (`teacher_dir`; by
default the shipped `assets/sft_tiny`, trained here on the addition traces; any checkpoint
`load_hf` reads works); the student is a smaller model with the teacher's vocabulary,
randomly initialised. `mode="offline"` caches the teacher's top-K once under the run
directory (or `cache_dir`) and trains from the cache; `mode="online"` runs the teacher in
the loop on the same batches (same curves, teacher compute every step).

tiny: K = 8 of a 37-token vocabulary (K <= V is required; the paper's K = 100 assumes a
real vocabulary); the held-out targets keep the whole vocabulary (`eval_top_k=0`), so
`eval_kl` is the exact full-vocabulary KL. About 2 minutes on two CPU cores.

`get_sweep` compares the two losses (see experiments/sweep.py):
  python -m experiments.sweep --launcher=experiments.distill --config=configs/distill.py:tiny \
      --sweep_dir=runs/distill_sweep
"""
import ml_collections

from configs import models
from configs.common import grid
from configs.sft import tasks_tiny

# The fields a resumed run may change (`launch.prepare_run_dir`); a change to any other, a
# new field included, is refused unless --config.resume_changes names it.
RESUME_INERT = ("steps", "eval_every", "checkpoint_every")


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
    if preset != "tiny":
        raise ValueError(f"Unknown distill preset {preset!r}; presets: tiny.")
    c = ml_collections.ConfigDict()
    c.teacher_dir = "assets/sft_tiny"
    c.tokenizer_dir = ""  # "": the teacher's directory
    # Vocabulary size and special ids come from the teacher.
    c.student = models.model_config("tiny")
    c.student.update(hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    c.data = ml_collections.ConfigDict(dict(tasks=tasks_tiny(), num_train=8000, num_eval=256, seq_len=128))
    c.mode = "offline"  # or "online": the teacher in the loop
    c.top_k = 8  # teacher ids kept per position; <= the vocabulary size
    c.tail = False  # False: the paper's top-K loss; True: plus the bucket of the mass outside the top-K
    c.temperature = 1.0  # of teacher and student alike
    c.eval_top_k = 0  # ids per held-out position (>= top_k); 0: the whole vocabulary (exact eval_kl)
    c.cache_dir = ""  # "": <run_dir>/teacher_cache; another run's (existing) cache can be shared
    c.cache_dtype = "float32"  # of the cached log-probs: "float32" or "bfloat16"
    # Rows per teacher call while caching. Equal to batch_size, the teacher computes with the
    # shapes of the online loop and both modes' curves are bitwise identical (CPU); other sizes
    # agree to f32 rounding (XLA rounds matmuls by shape), which training amplifies after ~50 steps.
    c.cache_batch_size = 16
    c.cache_rows_per_shard = 0  # resume granularity of the cache writer; 0: ~256 MiB shards
    c.loss_impl = "auto"
    c.remat = False
    c.optimizer = ml_collections.ConfigDict(dict(learning_rate=3e-3, warmup_steps=20, schedule="cosine",
                                                 decay_steps=600, weight_decay=0.01, b1=0.9, b2=0.98,
                                                 max_grad_norm=1.0))
    c.steps = 600
    c.batch_size = 16
    c.eval_every = 100
    c.eval_batch_size = 16
    c.checkpoint_every = 300
    c.seed = 0
    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
    c.run_dir = "runs/distill_tiny"
    c.resume_changes = ""  # "field,field": changes of what is learned a resumed run accepts
    return c


def get_sweep(preset: str = "tiny") -> list[dict]:
    """The paper's top-K loss (tail=False) against ours with the tail bucket (tail=True), on
    the same data and seed, at the default K and at a K small enough that the teacher's
    mass outside the top-K is no longer negligible."""
    del preset
    return grid(top_k=[8, 2], tail=[False, True])
