"""quality.py: a tiny end-to-end run as a user runs it, determinism, the worker pool's guarantees, the 95 %
intervals, the order of the tests, the head ablation, and the pieces whose bugs would hide."""

import math
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import time
import types

import pytest
import torch
from conftest import gqa_module, record_calls

import mha
import quality

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "quality.py")
FIGURES = ["quality.png", "trained_attention_maps.png"]
TINY = ["--steps", "4", "--seeds", "0", "1"]   # seconds, not minutes: nothing is learned, everything runs
ENV = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "MPLBACKEND")}   # headless, as in CI


def run(*args, **kwargs):
    return subprocess.run([sys.executable, SCRIPT, *args], check=False, capture_output=True, text=True, env=ENV,
                          timeout=300, **kwargs)


def start(*args, **kwargs):
    """quality.py started in the background, its output piped; waits for its first line (the estimate)."""
    p = subprocess.Popen([sys.executable, SCRIPT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=ENV, **kwargs)
    p.stdout.readline()
    return p


def numbers(stdout):
    """Everything the run prints except its wall time, its number of workers and the folder it wrote to."""
    return [line for line in stdout.splitlines()
            if not line.startswith(("time:", "Figures written to", "torch ", "This run:", "--quick"))]


def descendants(pid):
    """Every process below pid (Linux /proc), workers and the multiprocessing resource tracker alike."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            children = pathlib.Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except FileNotFoundError:
            continue
        found += map(int, children)
        todo += map(int, children)
    return found


def workers_of(pid):
    return [c for c in descendants(pid) if "resource_tracker" not in pathlib.Path(f"/proc/{c}/cmdline").read_text()]


def alive(pid):
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"   # not a zombie
    except FileNotFoundError:
        return False


def all_gone(pids, seconds=10):
    deadline = time.monotonic() + seconds
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(map(alive, pids))


def wait_for_workers(p, seconds=30):
    """The pids of p's workers once both are past their start (busy on a core)."""
    deadline = time.monotonic() + seconds
    while len(workers_of(p.pid)) < quality.WORKERS and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.5)                                            # spawned, importing torch or training
    return workers_of(p.pid)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny run as a user starts it, on the default WORKERS (the expensive part, shared below)."""
    out = tmp_path_factory.mktemp("quality")
    return run(*TINY, "--out-dir", str(out)), out


@pytest.fixture(scope="module")
def data():
    return quality.Data(quality.load_text())


def rows(table, names):
    return {line.split()[0]: line for line in table.splitlines() if line.split()[:1] in ([n] for n in names)}


# ----------------------------------------------------------------------------- end to end
def test_tiny_run_prints_the_estimate_four_tables_with_intervals_and_writes_two_pngs(tiny_run):
    r, out_dir = tiny_run
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "\r" not in r.stderr
    assert re.fullmatch(r"B\. conversion: (\d+) of \1 training steps, 0:0\d:\d\d so far, ~0:00:00 left",
                        r.stderr.strip().splitlines()[-1])
    out = r.stdout
    assert out.startswith("This run: ") and " min on a quiet 2-core AMD EPYC" in out.splitlines()[0]
    assert f"Python {sys.version.split()[0]}" in out and "sha256" in out
    assert f"{quality.WORKERS} worker processes of 1 thread each" in out
    table_a = out.split("A. From scratch")[1].split("B. Conversion")[0]
    assert "(MHA 0,1, GQA-4 0,1, GQA-2 0,1, MQA 0,1)" in table_a and "in advance, MQA, GQA-2, GQA-4" in table_a
    found = rows(table_a, quality.CONFIGS)
    assert list(found) == list(quality.CONFIGS)
    resolved = True
    for name in quality.tested_in_order():                    # every difference with its interval and its verdict
        mean, low, high = (float(x) for x in found[name].split("]")[0].replace("[", " ").replace(",", " ").split()[-3:])
        assert low < mean < high, found[name]
        said = "worse than MHA" if low > 0 else "better than MHA" if high < 0 else "not resolved"
        assert found[name].endswith(said if resolved else "not resolved)"), found[name]
        resolved = resolved and said != "not resolved"
    assert "what pairing buys" in table_a and table_a.split("of unpaired ones: ")[1].count(" against ") == 3
    table_b = out.split("B. Conversion")[1].split("C. What each head")[0]
    b_rows = [line.split()[:2] for line in table_b.splitlines() if line.split()[:1] in ([n] for n in quality.CONFIGS)]
    assert b_rows[0] == ["MHA", "(control)"] and len(b_rows) == 1 + 3 * len(quality.POOLS) + 2 * 3
    assert "then 1 step (5% of A's)" in table_b and "seeds 0, 1 (" in table_b and table_b.count("[95% interval]") == 3
    assert all((" - " in line) == ("random" in line) for line in table_b.splitlines()
               if line.split()[:1] in ([n] for n in quality.CONFIGS))      # random K/V: right after only
    table_c = out.split("C. What each head")[1].split("D. How much")[0]
    heads = [line for line in table_c.splitlines() if line.split()[:2] and line.split()[0].isdigit()]
    assert len(heads) == quality.N_LAYERS * quality.N_HEADS
    table_d = out.split("D. How much")[1].split("Figures written")[0]
    heads = [line for line in table_d.splitlines() if "".join(line.split()[:2]).isdigit()]
    assert len(heads) == quality.N_LAYERS * quality.N_HEADS and all("[" in line for line in heads)
    assert sorted(int(line.split("]")[1].split()[0]) for line in heads) == list(range(1, 17))    # ranks 1 .. 16
    assert "16 blocks of consecutive windows" in table_d and "heads can go" in table_d and "One model" in table_d
    assert sorted(os.listdir(out_dir)) == sorted(FIGURES)
    for name in FIGURES:
        assert (out_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_the_readme_quotes_the_recorded_default_run():
    """The README's numbers on what GQA costs are those of the default run LABNOTES.md records (a run takes 10
    minutes, too long for the suite): table A's MQA line, B's mean-pooled lines and control, the run's time."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = " ".join(f.read().split("## Next chapters")[1].split())
    with open(os.path.join(ROOT, "LABNOTES.md")) as f:
        run = f.read().split("## The default run of quality.py")[1].split("```text\n")[1].split("```")[0]
    a = run.split("A. From scratch")[1].split("B. Conversion")[0]
    b = run.split("B. Conversion")[1].split("C. What each head")[0]
    found_a = rows(a, quality.CONFIGS)
    mqa = re.search(r"(\+\d\.\d{3}) \[(\+\d\.\d{3}), (\+\d\.\d{3})\]\s+worse than MHA$", found_a["MQA"])
    assert mqa, found_a["MQA"]
    assert f"MQA costs {mqa[1]} bits per character (the loss: lower is better) against MHA, 95 % interval " \
           f"[{mqa[2]}, {mqa[3]}]" in readme
    assert all("not" in found_a[name].split("]")[-1] for name in ("GQA-2", "GQA-4"))
    assert "the smaller costs of GQA-2 and GQA-4 are not resolved" in readme
    steps = re.search(r"then (\d+) steps \((\d+)% of A's\)", b)
    assert f"then training {steps[1]} steps ({steps[2]} %) more" in readme and f"the same {steps[1]} steps" in readme
    pooled = {line.split()[0]: line.split("]")[0].split()[-3] for line in b.splitlines()
              if line.split()[1:3] == ["mean", "pool"]}       # config, "mean pool", right after, +5%, minus the control
    assert f"GQA-4 ends {pooled['GQA-4']} bits per character and MQA {pooled['MQA']} behind" in readme
    control = next(line.split() for line in b.splitlines() if "(control)" in line)
    assert f"moved that MHA itself from {control[2]} to {control[3]}" in readme
    minutes = float(re.search(r"^time: (\d+\.\d) min", run, re.MULTILINE)[1])
    low, high = map(int, re.search(r"\(([0-9]+) to ([0-9]+) minutes on 2 cores\)", readme).groups())
    assert low <= minutes <= high, minutes


def test_quick_says_first_that_it_resolves_nothing_then_how_long_it_will_take(tmp_path, capsys, monkeypatch):
    def stop(args, run):
        raise RuntimeError("stopped before training")
    monkeypatch.setattr(quality, "train_everything", stop)
    with pytest.raises(RuntimeError, match="stopped"):
        quality.main(["--quick", "--out-dir", str(tmp_path)])
    first, second = capsys.readouterr().out.splitlines()[:2]
    assert first == f"--quick: a smoke run for trying an edit ({quality.QUICK_STEPS} steps, seeds 0 1); it resolves nothing"
    assert second.startswith("This run: 1,312 training steps on 2 workers, about ") and " min " in second


@pytest.mark.parametrize("workers", [1, 2])
def test_one_worker_or_two_give_the_same_models_to_the_bit(workers, data, monkeypatch):
    """Every model trains on one thread in whichever worker is free, so the number of workers changes no bit."""
    monkeypatch.setattr(quality, "WORKERS", workers)
    with quality.workers(1) as run:
        scratch = quality.run_from_scratch([0, 1], 3, run)
    torch.set_num_threads(1)
    for name, seed in [("MHA", 1), ("MQA", 0)]:                  # as one process trains them, alone
        model = quality.fresh_models(len(data.chars), seed)[name]
        loss = quality.train(model, data, data.batches(seed, 3), quality.lr_at, {3})[3]
        assert scratch[name][seed][1] == loss, (name, seed)
        assert all(torch.equal(a, b) for a, b in zip(scratch[name][seed][0].state_dict().values(),
                                                      model.state_dict().values()))


def test_seeds_change_the_numbers(data):
    """In process: two seeds give two initialisations and data orders, one seed gives the same bits twice."""
    torch.set_num_threads(1)

    def loss_after(seed, steps=3):
        model = quality.fresh_models(len(data.chars), seed)["GQA-2"]
        return quality.train(model, data, data.batches(seed, steps), quality.lr_at, {steps})[steps]

    assert loss_after(0) == loss_after(0)
    assert loss_after(0) != loss_after(1)


def test_broken_pipe_exits_quietly(tmp_path):
    """python quality.py | head -3: no traceback, exit 1, once the reader has gone."""
    p = subprocess.Popen([sys.executable, SCRIPT, "--steps", "1", "--seeds", "0", "--out-dir", str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    for _ in range(3):
        p.stdout.readline()
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 1
    assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads a process's children from /proc")
def test_ctrl_c_is_one_line_exit_130_and_stops_the_workers(tmp_path):
    """Ctrl-C reaches every process of the group, workers too: one line, no trace, no process left, no folder."""
    out_dir = tmp_path / "figures"
    p = start("--steps", "1000", "--seeds", "0", "--out-dir", str(out_dir), start_new_session=True)
    below = wait_for_workers(p)
    assert len(below) == quality.WORKERS
    os.killpg(p.pid, signal.SIGINT)                                                # as a terminal's Ctrl-C does
    assert p.wait(timeout=60) == 130
    err = p.stderr.read()
    assert err.endswith("quality.py: interrupted\n") and "Traceback" not in err, err
    assert all_gone(below), "a worker outlived the interrupted run"
    assert not out_dir.exists(), "an interrupted run left the folder it made"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the workers in /proc")
def test_a_worker_killed_from_outside_is_one_line_and_nothing_written(tmp_path):
    out_dir = tmp_path / "figures"
    p = start("--steps", "1000", "--seeds", "0", "--out-dir", str(out_dir))
    below = wait_for_workers(p)
    os.kill(below[0], signal.SIGKILL)                                              # as the OOM killer would
    assert p.wait(timeout=60) == 1
    err = p.stderr.read()
    assert err.strip().splitlines()[-1].startswith("quality.py: error: a worker process stopped"), err
    assert "nothing was written" in err and "Traceback" not in err, err
    assert all_gone(below) and not out_dir.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the workers in /proc")
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_workers_die_with_a_killed_parent(how, tmp_path):
    """kill -TERM or kill -KILL of the main process: no worker goes on training without it."""
    p = start("--steps", "1000", "--seeds", "0", "--out-dir", str(tmp_path))
    below = wait_for_workers(p)
    assert len(below) == quality.WORKERS
    os.kill(p.pid, how)
    p.wait(timeout=60)
    assert all_gone(below), f"a worker outlived its parent killed by {how.name}"


def test_an_error_in_a_worker_stops_the_run_at_once_with_its_traceback():
    """A failing task is raised in the main process with the worker's traceback, while the other worker is
    busy with a task of an hour: it is stopped, not waited for."""
    start_time = time.monotonic()
    with pytest.raises(KeyError, match="no such config") as e, quality.workers(1) as work:
        work("A", [(quality.train_from_scratch, ("MHA", 0, 100_000), 1),
                   (quality.train_from_scratch, ("no such config", 0, 1), 0)])
    assert time.monotonic() - start_time < 60
    assert "in train_from_scratch" in str(e.value.__cause__)                    # the worker's own traceback


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("argv, value", [
    (["--steps", "0"], "--steps 0"), (["--steps", "-3"], "--steps -3"), (["--steps", "1000000"], "1000000"),
    (["--steps", "1.5"], "'1.5'"), (["--steps", "x"], "'x'"), (["--seeds", "x"], "'x'"),
    (["--seeds", "-1"], "--seeds -1"), (["--seeds", str(2**32)], str(2**32)), (["--seeds", "1", "1"], "--seeds 1 1"),
    (["--seeds"], "--seeds"),
])
def test_bad_flag_is_one_line_and_exit_2(argv, value, capsys):
    with pytest.raises(SystemExit) as e:
        quality.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert len(err.strip().splitlines()) == 1 and value in err, err


def test_bad_flag_from_the_command_line_writes_nothing(tmp_path):
    r = run("--steps", "0", "--out-dir", str(tmp_path / "figs"))
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "positive whole number" in r.stderr, r.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("knob, value, words", [
    ("CONFIGS", {"MHA": 8, "GQA-3": 3, "MQA": 1}, ["CONFIGS=", "positive divisor"]),
    ("CONFIGS", {"GQA-4": 4, "MQA": 1}, ["'MHA' to N_HEADS=8"]),
    ("UPTRAIN", 0, ["UPTRAIN=0", "in (0, 1]"]), ("UPTRAIN", 1.5, ["UPTRAIN=1.5", "in (0, 1]"]),
    ("UPTRAIN", (0.05,), ["UPTRAIN=(0.05,)"]),
    ("WORKERS", 0, ["WORKERS=0", "at least 1"]), ("WORKERS", 1.5, ["WORKERS=1.5"]), ("WORKERS", True, ["WORKERS=True"]),
    ("GQA_SEEDS", 0, ["GQA_SEEDS=0", "at least 1"]),
])
def test_a_knob_that_cannot_work_is_one_line_and_exit_2(knob, value, words, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(quality, knob, value)
    with pytest.raises(SystemExit) as e:
        quality.main([*TINY, "--out-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert all(w in err for w in words), err


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        quality.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())                  # as argparse wraps it, unwrapped
    assert e.value.code == 0
    assert f"default: {quality.STEPS}" in out and "UPTRAIN=0.05 of it" in out and "default: 0 1 2 3 4" in out and "--quick" in out


@pytest.mark.parametrize("under", ["a_file/figures", "a_file", ""])
def test_unwritable_out_dir_is_one_line_and_exit_2_like_a_bad_flag(under, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(SystemExit) as e:
        quality.main([*TINY, "--out-dir", str(tmp_path / under) if under else ""])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith("quality.py: error: ")
    assert os.listdir(tmp_path) == ["a_file"]


def test_import_has_no_side_effects(tmp_path):
    code = ("import torch; state = torch.random.get_rng_state(); threads = torch.get_num_threads(); "
            "import quality; assert torch.equal(state, torch.random.get_rng_state()); "
            "assert threads == torch.get_num_threads()")
    before = sorted(os.listdir(ROOT)), sorted(os.listdir(os.path.join(ROOT, "figures")))
    r = subprocess.run([sys.executable, "-c", code], check=False, cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", r.stderr
    assert os.listdir(tmp_path) == []
    assert (sorted(os.listdir(ROOT)), sorted(os.listdir(os.path.join(ROOT, "figures")))) == before


# ----------------------------------------------------------------------------- the design
def test_mha_and_mqa_take_every_seed_and_the_others_the_first_gqa_seeds():
    assert quality.tested_in_order() == ["MQA", "GQA-2", "GQA-4"]
    seeds = [5, 6, 7, 8, 9]
    assert quality.seeds_of("MHA", seeds) == quality.seeds_of("MQA", seeds) == seeds
    assert quality.seeds_of("GQA-2", seeds) == quality.seeds_of("GQA-4", seeds) == [5, 6, 7]


def scratch_of(gaps):
    """A made-up table A: MHA at 2.0 on every seed, each configuration at 2.0 + its gaps, one per seed."""
    model = quality.CharLM(10, quality.N_HEADS)
    out = {"MHA": {s: (model, 2.0) for s in range(5)}}
    out.update({name: {s: (model, 2.0 + g) for s, g in enumerate(gs)} for name, gs in gaps.items()})
    return out


@pytest.mark.parametrize("mqa, gqa2, said", [
    ([0.02, 0.03, 0.04, 0.03, 0.02], [0.01, 0.02, 0.015], ("worse than MHA", "worse than MHA", "not resolved")),
    ([0.02, -0.03, 0.04, 0.03, 0.02], [0.01, 0.02, 0.015], ("not resolved", "not tested (MQA not resolved)",
                                                            "not tested (GQA-2 not resolved)")),
])
def test_the_fixed_sequence_tests_each_only_if_the_one_before_was_resolved(mqa, gqa2, said, capsys):
    quality.print_table_a(scratch_of({"GQA-4": [0.01, -0.01, 0.02], "GQA-2": gqa2, "MQA": mqa}), 10)
    found = rows(capsys.readouterr().out, quality.CONFIGS)
    assert [found[n].endswith(s) for n, s in zip(["MQA", "GQA-2", "GQA-4"], said)] == [True] * 3, found


def test_each_difference_pairs_a_seed_with_the_mha_of_the_same_seed():
    """MHA's loss moves from seed to seed and GQA-4 follows it 0.05 above: every paired difference is 0.05."""
    scratch = {"MHA": {s: (None, 2.0 + 0.1 * s) for s in (5, 6, 7, 8, 9)},
               "GQA-4": {s: (None, 2.05 + 0.1 * s) for s in (5, 6, 7)}}
    assert quality.gaps(scratch, "GQA-4") == pytest.approx([0.05, 0.05, 0.05])


def test_what_pairing_buys_compares_the_paired_sd_with_the_unpaired_one(capsys):
    quality.print_table_a(scratch_of({"GQA-4": [0.0, 0.1, 0.2], "GQA-2": [0.1, 0.1, 0.1], "MQA": [0.1, 0.2, 0.3, 0.4, 0.5]}), 1)
    line = capsys.readouterr().out.split("of unpaired ones: ")[1]
    # MHA's losses do not vary: unpaired = sqrt(0 + sd^2) = sd. MQA's sd is 0.158.
    assert line.startswith("MQA 0.158 against 0.158, GQA-2 0.000 against 0.000, GQA-4 0.100 against 0.100"), line


# ----------------------------------------------------------------------------- the pieces
def test_every_configuration_starts_from_the_mha_initialisation():
    models = quality.fresh_models(50, seed=3)
    base, dh = models["MHA"], quality.D_MODEL // quality.N_HEADS
    q_rows = quality.N_HEADS * dh
    for name, kv in quality.CONFIGS.items():
        model = models[name]
        assert model.blocks[0].attn.n_kv_heads == kv
        for mine, theirs in zip(model.blocks, base.blocks):
            w, w0 = mine.attn.in_proj.weight, theirs.attn.in_proj.weight
            assert torch.equal(w[:q_rows], w0[:q_rows])                           # the same queries
            k0 = w0[q_rows:2 * q_rows].unflatten(0, (quality.N_HEADS, dh))        # (h, dh, d)
            kept = k0[::quality.N_HEADS // kv].flatten(0, 1)                      # first head of each group
            assert torch.equal(w[q_rows:q_rows + kv * dh], kept), name
            assert torch.equal(mine.mlp[0].weight, theirs.mlp[0].weight)
        assert torch.equal(model.embed.weight, base.embed.weight) and torch.equal(model.pos, base.pos)
    assert not torch.equal(quality.fresh_models(50, seed=4)["MHA"].embed.weight, base.embed.weight)


def test_random_pool_keeps_queries_and_redraws_kv():
    base = quality.fresh_models(50, seed=0)["MHA"]
    first = quality.with_kv_heads(base, 2, "first", seed=0)
    rand = quality.with_kv_heads(base, 2, "random", seed=0)
    q_rows = quality.D_MODEL
    for f, r in zip(first.blocks, rand.blocks):
        assert torch.equal(f.attn.in_proj.weight[:q_rows], r.attn.in_proj.weight[:q_rows])
        assert torch.equal(f.attn.out_proj.weight, r.attn.out_proj.weight)
        kv_rows = r.attn.in_proj.weight[q_rows:]
        assert not torch.equal(f.attn.in_proj.weight[q_rows:], kv_rows)
        assert kv_rows.abs().max() <= 1 / quality.D_MODEL ** 0.5                  # nn.Linear's initial bound
    assert torch.equal(quality.with_kv_heads(base, 2, "random", seed=0).blocks[0].attn.in_proj.weight,
                       rand.blocks[0].attn.in_proj.weight)


def test_conversion_batches_follow_the_training_batches(data):
    """Further training sees new windows: the ones after the original steps in the same data order."""
    assert torch.equal(data.batches(5, 10), data.batches(5, 13)[:10])
    assert not torch.equal(data.batches(5, 10), data.batches(6, 10))


def test_table_b_pairs_each_conversion_with_the_control_of_its_seed(capsys):
    """The control's loss moves with the seed and each mean-pooled conversion ends 0.2 above it on every seed:
    the difference is exactly +0.2, with no width, only if each seed meets its own control."""
    seeds, steps = (0, 1, 2), 20                 # 20 steps: 1 step of further training
    up = quality.uptrain_steps(steps)
    curves = {s: {("MHA", "none"): {0: 1.9, up: 2.0 + 0.1 * s}} for s in seeds}
    for s in seeds:
        for name in ("GQA-4", "GQA-2", "MQA"):
            curves[s][name, "mean"] = {0: 5.0, up: 2.2 + 0.1 * s}
            curves[s][name, "first"] = {0: 6.0, up: 2.3 + 0.1 * s}
            curves[s][name, "random"] = {0: 7.0}
    scratch = {name: {s: (None, 2.0) for s in seeds} for name in quality.CONFIGS}
    quality.print_table_b(curves, scratch, steps)
    lines = capsys.readouterr().out.splitlines()
    mean_rows = [line for line in lines if line.split()[1:3] == ["mean", "pool"]]
    first_rows = [line for line in lines if line.split()[1:2] == ["first"]]
    assert len(mean_rows) == len(first_rows) == 3
    assert all("+0.200 [+0.200, +0.200]" in line for line in mean_rows), mean_rows
    assert all("+0.300 [+0.300, +0.300]" in line for line in first_rows), first_rows


def test_the_control_is_trained_on_a_copy(data, monkeypatch):
    """A worker's MHA shares its tensors with every process: the control must train a copy, or it would
    change the MHA that the other conversions and tables C and D read."""
    monkeypatch.setitem(quality.WORKER, "data", data)
    torch.set_num_threads(1)
    model = quality.fresh_models(len(data.chars), 0)["MHA"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    curve = quality.convert_and_train("MHA", "none", 0, 40, model)
    assert curve[2] < curve[0] and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    trained_on = []
    record_calls(monkeypatch, quality, "train", trained_on, lambda model, data, starts, *rest: starts)
    quality.convert_and_train("MQA", "mean", 0, 40, model)
    assert torch.equal(trained_on[0], data.batches(0, 42)[40:])   # the 2 windows after A's 40 steps, not A's first
    assert list(quality.convert_and_train("MQA", "random", 0, 40, model)) == [0]        # right after only


def test_bits_per_char_known_answer():
    logits = torch.zeros(2, 3, 64)                                                 # uniform: log2(64) = 6 bits
    assert quality.bits_per_char(logits, torch.zeros(2, 3, dtype=torch.long)).item() == pytest.approx(6.0, abs=1e-6)


def test_validation_windows(data):
    assert data.val_x.shape == data.val_y.shape == (quality.EVAL_WINDOWS, quality.CONTEXT)
    assert torch.equal(data.val_x[:, 1:], data.val_y[:, :-1])                       # y is x one character on
    assert len(data.train) + len(data.val) == len(quality.load_text())


def test_head_roles_known_answer(data):
    """A model whose head 0 looks only at the previous character and head 1 only at itself."""
    T, h = quality.CONTEXT, quality.N_HEADS

    class Fake(torch.nn.Module):
        def forward(self, x, need_weights=False):
            p = torch.zeros(len(x), h, T, T)
            p[:, :, 0, 0] = 1.0
            p[:, 0, torch.arange(1, T), torch.arange(T - 1)] = 1.0               # previous character
            p[:, 1:, torch.arange(1, T), torch.arange(1, T)] = 1.0               # itself
            return None, [p]

    roles, chance = quality.head_roles(Fake(), data)
    assert roles["previous"][0, 0].item() == pytest.approx(1.0) and roles["itself"][0, 0].item() == 0.0
    assert roles["itself"][0, 1].item() == pytest.approx(1.0) and roles["previous"][0, 1].item() == 0.0
    level = sum(1 / (i + 1) for i in range(1, T)) / (T - 1)       # uniform: 1/(i+1) on the previous key
    assert chance["previous"] == pytest.approx(level) and chance["itself"] == pytest.approx(level)
    share = sum(data.chars[c].isspace() for c in data.val_x.flatten().tolist()) / data.val_x.numel()
    assert abs(chance["whitespace"] - share) < 0.03
    assert quality.strongest(roles, chance, 0, 0) == ("previous", pytest.approx(1 / level))


def test_quality_figure_draws_each_configuration_at_its_cache_bytes_with_its_interval():
    """Left panel: each configuration's seeds as dots at its KV bytes per token, their mean with its 95 % interval
    (quality.interval, Student's t), not the seeds' range; right panel: one bar per head."""
    from matplotlib.collections import PathCollection
    losses = {"MHA": [2.00, 2.02, 1.99, 2.01, 2.03], "GQA-4": [2.05, 2.01, 2.04], "GQA-2": [2.06, 2.02, 2.08],
              "MQA": [2.10, 2.07, 2.12, 2.09, 2.11]}
    scratch = {name: {seed: (None, loss) for seed, loss in enumerate(ls)} for name, ls in losses.items()}
    heads = [(i, j) for i in range(quality.N_LAYERS) for j in range(quality.N_HEADS)]
    g = torch.Generator().manual_seed(0)
    alone = {hd: torch.rand(quality.EVAL_WINDOWS, generator=g) * 0.1 for hd in heads}
    roles = {r: torch.rand(quality.N_LAYERS, quality.N_HEADS, generator=g)
             for r in ("previous", "itself", "whitespace", "word start")}
    fig = quality.plot_quality(scratch, 10, (alone, heads, [0.0] * len(heads)), roles, dict.fromkeys(roles, 0.1), 0)
    left, right = fig.axes
    dots = [c.get_offsets().tolist() for c in left.collections if isinstance(c, PathCollection)]   # the scatters
    for (name, kv), bar, seeds in zip(quality.CONFIGS.items(), left.containers, dots, strict=True):
        b, (low, high) = quality.cache_bytes_per_token(kv), quality.interval(losses[name])
        assert bar.lines[0].get_xydata().tolist() == [[b, pytest.approx(statistics.mean(losses[name]))]]
        assert bar.lines[2][0].get_segments()[0].tolist() == [[b, pytest.approx(low)], [b, pytest.approx(high)]]
        assert seeds == [[b, loss] for loss in losses[name]]
    assert len(right.patches) == len(heads)


def test_head_roles_finds_word_starts():
    """'ab ab': the word that holds each position starts at 0, 0, 0 (the space ends the first word), 3, 3. A head
    that attends to exactly those keys puts all its weight on word starts; one that looks at key 0 from row 1 and at
    the space from rows 2 to 4 puts a quarter there (row 1's key 0), three quarters on whitespace."""
    chars = [" ", "a", "b"]
    x = torch.tensor([[1, 2, 0, 1, 2]])                                    # 'ab ab': (N=1, T=5)
    data = types.SimpleNamespace(val_x=x, chars=chars)
    starts, spaces = [0, 0, 0, 3, 3], [0, 0, 2, 2, 2]

    class Fake(torch.nn.Module):
        def forward(self, x, need_weights=False):
            p = torch.zeros(1, quality.N_HEADS, 5, 5)                       # (N, h, T, T)
            p[0, 0, torch.arange(5), torch.tensor(starts)] = 1.0           # head 0: each word's start
            p[0, 1:, torch.arange(5), torch.tensor(spaces)] = 1.0          # the others: the space, or key 0
            return None, [p]

    roles, _ = quality.head_roles(Fake(), data)
    assert roles["word start"][0, 0].item() == pytest.approx(1.0)
    assert roles["word start"][0, 1].item() == pytest.approx(0.25)        # rows 1 to 4: only row 1's key 0
    assert roles["whitespace"][0, 1].item() == pytest.approx(0.75)


def student_t_cdf(t, df, n=20_000):
    """P(T <= t) for Student's t, by Simpson's rule on its density: a check that needs no scipy."""
    c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
    h = t / n
    f = [c * (1 + (k * h) ** 2 / df) ** (-(df + 1) / 2) for k in range(n + 1)]
    return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))


def test_t_quantiles_known_values_and_never_too_small():
    assert quality.t_975(2) == 4.303 and quality.t_975(4) == 2.776 and quality.t_975(1) == 12.706
    for df in range(1, 200):
        p = student_t_cdf(quality.t_975(df), df)
        assert p >= 0.975 - 1e-4, df                                              # never too narrow
        if df in quality.T_975:
            assert p == pytest.approx(0.975, abs=2e-4), df                         # and right where tabulated
    assert quality.t_975(11) == quality.t_975(10) > quality.t_975(12)


def test_interval_and_verdict_on_known_numbers():
    low, high = quality.interval([0.1, 0.2, 0.3])                                  # mean 0.2, sd 0.1, n 3
    assert (round(low, 3), round(high, 3)) == (-0.048, 0.448)
    five = [0.01, 0.03, 0.02, 0.04, 0.05]                                          # mean 0.03, sd 0.0158, n 5
    half = 2.776 * math.sqrt(0.00025) / math.sqrt(5)
    assert quality.interval(five) == (pytest.approx(0.03 - half), pytest.approx(0.03 + half))
    assert quality.paired([0.1, 0.2, 0.3]) == "+0.200 [-0.048, +0.448]" and quality.paired([0.2]) == "+0.200"
    assert quality.interval([0.2]) is None
    assert quality.verdict(five) == "worse than MHA" and quality.verdict([-v for v in five]) == "better than MHA"
    assert quality.verdict([0.1, 0.2, 0.3]) == "not resolved"                     # mean 2 sd clear, still not
    assert quality.verdict([0.2]) == "one seed: cannot judge"


def test_block_means_are_over_consecutive_windows():
    rise = torch.arange(256.0)
    means = quality.block_means(rise)
    assert len(means) == quality.BLOCKS and means[0] == pytest.approx(7.5) and means[-1] == pytest.approx(247.5)
    # Neighbours alike (a slow wave): the interval over blocks is wider than one over windows taken as independent.
    wave = torch.sin(torch.arange(256.0) / 8)
    widths = [high - low for low, high in (quality.interval(quality.block_means(wave)), quality.interval(wave.tolist()))]
    assert widths[0] > 2 * widths[1]


def test_zeroing_a_head_is_removing_its_slice_from_out_proj_input():
    """Silencing head j of a layer == out_proj applied to the heads' output without head j's dh columns."""
    torch.manual_seed(0)
    model = quality.CharLM(50, quality.N_HEADS)
    x = torch.randint(0, 50, (3, quality.CONTEXT))
    dh = quality.D_MODEL // quality.N_HEADS
    for layer, head in [(0, 0), (1, 5), (1, quality.N_HEADS - 1)]:
        attn = model.blocks[layer].attn
        seen = {}
        hook = attn.out_proj.register_forward_pre_hook(
            lambda mod, args, seen=seen: seen.update(o=args[0].detach().clone()))
        attn(model.blocks[layer].ln1(torch.randn(3, quality.CONTEXT, quality.D_MODEL)))
        hook.remove()
        o = seen["o"]                                                              # (..., h * dh): heads side by side
        keep = [c for c in range(quality.D_MODEL) if not head * dh <= c < (head + 1) * dh]
        removed = o[..., keep] @ attn.out_proj.weight[:, keep].T + attn.out_proj.bias
        silenced = quality.without_heads(model, [(layer, head)]).blocks[layer].attn.out_proj(o)
        assert torch.allclose(silenced, removed, atol=1e-6), (layer, head, (silenced - removed).abs().max())
        assert not torch.allclose(attn.out_proj(o), removed, atol=1e-3)          # the head mattered
    silenced = quality.without_heads(model, [(1, 5)])
    assert torch.equal(silenced(x), quality.without_heads(silenced, [(1, 5)])(x))   # twice is once
    assert model.blocks[1].attn.out_proj.weight[:, 5 * dh:6 * dh].abs().sum() > 0          # a copy was silenced


def test_head_ablation_pruning_follows_the_single_head_ranking(data):
    torch.manual_seed(1)
    model = quality.CharLM(len(data.chars), quality.N_HEADS)
    alone, order, curve = quality.head_ablation(model, data)
    heads = [(i, j) for i in range(quality.N_LAYERS) for j in range(quality.N_HEADS)]
    assert sorted(order) == heads and len(curve) == len(heads)
    rises = [alone[hd].mean().item() for hd in order]
    assert rises == sorted(rises)                                                  # least needed first
    base = quality.window_losses(model, data)
    assert curve[0] == pytest.approx(base.mean().item(), abs=1e-6)
    assert curve[1] == pytest.approx((base + alone[order[0]]).mean().item(), abs=1e-6)
    three = quality.window_losses(quality.without_heads(model, order[:3]), data).mean().item()
    assert curve[3] == pytest.approx(three, abs=1e-6)


def test_heads_that_can_go():
    limit = quality.PRUNE_LIMIT
    assert quality.heads_that_can_go([2.0, 2.01, 2.0 + limit - 0.001, 2.0 + limit + 0.001]) == 2
    assert quality.heads_that_can_go([2.0, 2.2, 2.0]) == 0
    assert quality.heads_that_can_go([2.0, 2.01, 2.02]) == 2


def test_further_training_is_five_percent_and_none_for_random_kv():
    assert quality.uptrain_steps(1800) == 90 and quality.uptrain_steps(6) == 1 and quality.uptrain_steps(1) == 1
    assert quality.uptrain_steps(1800, "random") == 0


def test_learning_rate_schedule():
    steps = 300
    lrs = [quality.lr_at(s, steps) for s in range(steps)]
    warm = round(quality.WARMUP * steps)
    assert lrs[warm - 1] == pytest.approx(quality.LR) and lrs[0] == pytest.approx(quality.LR / warm)
    assert lrs[-1] == pytest.approx(quality.MIN_LR * quality.LR)
    assert all(a >= b for a, b in zip(lrs[warm:], lrs[warm + 1:]))
    assert quality.lr_at(0, 1) > 0


# ----------------------------------------------------------------------------- to_gqa (MHA -> GQA conversion)
def tie_kv_heads_in_groups(attn, r):
    """Make every group of r consecutive K/V heads equal (to its first head), in place."""
    h, kv, dh = attn.n_heads, attn.n_kv_heads, attn.d_head
    with torch.no_grad():
        for t in (attn.in_proj.weight, attn.in_proj.bias):
            for start in (h * dh, (h + kv) * dh):                  # K rows, then V rows
                heads = t[start:start + kv * dh].unflatten(0, (kv // r, r, dh))  # (groups, r, dh, ...)
                heads.copy_(heads[:, :1].expand_as(heads))
    return attn


@pytest.mark.parametrize("h, kv, new_kv", [(6, 6, 2), (6, 6, 1), (8, 8, 4), (8, 4, 2), (12, 6, 2), (8, 2, 2)])
@pytest.mark.parametrize("pool", ["mean", "first"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_to_gqa_of_equal_heads_is_the_same_function(h, kv, new_kv, pool, dtype, tol):
    """Known answer: if each group's K/V heads are already equal, pooling them keeps the function, within
    rounding: the narrower module multiplies matrices of another width, which MKL may round differently
    (Intel CPUs under MKL_CBWR=AVX2 do), so this is a tolerance, not 0.0."""
    attn = tie_kv_heads_in_groups(gqa_module(16 * h, h, kv, dtype, seed=11), kv // new_kv)
    out = quality.to_gqa(attn, new_kv, pool=pool)
    assert (out.n_heads, out.n_kv_heads, out.d_head) == (h, new_kv, 16)
    for (name, p), (_, q) in zip(mha.to_torch(attn).named_parameters(), mha.to_torch(out).named_parameters()):
        assert mha.relative_diff(q, p) <= tol, name        # a mean of 3 equal floats may round
    x = torch.randn(2, 7, 16 * h, dtype=dtype)
    with torch.no_grad():
        y, y_out = attn(x), out(x)
    assert mha.relative_diff(y_out, y) <= tol, f"{mha.relative_diff(y_out, y):.2e}"


def test_to_gqa_of_different_heads_is_another_function():
    """The tolerance above is not loose: pooling heads that differ moves the output far beyond it."""
    attn = gqa_module(64, 4, 4, seed=3)
    x = torch.randn(2, 7, 64)
    with torch.no_grad():
        assert mha.relative_diff(quality.to_gqa(attn, 2)(x), attn(x)) > 1e-3


def test_to_gqa_mean_and_first_on_a_hand_made_module():
    """4 K/V heads of width 1 with known values, pooled to 2: the mean or the first of each pair."""
    attn = mha.CausalMHA(4, 4, 4)
    with torch.no_grad():
        attn.in_proj.weight.copy_(torch.arange(12.0).unsqueeze(1).expand(12, 4))   # row i is all i
        attn.in_proj.bias.copy_(-torch.arange(12.0))
    mean, first = quality.to_gqa(attn, 2), quality.to_gqa(attn, 2, pool="first")
    assert mean.in_proj.weight[:, 0].tolist() == [0, 1, 2, 3, 4.5, 6.5, 8.5, 10.5]
    assert first.in_proj.weight[:, 0].tolist() == [0, 1, 2, 3, 4, 6, 8, 10]
    assert mean.in_proj.bias.tolist() == [-0.0, -1, -2, -3, -4.5, -6.5, -8.5, -10.5]
    assert torch.equal(mean.out_proj.weight, attn.out_proj.weight)
    assert quality.to_gqa(attn, 1).in_proj.weight[:, 0].tolist() == [0, 1, 2, 3, 5.5, 9.5]


def test_to_gqa_copies_and_keeps_dtype_mode_and_bias():
    attn = gqa_module(64, 4, 4, torch.float64).train(False)
    out = quality.to_gqa(attn, 4)
    assert out is not attn and out.in_proj.weight.dtype == torch.float64 and not out.training
    assert torch.equal(out.in_proj.weight, attn.in_proj.weight)
    out.in_proj.weight.data.zero_()
    assert attn.in_proj.weight.abs().max() > 0                       # a copy, not a view
    no_bias = quality.to_gqa(mha.CausalMHA(64, 4, 2, bias=False), 1)
    assert no_bias.in_proj.bias is None and no_bias.n_kv_heads == 1


@pytest.mark.parametrize("kv, pool, error, words", [
    (3, "mean", ValueError, ["n_kv_heads=3", "positive divisor", "4 K/V heads"]),
    (8, "mean", ValueError, ["n_kv_heads=8"]),
    (0, "mean", ValueError, ["n_kv_heads=0"]),
    (2.0, "mean", TypeError, ["whole number", "2.0"]),
    (2, "max", ValueError, ["'max'", "'mean' or 'first'"]),
])
def test_to_gqa_refuses_in_one_sentence(kv, pool, error, words):
    with pytest.raises(error) as e:
        quality.to_gqa(mha.CausalMHA(64, 8, 4), kv, pool=pool)
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), str(e.value)
