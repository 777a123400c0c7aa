"""python mha.py as a user runs it: its output against the README, its figures, its flags, the
Things to try."""

import importlib.util
import os
import re
import subprocess
import sys

import matplotlib
import pytest
import torch
from conftest import ROOT, comparable, run_main, run_script

import mha

SCRIPT = os.path.join(ROOT, "mha.py")
FIGURES = ["attention_maps.png", "head_layout.png", "kv_cache_size.png"]


def readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One default run, as a user makes it (the expensive part, shared by the tests below)."""
    out = tmp_path_factory.mktemp("figures")
    return run_script(SCRIPT, "--out-dir", str(out)), out


def test_the_default_run_passes_every_check_and_writes_three_figures(run):
    r, out = run
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.count("  OK  ") == 10 and "FAIL" not in r.stdout
    assert "DETECTED, as it must be" in r.stdout
    assert r.stdout.rstrip().endswith("All checks: OK")
    assert sorted(os.listdir(out)) == FIGURES


def test_the_readme_quotes_the_real_output(run):
    """Each quoted block is a run of the output's lines, equal but for values within their
    tolerance."""
    printed = comparable(run[0].stdout)
    parts = readme().split("<!-- output:start -->\n```text\n")[1:]
    blocks = [part.split("```\n<!-- output:end -->")[0] for part in parts]
    assert len(blocks) == 2
    for block in blocks:
        quoted = comparable(block)
        assert any(printed[i:i + len(quoted)] == quoted for i in range(len(printed))), block


@pytest.mark.skipif(matplotlib.__version__ != "3.11.2",
                    reason="figures/ was drawn by matplotlib 3.11.2")
def test_the_committed_figures_are_what_the_code_draws(run):
    for name in FIGURES:
        with (open(os.path.join(run[1], name), "rb") as new,
              open(os.path.join(ROOT, "figures", name), "rb") as old):
            assert new.read() == old.read(), f"figures/{name} is stale: run python mha.py"


def test_the_readmes_usage_snippet_runs():
    blocks = [b.split("```")[0] for b in readme().split("```python\n")[1:]]
    snippet = next(b for b in blocks if b.startswith("import torch, mha"))
    scope = {}
    exec(snippet, scope)                                   # noqa: S102 (the README's own code)
    assert scope["y"].shape == (1, 10, 256) and scope["y_next"].shape == (1, 1, 256)
    assert scope["cache"].length == 11


def test_import_has_no_side_effects(tmp_path, monkeypatch, capsys):
    stamps = {n: os.stat(os.path.join(ROOT, "figures", n)).st_mtime_ns for n in FIGURES}
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("mha_imported", SCRIPT)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert capsys.readouterr() == ("", "") and os.listdir(tmp_path) == []
    assert {n: os.stat(os.path.join(ROOT, "figures", n)).st_mtime_ns for n in FIGURES} == stamps


# ------------------------------------------------------------------ flags and folders
@pytest.mark.parametrize("argv, words", [
    (["--n-kv-heads", "3"], "n_kv_heads=3 must divide N_HEADS=8: one of [8, 4, 2, 1]"),
    (["--n-kv-heads", "0"], "n_kv_heads=0 must divide N_HEADS=8: one of [8, 4, 2, 1]"),
])
def test_a_kv_that_does_not_divide_is_one_line_exit_2(argv, words, tmp_path, capsys):
    code, out, err = run_main(mha.main, [*argv, "--out-dir", str(tmp_path / "new")], capsys)
    assert code == 2 and out == "" and err == f"mha.py: error: {words}\n"
    assert not (tmp_path / "new").exists()


def test_an_edited_knob_that_does_not_divide_is_refused_the_same_way(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(mha, "N_KV_HEADS", 3)
    code, out, err = run_main(mha.main, ["--out-dir", str(tmp_path)], capsys)
    assert code == 2 and out == "" and err.startswith("mha.py: error: n_kv_heads=3 must divide")


def test_an_out_dir_that_cannot_be_made_is_one_line_exit_2_before_any_output(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    code, out, err = run_main(mha.main, ["--out-dir", str(tmp_path / "file" / "figs")], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("mha.py: error: --out-dir")


def test_a_failing_check_says_fail_and_exits_1(monkeypatch, tmp_path, capsys):
    real = mha.attend_grouped

    def unscaled(q, k, v):                                 # a plausible bug: the sqrt(dh) forgotten
        return real(q * (q.shape[-1] ** 0.5), k, v)

    monkeypatch.setattr(mha, "attend_grouped", unscaled)
    code, out, _ = run_main(mha.main, ["--out-dir", str(tmp_path)], capsys)
    assert code == 1 and "FAIL" in out and out.rstrip().endswith("All checks: FAIL")


def test_a_reader_that_leaves_ends_the_run_quietly(tmp_path):
    """python mha.py | head -3: no traceback, nothing on stderr, exit 1 (the output was lost)."""
    p = subprocess.Popen([sys.executable, "-u", SCRIPT, "--out-dir", str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = [p.stdout.readline() for _ in range(3)]
    p.stdout.close()
    err = p.stderr.read()
    assert head[0].startswith(b"Causal attention")
    assert p.wait(timeout=120) == 1 and err == b"", err.decode()


# ------------------------------------------------------------------ the README's Things to try
def things_to_try():
    return readme().split("## Things to try")[1].split("\n## ")[0]


def edited_copy(old, new, tmp_path):
    """mha.py with `old` replaced by `new` (which the README's Things to try must give), imported
    from a copy."""
    with open(SCRIPT) as f:
        src = f.read()
    missing = f"the README's edit no longer applies: {old!r} is not once in mha.py"
    assert src.count(old) == 1, missing
    assert f"`{new}`" in " ".join(things_to_try().split()), f"the edit {new!r} is no longer given"
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


def results(out):
    """{label: 'OK' or 'FAIL'} of each printed check."""
    checks = [re.match(r"  (.+?) += \S+  (OK|FAIL)  ", line) for line in out.splitlines()]
    return {m.group(1): m.group(2) for m in checks if m}


def test_try_two_kv_heads(tmp_path, capsys):
    m = edited_copy("N_KV_HEADS = 4 ", "N_KV_HEADS = 2", tmp_path)
    code, out, _ = run_main(m.main, ["--out-dir", str(tmp_path)], capsys)
    assert code == 0 and "reading 2 K/V heads: GQA-2, groups of 4" in out
    assert "GQA-2 written out vs F.sdpa(enable_gqa=True)" in results(out)


def test_try_swapping_two_heads(tmp_path, capsys):
    m = edited_copy("copy = from_torch(ref)", "copy = swap_query_heads(from_torch(ref), 2, 3)",
                    tmp_path)
    assert not m.check_against_torch(4, 0)
    status = results(capsys.readouterr().out)
    assert [status[k] for k in status if k.startswith("MHA ")] == ["FAIL"] * 3
    assert [status[k] for k in status if k.startswith("GQA-4")] == ["OK"] * 4


def test_try_repeat_instead_of_repeat_interleave(tmp_path, capsys):
    # K/V heads in the order [k0, k1, k0, k1]:
    m = edited_copy("k = k.repeat_interleave(g, dim=1)", "k = k.repeat(1, g, 1, 1)", tmp_path)
    assert not m.check_grouped(4, 0)
    assert m.check_cache(4, 0) and m.check_against_torch(4, 0)      # only the textbook copies K/V
    status = results(capsys.readouterr().out)
    assert status["GQA-4 grouped vs textbook, 5 new tokens, 12 keys"] == "FAIL"
    assert "with 8 or 1 K/V heads the two orders agree" in " ".join(things_to_try().split())
    for kv in (8, 1):
        assert m.check_grouped(kv, 0), kv


def test_try_is_causal_in_the_fused_call(tmp_path, capsys):
    m = edited_copy("attn_mask=mask", "is_causal=True", tmp_path)
    assert not m.check_cache(4, 0) and m.check_against_torch(4, 0)
    status = results(capsys.readouterr().out)
    assert status["fused: max |cached - full forward|"] == "FAIL"
    assert status["written out: max |cached - full forward|"] == "OK"


def test_try_a_longer_context(tmp_path, capsys):
    m = edited_copy("CACHE_TOKENS = 4096", "CACHE_TOKENS = 8192", tmp_path)
    m.print_cache_tables()
    out = capsys.readouterr().out
    assert "MHA's 4,294,967,296 bytes are 4.29 GB but 4.00 GiB" in out
    assert "Llama-2-7B               32   32   32  128  MHA        4.29 GB         9" in out
    assert "Llama-2-7B: 18 to 9" in things_to_try()


def test_the_readmes_tensor_table_is_what_forward_makes(monkeypatch):
    seen, real = {}, torch.einsum

    # Records the shapes of the first input and of the output:
    def einsum(equation, a, b):
        out = real(equation, a, b)
        seen[equation] = (tuple(a.shape), tuple(out.shape))
        return out

    monkeypatch.setattr(torch, "einsum", einsum)
    T, h, kv = len(mha.SENTENCE.split()), mha.N_HEADS, mha.N_KV_HEADS
    dh = mha.D_MODEL // mha.N_HEADS
    with torch.no_grad():
        y = mha.demo_module(kv, 0)(torch.randn(1, T, mha.D_MODEL))
    table = readme().split("The demo's tensors")[1].split("```text\n")[1].split("```")[0]
    rows = dict(re.match(r"(.+?)\s+(\([\d, ]+\))", line).groups() for line in table.splitlines())
    q_grouped, scores = seen["bnite,bnse->bnits"]
    assert rows == {"x": str((1, T, mha.D_MODEL)), "q": str((1, h, T, dh)),
                    "k, v": str((1, kv, T, dh)), "q in attend_grouped": str(q_grouped),
                    "scores, p": str(scores), "y": str(tuple(y.shape))}


def test_the_readmes_quality_numbers_are_those_of_the_run_the_lab_notes_quote():
    with open(os.path.join(ROOT, "LABNOTES.md")) as f:
        notes = f.read()
    run = notes.split("## The default run of quality.py")[1].split("```text\n")[1].split("```")[0]
    chapter = " ".join(readme().split("**What a smaller cache costs:**")[1].split("![")[0].split())
    plus, gap = r"(\+\d\.\d{3})", r"([+-]\d\.\d{3})"          # +0.123, and a gap of either sign
    mqa = re.search(rf"\n   MQA .* {plus} \[{plus}, {plus}\]   worse than MHA", run).groups()
    assert "MQA costs {} bits per character, 95 % interval [{}, {}]".format(*mqa) in chapter
    gaps = {kind: re.search(rf"\n   {kind} +mean pool .*?{gap} \[.*?\] +{gap} \[", run).groups()
            for kind in ("GQA-4", "MQA")}
    five, twenty = [[round(float(gaps[kind][i]), 2) for kind in ("GQA-4", "MQA")] for i in (0, 1)]
    assert "ends GQA-4 {:+.2f} and MQA {:+.2f} behind".format(*five) in chapter
    assert "20 % more, {:+.2f} and {:+.2f}".format(*twenty) in chapter


def test_bench_help_says_what_it_measures_and_runs_nothing():
    r = run_script(os.path.join(ROOT, "bench.py"), "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: bench.py"), r.stderr
    assert "as ratios measured side by side" in r.stdout and "1. forward" not in r.stdout
