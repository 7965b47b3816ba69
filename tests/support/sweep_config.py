"""The swept config of tests/test_launch.py's sweep test."""
from ml_collections import ConfigDict


def get_config(arg=""):
    return ConfigDict({"lr": 0.1, "seed": 0, "fail": False, "run_dir": ""})


def get_sweep(arg=""):
    return [{"lr": lr, "seed": seed} for lr in (0.1, 0.2) for seed in (0, 1)] + [{"seed": 9, "fail": True}]
