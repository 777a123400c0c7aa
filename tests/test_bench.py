"""bench.py on tiny shapes: it must keep running as mha.py changes, and its contradiction checks must fire."""

import os
import subprocess
import sys

import torch

import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_forward_times_compares_both_paths_with_pytorch_s_own():
    times = bench.forward_times(2, 8, 64, 4, rounds=3)
    assert len(times) == 4 and all(len(t) == 3 and min(t) > 0 for t in times)


def test_decode_times_measures_every_kind_its_reads_and_the_matmul():
    steps, parts, alone, reads, shared, copy, flops, weights = bench.decode_times(64, h=32, dh=4, rounds=2)
    assert list(steps) == list(parts) == list(alone) == list(reads) == list(bench.KINDS)
    timed = [*steps.values(), *parts.values(), *alone.values(), *reads.values(), shared, copy]
    assert all(len(t) == 2 and min(t) > 0 for t in timed)
    assert 1e8 < flops < 1e14
    d = 32 * 4                                   # in_proj (h + 2 kv) dh rows and out_proj d rows, with biases
    assert weights["MHA"] == 4 * ((32 + 2 * 32) * 4 * (d + 1) + d * (d + 1))
    assert weights["MQA"] == 4 * ((32 + 2 * 1) * 4 * (d + 1) + d * (d + 1))


def test_products_are_the_steps_products():
    """products() is mha.attend's two matmuls without scale, mask and softmax: checked against the formula."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 8, 1, 16, dtype=torch.float64), *torch.randn(2, 1, 2, 5, 16, dtype=torch.float64)
    scores = q.view(1, 2, 4, 16) @ k.transpose(-1, -2)     # each K/V head against its 4 query heads
    assert torch.allclose(bench.products(q, k, v), (scores @ v).view(2, 4, 16), atol=1e-12)


def test_scattered_rounds_are_a_contradiction(monkeypatch):
    monkeypatch.setattr(bench, "CONTRADICTIONS", [])
    assert bench.ratio([2, 2, 2, 2], [1, 1, 1, 1], "steady") == 2.0 and bench.CONTRADICTIONS == []
    bench.ratio([1, 2, 4, 8], [1, 1, 1, 1], "busy")
    assert bench.CONTRADICTIONS == ["busy: rounds scatter from 2.00 to 8.00"]


def test_an_order_against_the_bytes_is_a_contradiction(monkeypatch):
    monkeypatch.setattr(bench, "CONTRADICTIONS", [])
    bench.check_order({"MHA": [4.0], "GQA-8": [1.0], "MQA": [0.5]}, "attention", 4096)
    assert bench.CONTRADICTIONS == []
    bench.check_order({"MHA": [4.0], "GQA-8": [1.0], "MQA": [5.0]}, "attention", 4096)
    assert bench.CONTRADICTIONS == ["attention at 4096 tokens: MQA slower than GQA-8"]


def test_help_is_help_not_a_run():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--help"], check=False, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: bench.py") and "torch " not in r.stdout


def test_a_bad_flag_is_one_line():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--rounds", "3"], check=False, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == "bench.py: error: unrecognized arguments: --rounds 3\n"


def test_a_reader_that_goes_away_ends_it_quietly():
    """python bench.py | head -1: the first line, then a quiet exit, no traceback."""
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "bench.py")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    first = p.stdout.readline()
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=300) == 1 and first.startswith(b"torch ") and err == b"", err.decode()
