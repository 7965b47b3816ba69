r"""Teacher caches ranked by the student they train: top-K with and without the tail bucket,
sampled, and the exact teacher, over paired seeds.

  python -m experiments.bench_distill_caches --config=configs/distill.py:tiny --seeds=8 \
      --ks=2,8,0 --out=docs/results/bench_distill_caches.json
  python -m experiments.bench_distill_caches --config=configs/distill.py:example --ks=8,0 \
      --sampled_at_v=False --noaccuracy --out=docs/results/bench_distill_caches_bpe1024.json

The second ranks caches of a 1,024-token teacher (the README's example model, SFT-trained:
configs/distill.py says how it is written). The teacher's targets are held at the target
positions alone (`TargetPositions`): its whole-vocabulary targets at every position of the
1,428 training rows would take 1.9 GB.

Every arm trains the same students: seed s gives the student's initialisation, the batch order
and (for a sampled cache) the teacher's draws, the same in every arm, so arms differ by their
teacher targets alone and a difference is measured per seed (paired). The seeds of one arm
train side by side in one vmapped program. K = 0 means the whole vocabulary (V): its top-K
cache is the exact teacher (tail mass 0: with or without the tail bucket the same loss), its
sampled cache V draws per position.

Arms, each at the bytes per position of a K-wide cache (ids and log-probs or counts):
  exact       top-V: the full-vocabulary KL (K = 0)
  topk        top-K ids and log-probs, the paper's loss (tail=False)
  topk_tail   the same cache, plus the bucket of the teacher's mass outside the K ids
  sampled     K draws from the teacher per position, distinct ids with counts (Random-Sampling KD)

The training targets come from the teacher functions the cache writer calls
(`train.make_teacher_topk`, `train.make_teacher_samples`), held in memory: the online path,
whose curves the offline cache reproduces bitwise (tests/distill/test_train.py). Evaluation is the
trainer's: held-out full-vocabulary KL against the exact teacher, top-1 agreement, and the
greedy answers' accuracy (`--accuracy`). Pairs whose mean difference is within twice its
standard error over the seeds are reported as ties.
"""
from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from experiments import machine
from experiments.cache_ranking import TIE_SE, TargetPositions, arms_for, cache_bytes, plot, rank, table
from tlt_jax.data.packing import batch_indices, padded_batches
from tlt_jax.distill import teacher_cache as tc
from tlt_jax.distill import train
from tlt_jax.train_state import OptimizerConfig, TrainState, apply_gradients

_CONFIG = config_flags.DEFINE_config_file("config", "configs/distill.py:tiny", "Distillation config (the recipe "
                                          "every arm trains with); --config.<field>=<value> overrides.")
_SEEDS = flags.DEFINE_integer("seeds", 8, "Paired seeds 0 .. seeds-1 per arm.")
_KS = flags.DEFINE_list("ks", ["2", "8", "0"], "Cache widths K; 0 = the whole vocabulary.")
_ARMS = flags.DEFINE_list("arms", ["topk", "topk_tail", "sampled"], "Cache arms at each K below V (at V: exact "
                          "and sampled).")
_SAMPLED_AT_V = flags.DEFINE_bool("sampled_at_v", True, "At K = V also a sampled cache of V draws per position.")
_ACCURACY = flags.DEFINE_bool("accuracy", True, "Score each final student's greedy answers to the held-out prompts.")
_OUT = flags.DEFINE_string("out", "", "JSON path (experiments.machine.write_result); '' prints only.")
_PLOT = flags.DEFINE_string("plot", "", "PNG path: eval KL against cache bytes per position, one point per arm.")
_FROM_JSON = flags.DEFINE_string("from_json", "", "Train nothing: print the table (and --plot) of this JSON.")

class Targets:
    """The teacher's training targets per (arm, K, seed), ids and log-probs at the target
    positions of each split's rows (`TargetPositions`), computed once from the exact teacher
    (top-K columns of its sorted top-V) or its draws; `batch` spreads them over [B, T, K]."""

    def __init__(self, setup: train.Setup, config):
        self.setup, self.config = setup, config
        self.positions = {split: TargetPositions(setup.rows[split]["mask"]) for split in ("train", "eval")}
        self._exact = None

    def exact(self, split: str):
        if self._exact is None:
            self._exact = {s: self._topk(s, self.setup.vocab) for s in ("train", "eval")}
        return self._exact[split]

    def _topk(self, split, k):
        s = self.setup
        teacher = train.make_teacher_topk(s.teacher_cfg, s.teacher_params, s.mesh, k=k,
                                          temperature=self.config.temperature, logp_dtype=self.config.cache_dtype)
        return self._over_rows(split, lambda idx, inputs: teacher(*inputs))

    def train(self, arm: str, k: int, seed: int):
        if arm != "sampled":
            ids, logp = self.exact("train")
            return ids[:, :k], logp[:, :k]
        s = self.setup
        teacher = train.make_teacher_samples(s.teacher_cfg, s.teacher_params, s.mesh, samples=k, width=k,
                                             temperature=self.config.temperature, seed=seed)
        ids, counts = self._over_rows("train", lambda idx, inputs: teacher(*inputs, idx))
        return ids, tc.empirical_logp(counts, k)

    def batch(self, split: str, idx, ids_PK, logp_PK) -> dict:
        """{"ids", "logp"} [B, T, K] of rows idx; the positions without a target hold id -1 (out of
        the vocabulary: absent to the loss) and log-prob 0."""
        where = self.positions[split]
        return {"ids": where.scatter(idx, ids_PK, -1), "logp": where.scatter(idx, logp_PK, 0)}

    def _over_rows(self, split, fn):
        """fn(idx, (tokens, positions, segment_ids)) over every row in batches, each output kept
        at the target positions and concatenated on the host."""
        rows, where, outs = self.setup.rows[split], self.positions[split], []
        n, batch_size = len(rows["tokens"]), self.config.cache_batch_size
        for begin in range(0, n, batch_size):
            idx = np.arange(begin, min(begin + batch_size, n))
            out = jax.device_get(fn(idx, [rows[name][idx] for name in ("tokens", *train.LAYOUT)]))
            outs.append([where.gather(idx, np.asarray(x)) for x in out])
        return tuple(np.concatenate(parts) for parts in zip(*outs))


def train_arm(config, setup: train.Setup, targets: Targets, arm: str, k: int, seeds: list[int]):
    """The final students of one arm, one per seed, trained side by side (vmapped): stacked params
    and the number of skipped (non-finite) updates per seed."""
    student_cfg = train.init_student(config, setup, 0)[0]
    trainer = train.DistillTrainer(student_cfg, OptimizerConfig(**config.optimizer), setup.mesh,
                                   temperature=config.temperature, tail=arm == "topk_tail", top_k=k,
                                   loss_impl=config.loss_impl, remat=config.remat)
    params_S = jax.tree.map(lambda *xs: jnp.stack(xs), *(train.init_student(config, setup, s)[1] for s in seeds))
    opt_S = jax.vmap(trainer.optimizer.init)(params_S)
    state = TrainState(params_S, opt_S, jnp.zeros((len(seeds),), jnp.int32))

    def step(state, batch):
        loss, grads = jax.value_and_grad(trainer.loss)(state.params, batch)
        state, guard = apply_gradients(trainer.optimizer, state, grads, loss)
        return state, guard["skipped"]

    vstep = jax.jit(jax.vmap(step), donate_argnums=(0,))
    rows = setup.rows["train"]
    per_seed = ([targets.train(arm, k, s) for s in seeds] if arm == "sampled"
                else [targets.train(arm, k, 0)] * len(seeds))
    n, b, skipped = len(rows["tokens"]), config.batch_size, np.zeros(len(seeds))
    for t in range(config.steps):
        idx_S = [batch_indices(t, b, n, s) for s in seeds]
        batch = {name: np.stack([v[idx] for idx in idx_S]) for name, v in rows.items()}
        seed_targets = [targets.batch("train", idx, ids, logp) for (ids, logp), idx in zip(per_seed, idx_S)]
        batch.update({name: np.stack([t[name] for t in seed_targets]) for name in ("ids", "logp")})
        state, skip = vstep(state, batch)
        skipped += np.asarray(skip)
        if (t + 1) % 50 == 0:
            print(f"  {arm}-{k}: step {t + 1}/{config.steps}", flush=True)
    return trainer, state.params, skipped


def evaluate_arm(trainer, params_S, setup: train.Setup, targets: Targets, batch_size: int, seeds: int) -> list[dict]:
    """`train.eval_metrics` of each seed's student against the exact teacher (vmapped over seeds)."""
    vsums = jax.jit(jax.vmap(trainer.eval_sums_of, in_axes=(0, None)))
    ids, logp = targets.exact("eval")
    totals = None
    for idx, batch in padded_batches(setup.rows["eval"], batch_size):
        sums = jax.device_get(vsums(params_S, {**batch, **targets.batch("eval", idx, ids, logp)}))
        totals = sums if totals is None else {key: totals[key] + sums[key] for key in totals}
    return [train.eval_metrics({key: v[i] for key, v in totals.items()}) for i in range(seeds)]


def accuracies(config, setup: train.Setup, student_cfg, params_S, seeds: int) -> list[float]:
    """Each seed's student's greedy answer accuracy on the held-out prompts (one engine, its weights swapped)."""
    take = lambda i: jax.tree.map(lambda x: x[i], params_S)
    engine = train.answer_engine(config, setup, student_cfg, take(0))
    out = []
    for i in range(seeds):
        engine.update_params(take(i))
        out.append(train.answer_accuracy(engine, config, setup))
    return out


def main(argv):
    del argv
    if _FROM_JSON.value:
        with open(_FROM_JSON.value) as f:
            order = json.load(f)["arms"]
        print(table(order))
        if _PLOT.value:
            plot(order, _PLOT.value)
        return
    config, seeds = _CONFIG.value, list(range(_SEEDS.value))
    if len(seeds) < 2:
        raise ValueError(f"--seeds={_SEEDS.value}: paired comparisons need at least 2 seeds")
    config.eval_top_k = 0  # the held-out targets: the whole vocabulary, so eval_kl is the exact KL
    setup = train.prepare(config)
    targets = Targets(setup, config)
    arms = []
    for arm, k in arms_for([int(k) for k in _KS.value], setup.vocab, _ARMS.value, _SAMPLED_AT_V.value):
        t0 = time.time()
        trainer, params_S, skipped = train_arm(config, setup, targets, arm, k, seeds)
        evals = evaluate_arm(trainer, params_S, setup, targets, config.eval_batch_size, len(seeds))
        acc = accuracies(config, setup, trainer.model_config, params_S, len(seeds)) if _ACCURACY.value else []
        record = {"name": f"{arm}-{k}", "arm": arm, "k": k, "bytes": cache_bytes(k, config.cache_dtype),
                  "tail_mass": float(np.mean([e["eval_teacher_tail_mass"] for e in evals])),
                  "skipped_updates": skipped.tolist(), "eval_accuracy": acc, "seconds": time.time() - t0,
                  **{key: [e[key] for e in evals] for key in ("eval_kl", "eval_top1_agree", "eval_ece",
                                                              "eval_token_accuracy", "eval_loss")}}
        arms.append(record)
        print(f"{record['name']}: eval KL {np.mean(record['eval_kl']):.4f} over {len(seeds)} seeds "
              f"({record['seconds']:.0f} s)", flush=True)
        _report(config, seeds, arms, final=False)
    _report(config, seeds, arms, final=True)


def _report(config, seeds: list[int], arms: list[dict], final: bool) -> None:
    """Ranks the arms so far; the final call prints the table. The JSON is rewritten after
    every arm, so a run cut short keeps the arms it finished."""
    order = rank([dict(a) for a in arms])
    exact = next((a for a in order if a["arm"] == "exact"), None)
    beaten = [b["arm"] for b in exact["beaten_by"]] if exact else []
    if final:
        print(table(order))
        if _PLOT.value:
            plot(order, _PLOT.value)
        print(f"The exact teacher beaten beyond noise by: {', '.join(beaten) or 'none'}")
    if _OUT.value:
        machine.write_result(_OUT.value, {"config": json.loads(config.to_json_best_effort()), "seeds": seeds,
                                          "tie_rule": f"|mean paired difference| <= {TIE_SE} SE",
                                          "complete": final, "arms": order, "exact_beaten_by": beaten})


if __name__ == "__main__":
    app.run(main)
