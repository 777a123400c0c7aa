"""quality.py: a tiny end-to-end run as a user runs it, determinism, and the pieces whose bugs would hide."""

import io
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

import quality

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "quality.py")
FIGURES = ["quality.png", "trained_attention_maps.png"]
TINY = ["--steps", "4", "--seeds", "0"]            # seconds, not minutes: nothing is learned, everything runs


def run(*args, **kwargs):
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "MPLBACKEND")}   # headless, as in CI
    return subprocess.run([sys.executable, SCRIPT, *args], check=False, capture_output=True, text=True, env=env,
                          timeout=300, **kwargs)


def numbers(stdout):
    """Everything the run prints except its wall time, its number of workers and the folder it wrote to."""
    return [line for line in stdout.splitlines() if not line.startswith(("time:", "Figures written to", "torch "))]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny run as a user starts it, on the default WORKERS (the expensive part, shared below)."""
    out = tmp_path_factory.mktemp("quality")
    return run(*TINY, "--out-dir", str(out)), out


@pytest.fixture(scope="module")
def data():
    return quality.Data(quality.load_text())


# ----------------------------------------------------------------------------- end to end
def test_tiny_run_prints_three_tables_and_writes_two_pngs(tiny_run):
    r, out_dir = tiny_run
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "\r" not in r.stderr      # piped: plain progress lines only
    out = r.stdout
    assert f"Python {sys.version.split()[0]}" in out and "sha256" in out
    assert f"{quality.WORKERS} worker processes of 1 thread each" in out
    table_a = out.split("A. From scratch")[1].split("B. Conversion")[0]
    for name, kv in quality.CONFIGS.items():
        assert any(line.split()[:2] == [name, str(kv)] for line in table_a.splitlines()), name
    assert "one seed: no spread to judge noise by" in table_a
    table_b = out.split("B. Conversion")[1].split("C. What each head")[0]
    rows = [line.split()[:2] for line in table_b.splitlines() if line.split()[:1] in ([n] for n in quality.CONFIGS)]
    assert rows[0] == ["MHA", "(trained)"] and len(rows) == 1 + 3 * len(quality.POOLS)
    assert "mean pool beats random K/V for every target:" in table_b
    table_c = out.split("C. What each head")[1]
    heads = [line for line in table_c.splitlines() if line.split()[:2] and line.split()[0].isdigit()]
    assert len(heads) == quality.N_LAYERS * quality.N_HEADS
    assert "most previous-character-like: layer" in table_c
    assert sorted(os.listdir(out_dir)) == sorted(FIGURES)
    for name in FIGURES:
        assert (out_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_same_seed_same_numbers_and_pngs_with_one_worker_or_two(tiny_run, tmp_path, capsys, monkeypatch):
    """A second run with the same seed, in process and on one worker: every number and both PNGs the same.

    Every model trains on one thread in whichever worker is free, so the number of workers changes no bit.
    """
    a, a_dir = tiny_run
    assert a.returncode == 0 and quality.WORKERS == 2, a.stderr
    monkeypatch.setattr(quality, "WORKERS", 1)
    threads = torch.get_num_threads()
    try:
        assert quality.main([*TINY, "--out-dir", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)                                             # main() computes on one thread
    out = capsys.readouterr().out
    assert "1 worker process of 1 thread each" in out
    assert numbers(out) == numbers(a.stdout)
    for name in FIGURES:
        assert (tmp_path / name).read_bytes() == (a_dir / name).read_bytes(), name


def test_seeds_change_the_numbers(data):
    """In process: two seeds give two initialisations and data orders, one seed gives the same bits twice."""
    torch.set_num_threads(1)

    def loss_after(seed, steps=3):
        model = quality.fresh_models(len(data.chars), seed)["GQA-2"]
        quality.train(model, data, data.batches(seed, steps), quality.lr_at, quality.Progress(steps, io.StringIO()),
                      "test")
        return quality.evaluate(model, data)

    assert loss_after(0) == loss_after(0)
    assert loss_after(0) != loss_after(1)


def test_broken_pipe_exits_quietly(tmp_path):
    """python quality.py | head -3: no traceback, exit 1, once the reader has gone."""
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "MPLBACKEND")}
    p = subprocess.Popen([sys.executable, SCRIPT, "--steps", "1", "--seeds", "0", "--out-dir", str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    for _ in range(3):
        p.stdout.readline()
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 1
    assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads a process's children from /proc")
def test_ctrl_c_is_one_line_exit_130_and_stops_the_workers(tmp_path):
    """Ctrl-C reaches every process of the group, workers too, even while they start: one line, no trace."""
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "MPLBACKEND")}
    p = subprocess.Popen([sys.executable, SCRIPT, "--steps", "1000", "--seeds", "0", "--out-dir", str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    p.stdout.readline()                                    # the workers have started, and may still be importing
    children = pathlib.Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
    assert len(children) >= quality.WORKERS
    os.killpg(p.pid, signal.SIGINT)                                                # as a terminal's Ctrl-C does
    assert p.wait(timeout=60) == 130
    err = p.stderr.read()
    assert err.endswith("quality.py: interrupted\n") and "Traceback" not in err, err
    assert os.listdir(tmp_path) == []

    def alive(pid):
        try:
            return pathlib.Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"   # no zombie
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while any(map(alive, children)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(alive, children)), "a worker outlived the interrupted run"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the workers in /proc")
def test_a_worker_killed_from_outside_is_one_line_and_exit_1(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "MPLBACKEND")}
    p = subprocess.Popen([sys.executable, SCRIPT, "--steps", "1000", "--seeds", "0", "--out-dir", str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    p.stdout.readline()
    children = pathlib.Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
    workers = [c for c in children if "resource_tracker" not in pathlib.Path(f"/proc/{c}/cmdline").read_text()]
    assert len(workers) == quality.WORKERS
    os.kill(int(workers[0]), signal.SIGKILL)                                       # as the OOM killer would
    assert p.wait(timeout=60) == 1
    err = p.stderr.read()
    last = err.strip().splitlines()[-1]
    assert last.startswith("quality.py: error: a worker process stopped (exit code -9"), err
    assert "nothing was written" in last and "Traceback" not in err, err
    assert os.listdir(tmp_path) == []


def test_an_error_in_a_worker_stops_the_run_at_once():
    """A task that fails is raised in the main process with its traceback, not after the tasks queued behind it."""
    progress = quality.Progress(1, io.StringIO())
    start = time.monotonic()
    with quality.Workers(1, progress) as workers, pytest.raises(RuntimeError, match="KeyError: 'no such config'"):
        workers.run(quality.train_from_scratch, [("no such config", 0, 1), ("MHA", 0, 100_000)])
    assert time.monotonic() - start < 60


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("argv, value", [
    (["--steps", "0"], "'0'"), (["--steps", "-3"], "'-3'"), (["--steps", "1000000000000"], "'1000000000000'"), (["--steps", "1.5"], "'1.5'"), (["--steps", "x"], "'x'"),
    (["--seeds", "x"], "'x'"), (["--seeds", "-1"], "'-1'"), (["--seeds", str(2**32)], str(2**32)),
    (["--seeds", "1", "1"], "1 1"), (["--seeds"], "--seeds"),
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


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        quality.parse_args(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert f"default: {quality.STEPS}" in out and "5% and 10% of it" in out and "--seeds" in out


def test_unwritable_out_dir_is_one_line_and_exit_1(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    assert quality.main([*TINY, "--out-dir", str(blocker / "figures")]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and str(blocker / "figures") in err
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


# ----------------------------------------------------------------------------- the pieces
def test_every_configuration_starts_from_the_mha_initialisation():
    models = quality.fresh_models(50, seed=3)
    base, dh = models["MHA"], quality.D_MODEL // quality.N_HEADS
    q_rows = quality.N_HEADS * dh
    for name, kv in quality.CONFIGS.items():
        model = models[name]
        assert model.n_kv_heads == kv
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


def test_bits_per_char_known_answer():
    V = 64
    logits = torch.zeros(2, 3, V)                                                  # uniform: log2(64) = 6 bits
    assert quality.bits_per_char(logits, torch.zeros(2, 3, dtype=torch.long)).item() == pytest.approx(6.0, abs=1e-6)


def test_validation_windows_and_baselines(data):
    assert data.val_x.shape == data.val_y.shape == (quality.EVAL_WINDOWS, quality.CONTEXT)
    assert torch.equal(data.val_x[:, 1:], data.val_y[:, :-1])                       # y is x one character on
    assert len(data.train) + len(data.val) == len(quality.load_text())
    unigram, bigram = quality.baselines(data)
    assert bigram < unigram < torch.log2(torch.tensor(float(len(data.chars)))).item()


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
    # Uniform attention: query i puts 1/(i+1) on each key, so on the previous key (and on itself) the mean
    # over queries 1 .. T-1 is the mean of 1/(i+1); on whitespace it is about the share of whitespace.
    level = sum(1 / (i + 1) for i in range(1, T)) / (T - 1)
    assert chance["previous"] == pytest.approx(level) and chance["itself"] == pytest.approx(level)
    share = sum(data.chars[c].isspace() for c in data.val_x.flatten().tolist()) / data.val_x.numel()
    assert abs(chance["whitespace"] - share) < 0.03


def test_a_head_attending_uniformly_is_at_the_uniform_level_for_every_role(data):
    T, h = quality.CONTEXT, quality.N_HEADS

    class Uniform(torch.nn.Module):
        def forward(self, x, need_weights=False):
            p = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]
            return None, [p.expand(len(x), h, T, T)]

    roles, chance = quality.head_roles(Uniform(), data)
    for role, level in chance.items():
        assert torch.allclose(roles[role], torch.full((1, h), level)), role


def test_verdict_is_computed_from_the_spread():
    assert quality.verdict([0.10, 0.12, 0.14]) .startswith("worse than MHA")
    assert quality.verdict([0.05, -0.03, 0.04]) == "within noise"                   # mean 0.02 < spread 0.044
    assert quality.verdict([-0.10, -0.12, -0.14]).startswith("better than MHA")
    assert quality.verdict([0.2]) == "one seed: no spread to judge noise by"
    assert quality.spread([1.0, 3.0]) == pytest.approx(2 ** 0.5)


def test_learning_rate_schedule():
    steps = 300
    lrs = [quality.lr_at(s, steps) for s in range(steps)]
    warm = round(quality.WARMUP * steps)
    assert lrs[warm - 1] == pytest.approx(quality.LR) and lrs[0] == pytest.approx(quality.LR / warm)
    assert lrs[-1] == pytest.approx(quality.MIN_LR * quality.LR)
    assert all(a >= b for a, b in zip(lrs[warm:], lrs[warm + 1:]))
    assert quality.lr_at(0, 1) > 0


def test_progress_line_in_place_on_a_terminal_plain_when_piped_and_slow_flagged(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(quality, "PLAIN_EVERY", 0.0)
    for stream in (Terminal(), io.StringIO()):
        p = quality.Progress(40, stream)
        monkeypatch.setattr(p, "last_print", -1e9)
        for i in range(40):
            p.last_print = -1e9                                                    # print every step
            p.step("A MHA seed 0", i + 1, 40, 3.0, 0.01 if i < 20 else 0.1)       # 10x slower after step 20
        text = stream.getvalue()
        assert ("\r" in text) == stream.isatty() and ("\n" in text) != stream.isatty()
        lines = text.replace("\r", "\n").strip().splitlines()
        assert "step    40/40" in lines[-1] and "left ~0:00" in lines[-1]
        assert "SLOW: steps take 10x" in lines[-1] and "SLOW" not in lines[18]
