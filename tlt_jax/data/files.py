"""Problems from files on disk: JSONL, JSON, Parquet, CSV, or a `save_to_disk` directory.

Files are read with the `datasets` library, so rows stay in Arrow, memory-mapped, and are
turned into `tasks.Example`s one at a time when a step draws them: a million-row file
costs its Arrow cache on disk, not Python objects. Columns are named by dotted paths into
nested records (`reward_model.ground_truth`), which covers the usual layouts as they are:

  verl's parquet   prompt (a list of {role, content}: a conversation), data_source,
                   ability, reward_model {style, ground_truth}, extra_info
                   -> prompt_field="prompt", answer_field="reward_model.ground_truth"
  GSM8K            question, answer ("... #### 72")
                   -> prompt_field="question", answer_field="answer"

Of each row, the prompt field becomes `Example.prompt` (text, or a conversation), the
answer field `Example.answer` (the reference a reward checks), the response field (SFT's
target; default the answer field) `Example.solution`, `data_source` (when present)
`Example.task`, and every other top-level column `Example.fields` (they reach the reward
function as keyword fields). Rows whose formatted prompt is longer than the rollout's
`max_prompt_length` are dropped and counted (`FileProblems.dropped`), never truncated.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from tlt_jax.data import prompts, tasks

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_table(path: str, flag: str):
    """The rows of a file or `save_to_disk` directory, as a memory-mapped `datasets.Dataset`.
    Errors name `flag` (the config field that gave the path) and what it accepts."""
    import datasets

    datasets.disable_progress_bars()
    accepted = "a .jsonl, .json, .parquet or .csv file, or a directory written by datasets' save_to_disk"
    if not path:
        raise ValueError(f"{flag} is empty; give {accepted}.")
    if os.path.isdir(path):
        try:
            table = datasets.load_from_disk(path)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{flag}={path!r} is a directory that save_to_disk did not write ({e}); "
                                    f"give {accepted}.") from e
        if isinstance(table, datasets.DatasetDict):
            raise ValueError(f"{flag}={path!r} holds the splits {sorted(table)}; give one of them, e.g. "
                             f"{flag}={os.path.join(path, sorted(table)[0])}.")
        return table
    if not os.path.exists(path):
        raise FileNotFoundError(f"{flag}={path!r} does not exist; give {accepted}.")
    builder = FORMATS.get(os.path.splitext(path)[1].lower())
    if builder is None:
        raise ValueError(f"{flag}={path!r}: unknown file type; give {accepted}.")
    return datasets.load_dataset(builder, data_files=os.path.abspath(path), split="train")


def field_paths(row: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Every dotted path into a row's nested records (what a field name may say)."""
    paths = []
    for key, value in row.items():
        paths.append(prefix + key)
        if isinstance(value, Mapping):
            paths.extend(field_paths(value, prefix + key + "."))
    return paths


def get_field(row: Mapping[str, Any], path: str):
    """The value at a dotted path of a row (KeyError when absent)."""
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise KeyError(path)
        value = value[part]
    return value


def _answer_text(value) -> str:
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    return "" if value is None else str(value)


class FileProblems(Sequence[tasks.Example]):
    """The kept rows of a table as `tasks.Example`s, made on access (see the module doc).

    prompt_ids: `PromptFormat.example_ids` bound to the model's tokenizer, used to measure
    every prompt once; None keeps every row (lengths unchecked).
    """

    def __init__(self, table, *, prompt_field: str, answer_field: str, response_field: str = "",
                 prompt_ids: Callable[[tasks.Example], Sequence[int]] | None = None, max_prompt_length: int = 0,
                 limit: int = 0, flag: str = "data.train", name: str = "files"):
        self.table, self.flag, self.name = table, flag, name
        self.prompt_field, self.answer_field = prompt_field, answer_field
        self.response_field = response_field or answer_field
        if len(table) == 0:
            raise ValueError(f"{flag} has no rows.")
        first = table[0]
        known = field_paths(first)
        for config_name, path in (("data.prompt_field", self.prompt_field), ("data.answer_field", self.answer_field),
                                  ("data.response_field", self.response_field)):
            if path and path not in known:  # "": no such column (code datasets need no answer)
                raise ValueError(f"{config_name}={path!r} is not a field of {flag}; its fields: {', '.join(known)}.")
        self._prompt_column = self.prompt_field.split(".")[0]  # the other columns are reward fields
        rows = np.arange(len(table), dtype=np.int64)
        self.dropped = 0
        if prompt_ids is not None and max_prompt_length > 0:
            lengths = np.fromiter((len(prompt_ids(self._example(int(i)))) for i in rows), np.int64, len(rows))
            keep = lengths <= max_prompt_length
            self.dropped, rows = int((~keep).sum()), rows[keep]
            if not len(rows):
                raise ValueError(f"Every prompt of {flag} ({len(table)} rows) is longer than "
                                 f"rollout.max_prompt_length={max_prompt_length} tokens (the shortest has "
                                 f"{int(lengths.min())}); raise rollout.max_prompt_length.")
        self.rows = rows[:limit] if limit > 0 else rows

    def _example(self, row_index: int) -> tasks.Example:
        row = self.table[row_index]
        prompt = get_field(row, self.prompt_field)
        if prompt is None or (not isinstance(prompt, str) and not prompts.is_conversation(prompt)):
            raise ValueError(f"Row {row_index} of {self.flag}: data.prompt_field={self.prompt_field!r} holds "
                             f"{type(prompt).__name__}, neither text nor a list of {{role, content}} messages.")
        if not isinstance(prompt, str):
            prompt = tuple({"role": m["role"], "content": m["content"]} for m in prompt)
        fields = {k: v for k, v in row.items() if k != self._prompt_column}
        task = str(row.get("data_source") or self.name)
        text = lambda path: _answer_text(get_field(row, path)) if path else ""
        return tasks.Example(prompt=prompt, solution=text(self.response_field), answer=text(self.answer_field),
                             task=task, fields=fields)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._example(int(self.rows[i]))
