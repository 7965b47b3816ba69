"""experiments.cache_ranking (bench_distill_caches' arithmetic): the arms it trains, the paired tie rule and the ranking
it reports (the training itself is the distillation trainer's, tested in test_distill.py)."""
import numpy as np
import pytest

from experiments import cache_ranking as bench


def test_arms_at_the_whole_vocabulary_are_the_exact_teacher():
    arms = bench.arms_for([2, 0], 37, ["topk", "topk_tail", "sampled"])
    assert arms == [("topk", 2), ("topk_tail", 2), ("sampled", 2), ("exact", 37), ("sampled", 37)]
    assert bench.arms_for([37], 37, ["topk"], sampled_at_v=True) == [("exact", 37)]
    assert bench.arms_for([8], 37, ["sampled"], sampled_at_v=False) == [("sampled", 8)]
    with pytest.raises(ValueError, match="K=40 must lie in"):
        bench.arms_for([40], 37, ["topk"])
    with pytest.raises(ValueError, match="not arms"):
        bench.arms_for([8], 37, ["top"])


def test_a_paired_difference_within_two_standard_errors_is_a_tie():
    base = np.array([0.10, 0.20, 0.15, 0.12])
    # The same shift on every seed: no spread, so any shift is beyond noise.
    assert not bench.paired(base - 0.01, base)["tie"]
    # Shifts of both signs around a small mean: a tie, though the means differ.
    mixed = bench.paired(base + np.array([0.05, -0.04, 0.03, -0.03]), base)
    assert mixed["tie"] and mixed["diff"] == pytest.approx(0.0025)
    assert bench.paired(base, base)["se"] == 0.0


def test_rank_orders_by_mean_and_names_ties_and_wins():
    arms = [{"name": "a", "eval_kl": [0.30, 0.31, 0.29]}, {"name": "b", "eval_kl": [0.10, 0.11, 0.12]},
            {"name": "c", "eval_kl": [0.11, 0.10, 0.13]}]
    order = bench.rank(arms)
    assert [a["name"] for a in order] == ["b", "c", "a"]
    b, c, a = order
    assert [x["arm"] for x in b["ties"]] == ["c"] and [x["arm"] for x in b["beats"]] == ["a"]
    assert [x["arm"] for x in a["beaten_by"]] == ["b", "c"] and not a["beats"]


def test_cache_bytes_are_the_same_for_either_kind():
    assert bench.cache_bytes(8, "float32") == 8 * (4 + 4)
    assert bench.cache_bytes(100, "bfloat16") == 100 * (4 + 2)
