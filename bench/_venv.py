#!/usr/bin/env python3
"""bench/.venv: create it, install the pinned requirements, re-run a script inside it.

Standard library only. Every bench Python script calls `ensure()` before its third-party imports:
when the running interpreter is not bench/.venv's, the venv is created (python3 -m venv) when
missing, bench/reference/requirements.txt and bench/requirements-plot.txt are installed with pip
whenever their contents changed (a hash is kept in .venv/.requirements.sha256), and the script
is exec'd again with the venv's python and the same arguments. A file lock keeps two scripts that
start at once from installing twice.

    python3 bench/_venv.py      # just make sure the venv is ready; prints its python path
"""

import fcntl
import hashlib
import os
import subprocess
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
VENV = os.path.join(BENCH, ".venv")
PYTHON = os.path.join(VENV, "bin", "python")
REQUIREMENTS = [
    os.path.join(BENCH, "reference", "requirements.txt"),
    os.path.join(BENCH, "requirements-plot.txt"),
]
STAMP = os.path.join(VENV, ".requirements.sha256")


def _digest():
    h = hashlib.sha256()
    for path in REQUIREMENTS:
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def prepare():
    """Creates/updates bench/.venv; returns its python path."""
    os.makedirs(VENV, exist_ok=True)
    with open(os.path.join(VENV, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(PYTHON):
            print("[bench] creating bench/.venv", file=sys.stderr)
            subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
        want = _digest()
        have = open(STAMP).read().strip() if os.path.exists(STAMP) else ""
        if have != want:
            print("[bench] installing pinned requirements into bench/.venv", file=sys.stderr)
            args = [PYTHON, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
            for path in REQUIREMENTS:
                args += ["-r", path]
            subprocess.run(args, check=True, stdout=sys.stderr)
            with open(STAMP, "w") as f:
                f.write(want + "\n")
    return PYTHON


def ensure():
    """Re-executes the calling script inside bench/.venv unless it already runs there."""
    if os.path.realpath(sys.prefix) == os.path.realpath(VENV):
        return
    python = prepare()
    os.execv(python, [python] + sys.argv)


if __name__ == "__main__":
    print(prepare())
