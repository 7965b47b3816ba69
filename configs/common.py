"""Helpers shared by config files, and the synthetic task mixes the presets train on."""
import itertools

import ml_collections


def grid(**axes) -> list[dict]:
    """Cartesian product of overrides: grid(lr=[1e-4, 3e-4], seed=[0, 1]) -> four dicts."""
    keys = list(axes)
    return [dict(zip(keys, values)) for values in itertools.product(*(axes[k] for k in keys))]


def tasks_tiny():
    """Schoolbook additions of up to 8 digits (Zipf-distributed digit counts): a problem
    space large enough that held-out problems test the procedure, not memory."""
    return ml_collections.ConfigDict({"addition": {"weight": 1.0, "max_digits": 8, "digits_zipf": 1.6}})


def tasks_long_tail():
    """Additions of up to 32 digits, most short (median answer 32 characters) and a few
    up to 270: per RL step of 64 samples the longest runs about 6x the median, the long
    tail of reasoning traces that speculation is for."""
    return ml_collections.ConfigDict({"addition": {"weight": 1.0, "max_digits": 32, "digits_zipf": 1.6}})


# B's weight (A's is 1) in the drift_shift warm start's problems: tuned so that B's pass@G
# starts in the band RL can learn from (docs/tlt.md).
WARM_START_COUNTDOWN_WEIGHT = 0.1


def tasks_drift_shift(countdown_weight: float = 1.0):
    """Two tasks whose share changes between warm start and RL (bench_tlt's cpu_drift_shift):
    additions of up to 16 digits (A) and countdowns over three numbers up to 8 (B, searches
    of up to 24 lines, median answer twice A's). The SFT model sees little of B, so RL moves
    B's completions and the drafter trained on the SFT model goes stale there."""
    return ml_collections.ConfigDict({
        "addition": {"weight": 1.0, "max_digits": 16, "digits_zipf": 1.6},
        "countdown": {"weight": countdown_weight, "num_numbers": 3, "max_number": 8, "max_trace_lines": 24}})


# The worked trace's share of the drift_learn warm start's SFT targets (the rest are bare
# answers): rare enough that the warm start mostly answers bare, common enough that it
# learns the trace well and samples it now and then, for RL to find (docs/tlt.md).
WARM_START_TRACE_SHARE = 0.15


def tasks_drift_learn(trace_share: float = WARM_START_TRACE_SHARE):
    """Additions of 3 to 5 digits, each SFT target the worked trace (reliable, long) with
    probability `trace_share` and otherwise a bare answer (short, and nearly always wrong:
    the tiny model adds bare up to two digits, the trace works up to about five), nothing in
    the prompt choosing (bench_tlt's cpu_drift_learn). Correctness alone moves RL toward the
    trace: accuracy rises while responses double in length and change format, away from what
    a drafter trained on the warm start's outputs drafts (docs/benchmarks.md)."""
    return ml_collections.ConfigDict({"addition": {"weight": 1.0, "max_digits": 5, "min_digits": 3,
                                                   "digits_zipf": 1.6, "trace_share": trace_share}})


def code_config(**overrides) -> ml_collections.ConfigDict:
    """The `code` reward's options (`rewards.CodeReward`; docs/code.md): read when
    reward="code", as get_reward("code", **config.code)."""
    fields = dict(
        partial_credit=True,  # the share of tests passed; False: 1 only if all pass
        sandbox="auto",  # bwrap (namespaces), rlimits (resource limits only), auto: bwrap where it runs
        timeout_s=5.0,  # wall seconds per test; a sample's first timeout ends its run
        memory_mb=1024,  # address space per program
        output_bytes=1 << 20,  # stdout + stderr per program, and each stdin/stdout test's output
        file_bytes=16 << 20,  # the largest file a program may write
        processes=16,  # processes and threads per program at once
        disk_mb=64,  # all a program may write, together (bwrap: a size-capped tmpfs; rlimits cannot bound it)
        forgeable="skip",  # a test only the program's own interpreter could decide: skip, run (forgeably), error
        max_parallel=0,  # sandboxes at once (0: four per CPU)
        python="",  # the interpreter programs run with ("": this one, or the system's python3)
    )
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise KeyError(f"Unknown code fields {unknown}.")
    return ml_collections.ConfigDict({**fields, **overrides})


def data_config(**overrides) -> ml_collections.ConfigDict:
    """A `data` section with every field `tlt_jax.data.sources` reads (source, synthetic
    tasks, files and their columns, prompt format); `overrides` set some of them."""
    fields = dict(source="tasks", tasks=tasks_tiny(), num_train=20000, num_eval=256, seed=0, train="", eval="",
                  prompt_field="prompt", answer_field="answer", response_field="", chat_template=False,
                  system_prompt="", prompt_template="{prompt}")
    unknown = sorted(set(overrides) - set(fields) - {"seq_len"})
    if unknown:
        raise KeyError(f"Unknown data fields {unknown}.")
    return ml_collections.ConfigDict({**fields, **overrides})
