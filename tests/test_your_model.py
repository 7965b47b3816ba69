"""Your model, your data, your reward: RL and SFT on a Qwen2 checkpoint written by
transformers with a BPE tokenizer trained here (a chat template, two end tokens), on
problems from a parquet file and from reasoning-gym; bad input refused in one line naming
the flag, before anything is written."""
import json
import os
import subprocess
import sys

import datasets
import numpy as np
import pytest

from configs import rl, sft
from tests.support.bpe_model import write_bpe_qwen2
from tlt_jax import evaluation
from tlt_jax.data import sources
from tlt_jax.data.prompts import PromptFormat
from tlt_jax.rl import loop as loop_lib
from tlt_jax.rl import train as rl_train
from tlt_jax.rollout.engine import Rollouts
from tlt_jax.rollout.timeline import RolloutTimeline
from tlt_jax.sft import train_sft
from tlt_jax.tokenizer import load_tokenizer

pytestmark = pytest.mark.costly  # an RL run and an SFT run on a model written by transformers
ROWS = [{"data_source": "toy_math", "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
         "reward_model": {"style": "rule", "ground_truth": str(2 * i)}, "extra_info": {"index": i}}
        for i in range(40)]
SMALL = {"rollout.num_slots": 16, "rollout.max_prompt_length": 96, "rollout.max_tokens": 16,
         "prompts_per_step": 4, "num_samples": 4, "learner.micro_batch_size": 8, "steps": 2, "eval_every": 2,
         "checkpoint_every": 2, "data.num_eval": 8, "tlt.drafter.seq_len": 64,
         # One rollout group and one attention bucket: each more would compile every chunk
         # again (the two groups' runs and the buckets are the engine tests' to check).
         "mesh.data": 1, "mesh.fsdp": 8, "rollout.kv_bucket": 0,
         # one drafting strategy beside plain decode: TLT's path at a fraction of the compiles
         "tlt.tuner.buckets": [1], "tlt.tuner.arms": [["eagle-d3", "plain"]]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_bpe_qwen2(str(tmp_path_factory.mktemp("qwen2_bpe")), max_position_embeddings=320)


@pytest.fixture(scope="module")
def parquet(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("data") / "train.parquet")
    datasets.Dataset.from_list(ROWS).to_parquet(path)
    return path


def _set(c, overrides):
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        target = c
        for part in parents:
            target = target[part]
        target[leaf] = value
    return c


def _hf_config(model_dir, parquet, run_dir, **extra):
    c = rl.get_config("hf")
    c.model_dir, c.run_dir = model_dir, str(run_dir)
    c.data.update(train=parquet, eval=parquet, prompt_field="prompt", answer_field="reward_model.ground_truth")
    return _set(c, {**SMALL, **extra})


def test_rl_on_a_parquet_file_with_the_chat_template_and_math_reward(model_dir, parquet, tmp_path):
    """Two GRPO steps with TLT on; eval_samples.jsonl holds every evaluated sample with its
    prompt exactly as the chat template made it."""
    config = _hf_config(model_dir, parquet, tmp_path / "rl")
    summary = rl_train.train_rl(config, progress=False)
    assert summary["steps"] == 2 and summary["reward_failures"] == 0
    assert summary["dropped_prompts"] == {"train": 0, "eval": 0}
    assert 0.0 <= summary["final_eval_truncated_share"] <= 1.0
    samples = [json.loads(line) for line in open(tmp_path / "rl" / "eval_samples.jsonl")]
    assert sorted({s["step"] for s in samples}) == [0, 2] and len(samples) == 2 * 8
    tokenizer = load_tokenizer(model_dir)
    templated = tokenizer.apply_chat_template(ROWS[0]["prompt"], add_generation_prompt=True, tokenize=False)
    first = samples[0]
    assert set(first) == {"step", "prompt", "completion", "reference", "reward", "length", "finish_reason", "ended"}
    assert first["prompt"] == templated and first["reference"] == "0"
    assert all(s["ended"] == (s["finish_reason"] in ("eos", "stop")) for s in samples)
    assert os.path.isdir(tmp_path / "rl" / "drafter") and os.path.isdir(tmp_path / "rl" / "hf")
    exported = json.load(open(tmp_path / "rl" / "hf" / "generation_config.json"))
    assert exported["eos_token_id"] == tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])


def test_every_end_token_ends_a_sample_for_the_learner(model_dir):
    """Samples that end on either end token are cut there in text and scored through it by
    the learner (the end token is a target of the loss mask)."""
    tokenizer = load_tokenizer(model_dir)
    ends = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    answer = tokenizer("<answer>4</answer>", add_special_tokens=False)["input_ids"]
    tokens = [np.asarray(answer + [end], np.int32) for end in ends]
    rollouts = Rollouts(prompt_index=np.zeros(2, np.int32), sample_index=np.arange(2, dtype=np.int32),
                        tokens=tokens, logprobs=[np.zeros(len(t), np.float32) for t in tokens],
                        finish_reason=["eos", "eos"], group=np.zeros(2, np.int32), timeline=RolloutTimeline([]))
    assert evaluation.decode_completions(tokenizer, tokens, ends) == ["<answer>4</answer>"] * 2
    prompt = PromptFormat(chat_template=True).ids(tokenizer, "What is 2 + 2?")
    batch, _ = loop_lib.build_batch([prompt], rollouts, np.ones(2, np.float32), 160, tokenizer.pad_token_id)
    for i, end in enumerate(ends):
        row = np.flatnonzero(batch["segment_ids"][0] == i + 1)
        assert batch["tokens"][0, row[-1]] == end
        assert batch["loss_mask"][0, row[-1] - 1]  # the last position of the sample predicts its end token


def test_sft_on_reasoning_gym_in_the_chat_template(model_dir, tmp_path):
    pytest.importorskip("reasoning_gym")
    c = sft.get_config("hf")
    c.model_dir, c.run_dir = model_dir, str(tmp_path / "sft")
    c.data.update(source="reasoning_gym:leg_counting,basic_arithmetic", num_train=64, num_eval=8, seq_len=320)
    c.eval.update(num_slots=8, max_prompt_length=256)
    c.update(steps=2, eval_every=2, checkpoint_every=2, batch_size=8)
    c.mesh.update(data=1, fsdp=8)  # one eval engine group: a second compiles every chunk again
    result = train_sft(c, progress=False)
    assert np.isfinite(result["loss"]) and "eval_accuracy" in result
    samples = [json.loads(line) for line in open(tmp_path / "sft" / "eval_samples.jsonl")]
    assert len(samples) == 8 and all(s["prompt"].endswith("<|im_start|>assistant\n") for s in samples)
    assert os.path.isfile(tmp_path / "sft" / "hf" / "model.safetensors")


def _bad(model, parquet, tmp_path, overrides: dict):
    return _set(_hf_config(model, parquet, tmp_path / "never"), overrides)


def test_bad_input_is_one_line_naming_the_flag(model_dir, parquet, tmp_path):
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(open(os.path.join(model_dir, "config.json")).read())
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        os.link(os.path.join(model_dir, name), no_tokenizer / name)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    for name in os.listdir(model_dir):
        os.link(os.path.join(model_dir, name), gpt2 / name)
    hf = json.load(open(os.path.join(model_dir, "config.json")))
    os.unlink(gpt2 / "config.json")
    (gpt2 / "config.json").write_text(json.dumps({**hf, "model_type": "gpt2"}))
    cases = [
        ({"model_dir": str(no_weights)}, FileNotFoundError, "--config.model_dir=.* has no weights"),
        ({"model_dir": str(no_tokenizer)}, FileNotFoundError, "--config.model_dir=.* has no tokenizer"),
        ({"model_dir": str(gpt2)}, ValueError, "--config.model_dir=.*: Unsupported model_type 'gpt2'; "
                                                "supported: LlamaForCausalLM"),
        ({"data.train": str(tmp_path / "missing.parquet")}, FileNotFoundError, "data.train=.*does not exist"),
        ({"data.answer_field": "reward_model.truth"}, ValueError,
         "data.answer_field='reward_model.truth' is not a field of data.train; its fields: data_source, prompt"),
        ({"rollout.max_prompt_length": 8}, ValueError, "Every prompt of data.train .* longer than "
                                                      "rollout.max_prompt_length=8"),
        ({"data.chat_template": False}, ValueError, "conversation .* data.chat_template=False"),
        ({"reward": "no_such_reward"}, ValueError, "reward='no_such_reward'"),
        ({"reward": "no_such_module:fn"}, ImportError, "reward='no_such_module:fn'"),
        ({"reward": "task"}, ValueError, "reward='task' scores the synthetic tasks"),
        ({"rollout.max_tokens": 512}, ValueError,
         r"max_prompt_length \+ rollout.max_tokens = 608 is beyond the 320 positions"),
    ]
    for overrides, error, message in cases:
        with pytest.raises(error, match=message):
            rl_train.check_config(_bad(model_dir, parquet, tmp_path, overrides))
    with pytest.raises(ValueError, match="--config.model_dir is required"):
        rl_train.check_config(_bad(model_dir, parquet, tmp_path, {"model_dir": ""}))
    assert not (tmp_path / "never").exists()


def test_the_launcher_refuses_bad_data_before_writing(model_dir, parquet, tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "experiments.train_rl", "--config=configs/rl.py:hf",
                          f"--config.model_dir={model_dir}", f"--config.data.train={parquet}",
                          f"--config.data.eval={tmp_path / 'typo.jsonl'}", f"--config.run_dir={run_dir}",
                          "--config.rollout.max_prompt_length=96", "--config.rollout.max_tokens=16",
                          "--config.data.answer_field=reward_model.ground_truth"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert out.stderr.startswith("Error: data.eval=") and "does not exist" in out.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize("preset,columns", [
    ("qwen2.5-math-1.5b-gsm8k", {"question": "Tom has 3 apples and buys 4. How many now?",
                                 "answer": "3 + 4 = 7\n#### 7"}),
    ("qwen2.5-7b-math", {"problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "solution": "$\\boxed{\\frac{3}{4}}$"}),
])
def test_the_gpu_presets_take_their_documented_layouts(tmp_path_factory, preset, columns):
    """docs/your_model.md's commands: the preset, model_dir and the two files, nothing else."""
    model = write_bpe_qwen2(str(tmp_path_factory.mktemp("long_context")), max_position_embeddings=4096)
    path = str(tmp_path_factory.mktemp("layout") / "rows.parquet")
    datasets.Dataset.from_list([columns] * 4).to_parquet(path)
    c = rl.get_config(preset)
    c.model_dir = model
    c.data.update(train=path, eval=path)
    rl_train.check_config(c)
    problems = sources.problems_for(model, c.data, c.rollout.max_prompt_length)
    assert problems.train[0].answer == list(columns.values())[1]
    assert problems.prompt_format.example_text(load_tokenizer(model), problems.train[0]).startswith(
        "<|im_start|>system\nPlease reason step by step")
