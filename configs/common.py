"""Helpers shared by config files."""
import itertools

import ml_collections


def grid(**axes) -> list[dict]:
    """Cartesian product of overrides: grid(lr=[1e-4, 3e-4], seed=[0, 1]) -> four dicts."""
    keys = list(axes)
    return [dict(zip(keys, values)) for values in itertools.product(*(axes[k] for k in keys))]


def data_config(**overrides) -> ml_collections.ConfigDict:
    """A `data` section with every field `tlt_jax.data.sources` reads (source, synthetic
    tasks, files and their columns, prompt format); `overrides` set some of them."""
    from configs import sft

    fields = dict(source="tasks", tasks=sft.tasks_tiny(), num_train=20000, num_eval=256, seed=0, train="", eval="",
                  prompt_field="prompt", answer_field="answer", response_field="", chat_template=False,
                  system_prompt="", prompt_template="{prompt}")
    unknown = sorted(set(overrides) - set(fields) - {"seq_len"})
    if unknown:
        raise KeyError(f"Unknown data fields {unknown}.")
    return ml_collections.ConfigDict({**fields, **overrides})
