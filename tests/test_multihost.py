"""The RL job as two processes on one machine (jax.distributed, 4 simulated CPU devices each,
CPU collectives across processes through gloo) against one process of 8 devices on the
same mesh (data=2 rollout groups, fsdp=4): the same learning, checkpoints that cross from
two processes to one and back, and bad multi-host input refused in one line."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from tests.rl.test_train import warm_start  # noqa: F401 (a fixture: a small random policy)
from tests.support import REPO, xla_flags
from tlt_jax import metrics
from tlt_jax.rl.train import learning_metrics

CONFIG = "--config=tests/support/multihost_config.py:tlt"  # TLT on, every learning metric a function of the seed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(processes: int, *args: str) -> list[subprocess.Popen]:
    """`experiments.train_rl` as one process of 8 devices or `processes` of 8 / processes."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags(8 // processes))
    common = [sys.executable, "-m", "experiments.train_rl", *args]
    if processes == 1:
        return [subprocess.Popen(common, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)]
    port = _free_port()
    return [subprocess.Popen([*common, f"--coordinator_address=localhost:{port}", f"--num_processes={processes}",
                              f"--process_id={i}"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for i in range(processes)]


def _finish(*groups: list[subprocess.Popen], timeout: float = 1200,
            failing: bool = False) -> list[list[tuple[int, str, str]]]:
    """Waits for every process; once one fails (unless all are expected to: `failing`),
    kills the others (a process whose peer died waits for it at the next collective).
    Returns (returncode, stdout, stderr) each."""
    procs = [p for g in groups for p in g]
    deadline = time.time() + timeout
    while any(p.poll() is None for p in procs):
        if time.time() > deadline or not failing and any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.5)
    return [[(p.wait(), *p.communicate()) for p in g] for g in groups]


def _check_ok(results):
    for rc, _, err in results:
        assert rc == 0, err[-4000:]


def _records(run_dir) -> dict:
    """step -> metrics record; each step written once."""
    records = metrics.read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), steps
    return {r["step"]: r for r in records}


def _pulls(record) -> dict:
    return {k: v for k, v in record.items() if k.startswith("tuner/") and k.endswith("/pulls")}


def _assert_same_learning(a: dict, b: dict, skip=()):
    """Learning metrics equal to float rounding (the collectives of one process and of two
    sum in different orders), the tuner's pulls and the drafter version exactly."""
    la = {k: v for k, v in learning_metrics(a).items() if k not in ("wall_time", *skip)}
    lb = {k: v for k, v in learning_metrics(b).items() if k not in ("wall_time", *skip)}
    assert sorted(la) == sorted(lb)
    for k in la:
        assert la[k] == pytest.approx(lb[k], rel=1e-4, abs=1e-5), (a["step"], k, la[k], lb[k])
    assert _pulls(a) == _pulls(b) and sum(_pulls(a).values()) > 0
    assert a.get("drafter_version") == b.get("drafter_version")


@pytest.mark.costly
def test_two_processes_learn_as_one_and_checkpoints_cross_between_them(warm_start, tmp_path):  # noqa: F811
    """Steps 1-2 with two updates a step (an old-policy pass first), from the start; step 3
    resumed across the process count with one update (on-policy: no old-policy pass, the
    update's own forward gives the old log-probs and the drafter's data, gathered from both
    processes to process 0's buffer)."""
    # The launches share the launchers' compilation cache and run one after the other, so
    # that each loads the programs the runs before it compiled (a rollout group's programs
    # are the same in one process and in two): launched at once, each compiles them again.
    config = (CONFIG, f"--config.model_dir={warm_start}")
    on_policy = ("--config.steps=3", "--config.learner.num_minibatches=1",
                 "--config.resume_changes=learner.num_minibatches")
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    first = _finish(_launch(1, *config, f"--config.run_dir={one}", "--config.steps=2"))
    first += _finish(_launch(2, *config, f"--config.run_dir={two}", "--config.steps=2"))
    for results in first:
        _check_ok(results)
    summaries = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in first[1]]
    assert summaries[0] == summaries[1]  # every process reports process 0's summary

    # Crossing over: one process takes the two processes' run from step 2 to step 3, two
    # processes a copy of the one process's; the one process's own run goes on alone (the
    # reference), first: it compiles the one-update programs the others load.
    crossed = str(tmp_path / "one_then_two")
    shutil.copytree(one, crossed)
    second = _finish(_launch(1, *config, f"--config.run_dir={one}", *on_policy))
    second += _finish(_launch(2, *config, f"--config.run_dir={crossed}", *on_policy))
    second += _finish(_launch(1, *config, f"--config.run_dir={two}", *on_policy))
    for results in second:
        _check_ok(results)
        assert "Resumed" in results[0][2]  # process 0 reports

    reference, two_then_one, one_then_two = _records(one), _records(two), _records(crossed)
    assert sorted(reference) == sorted(two_then_one) == sorted(one_then_two) == [0, 1, 2, 3]
    for key in ("eval_accuracy", "eval_length_mean"):  # the warm start's evaluation
        assert reference[0][key] == two_then_one[0][key]
    for step in (1, 2):  # two processes from the start
        assert reference[step]["time_old_logp_s"] > 0 and two_then_one[step]["time_old_logp_s"] > 0
        _assert_same_learning(reference[step], two_then_one[step],
                              skip=[k for k in two_then_one[step] if k.startswith("eval_")])
    for records in (two_then_one, one_then_two):  # resumed across the process count, on-policy
        _assert_same_learning(reference[3], records[3])
        assert reference[3]["time_old_logp_s"] == records[3]["time_old_logp_s"] == 0
        assert records[3]["buffer_rows"] == reference[3]["buffer_rows"] > 0
    assert [reference[s]["drafter_version"] for s in (1, 2, 3)] == [1, 2, 3]
    assert all(reference[s]["speculative_token_share"] > 0 and reference[s]["loss"] != 0 for s in (1, 2, 3))
    # Process 0 alone wrote the plots and exports.
    for run_dir in (two, crossed):
        for name in ("reward.png", "tlt.png", "rollout_timeline.png", "result.json", "drafter"):
            assert os.path.exists(os.path.join(run_dir, name)), name


def _one_line_error(result, *expected):
    rc, _, err = result
    assert rc == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("Error: ")]
    assert len(lines) == 1, err[-3000:]
    for text in expected:
        assert text in lines[0], lines[0]


def test_bad_multihost_input_is_one_line_naming_the_flag(tmp_path):
    run = f"--config.run_dir={tmp_path / 'run'}"
    port = _free_port()
    out_of_range = subprocess.run(
        [sys.executable, "-m", "experiments.train_rl", CONFIG, run, f"--coordinator_address=localhost:{port}",
         "--num_processes=2", "--process_id=2"], cwd=REPO, capture_output=True, text=True, timeout=300)
    _one_line_error((out_of_range.returncode, out_of_range.stdout, out_of_range.stderr), "--process_id=2",
                    "--num_processes=2")

    # Process 1 of 2 with no process 0 anywhere: a timeout with a message, not a hang.
    t0 = time.time()
    alone = subprocess.run(
        [sys.executable, "-m", "experiments.train_rl", CONFIG, run, f"--coordinator_address=localhost:{port}",
         "--num_processes=2", "--process_id=1", "--coordinator_timeout=5"], cwd=REPO, capture_output=True,
        text=True, timeout=300)
    assert time.time() - t0 < 120
    _one_line_error((alone.returncode, alone.stdout, alone.stderr), "no coordinator answered",
                    f"--coordinator_address=localhost:{port}", "--coordinator_timeout=5")

    # Meshes that do not fit two processes of 4 devices: 12 devices, and a rollout group on both.
    for mesh, expected in ((("--config.mesh.data=3", "--config.mesh.fsdp=4"), ("mesh.data=3", "8 are available")),
                           (("--config.mesh.data=1", "--config.mesh.fsdp=8"), ("mesh.data=1", "multiple of 2"))):
        for result in _finish(_launch(2, CONFIG, run, *mesh), timeout=300, failing=True)[0]:
            _one_line_error(result, *expected)
    assert not os.path.exists(tmp_path / "run")
