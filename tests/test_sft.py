"""SFT: packing layout, a trainer that learns, exact resume, and the RL run's warm start."""
import jax
import numpy as np
import pytest

from configs import rl as rl_configs
from configs import sft as sft_configs
from tests.support import tiny
from tlt_jax import metrics, sharding
from tlt_jax import sft as sft_lib
from tlt_jax.data import tasks
from tlt_jax.data.packing import pack_examples
from tlt_jax.models import transformer as tfm
from tlt_jax.models.hf_io import load_hf
from tlt_jax.rl import train as rl_train
from tlt_jax.sft import SFTTrainer
from tlt_jax.train_state import OptimizerConfig


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tasks.build_task_tokenizer(str(tmp_path_factory.mktemp("tok")))


def test_packing_keeps_examples_apart(tokenizer):
    examples = tasks.make_split(tasks.get_task("addition", max_digits=3), "train", 30, seed=0)
    packed = pack_examples(tokenizer, examples, seq_len=64)
    tokens, seg, pos, mask = packed["tokens"], packed["segment_ids"], packed["positions"], packed["mask"]
    assert tokens.shape[1] == 64 and mask.shape == (tokens.shape[0], 63)
    flat = []
    for row in range(tokens.shape[0]):
        for s in range(1, seg[row].max() + 1):
            at = np.flatnonzero(seg[row] == s)
            ids = tokens[row, at].tolist()
            np.testing.assert_array_equal(pos[row, at], np.arange(len(at)))
            assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
            # Targets: exactly the solution and <eos>, predicted from within the segment.
            targets = [t for t in at[1:] if mask[row, t - 1]]
            want = tokenizer(examples[len(flat)].solution, add_special_tokens=False)["input_ids"]
            assert tokens[row, targets].tolist() == want + [tokenizer.eos_token_id]
            assert not mask[row, at[0] - 1] if at[0] > 0 else True
            flat.append(ids)
        assert (tokens[row, seg[row] == 0] == tokenizer.pad_token_id).all()
    assert len(flat) == len(examples)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trainer_fits_a_batch(tokenizer, dtype):
    """bfloat16: float32 master weights, bfloat16 compute (configs/sft.py:gpu), on one
    device: on 2 x 4 CPU devices XLA's bfloat16 program sometimes deadlocks in its
    collectives (all-gather and all-reduce of different device groups: jax 0.10's
    rendezvous aborts after 40 s), as no float32 one here does."""
    cfg = tiny.policy_config(vocab_size=len(tokenizer), dtype=dtype)
    mesh = (sharding.make_mesh({"data": 2, "fsdp": 4}) if dtype == "float32"
            else sharding.make_mesh({"data": 1, "fsdp": 1}, jax.devices()[:1]))
    trainer = SFTTrainer(cfg, OptimizerConfig(learning_rate=3e-3), mesh)
    state = trainer.init_state(tfm.init_params(cfg, jax.random.PRNGKey(0)))
    batch = pack_examples(tokenizer, tasks.make_split(tasks.get_task("addition", max_digits=2), "train", 40, seed=1),
                          seq_len=48)
    batch = {k: v[:8] for k, v in batch.items()}
    losses = []
    for _ in range(15):
        state, out = trainer.step(state, batch)
        losses.append(float(out["loss"]))
    assert losses[-1] < 0.75 * losses[0] and int(state.step) == 15


def _tiny_sft_config(run_dir, steps):
    c = sft_configs.get_config("tiny")
    c.model.update(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)
    c.data.update(tasks={"addition": {"weight": 1.0, "max_digits": 2}}, num_train=64, num_eval=4, seq_len=48)
    c.eval.update(num_slots=4, max_prompt_length=16)
    c.optimizer.update(warmup_steps=1, decay_steps=8)
    c.update(steps=steps, batch_size=8, eval_every=4, checkpoint_every=2, run_dir=str(run_dir))
    c.mesh.update(data=2, fsdp=4)
    return c


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in metrics.read_metrics(str(run_dir / "metrics.jsonl"))}


def test_sft_run_resumes_exactly_and_rl_builds_its_warm_start_from_it(tmp_path, monkeypatch):
    """An RL run whose model_dir is '' (it asks for a warm start) trains its SFT config (4
    steps) into its run directory once, and loads it; the same SFT run stopped after 2
    steps and run again to 4 ends with the same losses and weights. A given model_dir that
    does not exist is an error naming the flag, and trains nothing."""
    config = rl_configs.get_config("tiny")
    config.update(model_dir=str(tmp_path / "nowhere"), run_dir=str(tmp_path / "rl"))
    config.sft = _tiny_sft_config("", 4)
    with monkeypatch.context() as m:
        m.setattr(sft_lib, "train_sft", lambda *a, **k: pytest.fail("a mistyped model_dir trained a warm start"))
        with pytest.raises(FileNotFoundError, match=r"--config.model_dir='.*nowhere' does not exist.*model_dir=''"):
            rl_train.check_config(config)
        with pytest.raises(FileNotFoundError, match="--config.model_dir"):
            rl_train._warm_start(config)
    assert not (tmp_path / "rl").exists()
    config.model_dir = ""
    _, params, tokenizer, _ = rl_train._warm_start(config)
    full = _losses(tmp_path / "rl" / "sft")
    assert sorted(full) == [1, 2, 3, 4] and full[4] != full[2] and tokenizer.eos_token_id == 2
    _, written = load_hf(str(tmp_path / "rl" / "sft" / "hf"))
    jax.tree.map(np.testing.assert_array_equal, params, written)
    monkeypatch.setattr(sft_lib, "train_sft", lambda *a, **k: pytest.fail("the warm start was trained twice"))
    rl_train._warm_start(config)
    monkeypatch.undo()

    sft_lib.train_sft(_tiny_sft_config(tmp_path / "resumed", 2), progress=False)
    sft_lib.train_sft(_tiny_sft_config(tmp_path / "resumed", 4), progress=False)
    assert _losses(tmp_path / "resumed") == full
    _, resumed = load_hf(str(tmp_path / "resumed" / "hf"))
    jax.tree.map(np.testing.assert_array_equal, resumed, written)
