"""A launcher for tests/test_launch.py's sweep test: writes its process id and config
into its run directory, and fails where the config says so."""
import json
import os

from absl import app
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "tests/support/sweep_config.py")


def main(argv):
    del argv
    config = _CONFIG.value
    os.makedirs(config.run_dir, exist_ok=True)
    with open(os.path.join(config.run_dir, "point.json"), "w") as f:
        json.dump({"pid": os.getpid(), "config": config.to_dict()}, f)
    if config.fail:
        raise SystemExit(3)


if __name__ == "__main__":
    app.run(main)
