"""mla.py: absorption, the MQA identity, RoPE, the cache, the decode timing, refusals, and the script as run."""

import math
import os
import subprocess
import sys

import conftest
import pytest
import torch
import torch.nn.functional as F
from conftest import comparable, record_calls, run_script
from torch.profiler import ProfilerActivity, profile

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


def test_float32_difference_is_bounded():
    """Reordered products round differently: within the printed tolerance, not claimed to be zero."""
    attn, x = mla.demo_module(0)
    diff = mla.absorbed_vs_naive(attn, x)
    assert diff <= 1e-5, f"{diff:.2e}"


def test_absorption_uses_the_right_rows_of_w_uk(monkeypatch):
    """W_UK viewed (dh, h, dc) instead of (h, dh, dc), a plausible wrong reshape, must break the match."""
    attn = module()
    x = inputs(attn)

    def wrong(self, q):
        return q @ self.w_uk.weight.view(self.d_head, self.n_heads, self.d_latent).transpose(0, 1)

    monkeypatch.setattr(mla.LatentAttention, "absorb_query", wrong)
    assert mla.absorbed_vs_naive(attn, x) > 1e-3


def test_expansion_uses_the_right_rows_of_w_uv(monkeypatch):
    attn = module()
    x = inputs(attn)

    def wrong(self, o_lat):
        return o_lat @ self.w_uv.weight.view(self.d_head, self.n_heads, self.d_latent).permute(1, 2, 0)

    monkeypatch.setattr(mla.LatentAttention, "expand_output", wrong)
    assert mla.absorbed_vs_naive(attn, x) > 1e-3


def test_the_scale_is_one_over_sqrt_of_dh_plus_dr():
    attn = module(dh=8, dr=6)
    assert attn.scale == pytest.approx(1 / math.sqrt(14), rel=1e-15)


# ----------------------------------------------------------------------------- the MQA identity
def test_absorbed_decode_step_is_mqa_with_one_kv_head():
    attn = module()
    assert mla.mqa_identity_gap(attn, inputs(attn, T=9)) <= 1e-12


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


def sdpa_ops(value_width):
    """The ops PyTorch runs for one MQA decode call, 16 heads, keys 12 wide, values value_width wide."""
    query, key = torch.randn(1, 16, 1, 12), torch.randn(1, 1, 32, 12)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        F.scaled_dot_product_attention(query, key, key[..., :value_width], enable_gqa=True)
    return {e.key for e in prof.key_averages()}


def test_why_the_literal_mqa_call_is_slow():
    """What the docstring and the README say: values narrower than keys send SDPA on CPU to its math kernel,
    which copies K and V out to every head; values as wide as keys do not."""
    narrow, wide = sdpa_ops(8), sdpa_ops(12)
    assert "aten::_scaled_dot_product_attention_math" in narrow and "aten::repeat_interleave" in narrow, narrow
    assert "aten::repeat_interleave" not in wide, wide


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
    assert mla.cached_vs_full(attn, x, True, [(0, 3), (3, 5), (5, 6)]) > 1e-3


def test_cached_check_sees_a_mask_without_its_offset(monkeypatch):
    """A causal mask that forgets the cached tokens (new token i at i, not S - T + i) must fail the printed check.
    The naive path masks single tokens too, so it would see it anyway; the absorbed one, like mha.attend, adds no
    mask at T = 1, and only the 2-token chunk after the prompt uses the offset there."""
    monkeypatch.setattr(mha, "causal_mask", conftest.mask_without_offset)
    attn = module(dtype=torch.float32)
    x = inputs(attn, T=12)
    for absorbed in (False, True):
        assert mla.cached_vs_full(attn, x, absorbed, [(0, 6), (6, 8), (8, 9), (9, 10), (10, 11), (11, 12)]) > 1e-2
    singles = [(0, 6), *((t, t + 1) for t in range(6, 12))]
    assert mla.cached_vs_full(attn, x, True, singles) < 1e-5     # single tokens alone: not seen


@pytest.mark.parametrize("B, max_len, dtype", [(1, 512, torch.float32), (3, 17, torch.float64), (2, 5, torch.bfloat16)])
def test_new_cache_bytes_match_the_formula(B, max_len, dtype):
    cache = module(dtype=dtype, dc=12, dr=6).new_cache(B, max_len)
    per = torch.tensor([], dtype=dtype).element_size()
    assert cache.c.shape == (B, max_len, 12) and cache.k_rope.shape == (B, max_len, 6)
    assert cache.nbytes == B * max_len * (12 + 6) * per
    assert cache.nbytes == mla.latent_cache_bytes(1, 12, 6, max_len, batch=B, bytes_per_elem=per)
    assert cache.c.dtype == cache.k_rope.dtype == dtype and cache.length == 0


def test_new_cache_is_made_where_the_weights_are():
    cache = module(dc=12, dr=6).to("meta").new_cache(2, 5)       # 'meta' stands in for a GPU
    assert cache.c.device.type == cache.k_rope.device.type == "meta"


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


def test_the_printed_table_follows_the_bytes_knob(monkeypatch, capsys):
    monkeypatch.setattr(mla, "CACHE_BYTES_PER_ELEM", 1)
    mla.print_cache_table()
    out = capsys.readouterr().out
    assert "1 bytes per number" in out and "\n   = 141,557,760 bytes = 0.14 GB, against 8.1 GB" in out
    assert "   DeepSeek-V2           60  128   8.05 GB  0.50 GB  0.06 GB   0.14 GB       10.07 GB       56.9x" in out


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
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


BAD_CALLS = [   # (name, the call on a float32 cache holding 3 of 5 tokens, error, words)
    ("overflow", lambda attn, cache: attn(inputs(attn, B=2, T=3), cache=cache), ValueError,
     ["holds 3 of its 5 tokens: 3 more do not fit"]),
    ("wrong dtype", lambda attn, cache: attn(inputs(attn, B=2, T=1).double(), cache=cache), TypeError,
     ["torch.float64", "torch.float32"]),
    ("wrong batch", lambda attn, cache: attn(inputs(attn, B=3, T=1), cache=cache), ValueError,
     ["(2, 5, 12)", "(3, 5, 12)", "new_cache()"]),
    ("wrong width", lambda attn, cache: attn(torch.zeros(2, 1, 47), cache=cache), ValueError, ["d_model=48", "47"]),
    ("no tokens", lambda attn, cache: attn(torch.zeros(2, 0, 48), cache=cache), ValueError, ["B, T >= 1"]),
    ("not a cache", lambda attn, cache: attn(torch.zeros(2, 1, 48), cache=(cache.c, cache.k_rope)), TypeError,
     ["LatentCache"]),
    ("length past the end", lambda attn, cache: setattr(cache, "length", 5) or attn(torch.zeros(2, 1, 48),
                                                                                    cache=cache), ValueError,
     ["holds 5 of its 5 tokens: 1 more do not fit"]),
]


@pytest.mark.parametrize("case", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_a_refused_call_leaves_the_cache_as_it_was(case):
    name, call, error, words = case
    attn = module(dtype=torch.float32)
    cache = attn.new_cache(2, 5)
    with torch.no_grad():
        attn(inputs(attn, B=2, T=3), cache=cache)
        before = (cache.c.clone(), cache.k_rope.clone())
        with pytest.raises(error) as e:
            call(attn, cache)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), (name, str(e.value))
    assert torch.equal(cache.c, before[0]) and torch.equal(cache.k_rope, before[1])
    assert cache.length == (5 if name == "length past the end" else 3)    # that test set it; the module wrote nothing


def test_a_cache_of_the_wrong_dtype_is_refused():
    attn = module(dtype=torch.float32)
    cache = module(dtype=torch.float64).new_cache(2, 5)
    with torch.no_grad(), pytest.raises(ValueError, match="latent c as .* in torch.float64 on cpu; this call needs"):
        attn(inputs(attn, T=1), cache=cache)
    assert cache.length == 0 and not cache.c.any()


def test_a_hand_built_cache_with_a_wrong_rope_key_is_refused_before_c_is_written():
    attn = module(dtype=torch.float32)
    cache = attn.new_cache(1, 5)
    cache.k_rope = torch.zeros(1, 5, 7)
    with torch.no_grad(), pytest.raises(ValueError, match="RoPE key as \\(1, 5, 7\\)"):
        attn(torch.randn(1, 2, 48), cache=cache)
    assert cache.length == 0 and not cache.c.any()


def test_decoding_under_autograd_is_refused():
    attn = module(dtype=torch.float32).train()
    cache = attn.new_cache(1, 4)
    with pytest.raises(RuntimeError, match="torch.no_grad"):
        attn(torch.randn(1, 1, 48), cache=cache)
    assert cache.length == 0 and not cache.c.any()


def test_any_trainable_parameter_refuses_decoding_under_autograd():
    """Only the query projection trainable: backward() would still fail on the in-place write."""
    attn = module(dtype=torch.float32)
    attn.requires_grad_(False)
    attn.w_q.weight.requires_grad_(True)
    cache = attn.new_cache(1, 4)
    with pytest.raises(RuntimeError, match="torch.no_grad"):
        attn(torch.randn(1, 1, 48), cache=cache)
    assert cache.length == 0 and not cache.c.any()


def test_training_without_a_cache_still_works():
    attn = module(dtype=torch.float32).train()
    attn(torch.randn(1, 3, 48), absorbed=True).sum().backward()
    assert attn.w_uk.weight.grad is not None and attn.w_uk.weight.grad.abs().max() > 0


@pytest.mark.parametrize("batch, max_len, error", [(0, 4, ValueError), (1, 2.0, TypeError), (1, -1, ValueError)])
def test_new_cache_refuses_bad_sizes(batch, max_len, error):
    with pytest.raises(error, match="batch|max_len"):
        module().new_cache(batch, max_len)


# ----------------------------------------------------------------------------- decode timing
def test_decode_step_work():
    flops, n, cached = mla.mla_step_work(1024, 128, 512, 64)
    assert round(flops / n, 1) == 97.8 and round(flops / cached, 1) == 120.9   # the review's number; cache alone
    flops, n, cached = mla.mla_step_work(4096, 128, 512, 64)
    assert round(flops / n) == 114 and cached == 4096 * 576 * 4
    assert mla.gqa_step_work(4096, 128, 8, 128) == (268435456, 33554432 + 131072, 33554432)
    assert mla.gqa_step_work(1024, 128, 128, 128)[2] == mha.decode_bytes(128, 128, 1024)


def test_a_floor_reads_at_the_speed_of_its_own_cache():
    flops, n, cached = mla.mla_step_work(4096, 128, 512, 64)
    step = mla.Step("MLA", 4096, flops, n, cached, seconds=1.0, read_seconds=cached / 20e9)   # cache read at 20 GB/s
    assert step.floor(100e9) == mha.roofline(flops, n, mha.Ceilings(20e9, 100e9)) == (flops / 100e9, "compute")
    assert step.floor(1e15) == pytest.approx((n / 20e9, "memory"))


PEAK = 100e9                                               # FLOP/s


def steps(ms):
    """Steps at 1024 and 2048 tokens with the given times in ms, each cache read at 10 GB/s."""
    out = []
    for i, S in enumerate((1024, 2048)):
        work = {"MLA": mla.mla_step_work(S, 128, 512, 64), "MHA": mla.gqa_step_work(S, 128, 128, 128),
                "GQA-8": mla.gqa_step_work(S, 128, 8, 128)}
        for kind, (flops, n, cached) in work.items():
            out.append(mla.Step(kind, S, flops, n, cached, seconds=ms[kind][i] / 1e3, read_seconds=cached / 10e9))
    return out


# floors at 10 GB/s and 100 GFLOP/s: MLA 2.85 / 5.70 ms, MHA 13.4 / 26.8 ms, GQA-8 0.84 / 1.68 ms
GOOD = {"MLA": [4, 8], "MHA": [60, 120], "GQA-8": [4, 8]}


def test_consistent_timings_raise_no_alarm():
    assert mla.timing_contradictions(steps(GOOD), PEAK) == []


@pytest.mark.parametrize("ms, words", [
    ({"MLA": [2, 8], "MHA": [60, 120], "GQA-8": [4, 8]}, "MLA at 1024 tokens is 30% below its floor"),
    ({"MLA": [4, 8], "MHA": [60, 120], "GQA-8": [4, 150]}, "GQA-8 is slower than MHA at 2048 tokens"),
])
def test_contradicting_timings_are_named(ms, words):
    assert words in mla.timing_contradictions(steps(ms), PEAK)


def test_other_programs_busy_meanwhile_is_named():
    assert mla.timing_contradictions(steps(GOOD), PEAK, elsewhere=0.2) == []
    assert mla.timing_contradictions(steps(GOOD), PEAK, elsewhere=0.9) == ["other programs kept 0.9 cores busy"]


def test_a_busy_machine_is_said_instead_of_a_lesson(capsys):
    bad = steps({"MLA": [2, 8], "MHA": [60, 120], "GQA-8": [4, 8]})
    mla.print_decode_table(bad, PEAK, mla.timing_contradictions(bad, PEAK))
    out = capsys.readouterr().out
    assert "NOT TRUSTWORTHY, the machine was busy while timing: MLA at 1024 tokens" in out and "At 2048" not in out


def test_the_table_and_the_lesson_are_made_from_the_numbers(capsys):
    mla.print_decode_table(steps(GOOD), PEAK, [])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[-1:] and line.split()[-1].endswith("x")
            and len(line.split()) in (8, 9)]
    assert [r[-8] for r in rows] == ["MLA", "MHA", "GQA-8"] * 2
    mla_row = rows[0]                                      # 1024 tokens: floor 2.852 ms (compute), 4 ms measured
    assert mla_row == ["1024", "MLA", "97.8", "10.0", "compute", "2.852", "4.000", "71%", "15.0x"], mla_row
    assert "At 2048 tokens MLA does 4.25x MHA's FLOPs on 1/51 of its bytes and is 15.0x faster (compute-bound," in out
    assert "MHA memory-bound). In bf16 (half the bytes) MLA does 216 FLOPs per byte, GQA-8 16" in out
    # An H100's ridge, 989e12 / 3.35e12 = 295 FLOPs per byte, lies above MLA's 216: memory-bound there, at 0.73x
    assert "ridge is at 295: MLA's step lies below it, at 0.73x the ridge, and GQA-8's far below it, waiting" in out


def test_measure_decode_on_tiny_contexts(monkeypatch):
    """One step per kind and context, and each step and each read gets its own context's cache, not all of it."""
    timed = []                                   # what each timed call got: its kind and its cache's shapes
    latent = lambda q_lat, q_rope, c, k_rope, scale: ("MLA", c.shape, k_rope.shape)
    record_calls(monkeypatch, mla, "latent_attend", timed, latent)
    record_calls(monkeypatch, mha, "attend", timed, lambda q, k, v: ("attend", k.shape, v.shape))
    record_calls(monkeypatch, torch.Tensor, "sum", timed, lambda t: ("read", t.shape))
    got, flops, elsewhere = mla.measure_decode((128, 64), 1, 0)
    monkeypatch.undo()
    h, dh, dc, dr = 128, 128, 512, 64            # DeepSeek-V2's heads, head width, latent and RoPE key
    one_round = []
    for S in (128, 64):                          # longest context first; at each, every read, then every step
        one_round += [("read", (1, S, dc)), ("read", (1, S, dr))]                      # MLA's c and k_R
        one_round += [("read", (2, 1, kv, S, dh)) for kv in (h, 8)]                    # MHA's, GQA-8's K and V
        one_round += [("MLA", (1, S, dc), (1, S, dr))]
        one_round += [("attend", (1, kv, S, dh), (1, kv, S, dh)) for kv in (h, 8)]
    assert timed == one_round
    assert [(s.kind, s.S) for s in got] == [(k, S) for S in (64, 128) for k in ("MLA", "MHA", "GQA-8")]
    assert all(0 < s.seconds < 1 and 0 < s.read_seconds < 1 for s in got) and flops > 1e8 and elsewhere >= 0
    assert [s.cache_bytes for s in got[:3]] == [64 * 576 * 4, mha.decode_bytes(128, 128, 64), mha.decode_bytes(8, 128, 64)]


# ----------------------------------------------------------------------------- the script, as a user runs it
def run_main(argv, capsys):
    return conftest.run_main(mla.main, argv, capsys)


@pytest.fixture(scope="module")
def default_run():
    return run_script(SCRIPT)


def test_default_run_prints_every_check(default_run):
    r = default_run
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.count("  OK  (tolerance") == 5 and "DETECTED, as it must be" in r.stdout
    assert "512-token cache: 294,912 bytes allocated, 294,912 by the formula" in r.stdout
    assert "cached, float32: chunks of [6, 2, 1, 1, 1, 1] tokens, against one full forward" in r.stdout
    assert "latent_cache_bytes(60, 512, 64, 4096)\n   = 283,115,520 bytes = 0.28 GB, against 16.1 GB" in r.stdout
    assert "   DeepSeek-V2           60  128  16.11 GB  1.01 GB  0.13 GB   0.28 GB       20.13 GB       56.9x" in r.stdout
    assert "3. Decode step" in r.stdout and mha.machine_name().split(",")[0] in r.stdout
    assert r.stdout.rstrip().endswith("All checks: OK")


def test_the_lab_notes_quote_the_real_output(default_run):
    """The lab notes quote sections 1 and 2 of a run (section 3 is measured, quoted apart): the same lines
    as a fresh run's, up to values checked against a tolerance."""
    with open(os.path.join(ROOT, "LABNOTES.md")) as f:
        notes = f.read()
    quoted = notes.split("<!-- mla-output:start -->\n```text\n")[1].split("```\n<!-- mla-output:end -->")[0]
    cut = "3. Decode step"
    assert cut in default_run.stdout and cut not in quoted
    assert comparable(quoted.rstrip()) == comparable(default_run.stdout.split(cut)[0].rstrip())


def test_a_short_run_in_process(monkeypatch, capsys):
    """Tiny contexts and one round: main() still prints the whole table and the lesson or the alarm."""
    monkeypatch.setattr(mla, "DECODE_CONTEXTS", (128, 64))
    monkeypatch.setattr(mla, "DECODE_ROUNDS", 1)
    code, out, err = run_main([], capsys)
    assert code == 0 and err == ""
    assert [line.split()[0] for line in out.splitlines() if " MLA " in line and line.endswith("x")] == ["64", "128"]
    assert ("At 128 tokens MLA does" in out) != ("NOT TRUSTWORTHY" in out)


def test_a_failing_check_says_fail_and_exits_1(monkeypatch, capsys):
    """W_UV's rows used for W_UK in the absorbed path: the run must say FAIL and exit 1."""
    monkeypatch.setattr(mla, "DECODE_CONTEXTS", (64,))
    monkeypatch.setattr(mla, "DECODE_ROUNDS", 1)

    def wrong(self, q):
        return q @ self.w_uv.weight.view(self.n_heads, self.d_head, self.d_latent)

    monkeypatch.setattr(mla.LatentAttention, "absorb_query", wrong)
    code, out, _ = run_main([], capsys)
    assert code == 1 and "FAIL  (tolerance 1e-12)" in out and out.rstrip().endswith("All checks: FAIL")


@pytest.mark.parametrize("argv, words", [(["--seed", "-1"], ["-1", "2**32 - 1"]), (["--seed", "abc"], ["'abc'"]),
                                         (["--out-dir", "x"], ["unrecognized arguments: --out-dir x"])])
def test_bad_flag_exits_2_in_one_line(argv, words, capsys):
    code, out, err = run_main(argv, capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and err.startswith("mla.py: error: ")
    assert all(w in err for w in words), err


@pytest.mark.parametrize("knob, value, words", [
    ("D_ROPE", 15, ["d_rope=15", "even"]),
    ("D_LATENT", 64.5, ["d_latent", "whole number"]),
    ("SEQ_LEN", 1, ["SEQ_LEN=1", "at least 2"]),
    ("CACHE_TOKENS", "4k", ["CACHE_TOKENS", "whole number", "'4k'"]),
    ("DECODE_CONTEXTS", (), ["DECODE_CONTEXTS", "at least one"]),
    ("DECODE_CONTEXTS", (1024, -8), ["DECODE_CONTEXTS[1]=-8", "at least 1"]),
    ("GQA_KV_HEADS", 3, ["GQA_KV_HEADS=3", "divide"]),
])
def test_a_knob_that_cannot_work_is_refused_at_start(knob, value, words, monkeypatch, capsys):
    monkeypatch.setattr(mla, knob, value)
    code, out, err = run_main([], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert all(w in err for w in words), err


def test_out_of_memory_is_one_line(monkeypatch, capsys):
    """A context of 10**8 tokens asks for 13 TB of K and V: PyTorch cannot allocate it; one line, exit 1."""
    monkeypatch.setattr(sys, "argv", ["mla.py"])
    with pytest.raises(SystemExit) as e:
        mha.run_as_script(lambda: mla.measure_decode((10**8,), 1, 0))
    assert e.value.code == 1 and capsys.readouterr().err == "mla.py: error: out of memory; make the knobs smaller\n"


def test_bad_flag_from_the_shell_has_no_traceback():
    r = run_script(SCRIPT, "--seed", "-3")
    assert r.returncode == 2 and r.stdout == "" and r.stderr == "mla.py: error: --seed -3 must be between 0 and 2**32 - 1\n"


def test_help_shows_the_defaults(capsys):
    code, out, _ = run_main(["--help"], capsys)
    assert code == 0 and "--seed" in out and f"default: {mla.SEED}" in out


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
