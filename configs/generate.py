"""Generation demo: `--config=configs/generate.py:tiny` (any model preset name)."""
import ml_collections

from configs import models
from configs.common import grid


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = models.model_config(preset)
    c.hf_dir = ""  # a Hugging Face checkpoint directory replaces the preset (and its tokenizer is used)
    c.drafter_dir = ""  # a drafter trained for that target (experiments.train_drafter) enables speculation
    c.strategy = ""  # e.g. eagle-d4, eagle-d5-k3-t12, ngram-d4-b2; empty: eagle-d4 when there is a drafter
    c.prompt = "add 12+34\n"  # text when a tokenizer exists (assets/sft_tiny's task); otherwise prompt_ids
    c.prompt_ids = (1, 2, 3, 4)
    c.batch_size = 4
    c.max_new_tokens = 32
    c.temperature = 0.0  # greedy
    c.top_p = 1.0
    c.top_k = 0
    c.seed = 0
    c.timed_runs = 3  # timed generate calls per mode, after one that compiles; the fastest is reported
    c.run_dir = ""  # unused by generation; set by the sweep runner
    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
    return c


def get_sweep(preset: str = "tiny") -> list[dict]:
    """Decode throughput over batch size and temperature (see experiments/sweep.py)."""
    del preset
    return grid(batch_size=[1, 8], temperature=[0.0, 1.0])
