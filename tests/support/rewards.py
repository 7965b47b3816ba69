"""Reward functions of the tests that score in worker processes: a module the workers
import fast (no JAX), as they unpickle a reward function by importing its module."""
import os
import signal
import time


def hang_on_marker(prompts, completions, **_):
    """A reward that never returns for a batch holding the completion "hang"."""
    if "hang" in completions:
        time.sleep(3600)
    return [1.0] * len(completions)


def die_on_marker(prompts, completions, **_):
    """A reward whose process is killed (SIGKILL) by the completion "die": only in workers."""
    if "die" in completions:
        os.kill(os.getpid(), signal.SIGKILL)
    return [1.0] * len(completions)


_batches = []


def hang_on_second_batch(prompts, completions, **fields):
    """The task reward, except that the second batch it is given never returns."""
    from tlt_jax import rewards

    _batches.append(len(completions))
    if len(_batches) == 2:
        time.sleep(3600)
    return rewards.task_reward(prompts, completions, **fields)


def exact_answer(prompts, completions, answer, **_):
    """A reward of one's own, as a config names it: reward=tests.support.rewards:exact_answer."""
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


not_a_reward = 0.5  # reward=tests.support.rewards:not_a_reward names something that is not callable


def raises_on_boom(prompts, completions, answer, **_):
    """Exact answers, except that a completion "boom" raises and "nan" scores NaN."""
    if "boom" in completions:
        raise RuntimeError("boom")
    return [float("nan") if c == "nan" else float(c.strip() == a) for c, a in zip(completions, answer)]


def logged(prompts, completions, answer, log, **_):
    """A checksum of the completion and its answer in [0, 1) (a score that varies on any
    text, a random model's too, and reads a field); each scored completion appended
    to the file of its field `log` (from whichever process scores it) with the time; a
    completion "sleep" first sleeps 5 s."""
    scores = []
    for completion, reference, path in zip(completions, answer, log):
        if completion == "sleep":
            time.sleep(5)
        with open(path, "a") as f:
            f.write(f"{completion!r} {time.time()!r}\n")
        scores.append((sum(map(ord, completion)) * 31 + sum(map(ord, reference))) % 97 / 97)
    return scores
