r"""Peers on the same work: one GRPO job in tunix, TRL and tlt_jax (TLT off and on).

  python -m experiments.bench_peers --setup=sft_tiny --out=docs/results/bench_peers_sft_tiny.json
  python -m experiments.bench_peers --setup=cpu_long --out=docs/results/bench_peers_cpu_long.json
  python -m experiments.bench_peers --frameworks=baseline,trl --steps=3   # a quick look

The work: one Hugging Face checkpoint (`sft_tiny`: the shipped `assets/sft_tiny`, a 4-layer
Llama, on the tiny RL job's additions; `cpu_long`: bench_tlt's `cpu_long` target, its
long-tail SFT model deepened to 16 layers, built once into `--cache_dir` by
`bench_tlt.build_target`), the same prompts in the same order (the train stream of our RL
loop, `RLLoop.prompts_for`), G samples each, the same max_tokens, temperature 1, top_p 1,
learning rate (constant, AdamW b1 0.9, b2 0.99, no weight decay, gradients clipped at norm 1),
PPO clipping (0.2 low, 0.28 high), no KL term, token-mean loss aggregation (TRL's `dapo`,
tunix's `token-mean`), one optimizer update per step over all samples, and the reward of the
task, `tlt_jax.rewards.task_reward`, a plain `fn(prompts, completions, **columns)` that
every framework calls as it is. Frameworks (`--frameworks`):
  baseline   tlt_jax with TLT off (`bench_tlt.mode_config`, `train_rl`)
  tlt        tlt_jax with TLT on: adaptive speculation and the drafter trained on the spot
  trl        TRL's `GRPOTrainer` on CPU torch (`experiments/_peer_trl.py`, beside us)
  tunix      tunix's `GRPOLearner` with its vanilla sampler, the checkpoint read by its own
             safetensors loader (`experiments/_peer_tunix.py`), in a virtual environment of
             its own (`--venv_dir`, built on first use: `python -m venv` and
             `pip install google-tunix==0.1.7`, since tunix pins safetensors<0.8)

Each framework runs in its own fresh process, which first checks its forward pass against
transformers' logits on the checkpoint (the max abs difference over a batch of prompts is
reported; over `--max_logit_diff` the framework is not timed), seeds its sampling per step
(from --seed and the step), runs `--steps` steps and writes one record per step: step time,
rollout time (where the framework has a rollout phase we can time: all three do), reward
time, tokens generated and the mean reward. The table gives medians over the steps after
`--warmup_steps` (compiles fall there), the learner time (step - rollout - reward: the
old-logp pass, the update and the weight sync), rollout tokens/s, the mean reward of the
last step and of all steps, and the step and rollout ratios of each framework against
tlt_jax's baseline (> 1: faster than the baseline). A framework that cannot be installed or
imported is reported with the wheel that is missing, and the others run.

tunix 0.1.7 workarounds, applied at run time in the worker (docs/benchmarks.md): its llama3
attention calls `apply_rope` without the config's `rope_theta` (a fixed base of 1e6), so the
worker rebinds the module's `apply_rope` with the checkpoint's base; its vanilla rollout passes
the config's one `seed` to every sampler call (the same key each step), so the worker gives
each call a key folded from --seed and the call's number.
"""
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

import numpy as np
from absl import flags

from experiments import bench_tlt, machine
from tlt_jax import launch, metrics

_SETUP = flags.DEFINE_enum("setup", "sft_tiny", ["sft_tiny", "cpu_long"], "The work (see SETUPS).")
_FRAMEWORKS = flags.DEFINE_list("frameworks", ["baseline", "tlt", "trl", "tunix"],
                                "Frameworks to run, in order: baseline, tlt, trl, tunix.")
_WORK_DIR = flags.DEFINE_string("work_dir", "runs/bench_peers", "The work file, the runs and their results go here.")
_VENV_DIR = flags.DEFINE_string("venv_dir", "runs/bench_peers/venv_tunix", "tunix's virtual environment (built "
                                "here on first use).")
_TUNIX_WHEEL = flags.DEFINE_string("tunix_wheel", "google-tunix==0.1.7", "What pip installs into --venv_dir.")
_WARMUP = flags.DEFINE_integer("warmup_steps", None, "Steps left out of the medians (default: the setup's).")
_MAX_LOGIT_DIFF = flags.DEFINE_float("max_logit_diff", 1e-3, "A framework whose logits differ from transformers' "
                                     "by more than this on the checkpoint is not timed.")
_SINGLE = flags.DEFINE_string("single", "", "Run this one tlt_jax mode (baseline, tlt) or trl in this process on "
                              "--work and write its records to --out (what each run is).")
_WORK = flags.DEFINE_string("work", "", "The work file of a --single run.")

FRAMEWORKS = ("baseline", "tlt", "trl", "tunix")
SETUPS = {
    # The shipped 4-layer SFT checkpoint and its drafter on the tiny RL job's additions (up
    # to 8 digits): 8 prompts x 8 samples, up to 96 new tokens.
    "sft_tiny": dict(bench_tlt.PRESETS["cpu"], layers=4, steps=8, warmup_steps=2, prompts_per_step=8,
                     num_samples=8, max_tokens=96, num_slots=64),
    # bench_tlt's cpu_long preset (16-layer target, long-tail additions, up to 288 new tokens),
    # fewer steps.
    "cpu_long": dict(bench_tlt.PRESETS["cpu_long"], steps=6, warmup_steps=2),
}
_CHECK_PROMPTS = 4  # prompts of the forward check
_PHASES = ("time_step_s", "time_rollout_s", "time_reward_s", "time_learner_s")


def setup_target(setup: dict) -> tuple[str, str]:
    """(checkpoint dir, drafter export dir) of a setup: the shipped ones, or bench_tlt's
    deepened target built once into --cache_dir."""
    if setup.get("warm_start", "assets") == "assets":
        return bench_tlt.build_warm_start("assets", bench_tlt.CACHE.value)
    return bench_tlt.build_target(setup["layers"], bench_tlt.CACHE.value, setup["warm_start"])


def ours_config(mode: str, setup: dict, target_dir: str, drafter_dir: str, seed: int, steps: int):
    """bench_tlt's config of `mode` with the peers' work: one update per step, a constant
    learning rate from the first step, a small eval set (eval is outside the timed steps)."""
    c = bench_tlt.mode_config(mode, setup, target_dir, drafter_dir, seed, steps)
    c.learner.num_minibatches = 1
    c.learner.optimizer.warmup_steps = 0
    c.data.num_eval = 32
    c.run_dir = os.path.join(_WORK_DIR.value, f"{mode}_s{seed}")
    return c


def make_work(setup_name: str, seed: int, steps: int) -> dict:
    """The work every framework runs: checkpoint, sampling and optimizer settings, and each
    step's prompts with their reward columns, taken from our RL loop's train stream."""
    from tlt_jax.data import sources, tasks
    from tlt_jax.rl.loop import RLLoop, RLStepConfig
    from tlt_jax.tokenizer import load_tokenizer

    setup = SETUPS[setup_name]
    target_dir, drafter_dir = setup_target(setup)
    c = ours_config("baseline", setup, target_dir, drafter_dir, seed, steps)
    problems = sources.problems_for(c.model_dir, c.data, c.rollout.max_prompt_length)
    tokenizer = load_tokenizer(c.model_dir)
    loop = RLLoop(engine=None, learner=None, tokenizer=tokenizer, train_examples=problems.train,
                  eval_examples=[], sampling_params=None, step_config=RLStepConfig(prompts_per_step=c.prompts_per_step),
                  seq_len=0, seed=seed)
    prompts = []
    for step in range(steps):
        examples = loop.prompts_for(step * c.prompts_per_step)
        fields = tasks.reward_fields(examples)
        prompts.append([dict(prompt=e.prompt, **{k: v[i] for k, v in fields.items()}) for i, e in enumerate(examples)])
    loop.close()
    o, g = c.learner.optimizer, c.grpo
    return dict(setup=setup_name, model_dir=os.path.abspath(c.model_dir), drafter_dir=os.path.abspath(drafter_dir),
                seed=seed, steps=steps, prompts_per_step=c.prompts_per_step, num_samples=c.num_samples,
                max_tokens=c.rollout.max_tokens, max_prompt_length=c.rollout.max_prompt_length,
                temperature=c.rollout.temperature, top_p=c.rollout.top_p, learning_rate=o.learning_rate,
                b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, max_grad_norm=o.max_grad_norm,
                clip_eps=g.clip_eps, clip_eps_high=g.clip_eps_high, kl_coef=g.kl_coef, aggregation=g.aggregation,
                advantage=c.advantage, reward=c.reward, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, repo_root=os.path.abspath(os.getcwd()), prompts=prompts)


def reference_logits(work: dict, path: str) -> None:
    """transformers' logits of the checkpoint on the first prompts (right-padded with pad
    ids; positions past a prompt are never compared): `path` (.npz: tokens, lengths, logits)."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(work["model_dir"])
    ids = [tokenizer(p["prompt"])["input_ids"] for p in work["prompts"][0][:_CHECK_PROMPTS]]
    width = max(len(i) for i in ids)
    tokens = np.full((len(ids), width), work["pad_token_id"], np.int32)
    for row, i in enumerate(ids):
        tokens[row, :len(i)] = i
    model = transformers.AutoModelForCausalLM.from_pretrained(work["model_dir"], dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    np.savez(path, tokens=tokens, lengths=np.asarray([len(i) for i in ids]), logits=logits)


def max_logit_diff(check: dict, logits_BTV) -> float:
    """Max abs difference from the reference logits over each prompt's own positions."""
    ref = check["logits"]
    return float(max(np.abs(np.asarray(logits_BTV)[b, :n] - ref[b, :n]).max() for b, n in enumerate(check["lengths"])))


def run_ours(mode: str, work: dict, check: dict) -> dict:
    """One tlt_jax run of the work in this process: the forward check, then train_rl."""
    import jax
    import jax.numpy as jnp

    from tlt_jax.models import transformer as tfm
    from tlt_jax.models.hf_io import load_hf
    from tlt_jax.rl.train import train_rl

    launch.enable_compilation_cache(bench_tlt.xla_cache_dir())
    cfg, params = load_hf(work["model_dir"])
    h = tfm.forward(jax.tree.map(jnp.asarray, params), cfg, jnp.asarray(check["tokens"]))
    diff = max_logit_diff(check, tfm.logits_from_hidden(params, cfg, h))
    out = dict(framework=mode, forward_max_abs_diff=diff, version=f"tlt_jax, jax {jax.__version__}")
    if diff > _MAX_LOGIT_DIFF.value:
        return dict(out, error=f"forward differs from transformers by {diff:.3g}")
    setup = SETUPS[work["setup"]]
    c = ours_config(mode, setup, work["model_dir"], work["drafter_dir"], work["seed"], work["steps"])
    if os.path.exists(c.run_dir):
        import shutil

        shutil.rmtree(c.run_dir)
    programs = bench_tlt.cached_programs()
    train_rl(c, progress=False)
    out["new_compiled_programs"] = bench_tlt.cached_programs() - programs
    records = metrics.read_metrics(os.path.join(c.run_dir, metrics.METRICS_FILENAME))
    steps = []
    for r in (r for r in records if "time_step_s" in r):
        steps.append(dict(step=r["step"], time_step_s=r["time_step_s"], time_rollout_s=r["time_rollout_s"],
                          time_reward_s=r["time_reward_s"], time_old_logp_s=r["time_old_logp_s"],
                          tokens=r["rollout_tokens"], reward_mean=r["reward_mean"],
                          response_length_mean=r["response_length_mean"],
                          acceptance_length=r["acceptance_length"]))
    return dict(out, steps=steps)


def tunix_python(venv_dir: str, wheel: str, run=subprocess.run) -> tuple[str | None, str]:
    """(The venv's python, "") once `wheel` imports there, building the venv on first use;
    (None, why not) naming the wheel when it cannot be installed or imported."""
    python = os.path.join(venv_dir, "bin", "python")
    probe = [python, "-c", "import tunix, flax, jax, optax, transformers"]
    if os.path.exists(python) and run(probe, capture_output=True).returncode == 0:
        return python, ""
    for command in ([sys.executable, "-m", "venv", venv_dir], [python, "-m", "pip", "install", "-q", wheel]):
        print(f"building tunix's environment: {shlex.join(command)}", flush=True)
        done = run(command, capture_output=True, text=True)
        if done.returncode:
            lines = (done.stderr or done.stdout or "").strip().splitlines()
            return None, (f"tunix: cannot install the wheel {wheel} into {venv_dir} ({shlex.join(command[:4])} "
                          f"exit status {done.returncode}: {lines[-1] if lines else 'no output'})")
    done = run(probe, capture_output=True, text=True)
    if done.returncode:
        lines = (done.stderr or "").strip().splitlines()
        return None, f"tunix: {wheel} installed in {venv_dir} but does not import: {lines[-1] if lines else ''}"
    return python, ""


def trl_missing() -> str:
    """"" when TRL's GRPOTrainer imports here, else which wheel is missing."""
    try:
        import torch  # noqa: F401
        from trl import GRPOTrainer  # noqa: F401
    except ImportError as e:
        return f"trl: cannot import TRL's GRPOTrainer ({e}); pip install trl torch"
    return ""


def framework_command(name: str, work_path: str, out: str, python_of=tunix_python) -> tuple[list[str] | None, str]:
    """(command line of the run of `name`, "") or (None, why it cannot run)."""
    if name == "tunix":
        python, why = python_of(_VENV_DIR.value, _TUNIX_WHEEL.value)
        if python is None:
            return None, why
        return [python, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_peer_tunix.py"),
                f"--work={work_path}", f"--out={out}"], ""
    if name == "trl":
        why = trl_missing()
        if why:
            return None, why
    return [sys.executable, "-m", "experiments.bench_peers", f"--single={name}", f"--work={work_path}",
            f"--out={out}", f"--cache_dir={bench_tlt.CACHE.value}", f"--work_dir={_WORK_DIR.value}",
            f"--max_logit_diff={_MAX_LOGIT_DIFF.value}"], ""


def summarise(run: dict, warmup: int) -> dict:
    """Medians of a run's phases over the steps after `warmup`, tokens/s, rewards."""
    steps = run["steps"]
    steady = steps[warmup:] or steps
    for s in steps:
        s["time_learner_s"] = s["time_step_s"] - s["time_rollout_s"] - s.get("time_reward_s", 0.0)
    med = {k: statistics.median(s.get(k, 0.0) for s in steady) for k in _PHASES}
    return dict(median=med, rollout_tokens_per_s=statistics.median(s["tokens"] / s["time_rollout_s"] for s in steady),
                first_steps_s=[s["time_step_s"] for s in steps[:warmup]],
                reward_last=steps[-1]["reward_mean"], reward_all=statistics.fmean(s["reward_mean"] for s in steps),
                reward_per_step=[s["reward_mean"] for s in steps],
                response_length_mean=statistics.fmean(s["tokens"] for s in steps) / max(
                    1, run.get("samples_per_step", 1)),
                timed_steps=len(steady))


def with_ratios(results: dict) -> dict:
    """`step_speedup_vs_baseline` and `rollout_speedup_vs_baseline` of each summarised
    framework: the baseline's median over the framework's (> 1: faster than our baseline)."""
    base = results.get("baseline", {}).get("summary")
    if base is None:
        return results
    for r in results.values():
        if "summary" in r:
            m = r["summary"]["median"]
            r["summary"]["step_speedup_vs_baseline"] = base["median"]["time_step_s"] / m["time_step_s"]
            r["summary"]["rollout_speedup_vs_baseline"] = base["median"]["time_rollout_s"] / m["time_rollout_s"]
    peers = [r["summary"]["median"]["time_step_s"] for n, r in results.items() if n in ("trl", "tunix")
             and "summary" in r]
    if peers and "tlt" in results and "summary" in results["tlt"]:
        results["tlt"]["summary"]["step_speedup_vs_fastest_peer"] = min(peers) / results["tlt"]["summary"][
            "median"]["time_step_s"]
    return results


def print_table(result: dict) -> None:
    print(f"\nsetup {result['setup']} ({result['model_dir']}), {result['prompts_per_step']} prompts x "
          f"{result['num_samples']} samples, max_tokens {result['max_tokens']}, {result['steps']} steps, medians "
          f"over steps {result['warmup_steps'] + 1}..{result['steps']}; seconds")
    print(f"{'framework':10}{'step':>9}{'rollout':>9}{'reward':>8}{'learner':>9}{'tok/s':>8}{'fwd diff':>10}"
          f"{'reward':>8}{'(all)':>7}{'step x':>8}{'roll x':>8}")
    for name, r in result["frameworks"].items():
        if "summary" not in r:
            print(f"{name:10}  {r.get('missing') or r.get('error', 'no result')}")
            continue
        s, m = r["summary"], r["summary"]["median"]
        print(f"{name:10}{m['time_step_s']:9.3f}{m['time_rollout_s']:9.3f}{m['time_reward_s']:8.3f}"
              f"{m['time_learner_s']:9.3f}{s['rollout_tokens_per_s']:8.0f}{r['forward_max_abs_diff']:10.1e}"
              f"{s['reward_last']:8.3f}{s['reward_all']:7.3f}{s.get('step_speedup_vs_baseline', 0.0):8.2f}"
              f"{s.get('rollout_speedup_vs_baseline', 0.0):8.2f}")
    cold = {n: r["new_compiled_programs"] for n, r in result["frameworks"].items() if r.get("new_compiled_programs")}
    if cold:
        print(f"Programs compiled during the runs (not found in {bench_tlt.CACHE.value}/xla): {cold}. Learner "
              "shapes that first appear after the warm-up steps compile inside timed steps: run the same command "
              "again for a fair ratio.")
    tlt = result["frameworks"].get("tlt", {}).get("summary", {})
    if "step_speedup_vs_fastest_peer" in tlt:
        print(f"TLT step vs the fastest peer: {tlt['step_speedup_vs_fastest_peer']:.2f}x")


def spawn(command: list[str]) -> tuple[int, str]:
    """Runs one framework's process to its end, output shown; (exit status, its stderr's tail)."""
    return bench_tlt.spawn(command, env=dict(os.environ))


def run_all(launch_child=spawn, command_of=framework_command) -> dict:
    """Writes the work, then runs each framework of --frameworks in its own process; rewrites
    --out after each. A framework that cannot run is recorded with why, and the rest run."""
    for name in _FRAMEWORKS.value:
        if name not in FRAMEWORKS:
            raise ValueError(f"Unknown framework {name!r}: the frameworks are {', '.join(FRAMEWORKS)}.")
    setup = SETUPS[_SETUP.value]
    steps = bench_tlt.STEPS.value or setup["steps"]
    warmup = setup["warmup_steps"] if _WARMUP.value is None else _WARMUP.value
    seed = bench_tlt.SEED.value
    os.makedirs(_WORK_DIR.value, exist_ok=True)
    work = make_work(_SETUP.value, seed, steps)
    work_path = os.path.abspath(os.path.join(_WORK_DIR.value, f"work_{_SETUP.value}.json"))
    work["check_path"] = os.path.splitext(work_path)[0] + "_logits.npz"
    work["max_logit_diff"] = _MAX_LOGIT_DIFF.value
    reference_logits(work, work["check_path"])
    metrics.write_json(work_path, work)
    result = dict({k: v for k, v in work.items() if k != "prompts"}, warmup_steps=warmup, frameworks={},
                  machine=_machine(), command=shlex.join(sys.argv))
    for name in _FRAMEWORKS.value:
        out = os.path.abspath(os.path.join(_WORK_DIR.value, f"{_SETUP.value}_{name}.json"))
        if os.path.exists(out):
            os.remove(out)
        command, why = command_of(name, work_path, out)
        record = dict(framework=name)
        if command is None:
            record["missing"] = why
            print(f"{name}: not run: {why}", flush=True)
        else:
            print(f"\n== {name}: {shlex.join(command)}", flush=True)
            t0 = time.perf_counter()
            rc, tail = launch_child(command)
            record.update(command=shlex.join(command), rc=rc, wall_s=time.perf_counter() - t0)
            try:
                with open(out) as f:
                    record.update(json.load(f))
            except (OSError, ValueError) as e:
                record["error"] = f"exit status {rc}, no result in {out} ({e}): {tail}"
            if "steps" in record and "error" not in record:
                record["samples_per_step"] = work["prompts_per_step"] * work["num_samples"]
                record["summary"] = summarise(record, warmup)
        result["frameworks"][name] = record
        with_ratios(result["frameworks"])
        if _out():
            machine.write_result(_out(), result)
    print_table(result)
    return result


def _out() -> str:
    return bench_tlt.OUT.value


def _machine() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"{len(names)} x {names[0]}" if names else ""
    except OSError:
        return ""


def run_single(name: str) -> None:
    with open(_WORK.value) as f:
        work = json.load(f)
    check = dict(np.load(work["check_path"]))
    if name in ("baseline", "tlt"):
        result = run_ours(name, work, check)
    elif name == "trl":
        from experiments import _peer_trl

        result = _peer_trl.run(work, check, _MAX_LOGIT_DIFF.value, max_logit_diff)
    else:
        raise ValueError(f"--single={name!r}: baseline, tlt or trl (tunix runs in its own environment).")
    machine.write_result(_out(), result)


def main(argv):
    del argv
    if _SINGLE.value:
        run_single(_SINGLE.value)
    else:
        result = run_all()
        # A framework that cannot be installed is reported, not a failure; one that ran and broke is.
        if any("error" in r for r in result["frameworks"].values()):
            sys.exit(1)


if __name__ == "__main__":
    launch.run(main)
