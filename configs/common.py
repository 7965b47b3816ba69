"""Helpers shared by config files."""
import itertools


def grid(**axes) -> list[dict]:
    """Cartesian product of overrides: grid(lr=[1e-4, 3e-4], seed=[0, 1]) -> four dicts."""
    keys = list(axes)
    return [dict(zip(keys, values)) for values in itertools.product(*(axes[k] for k in keys))]
