"""decode.py: the roofline by hand, contradictions in made-up timings, a step without copies, the
step's parts, a tiny run. Untimed."""
import io
import os
import time

import pytest
import torch
from conftest import ROOT, run_main, run_script
from torch.profiler import ProfilerActivity, profile

import decode
import mha

KINDS = [("MHA", 32), ("GQA-8", 8), ("GQA-4", 4), ("MQA", 1)]   # Llama-7B's 32 query heads


# ------------------------------------------------------------------ the roofline
def test_flops_and_bytes_by_hand():
    assert decode.decode_flops(32, 128, 8192) == 4 * 32 * 8192 * 128 == 134217728
    # h, not kv: every query head computes
    assert decode.decode_flops(32, 64, 100) == 4 * 32 * 100 * 64
    # K and V, fp32
    assert decode.decode_bytes(32, 128, 8192) == 2 * 32 * 8192 * 128 * 4 == 268435456
    assert decode.decode_bytes(8, 64, 100) == 2 * 8 * 100 * 64 * 4     # kv heads are read, not h
    assert decode.decode_bytes(1, 128, 8192, bytes_per_elem=2) == 4194304   # the H100's 4.2 MB


def test_roofline_takes_the_slower_of_reading_and_computing():
    """The worked example: 20 GB/s and 100 GFLOP/s, MHA and MQA at 8192 tokens."""
    mha_floor = decode.roofline(134217728, 268435456, 20e9, 100e9)
    mqa_floor = decode.roofline(134217728, 8388608, 20e9, 100e9)
    assert mha_floor == (268435456 / 20e9, "memory")                   # 13.4 ms
    assert mqa_floor == (134217728 / 100e9, "compute")                 # 1.34 ms


def fake_timing(read_rate=40e9, flop_rate=160e9, contexts=(512, 1024, 8192), slower=1.5):
    """A Timing as a quiet machine would give it: every K and V read at read_rate, every step
    `slower` x its floor, its parts at the longest context 0.4, 0.1 and 0.4 of the step."""
    timing = decode.Timing(contexts, tuple(kv for _, kv in KINDS), {}, flop_rate)
    best, S = timing.best, max(contexts)
    for kv in timing.kv_heads:
        for s in contexts:
            best["read", kv, s] = decode.decode_bytes(kv, 128, s) / read_rate
            best["step", kv, s] = slower * timing.floor(kv, s)[0]
        best["textbook", kv, S], best["fused", kv, S] = 0.07, 0.004
        for part, share in [("q k^T", 0.4), ("softmax", 0.1), ("p v", 0.4)]:
            best[part, kv, S] = share * best["step", kv, S]
    return timing


def test_a_step_s_floor_comes_from_its_own_heads_and_its_own_read():
    timing = fake_timing(contexts=(512, 8192))        # 40 GB/s, 160 GFLOP/s
    assert timing.floor(32, 8192) == (268435456 / 40e9, "memory")     # MHA: 268 MB at 40 GB/s
    assert timing.floor(1, 8192) == (134217728 / 160e9, "compute")    # MQA: 134 MFLOP, 160 GFLOP/s
    timing.best["read", 1, 512] /= 4             # MQA's K and V at 512 tokens read 4x faster
    assert timing.read_rate(1, 512) == pytest.approx(160e9)
    assert timing.read_rate(1, 8192) == pytest.approx(40e9)


# ------------------------------------------------------------------ what no quiet machine shows
def test_contradictions_of_made_up_timings():
    timing = fake_timing()
    assert decode.contradictions(timing) == []
    timing.best["step", 32, 8192] *= 0.5         # MHA at 8192 tokens: 0.75 of its floor
    timing.best["step", 1, 1024] *= 20           # MQA at 1024 tokens: slower than GQA-4
    assert decode.contradictions(timing) == ["MQA is slower than GQA-4 at 1024 tokens",
                                             "MHA at 8192 tokens took 75% of its floor"]
    # Within the 10 % a quiet machine's rates may wobble; and at 512 tokens a step is mostly fixed
    # costs, so the order of the configurations is not checked there.
    timing = fake_timing(slower=0.95)
    timing.best["step", 1, 512] *= 20
    assert decode.contradictions(timing) == []
    timing.elsewhere = 0.9                       # another program held most of a core throughout
    assert decode.contradictions(timing) == ["other programs kept 0.9 cores busy"]


def test_measure_says_how_many_cores_other_programs_kept_busy(monkeypatch):
    """(wall clock, CPU seconds of other programs) from (0, 8) to (2, 10): 2 CPU seconds in 2 s,
    one core; nothing claimed where Linux's /proc/stat is not there."""
    clock = iter([(0.0, 8.0), (2.0, 10.0)])
    monkeypatch.setattr(decode, "seconds_elsewhere", lambda: next(clock))
    assert decode.measure(contexts=(16,), kv_heads=(1,), rounds=1).elsewhere == 1.0
    monkeypatch.setattr(decode, "seconds_elsewhere", lambda: None)
    assert decode.measure(contexts=(16,), kv_heads=(1,), rounds=1).elsewhere == 0.0


def test_other_programs_cpu_seconds_leave_out_idle_ticks_and_this_process_s(monkeypatch):
    """/proc/stat's first line counts ticks, here 100 a second: user nice system idle iowait irq
    softirq steal. 1000 busy ticks are 10 s, of which this process ran 4: others ran 6."""
    stat = "cpu  600 100 200 5000 300 50 40 10 0 0\n"
    monkeypatch.setattr(decode, "open", lambda path: io.StringIO(stat), raising=False)
    monkeypatch.setattr(os, "sysconf", lambda name: 100)
    monkeypatch.setattr(time, "process_time", lambda: 4.0)
    assert decode.seconds_elsewhere()[1] == pytest.approx(6.0)


# ------------------------------------------------------------------ the step that copies nothing
def largest_allocation(fn):
    """Bytes of the largest single allocation any operation makes while fn() runs, and the
    operations' names."""
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(e.self_cpu_memory_usage for e in prof.events()), {e.name for e in prof.events()}


@pytest.mark.parametrize("kv", [8, 4, 1])
def test_the_grouped_step_copies_no_k_or_v_and_the_textbook_does(kv):
    """A decode step of mha.attend_grouped allocates at most its scores (h x S numbers), never K
    or V; the textbook's repeat_interleave allocates K copied out to h heads (so this check can
    fail)."""
    h, S, dh = 8, 4096, 64
    q, k, v = torch.randn(1, h, 1, dh), torch.randn(1, kv, S, dh), torch.randn(1, kv, S, dh)
    grouped, names = largest_allocation(lambda: mha.attend_grouped(q, k, v))
    assert grouped <= h * S * 4 < k.nbytes and "aten::repeat_interleave" not in names, grouped
    textbook, names = largest_allocation(lambda: mha.attend_textbook(q, k, v))
    assert textbook >= h * S * dh * 4 and "aten::repeat_interleave" in names, textbook


def test_each_timed_call_gets_its_own_configuration_s_cache_and_context(monkeypatch):
    """Longest context first; at each, every configuration's read (K and V together), then every
    step; then the textbook and the fused call at the longest context, on the whole cache; then
    each configuration's three parts there."""
    timed = []

    def log(owner, name, what):                # owner.name, logging its last argument's shape
        real = getattr(owner, name)

        def logged(*args):
            timed.append((what, args[-1].shape))
            return real(*args)
        monkeypatch.setattr(owner, name, logged)

    log(torch, "sum", "read")
    log(mha, "attend_grouped", "step")
    log(mha, "attend_textbook", "textbook")
    log(decode, "fused", "fused")
    timing = decode.measure(contexts=(16, 32), kv_heads=(32, 1), rounds=2)
    one_round = []
    for S in (32, 16):                      # K and V (2, B, kv, S, dh) for a read, V for a step
        one_round += [("read", (2, 1, kv, S, 128)) for kv in (32, 1)]
        one_round += [("step", (1, kv, S, 128)) for kv in (32, 1)]
    one_round += [("textbook", (1, kv, 32, 128)) for kv in (32, 1)]
    one_round += [("fused", (1, kv, 32, 128)) for kv in (32, 1)]
    assert timed == 2 * one_round
    # Every call's best time is kept under what it timed, with its own kv and S.
    assert timing.contexts == (16, 32) and timing.kv_heads == (32, 1)
    at_longest = ["textbook", "fused", "q k^T", "softmax", "p v"]
    keys = [("matmul", None, None)] + [(what, kv, S) for what in ("read", "step")
                                       for kv in (32, 1) for S in (16, 32)]
    keys += [(what, kv, 32) for what in at_longest for kv in (32, 1)]
    assert sorted(timing.best, key=str) == sorted(keys, key=str)
    assert min(timing.best.values()) > 0


@pytest.mark.parametrize("kv", [32, 4, 1])
def test_the_parts_timed_are_the_step_s_own(kv):
    """Each part's arguments are what the part before it returns, and the last part returns
    mha.attend_grouped's output to the bit: the same operations on the same shapes."""
    q, k, v = torch.randn(1, 32, 1, 128), torch.randn(1, kv, 300, 128), torch.randn(1, kv, 300, 128)
    scores_part, softmax_part, values_part = decode.step_parts(q, k, v)
    (qk, scores_of, args), (softmax, softmax_of, (scores, dim)) = scores_part, softmax_part
    pv, values_of, (spec, p, v_in) = values_part
    assert [qk, softmax, pv] == ["q k^T", "softmax", "p v"] and dim == -1 and v_in is v
    assert torch.equal(scores_of(*args), scores) and torch.equal(softmax_of(scores, dim), p)
    o, weights = mha.attend_grouped(q, k, v)
    assert torch.equal(values_of(spec, p, v).reshape(o.shape), o)
    assert torch.equal(p.reshape(weights.shape), weights)


# ------------------------------------------------------------------ the script
def test_help():
    r = run_script(os.path.join(ROOT, "decode.py"), "--help")
    assert r.returncode == 0 and "--out-dir" in r.stdout and r.stderr == "", r.stderr


def test_an_out_dir_that_cannot_be_made_ends_in_one_line_before_any_timing(tmp_path, capsys,
                                                                            monkeypatch):
    monkeypatch.setattr(decode, "measure", lambda *args: pytest.fail("timed before the folder"))
    (tmp_path / "a_file").write_text("")
    bad = str(tmp_path / "a_file" / "figures")
    code, out, err = run_main(decode.main, ["--out-dir", bad], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1 and bad in err, err


def test_a_tiny_run_prints_its_tables_and_draws_its_figure(tmp_path, capsys, monkeypatch):
    """The whole run on two tiny contexts and two configurations, one round: no claim on the
    times themselves."""
    monkeypatch.setattr(decode, "CONTEXTS", (16, 32))
    monkeypatch.setattr(decode, "KV_HEADS", (32, 1))
    monkeypatch.setattr(decode, "ROUNDS", 1)
    assert decode.main(["--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(("MHA ", "MQA "))]
    steps = [line for line in lines if "%)" in line]
    # A time and a share of the floor at each S:
    assert len(steps) == 2 and all(len(line.split()) == 1 + 2 * 2 for line in steps)
    assert len([line for line in lines if len(line.split()) == 9]) == 2           # the parts
    assert len([line for line in lines if "x faster than copying" in line]) == 2
    assert ("NOT TRUSTWORTHY" in out) != ("These timings hold together" in out)
    assert (tmp_path / "decode_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_busy_machine_is_said_by_the_run(tmp_path, capsys, monkeypatch):
    timing = fake_timing()
    timing.elsewhere = 0.9
    monkeypatch.setattr(decode, "measure", lambda *args: timing)
    assert decode.main(["--out-dir", str(tmp_path)]) == 0
    said = "NOT TRUSTWORTHY, the machine was busy while timing: other programs kept 0.9"
    assert said in capsys.readouterr().out


def test_the_printed_floors_speed_ups_and_ratios_are_the_roofline_s(capsys):
    # Ridge 3: GQA-4 and MQA compute-bound. Every step twice its floor.
    timing = fake_timing(read_rate=40e9, flop_rate=120e9, slower=2.0)
    decode.print_steps(timing)
    decode.print_longest(timing, [])
    decode.print_parts(timing)
    decode.print_copy_trap(timing)
    out = capsys.readouterr().out
    shares = [line.split()[2::2] for line in out.splitlines() if line.endswith("%)")]
    assert shares == [["(50%)"] * 3] * 4
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if len(line.split()) == 11}
    parts = {line.split()[0]: line.split()[1:] for line in out.splitlines()
             if len(line.split()) == 9}
    for kind, kv in KINDS:
        mb, per_byte, read, ridge, bound, floor, step, reaches, speedup, allowed = rows[kind]
        want = decode.roofline(134217728, decode.decode_bytes(kv, 128, 8192), 40e9, 120e9)
        assert (mb, float(per_byte), read, ridge) == (f"{8.388608 * kv:.1f}", 16 / kv, "40.0",
                                                      "3.0")
        assert (bound, float(floor)) == (want[1], pytest.approx(want[0] * 1e3, abs=1e-3))
        assert float(step) == pytest.approx(2 * want[0] * 1e3, abs=1e-3) and reaches == "50%"
        # All twice their floors: the speed-up is the ratio of the floors.
        assert speedup == allowed == f"{268435456 / 40e9 / want[0]:.1f}x"
        # The parts: 0.4, 0.1 and 0.4 of the step; a product does 2 h S dh FLOPs and reads K or V.
        qk, qk_flops, qk_read, softmax, pv, pv_flops, pv_read, share = parts[kind]
        times = (float(qk), float(softmax), float(pv))
        assert times == pytest.approx((0.8e3 * want[0], 0.2e3 * want[0], 0.8e3 * want[0]), abs=1e-3)
        assert qk_flops == pv_flops == f"{67108864 / (0.8 * want[0]) / 1e9:.0f}"
        assert qk_read == pv_read == f"{kv * 8192 * 128 * 4 / (0.8 * want[0]) / 1e9:.0f}"
        assert share == "0.90"
    ratio = f"{268435456 / 40e9 / (134217728 / 120e9):.1f}x"       # MHA's floor / MQA's
    said = f"MQA reads 32x fewer bytes than MHA and is {ratio} faster; its floor allows {ratio}."
    assert said in out
    mqa = 2e3 * 134217728 / 120e9                                  # ms: twice its compute floor
    copy_trap = f"MQA 70.00 {mqa:.2f} 4.00 grouped 31x faster than copying, 0.56x the fused"
    assert copy_trap in " ".join(out.split())


def test_the_gpu_lines_are_computed(capsys):
    decode.print_gpu()
    out = " ".join(capsys.readouterr().out.split())
    assert ("ridge 295 FLOPs per byte) a bf16 step does g FLOPs per byte, 1 to 32 here: every "
            "configuration") in out
    assert "MQA at 8192 tokens reads 4.2 MB a layer, 1.25 us at 3.35 TB/s (memory-bound)" in out


def test_the_figure_draws_steps_floors_dots_and_a_busy_machine():
    timing = fake_timing()
    fig = decode.plot(timing, ["MQA is slower than GQA-4 at 1024 tokens"])
    assert "NOT TRUSTWORTHY" in fig.get_suptitle()
    left, right = fig.axes
    for i, (_, kv) in enumerate(KINDS):     # each configuration's times, then its floor, dashed
        measured, floor = left.lines[2 * i], left.lines[2 * i + 1]
        steps = [timing.best["step", kv, S] * 1e3 for S in timing.contexts]
        assert list(measured.get_ydata()) == pytest.approx(steps)
        floors = [timing.floor(kv, S)[0] * 1e3 for S in timing.contexts]
        assert list(floor.get_ydata()) == pytest.approx(floors)
    dots = [line for line in right.lines if line.get_marker() == "o"]
    assert [d.get_xdata()[0] for d in dots] == [0.5, 2.0, 4.0, 16.0]      # g / 2 FLOPs per byte
    for d, (_, kv) in zip(dots, KINDS):          # at its GFLOP/s: the floor's rate / 1.5
        rate = 134217728 / (1.5 * timing.floor(kv, 8192)[0]) / 1e9
        assert d.get_ydata()[0] == pytest.approx(rate)
    assert "NOT TRUSTWORTHY" not in decode.plot(timing, []).get_suptitle()
