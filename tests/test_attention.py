"""The module against PyTorch: bit-exact for MHA, within stated tolerances for GQA/MQA and conversions."""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import gqa_module
from torch import nn
from torch.nn.attention.bias import causal_lower_right

import mha


def torch_mha(d, h, dtype=torch.float32, bias=True, seed=0):
    """nn.MultiheadAttention with its own weight init and random (non-zero) biases."""
    torch.manual_seed(seed)
    return mha.random_biases(nn.MultiheadAttention(d, h, bias=bias, batch_first=True, dtype=dtype))


# d_head 32 and 64 are powers of two; 48 and 24 are not (sqrt(1/dh) is then inexact in binary).
SHAPES = [(256, 8), (384, 8), (192, 8), (512, 8)]


# ----------------------------------------------------------------------------- exact: the same operations as PyTorch
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("d, h", SHAPES)
@pytest.mark.parametrize("T", [1, 12, 37])
@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_mha_is_bit_identical_to_torch(dtype, d, h, T, train, fused, bias):
    """One sequence, written out against need_weights=True, fused against need_weights=False: the same
    operations in the same order (both projections the same addmm on the same matrix; the attention between
    on views where PyTorch has copies), 0.0 on every MKL path CI runs."""
    ref = torch_mha(d, h, dtype, bias).train(train)
    ours = mha.from_torch(ref)
    assert ours.training == train and ours.in_proj.weight.dtype == dtype
    assert (ours.in_proj.bias is None) == (not bias)
    x = torch.randn(1, T, d, dtype=dtype)
    y_diff, w_diff = mha.max_diff_vs_torch(ours, x, ref, fused=fused)
    assert y_diff == 0.0, f"max |ours - nn.MultiheadAttention| = {y_diff:.3e}"
    assert w_diff == (None if fused else 0.0), f"max |weights - nn.MultiheadAttention's| = {w_diff}"


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("d, h", SHAPES)
@pytest.mark.parametrize("B, T", [(2, 12), (3, 1), (3, 37)])
@pytest.mark.parametrize("fused", [False, True])
def test_mha_matches_torch_on_a_batch_within_rounding(dtype, tol, d, h, B, T, fused):
    """For a batch nn.MultiheadAttention projects a transposed view: F.linear then adds the bias after the
    product (ours within it, addmm), on rows stacked (T, B) where ours are (B, T); both may round otherwise.
    A reshape that mixed sequences would be off by far more."""
    ref = torch_mha(d, h, dtype)
    y_diff, w_diff = mha.max_diff_vs_torch(mha.from_torch(ref), torch.randn(B, T, d, dtype=dtype), ref,
                                           fused=fused)
    assert y_diff <= tol and (w_diff or 0.0) <= tol, (y_diff, w_diff)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fused", [False, True])
def test_mha_bit_identical_with_one_or_two_threads(threads, fused):
    torch.set_num_threads(threads)
    ref = torch_mha(384, 8, seed=3)
    x = torch.randn(1, 50, 384)
    y_diff, w_diff = mha.max_diff_vs_torch(mha.from_torch(ref), x, ref, fused=fused)
    assert y_diff == 0.0 and (w_diff or 0.0) == 0.0, f"{threads} threads: {y_diff:.3e}, {w_diff}"


def test_the_two_paths_are_the_same_attention_within_rounding():
    """attend and attend_fused differ only in the last bits (as PyTorch's own two paths do)."""
    attn = gqa_module(256, 8, 2, seed=4)
    x = torch.randn(2, 20, 256)
    with torch.no_grad():
        assert mha.relative_diff(attn(x, fused=True), attn(x)) <= 1e-6


def test_swapped_heads_fail_the_check():
    ref = torch_mha(256, 8, seed=6)
    broken = mha.swap_query_heads(mha.from_torch(ref), 0, 1)
    y_diff, _ = mha.max_diff_vs_torch(broken, torch.randn(2, 12, 256), ref)
    assert y_diff > 1e-3, f"swapping two query heads went unnoticed: {y_diff:.3e}"


def test_to_torch_inverts_from_torch():
    ref = torch_mha(128, 4, seed=7)
    back = mha.to_torch(mha.from_torch(ref))
    for (name, p), (_, q) in zip(ref.named_parameters(), back.named_parameters()):
        assert torch.equal(p, q), name


def test_from_torch_copies_every_weight_and_bias_to_its_place():
    ref = torch_mha(64, 4, bias=True, seed=2)
    ours = mha.from_torch(ref)
    assert torch.equal(ours.in_proj.weight, ref.in_proj_weight) and torch.equal(ours.in_proj.bias, ref.in_proj_bias)
    assert torch.equal(ours.out_proj.weight, ref.out_proj.weight) and torch.equal(ours.out_proj.bias, ref.out_proj.bias)
    assert ref.in_proj_bias.abs().min() > 0                # biases really random: a misplaced one would show


# ----------------------------------------------------------------------------- GQA / MQA: within a tolerance
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("d, h, kv", [(256, 8, 4), (256, 8, 2), (256, 8, 1), (384, 8, 2), (192, 8, 4)])
@pytest.mark.parametrize("T", [1, 23])
def test_gqa_matches_torch_with_repeated_kv(dtype, tol, d, h, kv, T):
    ours = gqa_module(d, h, kv, dtype)
    x = torch.randn(2, T, d, dtype=dtype)
    y_diff, w_diff = mha.max_diff_vs_torch(ours, x)
    fused_diff, _ = mha.max_diff_vs_torch(ours, x, fused=True)
    assert max(y_diff, w_diff, fused_diff) <= tol, f"kv={kv}: {y_diff:.3e} {w_diff:.3e} {fused_diff:.3e}"


@pytest.mark.parametrize("kv", [4, 2, 1])
def test_gqa_matches_the_textbook_and_sdpa_enable_gqa(kv):
    attn, x = gqa_module(256, 8, kv), torch.randn(2, 17, 256)
    q, k, v = torch.randn(2, 8, 17, 32), torch.randn(2, kv, 17, 32), torch.randn(2, kv, 17, 32)
    textbook = mha.relative_diff(mha.attend(q, k, v)[0], mha.attend_textbook(q, k, v)[0])   # as section 3 prints it
    sdpa = mha.max_diff_vs_sdpa(attn, x)
    assert textbook <= 2e-6 and sdpa <= 2e-6, f"kv={kv}: textbook {textbook:.3e}, sdpa(enable_gqa=True) {sdpa:.3e}"


@pytest.mark.parametrize("attend", [mha.attend_textbook, mha.attend, mha.attend_fused])
def test_query_heads_are_grouped_like_repeat_interleave(attend):
    """Query head i must read K/V head i // g; repeat() instead of repeat_interleave() pairs them wrongly."""
    torch.manual_seed(8)
    B, h, kv, T, dh = 2, 4, 2, 5, 8
    q, k, v = torch.randn(B, h, T, dh), torch.randn(B, kv, T, dh), torch.randn(B, kv, T, dh)
    o = attend(q, k, v)
    o = o[0] if isinstance(o, tuple) else o
    right = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    wrong = F.scaled_dot_product_attention(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1), is_causal=True)
    assert (o - right).abs().max() <= 1e-6
    assert (o - wrong).abs().max() > 1e-2


@pytest.mark.parametrize("attend", [mha.attend_textbook, mha.attend])
def test_attend_is_the_formula_written_out(attend):
    """Known answer from the formula itself, in float64: softmax(q k^T / sqrt(dh) + mask) v, per head."""
    torch.manual_seed(9)
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.float64) for _ in range(3))
    o, p = attend(q, k, v)
    want_p = (q @ k.transpose(-1, -2) / 8 ** 0.5 + mha.causal_mask(4, 4, torch.float64)).softmax(-1)
    assert torch.allclose(p, want_p, atol=1e-12) and torch.allclose(o, want_p @ v, atol=1e-12)


@pytest.mark.parametrize("T, S", [(5, 5), (1, 9), (3, 9)])
def test_attend_is_the_textbook_without_the_copies(T, S):
    """GQA-2 of 8 heads, with and without a cache's earlier keys: the same weights and output (float64)."""
    torch.manual_seed(10)
    q, k, v = torch.randn(2, 8, T, 16, dtype=torch.float64), *torch.randn(2, 2, 2, S, 16, dtype=torch.float64)
    (o, p), (o_book, p_book) = mha.attend(q, k, v), mha.attend_textbook(q, k, v)
    assert torch.allclose(p, p_book, atol=1e-12) and torch.allclose(o, o_book, atol=1e-12)


def test_a_decode_step_adds_no_mask(monkeypatch):
    """T = 1: the one new token sees every key, so attend builds no mask (section 5 times that step); T > 1 masks."""
    calls, real = [], mha.causal_mask
    monkeypatch.setattr(mha, "causal_mask", lambda T, S, dtype=torch.float32: calls.append((T, S)) or real(T, S, dtype))
    k, v = torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    mha.attend(torch.randn(1, 4, 1, 8), k, v)
    assert calls == []
    mha.attend(torch.randn(1, 4, 3, 8), k, v)
    assert calls == [(3, 9)]


def test_attends_repl_example_runs_and_agrees_with_the_textbook():
    """The two lines attend's docstring offers for a REPL, run as written, on 50 seeds: rounding only."""
    lines = mha.attend.__doc__.split("To see it in a REPL (from mha import *):")[1].strip().splitlines()[:2]
    worst = 0.0
    for seed in range(50):
        torch.manual_seed(seed)
        scope = {"torch": torch, "attend": mha.attend, "attend_textbook": mha.attend_textbook}
        exec(lines[0].strip(), scope)                      # noqa: S102 (the docstring's own line, as a doctest would)
        worst = max(worst, eval(lines[1].split("#")[0].strip(), scope).item())
    assert worst <= 2e-6, worst                          # rounding only: within the file's tolerance for GQA


def test_attends_repl_lines_show_the_stacked_order(monkeypatch):
    """The docstring's next two lines, run as written, give the blocks its comment states, and those are the
    rows attend stacks: each block holds its group's heads, head after head."""
    lines = mha.attend.__doc__.split("To see it in a REPL (from mha import *):")[1].strip().splitlines()[2:4]
    scope = {"torch": torch}
    exec(lines[0].split("#")[0].strip(), scope)            # noqa: S102 (the docstring's own line, as a doctest would)
    blocks = eval(lines[1].split("#")[0].strip(), scope)
    said = [[float(n) for n in part.split("=")[1].split()] for part in lines[1].split("#")[1].split(",")]
    assert blocks.tolist() == said == [[0, 0, 0, 1, 1, 1], [2, 2, 2, 3, 3, 3]]
    seen = []
    real_baddbmm = torch.baddbmm
    monkeypatch.setattr(torch, "baddbmm", lambda mask, q, k: seen.append(q) or real_baddbmm(mask, q, k))
    mha.attend(scope["q"], torch.zeros(1, 2, 3, 1), torch.zeros(1, 2, 3, 1))
    assert torch.equal(seen[0][:, :, 0], blocks)           # attend's own stacked q (dh = 1: scaled by 1)


def test_forwards_repl_comment_shows_what_view_with_and_without_transpose_gives(monkeypatch):
    """forward's comment, run as it says: view then transpose gives head 0 the first two numbers of each token,
    the view without the transpose gives it token 0's two heads; and forward's own q is cut the first way."""
    import inspect
    source = " ".join(line.strip().lstrip("# ") for line in inspect.getsource(mha.CausalMHA.forward).splitlines())
    x = torch.arange(8.).view(1, 2, 4)                     # as the comment defines it
    assert "x = torch.arange(8.).view(1, 2, 4) is token 0 = 0 1 2 3, token 1 = 4 5 6 7" in source
    assert x[0].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for t in range(2):                                     # the drawing: each token cut into its two heads
        heads = x.view(1, 2, 2, 2)[0, t].int().tolist()    # [[head 0's numbers], [head 1's]]
        drawn = f"token {t}:  " + " | ".join(" ".join(map(str, head)) for head in heads)
        assert drawn in source, drawn
    head0 = x.view(1, 2, 2, 2).transpose(1, 2)[0, 0]
    wrong = x.view(1, 2, 2, 2)[0, 0]
    assert "transpose(1, 2)[0, 0] is head 0: [[0, 1], [4, 5]]" in source and head0.tolist() == [[0, 1], [4, 5]]
    assert "Without the transpose, x.view(1, 2, 2, 2)[0, 0] is [[0, 1], [2, 3]]" in source
    assert wrong.tolist() == [[0, 1], [2, 3]]
    attn = mha.CausalMHA(4, 2, bias=False)                 # h=2, dh=2; in_proj the identity on q's rows
    with torch.no_grad():
        attn.in_proj.weight.zero_()
        attn.in_proj.weight[:4] = torch.eye(4)
    seen, real = {}, mha.attend

    def spy(q, k, v):
        seen["q"] = q
        return real(q, k, v)

    monkeypatch.setattr(mha, "attend", spy)
    with torch.no_grad():
        attn(x)
    assert torch.equal(seen["q"][0, 0], head0)             # forward's q: head 0 as the comment says


def test_the_one_head_repl_example_is_the_readmes_by_hand():
    """attend_one_head's docstring lines, run as written, give the printed digits; the README's three matrices
    (scores with the mask, p, o, to two decimals) are what the code computes, and its prose quotes row 2."""
    lines = mha.attend_one_head.__doc__.split("in a REPL (from mha import *):")[1].strip().splitlines()[:3]
    scope = {"torch": torch, "attend_one_head": mha.attend_one_head}
    for line in lines[:2]:                                 # k = ..., q = ...
        exec(line.split("#")[0].strip(), scope)            # noqa: S102 (the docstring's own line, as a doctest would)
    o = eval(lines[2].split("#")[0].strip(), scope)
    printed = [float(n) for n in lines[2].rsplit("tensor([", 1)[1].split("])")[0].split(", ")]
    assert torch.equal(o.round(decimals=4), torch.tensor(printed))
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")) as f:
        readme = f.read()
    block = readme.split("q k^T / sqrt(2) + mask")[1].split("```")[0].strip().splitlines()[1:]   # after the headers
    rows = [[float(n) for n in line.replace("[", " ").replace("]", " ").split()] for line in block]
    assert len(rows) == 3 and all(len(row) == 3 + 3 + 2 for row in rows)      # scores, p, o side by side
    q, k = scope["q"], scope["k"]
    scores = q @ k.T / math.sqrt(2) + mha.causal_mask(3, 3)
    o, p = mha.attend_one_head(q, k, k)
    assert torch.equal(torch.tensor([row[:3] for row in rows]), scores.round(decimals=2))
    assert torch.equal(torch.tensor([row[3:6] for row in rows]), p.round(decimals=2))
    assert torch.equal(torch.tensor([row[6:] for row in rows]), o.round(decimals=2))
    prose = " ".join(readme.split())
    assert "softmax `(0.40, 0.20, 0.40)`" in prose and "= (0.80, 0.60)`" in prose


def test_the_textbook_is_one_head_at_a_time():
    """attend_textbook on (B, h, T, dh) is attend_one_head run on each head of each sequence alone, with its K/V
    head copied as the picture says (query head i reads K/V head i // g), and with a cache's earlier keys."""
    torch.manual_seed(3)
    q, k, v = torch.randn(2, 6, 3, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8)   # h=6, kv=3, T=3, S=7
    o, p = mha.attend_textbook(q, k, v)
    for b in range(2):
        for i in range(6):
            o_i, p_i = mha.attend_one_head(q[b, i], k[b, i // 2], v[b, i // 2])
            assert torch.allclose(o[b, i], o_i, atol=1e-6) and torch.allclose(p[b, i], p_i, atol=1e-6), (b, i)
    assert not torch.allclose(o[0, 1], mha.attend_one_head(q[0, 1], k[0, 1], v[0, 1])[0], atol=1e-3)


@pytest.mark.parametrize("kv", [8, 2, 1])
def test_causal_future_tokens_do_not_change_the_past(kv):
    """By construction: the past's rows see the same numbers, the future's scores become exact zeros."""
    attn = gqa_module(128, 8, kv).eval()
    x = torch.randn(2, 16, 128)
    x2 = x.clone()
    x2[:, 10:] = torch.randn(2, 6, 128)
    with torch.no_grad():
        y, y2 = attn(x), attn(x2)
    assert torch.equal(y[:, :10], y2[:, :10])
    assert not torch.equal(y[:, 10:], y2[:, 10:])


def test_attention_weights_are_causal_distributions():
    attn = gqa_module(128, 8, 2).eval()
    with torch.no_grad():
        y, p = attn(torch.randn(2, 9, 128), need_weights=True)
    assert y.shape == (2, 9, 128) and p.shape == (2, 8, 9, 9)
    assert torch.allclose(p.sum(-1), torch.ones(2, 8, 9), atol=1e-6)
    assert p.triu(1).abs().max() == 0.0


def test_output_shape_and_attributes():
    attn = mha.CausalMHA(96, 6, 3)
    assert (attn.n_heads, attn.n_kv_heads, attn.d_head) == (6, 3, 16)
    assert attn.in_proj.weight.shape == ((6 + 2 * 3) * 16, 96)
    assert mha.CausalMHA(96, 6).n_kv_heads == 6                # None means MHA
    assert attn(torch.randn(4, 7, 96)).shape == (4, 7, 96)


def test_causal_mask_aligns_new_tokens_bottom_right():
    assert mha.causal_mask(2, 4).tolist() == [[0, 0, 0, float("-inf")], [0, 0, 0, 0]]
    assert torch.equal(mha.causal_mask(3, 3), torch.full((3, 3), float("-inf")).triu(1))
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 9, 8), torch.randn(2, 4, 9, 8)   # T=3 new tokens, S=9
    ours = F.scaled_dot_product_attention(q, k, v, attn_mask=mha.causal_mask(3, 9))
    lower_right = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(3, 9))   # as the docstring says
    top_left = F.scaled_dot_product_attention(q, k, v, is_causal=True)                          # the trap it warns of
    assert (ours - lower_right).abs().max() <= 1e-6 < (ours - top_left).abs().max()


def test_attention_kind_names_the_kv_heads():
    assert [mha.attention_kind(32, kv) for kv in (32, 8, 1)] == ["MHA", "GQA-8", "MQA"]


# ----------------------------------------------------------------------------- bad input: one sentence
def one_sentence(error, words):
    for w in words:
        assert w in str(error.value), (w, str(error.value))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("d, h, kv, error, words", [
    (100, 8, None, ValueError, ["d_model=100", "n_heads=8", "multiple"]),
    (64, 0, None, ValueError, ["n_heads=0"]),
    (64, 8, 3, ValueError, ["n_kv_heads=3", "positive divisor", "n_heads=8"]),
    (64, 8, 0, ValueError, ["n_kv_heads=0", "positive divisor"]),
    (64, 8, 16, ValueError, ["n_kv_heads=16", "positive divisor"]),
    (64, 8, 2.0, TypeError, ["n_kv_heads must be a whole number", "2.0"]),
    (64.0, 8, 2, TypeError, ["d_model must be a whole number"]),
])
def test_bad_sizes_say_what_and_why(d, h, kv, error, words):
    with pytest.raises(error) as e:
        mha.CausalMHA(d, h, kv)
    one_sentence(e, words)


@pytest.mark.parametrize("x, error, words", [
    (torch.randn(5, 64), ValueError, ["(B, T, d_model=64)", "(5, 64)"]),
    (torch.randn(2, 5, 32), ValueError, ["(2, 5, 32)"]),
    (torch.randn(2, 0, 64), ValueError, ["T >= 1", "(2, 0, 64)"]),
    (torch.randn(1, 3, 64, dtype=torch.float64), TypeError, ["torch.float64", "torch.float32", ".to()"]),
    ([[1.0] * 64], ValueError, ["list"]),
])
def test_bad_input_says_what_it_got(x, error, words):
    with pytest.raises(error) as e:
        mha.CausalMHA(64, 8, 2)(x)
    one_sentence(e, words)


def test_weights_from_the_fused_path_are_refused():
    with pytest.raises(ValueError) as e:
        mha.CausalMHA(64, 8, 2)(torch.randn(1, 3, 64), need_weights=True, fused=True)
    one_sentence(e, ["need_weights=True", "fused"])


@pytest.mark.parametrize("ref, error, words", [
    (nn.Linear(4, 4), TypeError, ["nn.MultiheadAttention", "Linear"]),
    (nn.MultiheadAttention(64, 4, dropout=0.1, batch_first=True), ValueError, ["dropout=0.0", "0.1"]),
    (nn.MultiheadAttention(64, 4), ValueError, ["batch_first=True"]),
    (nn.MultiheadAttention(64, 4, kdim=32, batch_first=True), ValueError, ["kdim"]),
])
def test_from_torch_refuses_what_it_cannot_copy(ref, error, words):
    with pytest.raises(error) as e:
        mha.from_torch(ref)
    one_sentence(e, words)


def test_dropout_in_eval_mode_is_accepted_and_exact():
    evaluated = torch_mha(64, 4)
    evaluated.dropout = 0.1                                # dropout does nothing in eval mode
    evaluated.eval()
    x = torch.randn(1, 5, 64)
    assert mha.max_diff_vs_torch(mha.from_torch(evaluated), x, evaluated)[0] == 0.0


def test_the_stacking_figure_shows_each_heads_weights_in_the_row_it_labels():
    """figures/stacking.png: a block's row labelled q{i}t{t} holds the numbers of the textbook's panel for query
    head i, row t, and the masked cells are exactly the future keys; stacked in another order, it fails."""
    fig = mha.plot_stacking()
    axes = fig.axes
    assert len(axes) == 6                                  # 4 textbook panels (h = 4), then 2 blocks (kv = 2)

    def cells(ax):                                         # {(row label, column): the cell's text}
        rows = [t.get_text() for t in ax.get_yticklabels()]
        return {(rows[round(t.get_position()[1])], round(t.get_position()[0])): t.get_text() for t in ax.texts}

    textbook = {}
    for ax in axes[:4]:
        textbook.update(cells(ax))
    stacked = {}
    for ax in axes[4:]:
        stacked.update(cells(ax))
    assert stacked == textbook and len(stacked) == 4 * 3 * 3
    for (row, key), text in stacked.items():
        t = int(row.split("t")[1])
        assert (text == "masked") == (key > t), (row, key, text)
    assert len({text for text in stacked.values()}) > 6    # real weights, not one repeated number
