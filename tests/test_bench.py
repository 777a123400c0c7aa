"""bench.py on tiny shapes: it must keep running as mha.py changes, and its contradiction checks must fire."""

import bench


def test_forward_times_compares_both_sides():
    ours, torch_s = bench.forward_times(2, 8, 64, 4, rounds=3)
    assert len(ours) == len(torch_s) == 3 and min(ours) > 0 and min(torch_s) > 0


def test_decode_times_measures_every_kind_and_both_ceilings():
    steps, parts, shared, copied, ceilings = bench.decode_times(64, h=32, dh=4, rounds=2)
    assert list(steps) == list(parts) == list(bench.KINDS)
    assert all(len(t) == 2 and min(t) > 0 for t in [*steps.values(), *parts.values(), shared, copied])
    assert 1e8 < ceilings.bandwidth < 1e13 and 1e8 < ceilings.flops < 1e14


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

