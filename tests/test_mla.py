"""mla.py: absorption, the MQA identity, the cache, refusals, and the script as a user runs it."""

import math
import os
import re
import subprocess
import sys

import conftest
import pytest
import torch
import torch.nn.functional as F
from conftest import comparable, run_script

import mha
import mla

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "mla.py")


def module(seed=0, dtype=torch.float64, d=48, h=4, dh=8, dc=12, dr=6):
    torch.manual_seed(seed)
    return mla.LatentAttention(d, h, dh, dc, dr).to(dtype).eval()


def inputs(attn, B=2, T=7, seed=1):
    torch.manual_seed(seed)
    return torch.randn(B, T, attn.d_model, dtype=attn.w_dkv.weight.dtype)


# ----------------------------------------------------------------------------- absorption
@pytest.mark.parametrize("sizes", [{}, {"dc": 4, "dh": 16}, {"h": 1, "dr": 2}, {"dc": 64, "dr": 16}])
def test_absorbed_equals_naive_in_float64(sizes):
    attn = module(**sizes)
    for T in (1, 2, 9):
        diff = mla.absorbed_vs_naive(attn, inputs(attn, T=T))
        assert diff <= 1e-12, f"T={T}, {sizes}: relative difference {diff:.2e}"


def test_float32_difference_is_printed_and_bounded():
    """Reordered products round differently: not zero, but within a few units of float32's last place."""
    attn, x = mla.demo_module(0)
    diff = mla.absorbed_vs_naive(attn, x)
    assert 0 < diff <= 1e-5, f"{diff:.2e}"


def test_absorption_uses_the_right_rows_of_w_uk(monkeypatch):
    """W_UK viewed (dh, h, dc) instead of (h, dh, dc), a plausible wrong reshape, must break the match."""
    attn = module()
    x = inputs(attn)

    def wrong(self, q):
        return q @ self.w_uk.weight.view(self.d_head, self.n_heads, self.d_latent).transpose(0, 1)

    monkeypatch.setattr(mla.LatentAttention, "absorb_query", wrong)
    assert mla.absorbed_vs_naive(attn, x) > 1e-3


def test_the_scale_is_one_over_sqrt_of_dh_plus_dr():
    attn = module(dh=8, dr=6)
    assert attn.scale == pytest.approx(1 / math.sqrt(14), rel=1e-15)


# ----------------------------------------------------------------------------- the MQA identity
def test_absorbed_decode_step_is_mqa_with_one_kv_head():
    attn = module()
    x = inputs(attn, T=9)
    assert mla.mqa_identity_gap(attn, x) <= 1e-12


def test_the_identity_needs_mlas_scale():
    """The same MQA call with SDPA's default scale, 1/sqrt(dc + dr), does not give the decode step."""
    attn = module()
    x = inputs(attn, T=9)
    B, T, _ = x.shape
    cache = attn.new_cache(B, T)
    with torch.no_grad():
        attn(x[:, :-1], cache=cache, absorbed=True)
        step = attn(x[:, -1:], cache=cache, absorbed=True)
        q, q_rope, _, _ = attn.project(x[:, -1:], T - 1)
        query = torch.cat([attn.absorb_query(q), q_rope], dim=-1)
        key = torch.cat([cache.c, cache.k_rope], dim=-1).unsqueeze(1)
        o = F.scaled_dot_product_attention(query, key, cache.c.unsqueeze(1), enable_gqa=True)  # default scale
        wrong = attn.w_o(attn.expand_output(o).transpose(1, 2).reshape(B, 1, -1))
    assert mha.relative_diff(wrong, step) > 1e-3


# ----------------------------------------------------------------------------- RoPE
def test_rope_worked_example():
    out = mla.rope(torch.tensor([[1.0, 0.0]], dtype=torch.float64), torch.tensor([1]))
    assert torch.allclose(out, torch.tensor([[math.cos(1), math.sin(1)]], dtype=torch.float64), rtol=0, atol=1e-15)


def test_rope_scores_depend_only_on_the_distance():
    torch.manual_seed(0)
    q, k = torch.randn(1, 8, dtype=torch.float64), torch.randn(1, 8, dtype=torch.float64)

    def score(m, n):
        return (mla.rope(q, torch.tensor([m])) @ mla.rope(k, torch.tensor([n])).T).item()

    assert score(3, 1) == pytest.approx(score(12, 10), rel=1e-12)
    assert abs(score(3, 1) - score(3, 2)) > 1e-3


def test_rope_before_absorption_breaks_the_identity():
    attn = module()
    assert mla.rope_before_absorption_gap(attn, inputs(attn, T=6)) > 0.1
    # At a single position 0 RoPE turns nothing, and the same computation agrees: the gap is the turn.
    assert mla.rope_before_absorption_gap(attn, inputs(attn, T=1)) <= 1e-12


# ----------------------------------------------------------------------------- the cache
@pytest.mark.parametrize("absorbed", [False, True])
@pytest.mark.parametrize("chunks", [[7], [1] * 7, [3, 1, 1, 2], [6, 1]])
def test_cached_decoding_equals_one_full_forward(absorbed, chunks):
    attn = module(dtype=torch.float32)
    x = inputs(attn, T=sum(chunks))
    cache = attn.new_cache(2, 10)
    outs, t = [], 0
    with torch.no_grad():
        for n in chunks:
            outs.append(attn(x[:, t:t + n], cache=cache, absorbed=absorbed))
            t += n
        full = attn(x, absorbed=absorbed)
    diff = mha.relative_diff(torch.cat(outs, dim=1), full)
    assert cache.length == t and diff <= 1e-5, f"{diff:.2e}"


def test_cached_check_sees_a_wrong_position():
    """If the cache forgot its length when turning RoPE (every chunk at position 0), decoding must differ."""
    attn = module(dtype=torch.float32)
    x = inputs(attn, T=6)
    right = attn.project
    attn.project = lambda x, start: right(x, 0)
    assert mla.cached_vs_full(attn, x, True, 3) > 1e-3


@pytest.mark.parametrize("B, max_len, dtype", [(1, 512, torch.float32), (3, 17, torch.float64), (2, 5, torch.bfloat16)])
def test_new_cache_bytes_match_the_formula(B, max_len, dtype):
    attn = module(dtype=dtype, dc=12, dr=6)
    cache = attn.new_cache(B, max_len)
    per = torch.tensor([], dtype=dtype).element_size()
    assert cache.nbytes == B * max_len * (12 + 6) * per
    assert cache.nbytes == mla.latent_cache_bytes(1, 12, 6, max_len, batch=B, bytes_per_elem=per)
    assert cache.c.dtype == cache.k_rope.dtype == dtype and cache.length == 0


def test_latent_cache_bytes_known_answers():
    assert mla.latent_cache_bytes(60, 512, 64, 4096) == 283115520             # DeepSeek-V2, bf16: 0.28 GB
    assert mla.latent_cache_bytes(27, 512, 64, 4096) == 127401984             # DeepSeek-V2-Lite
    assert mla.latent_cache_bytes(60, 512, 64, 4096, batch=3, bytes_per_elem=4) == 6 * 283115520
    mha_bytes = mha.kv_cache_bytes(60, 128, 128, 4096)
    assert round(mha_bytes / 1e9, 1) == 16.1 and round(mha_bytes / 283115520, 1) == 56.9


def test_the_table_rows():
    rows = {kind: n for kind, n, _ in mla.cache_rows(*mla.DEEPSEEK["DeepSeek-V2"])}
    assert rows == {"MHA": 32768, "GQA-8": 2048, "MQA": 256, "MLA": 576, "MLA, careless": 40960}
    assert rows["MLA"] / 128 == 4.5                       # Table 1 of the paper: (dc + dr) = 9/2 dh


def test_decode_step_work():
    flops, n = mla.mla_step_work(4096, 128, 512, 64)
    assert round(flops / n, 1) == 120.9 and round(2 * flops / n) == 242   # fp32, and bf16 (half the bytes)
    assert mla.gqa_step_work(4096, 128, 128, 128) == (268435456, 536870912)


# ----------------------------------------------------------------------------- causality
@pytest.mark.parametrize("absorbed", [False, True])
def test_future_tokens_do_not_change_the_past(absorbed):
    attn = module()
    x = inputs(attn, T=8)
    y = x.clone()
    y[:, 5:] = torch.randn_like(y[:, 5:])
    with torch.no_grad():
        a, b = attn(x, absorbed=absorbed), attn(y, absorbed=absorbed)
    assert mha.relative_diff(b[:, :5], a[:, :5]) <= 1e-12
    assert mha.relative_diff(b[:, 5:], a[:, 5:]) > 1e-3


# ----------------------------------------------------------------------------- refusals, in one sentence
@pytest.mark.parametrize("sizes, error, words", [
    ((48, 4, 8, 12, 5), ValueError, ["d_rope=5", "even", "pairs"]),
    ((48, 4, 8, 12.0, 6), TypeError, ["d_latent", "whole number", "12.0"]),
    ((48, 4, 8, 12, True), TypeError, ["d_rope", "whole number"]),
    ((48, 0, 8, 12, 6), ValueError, ["n_heads=0", "at least 1"]),
    ((48, 4, "8", 12, 6), TypeError, ["d_head", "'8'"]),
])
def test_bad_sizes_are_refused_in_one_sentence(sizes, error, words):
    with pytest.raises(error) as e:
        mla.LatentAttention(*sizes)
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value)


def bad_calls(attn):
    """(description, call on a cache holding 3 of 5 tokens, error, words) for every refusal a user can meet."""
    x = inputs(attn, B=2, T=1).float()

    def with_length(n):
        def call(cache):
            cache.length = n
            return attn(x, cache=cache)
        return call

    return [
        ("overflow", lambda cache: attn(inputs(attn, B=2, T=3).float(), cache=cache), ValueError,
         ["holds 3 of at most 5 tokens", "cannot take 3 more"]),
        ("wrong dtype", lambda cache: attn(x.double(), cache=cache), ValueError, ["torch.float64", "torch.float32"]),
        ("wrong batch", lambda cache: attn(inputs(attn, B=3, T=1).float(), cache=cache), ValueError,
         ["(2, 5, 12)", "(3, 5, 12)"]),
        ("wrong width", lambda cache: attn(torch.zeros(2, 1, 47), cache=cache), ValueError, ["(B, T, 48)", "47"]),
        ("no tokens", lambda cache: attn(torch.zeros(2, 0, 48), cache=cache), ValueError, ["at least one token"]),
        ("length not whole", with_length(2.5), TypeError, ["cache.length", "whole number", "2.5"]),
        ("absorbed not a bool", lambda cache: attn(x, cache=cache, absorbed="yes"), TypeError, ["absorbed"]),
        ("not a cache", lambda cache: attn(x, cache=(cache.c, cache.k_rope)), TypeError, ["LatentCache"]),
    ]


@pytest.mark.parametrize("case", range(8))
def test_a_refused_call_leaves_the_cache_as_it_was(case):
    attn = module(dtype=torch.float32)
    cache = attn.new_cache(2, 5)
    with torch.no_grad():
        attn(inputs(attn, B=2, T=3).float(), cache=cache)
    before = (cache.c.clone(), cache.k_rope.clone(), cache.length)
    name, call, error, words = bad_calls(attn)[case]
    with torch.no_grad(), pytest.raises(error) as e:
        call(cache)
    if name == "length not whole":
        cache.length = before[2]                            # the test itself set it; the module wrote nothing
    assert "\n" not in str(e.value), name
    for w in words:
        assert w in str(e.value), (name, str(e.value))
    assert torch.equal(cache.c, before[0]) and torch.equal(cache.k_rope, before[1]) and cache.length == before[2]


def test_a_cache_of_the_wrong_dtype_is_refused():
    attn = module(dtype=torch.float32)
    cache = module(dtype=torch.float64).new_cache(2, 5)
    with torch.no_grad(), pytest.raises(ValueError, match="torch.float64, this call needs .* in torch.float32"):
        attn(inputs(attn).float()[:, :1], cache=cache)
    assert cache.length == 0 and not cache.c.any()


def test_decoding_under_autograd_is_refused():
    attn = module(dtype=torch.float32).train()
    cache = attn.new_cache(1, 4)
    with pytest.raises(RuntimeError, match="torch.no_grad"):
        attn(torch.zeros(1, 1, 48), cache=cache)
    assert cache.length == 0


def test_any_trainable_parameter_refuses_decoding_under_autograd():
    """Only the query projection trainable: backward() would still fail on the in-place write."""
    attn = module(dtype=torch.float32)
    attn.requires_grad_(False)
    next(p for name, p in attn.named_parameters() if not name.startswith("w_dkv")).requires_grad_(True)
    cache = attn.new_cache(1, 4)
    with pytest.raises(RuntimeError, match="torch.no_grad"):
        attn(torch.zeros(1, 1, 48), cache=cache)
    assert cache.length == 0 and not cache.c.any()


@pytest.mark.parametrize("which", ["shared", "stride 0", "inference"])
def test_a_cache_whose_memory_cannot_be_written_is_refused_before_anything_is(which):
    attn = module(dtype=torch.float32)
    cache = attn.new_cache(1, 5)
    if which == "shared":                                   # the RoPE key a view into the latent's memory
        cache.k_rope = cache.c[..., :cache.k_rope.shape[-1]]
        words = "the cache's latent c and RoPE key share memory, so writing RoPE key would overwrite"
    elif which == "stride 0":                               # one position's latent repeated: not writable
        cache.c = torch.zeros(1, 1, cache.c.shape[-1]).expand_as(cache.c)
        words = "positions of the cache's latent c share memory"
    else:
        with torch.inference_mode():
            cache = attn.new_cache(1, 5)
        words = "made under torch.inference_mode()"
    before = cache.c.clone(), cache.k_rope.clone()
    with torch.no_grad(), pytest.raises((ValueError, RuntimeError), match=re.escape(words)):
        attn(torch.randn(1, 2, 48), cache=cache)
    assert torch.equal(cache.c, before[0]) and torch.equal(cache.k_rope, before[1]) and cache.length == 0


@pytest.mark.parametrize("batch, max_len, error", [(0, 4, ValueError), (1, 2.0, TypeError), (1, -1, ValueError)])
def test_new_cache_refuses_bad_sizes(batch, max_len, error):
    with pytest.raises(error, match="batch|max_len"):
        module().new_cache(batch, max_len)


# ----------------------------------------------------------------------------- timing: the numbers check themselves
PEAK = 100e9                                               # FLOP/s


def steps(ms):
    """Steps at 1024 and 2048 tokens with the given times in ms, each read of its bytes at 10 GB/s."""
    out = []
    for i, S in enumerate((1024, 2048)):
        work = {"MLA": mla.mla_step_work(S, 128, 512, 64), "MHA": mla.gqa_step_work(S, 128, 128, 128),
                "GQA-8": mla.gqa_step_work(S, 128, 8, 128)}
        for kind, (flops, n) in work.items():
            out.append(mla.Step(kind, S, flops, n, seconds=ms[kind][i] / 1e3, read_seconds=n / 10e9))
    return out


def test_a_floor_is_the_roofline_at_the_steps_own_bandwidth():
    step = mla.Step("MLA", 4096, *mla.mla_step_work(4096, 128, 512, 64), seconds=1.0, read_seconds=9437184 / 20e9)
    floor, bound = step.floor(PEAK)
    assert bound == "compute" and floor == pytest.approx(1140850688 / PEAK, rel=1e-12)
    floor, bound = step.floor(1e15)
    assert bound == "memory" and floor == pytest.approx(9437184 / 20e9, rel=1e-12)


def test_consistent_timings_raise_no_alarm():
    # floors at 10 GB/s and 100 GFLOP/s: MLA 2.85 / 5.70 ms, MHA 13.4 / 26.8 ms, GQA-8 0.84 / 1.68 ms
    good = {"MLA": [4, 8], "MHA": [60, 120], "GQA-8": [4, 8]}
    assert mla.timing_contradictions(steps(good), PEAK) == []


@pytest.mark.parametrize("ms, words", [
    ({"MLA": [2, 8], "MHA": [60, 120], "GQA-8": [4, 8]}, "MLA at 1024 tokens is 30% below its floor"),
    ({"MLA": [4, 8], "MHA": [60, 120], "GQA-8": [4, 150]}, "GQA-8 is slower than MHA at 2048 tokens"),
    ({"MLA": [4, 8], "MHA": [200, 120], "GQA-8": [4, 8]}, "MHA at 2048 tokens is faster than at a shorter context"),
])
def test_contradicting_timings_are_named(ms, words):
    problems = mla.timing_contradictions(steps(ms), PEAK)
    assert any(words in p for p in problems), problems


def test_other_programs_busy_meanwhile_is_named_first():
    good = steps({"MLA": [4, 8], "MHA": [60, 120], "GQA-8": [4, 8]})
    assert mla.timing_contradictions(good, PEAK, elsewhere=0.2) == []
    assert mla.timing_contradictions(good, PEAK, elsewhere=0.9) == ["other programs kept 0.9 cores busy"]


def test_a_busy_machine_is_said_instead_of_a_lesson(capsys):
    bad = steps({"MLA": [2, 8], "MHA": [60, 120], "GQA-8": [4, 8]})
    mla.print_decode_table(bad, PEAK, mla.timing_contradictions(bad, PEAK), trap=0.5)
    out = capsys.readouterr().out
    assert "NOT TRUSTWORTHY, the machine was busy while timing: MLA at 1024 tokens" in out
    assert "Memory-bound here" not in out and "250 times latent_attend's 2.00 ms" in out


def test_the_lesson_is_made_from_the_numbers(capsys):
    good = steps({"MLA": [4, 8], "MHA": [60, 120], "GQA-8": [4, 8]})
    mla.print_decode_table(good, PEAK, [], trap=0.5)
    out = capsys.readouterr().out
    assert "Memory-bound here: MHA, GQA-8; compute-bound: MLA. At 2048 tokens: MLA 8.0 ms, MHA 120.0 ms" in out
    assert "MLA does 4.25x their FLOPs on 1/57 of MHA's bytes: its time is set by arithmetic" in out
    assert "In bf16 MLA does 242 FLOPs per byte, GQA-8 16. An H100 SXM" in out


# ----------------------------------------------------------------------------- the script, as a user runs it
def run(*args, cwd=None):
    return run_script(SCRIPT, *args, cwd=cwd)


def run_main(argv, capsys):
    return conftest.run_main(mla.main, argv, capsys)


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("mla_run")
    return run("--out-dir", str(out)), out


def test_default_run_prints_every_check_and_writes_both_figures(default_run):
    r, out = default_run
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.count("  OK  (tolerance") == 5 and "FAIL, as it must" in r.stdout
    assert "latent_cache_bytes(60, 512, 64, 4096)\n   = 283,115,520 bytes = 0.28 GB, against 16.1 GB" in r.stdout
    assert "   DeepSeek-V2           60  128  16.11 GB  1.01 GB  0.13 GB   0.28 GB       20.13 GB       56.9x" in r.stdout
    assert "3. Decode step" in r.stdout and mha.machine_name().split(",")[0] in r.stdout
    assert r.stdout.rstrip().endswith("All checks: OK")
    assert sorted(os.listdir(out)) == sorted(mla.FIGURES)


def test_committed_cache_figure_is_what_the_code_draws(default_run):
    """figures/mla_cache.png must be redrawn when the code changes it (skipped under another matplotlib)."""
    from PIL import Image
    _, out = default_run
    committed = os.path.join(ROOT, "figures", "mla_cache.png")
    made_by, here = Image.open(committed).info.get("Software"), Image.open(out / "mla_cache.png").info.get("Software")
    if made_by != here:
        assert not os.environ.get("CI"), f"CI must install the matplotlib that drew figures/mla_cache.png: {made_by}"
        pytest.skip(f"mla_cache.png was drawn by {made_by}; this machine has {here}")
    with open(committed, "rb") as f:
        assert f.read() == (out / "mla_cache.png").read_bytes(), "figures/mla_cache.png is stale: run python mla.py"
    assert mha.png_bytes(mla.plot_cache()) == (out / "mla_cache.png").read_bytes()   # and the same in every run




def test_readme_quotes_the_real_output(default_run):
    """The README quotes sections 1 and 2 of a run (section 3 is measured and lives in the lab notes): the
    same lines as a fresh run's, up to values checked against a tolerance."""
    r, _ = default_run
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    quoted = readme.split("<!-- mla-output:start -->\n```text\n")[1].split("```\n<!-- mla-output:end -->")[0]
    cut = "3. Decode step"
    assert cut in r.stdout and cut not in quoted
    assert comparable(quoted.rstrip()) == comparable(r.stdout.split(cut)[0].rstrip())


def test_a_short_run_in_process(monkeypatch, tmp_path, capsys):
    """Tiny contexts and one round: main() still prints the whole table and the lesson or the alarm."""
    monkeypatch.setattr(mla, "DECODE_CONTEXTS", (128, 64))
    monkeypatch.setattr(mla, "DECODE_ROUNDS", 1)
    code, out, err = run_main(["--out-dir", str(tmp_path)], capsys)
    assert code == 0 and err == ""
    rows = re.findall(r"^ +(\d+)  MLA ", out, flags=re.MULTILINE)
    assert rows == ["64", "128"]
    assert ("Memory-bound here" in out) != ("NOT TRUSTWORTHY" in out)
    assert sorted(os.listdir(tmp_path)) == sorted(mla.FIGURES)


def test_a_failing_check_says_fail_and_exits_1(monkeypatch, tmp_path, capsys):
    """W_UV's rows used for W_UK in the absorbed path: the run must say FAIL and exit 1."""
    monkeypatch.setattr(mla, "DECODE_CONTEXTS", (64,))
    monkeypatch.setattr(mla, "DECODE_ROUNDS", 1)

    def wrong(self, q):
        return q @ self.w_uv.weight.view(self.n_heads, self.d_head, self.d_latent)

    monkeypatch.setattr(mla.LatentAttention, "absorb_query", wrong)
    code, out, _ = run_main(["--out-dir", str(tmp_path)], capsys)
    assert code == 1 and "FAIL  (tolerance 1e-12)" in out and out.rstrip().endswith("All checks: FAIL")


@pytest.mark.parametrize("argv, words", [
    (["--seed", "-1"], ["-1", "2**32 - 1"]),
    (["--seed", "abc"], ["'abc'"]),
])
def test_bad_flag_exits_2_in_one_line(argv, words, tmp_path, capsys):
    code, out, err = run_main(argv + ["--out-dir", str(tmp_path)], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and err.startswith("mla.py: error: ")
    assert all(w in err for w in words) and os.listdir(tmp_path) == []


@pytest.mark.parametrize("knob, value, words", [
    ("D_ROPE", 15, ["d_rope=15", "even"]),
    ("D_LATENT", 64.5, ["d_latent", "whole number"]),
    ("SEQ_LEN", 1, ["SEQ_LEN=1", "at least 2"]),
    ("DECODE_CONTEXTS", (), ["DECODE_CONTEXTS"]),
    ("GQA_KV_HEADS", 3, ["GQA_KV_HEADS=3", "divide"]),
    ("DECODE_CONTEXTS", (10**7,), ["DECODE_CONTEXTS up to 10,000,000 tokens", "at most 4 GB"]),
    ("ROPE_BASE", "10000", ["ROPE_BASE='10000'", "finite number above 1"]),
    ("ROPE_BASE", 0.0, ["ROPE_BASE=0.0", "finite number above 1"]),
    ("DEEPSEEK", {"Other": (1, 8, 8, 8, 8)}, ["DEEPSEEK must keep the 'DeepSeek-V2' shape"]),
    ("D_MODEL", 10**9, ["GB of weights, more than this machine's"]),
    ("SEQ_LEN", 100000, ["SEQ_LEN=100000", "at most 512"]),
])
def test_a_knob_that_cannot_work_is_refused_at_start(knob, value, words, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(mla, knob, value)
    code, out, err = run_main(["--out-dir", str(tmp_path)], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert all(w in err for w in words) and os.listdir(tmp_path) == []


def test_out_dir_under_a_file_ends_in_one_line(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    code, out, err = run_main(["--out-dir", str(blocker / "figures")], capsys)
    assert code == 2 and out == "" and err.startswith("mla.py: error: ") and len(err.strip().splitlines()) == 1
    assert os.listdir(tmp_path) == ["a_file"]


def test_bad_flag_from_the_shell_has_no_traceback(tmp_path):
    r = run("--seed", "-3", "--out-dir", str(tmp_path))
    assert r.returncode == 2 and r.stdout == "" and r.stderr == "mla.py: error: --seed -3 must be between 0 and 2**32 - 1\n"


def test_help_shows_the_defaults(capsys):
    code, out, _ = run_main(["--help"], capsys)
    assert code == 0 and "--out-dir" in out and f"default: {mla.SEED}" in out


def test_import_has_no_side_effects(tmp_path):
    """No output, no file, and nothing seeded: torch draws a fresh seed in each process, so two imports
    of a module that seeded would print the same random number."""
    before = sorted(os.listdir(ROOT))
    runs = [subprocess.run([sys.executable, "-c", "import mla, torch; print(torch.rand(1).item())"], check=False,
                           capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT))
            for _ in range(2)]
    assert all(r.returncode == 0 and r.stderr == "" for r in runs), runs[0].stderr
    assert runs[0].stdout != runs[1].stdout and len(runs[0].stdout.splitlines()) == 1
    assert os.listdir(tmp_path) == [] and sorted(os.listdir(ROOT)) == before


def test_a_module_or_cache_larger_than_memory_or_elsewhere_is_one_sentence():
    with pytest.raises(ValueError, match="GB of weights, more than this machine's"):
        mla.LatentAttention(10**6, 128, 128, 512, 64)
    with pytest.raises(ValueError, match="needs [\\d,]+ GB, more than this machine's"):
        module().new_cache(10**6, 10**6)
    attn = module(dtype=torch.float32)
    cache = attn.new_cache(1, 4)
    cache.c = cache.c.to_sparse()
    with torch.no_grad(), pytest.raises(ValueError, match="ordinary dense tensor"):
        attn(torch.zeros(1, 1, 48), cache=cache)
