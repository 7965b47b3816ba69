"""A tiny deterministic trainer that checkpoints every step, for tests/test_checkpoint.py.

Linear regression by SGD with momentum under dropout: the state holds params, optimizer
state, a bf16 reference copy and a PRNG key, all on a 2x4 mesh; the meta holds the data
position. Run as `python -m tests.support.checkpoint_worker DIR` from the repository root: it
trains NUM_STEPS steps, saving after each, unless killed first.
"""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tlt_jax.checkpoint import Checkpointer

NUM_STEPS = 24
NUM_ROWS, BATCH, FEATURES, OUTPUTS = 96, 8, 16, 8
LEARNING_RATE, MOMENTUM, KEEP_PROB, REFERENCE_WEIGHT = 0.05, 0.9, 0.8, 1e-2
STEP_PAUSE_S = 0.02  # keeps the run going well past the step the test kills it at


def make_mesh() -> Mesh:
    return Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))


def dataset() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x_ND = rng.normal(size=(NUM_ROWS, FEATURES)).astype(np.float32)
    w_true_DO = rng.normal(size=(FEATURES, OUTPUTS)).astype(np.float32)
    return x_ND, x_ND @ w_true_DO


def initial_state(mesh: Mesh) -> tuple[dict, dict]:
    """(state, meta) before step 1."""
    w_DO = jax.device_put(0.1 * jnp.ones((FEATURES, OUTPUTS), jnp.float32),
                          NamedSharding(mesh, P("data", "fsdp")))
    state = {"params": {"w": w_DO},
             "momentum": {"w": jnp.zeros_like(w_DO)},
             "reference": {"w": w_DO.astype(jnp.bfloat16)},
             "key": jax.device_put(jax.random.key(0), NamedSharding(mesh, P()))}
    return state, {"data_position": 0}


@jax.jit
def train_step(state: dict, x_BD: jax.Array, y_BO: jax.Array) -> tuple[dict, jax.Array]:
    key, dropout_key = jax.random.split(state["key"])
    keep_BD = jax.random.bernoulli(dropout_key, KEEP_PROB, x_BD.shape)
    reference_DO = state["reference"]["w"].astype(jnp.float32)

    def loss_fn(w_DO):
        prediction_BO = (jnp.where(keep_BD, x_BD, 0.0) / KEEP_PROB) @ w_DO
        return (jnp.mean((prediction_BO - y_BO) ** 2)
                + REFERENCE_WEIGHT * jnp.mean((w_DO - reference_DO) ** 2))

    loss, grad_DO = jax.value_and_grad(loss_fn)(state["params"]["w"])
    momentum_DO = MOMENTUM * state["momentum"]["w"] + grad_DO
    new_state = {"params": {"w": state["params"]["w"] - LEARNING_RATE * momentum_DO},
                 "momentum": {"w": momentum_DO},
                 "reference": state["reference"],
                 "key": key}
    return new_state, loss


def train(state: dict, meta: dict, last_step: int, checkpointer: Checkpointer | None = None,
          pause_s: float = 0.0) -> tuple[dict, dict[int, float]]:
    """Runs steps meta.get("step", 0) + 1 .. last_step; returns the state and loss per step."""
    x_ND, y_NO = dataset()
    data_position = meta["data_position"]
    losses = {}
    for step in range(meta.get("step", 0) + 1, last_step + 1):
        rows_B = (data_position + np.arange(BATCH)) % NUM_ROWS
        state, loss = train_step(state, x_ND[rows_B], y_NO[rows_B])
        data_position += BATCH
        losses[step] = float(loss)
        if checkpointer is not None:
            checkpointer.save(step, state, {"data_position": data_position, "loss": losses[step]})
        time.sleep(pause_s)
    return state, losses


def main(directory: str) -> None:
    state, meta = initial_state(make_mesh())
    with Checkpointer(directory) as checkpointer:
        train(state, meta, NUM_STEPS, checkpointer, pause_s=STEP_PAUSE_S)


if __name__ == "__main__":
    main(sys.argv[1])
