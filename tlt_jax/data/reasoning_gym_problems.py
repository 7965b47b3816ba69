"""Procedural reasoning environments from the `reasoning-gym` package (an optional extra).

`data.source=reasoning_gym:NAME`, or a weighted mixture `reasoning_gym:NAME1=0.7,NAME2=0.3`
(weights default to 1), draws problems from `reasoning_gym.create_dataset(NAME, size=,
seed=)`. Train and eval never share a problem: each problem belongs to one split by a
hash of its question (`tasks.split_of`, as for the synthetic tasks), whatever the seeds.
Each `Example` carries the package's entry (question, answer, metadata) as the field
`entry`, so the `reasoning_gym` reward scores it with that task's own `score_answer`.
"""
from __future__ import annotations

import numpy as np

from tlt_jax.data import tasks

PREFIX = "reasoning_gym:"
INSTALL_HINT = "pip install -e '.[envs]'"


def import_reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(f"reasoning-gym is not installed ({e}); it is an optional extra: {INSTALL_HINT}") from e
    return reasoning_gym


def parse_source(source: str) -> dict[str, float]:
    """NAME -> weight of `reasoning_gym:NAME1=w1,NAME2,...` (ValueError naming data.source)."""
    if not source.startswith(PREFIX) or not source[len(PREFIX):].strip():
        raise ValueError(f"data.source={source!r}: write reasoning_gym:NAME or reasoning_gym:NAME1=0.7,NAME2=0.3.")
    weights = {}
    for part in source[len(PREFIX):].split(","):
        name, _, weight = part.strip().partition("=")
        try:
            weights[name.strip()] = float(weight) if weight else 1.0
        except ValueError as e:
            raise ValueError(f"data.source={source!r}: the weight of {name!r} is not a number ({weight!r}).") from e
    if min(weights.values()) < 0 or sum(weights.values()) <= 0:
        raise ValueError(f"data.source={source!r}: weights must be >= 0 with a positive total.")
    rg = import_reasoning_gym()
    unknown = sorted(set(weights) - set(rg.factory.DATASETS))
    if unknown:
        raise ValueError(f"data.source={source!r}: unknown reasoning-gym task(s) {unknown}; the package has "
                         f"{len(rg.factory.DATASETS)}, e.g. {', '.join(sorted(rg.factory.DATASETS)[:8])}.")
    return weights


def _example(entry: dict, name: str) -> tasks.Example:
    return tasks.Example(prompt=entry["question"], solution=f"<answer>{entry['answer']}</answer>",
                         answer=str(entry["answer"]), task=name, fields={"entry": entry})


def make_split(source: str, split: str, n: int, seed: int = 0, unique: bool = False) -> list[tasks.Example]:
    """`n` problems of `split` ("train" or "eval") from the mixture, deterministic in
    (source, split, n, seed); SFT targets are the answers in reasoning-gym's
    <answer>...</answer> format."""
    if split not in tasks.SPLITS:
        raise ValueError(f"split must be one of {tasks.SPLITS}, got {split!r}.")
    weights = parse_source(source)
    rg = import_reasoning_gym()
    names = list(weights)
    probabilities = np.asarray([weights[k] for k in names], np.float64) / sum(weights.values())
    max_draws = 100 * n + 1000
    sets = {name: rg.create_dataset(name, size=max_draws, seed=seed * len(tasks.SPLITS) + tasks.SPLITS.index(split))
            for name in names}
    cursor = dict.fromkeys(names, 0)
    rng = np.random.default_rng([seed, tasks.SPLITS.index(split)])
    examples, seen = [], set()
    for _ in range(max_draws):
        if len(examples) == n:
            break
        name = names[int(rng.choice(len(names), p=probabilities))]
        if cursor[name] >= max_draws:
            break
        entry = sets[name][cursor[name]]
        cursor[name] += 1
        question = entry["question"]
        if tasks.split_of(question) == split and not (unique and question in seen):
            examples.append(_example(entry, name))
            seen.add(question)
    if len(examples) < n:
        raise RuntimeError(f"only {len(examples)} of {n} {split} problems in {max_draws} draws from {source}; "
                           "lower data.num_train / data.num_eval or add tasks.")
    return examples
