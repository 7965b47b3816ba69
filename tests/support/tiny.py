"""The tiny models the tests run, in one place: their configs (a test's own overrides on
top), parameters, and a rollout engine over them. Tests that take the same shapes trace the
same programs, which the persistent compilation cache then compiles once for all of them
(tests/conftest.py), so a test takes these shapes unless it needs others.

`config()`: the engine's and the learner's tests (4 query heads over 2 key-value heads of 8).
`policy_config(tokenizer)`: the RL, SFT and scoring tests' policy over a task tokenizer, the
warm start's shapes (2 query heads, 1 key-value head of 16).
`HF_SHAPES`: the checkpoint-format tests' models."""
import jax

from tlt_jax import sharding
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import ModelConfig
from tlt_jax.rollout.engine import RolloutConfig, RolloutEngine

SHAPES = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=8)
POLICY_SHAPES = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)
# The Hugging Face checkpoints' tests (hf_io, eagle_io, nnx): an odd vocabulary and an MLP width
# other than twice the hidden size, so that no transposed or swapped weight loads by its shape.
HF_SHAPES = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)


def config(**overrides) -> ModelConfig:
    """The tiny model; `overrides` name the fields a test needs otherwise (e.g. vocab_size,
    num_layers=3 for a drafter's fused features)."""
    return ModelConfig(**{**SHAPES, **overrides})


def policy_config(tokenizer=None, **overrides) -> ModelConfig:
    """The tiny policy: POLICY_SHAPES over `tokenizer`'s vocabulary, begin and end tokens
    (without one, `overrides` give the vocabulary)."""
    if tokenizer is not None:
        overrides = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **overrides)
    return ModelConfig(**{**POLICY_SHAPES, **overrides})


def params(cfg: ModelConfig, seed: int = 0, init_std: float = 0.3):
    """Random parameters of `cfg`; a wide init (0.3) spreads the next-token distribution, so
    samples vary."""
    return tfm.init_params(cfg, jax.random.PRNGKey(seed), init_std=init_std)


def engine(cfg: ModelConfig, params, num_slots: int = 4, *, data: int = 1, tensor: int = 1, drafter_config=None,
           drafter_params=None, **rollout) -> RolloutEngine:
    """A rollout engine over the first data x tensor devices. `rollout` sets RolloutConfig's
    fields; unless given: prompts up to 6 tokens, token 0 ends a sample, 8 steps a sync."""
    mesh = sharding.make_mesh({"data": data, "tensor": tensor}, jax.devices()[:data * tensor])
    rc = RolloutConfig(**{"num_slots": num_slots, "max_prompt_length": 6, "eos_token_id": 0, "steps_per_sync": 8,
                          **rollout})
    return RolloutEngine(cfg, params, mesh, rc, drafter_config, drafter_params)
