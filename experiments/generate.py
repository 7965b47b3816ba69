r"""Generate from a model preset or a Hugging Face checkpoint and report tokens/s, with and
without speculation (the drafter trained during RL is a free by-product for inference).

  python -m experiments.generate --config=configs/generate.py:tiny
  python -m experiments.generate --target=assets/sft_tiny --drafter=runs/drafter_tiny/drafter \
      --prompt="add 123+456"
  python -m experiments.generate --target=/path/to/ckpt --strategy=ngram-d4-b2   # no drafter needed
"""
import json
import os

import jax
from absl import flags
from ml_collections import config_flags

from tlt_jax import launch, sampling, sharding
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import from_config_dict
from tlt_jax.rollout.engine import RolloutConfig, RolloutEngine
from tlt_jax.rollout.speculative import FixedSpeculation, Strategy

_CONFIG = config_flags.DEFINE_config_file("config", "configs/generate.py:tiny", "Generation config.")
_TARGET = flags.DEFINE_string("target", None, "Shorthand for --config.hf_dir.")
_DRAFTER = flags.DEFINE_string("drafter", None, "Shorthand for --config.drafter_dir.")
_PROMPT = flags.DEFINE_string("prompt", None, "Shorthand for --config.prompt.")
_STRATEGY = flags.DEFINE_string("strategy", None, "Shorthand for --config.strategy.")


def _load(cfg):
    if cfg.hf_dir:
        from tlt_jax.models.hf_io import load_hf
        model_cfg, params = load_hf(cfg.hf_dir)
        tokenizer = None
        if os.path.exists(os.path.join(cfg.hf_dir, "tokenizer.json")):
            from tlt_jax.tokenizer import load_tokenizer
            tokenizer = load_tokenizer(cfg.hf_dir)
        return model_cfg, params, tokenizer
    model_cfg = from_config_dict(cfg.model)
    return model_cfg, tfm.init_params(model_cfg, jax.random.PRNGKey(cfg.seed)), None


def main(argv):
    del argv
    launch.maybe_initialize_distributed()
    cfg = _CONFIG.value
    for flag, field in ((_TARGET, "hf_dir"), (_DRAFTER, "drafter_dir"), (_PROMPT, "prompt"), (_STRATEGY, "strategy")):
        if flag.value is not None:
            cfg[field] = flag.value
    model_cfg, params, tokenizer = _load(cfg)
    drafter_cfg = drafter_params = None
    if cfg.drafter_dir:
        from tlt_jax.drafter_training.io import load_drafter
        drafter_cfg, drafter_params = load_drafter(cfg.drafter_dir, model_cfg)
    strategy = Strategy.from_name(cfg.strategy) if cfg.strategy else None
    if strategy is None and drafter_cfg is not None:
        strategy = Strategy("eagle", depth=4)
    mesh = sharding.make_mesh(cfg.mesh)
    prompt = tokenizer.encode(cfg.prompt) if tokenizer else list(cfg.prompt_ids)
    engine = RolloutEngine(model_cfg, params, mesh, RolloutConfig(
        num_slots=cfg.batch_size, max_prompt_length=len(prompt), max_length=len(prompt) + cfg.max_new_tokens + 1,
        eos_token_id=model_cfg.eos_token_id, max_draft_depth=max(8, strategy.depth if strategy else 0)),
        drafter_cfg, drafter_params)
    sp = sampling.SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                 max_tokens=cfg.max_new_tokens)
    key = jax.random.PRNGKey(cfg.seed)
    modes = [("plain", None)] + ([(strategy.name, FixedSpeculation(strategy, cfg.batch_size))] if strategy else [])
    for name, speculation in modes:
        engine.generate([prompt], cfg.batch_size, sp, key, speculation=speculation)  # compile outside the timing
        out = engine.generate([prompt], cfg.batch_size, sp, key, speculation=speculation)
        summary = out.timeline.summary()
        print(f"--- {name}")
        for tokens in out.tokens[: min(cfg.batch_size, 4)]:
            print(tokenizer.decode(tokens.tolist()) if tokenizer else tokens.tolist())
        print(json.dumps(dict(mode=name, batch_size=cfg.batch_size, prompt_tokens=len(prompt),
                              new_tokens=int(out.lengths.sum()), tokens_per_s=round(summary["tokens_per_s"], 1),
                              acceptance_length=round(summary["acceptance_length"], 2),
                              devices=jax.device_count(), backend=jax.default_backend())))


if __name__ == "__main__":
    launch.run(main)
