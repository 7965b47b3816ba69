"""Where a run's problems come from: a config's `data` section, whatever its source.

  data.source = "tasks"                 the synthetic generators of `data.tasks` (tasks.py)
                "files"                 `data.train` / `data.eval`: files or save_to_disk
                                        directories (files.py), columns by
                                        `data.prompt_field` / `answer_field` / `response_field`
                "reasoning_gym:NAME..." procedural problems (reasoning_gym_problems.py)

`load_problems` returns both splits as sequences of `tasks.Example` with every prompt
measured in the model's own format (`prompts.PromptFormat`): prompts longer than the
rollout's `max_prompt_length` are dropped and counted per split, never truncated.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Sequence

from tlt_jax.data import files, prompts, reasoning_gym_problems, tasks

SOURCES = ("tasks", "files", reasoning_gym_problems.PREFIX + "NAME[=WEIGHT],...")


@dataclasses.dataclass
class Problems:
    train: Sequence[tasks.Example]
    eval: Sequence[tasks.Example]
    dropped: dict[str, int]  # split -> prompts dropped as longer than max_prompt_length
    prompt_format: prompts.PromptFormat


def kind(data_config) -> str:
    """"tasks", "files" or "reasoning_gym" (ValueError naming data.source otherwise)."""
    source = data_config.get("source", "tasks")
    if source in ("tasks", "files"):
        return source
    if isinstance(source, str) and source.startswith(reasoning_gym_problems.PREFIX):
        return "reasoning_gym"
    raise ValueError(f"data.source={source!r}; choose one of {', '.join(SOURCES)}.")


def correctness_reward(data_config, reward: str) -> str:
    """The reward whose mean is a run's accuracy: the tasks' own answer checker for the
    synthetic tasks (the training reward may give partial credit for the format), the
    training reward itself for every other source."""
    return "answer_correctness" if kind(data_config) == "tasks" else reward


def default_reward(data_config) -> str:
    """The verifier a source is scored with unless the config names one: the tasks' own
    checkers, reasoning-gym's `score_answer`, math-verify for files."""
    return {"tasks": "task", "reasoning_gym": "reasoning_gym", "files": "math"}[kind(data_config)]


def check_reward(data_config, reward: str) -> None:
    """The synthetic tasks' rewards read the tasks' answer format and checkers."""
    if kind(data_config) != "tasks" and reward in ("task", "answer_correctness", "format"):
        raise ValueError(f"reward={reward!r} scores the synthetic tasks' format; with data.source="
                         f"{data_config.source!r} choose math, gsm8k, reasoning_gym, code or module.path:function.")


def _filter(examples: list[tasks.Example], prompt_ids, max_prompt_length: int, what: str) -> tuple[list, int]:
    if max_prompt_length <= 0:
        return examples, 0
    kept = [e for e in examples if len(prompt_ids(e)) <= max_prompt_length]
    if not kept:
        raise ValueError(f"Every prompt of the {what} split is longer than rollout.max_prompt_length="
                         f"{max_prompt_length} tokens; raise rollout.max_prompt_length.")
    return kept, len(examples) - len(kept)


def load_problems(data_config, *, tokenizer, max_prompt_length: int = 0) -> Problems:
    """Both splits of the config's source, formatted for `tokenizer` (see the module doc).
    data_config fields: source, tasks, num_train, num_eval, seed, train, eval, prompt_field,
    answer_field, response_field, chat_template, system_prompt, prompt_template."""
    fmt = prompts.PromptFormat.from_config(data_config)
    fmt.check(tokenizer)
    prompt_ids = lambda example: fmt.example_ids(tokenizer, example)
    source = kind(data_config)
    num_train, num_eval, seed = data_config.num_train, data_config.num_eval, data_config.get("seed", 0)
    if source == "files":
        get = lambda name, default="": data_config.get(name, default) or default
        splits = {}
        for split, flag in (("train", "data.train"), ("eval", "data.eval")):
            table = files.load_table(get(split), flag)
            splits[split] = files.FileProblems(
                table, prompt_field=get("prompt_field", "prompt"),
                answer_field=data_config.get("answer_field", "answer"),  # "": none (code rows carry tests)
                response_field=get("response_field"), prompt_ids=prompt_ids, max_prompt_length=max_prompt_length,
                limit=num_train if split == "train" else num_eval, flag=flag)
        return Problems(splits["train"], splits["eval"], {k: v.dropped for k, v in splits.items()}, fmt)
    if source == "tasks":
        task = tasks.from_spec(data_config.tasks.to_dict())
        train = tasks.make_split(task, "train", num_train, seed)
        eval_ = tasks.make_split(task, "eval", num_eval, seed, unique=True)
    else:
        train = reasoning_gym_problems.make_split(data_config.source, "train", num_train, seed)
        eval_ = reasoning_gym_problems.make_split(data_config.source, "eval", num_eval, seed, unique=True)
    train, dropped_train = _filter(train, prompt_ids, max_prompt_length, "train")
    eval_, dropped_eval = _filter(eval_, prompt_ids, max_prompt_length, "eval")
    return Problems(train, eval_, {"train": dropped_train, "eval": dropped_eval}, fmt)


def problems_for(model_dir: str, data_config, max_prompt_length: int = 0) -> Problems:
    """`load_problems` in the prompt format of model_dir's tokenizer, once per process and
    arguments: a launcher's input check loads them (bad data fails before its run
    directory is written) and the run takes the same ones."""
    return _problems_for(model_dir, data_config.to_json(), max_prompt_length)


@functools.lru_cache(maxsize=2)
def _problems_for(model_dir: str, data_json: str, max_prompt_length: int) -> Problems:
    import ml_collections

    from tlt_jax.tokenizer import load_tokenizer

    return load_problems(ml_collections.ConfigDict(json.loads(data_json)), tokenizer=load_tokenizer(model_dir),
                         max_prompt_length=max_prompt_length)
