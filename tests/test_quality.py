"""quality.py: a tiny run through main(), its flags and Ctrl-C, the conversion (to_gqa, and A's
optimizer resumed with its K/V moments pooled), and the statistics against hand values."""

import copy
import math
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, gqa_module, run_main

import mha
import quality

SCRIPT = os.path.join(ROOT, "quality.py")
ENV = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "MPLBACKEND")}   # headless


@pytest.fixture(scope="module")
def data():
    return quality.Data(quality.load_text())


def rows(table):
    """The lines of a printed table that start with a configuration's name, split into words."""
    names = [[name] for name in quality.CONFIGS]
    return [line.split() for line in table.splitlines() if line.split()[:1] in names]


def trained_with_state(vocab=20, steps=3, seed=0):
    """A small MHA CharLM after a few AdamW steps on random characters, and its AdamW state."""
    torch.manual_seed(seed)
    model = quality.CharLM(vocab, quality.N_HEADS)
    opt = quality.optimizer(model)
    for _ in range(steps):
        x, y = torch.randint(vocab, (2, 2, quality.CONTEXT))
        opt.zero_grad()
        quality.bits_per_char(model(x), y).backward()
        opt.step()
    return model, opt.state_dict()


# ----------------------------------------------------------------------------- end to end
def test_a_tiny_run_prints_every_table_and_trains_as_one_process_would(data, tmp_path, capsys,
                                                                       monkeypatch):
    """main() as a user runs it, on tiny steps: nothing is learned, everything runs. The models the
    two workers trained, and their losses in fewer bits, are those this process makes alone."""
    results, real = [], quality.train_everything

    def keep(args, run):
        results.append(real(args, run))
        return results[-1]

    monkeypatch.setattr(quality, "train_everything", keep)
    # One seed: no interval.
    assert quality.main(["--steps", "10", "--seeds", "0", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    table_a = out.split("A. From scratch")[1].split("B. Conversion")[0]
    assert [r[0] for r in rows(table_a)] == list(quality.CONFIGS)
    table_b = out.split("B. Conversion")[1].split("E. Fewer bits")[0]
    b_rows = rows(table_b)
    assert [r[:2] for r in b_rows] == [["MHA", "(control)"]] + [
        [n, p] for n in ("GQA-4", "GQA-2", "MQA") for p in ("mean", "first", "random")]
    # Mean pooling: 3 losses, 2 gaps and A's loss; the others trained to +5 % only.
    assert all(len(r) == 3 + 3 + 2 + 1 for r in b_rows if r[2] == "pool")
    assert all(r[4] == "-" and len(r) == 7 for r in b_rows if r[1] in ("first", "random"))
    assert "the control resumed, minus untouched" in table_b and "0.0007 held" in table_b
    assert (tmp_path / quality.FIGURE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table_e = out.split("E. Fewer bits")[1].split("The answer at equal bytes")[0]
    assert [r[:3] for r in rows(table_e)] == [[n, str(kv), str(b or "full")]
                                              for n, kv in quality.CONFIGS.items()
                                              for b in (None, 8, 4, 3, 2)]
    check = (r"max \|logits difference\| = \S+ \(tolerance 1e-04\); tensors 12,288 bytes, "
             r"formula 64 x 192  OK")
    assert re.search(check, table_e.replace("\n   ", " "))
    answer = out.split("The answer at equal bytes")[1]
    assert len(re.findall(r"\n      answer: ", answer)) == 3             # 1/2, 1/4, 1/8
    scratch, losses, ok = results[0]
    assert ok
    torch.set_num_threads(1)
    for name, seed in [("MHA", 0), ("MQA", 0)]:
        model = quality.fresh_models(len(data.chars), seed)[name]
        opt = quality.optimizer(model)
        loss = quality.train(model, opt, data, data.batches(seed, 10), quality.lr_at, {10})[10]
        assert scratch[name][seed].loss == loss == losses[name, None][seed], (name, seed)
        fewer_bits = quality.window_losses(model, data.val_x, data.val_y, 4).mean().item()
        assert losses[name, 4][seed] == fewer_bits
        theirs = scratch[name][seed].model.state_dict().values()
        assert all(map(torch.equal, theirs, model.state_dict().values()))


def test_a_bad_flag_or_folder_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "a_file").write_text("not a folder")
    bad_folder = str(tmp_path / "a_file" / "figures")
    for argv, words in [(["--steps", "0"], "--steps 0 must be at least 1"),
                        (["--out-dir", bad_folder], "cannot be made: Not a directory")]:
        code, out, err = run_main(quality.main, argv, capsys)
        assert (code, out) == (2, "") and err.startswith("quality.py: error: "), err
        assert words in err and err.count("\n") == 1, err


def children(pid):
    """The processes pid started (Linux /proc): its workers and multiprocessing's tracker."""
    return [int(c) for c in pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def alive(pid):
    try:                                                   # and not a zombie
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads processes from /proc")
def test_ctrl_c_is_one_line_exit_130_and_stops_the_workers(tmp_path):
    argv = [sys.executable, SCRIPT, "--steps", "2000", "--seeds", "0", "--out-dir", str(tmp_path)]
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env=ENV, start_new_session=True)
    deadline, workers = time.monotonic() + 60, []
    while len(workers) < quality.WORKERS and time.monotonic() < deadline:
        time.sleep(0.1)
        workers = [c for c in children(p.pid)
                   if "resource_tracker" not in pathlib.Path(f"/proc/{c}/cmdline").read_text()]
    assert len(workers) == quality.WORKERS
    time.sleep(0.5)                            # spawned: importing torch, reading data or training
    os.killpg(p.pid, signal.SIGINT)                        # a terminal's Ctrl-C reaches the group
    assert p.wait(timeout=60) == 130
    err = p.stderr.read()
    assert err.endswith("\nquality.py: interrupted\n") and "Traceback" not in err, err
    deadline = time.monotonic() + 10
    while any(map(alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(alive, workers)), "a worker outlived the interrupted run"


# ----------------------------------------------------------------------------- B. conversion
def relative_diff(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def tie_kv_heads_in_groups(attn, r):
    """Make every group of r consecutive K/V heads equal (to its first head), in place."""
    h, kv, dh = attn.n_heads, attn.n_kv_heads, attn.d_head
    with torch.no_grad():
        for t in (attn.in_proj.weight, attn.in_proj.bias):
            for start in (h * dh, (h + kv) * dh):                  # K rows, then V rows
                heads = t[start:start + kv * dh].unflatten(0, (kv // r, r, dh))   # (groups, r, dh)
                heads.copy_(heads[:, :1].expand_as(heads))
    return attn


@pytest.mark.parametrize("h, kv, new_kv", [(6, 6, 2), (6, 6, 1), (8, 8, 4), (8, 4, 2), (12, 6, 2),
                                           (8, 2, 2)])
@pytest.mark.parametrize("pool", ["mean", "first"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_to_gqa_of_equal_heads_is_the_same_function(h, kv, new_kv, pool, dtype, tol):
    """Known answer: if each group's K/V heads are already equal, pooling them keeps the function,
    within rounding: the narrower module multiplies matrices of another width, which MKL may round
    differently (Intel CPUs under MKL_CBWR=AVX2 do), so this is a tolerance, not 0.0."""
    attn = tie_kv_heads_in_groups(gqa_module(16 * h, h, kv, dtype, seed=11), kv // new_kv)
    out = quality.to_gqa(attn, new_kv, pool=pool)
    assert (out.n_heads, out.n_kv_heads, out.d_head, out.in_proj.weight.dtype) == (h, new_kv, 16,
                                                                                   dtype)
    x = torch.randn(2, 7, 16 * h, dtype=dtype)
    with torch.no_grad():
        y, y_out = attn(x), out(x)
    assert relative_diff(y_out, y) <= tol, f"{relative_diff(y_out, y):.2e}"


def test_to_gqa_of_different_heads_is_another_function():
    """The tolerance above is not loose: pooling heads that differ moves the output far past it."""
    attn = gqa_module(64, 4, 4, seed=3)
    x = torch.randn(2, 7, 64)
    with torch.no_grad():
        assert relative_diff(quality.to_gqa(attn, 2)(x), attn(x)) > 1e-3


def test_to_gqa_mean_and_first_on_a_hand_made_module():
    """4 K/V heads of width 1 with known values, pooled to 2: the mean or the first of each pair;
    a bad size refused."""
    attn = mha.CausalMHA(4, 4, 4)
    with torch.no_grad():
        attn.in_proj.weight.copy_(torch.arange(12.0).unsqueeze(1).expand(12, 4))   # row i is all i
        attn.in_proj.bias.copy_(-torch.arange(12.0))
    mean, first = quality.to_gqa(attn, 2), quality.to_gqa(attn, 2, pool="first")
    assert mean.in_proj.weight[:, 0].tolist() == [0, 1, 2, 3, 4.5, 6.5, 8.5, 10.5]
    assert first.in_proj.weight[:, 0].tolist() == [0, 1, 2, 3, 4, 6, 8, 10]
    assert mean.in_proj.bias.tolist() == [-0.0, -1, -2, -3, -4.5, -6.5, -8.5, -10.5]
    assert torch.equal(mean.out_proj.weight, attn.out_proj.weight)
    with pytest.raises(ValueError, match="n_kv_heads=3 must be a positive divisor of the 4 K/V"):
        quality.to_gqa(attn, 3)


def test_the_k_v_rows_moments_are_pooled_as_their_weights_are():
    """Resuming A's AdamW after conversion: each group's K/V rows' moments become their mean (or
    the first head's); random K/V rows start at zero; every other moment and step count is A's."""
    model, state = trained_with_state()
    old = quality.optimizer(model, state).state
    dh, h = quality.D_MODEL // quality.N_HEADS, quality.N_HEADS
    for pool in ("none", "mean", "first", "random"):
        new = copy.deepcopy(model) if pool == "none" else quality.with_kv_heads(model, 2, pool)
        resumed = quality.resumed_optimizer(new, model, state, pool)
        for (name, p), (_, q) in zip(model.named_parameters(), new.named_parameters()):
            was, now = old[p], resumed.state[q]
            assert now["step"] == was["step"] == 3, name
            for key in ("exp_avg", "exp_avg_sq"):
                if pool == "none" or ".attn.in_proj." not in name:
                    assert torch.equal(now[key], was[key]), (pool, name, key)
                    continue
                assert torch.equal(now[key][:h * dh], was[key][:h * dh]), (pool, name)  # queries
                # K, then V: 8 heads become 2, each from a group of 4 (zero for random).
                for j in (0, 1):
                    heads = was[key][(j + 1) * h * dh:(j + 2) * h * dh].unflatten(0, (h, dh))
                    groups = heads.unflatten(0, (2, 4))                     # (2, 4, dh, ...)
                    expected = groups.mean(1) if pool == "mean" else groups[:, 0]
                    expected = expected.flatten(0, 1) * (pool != "random")
                    got = now[key][(h + 2 * j) * dh:(h + 2 * j + 2) * dh]
                    assert torch.allclose(got, expected, rtol=1e-6, atol=0), (pool, name, key, j)


def test_conversion_resumes_a_at_its_last_lr_on_the_batches_after_its_own(data, monkeypatch):
    """convert_and_train trains a copy (the MHA is shared with the other processes) with A's
    optimizer state, at A's last learning rate, on the windows after A's steps in the seed's
    order, evaluated at 0, +5 % and +20 %."""
    model, state = trained_with_state(vocab=len(data.chars))
    monkeypatch.setitem(quality.WORKER, "data", data)
    calls = []

    def spy(new, opt, data_, starts, schedule, marks):
        moments = {k: v["exp_avg"].clone() for k, v in opt.state_dict()["state"].items()}
        lrs = {schedule(s, len(starts)) for s in range(len(starts))}
        calls.append((new, moments, starts, lrs, marks))
        return {}

    monkeypatch.setattr(quality, "train", spy)
    before = copy.deepcopy(model.state_dict())
    last_lr = quality.lr_at(39, 40)
    for name, pool, up, marks in [("MHA", "none", 8, {0, 2, 8}), ("MQA", "mean", 8, {0, 2, 8}),
                                  ("GQA-2", "first", 2, {0, 2}), ("GQA-4", "random", 2, {0, 2})]:
        quality.convert_and_train(name, pool, 5, 40, model, state)
        new, moments, starts, lrs, got_marks = calls[-1]
        assert new is not model and new.blocks[0].attn.n_kv_heads == quality.CONFIGS[name]
        assert torch.equal(starts, data.batches(5, 40 + up)[40:]), name   # not A's first windows
        assert lrs == {last_lr} and got_marks == marks, name
        assert len(moments) == len(state["state"])                         # resumed, not fresh
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_table_b_pairs_each_row_with_the_control_of_its_seed_at_the_same_step(capsys):
    """The control's loss moves with the seed and each conversion ends 0.2 (mean) or 0.3 (others)
    above it on every seed: the gap is exactly that, with no width, only if each seed meets its
    own control at the same step."""
    seeds, steps = (0, 1, 2), 20         # 20 steps: 1 further (5 %), 4 for control and mean (20 %)
    curves = {s: {("MHA", "none"): {0: 1.9 + 0.1 * s, 1: 2.0 + 0.1 * s, 4: 1.0 + 0.1 * s}}
              for s in seeds}
    for s in seeds:
        for name in ("GQA-4", "GQA-2", "MQA"):
            curves[s][name, "mean"] = {0: 5.0, 1: 2.2 + 0.1 * s, 4: 1.2 + 0.1 * s}
            curves[s][name, "first"] = curves[s][name, "random"] = {0: 6.0, 1: 2.3 + 0.1 * s}
    scratch = {name: {s: quality.Trained(None, 2.0, None) for s in seeds}
               for name in quality.CONFIGS}
    quality.print_table_b(curves, scratch, steps)
    out = capsys.readouterr().out
    lines = [" ".join(r) for r in rows(out) if r[0] != "MHA"]
    assert len(lines) == 9
    for line in lines:
        gaps = re.findall(r"[+-]\d\.\d{3} \[[+-]\d\.\d{3}, [+-]\d\.\d{3}\]", line)
        exact = ["+0.200 [+0.200, +0.200]"] * 2 if "mean" in line else ["+0.300 [+0.300, +0.300]"]
        assert gaps == exact, line
    assert "paired by seed: +5% +0.100 [+0.100, +0.100], +20% -0.900 [-0.900, -0.900]" in out


# ----------------------------------------------------------------------------- the statistics
def student_t_cdf(t, df, n=20_000):
    """P(T <= t) for Student's t, by Simpson's rule on its density: a check that needs no scipy."""
    c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
    h = t / n
    f = [c * (1 + (k * h) ** 2 / df) ** (-(df + 1) / 2) for k in range(n + 1)]
    return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))


def t_used(df):
    """The t that interval takes for df + 1 values, read back from the interval's half width."""
    values = [0.0] * df + [1.0]
    low, high = quality.interval(values)
    return (high - low) / 2 * math.sqrt(df + 1) / statistics.stdev(values)


def test_t_quantiles_known_values_and_never_too_small():
    assert [round(t_used(df), 3) for df in (2, 4, 7, 11)] == [4.303, 2.776, 2.365, 2.228]
    for df in range(1, 130, 3):
        p = student_t_cdf(t_used(df), df)
        assert p >= 0.975 - 1e-4, df                                          # never too narrow
        if df in quality.T_975:
            assert p == pytest.approx(0.975, abs=2e-4), df                    # right in the table


def test_interval_and_verdict_on_known_numbers():
    low, high = quality.interval([0.1, 0.2, 0.3])                          # mean 0.2, sd 0.1, n 3
    assert (round(low, 3), round(high, 3)) == (-0.048, 0.448)
    assert quality.paired([0.1, 0.2, 0.3]) == "+0.200 [-0.048, +0.448]"
    five = [0.01, 0.03, 0.02, 0.04, 0.05]
    assert quality.verdict(five) == "worse than MHA"
    assert quality.verdict([-v for v in five]) == "better than MHA"
    assert quality.verdict([0.1, 0.2, 0.3]) == "not resolved"             # 2 sd clear, still not
    assert quality.verdict([0.2]) == "one seed: cannot judge"


@pytest.mark.parametrize("mqa, said", [
    ([0.02, 0.03, 0.04, 0.03, 0.02], ("worse than MHA", "worse than MHA", "not resolved")),
    ([0.02, -0.03, 0.04, 0.03, 0.02], ("not resolved", "not tested (MQA not resolved)",
                                       "not tested (GQA-2 not resolved)")),
])
def test_the_fixed_sequence_tests_each_only_if_the_one_before_was_resolved(mqa, said, capsys):
    """Each row's difference pairs a seed with the MHA of that seed, whose loss moves by seed."""
    model = quality.CharLM(10, quality.N_HEADS)
    gaps = {"GQA-4": [0.01, -0.01, 0.02], "GQA-2": [0.01, 0.02, 0.015], "MQA": mqa}
    scratch = {"MHA": {s: quality.Trained(model, 2.0 + 0.1 * s, None) for s in range(5)}}
    for name, gs in gaps.items():
        scratch[name] = {s: quality.Trained(model, 2.0 + 0.1 * s + g, None)
                         for s, g in enumerate(gs)}
    quality.print_table_a(scratch, 10)
    found = {r[0]: " ".join(r) for r in rows(capsys.readouterr().out)}
    assert [found[n].endswith(s) for n, s in zip(["MQA", "GQA-2", "GQA-4"], said)] == [True] * 3
    assert all(quality.paired(gaps[n]) in found[n] for n in gaps), found
