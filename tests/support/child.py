"""Checks that import a launcher run in a Python process of their own: launchers define absl
flags, and two of them that share a flag name cannot live in one test process."""
import json
import subprocess
import sys


def printed_json(script: str, *args: str):
    """What `python -c script args` printed as JSON on its last line (it must exit 0)."""
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])
