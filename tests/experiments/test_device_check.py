"""experiments/device_check.sh on the CPU. `DRY=1` runs every block's commands (the same
launchers and flags, tiny sizes, a few steps; "DRY: ..." where a GPU-only path falls back)
once for the module, about 3 minutes on two cores; the tests read its exit lines, its JSON
(every field the summary table reads) and the table it ends with. `PLAN=1` checks the GPU
budget without running anything."""
import json
import os
import re
import subprocess
import sys

import pytest

from experiments import device_summary
from tests.support import REPO, xla_flags

SCRIPT = "experiments/device_check.sh"
BLOCKS = ("spec", "tlt", "rollout", "attention", "verify", "losses", "distill32k")  # least measured first
JSON = {"spec": ["bench_spec.json"], "tlt": ["bench_tlt.json"], "rollout": ["bench_rollout.json"],
        "attention": ["bench_attention.json", "bench_attention_segments.json"], "verify": ["bench_verify.json"],
        "losses": ["bench_kl.json"], "distill32k": ["plan_distill_32k.json"]}


def _env(**extra):
    env = dict(os.environ)
    # One CPU device, as the H200 run has one GPU (conftest's 8 are for sharding tests).
    env["XLA_FLAGS"] = xla_flags()
    for name in ("BLOCKS", "OUT", "DRY", "PLAN", "PACK", "DRY_TIMEOUT", "SPEC_ARGS", "TLT_ARGS", "VERIFY_ARGS",
                 "LOSSES_ARGS"):
        env.pop(name, None)
    # Every command under this interpreter, and a `python` first on PATH that fails: a command
    # that took PATH's would fail its block.
    stub = os.path.join(REPO, "tests", "support", "no_python")
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", PYTHON=sys.executable,
               PATH=f"{stub}{os.pathsep}{env.get('PATH', '')}", **extra)
    return env


def _run(timeout, **extra):
    return subprocess.run(["bash", SCRIPT], cwd=REPO, env=_env(**extra), capture_output=True, text=True,
                          timeout=timeout)


# One xdist worker runs this module (setup.cfg: --dist loadgroup), so its module fixture
# (the dry run) is built once, not once per worker.
pytestmark = pytest.mark.xdist_group("test_device_check")


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("device_check_dry")
    # The whole script: 7.5 min alone on a slow 2-core machine, more beside other tests.
    done = _run(1200, DRY="1", OUT=str(out), DRY_TIMEOUT="300")
    return done, str(out)


def _explain(done):
    return f"exit {done.returncode}\n--- stdout\n{done.stdout[-6000:]}\n--- stderr\n{done.stderr[-3000:]}"


def _block_output(stdout, block):
    """What the script printed for a block: its notes, its logs' tails and its exit line."""
    match = re.search(rf"^== block {block}$(.*?)^block {block}: .*?$", stdout, re.M | re.S)
    return match.group(0) if match else f"(no output for block {block})"


def test_every_block_runs_on_the_cpu_and_exits_ok(dry):
    done, out = dry
    for block in BLOCKS:
        assert re.search(rf"^block {block}: ok \(\d+ s\)$", done.stdout, re.M), (
            _block_output(done.stdout, block)[-4000:] + "\n" + _explain(done))
    exits = [line.split(":")[0] for line in done.stdout.splitlines() if line.startswith("block ")]
    assert exits == [f"block {b}" for b in BLOCKS], "one exit line per block, in the order of the script"
    assert done.returncode == 0, _explain(done)
    for block in BLOCKS:
        for name in JSON[block]:
            with open(os.path.join(out, name)) as f:
                assert json.load(f)["backend"] == "cpu", name


def test_the_log_says_what_falls_back_from_the_gpu(dry):
    done, _ = dry
    notes = "\n".join(line for line in done.stdout.splitlines() if line.startswith("DRY: "))
    for what in ("nvidia-smi", "cuDNN", "interpret mode", "no Triton lowering", "no device memory stats",
                 "transformers on the CPU"):
        assert what in notes, what


def test_the_json_has_every_field_the_summary_reads(dry):
    _, out = dry
    rows = device_summary.evaluate(out)
    assert [r["name"] for r in rows] == [b.name for b in device_summary.BARS]
    missing = [f"{r['name']}: {r['where']}" for r in rows if r["status"] == "missing"]
    assert not missing, missing
    # Only the device peaks have no CPU counterpart, and the speculation efficiency comes from
    # bench_spec --breakdown, which the default spec block leaves out (SPEC_ARGS names it);
    # every other bar has a value to compare.
    assert {r["name"] for r in rows if r["status"] == "n/a"} <= {
        "KL peak at 256k tokens (GiB)", "distill 3.2B at 32k, peak (GB)", "spec efficiency, batch 1-8",
        "spec efficiency, batch 32-64"}
    assert {r["block"] for r in rows} == set(BLOCKS)


def test_the_script_ends_with_one_table_of_every_bar(dry):
    done, out = dry
    lines = done.stdout.rstrip().splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("bar ") and "target" in line)
    table = lines[start + 1:]
    for bar in device_summary.BARS:
        row = next((line for line in table if line.startswith(bar.name + " ")), None)
        assert row is not None, f"{bar.name} not in the table:\n" + "\n".join(table)
        assert f"{bar.op} {bar.target:g}" in row
        assert re.search(r"\s(pass|FAIL|n/a)\s", row), row
    assert table[-1].startswith("DRY: ")
    with open(os.path.join(out, "summary.json")) as f:
        assert len(json.load(f)["bars"]) == len(device_summary.BARS)
    assert os.path.exists(os.path.join(out, "device_check.tgz"))
    assert os.path.exists(os.path.join(out, "rollout_hlo.tgz"))


def test_the_bars_are_design_s():
    bars = {b.name: (b.op, b.target) for b in device_summary.BARS}
    assert bars["tlt step speed-up"] == (">=", 2.5)
    assert bars["spec speed-up (tokens/s)"] == (">=", 2.5)
    assert bars["spec acceptance length"] == bars["tlt acceptance length"] == (">=", 4.0)
    assert bars["decode roofline share"] == (">=", 0.6)
    assert bars["KL peak at 256k tokens (GiB)"] == ("<=", 7.0)
    assert bars["KL XLA temp, bf16 (GiB)"] == ("<=", 2.0)


def _plan(**extra):
    done = _run(60, PLAN="1", **extra)
    assert done.returncode == 0, _explain(done)
    total = int(re.search(r"^planned: (\d+) s in all", done.stdout, re.M).group(1))
    blocks = re.findall(r"^block (\w+):$", done.stdout, re.M)
    limits = [int(s) for s in re.findall(r"^\s*(\d+) s  ", done.stdout, re.M)]
    assert sum(limits) == total
    return done.stdout, total, blocks


def test_default_blocks_fit_eight_minutes_by_their_own_timeouts():
    out, total, blocks = _plan()
    assert blocks == ["spec", "tlt"]
    assert total <= 8 * 60, out
    assert "--preset=gpu" in out and "--dtype=bfloat16" in out
    _, _, every = _plan(BLOCKS=" ".join(reversed(BLOCKS)))
    assert every == list(BLOCKS), "the script runs its blocks in its own order, least measured first"


def test_a_block_cut_at_its_timeout_keeps_what_it_finished(tmp_path):
    """bench_kl is stopped mid-preset; its JSON (rewritten after every case) keeps the cases
    that finished, the exit line says so, and the summary still reads it."""
    # The Pallas cases too (the dry run leaves them out), at N=1024 only: the dense anchor and
    # the fused XLA path finish in about 10 s on two idle cores (the first case in 4 s; 6 s with
    # the machine's two cores busy with other tests, within the cut), then the Pallas kernels
    # in interpret mode run past the cut by about 40 s.
    done = _run(150, DRY="1", OUT=str(tmp_path), BLOCKS="losses", DRY_TIMEOUT="12",
                LOSSES_ARGS="--only=chunked_xla,pallas,anchor_dense --ns=1024")
    assert re.search(r"^block losses: timeout \(bench_kl stopped at its 12 s; kept what finished; \d+ s\)$",
                     done.stdout, re.M), _explain(done)
    assert done.returncode == 1
    with open(tmp_path / "bench_kl.json") as f:
        kl = json.load(f)
    assert not kl["complete"] and any(r["status"] == "ok" for r in kl["results"])
    rows = {r["name"]: r for r in device_summary.evaluate(str(tmp_path))}
    assert rows["KL throughput vs dense"]["status"] != "missing"
    assert rows["tlt step speed-up"]["status"] == "missing"  # the blocks not run
    assert "tlt step speed-up" in done.stdout
