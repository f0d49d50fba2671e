#!/usr/bin/env bash
# The README's test command: set up (idempotent) and run the whole test suite on the
# patched pyfuse3 (scripts/pyfuse3/), then a subset on the stock pyfuse3 (installed by
# setup.sh into .venv/pyfuse3-stock and put first on PYTHONPATH, daemons included).
# Arguments go to the first run only; with arguments the stock run is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
stock_subset=(tests/test_fuse_kernel_cache.py tests/test_fuse_ops.py tests/test_fuse_io.py
              tests/test_restore_live.py tests/test_checkpoint_live.py)
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
fi
REWINDFS_EXPECT_BINDING=patched .venv/bin/python -m pytest -q -p no:cacheprovider
echo "test.sh: the subset on the stock pyfuse3 (.venv/pyfuse3-stock)"
PYTHONPATH="$PWD/.venv/pyfuse3-stock${PYTHONPATH:+:$PYTHONPATH}" REWINDFS_EXPECT_BINDING=stock \
  exec .venv/bin/python -m pytest -q -p no:cacheprovider "${stock_subset[@]}"
