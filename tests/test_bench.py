"""bench.py on tiny shapes: it must keep running as mha.py changes, and its contradiction checks must fire."""

import os
import subprocess
import sys

import torch

import bench
import mha

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


def fake_decode_times(parts_over_floor):
    """decode_times as a quiet machine with a 40 GB/s read and a 160 GFLOP/s matmul would measure it at 4096
    tokens: each attention parts_over_floor[kind] x its roofline floor, each whole step 2 x its own floor."""
    def decode_times(S, h, dh):
        flops, memory = 160e9, 40e9
        kv_bytes = {kind: mha.decode_bytes(kv, dh, S) for kind, kv in bench.KINDS.items()}
        weights = dict.fromkeys(bench.KINDS, 10**6)
        ceilings = mha.Ceilings(bandwidth=memory, flops=flops)
        floors = {kind: mha.roofline(mha.decode_flops(h, dh, S), n, ceilings)[0] for kind, n in kv_bytes.items()}
        steps = {kind: [2 * (weights[kind] + n) / memory] * 3 for kind, n in kv_bytes.items()}
        parts = {kind: [parts_over_floor[kind] * floors[kind]] * 3 for kind in bench.KINDS}
        alone = {kind: [0.9 * t for t in parts[kind]] for kind in bench.KINDS}
        reads = {kind: [n / memory] * 3 for kind, n in kv_bytes.items()}
        return steps, parts, alone, reads, [1e-3] * 3, [1e-2] * 3, flops, weights
    return decode_times


def test_the_decode_goals_follow_from_the_floors(monkeypatch, capsys):
    """At 4096 tokens MHA's floor is its read, 134 MB / 40 GB/s = 3.36 ms, and MQA's its FLOPs, 67 MFLOP / 160
    GFLOP/s = 0.42 ms: MQA's attention must be 0.2 x 8 = 1.6x faster than MHA's. Each at twice its floor: 8x."""
    monkeypatch.setattr(bench, "CONTRADICTIONS", [])
    monkeypatch.setattr(bench, "decode_times", fake_decode_times({"MHA": 2.0, "GQA-8": 2.0, "MQA": 2.0}))
    bench.bench_decode(contexts=(4096,))
    out = capsys.readouterr().out
    assert "every attention reaches at least 50% of its floor: goal met (>= 20%)" in out
    assert "MQA attention 8.0x faster than MHA: goal met (>= 1.6x)" in out
    assert "without copying K/V 1.000 ms, copied to 32 heads first 10.000 ms: 10.0x, goal met (>= 5x)" in out
    assert bench.CONTRADICTIONS == []


def test_an_attention_below_its_floor_is_a_contradiction(monkeypatch, capsys):
    monkeypatch.setattr(bench, "CONTRADICTIONS", [])
    monkeypatch.setattr(bench, "decode_times", fake_decode_times({"MHA": 2.0, "GQA-8": 2.0, "MQA": 0.5}))
    bench.bench_decode(contexts=(4096,))
    assert "every attention reaches at least 50% of its floor" in capsys.readouterr().out
    assert bench.CONTRADICTIONS == ["attention MQA at 4096 tokens 50% below its floor"]
