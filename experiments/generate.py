r"""Generate from a model, plainly and speculatively, and say whether speculation pays.

Prints the model, prompt and sampling settings, each distinct completion once (greedy by
default: every sample is the same), one JSON line per mode (tokens/s of the fastest of
--config.timed_runs, acceptance length) and, with a drafter or an n-gram strategy, the
measured cost of a speculative step in plain steps beside the tokens it commits:
speculation pays when it commits more.

  python -m experiments.generate --target=assets/sft_tiny --drafter=assets/drafter_tiny --prompt=$'add 12+34\n'
  python -m experiments.generate --target=/path/to/ckpt --strategy=ngram-d4-b2   # no drafter needed
  python -m experiments.generate --config=configs/generate.py:qwen2.5-0.5b       # random weights: speed only
"""
import collections
import json
import os
import re

import jax
from absl import flags
from ml_collections import config_flags

from tlt_jax import launch, metrics, sampling, sharding
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import from_config_dict
from tlt_jax.rewards import parse_answer
from tlt_jax.rollout.engine import RolloutConfig, RolloutEngine
from tlt_jax.rollout.speculative import FixedSpeculation, Strategy

_CONFIG = config_flags.DEFINE_config_file("config", "configs/generate.py:tiny", "Generation config.")
_TARGET = flags.DEFINE_string("target", None, "Hugging Face checkpoint to generate from (--config.hf_dir).")
_DRAFTER = flags.DEFINE_string("drafter", None, "Drafter export for that target (--config.drafter_dir).")
_PROMPT = flags.DEFINE_string("prompt", None, "Prompt text, needs the target's tokenizer (--config.prompt).")
_STRATEGY = flags.DEFINE_string("strategy", None, "Drafting strategy, e.g. eagle-d4, ngram-d4-b2 (--config.strategy).")
_TEMPERATURE = flags.DEFINE_float("temperature", None, "Sampling temperature; 0 is greedy (--config.temperature).")


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


def _checked(prompt: str, completion: str) -> str:
    """' (correct)' / ' (wrong: a+b is ...)' for an addition prompt of our tasks, else ''."""
    problem = re.fullmatch(r"add (\d+)\+(\d+)\n?", prompt)
    if problem is None:
        return ""
    expected = str(int(problem.group(1)) + int(problem.group(2)))
    return "  (correct)" if parse_answer(completion) == expected else f"  (wrong: the sum is {expected})"


def _step_seconds(summary: dict) -> float:
    """Mean wall time of one decode step (plain, or draft + verify) of a rollout."""
    return summary["wall_s"] / max(summary["decode_steps"], 1)


def main(argv):
    del argv
    launch.maybe_initialize_distributed()
    cfg = _CONFIG.value
    for flag, field in ((_TARGET, "hf_dir"), (_DRAFTER, "drafter_dir"), (_PROMPT, "prompt"), (_STRATEGY, "strategy"),
                        (_TEMPERATURE, "temperature")):
        if flag.value is not None:
            cfg[field] = flag.value
    sp = sampling.SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                 max_tokens=cfg.max_new_tokens)
    strategy = Strategy.from_name(cfg.strategy) if cfg.strategy else None
    model_cfg, params, tokenizer = _load(cfg)
    drafter_cfg = drafter_params = None
    if cfg.drafter_dir:
        from tlt_jax.drafter_training.io import load_drafter
        drafter_cfg, drafter_params = load_drafter(cfg.drafter_dir, model_cfg)
    if strategy is None and drafter_cfg is not None:
        strategy = Strategy("eagle", depth=4)
    mesh = sharding.make_mesh(cfg.mesh)

    source = cfg.hf_dir or "random weights of the model preset (the text is noise; the speeds are real)"
    metrics.report(f"Model: {source}: {model_cfg.model_type}, {model_cfg.num_layers} layers, "
                   f"{model_cfg.num_params() / 1e6:.1f}M parameters; {jax.device_count()} {jax.default_backend()} "
                   "device(s)")
    if tokenizer:
        prompt = tokenizer.encode(cfg.prompt)
        shown = repr(cfg.prompt)
    else:
        prompt = list(cfg.prompt_ids)
        shown = f"token ids {prompt} (no tokenizer: --prompt needs a --target with one)"
    decoding = ("greedy (temperature 0)" if cfg.temperature == 0 else
                f"sampled at temperature {cfg.temperature:g}, top_p {cfg.top_p:g}, top_k {cfg.top_k or 'off'}")
    metrics.report(f"Prompt: {shown}; {cfg.batch_size} samples, {decoding}, at most {cfg.max_new_tokens} new tokens")
    metrics.report(f"Speculation: {strategy.name} ({'drafter ' + cfg.drafter_dir if cfg.drafter_dir else 'n-gram'})"
                   if strategy else "Speculation: none (give --drafter or --strategy=ngram-d4-b2)")

    engine = RolloutEngine(model_cfg, params, mesh, RolloutConfig(
        num_slots=cfg.batch_size, max_prompt_length=len(prompt), max_length=len(prompt) + cfg.max_new_tokens + 1,
        eos_token_id=model_cfg.eos_token_id, max_draft_depth=max(8, strategy.depth if strategy else 0)),
        drafter_cfg, drafter_params)
    key = jax.random.PRNGKey(cfg.seed)
    modes = [("plain", None)] + ([(strategy.name, FixedSpeculation(strategy, cfg.batch_size))] if strategy else [])
    summaries = {}
    for name, speculation in modes:
        engine.generate([prompt], cfg.batch_size, sp, key, speculation=speculation)  # compile outside the timing
        runs = [engine.generate([prompt], cfg.batch_size, sp, key, speculation=speculation)
                for _ in range(max(cfg.timed_runs, 1))]
        out = min(runs, key=lambda r: r.timeline.summary()["wall_s"])  # the least disturbed by other work
        summaries[name] = summary = out.timeline.summary()
        texts = [tokenizer.decode(t.tolist(), skip_special_tokens=True) if tokenizer else str(t.tolist())
                 for t in out.tokens]
        print(f"--- {name}: {len(set(texts))} distinct of {len(texts)} samples")
        for text, count in collections.Counter(texts).most_common(4):
            print(f"[{count}x] " + text.replace("\n", "\n      ") + (_checked(cfg.prompt, text) if tokenizer else ""))
        print(json.dumps(dict(mode=name, batch_size=cfg.batch_size, temperature=cfg.temperature,
                              prompt_tokens=len(prompt), new_tokens=int(out.lengths.sum()),
                              tokens_per_s=round(summary["tokens_per_s"], 1),
                              acceptance_length=round(summary["acceptance_length"], 2),
                              devices=jax.device_count(), backend=jax.default_backend())), flush=True)
    if strategy:
        plain, spec = summaries["plain"], summaries[strategy.name]
        cost = _step_seconds(spec) / _step_seconds(plain)
        speedup = spec["tokens_per_s"] / max(plain["tokens_per_s"], 1e-9)
        verdict = (f"Speculation {'pays' if speedup > 1 else 'does not pay'} here ({speedup:.2f}x plain tokens/s): "
                   f"a speculative step (drafting {strategy.depth} tokens, then verifying them in one target "
                   f"forward) took {1e3 * _step_seconds(spec):.2f} ms, {cost:.1f} plain steps of "
                   f"{1e3 * _step_seconds(plain):.2f} ms, and committed {spec['acceptance_length']:.2f} tokens per "
                   "sequence.")
        if speedup <= 1:
            verdict += (" It pays where a step's cost barely grows with the tokens it verifies: decode bound by "
                        "reading the weights (a large target, few sequences, a GPU), not a small model on a CPU.")
        print(verdict)


if __name__ == "__main__":
    launch.run(main)
