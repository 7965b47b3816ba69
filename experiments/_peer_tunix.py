"""tunix's GRPOLearner on the work of experiments.bench_peers, in tunix's own environment.

  <venv>/bin/python experiments/_peer_tunix.py --work=runs/bench_peers/work_sft_tiny.json --out=OUT.json

Runs in the virtual environment bench_peers builds (google-tunix 0.1.7 and what it pins), so it
imports nothing of tlt_jax but the reward (`tlt_jax.rewards`, numpy only). The model is
tunix's llama3 `Llama3`, read from the checkpoint by tunix's own safetensors loader
(`tunix.models.llama3.params.create_model_from_safe_tensors`); the rollout is the vanilla
engine (tunix's `Sampler`); one RLCluster on a 1x1 (fsdp, tp) mesh, actor and rollout sharing
the model. Writes bench_peers' record: the forward check against transformers' logits, then per
step the step time (`RLLearner._run_global_step` plus any weight sync), rollout time
(`RLCluster.generate`), reward time (`_compute_rewards`), tokens generated, mean reward.

Two workarounds for tunix 0.1.7, applied here at run time (site-packages untouched):
  * RoPE base: llama3's attention calls `apply_rope(x, positions, head_dim=...)` without the
    config's `rope_theta`, so every model gets apply_rope's default base of 1,000,000. The
    module's `apply_rope` is rebound to one with the checkpoint's `rope_theta`; the forward
    check fails without it.
  * Sampling seed: `VanillaRollout.generate` passes the rollout config's one `seed` to every
    sampler call (None: `PRNGKey(0)`), so each step would draw the same random numbers.
    `generate` is wrapped to pass a key folded from the work's seed and the call's number.
"""
import argparse
import dataclasses
import functools
import itertools
import json
import sys
import time


def patch_rope(model_lib, rope_theta: float) -> None:
    """llama3's attention reads the module-level `apply_rope` when it runs: rebind it to one
    whose base is the checkpoint's."""
    original = getattr(model_lib.apply_rope, "func", model_lib.apply_rope)
    model_lib.apply_rope = functools.partial(original, rope_theta=rope_theta)


def patch_rollout_seed(vanilla_rollout, jax, seed: int) -> None:
    """Every `VanillaRollout.generate` call samples with its own key: fold_in(seed, call)."""
    original = vanilla_rollout.VanillaRollout.generate
    calls = itertools.count()

    @functools.wraps(original)
    def generate(self, prompts, rollout_config, **kwargs):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), next(calls))
        return original(self, prompts, dataclasses.replace(rollout_config, seed=key), **kwargs)

    vanilla_rollout.VanillaRollout.generate = generate


def model_config(model_lib, hf: dict):
    theta = hf.get("rope_theta") or hf.get("rope_parameters", {}).get("rope_theta", 10000.0)
    return model_lib.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"], num_heads=hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"], rope_theta=theta, norm_eps=hf["rms_norm_eps"],
        weight_tying=hf.get("tie_word_embeddings", False))


def run(work: dict) -> dict:
    from importlib.metadata import version

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import transformers
    from tunix.models.llama3 import model as model_lib
    from tunix.models.llama3 import params as params_lib
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout, vanilla_rollout

    sys.path.insert(0, work["repo_root"])
    from tlt_jax import rewards

    with open(f"{work['model_dir']}/config.json") as f:
        hf = json.load(f)
    config = model_config(model_lib, hf)
    patch_rope(model_lib, config.rope_theta)
    patch_rollout_seed(vanilla_rollout, jax, work["seed"])
    # A mesh of automatic axes (jax.make_mesh's explicit ones break tunix's embedding gather).
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    model = params_lib.create_model_from_safe_tensors(work["model_dir"], config, mesh, dtype=jnp.float32)

    check = dict(np.load(work["check_path"]))
    tokens = jnp.asarray(check["tokens"])
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    logits, _ = model(tokens, positions, None, causal)
    diff = float(max(np.abs(np.asarray(logits)[i, :n] - check["logits"][i, :n]).max()
                     for i, n in enumerate(check["lengths"])))
    out = dict(framework="tunix", forward_max_abs_diff=diff,
               version=f"tunix {version('google-tunix')}, flax {version('flax')}, jax {jax.__version__}")
    if diff > work["max_logit_diff"]:
        return dict(out, error=f"forward differs from transformers by {diff:.3g}")

    tokenizer = transformers.AutoTokenizer.from_pretrained(work["model_dir"])
    optimizer = optax.chain(optax.clip_by_global_norm(work["max_grad_norm"]),
                            optax.adamw(work["learning_rate"], b1=work["b1"], b2=work["b2"],
                                        weight_decay=work["weight_decay"]))
    cluster = rl_cluster_lib.RLCluster(
        actor=model, reference=None, tokenizer=tokenizer,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                          rl_cluster_lib.Role.ROLLOUT: mesh},
            rollout_engine="vanilla", offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optimizer, eval_every_n_steps=work["steps"] + 1, max_steps=work["steps"]),
            rollout_config=base_rollout.RolloutConfig(
                max_tokens_to_generate=work["max_tokens"], max_prompt_length=work["max_prompt_length"],
                kv_cache_size=work["max_prompt_length"] + work["max_tokens"], temperature=work["temperature"],
                top_p=work["top_p"], top_k=None, eos_tokens=[work["eos_token_id"]])))
    algo = grpo_learner.GRPOConfig(num_generations=work["num_samples"], num_iterations=1, beta=work["kl_coef"],
                                   epsilon=work["clip_eps"], loss_agg_mode="token-mean")
    algo.epsilon_high = work["clip_eps_high"]  # not a GRPOConfig field; its grpo loss reads it when set
    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, reward_fns=rewards.get_reward(work["reward"]),
                                       algo_config=algo)

    steps, current = [], {}

    def timed(obj, name, key, after=None):
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            result = fn(*a, **k)
            current[key] = current.get(key, 0.0) + time.perf_counter() - t0
            if after is not None:
                after(result)
            return result
        setattr(obj, name, wrapper)

    def rollout_done(output):
        current["tokens"] = current.get("tokens", 0) + sum(len(x) for x in output.tokens)

    def rewards_done(scores):
        current["reward_mean"] = float(np.mean(scores))

    def step_done(_):
        steps.append(dict(step=len(steps) + 1, **current))
        current.clear()

    def synced(_):  # after the step it belongs to
        steps[-1]["time_weight_sync_s"] = current.pop("time_weight_sync_s")
        steps[-1]["time_step_s"] += steps[-1]["time_weight_sync_s"]

    timed(cluster, "generate", "time_rollout_s", rollout_done)
    timed(learner, "_compute_rewards", "time_reward_s", rewards_done)
    timed(learner, "_run_global_step", "time_step_s", step_done)
    timed(cluster, "sync_weights", "time_weight_sync_s", synced)
    columns = sorted({k for p in work["prompts"][0] for k in p} - {"prompt"})
    dataset = [dict(prompts=np.asarray([p["prompt"] for p in step]),
                    **{k: np.asarray([p[k] for p in step]) for k in columns}) for step in work["prompts"]]
    learner.train(dataset)
    return dict(out, steps=steps)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with open(args.work) as f:
        work = json.load(f)
    result = run(work)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
