r"""Generate from a model preset or a Hugging Face checkpoint and report tokens/s.

  python -m experiments.generate --config=configs/generate.py:tiny
  python -m experiments.generate --config=configs/generate.py --config.hf_dir=/path/to/ckpt
"""
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import config_flags

from tlt_jax import launch, sampling, sharding
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import from_config_dict

_CONFIG = config_flags.DEFINE_config_file("config", "configs/generate.py:tiny", "Generation config.")


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
    model_cfg, params, tokenizer = _load(cfg)
    mesh = sharding.make_mesh(cfg.mesh)
    params = sharding.shard_params(model_cfg, params, mesh)
    prompt = tokenizer.encode(cfg.prompt) if tokenizer else list(cfg.prompt_ids)
    b, p = cfg.batch_size, len(prompt)
    max_len = p + cfg.max_new_tokens
    sp = sampling.SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                 max_tokens=cfg.max_new_tokens)

    @jax.jit
    def start(params, tokens_BT, key):
        cache = tfm.init_cache(model_cfg, b, max_len)
        logits, _, cache = tfm.prefill(params, model_cfg, cache, tokens_BT, jnp.full((b,), p),
                                       return_logits=True)
        return sampling.sample(key, logits, sp)[0], cache

    @jax.jit
    def step(params, cache, token_B, key):
        logits, _, cache = tfm.decode(params, model_cfg, cache, token_B[:, None], cache.lengths[:, None],
                                      return_logits=True)
        return sampling.sample(key, logits[:, 0], sp)[0], cache

    keys = jax.random.split(jax.random.PRNGKey(cfg.seed), cfg.max_new_tokens)
    tokens_BT = jnp.asarray([prompt] * b, jnp.int32)
    token, cache = start(params, tokens_BT, keys[0])
    jax.block_until_ready(step(params, cache, token, keys[1]))  # compile outside the timing
    out = [token]
    t0 = time.perf_counter()
    for i in range(1, cfg.max_new_tokens):
        token, cache = step(params, cache, token, keys[i])
        out.append(token)
    jax.block_until_ready(token)
    elapsed = time.perf_counter() - t0
    generated = np.stack([np.asarray(t) for t in out], axis=1)
    for row in generated[: min(b, 4)]:
        print(tokenizer.decode(row.tolist()) if tokenizer else row.tolist())
    print(json.dumps(dict(batch_size=b, prompt_tokens=p, new_tokens=cfg.max_new_tokens,
                          decode_tokens_per_s=round(b * (cfg.max_new_tokens - 1) / elapsed, 1),
                          devices=jax.device_count(), backend=jax.default_backend())))


if __name__ == "__main__":
    launch.run(main)
