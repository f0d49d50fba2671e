#!/usr/bin/env bash
# The README's first command: set up (idempotent), then run the main job on the default
# store: a session on a real project (this repository, or the directory given; --sdist for
# the benchmarks' Django sdist), git and the project's tests in the mount, checkpoint, break,
# diff, restore, a read-only mount of an old checkpoint, shutdown. See mainjob.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/mainjob.py "$@"
