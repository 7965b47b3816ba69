"""Trained drafters on disk, for whoever decodes with one (rollout engine, RL warm start).

An export directory is a `checkpoint.Checkpointer` root (orbax, integrity manifests): each
step holds the drafter parameters only (the target's embedding, final norm and LM head are
never stored) and a JSON meta with the DrafterConfig, the target's ModelConfig and a
fingerprint of the target's weights. Exports of later steps go to the same directory; loading
takes the newest step that verifies. Parameters come back as host numpy arrays, like
`hf_io.load_hf`'s.

A drafter that SGLang and vLLM compute exactly (`DrafterConfig(layout="eagle")`, unfused) is
also written to <export>/eagle in their EAGLE format (`eagle_io`: config.json and
model.safetensors), the step last saved; any other gets a warning saying why not.
`load_drafter` reads such a directory too (ours or a released one, e.g. fastrl's), told apart
by its config.json.
"""
from __future__ import annotations

import dataclasses
import os

import jax
from absl import logging

from tlt_jax import checkpoint, sharding
from tlt_jax.models import drafter as drafter_lib
from tlt_jax.models import eagle_io
from tlt_jax.models.config import ModelConfig, from_config_dict

FORMAT = "tlt_jax.drafter/1"
EAGLE_DIR = "eagle"  # the EAGLE-format copy inside an export
# Precision may differ between the target a drafter was trained with and the one it serves.
_PRECISION_FIELDS = ("param_dtype", "dtype")


def save_drafter(path: str | os.PathLike, drafter_params, drafter_config: drafter_lib.DrafterConfig,
                 target_config: ModelConfig, target_fingerprint: str, *, step: int = 0) -> None:
    """Writes the drafter as export step `step` under `path` (collective under multi-host).

    target_fingerprint: of the target weights it was trained against
    (`fingerprint.fingerprint_arrays(target_params)`).
    """
    drafter_lib.check_drafter_params(drafter_params, target_config, drafter_config)
    meta = {"format": FORMAT, "drafter_config": dataclasses.asdict(drafter_config),
            "target_config": dataclasses.asdict(target_config), "target_fingerprint": target_fingerprint}
    host = jax.tree.map(sharding.to_host, drafter_params)
    with checkpoint.Checkpointer(path, max_to_keep=2, async_save=False) as ckpt:
        ckpt.save(step, host, meta)
    if jax.process_index() != 0:
        return
    problem = eagle_io.export_problem(drafter_config, target_config)
    if problem:
        logging.warning("No EAGLE-format copy of the drafter in %s (for SGLang / vLLM): %s.", path, problem)
    else:
        eagle_io.save_eagle_drafter(os.path.join(path, EAGLE_DIR), host, drafter_config, target_config)


def load_drafter(path: str | os.PathLike, target_config: ModelConfig | None = None, *,
                 target_fingerprint: str | None = None):
    """(drafter_config, drafter_params as host numpy arrays) of the newest good export, or
    of an EAGLE-format directory (`eagle_io.load_eagle_drafter`).

    target_config: the target it will draft for; a target other than the one it was trained
    for raises ValueError naming the differing fields. target_fingerprint: the weights it will
    draft for; other weights than the training target's (an RL-updated target) only warn, as
    the drafter still fits and merely accepts less until retrained (an EAGLE-format directory
    records none).
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"No drafter export at {path!r}; `python -m experiments.train_drafter` writes one "
                                "to <run_dir>/drafter.")
    if eagle_io.is_eagle_checkpoint(path):
        return eagle_io.load_eagle_drafter(path, target_config)
    with checkpoint.Checkpointer(path, max_to_keep=2) as ckpt:
        params, meta = ckpt.restore()
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path!r} is a checkpoint but not a drafter export (format {meta.get('format')!r}, "
                         f"expected {FORMAT!r}).")
    config = drafter_lib.DrafterConfig(**meta["drafter_config"])
    trained_for = from_config_dict(meta["target_config"])
    if target_config is not None:
        differ = eagle_io.config_differences(trained_for, target_config, _PRECISION_FIELDS)
        if differ:
            raise ValueError(f"The drafter at {path!r} was trained for another target model ({'; '.join(differ)}). "
                             "Load it with the target it was trained for, or train a drafter for this target "
                             "(python -m experiments.train_drafter --config.target_dir=...).")
    drafter_lib.check_drafter_params(params, target_config or trained_for, config)
    if target_fingerprint is not None and target_fingerprint != meta["target_fingerprint"]:
        logging.warning("The drafter at %s was trained against other weights of this target (%s, now %s); it "
                        "fits, but acceptance may be lower until it is retrained.", path,
                        meta["target_fingerprint"], target_fingerprint)
    return config, params
