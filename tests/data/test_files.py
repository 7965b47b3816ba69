"""Problems from files: every format `datasets` reads, nested fields, conversations, other
columns as reward fields, long prompts dropped and counted, errors that name the flag."""
import json

import datasets
import pytest

from tlt_jax.data import files, tasks
from tlt_jax.data.prompts import PromptFormat

GSM8K = [{"question": f"Tom has {i} apples and buys {i + 1}. How many now?",
          "answer": f"{i} + {i + 1} = {2 * i + 1}\n#### {2 * i + 1}"} for i in range(6)]
VERL = [{"data_source": "openai/gsm8k", "ability": "math",
         "prompt": [{"role": "user", "content": row["question"]}],
         "reward_model": {"style": "rule", "ground_truth": str(2 * i + 1)},
         "extra_info": {"index": i}} for i, row in enumerate(GSM8K)]


def _write(rows, tmp_path, fmt: str) -> str:
    table = datasets.Dataset.from_list(rows)
    path = str(tmp_path / f"rows.{fmt}")
    if fmt == "jsonl":
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    elif fmt == "json":
        with open(path, "w") as f:
            json.dump(rows, f)
    elif fmt == "parquet":
        table.to_parquet(path)
    elif fmt == "csv":
        table.to_csv(path, index=False)
    else:
        path = str(tmp_path / "saved")
        table.save_to_disk(path)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "save_to_disk"])
def test_gsm8k_rows_in_every_format(tmp_path, fmt):
    problems = files.FileProblems(files.load_table(_write(GSM8K, tmp_path, fmt), "data.train"),
                                  prompt_field="question", answer_field="answer")
    assert len(problems) == len(GSM8K)
    for row, example in zip(GSM8K, problems):
        assert example.prompt == row["question"] and example.answer == row["answer"]
        assert example.solution == row["answer"]  # SFT's target defaults to the answer field


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "save_to_disk"])
def test_verl_rows_nested_fields_and_conversations(tmp_path, fmt):
    problems = files.FileProblems(files.load_table(_write(VERL, tmp_path, fmt), "data.train"),
                                  prompt_field="prompt", answer_field="reward_model.ground_truth")
    example = problems[2]
    assert example.prompt == ({"role": "user", "content": GSM8K[2]["question"]},)
    assert example.answer == "5" and example.task == "openai/gsm8k"
    fields = tasks.reward_fields([problems[0], problems[1]])
    assert fields["answer"] == ["1", "3"] and fields["ability"] == ["math", "math"]
    assert fields["extra_info"] == [{"index": 0}, {"index": 1}] and "prompt" not in fields


def test_missing_file_and_field_errors_name_the_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.eval='.*nope.jsonl' does not exist"):
        files.load_table(str(tmp_path / "nope.jsonl"), "data.eval")
    (tmp_path / "rows.txt").write_text("x")
    with pytest.raises(ValueError, match="unknown file type"):
        files.load_table(str(tmp_path / "rows.txt"), "data.train")
    table = files.load_table(_write(VERL, tmp_path, "jsonl"), "data.train")
    with pytest.raises(ValueError, match=r"data.answer_field='reward_model.truth' is not a field of data.train; "
                                         r"its fields: data_source, ability, prompt, reward_model, "
                                         r"reward_model.style, reward_model.ground_truth, extra_info"):
        files.FileProblems(table, prompt_field="prompt", answer_field="reward_model.truth")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM8K)})
    splits.save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ValueError, match="holds the splits"):
        files.load_table(str(tmp_path / "dict"), "data.train")


def test_long_prompts_are_dropped_and_counted(tmp_path):
    tok = tasks.build_task_tokenizer(str(tmp_path / "tok"))
    rows = [{"prompt": "add 1+2\n", "answer": "3"}, {"prompt": "add 12345+67890\n", "answer": "80235"},
            {"prompt": "add 3+4\n", "answer": "7"}]
    table = files.load_table(_write(rows, tmp_path, "jsonl"), "data.train")
    fmt = PromptFormat()
    ids = lambda e: fmt.example_ids(tok, e)
    problems = files.FileProblems(table, prompt_field="prompt", answer_field="answer", prompt_ids=ids,
                                  max_prompt_length=10)
    assert problems.dropped == 1 and [e.answer for e in problems] == ["3", "7"]
    with pytest.raises(ValueError, match="longer than rollout.max_prompt_length=3"):
        files.FileProblems(table, prompt_field="prompt", answer_field="answer", prompt_ids=ids, max_prompt_length=3)
