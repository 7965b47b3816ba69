"""Helpers shared by config files, and the synthetic task mixes the presets train on."""
import itertools

import ml_collections


def grid(**axes) -> list[dict]:
    """Cartesian product of overrides: grid(lr=[1e-4, 3e-4], seed=[0, 1]) -> four dicts."""
    keys = list(axes)
    return [dict(zip(keys, values)) for values in itertools.product(*(axes[k] for k in keys))]


def tasks_tiny():
    """Schoolbook additions of up to 8 digits (Zipf-distributed digit counts): a problem
    space large enough that held-out problems test the procedure, not memory."""
    return ml_collections.ConfigDict({"addition": {"weight": 1.0, "max_digits": 8, "digits_zipf": 1.6}})


def tasks_long_tail():
    """Additions of up to 32 digits, most short (median answer 32 characters) and a few
    up to 270: per RL step of 64 samples the longest runs about 6x the median, the long
    tail of reasoning traces that speculation is for."""
    return ml_collections.ConfigDict({"addition": {"weight": 1.0, "max_digits": 32, "digits_zipf": 1.6}})


def data_config(**overrides) -> ml_collections.ConfigDict:
    """A `data` section with every field `tlt_jax.data.sources` reads (source, synthetic
    tasks, files and their columns, prompt format); `overrides` set some of them."""
    fields = dict(source="tasks", tasks=tasks_tiny(), num_train=20000, num_eval=256, seed=0, train="", eval="",
                  prompt_field="prompt", answer_field="answer", response_field="", chat_template=False,
                  system_prompt="", prompt_template="{prompt}")
    unknown = sorted(set(overrides) - set(fields) - {"seq_len"})
    if unknown:
        raise KeyError(f"Unknown data fields {unknown}.")
    return ml_collections.ConfigDict({**fields, **overrides})
