#!/usr/bin/env bash
# The README's first command: set up (idempotent), then run the main job on the default
# store: snapshot a real source tree (this repository, or the directory given), list, diff
# against a changed copy, materialize back and show the trees are equal. See mainjob.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/mainjob.py "$@"
