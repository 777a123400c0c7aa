"""The script as a user runs it: output, figures, errors, and no side effects on import."""

import gc
import os
import subprocess
import sys

import pytest

import mha

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "mha.py")
FIGURES = ["attention_maps.png", "kv_cache_size.png", "head_layout.png", "decode_time.png"]
DETERMINISTIC = FIGURES[:3]          # decode_time.png is measured, so it varies from run to run


def run(*args, cwd=None):
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "MPLBACKEND")}   # headless, as in CI
    return subprocess.run([sys.executable, SCRIPT, *args], check=False, capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300)


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
                "GQA-4             4    0.27 GB      8x", "MQA               1    0.07 GB     32x"]:
        assert row in out
    assert "Llama-2-70B              80   64    8  128  GQA-8      1.34 GB        29" in out
    assert "All checks: OK" in out
    assert "Traceback" not in r.stderr


def test_readme_quotes_the_real_output(two_runs):
    """Everything the run prints before the timings is deterministic, so the README must match it."""
    r, _ = two_runs[0]
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    quoted = readme.split("<!-- output:start -->\n```text\n")[1].split("```\n<!-- output:end -->")[0]
    cut = "5. Decode step"
    assert cut in quoted and cut in r.stdout
    assert quoted.split(cut)[0] == r.stdout.split(cut)[0]


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
    """figures/ must be regenerated when the code changes a figure (checked where matplotlib matches)."""
    from PIL import Image
    _, fresh = two_runs[0]
    for name in DETERMINISTIC:
        committed = os.path.join(ROOT, "figures", name)
        made_by = Image.open(committed).info.get("Software")
        if made_by != Image.open(fresh / name).info.get("Software"):
            pytest.skip(f"{name} was drawn by {made_by}; this machine's matplotlib draws it differently")
        with open(committed, "rb") as f:
            assert f.read() == (fresh / name).read_bytes(), f"figures/{name} is stale: run python mha.py"


def test_knob_changes_the_run(tmp_path):
    r = run("--n-kv-heads", "2", "--out-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "GQA-2 max |ours - nn.MHA with K/V heads repeated|" in r.stdout
    assert "GQA-2             2    0.13 GB     16x   <- your n_kv_heads" in r.stdout


@pytest.mark.parametrize("flag, value", [("--n-kv-heads", v) for v in ["3", "0", "-1", "16", "two"]]
                         + [("--seed", v) for v in ["-1", str(2**64), "abc"]])
def test_bad_knob_exits_2_with_one_line(flag, value, tmp_path):
    r = run(f"{flag}={value}", "--out-dir", str(tmp_path))
    assert r.returncode == 2
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert value in r.stderr and "Traceback" not in r.stderr
    assert os.listdir(tmp_path) == []


def test_unwritable_out_dir_exits_nonzero_with_one_line(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    target = blocker / "figures"
    r = run("--out-dir", str(target))
    assert r.returncode != 0
    assert len(r.stderr.strip().splitlines()) == 1 and str(target) in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_a_failing_check_says_fail_and_exits_1(tmp_path, monkeypatch, capsys):
    """Copy the weights wrongly for every check, and the run must say FAIL and exit 1."""
    right = mha.CausalMHA.from_torch

    def wrong(ref):
        return mha.swap_query_heads(right(ref), 2, 3)

    monkeypatch.setattr(mha.CausalMHA, "from_torch", staticmethod(wrong))
    try:
        assert mha.main(["--out-dir", str(tmp_path)]) == 1
    finally:
        gc.unfreeze()                      # main() froze this test process's objects; give them back
    out = capsys.readouterr().out
    assert "MHA   max |ours - nn.MultiheadAttention|" in out and "FAIL  (must be exactly 0)" in out
    assert out.rstrip().endswith("All checks: FAIL")


def test_help_shows_the_defaults():
    r = run("--help")
    assert r.returncode == 0
    assert f"default: {mha.N_KV_HEADS}" in r.stdout and "--out-dir" in r.stdout and "--seed" in r.stdout


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


def test_interrupted_save_leaves_no_file(tmp_path, monkeypatch):
    from matplotlib.figure import Figure
    fig = Figure()
    fig.subplots().plot([1, 2, 3])
    path = tmp_path / "plot.png"
    path.write_bytes(b"old")

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(mha.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        mha.save_png(fig, str(path))
    assert os.listdir(tmp_path) == ["plot.png"] and path.read_bytes() == b"old"
    monkeypatch.undo()
    mha.save_png(fig, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.listdir(tmp_path) == ["plot.png"]
