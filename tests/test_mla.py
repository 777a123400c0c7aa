"""mla.py: absorption, RoPE, cached decoding, cache bytes, refusals, the run (its checks, the MQA
identity among them, and its table against the lab notes) and its figure."""

import contextlib
import importlib
import io
import math
import os

import pytest
import torch
from conftest import ROOT, comparable, run_main

import mla


def module(dtype=torch.float64, d=48, h=4, dh=8, dc=12, dr=6, seed=0):
    torch.manual_seed(seed)
    return mla.LatentAttention(d, h, dh, dc, dr).to(dtype).eval()


def inputs(attn, B=2, T=7, seed=1):
    torch.manual_seed(seed)
    return torch.randn(B, T, attn.d_model, dtype=attn.w_dkv.weight.dtype)


# ------------------------------------------------------------------ absorption
@pytest.mark.parametrize("sizes",
                         [{}, {"dc": 4, "dh": 16}, {"h": 1, "dr": 2}, {"dc": 64, "dr": 16}])
def test_absorbed_equals_naive_in_float64(sizes):
    attn = module(**sizes)
    for T in (1, 2, 9):
        diff = mla.absorbed_vs_naive(attn, inputs(attn, T=T))
        assert diff <= 1e-12, f"T={T}, {sizes}: relative difference {diff:.2e}"


def test_the_absorbed_path_never_builds_a_key_or_a_value():
    """W_UK and W_UV enter only as weights, folded into the query and the output: their forward
    never runs."""
    attn = module()
    x = inputs(attn, T=5)
    attn.w_uk.forward = attn.w_uv.forward = None          # calling either now raises a TypeError
    cache = attn.new_cache(2, 5)
    with torch.no_grad():
        attn(x, absorbed=True)
        attn(x[:, :4], cache=cache, absorbed=True)
        attn(x[:, 4:], cache=cache, absorbed=True)
        with pytest.raises(TypeError, match="not callable"):
            attn(x)                                       # the naive path builds them


# ------------------------------------------------------------------ RoPE, and why it is decoupled
def test_rope_turns_pairs_and_scores_depend_only_on_the_distance():
    # Pair i turns by 10000^(-2i / 4) radians at position 1.
    out = mla.rope(torch.tensor([[1.0, 0.0, 1.0, 0.0]], dtype=torch.float64), torch.tensor([1]))
    want = [math.cos(1), math.sin(1), math.cos(0.01), math.sin(0.01)]
    assert torch.allclose(out, torch.tensor([want], dtype=torch.float64), rtol=0, atol=1e-15)
    torch.manual_seed(0)
    q, k = torch.randn(1, 8, dtype=torch.float64), torch.randn(1, 8, dtype=torch.float64)

    def score(m, n):
        return (mla.rope(q, torch.tensor([m])) @ mla.rope(k, torch.tensor([n])).T).item()

    assert score(3, 1) == pytest.approx(score(12, 10), rel=1e-12)
    assert abs(score(3, 1) - score(3, 2)) > 1e-3


def test_turned_content_keys_change_the_absorbed_scores():
    attn = module()
    assert mla.turned_keys_gap(attn, inputs(attn, T=6)) > 0.1
    # Position 0 turns nothing: the gap is the turn.
    assert mla.turned_keys_gap(attn, inputs(attn, T=1)) <= 1e-12


# ------------------------------------------------------------------ cached decoding
@pytest.mark.parametrize("absorbed", [False, True])
@pytest.mark.parametrize("chunks", [[(0, 7)], [(t, t + 1) for t in range(7)],
                                    [(0, 3), (3, 4), (4, 5), (5, 7)], mla.prompt_chunks(7)])
def test_cached_decoding_equals_one_full_forward(absorbed, chunks):
    attn = module(dtype=torch.float32)
    assert mla.cached_vs_full(attn, inputs(attn), absorbed, chunks) <= 1e-5


def test_cached_decoding_fills_the_cache_with_every_tokens_latent_and_turned_key():
    attn = module()
    x = inputs(attn, T=5)
    cache = attn.new_cache(2, 6)
    with torch.no_grad():
        attn(x[:, :3], cache=cache)
        attn(x[:, 3:], cache=cache, absorbed=True)
        c, k_rope = attn.w_dkv(x), mla.rope(attn.w_kr(x), torch.arange(5))
    assert cache.length == 5 and not cache.kv[:, 5:].any()
    assert torch.allclose(cache.kv[:, :5], torch.cat([c, k_rope], dim=-1), rtol=0, atol=1e-14)


# ------------------------------------------------------------------ the cache, in bytes
@pytest.mark.parametrize("B, max_len, dtype",
                         [(1, 512, torch.float32), (3, 17, torch.float64), (2, 5, torch.bfloat16)])
def test_a_new_cache_holds_the_bytes_of_the_formula(B, max_len, dtype):
    cache = module(dtype=dtype, dc=12, dr=6).new_cache(B, max_len)
    per = torch.tensor([], dtype=dtype).element_size()
    assert cache.kv.shape == (B, max_len, 12 + 6) and cache.kv.dtype == dtype and cache.length == 0
    assert cache.kv.nbytes == mla.latent_cache_bytes(1, 12, 6, max_len, batch=B, bytes_per_elem=per)


def test_latent_cache_bytes_of_its_docstring_example():
    assert mla.latent_cache_bytes(60, 512, 64, 4096) == 283_115_520    # DeepSeek-V2, bf16


# ------------------------------------------------------------------ refusals, in one sentence
@pytest.mark.parametrize("sizes, words", [
    ((48, 4, 8, 12, 5), "d_rope=5 must be even"),
    ((48, 4, 8, 12.0, 6), "d_latent=12.0 must be a whole number"),
    ((48, 0, 8, 12, 6), "n_heads=0 must be a whole number of at least 1")])
def test_bad_sizes_are_refused_in_one_sentence(sizes, words):
    with pytest.raises(ValueError, match=words):
        mla.LatentAttention(*sizes)


# (name, what the call gets besides the cache, error, words); the cache holds 3 of 5 tokens
BAD_CALLS = [
    ("overflow", torch.zeros(2, 3, 48), ValueError,
     "holds 3 of its 5 tokens: 3 more do not fit"),
    ("wrong dtype", torch.zeros(2, 1, 48, dtype=torch.float64), TypeError,
     "torch.float64 on cpu, the module"),
    ("wrong batch", torch.zeros(3, 1, 48), ValueError,
     r"the cache is \(2, 5, 18\) .* needs \(3, 5, 18\)"),
    ("wrong width", torch.zeros(2, 1, 47), ValueError,
     r"d_model=48\) with B, T >= 1, got \(2, 1, 47\)"),
    ("no tokens", torch.zeros(2, 0, 48), ValueError, "with B, T >= 1"),
]


@pytest.mark.parametrize("name, x, error, words", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_a_refused_call_leaves_the_cache_as_it_was(name, x, error, words):
    attn = module(dtype=torch.float32)
    cache = attn.new_cache(2, 5)
    with torch.no_grad():
        attn(inputs(attn, B=2, T=3), cache=cache)
        before = cache.kv.clone()
        with pytest.raises(error, match=words):
            attn(x, cache=cache)
    assert torch.equal(cache.kv, before) and cache.length == 3


def test_a_cache_of_another_dtype_is_refused_before_it_is_written():
    attn, cache = module(), module(dtype=torch.float32).new_cache(2, 5)
    words = "in torch.float32 on cpu; this call needs"
    with torch.no_grad(), pytest.raises(ValueError, match=words):
        attn(inputs(attn, T=1), cache=cache)
    assert not cache.kv.any()


def test_a_cached_call_under_autograd_is_refused_and_training_without_a_cache_works():
    attn = module(dtype=torch.float32).train()
    cache = attn.new_cache(1, 4)
    with pytest.raises(RuntimeError, match="torch.no_grad"):
        attn(torch.randn(1, 1, 48), cache=cache)
    assert cache.length == 0 and not cache.kv.any()
    attn(torch.randn(1, 3, 48), absorbed=True).sum().backward()
    assert attn.w_uk.weight.grad.abs().max() > 0


# ------------------------------------------------------------------ the script, as a user runs it
@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """main() with the defaults and --out-dir: (exit code, what it printed, the folder)."""
    out, out_dir = io.StringIO(), tmp_path_factory.mktemp("run") / "figures"
    with contextlib.redirect_stdout(out):
        code = mla.main(["--out-dir", str(out_dir)])
    return code, out.getvalue(), out_dir


def test_the_script_prints_every_check_and_writes_its_figure(default_run):
    code, out, out_dir = default_run
    assert code == 0 and out.count("  OK  (tolerance") == 5 and "CHANGED, as it must" in out
    assert out.rstrip().endswith("All checks: OK")
    assert (out_dir / "mla_cache.png").read_bytes()[:4] == b"\x89PNG"


def test_the_lab_notes_quote_the_real_output(default_run):
    """The lab notes quote sections 1 and 2 of a run, up to values held to a tolerance."""
    with open(os.path.join(ROOT, "LABNOTES.md")) as f:
        notes = f.read()
    quoted = notes.split("<!-- mla-output:start -->\n```text\n")[1]
    quoted = quoted.split("```\n<!-- mla-output:end -->")[0]

    sections_1_and_2 = [text.split("\n\n3. ")[0].rstrip() for text in (quoted, default_run[1])]
    assert comparable(sections_1_and_2[0]) == comparable(sections_1_and_2[1])


def test_a_failing_check_says_fail_and_exits_1(monkeypatch, capsys, tmp_path):
    """W_UV's rows used for W_UK in the absorbed path: the run must say FAIL and exit 1."""
    def absorb_with_w_uv(self, q):
        return q @ self.w_uv.weight.view(self.n_heads, self.d_head, self.d_latent)

    monkeypatch.setattr(mla.LatentAttention, "absorb_query", absorb_with_w_uv)
    code, out, _ = run_main(mla.main, ["--out-dir", str(tmp_path)], capsys)
    assert code == 1 and "FAIL  (tolerance 1e-12)" in out
    assert out.rstrip().endswith("All checks: FAIL")


@pytest.mark.parametrize("knob, value, words", [
    ("D_ROPE", 15, "d_rope=15 must be even"),
    ("SEQ_LEN", 1, "SEQ_LEN=1 must be a whole number of at least 2"),
    ("GQA_KV_HEADS", 3, "GQA_KV_HEADS=3 must divide")])
def test_a_knob_that_cannot_work_is_refused_before_anything_runs(knob, value, words, monkeypatch,
                                                                 capsys, tmp_path):
    monkeypatch.setattr(mla, knob, value)
    code, out, err = run_main(mla.main, ["--out-dir", str(tmp_path / "new")], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"mla.py: error: {words}")
    assert not (tmp_path / "new").exists()


def test_a_folder_that_cannot_be_made_is_one_line_before_anything_runs(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    code, out, err = run_main(mla.main, ["--out-dir", str(tmp_path / "file" / "figures")], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("mla.py: error: --out-dir ") and "cannot be made: Not a directory" in err


def test_import_has_no_side_effects(capsys, tmp_path, monkeypatch):
    """No output, no file, and nothing seeded: a module that seeded would set torch's initial
    seed."""
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(ROOT))
    torch.manual_seed(12345)
    importlib.reload(mla)
    assert capsys.readouterr() == ("", "") and torch.initial_seed() == 12345
    assert os.listdir(tmp_path) == [] and sorted(os.listdir(ROOT)) == before
