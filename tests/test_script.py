"""The script as a user runs it: output, figures, errors, and no side effects on import."""

import errno
import os
import subprocess
import sys

import conftest
import pytest
from conftest import comparable, run_script

import mha

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "mha.py")
FIGURES = ["attention_maps.png", "kv_cache_size.png", "head_layout.png", "decode_time.png"]
DETERMINISTIC = FIGURES[:3]          # decode_time.png is measured, so it varies from run to run


def run(*args, cwd=None, script=SCRIPT):
    return run_script(script, *args, cwd=cwd)


def run_main(argv, capsys):
    return conftest.run_main(mha.main, argv, capsys)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two default runs into two folders (the expensive part, shared by the tests below)."""
    outs = [tmp_path_factory.mktemp(f"run{i}") for i in range(2)]
    return [(run("--out-dir", str(o)), o) for o in outs]


def test_default_run_prints_the_evidence(two_runs):
    r, _ = two_runs[0]
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "MHA   max |ours - nn.MultiheadAttention|             = 0.00e+00  OK" in out
    assert "FAIL, as it must" in out and "NOT DETECTED" not in out
    for row in ["MHA              32    2.15 GB      1x", "GQA-8             8    0.54 GB      4x",
                "GQA-4             4    0.27 GB      8x", "MQA               1    0.07 GB     32x",
                "GQA-16           16    1.07 GB      2x   <- g = 2 query heads per K/V head, as in your demo"]:
        assert row in out
    assert "Llama-2-70B              80   64    8  128  GQA-8      1.34 GB        29" in out
    assert "All checks: OK" in out
    assert r.stderr == ""




def test_comparable_masks_only_tolerance_values():
    exact = "  MHA   max |ours - nn.MultiheadAttention|  = 0.00e+00  OK  (must be exactly 0)"
    tol = "  GQA-4 max |ours - F.sdpa(enable_gqa=True)|  = 1.19e-07  OK  (tolerance 2e-06)"
    assert comparable(exact) == [exact]
    assert comparable(tol) == [tol.replace("1.19e-07", "<value>")]
    assert comparable(tol) == comparable(tol.replace("1.19e-07", "1.79e-07"))
    assert comparable(exact) != comparable(exact.replace("0.00e+00", "2.38e-07"))
    with pytest.raises(AssertionError):
        comparable(tol.replace("1.19e-07", "3.00e-06"))


def test_readme_quotes_the_real_output(two_runs):
    """Everything the run prints before the timings is the same on every CPU but the tolerance values."""
    r, _ = two_runs[0]
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    quoted = readme.split("<!-- output:start -->\n```text\n")[1].split("```\n<!-- output:end -->")[0]
    cut = "5. Decode step"
    assert cut in quoted and cut in r.stdout
    assert comparable(quoted.split(cut)[0]) == comparable(r.stdout.split(cut)[0])
    (q_figures, q_last), (r_figures, r_last) = quoted.rstrip().splitlines()[-2:], r.stdout.rstrip().splitlines()[-2:]
    assert q_last == r_last and q_figures.split(": ")[1:] == r_figures.split(": ")[1:]     # the folder differs


def test_default_run_writes_four_pngs_and_nothing_else(two_runs):
    _, out_dir = two_runs[0]
    assert sorted(os.listdir(out_dir)) == sorted(FIGURES)
    for name in FIGURES:
        with open(out_dir / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name


def test_figures_are_byte_identical_across_runs(two_runs):
    (_, a), (_, b) = two_runs
    for name in DETERMINISTIC:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_committed_figures_are_what_the_code_draws(two_runs):
    """figures/ must be regenerated when the code changes a figure.

    Another matplotlib draws other bytes, so elsewhere this skips; CI installs the version that drew
    them and must never skip.
    """
    from PIL import Image
    _, fresh = two_runs[0]
    for name in DETERMINISTIC:
        committed = os.path.join(ROOT, "figures", name)
        made_by = Image.open(committed).info.get("Software")
        here = Image.open(fresh / name).info.get("Software")
        if made_by != here:
            assert not os.environ.get("CI"), f"CI must install the matplotlib that drew figures/{name}: {made_by}"
            pytest.skip(f"{name} was drawn by {made_by}; this machine's {here} draws it differently")
        with open(committed, "rb") as f:
            assert f.read() == (fresh / name).read_bytes(), f"figures/{name} is stale: run python mha.py"


def test_knob_changes_the_run(tmp_path, capsys):
    code, out, _ = run_main(["--n-kv-heads", "2", "--out-dir", str(tmp_path)], capsys)
    assert code == 0
    assert "GQA-2 max |ours - nn.MHA with K/V heads repeated|" in out
    assert "GQA-8             8    0.54 GB      4x   <- g = 4 query heads per K/V head, as in your demo" in out
    assert out.count("<- g =") == 1 and "GQA-16" not in out


def test_knob_that_matches_no_row_says_so(monkeypatch, capsys):
    monkeypatch.setattr(mha, "LLAMA_HEADS", 20)
    monkeypatch.setattr(mha, "LLAMA_KV_HEADS", (20, 4, 1))
    mha.print_cache_table(1)                   # g = 8 does not divide 20 query heads
    out = capsys.readouterr().out
    assert "g = 8 does not divide 20 query heads: no row has it" in out and "<-" not in out


# ----------------------------------------------------------------------------- mistakes a user can make
@pytest.mark.parametrize("flag, value, words", [
    ("--n-kv-heads", "3", ["n_kv_heads=3", "positive divisor of n_heads=8"]),
    ("--n-kv-heads", "0", ["n_kv_heads=0", "positive divisor"]),
    ("--n-kv-heads", "-4", ["n_kv_heads=-4", "positive divisor"]),
    ("--n-kv-heads", "16", ["n_kv_heads=16", "positive divisor"]),
    ("--n-kv-heads", "two", ["'two'"]),
    ("--seed", "-1", ["-1", "2**32 - 1"]),
    ("--seed", str(2**64), [str(2**64)]),
    ("--seed", "abc", ["'abc'"]),
])
def test_bad_flag_exits_2_with_one_line(flag, value, words, tmp_path, capsys):
    code, out, err = run_main([f"{flag}={value}", "--out-dir", str(tmp_path)], capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("mha.py: error: "), err
    for w in words:
        assert w in err
    assert os.listdir(tmp_path) == []


def test_bad_flag_from_the_shell_exits_2_without_traceback(tmp_path):
    r = run("--n-kv-heads", "-4", "--out-dir", str(tmp_path))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == "mha.py: error: n_kv_heads=-4 must be a positive divisor of n_heads=8 (1 = MQA, 8 = MHA, " \
                       "a divisor in between = GQA)\n"
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("knob, value, words", [
    ("SEQ_LEN", 0, ["SEQ_LEN=0", "at least 1"]),
    ("SEQ_LEN", 1, ["SEQ_LEN=1", "at least 2"]),
    ("BATCH", 1.5, ["BATCH", "whole number", "1.5"]),
    ("N_HEADS", 6, ["d_model=256", "n_heads=6"]),
    ("DECODE_CONTEXTS", (), ["DECODE_CONTEXTS", "at least one"]),
    ("DECODE_CONTEXTS", (512, -8), ["DECODE_CONTEXTS[1]=-8"]),
    ("DECODE_ROUNDS", 0, ["DECODE_ROUNDS=0"]),
    ("LLAMA_KV_HEADS", (32, 6), ["n_kv_heads=6", "positive divisor of n_heads=32"]),
    ("LLAMA_KV_HEADS", (8, 1), ["must include LLAMA_HEADS=32"]),
    ("N_HEADS", 1, ["N_HEADS=1", "at least 2", "swaps query heads 0 and 1"]),
    ("N_HEADS", 128, ["N_HEADS=128", "at most 64"]),
    ("SEQ_LEN", 10**6, ["SEQ_LEN=1000000", "at most 512"]),
    ("D_MODEL", 8192, ["D_MODEL=8192", "at most 4096"]),
    ("D_MODEL", 2**30, ["d_model=1073741824", "GB of weights, more than this machine's"]),
    ("GPU_CACHE_GB", float("inf"), ["GPU_CACHE_GB=inf", "finite"]),
    ("GPU_CACHE_GB", float("nan"), ["GPU_CACHE_GB=nan", "finite"]),
    ("GPU_CACHE_GB", 0, ["GPU_CACHE_GB=0", "positive"]),
    ("DECODE_CONTEXTS", (10**7,), ["DECODE_CONTEXTS up to 10,000,000 tokens", "460.8 GB", "at most 4 GB"]),
    ("MATMUL_N", 0, ["MATMUL_N=0", "at least 1"]),
    ("MATMUL_N", 200000, ["MATMUL_N=200000", "at most 4096"]),
    ("GPU", ("X", 989e12, 0), ["GPU=", "positive, finite"]),
    ("PUBLISHED_MODELS", {"Odd-7B": (32, 32, 3, 128)}, ["n_kv_heads=3", "positive divisor of n_heads=32"]),
    ("PUBLISHED_MODELS", {"Odd-7B": (32.5, 32, 8, 128)}, ["layers of Odd-7B", "32.5"]),
    ("CACHE_TOKENS", "4k", ["CACHE_TOKENS", "'4k'"]),
])
def test_a_knob_that_cannot_work_is_refused_at_start(knob, value, words, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(mha, knob, value)
    code, out, err = run_main(["--out-dir", str(tmp_path)], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err
    assert os.listdir(tmp_path) == []


def test_the_shortest_sequence_works(monkeypatch, capsys):
    monkeypatch.setattr(mha, "SEQ_LEN", 2)
    assert mha.run_checks(2, 0) and mha.check_cache(2, 0)
    assert "cache fed 1 tokens, then 1 one at a time" in capsys.readouterr().out
    mha.plot_attention_maps(2, 0)


def test_why_one_token_is_refused(monkeypatch, capsys):
    """With T = 1 the swapped-query demo cannot fail: softmax over one key is 1, the output is v."""
    monkeypatch.setattr(mha, "SEQ_LEN", 1)
    assert not mha.run_checks(2, 0)
    assert "NOT DETECTED" in capsys.readouterr().out
    with pytest.raises(ValueError, match="SEQ_LEN=1 must be at least 2"):
        mha.check_knobs()


def out_dir_error(target, capsys, early=True):
    """The one-line error of a run into target; early: found with the flags, before anything was computed
    or printed, so it exits 2 as a bad flag does; late: found when the figures are written, exit 1."""
    code, out, err = run_main(["--out-dir", str(target)], capsys)
    assert code == (2 if early else 1) and (out == "") == early, out
    assert len(err.strip().splitlines()) == 1 and err.startswith("mha.py: error: "), err
    return err


def test_out_dir_under_a_file(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    err = out_dir_error(blocker / "figures", capsys)
    assert f"'{blocker}' is a file, not a folder" in err
    assert os.listdir(tmp_path) == ["a_file"]


def test_out_dir_that_is_a_file(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    assert f"'{blocker}' is a file, not a folder" in out_dir_error(blocker, capsys)


def test_out_dir_that_takes_no_files(capsys):
    assert "the folder '/proc' exists but does not accept new files" in out_dir_error("/proc", capsys)


def test_a_figure_name_taken_by_a_folder(tmp_path, capsys):
    (tmp_path / "head_layout.png").mkdir()
    err = out_dir_error(tmp_path, capsys)
    assert f"'{tmp_path / 'head_layout.png'}' exists and is not a file" in err
    assert os.listdir(tmp_path) == ["head_layout.png"]


def test_an_out_dir_too_long_for_the_figures_paths(tmp_path, capsys):
    """The folder itself can be made, but a figure's path inside it would pass the system's limit."""
    limit = os.pathconf(str(tmp_path), "PC_PATH_MAX") - 1      # characters a path may have (4095 on Linux)
    target = str(tmp_path)
    while limit - 10 - len(target) > 201:
        target = os.path.join(target, "d" * 200)
    target = os.path.join(target, "e" * (limit - 10 - len(target) - 1))
    assert len(target) == limit - 10                           # "/attention_maps.png" does not fit after it
    err = out_dir_error(target, capsys)
    assert "File name too long" in err, err
    assert os.listdir(tmp_path) == []                          # the folders it made to try are gone again


def test_a_new_out_dir_is_made_only_when_the_figures_are_written(tmp_path, capsys, monkeypatch):
    """Checking a new nested --out-dir leaves the disk as it was; a failed write removes what it made."""
    target = tmp_path / "new" / "figures"
    assert mha.out_dir_problem(str(target), mha.FIGURES) is None and os.listdir(tmp_path) == []

    def no_space(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), dst)

    monkeypatch.setattr(mha.os, "replace", no_space)
    assert not mha.write_figures("mha.py", str(target), {"a.png": b"a"})
    assert "No space left on device; nothing was written" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    assert mha.write_figures("mha.py", str(target), {"a.png": b"a"}) and os.listdir(target) == ["a.png"]


def test_a_full_disk_writes_nothing(tmp_path, monkeypatch, capsys):
    """The third figure's write fails for lack of space: one line, exit 1, no figure and no temporary file."""
    real_open = open
    calls = []

    def filling_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if mode == "xb" and str(path).endswith(".tmp"):
            calls.append(path)
            if len(calls) == 3:
                f.close()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return f

    monkeypatch.setattr("builtins.open", filling_open)
    err = out_dir_error(tmp_path, capsys, early=False)
    assert err == f"mha.py: error: cannot write '{tmp_path / 'kv_cache_size.png'}': No space left on device; " \
                  "nothing was written\n"
    assert os.listdir(tmp_path) == []


def test_a_really_full_disk_writes_nothing(tmp_path):
    """The same on a 200 KB tmpfs, where the system says it (needs root to mount; skipped elsewhere)."""
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(small)],
                      check=False, capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        r = run("--out-dir", str(small))
        assert r.returncode == 1 and "No space left on device" in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and os.listdir(small) == []
    finally:
        subprocess.run(["umount", str(small)], check=True)


@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_a_closed_pipe_ends_quietly(tmp_path, unbuffered):
    """python mha.py | head -3: no traceback, nothing on stderr, no half-written figure."""
    env = dict(os.environ, PYTHONUNBUFFERED=unbuffered)
    p = subprocess.Popen([sys.executable, SCRIPT, "--out-dir", str(tmp_path)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    head = [p.stdout.readline() for _ in range(3)]
    p.stdout.close()                           # what head does after three lines
    err = p.stderr.read()
    code = p.wait(timeout=300)
    assert head[0].startswith(b"Causal attention") and err == b"", err.decode()
    # Unbuffered, the next print meets the closed pipe: exit 1 before any figure. Buffered, the whole
    # output fits in the pipe's buffer before it closes, and the run completes.
    assert code == (1 if unbuffered else 0)
    assert sorted(os.listdir(tmp_path)) == ([] if unbuffered else sorted(FIGURES))


def test_a_rename_failing_late_says_what_was_already_written(tmp_path, capsys):
    """A folder that appears where the third figure goes, after the checks: the line names it and the two
    figures already written, and no temporary file is left."""
    pngs = {n: n.encode() for n in ["a.png", "b.png", "c.png"]}
    (tmp_path / "c.png").mkdir()
    assert not mha.write_figures("mha.py", str(tmp_path), pngs)
    err = capsys.readouterr().err
    assert err == f"mha.py: error: cannot write '{tmp_path / 'c.png'}': Is a directory; written before it: " \
                  "a.png, b.png\n"
    assert sorted(os.listdir(tmp_path)) == ["a.png", "b.png", "c.png"] and (tmp_path / "c.png").is_dir()


def test_an_empty_out_dir_is_refused(capsys):
    assert "--out-dir is empty: name a folder" in out_dir_error("", capsys)


def test_unsorted_decode_contexts_are_timed_in_order(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(mha, "DECODE_CONTEXTS", (512, 64, 256, 64))
    code, out, _ = run_main(["--out-dir", str(tmp_path)], capsys)
    rows = [line.split()[0] for line in out.split("vs MHA |")[-1].splitlines()[1:] if "|" in line]
    assert code == 0 and rows == ["64", "256", "512"]


def test_interrupted_write_leaves_no_file(tmp_path, monkeypatch):
    paths = {str(tmp_path / n): n.encode() for n in ["a.png", "b.png"]}
    (tmp_path / "a.png").write_bytes(b"old")

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(mha.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        mha.write_all(paths)
    assert os.listdir(tmp_path) == ["a.png"] and (tmp_path / "a.png").read_bytes() == b"old"
    monkeypatch.undo()
    mha.write_all(paths)
    assert sorted(os.listdir(tmp_path)) == ["a.png", "b.png"] and (tmp_path / "a.png").read_bytes() == b"a.png"


def test_a_failing_check_says_fail_and_exits_1(tmp_path, monkeypatch, capsys):
    """Copy the weights wrongly for every check, and the run must say FAIL and exit 1."""
    right = mha.CausalMHA.from_torch

    def wrong(ref):
        return mha.swap_query_heads(right(ref), 2, 3)

    monkeypatch.setattr(mha.CausalMHA, "from_torch", staticmethod(wrong))
    code, out, _ = run_main(["--out-dir", str(tmp_path)], capsys)
    assert code == 1
    assert "MHA   max |ours - nn.MultiheadAttention|" in out and "FAIL  (must be exactly 0)" in out
    assert out.rstrip().endswith("All checks: FAIL")


def test_help_shows_the_defaults(capsys):
    code, out, _ = run_main(["--help"], capsys)
    assert code == 0
    assert f"default: {mha.N_KV_HEADS}" in out and "--out-dir" in out and "--seed" in out


def test_import_has_no_side_effects(tmp_path):
    before = sorted(os.listdir(ROOT))
    figures = os.path.join(ROOT, "figures")
    stamps = {n: os.stat(os.path.join(figures, n)).st_mtime_ns for n in os.listdir(figures)} \
        if os.path.isdir(figures) else {}
    r = subprocess.run([sys.executable, "-c", "import mha"], check=False, capture_output=True, text=True, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", r.stderr
    assert os.listdir(tmp_path) == [] and sorted(os.listdir(ROOT)) == before
    if stamps:
        assert {n: os.stat(os.path.join(figures, n)).st_mtime_ns for n in os.listdir(figures)} == stamps


# ----------------------------------------------------------------------------- the README's "Things to try"
def things_to_try():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read().split("## Things to try")[1].split("\n## ")[0]


def edited_copy(old, new, tmp_path):
    """mha.py with every `old` replaced by `new`, imported from a copy (old must be there)."""
    import importlib.util
    with open(SCRIPT) as f:
        src = f.read()
    assert old in src, f"the README's edit no longer applies: {old!r} is not in mha.py"
    assert f"`{new}`" in things_to_try(), f"the README no longer gives the edit {new!r}"
    path = tmp_path / "mha_edited.py"
    path.write_text(src.replace(old, new))
    spec = importlib.util.spec_from_file_location("mha_edited", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["mha_edited"] = module          # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["mha_edited"]
    return module


def line_with(out, start):
    return next(line for line in out.splitlines() if line.lstrip().startswith(start))


def test_try_two_kv_heads(capsys, tmp_path):
    m = edited_copy("N_KV_HEADS = 4 ", "N_KV_HEADS = 2", tmp_path)
    kv = m.parse_args([]).n_kv_heads
    assert kv == 2 and m.run_checks(kv, 0)
    m.print_cache_table(kv)
    out = capsys.readouterr().out
    assert "GQA-2 max |ours - nn.MHA with K/V heads repeated|" in out
    assert line_with(out, "GQA-8").endswith("<- g = 4 query heads per K/V head, as in your demo")


def test_try_swapping_two_heads(capsys, tmp_path):
    m = edited_copy("copy = CausalMHA.from_torch(ref)", "copy = swap_query_heads(CausalMHA.from_torch(ref), 2, 3)", tmp_path)
    assert not m.run_checks(4, 0)
    out = capsys.readouterr().out
    mha_lines = [line for line in out.splitlines() if line.lstrip().startswith("MHA ")]
    assert len(mha_lines) == 3 and all(line.endswith("FAIL  (must be exactly 0)") for line in mha_lines)
    assert "GQA-4 max |ours - nn.MHA with K/V heads repeated|    = 0.00e+00  OK" in out


def test_try_repeat_instead_of_repeat_interleave(capsys, tmp_path):
    m = edited_copy(".repeat_interleave(g, dim=0)", ".repeat(g, 1, 1)", tmp_path)
    assert not m.run_checks(4, 0)
    out = capsys.readouterr().out
    assert line_with(out, "MHA   max |ours").endswith("OK  (must be exactly 0)")
    assert line_with(out, "GQA-4 max |ours - nn.MHA").endswith("FAIL  (tolerance 2e-06)")
    assert line_with(out, "GQA-4 same, need_weights=True: outputs").endswith("FAIL  (tolerance 2e-06)")
    assert line_with(out, "GQA-4 same, need_weights=True: per-head").endswith("FAIL  (tolerance 2e-06)")
    assert line_with(out, "GQA-4 max |ours - F.sdpa").endswith("OK  (tolerance 2e-06)")   # not through to_torch


def test_try_projecting_batch_major(capsys, tmp_path):
    """The edited check may FAIL by a few units in the last place: whether the two layouts round alike
    depends on the CPU's MKL path (AMD EPYC: 2.38e-07; Intel Xeon with AVX-512: 0.0). What holds on every
    CPU: the check says FAIL exactly when it measured a difference, and the difference is tiny."""
    m = edited_copy("self.in_proj(x.transpose(0, 1))", "self.in_proj(x).transpose(0, 1)", tmp_path)
    ok = m.run_checks(4, 0)
    diff = float(line_with(capsys.readouterr().out, "MHA   max |ours").split("= ")[1].split()[0])
    assert ok == (diff == 0.0) and diff < 1e-6, diff


def test_try_a_longer_context(capsys, tmp_path):
    m = edited_copy("CACHE_TOKENS = 4096", "CACHE_TOKENS = 8192", tmp_path)
    m.print_cache_table(4)
    m.print_published_table()
    out = capsys.readouterr().out
    assert "MHA's 4,294,967,296 bytes are 4.29 GB but 4.00 GiB" in out
    assert line_with(out, "MHA ").split()[2:4] == ["4.29", "GB"]
    assert line_with(out, "Llama-2-7B").split()[-1] == "9"          # 18 requests at 4096 tokens


def test_ctrl_c_ends_in_one_line_and_exit_130(capsys, monkeypatch):
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(sys, "argv", ["mha.py"])
    with pytest.raises(SystemExit) as e:
        mha.run_as_script(interrupted)
    assert e.value.code == 130
    assert capsys.readouterr().err == "\nmha.py: interrupted\n"


def test_a_closed_stdout_is_one_line(tmp_path):
    """python mha.py >&- : one line on stderr, exit 1, nothing written."""
    r = subprocess.run([sys.executable, SCRIPT, "--out-dir", str(tmp_path)], check=False, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True, timeout=300, preexec_fn=lambda: os.close(1))
    assert r.returncode == 1 and r.stderr == "mha.py: error: standard output is closed\n", r.stderr
    assert os.listdir(tmp_path) == []


def test_a_full_stdout_is_one_line(tmp_path):
    """python mha.py > /dev/full : one line naming the cause, exit 1, no traceback."""
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, SCRIPT, "--out-dir", str(tmp_path)], check=False, stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert r.stderr == "mha.py: error: cannot write to standard output: No space left on device\n", r.stderr


def test_a_folder_name_the_terminal_cannot_encode(tmp_path):
    """PYTHONIOENCODING=ascii and a non-ASCII --out-dir: the run completes and shows the name escaped."""
    target = tmp_path / "figures-\u00e9t\u00e9"
    env = dict(os.environ, PYTHONIOENCODING="ascii")
    r = subprocess.run([sys.executable, SCRIPT, "--out-dir", str(target)], check=False, capture_output=True,
                       timeout=300, env=env)
    assert r.returncode == 0 and r.stderr == b"", r.stderr.decode()
    assert b"figures-\\xe9t\\xe9" in r.stdout and sorted(os.listdir(target)) == sorted(FIGURES)


def test_another_oserror_is_not_blamed_on_stdout(capsys, monkeypatch):
    def failing():
        raise OSError(errno.EACCES, "something else")

    monkeypatch.setattr(sys, "argv", ["mha.py"])
    with pytest.raises(OSError, match="something else"):
        mha.run_as_script(failing)


def test_an_out_dir_through_a_link_and_dotdot_goes_where_the_system_says(tmp_path, capsys, monkeypatch):
    """link/../exists is real/exists (the link is followed first): nothing made beside it, and named so."""
    (tmp_path / "real" / "deep").mkdir(parents=True)
    (tmp_path / "real" / "exists").mkdir()
    (tmp_path / "cwd").mkdir()
    (tmp_path / "cwd" / "link").symlink_to(tmp_path / "real" / "deep")
    monkeypatch.chdir(tmp_path / "cwd")
    assert mha.out_dir_problem("link/../newdir", mha.FIGURES) is None        # mkdir -p would make real/newdir
    assert mha.write_figures("mha.py", "link/../exists", {"a.png": b"a"})
    assert os.listdir(tmp_path / "cwd") == ["link"] and os.listdir(tmp_path / "real" / "exists") == ["a.png"]
    assert mha.shown_path("link/../exists") == os.path.join(str(tmp_path / "real" / "exists"), "")


def test_an_out_dir_with_a_newline_is_still_one_line(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    code, out, err = run_main(["--out-dir", str(blocker / "a\nb")], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "\\n" in err
