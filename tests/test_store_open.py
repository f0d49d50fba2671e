"""Opening a store from several processes at once."""

import subprocess
import sys


def test_concurrent_first_open(tmp_path):
    root = tmp_path / "store"
    code = ("import sys; from store.objects import Store; s = Store(sys.argv[1]); "
            "s.list_snapshots(); print(s.chunk_size)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(root)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(6)]
    results = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err
        assert out.strip() == str(1 << 20)
