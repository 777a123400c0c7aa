"""The script as a user runs it: output, figures, errors, the README's Things to try, no side effects on import."""

import errno
import importlib.util
import os
import subprocess
import sys

import conftest
import pytest
import torch
from conftest import comparable, run_script

import mha

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "mha.py")
FIGURES = ["attention_maps.png", "kv_cache_size.png", "head_layout.png", "stacking.png", "decode_time.png"]
DETERMINISTIC = FIGURES[:4]          # decode_time.png is measured, so it varies from run to run


def run_main(argv, capsys):
    return conftest.run_main(mha.main, argv, capsys)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two default runs into two folders (the expensive part, shared by the tests below)."""
    outs = [tmp_path_factory.mktemp(f"run{i}") for i in range(2)]
    return [(run_script(SCRIPT, "--out-dir", str(o)), o) for o in outs]


def test_default_run_prints_the_evidence(two_runs):
    r, _ = two_runs[0]
    assert r.returncode == 0 and r.stderr == "", r.stderr
    out = r.stdout
    for start in ["MHA   written out vs nn.MHA(need_weights=True)", "MHA   the same, per-head weights",
                  "MHA   fused vs nn.MHA(need_weights=False)"]:
        assert line_with(out, start).endswith("= 0.00e+00  OK  (must be exactly 0)"), start
    assert "DETECTED, as it must be" in out and "NOT DETECTED" not in out
    for row in ["MHA              32    2.15 GB      1x", "MQA               1    0.07 GB     32x",
                ("GQA-16           16    1.07 GB      2x   <- g = 2, as in your demo: its 8 query heads over 4, "
                 "this row's 32 over 16"),
                "Llama-2-70B              80   64    8  128  GQA-8      1.34 GB        29"]:
        assert row in out
    assert out.rstrip().endswith("All checks: OK")


def test_comparable_masks_only_tolerance_values_and_pytorch_against_itself():
    exact = "  MHA   fused vs nn.MHA(need_weights=False)  = 0.00e+00  OK  (must be exactly 0)"
    tol = "  GQA-4 written out vs F.sdpa(enable_gqa=True)  = 1.19e-07  OK  (tolerance 2e-06)"
    own = "        nn.MHA need_weights=True vs =False  = 1.79e-07  (PyTorch against itself: not a check)"
    assert comparable(exact) == [exact] and comparable(exact) != comparable(exact.replace("0.00e+00", "2.38e-07"))
    assert comparable(tol) == comparable(tol.replace("1.19e-07", "1.79e-07")) != [tol]
    assert comparable(own) == comparable(own.replace("1.79e-07", "0.00e+00"))
    with pytest.raises(AssertionError):
        comparable(tol.replace("1.19e-07", "3.00e-06"))


def readme_output():
    """The quoted output of `python mha.py`, joined as printed: the README's blocks (sections 1 to 3, then 4)
    and LABNOTES.md's (section 5 and the run's last lines), all from one run."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    with open(os.path.join(ROOT, "LABNOTES.md")) as f:
        notes = f.read()
    blocks = [part.split("```\n<!-- output:end -->")[0] for part in readme.split("<!-- output:start -->\n```text\n")[1:]]
    blocks += [part.split("```\n<!-- mha-output:end -->")[0] for part in notes.split("<!-- mha-output:start -->\n```text\n")[1:]]
    assert len(blocks) == 3 and blocks[1].startswith("4. Checks against PyTorch") and blocks[2].startswith("5. Decode step")
    return readme, "\n".join(blocks)


def test_readme_quotes_the_real_output(two_runs):
    """Everything the run prints before the timings is the same on every CPU but the tolerance values."""
    r, _ = two_runs[0]
    _, quoted = readme_output()
    cut = "5. Decode step"
    assert cut in quoted and cut in r.stdout
    assert comparable(quoted.split(cut)[0]) == comparable(r.stdout.split(cut)[0])
    (q_figures, q_last), (r_figures, r_last) = quoted.rstrip().splitlines()[-2:], r.stdout.rstrip().splitlines()[-2:]
    assert q_last == r_last and q_figures.split(": ")[1:] == r_figures.split(": ")[1:]     # the folder differs


def test_the_readme_is_a_learners_length():
    """Issue 20's ceiling for the README: at most 16,000 bytes (what does not fit goes to LABNOTES.md)."""
    assert os.path.getsize(os.path.join(ROOT, "README.md")) <= 16_000


def test_readme_prose_quotes_the_quoted_decode_table():
    """The section 5 bullet's worked example is the formulas' arithmetic, what it says of MHA and MQA is what the
    quoted run found, and the table it shows is lines of that run, as printed."""
    import re
    readme, quoted = readme_output()
    section5 = quoted.split("5. Decode step")[1]
    excerpt = readme.split("<!-- output-excerpt:start -->\n```text\n")[1].split("```\n<!-- output-excerpt:end -->")[0]
    assert excerpt.startswith("   config") and len(excerpt.splitlines()) >= 5 and excerpt in section5
    rows = {line.split()[0]: line.split() for line in excerpt.splitlines()
            if re.match(r"   (MHA|GQA-\d+|MQA) .*%$", line)}   # config, FLOP/byte, read GB/s, ridge, bound, ..., reaches
    assert len(rows) == 4
    prose = " ".join(readme.split())
    flops, mha_bytes, mqa_bytes = (mha.decode_flops(32, 128, 8192), mha.decode_bytes(32, 128, 8192),
                                   mha.decode_bytes(1, 128, 8192))   # the worked example, at 20 GB/s and 100 GFLOP/s
    assert f"MHA reads {mha_bytes / 1e6:.0f} MB (fp32) for {flops / 1e6:.0f} MFLOP" in prose
    assert f"the reading takes {mha_bytes / 20e9 * 1e3:.1f} ms and the arithmetic {flops / 100e9 * 1e3:.1f} ms" in prose
    assert f"MQA reads {mha_bytes // mqa_bytes} times less ({mqa_bytes / 20e9 * 1e3:.1f} ms)" in prose
    _, gpu_flops, gpu_bandwidth = mha.GPU
    assert f"near {round(gpu_flops / gpu_bandwidth, -2):.0f} on a GPU" in prose
    assert rows["MHA"][1] == "0.5" and rows["MHA"][4] == "memory", rows["MHA"]   # the paragraph: MHA waits on memory
    assert rows["MQA"][1] == "16.0" and rows["MQA"][4] == "compute", rows["MQA"]   # MQA's arithmetic decides
    cpu = section5.split(" on ")[1].split(",")[0]                   # the quoted run's CPU, as Linux names it
    assert f"on a 2-core {cpu}, printed at 8192 tokens" in prose and "2 threads" in section5
    assert "At 8192 tokens:" in section5


def test_readme_shapes_are_the_demo_forwards(monkeypatch):
    """The README's table of the demo's tensors: each line's shapes are those forward and attend really make."""
    import re
    seen = {}
    real_attend, real_baddbmm, real_bmm = mha.attend, torch.baddbmm, torch.bmm

    def attend(q, k, v):
        seen["q"], seen["k, v"] = [q.shape], [k.shape]
        o, p = real_attend(q, k, v)
        seen["o"].append(o.shape)                          # after the stacked o, from bmm below
        return o, p

    def baddbmm(mask, q, k_t):
        seen["q, stacked"] = [q.shape]
        seen["scores, p"] = [real_baddbmm(mask, q, k_t).shape]
        return real_baddbmm(mask, q, k_t)

    def bmm(p, v):
        seen["o"] = [real_bmm(p, v).shape]
        return real_bmm(p, v)

    monkeypatch.setattr(mha, "attend", attend)
    monkeypatch.setattr(torch, "baddbmm", baddbmm)
    monkeypatch.setattr(torch, "bmm", bmm)
    attn = mha.CausalMHA(mha.D_MODEL, mha.N_HEADS, mha.N_KV_HEADS)
    attn.in_proj.register_forward_hook(lambda _m, _i, out: seen.update({"in_proj(x)": [out.shape]}))
    attn.out_proj.register_forward_hook(lambda _m, i, out: seen.update({"heads side by side": [i[0].shape, out.shape]}))
    x = torch.randn(mha.BATCH, mha.SEQ_LEN, mha.D_MODEL)
    seen["x"] = [x.shape]
    with torch.no_grad():
        attn(x)
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    lines = []
    for before in ("order `CausalMHA.forward` makes them", "The demo's tensors in `attend`"):   # forward's, attend's
        lines += readme.split(before)[1].split("```text\n")[1].split("```")[0].strip().splitlines()
    assert len(lines) == len(seen) == 8
    for line in lines:
        name = re.split(r"\s{2,}", line)[0]
        shapes = [tuple(int(n) for n in t.split(", ")) for t in re.findall(r"\((\d+(?:, \d+)+)\)", line)]
        assert shapes == [tuple(s) for s in seen[name]], line


def test_default_run_writes_five_pngs_and_nothing_else(two_runs):
    _, out_dir = two_runs[0]
    assert sorted(os.listdir(out_dir)) == sorted(FIGURES)
    for name in FIGURES:
        assert (out_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_figures_are_byte_identical_across_runs(two_runs):
    (_, a), (_, b) = two_runs
    for name in DETERMINISTIC:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_committed_figures_are_what_the_code_draws(two_runs):
    """figures/ must be regenerated when the code changes a figure. Another matplotlib draws other bytes, so
    elsewhere this skips; CI installs the version that drew them and must never skip."""
    from PIL import Image
    _, fresh = two_runs[0]
    for name in DETERMINISTIC:
        committed = os.path.join(ROOT, "figures", name)
        made_by, here = Image.open(committed).info.get("Software"), Image.open(fresh / name).info.get("Software")
        if made_by != here:
            assert not os.environ.get("CI"), f"CI must install the matplotlib that drew figures/{name}: {made_by}"
            pytest.skip(f"{name} was drawn by {made_by}; this machine's {here} draws it differently")
        with open(committed, "rb") as f:
            assert f.read() == (fresh / name).read_bytes(), f"figures/{name} is stale: run python mha.py"


def test_knob_changes_the_run(tmp_path, capsys):
    code, out, _ = run_main(["--n-kv-heads", "2", "--out-dir", str(tmp_path)], capsys)
    assert code == 0
    assert "GQA-2 written out vs nn.MHA, K/V heads repeated" in out
    assert ("GQA-8             8    0.54 GB      4x   <- g = 4, as in your demo: its 8 query heads over 2, "
            "this row's 32 over 8") in out
    assert out.count("<- g =") == 1 and "GQA-16" not in out


def test_a_failing_check_says_fail_and_exits_1(tmp_path, monkeypatch, capsys):
    """Copy the weights wrongly for every check, and the run must say FAIL and exit 1."""
    right = mha.from_torch
    monkeypatch.setattr(mha, "from_torch", lambda ref: mha.swap_query_heads(right(ref), 2, 3))
    code, out, _ = run_main(["--out-dir", str(tmp_path)], capsys)
    assert code == 1 and "FAIL  (must be exactly 0)" in out and out.rstrip().endswith("All checks: FAIL")


def test_a_batch_of_one_checks_only_what_is_exact(monkeypatch, capsys):
    monkeypatch.setattr(mha, "BATCH", 1)
    assert mha.run_checks(4, 0)
    out = capsys.readouterr().out
    assert "at batch" not in out and out.count("(must be exactly 0)") == 3


def test_the_shortest_sequence_works(monkeypatch, capsys):
    monkeypatch.setattr(mha, "SEQ_LEN", 2)
    assert mha.run_checks(2, 0) and mha.check_cache(2, 0)
    assert "cache fed chunks of [1, 1] tokens:" in capsys.readouterr().out


def test_section_3_catches_a_mask_without_its_offset(monkeypatch, capsys):
    """causal_mask's S - T (new token i sits at S - T + i) is used by section 3's 2-token chunk after the prompt:
    a mask that forgets the cached tokens must say FAIL there. The textbook line (T == S) cannot see it."""
    monkeypatch.setattr(mha, "causal_mask", conftest.mask_without_offset)
    assert not mha.check_cache(4, 0)
    out = capsys.readouterr().out
    assert "cache fed chunks of [6, 2, 1, 1, 1, 1] tokens:" in out
    assert line_with(out, "max |cached - full forward|").endswith("FAIL  (tolerance 1e-05)")
    assert line_with(out, "GQA-4 max |attend - textbook|").endswith("OK  (tolerance 2e-06)")


def test_a_short_sequence_is_fed_in_chunks_that_add_up(monkeypatch, capsys):
    for n, chunks in [(3, "[1, 2]"), (5, "[2, 2, 1]"), (7, "[3, 2, 1, 1]")]:
        monkeypatch.setattr(mha, "SEQ_LEN", n)
        assert mha.check_cache(4, 0)
        assert f"cache fed chunks of {chunks} tokens:" in capsys.readouterr().out


def test_help_shows_the_defaults(capsys):
    code, out, _ = run_main(["--help"], capsys)
    assert code == 0 and f"default: {mha.N_KV_HEADS}" in out and "--out-dir" in out and "--seed" in out


def test_import_has_no_side_effects(tmp_path):
    before = sorted(os.listdir(ROOT))
    figures = os.path.join(ROOT, "figures")
    stamps = {n: os.stat(os.path.join(figures, n)).st_mtime_ns for n in os.listdir(figures)}
    r = subprocess.run([sys.executable, "-c", "import mha"], check=False, capture_output=True, text=True, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", r.stderr
    assert os.listdir(tmp_path) == [] and sorted(os.listdir(ROOT)) == before
    assert {n: os.stat(os.path.join(figures, n)).st_mtime_ns for n in os.listdir(figures)} == stamps


# ----------------------------------------------------------------------------- mistakes a user can make
def one_line_exit(argv, capsys, code=2):
    """The run's one-line error: before anything is printed, computed or written (exit 2, as a bad flag)."""
    got, out, err = run_main(argv, capsys)
    assert got == code and out == "", out
    assert len(err.strip().splitlines()) == 1 and err.startswith("mha.py: error: "), err
    return err


@pytest.mark.parametrize("flag, value, words", [
    ("--n-kv-heads", "3", ["n_kv_heads=3", "positive divisor of n_heads=8"]),
    ("--n-kv-heads", "0", ["n_kv_heads=0", "positive divisor"]),
    ("--n-kv-heads", "16", ["n_kv_heads=16", "positive divisor"]),
    ("--n-kv-heads", "two", ["'two'"]),
    ("--seed", "-1", ["-1", "2**32 - 1"]),
])
def test_bad_flag_exits_2_with_one_line(flag, value, words, tmp_path, capsys):
    err = one_line_exit([f"{flag}={value}", "--out-dir", str(tmp_path)], capsys)
    assert all(w in err for w in words), err
    assert os.listdir(tmp_path) == []


def test_bad_flag_from_the_shell_exits_2_without_traceback(tmp_path):
    r = run_script(SCRIPT, "--n-kv-heads", "-4", "--out-dir", str(tmp_path))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == "mha.py: error: n_kv_heads=-4 must be a positive divisor of n_heads=8 (1 = MQA, 8 = MHA, " \
                       "a divisor in between = GQA)\n"
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("knob, value, words", [
    ("N_KV_HEADS", 3, ["n_kv_heads=3", "positive divisor"]),
    ("CACHE_TOKENS", 0, ["CACHE_TOKENS=0", "at least 1"]),
    ("CACHE_TOKENS", "4k", ["CACHE_TOKENS", "whole number", "'4k'"]),
    ("CACHE_BYTES_PER_ELEM", 0.5, ["CACHE_BYTES_PER_ELEM", "whole number", "0.5"]),
    ("DECODE_CONTEXTS", (), ["DECODE_CONTEXTS", "at least one"]),
    ("DECODE_CONTEXTS", (512, -8), ["DECODE_CONTEXTS[1]=-8"]),
    ("SEQ_LEN", 1, ["SEQ_LEN=1", "at least 2"]),           # the cache check feeds a prompt, then one token more
    ("BATCH", 0, ["BATCH=0", "at least 1"]),
    ("DECODE_ROUNDS", 0, ["DECODE_ROUNDS=0", "at least 1"]),
    ("MATMUL_N", 0, ["MATMUL_N=0", "at least 1"]),          # a 0x0 matmul: a FLOP rate of 0, a floor of x / 0
    ("LLAMA_KV_HEADS", (32, 8, 3), ["LLAMA_KV_HEADS=(32, 8, 3)", "divisors"]),   # 32 query heads in groups of 3
    ("LLAMA_KV_HEADS", (8, 1), ["LLAMA_KV_HEADS=(8, 1)", "must hold 32 (MHA)"]),   # the table compares with MHA
])
def test_a_knob_that_cannot_work_is_refused_at_start(knob, value, words, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(mha, knob, value)
    if knob == "N_KV_HEADS":                               # the flag's default is read when the parser is built
        err = one_line_exit(["--n-kv-heads", str(value), "--out-dir", str(tmp_path)], capsys)
    else:
        err = one_line_exit(["--out-dir", str(tmp_path)], capsys)
    assert all(w in err for w in words), err
    assert os.listdir(tmp_path) == []


def test_out_of_memory_is_one_line(monkeypatch, capsys):
    """DECODE_CONTEXTS = (10**7,) asks for 460 GB of K and V: PyTorch cannot allocate it; one line, exit 1."""
    monkeypatch.setattr(sys, "argv", ["mha.py"])

    def too_big():
        mha.measure_decode(contexts=(10**7,), kv_heads=(32,), rounds=1)

    with pytest.raises(SystemExit) as e:
        mha.run_as_script(too_big)
    assert e.value.code == 1
    assert capsys.readouterr().err == "mha.py: error: out of memory; make the knobs smaller\n"


def test_another_runtime_error_is_not_called_out_of_memory(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["mha.py"])

    def broken():
        raise RuntimeError("a bug of ours")

    with pytest.raises(RuntimeError, match="a bug of ours"):
        mha.run_as_script(broken)


def test_ctrl_c_ends_in_one_line_and_exit_130(capsys, monkeypatch):
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(sys, "argv", ["mha.py"])
    with pytest.raises(SystemExit) as e:
        mha.run_as_script(interrupted)
    assert e.value.code == 130 and capsys.readouterr().err == "\nmha.py: interrupted\n"


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


def test_a_pipe_closed_before_the_first_line_ends_quietly(tmp_path):
    """python mha.py | true: the reader is gone before anything arrives. Buffered, the run completes and its
    last flush, inside run_as_script's guard, meets the closed pipe: exit 1 (the output was lost), nothing on
    stderr, every figure written whole."""
    p = subprocess.Popen([sys.executable, SCRIPT, "--out-dir", str(tmp_path)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=dict(os.environ, PYTHONUNBUFFERED=""))
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=300) == 1 and err == b"", err.decode()
    assert sorted(os.listdir(tmp_path)) == sorted(FIGURES)


def test_out_dir_under_a_file_or_a_file(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    for target in (blocker / "figures", blocker):
        assert f"'{blocker}' is not a folder" in one_line_exit(["--out-dir", str(target)], capsys)
    assert os.listdir(tmp_path) == ["a_file"]


def test_out_dir_that_takes_no_files(capsys):
    assert "cannot write into '/proc'" in one_line_exit(["--out-dir", "/proc"], capsys)


def test_an_empty_out_dir_is_refused(capsys):
    assert "--out-dir '' names no folder" in one_line_exit(["--out-dir", ""], capsys)


def test_a_figure_name_taken_by_a_folder(tmp_path, capsys):
    (tmp_path / "head_layout.png").mkdir()
    err = one_line_exit(["--out-dir", str(tmp_path)], capsys)
    assert f"'{tmp_path / 'head_layout.png'}' exists and is not a file" in err
    assert os.listdir(tmp_path) == ["head_layout.png"]


def test_a_new_out_dir_is_made_only_when_the_figures_are_written(tmp_path):
    target = tmp_path / "new" / "figures"
    assert mha.out_dir_problem(str(target), mha.FIGURES) is None and os.listdir(tmp_path) == []
    assert mha.write_figures("mha.py", str(target), {"a.png": b"a"}) and os.listdir(target) == ["a.png"]


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "x.tmp"), KeyboardInterrupt()])
def test_a_full_disk_or_ctrl_c_while_writing_leaves_no_half_written_figure(tmp_path, monkeypatch, capsys, failure):
    """The second figure's write fails: the old first figure is still there, untouched, and no temporary file."""
    (tmp_path / "a.png").write_bytes(b"old")
    real_open, opened = open, []

    def failing_open(path, mode="r", *args, **kwargs):
        opened.append(path)
        if str(path).endswith(".tmp") and len(opened) == 2:
            raise failure
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", failing_open)
    if isinstance(failure, KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            mha.write_figures("mha.py", str(tmp_path), {"a.png": b"a", "b.png": b"b"})
    else:
        assert not mha.write_figures("mha.py", str(tmp_path), {"a.png": b"a", "b.png": b"b"})
        assert capsys.readouterr().err == "mha.py: error: cannot write 'x.tmp': No space left on device\n"
    assert os.listdir(tmp_path) == ["a.png"] and (tmp_path / "a.png").read_bytes() == b"old"


# ----------------------------------------------------------------------------- the README's "Things to try"
def things_to_try():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read().split("## Things to try")[1].split("\n## ")[0]


def edited_copy(old, new, tmp_path, told=None):
    """mha.py with every `old` replaced by `new`, imported from a copy (old must be there, new in the README's
    Things to try, or in `told`, a text that gives the edit)."""
    with open(SCRIPT) as f:
        src = f.read()
    assert old in src, f"the README's edit no longer applies: {old!r} is not in mha.py"
    told = things_to_try() if told is None else told
    assert f"`{new}`" in told, f"the edit {new!r} is no longer given"
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
    assert kv == 2 and m.check_cache(kv, 0) and m.run_checks(kv, 0)     # "the checks still pass": sections 3 and 4
    m.print_cache_tables(kv)
    out = capsys.readouterr().out
    assert "GQA-2 written out vs nn.MHA, K/V heads repeated" in out
    assert line_with(out, "GQA-8").endswith("<- g = 4, as in your demo: its 8 query heads over 2, this row's 32 over 8")


def test_try_swapping_two_heads(capsys, tmp_path):
    m = edited_copy("copy = from_torch(ref)", "copy = swap_query_heads(from_torch(ref), 2, 3)",
                    tmp_path)
    assert not m.run_checks(4, 0)
    out = capsys.readouterr().out
    mha_lines = [line for line in out.splitlines() if line.lstrip().startswith("MHA ")]
    assert len(mha_lines) == 4 and all(line.endswith("FAIL  (must be exactly 0)") for line in mha_lines[:3])
    assert mha_lines[3].endswith("FAIL  (tolerance 2e-06)")                # the batch, held to rounding only
    assert line_with(out, "GQA-4 written out vs nn.MHA").endswith("OK  (tolerance 2e-06)")


def test_try_repeat_instead_of_repeat_interleave(capsys, tmp_path):
    m = edited_copy("k.repeat_interleave(g, dim=1)", "k.repeat(1, g, 1, 1)", tmp_path)   # [k0, k1, k0, k1]
    g = m.N_HEADS // m.N_KV_HEADS                        # the README's pattern is the demo's, query head by query head
    pattern = [f"k{j}" for j in torch.arange(m.N_KV_HEADS).repeat(g).tolist()[:5]]
    assert f"`[{', '.join(pattern)}, ...]`" in things_to_try()
    assert not m.check_cache(4, 0)                       # section 3 holds the line against the textbook
    assert m.run_checks(4, 0)                            # section 4 does not use attend_textbook
    out = capsys.readouterr().out
    assert line_with(out, "GQA-4 max |attend - textbook|").endswith("FAIL  (tolerance 2e-06)")
    assert line_with(out, "max |cached - full forward|").endswith("OK  (tolerance 1e-05)")
    assert line_with(out, "MHA   written out").endswith("OK  (must be exactly 0)")
    for start in ["GQA-4 written out vs nn.MHA", "GQA-4 the same, per-head", "GQA-4 fused vs that", "GQA-4 written out vs F"]:
        assert line_with(out, start).endswith("OK  (tolerance 2e-06)"), start      # none copies K/V by .repeat
    assert "with 8 or 1 K/V heads the two orders agree" in things_to_try()
    for kv in (8, 1):                                    # MHA (g = 1) and MQA (one K/V head): one order, no FAIL
        assert m.check_cache(kv, 0), kv


def test_try_the_exact_check_on_the_whole_batch(capsys, tmp_path):
    """LABNOTES.md's edit, once the README's. The edited check may FAIL by a few units in the last place:
    whether nn.MultiheadAttention's route for a batch (the bias added after the product, rows stacked (T, B))
    rounds like ours depends on the CPU's MKL path (AMD EPYC: 2.38e-07). What holds on every CPU: each exact
    line says FAIL exactly when it measured a difference, and the difference is tiny."""
    with open(os.path.join(ROOT, "LABNOTES.md")) as f:
        notes = " ".join(f.read().split())
    assert "change `one = x[:1]` to `one = x` in `run_checks`" in notes
    m = edited_copy("one = x[:1]", "one = x", tmp_path, told=notes)
    ok = m.run_checks(4, 0)
    out = capsys.readouterr().out
    starts = ("MHA   written out", "MHA   the same, per-head", "MHA   fused")
    diffs = [float(line_with(out, start).split("= ")[1].split()[0]) for start in starts]
    assert ok == (max(diffs) == 0.0) and max(diffs) < 1e-6, diffs
    for start, diff in zip(starts, diffs):
        assert line_with(out, start).endswith("OK  (must be exactly 0)" if diff == 0 else "FAIL  (must be exactly 0)")


def test_try_a_longer_context(capsys, tmp_path):
    m = edited_copy("CACHE_TOKENS = 4096", "CACHE_TOKENS = 8192", tmp_path)
    m.print_cache_tables(4)
    out = capsys.readouterr().out
    assert "MHA's 4,294,967,296 bytes are 4.29 GB but 4.00 GiB" in out
    assert "Llama-2-7B               32   32   32  128  MHA        4.29 GB         9" in out


@pytest.mark.parametrize("stdout, words", [(None, "standard output is closed"),
                                           ("/dev/full", "cannot write to standard output: No space left on device")])
def test_a_closed_or_full_stdout_is_one_line(tmp_path, stdout, words):
    """python mha.py >&- and python mha.py > /dev/full: one line on stderr, exit 1, no traceback."""
    if stdout and not os.path.exists(stdout):
        pytest.skip(f"no {stdout} here")
    out = open(stdout, "w") if stdout else None          # noqa: SIM115 (closed below)
    try:
        r = subprocess.run([sys.executable, SCRIPT, "--out-dir", str(tmp_path)], check=False, text=True,
                           stdout=out if out else subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300,
                           preexec_fn=None if out else lambda: os.close(1))
    finally:
        if out:
            out.close()
    assert r.returncode == 1 and r.stderr == f"mha.py: error: {words}\n", r.stderr


def test_a_planted_bug_that_changes_nothing_is_not_detected(monkeypatch, capsys):
    """The on-purpose line must fail beyond rounding: a 'swap' that swaps nothing leaves only the batch's own
    rounding (about 2e-7), which must read NOT DETECTED and fail the checks, not 'DETECTED, as it must be'."""
    monkeypatch.setattr(mha, "swap_query_heads", lambda attn, i, j: attn)
    assert not mha.run_checks(4, 0)
    out = capsys.readouterr().out
    assert "NOT DETECTED" in out and "as it must be" not in out


def test_the_readmes_first_pass_names_what_comes_before_the_second_pass():
    """The README's first pass lists every function and class mha.py defines before its first section headed
    'a second pass', and main(); a function moved or renamed without the README fails this."""
    import re
    readme, _ = readme_output()
    route = " ".join(readme.split("**How to read it.**")[1].split("\n\n")[0].split())
    named = re.findall(r"`(\w+)(?:\(\))?`", route.split("A first pass reads")[1].split("skips")[0])
    with open(os.path.join(ROOT, "mha.py")) as f:
        source = f.read()
    first = source.split("\n# ----------------------------------------------------------------------------- a second pass")[0]
    defined = re.findall(r"^(?:def|class) (\w+)", first, flags=re.MULTILINE)
    assert sorted(named) == sorted(defined + ["main"]), (named, defined)
