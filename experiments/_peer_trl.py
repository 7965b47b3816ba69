"""TRL's GRPOTrainer on the work of experiments.bench_peers (CPU torch, in this process).

`run(work, check, max_logit_diff, logit_diff)` returns bench_peers' record of the run: the forward check
(the trainer's model against transformers' logits), then one entry per step: step time
(`on_step_begin` to `on_step_end`), rollout time (`GRPOTrainer._generate`: tokenising and
`generate`), reward time (`_calculate_rewards`), tokens generated, mean reward. One
generation per optimizer step (steps_per_generation 1, no gradient accumulation), so TRL
skips its old-logp pass; the dataset is the work's prompts in order (shuffle_dataset False),
and each step's sampling is seeded from the work's seed and the step.
"""
import functools
import tempfile
import time


def run(work: dict, check: dict, max_logit_diff: float, logit_diff) -> dict:
    """logit_diff(check, logits_BTV): bench_peers' comparison with transformers' logits."""
    import datasets
    import numpy as np
    import torch
    import transformers
    import trl

    from tlt_jax import rewards

    model = transformers.AutoModelForCausalLM.from_pretrained(work["model_dir"], dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(work["model_dir"])
    with torch.no_grad():
        logits = model(torch.as_tensor(check["tokens"], dtype=torch.long)).logits.numpy()
    out = dict(framework="trl", forward_max_abs_diff=logit_diff(check, logits),
               version=f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}")
    if out["forward_max_abs_diff"] > max_logit_diff:
        return dict(out, error=f"forward differs from transformers by {out['forward_max_abs_diff']:.3g}")

    rows = [row for step in work["prompts"] for row in step]
    samples = work["prompts_per_step"] * work["num_samples"]
    reward_fn = rewards.get_reward(work["reward"])

    # The dataset holds each prompt and its row number only: Arrow cannot hold every column
    # as it is (cpu_long's operands exceed int64), and the reward reads the work's own values.
    columns = [name for name in rows[0] if name != "prompt"]

    def task_reward(prompts, completions, row, **_):
        return reward_fn(prompts, completions, **{name: [rows[i][name] for i in row] for name in columns})

    with tempfile.TemporaryDirectory() as output_dir:
        args = trl.GRPOConfig(
            output_dir=output_dir, use_cpu=True, bf16=False, seed=work["seed"], max_steps=work["steps"],
            per_device_train_batch_size=samples, gradient_accumulation_steps=1, steps_per_generation=1,
            num_iterations=1, num_generations=work["num_samples"], max_completion_length=work["max_tokens"],
            temperature=work["temperature"], top_p=work["top_p"], top_k=0, learning_rate=work["learning_rate"],
            lr_scheduler_type="constant", warmup_steps=0, adam_beta1=work["b1"], adam_beta2=work["b2"],
            weight_decay=work["weight_decay"], max_grad_norm=work["max_grad_norm"], epsilon=work["clip_eps"],
            epsilon_high=work["clip_eps_high"], beta=work["kl_coef"], loss_type="dapo", scale_rewards="group",
            shuffle_dataset=False, logging_steps=1, save_strategy="no", report_to="none",
            dataloader_num_workers=0, disable_tqdm=True)
        trainer = trl.GRPOTrainer(model=model, reward_funcs=task_reward, args=args, processing_class=tokenizer,
                                  train_dataset=datasets.Dataset.from_list(
                                      [dict(prompt=r["prompt"], row=i) for i, r in enumerate(rows)]))
        steps, current = [], {}

        def timed(name, fn):
            @functools.wraps(fn)
            def wrapper(*a, **k):
                t0 = time.perf_counter()
                result = fn(*a, **k)
                current[name] = current.get(name, 0.0) + time.perf_counter() - t0
                if name == "time_rollout_s":
                    current["tokens"] = current.get("tokens", 0) + sum(len(c) for c in result[1])
                if name == "time_reward_s":
                    current["reward_mean"] = float(np.nansum(result.numpy(), axis=1).mean())
                return result
            return wrapper

        trainer._generate = timed("time_rollout_s", trainer._generate)
        trainer._calculate_rewards = timed("time_reward_s", trainer._calculate_rewards)

        class StepTimer(transformers.TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                torch.manual_seed(work["seed"] * 1_000_003 + state.global_step)
                current.clear()
                current["t0"] = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                t0 = current.pop("t0")
                steps.append(dict(step=state.global_step, time_step_s=time.perf_counter() - t0, **current))

        trainer.add_callback(StepTimer())
        trainer.train()
    return dict(out, steps=steps)
