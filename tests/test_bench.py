"""bench.py on tiny shapes: it must keep running as mha.py changes (its numbers are not judged here)."""

import bench
import mha


def test_forward_times_compares_both_sides():
    ours, torch_s = bench.forward_times(2, 8, 64, 4)
    assert ours > 0 and torch_s > 0


def test_decode_times_measures_every_kind():
    steps, parts, shared, copied, cache_bytes = bench.decode_times(64, h=32, dh=4)
    assert list(steps) == list(parts) == list(bench.KINDS)
    assert min(steps.values()) > 0 and min(parts.values()) > 0 and shared > 0 and copied > 0
    assert cache_bytes == mha.kv_cache_bytes(1, 32, 4, 64, bytes_per_elem=4)
