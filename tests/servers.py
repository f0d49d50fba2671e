"""The real servers of the shared-mode tests: ``scripts/localservers.py`` (one definition,
shared with the main job's ``--shared`` walk-through and the benchmarks), under the name
the fixtures in conftest.py and the tests import."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from localservers import (  # noqa: E402
    S3_ACCESS_KEY,
    S3_SECRET_KEY,
    PostgresCluster,
    SeaweedS3,
    free_port,
    weed_binary,
)

__all__ = ["S3_ACCESS_KEY", "S3_SECRET_KEY", "PostgresCluster", "SeaweedS3", "free_port",
           "weed_binary"]
