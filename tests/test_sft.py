"""SFT: packing layout and a trainer that learns."""
import jax
import numpy as np
import pytest

from tlt_jax import sharding
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import ModelConfig
from tlt_jax.rl import tasks
from tlt_jax.rl.sft import SFTTrainer, pack_examples
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


def test_trainer_fits_a_batch(tokenizer):
    cfg = ModelConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=16)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 4})
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
