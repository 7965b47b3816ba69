"""The adaptive drafter's bars read off one seed (experiments/tlt_bars.py)."""
from experiments import tlt_bars


def _mode(acceptance, evals=(0.02, 0.9), rewards=(0.3,) * 6 + (0.8,) * 6, kl=(0.0,) * 6 + (0.04,) * 6,
          digests=tuple(range(12))):
    return dict(eval_accuracy=list(evals), reward_mean=list(rewards), samples_digest=list(digests),
                thirds=dict(acceptance_length=tlt_bars.thirds(list(acceptance)),
                            policy_kl_from_start=tlt_bars.thirds(list(kl))))


def _result(**modes):
    return dict(preset="cpu_drift_learn", seed=7, decode_mlp_size=0, modes=modes)


def _by_bar(result):
    return [v.passed for v in tlt_bars.verdicts(result)]


def test_a_seed_that_meets_every_bar_passes_each_and_speed_is_not_measured_unpadded():
    result = _result(baseline=_mode([0.0] * 12), tlt=_mode([3.2] * 12), frozen=_mode([3.2] * 4 + [2.9] * 4 + [2.2] * 4),
                     scratch=_mode([2.7] * 12))
    assert _by_bar(result) == [True] * 7 + [None]


def test_each_bar_fails_on_its_own_fault():
    good = dict(baseline=_mode([0.0] * 12), tlt=_mode([3.2] * 12), frozen=_mode([3.2] * 4 + [2.9] * 4 + [2.2] * 4),
                scratch=_mode([2.7] * 12))
    faults = {
        0: dict(tlt=_mode([3.2] * 12, evals=(0.02, 0.10)),  # learned too little: in every mode, else
                baseline=_mode([0.0] * 12, evals=(0.02, 0.10)), frozen=_mode([3.2] * 4 + [2.9] * 4 + [2.2] * 4,
                                                                      evals=(0.02, 0.10)),
                scratch=_mode([2.7] * 12, evals=(0.02, 0.10))),  # learning differs between them
        1: dict(tlt=_mode([3.2] * 12, rewards=(0.8,) * 6 + (0.3,) * 6)),  # collapsed
        2: dict(tlt=_mode([3.2] * 12, kl=(0.04,) * 6 + (0.0,) * 6)),  # moved back
        3: dict(frozen=_mode([3.0] * 4 + [2.9] * 4 + [2.7] * 4), tlt=_mode([3.6] * 12),
                scratch=_mode([3.0] * 12)),  # frozen falls 10%
        4: dict(tlt=_mode([2.6] * 12)),  # 1.18x frozen
        5: dict(scratch=_mode([2.4] * 12)),  # 0.75x TLT
        6: dict(scratch=_mode([2.7] * 12, digests=tuple(range(11)) + (99,))),  # one step drew other samples
    }
    for bar, change in faults.items():
        passed = _by_bar(_result(**{**good, **change}))
        assert passed[bar] is False, (bar, passed)
        assert all(p is not False for i, p in enumerate(passed) if i != bar), (bar, passed)


def test_a_bar_whose_modes_did_not_run_is_not_measured_never_passed():
    passed = _by_bar(_result(baseline=_mode([0.0] * 12)))
    assert passed[3:6] == [None, None, None] and passed[6] is None


def test_speed_needs_the_weight_bound_regime():
    modes = dict(tlt=_mode([3.2] * 12), frozen=_mode([3.2] * 4 + [2.9] * 4 + [2.2] * 4))
    versus = dict(rollout_tokens_per_s_last_third=1.3)
    failed_check = dict(_result(**modes), decode_mlp_size=4096, regime=dict(passed=False, spread=0.3),
                        tlt_versus_frozen=versus)
    assert tlt_bars.verdicts(failed_check)[-1].passed is None
    weight_bound = dict(failed_check, regime=dict(passed=True, spread=0.05))
    assert tlt_bars.verdicts(weight_bound)[-1].passed is True
    slow = dict(weight_bound, tlt_versus_frozen=dict(rollout_tokens_per_s_last_third=1.1))
    assert tlt_bars.verdicts(slow)[-1].passed is False
