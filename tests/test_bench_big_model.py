"""bench.big_model's memory figures, on this process and on made-up maps (the benchmark itself,
85 M parameters and 12 GiB of RAM, is not run in CI: docs/benchmarks.md, "A model of real size")."""

from __future__ import annotations

import mmap
import os

import numpy as np

from bench.big_model import beside, proc_memory


def test_a_model_sized_buffer_is_counted_apart_and_a_files_pages_as_shareable(tmp_path):
    buffer = np.ones(80 << 18, dtype=np.float32)  # 80 MiB, anonymous, every page touched
    path = tmp_path / "library.so"
    path.write_bytes(os.urandom(8 << 20))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert sum(m[i] for i in range(0, len(m), 4096)) >= 0  # every page read once
        mine = proc_memory(os.getpid(), large=64 << 20)
    assert 80 <= mine["model_buffers"] < 81, mine
    assert mine["files"][str(path)] >= 7.9, mine["files"]  # read, not written: shareable with others
    # What only this process holds, outside the buffer: the interpreter's heap, numpy's, not the file's.
    assert 0 < mine["own"] < mine["anon"] - 79, mine
    assert mine["rss"] >= mine["model_buffers"] + mine["own"] + mine["files"][str(path)] - 1, mine
    del buffer


def test_beside_a_script_counts_only_the_pages_of_a_file_beyond_the_scripts():
    files = {"/lib/libtorch.so": 100.0, "/bin/p2pd": 30.0, "/lib/libc.so": 2.0}
    script = {"/lib/libtorch.so": 120.0, "/lib/libc.so": 1.5, "/data/batch.bin": 50.0}
    # libtorch: the script holds more of it (0 added); p2pd: the script holds none (30); libc: 0.5.
    assert beside(40.0, files, script) == 70.5
    assert beside(40.0, files, {}) == 172.0  # no script beside: every page is the daemon's
