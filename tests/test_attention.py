"""The module against PyTorch: bit-exact for MHA, within stated tolerances for GQA/MQA."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mha


def torch_mha(d, h, dtype=torch.float32, bias=True, seed=0):
    """nn.MultiheadAttention with its own weight init and random (non-zero) biases."""
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(d, h, bias=bias, batch_first=True, dtype=dtype)
    return mha.random_biases(ref, seed + 1)


def gqa_module(d, h, kv, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return mha.random_biases(mha.CausalMHA(d, h, kv).to(dtype), seed + 1)


# d_head 32 and 64 are powers of two; 48 and 24 are not (sqrt(1/dh) is then inexact in binary).
SHAPES = [(256, 8), (384, 8), (192, 8), (512, 8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("d, h", SHAPES)
@pytest.mark.parametrize("T", [1, 12, 37])
@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_mha_is_bit_identical_to_torch(dtype, d, h, T, train, need_weights, bias):
    ref = torch_mha(d, h, dtype, bias).train(train)
    ours = mha.CausalMHA.from_torch(ref)
    assert ours.training == train and ours.in_proj.weight.dtype == dtype
    assert (ours.in_proj.bias is None) == (not bias)
    x = torch.randn(3, T, d, dtype=dtype)
    y_diff, w_diff = mha.max_diff_vs_torch(ours, x, ref, need_weights=need_weights)
    assert y_diff == 0.0, f"max |ours - nn.MultiheadAttention| = {y_diff:.3e}"
    if need_weights:
        assert w_diff == 0.0, f"max |weights - nn.MultiheadAttention's| = {w_diff:.3e}"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("need_weights", [False, True])
def test_mha_bit_identical_with_one_or_two_threads(threads, dtype, need_weights):
    torch.set_num_threads(threads)
    ref = torch_mha(384, 8, dtype, seed=3)
    x = torch.randn(2, 50, 384, dtype=dtype)
    y_diff, w_diff = mha.max_diff_vs_torch(mha.CausalMHA.from_torch(ref), x, ref, need_weights=need_weights)
    assert y_diff == 0.0 and (w_diff or 0.0) == 0.0, f"{threads} threads: {y_diff:.3e}, {w_diff}"


def test_biases_are_really_random():
    """The exactness tests would miss a misplaced bias if the biases were zero, as PyTorch starts them."""
    ref = torch_mha(64, 4)
    assert ref.in_proj_bias.abs().min() > 0 and ref.out_proj.bias.abs().min() > 0


def test_swapped_heads_fail_the_check():
    ref = torch_mha(256, 8, seed=6)
    broken = mha.swap_query_heads(mha.CausalMHA.from_torch(ref), 0, 1)
    y_diff, _ = mha.max_diff_vs_torch(broken, torch.randn(2, 12, 256), ref)
    assert y_diff > 1e-3, f"swapping two query heads went unnoticed: {y_diff:.3e}"


def test_to_torch_inverts_from_torch():
    ref = torch_mha(128, 4, seed=7)
    back = mha.CausalMHA.from_torch(ref).to_torch()
    for (name, p), (_, q) in zip(ref.named_parameters(), back.named_parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("d, h, kv", [(256, 8, 4), (256, 8, 2), (256, 8, 1), (384, 8, 2), (192, 8, 4)])
@pytest.mark.parametrize("T", [1, 23])
def test_gqa_matches_torch_with_repeated_kv(dtype, tol, d, h, kv, T):
    ours = gqa_module(d, h, kv, dtype)
    x = torch.randn(2, T, d, dtype=dtype)
    y_diff, _ = mha.max_diff_vs_torch(ours, x)
    y2_diff, w_diff = mha.max_diff_vs_torch(ours, x, need_weights=True)
    assert max(y_diff, y2_diff, w_diff) <= tol, f"GQA kv={kv}: {y_diff:.3e} {y2_diff:.3e} {w_diff:.3e}"


@pytest.mark.parametrize("kv", [4, 2, 1])
def test_gqa_matches_sdpa_enable_gqa(kv):
    ours = gqa_module(256, 8, kv)
    diff = mha.max_diff_vs_sdpa(ours, torch.randn(2, 17, 256))
    assert diff <= 2e-6, f"kv={kv}: max |ours - sdpa(enable_gqa=True)| = {diff:.3e}"


def test_query_heads_are_grouped_like_repeat_interleave():
    """Query head i must read K/V head i // g; repeat() instead of repeat_interleave() pairs them wrongly."""
    torch.manual_seed(8)
    B, h, kv, T, dh = 1, 4, 2, 5, 8
    q, k, v = torch.randn(B, h, T, dh), torch.randn(B, kv, T, dh), torch.randn(B, kv, T, dh)
    o, _ = mha.attend(q, k, v)
    right = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    wrong = F.scaled_dot_product_attention(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1), is_causal=True)
    assert (o - right).abs().max() <= 1e-6
    assert (o - wrong).abs().max() > 1e-2


@pytest.mark.parametrize("kv", [8, 2, 1])
def test_causal_future_tokens_do_not_change_the_past(kv):
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
    assert mha.CausalMHA(96, 6).n_kv_heads == 6
    assert attn(torch.randn(4, 7, 96)).shape == (4, 7, 96)


@pytest.mark.parametrize("d, h, kv, words", [
    (100, 8, None, ["d_model=100", "n_heads=8", "multiple"]),
    (64, 0, None, ["n_heads", "at least 1", "0"]),
    (64, -2, 1, ["n_heads", "at least 1", "-2"]),
    (64, 8, 3, ["n_kv_heads=3", "positive divisor", "n_heads=8"]),
    (64, 8, 0, ["n_kv_heads=0", "positive divisor"]),
    (64, 8, 16, ["n_kv_heads=16", "positive divisor"]),
    (64, 8, -4, ["n_kv_heads=-4", "positive divisor"]),
])
def test_bad_configurations_say_what_and_why(d, h, kv, words):
    with pytest.raises(ValueError) as e:
        mha.CausalMHA(d, h, kv)
    for w in words:
        assert w in str(e.value)
    assert "\n" not in str(e.value)


def test_non_integer_heads_are_refused():
    with pytest.raises(TypeError, match="n_kv_heads must be a whole number"):
        mha.CausalMHA(64, 8, 2.0)


@pytest.mark.parametrize("bias", ["no", 0, None, 1.0])
def test_bias_must_be_true_or_false(bias):
    with pytest.raises(TypeError, match=f"bias must be True or False, got {bias!r}"):
        mha.CausalMHA(32, 4, bias=bias)


@pytest.mark.parametrize("shape, words", [
    ((5, 64), ["(B, T, 64)", "(5, 64)"]),
    ((2, 5, 32), ["(B, T, 64)", "(2, 5, 32)"]),
    ((1, 2, 5, 64), ["(1, 2, 5, 64)"]),
    ((2, 0, 64), ["at least one token", "(2, 0, 64)"]),
])
def test_bad_input_shapes_say_what_they_got(shape, words):
    attn = mha.CausalMHA(64, 8, 2)
    with pytest.raises(ValueError) as e:
        attn(torch.randn(shape))
    for w in words:
        assert w in str(e.value)


def test_input_of_another_dtype_is_refused():
    with pytest.raises(ValueError, match="x is torch.float64 but this module computes in torch.float32"):
        mha.CausalMHA(64, 8, 2)(torch.randn(1, 3, 64, dtype=torch.float64))


def test_swap_query_heads_refuses_heads_that_do_not_exist():
    with pytest.raises(ValueError, match="query heads 0 and 9 must both lie in 0 .. 7"):
        mha.swap_query_heads(mha.CausalMHA(64, 8), 0, 9)


def test_from_torch_refuses_what_it_cannot_copy():
    with pytest.raises(TypeError, match="from_torch copies an nn.MultiheadAttention, got Linear"):
        mha.CausalMHA.from_torch(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="dropout=0.0 in training mode"):
        mha.CausalMHA.from_torch(nn.MultiheadAttention(64, 4, dropout=0.1, batch_first=True))
    evaluated = torch_mha(64, 4)
    evaluated.dropout = 0.1                                # dropout does nothing in eval mode: accepted, exact
    evaluated.eval()
    x = torch.randn(2, 5, 64)
    assert mha.max_diff_vs_torch(mha.CausalMHA.from_torch(evaluated), x, evaluated)[0] == 0.0
    with pytest.raises(ValueError, match="batch_first=True"):
        mha.CausalMHA.from_torch(nn.MultiheadAttention(64, 4))


def test_causal_mask_aligns_new_tokens_bottom_right():
    m = mha.causal_mask(2, 4)
    assert m.tolist() == [[0, 0, 0, float("-inf")], [0, 0, 0, 0]]
    assert torch.equal(mha.causal_mask(3, 3), torch.full((3, 3), float("-inf")).triu(1))


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
    out = attn.to_gqa(new_kv, pool=pool)
    assert (out.n_heads, out.n_kv_heads, out.d_head) == (h, new_kv, 16)
    for (name, p), (_, q) in zip(attn.to_torch().named_parameters(), out.to_torch().named_parameters()):
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
        assert mha.relative_diff(attn.to_gqa(2)(x), attn(x)) > 1e-3


def test_to_gqa_mean_and_first_on_a_hand_made_module():
    """4 K/V heads of width 1 with known values, pooled to 2: the mean or the first of each pair."""
    attn = mha.CausalMHA(4, 4, 4)
    with torch.no_grad():
        attn.in_proj.weight.copy_(torch.arange(12.0).unsqueeze(1).expand(12, 4))   # row i is all i
        attn.in_proj.bias.copy_(-torch.arange(12.0))
    mean, first = attn.to_gqa(2), attn.to_gqa(2, pool="first")
    assert mean.in_proj.weight[:, 0].tolist() == [0, 1, 2, 3, 4.5, 6.5, 8.5, 10.5]
    assert first.in_proj.weight[:, 0].tolist() == [0, 1, 2, 3, 4, 6, 8, 10]
    assert mean.in_proj.bias.tolist() == [-0.0, -1, -2, -3, -4.5, -6.5, -8.5, -10.5]
    assert torch.equal(mean.out_proj.weight, attn.out_proj.weight)
    mqa = attn.to_gqa(1)
    assert mqa.in_proj.weight[:, 0].tolist() == [0, 1, 2, 3, 5.5, 9.5]


def test_to_gqa_copies_and_keeps_dtype_mode_and_bias():
    attn = gqa_module(64, 4, 4, torch.float64).train(False)
    out = attn.to_gqa(4)
    assert out is not attn and out.in_proj.weight.dtype == torch.float64 and not out.training
    assert torch.equal(out.in_proj.weight, attn.in_proj.weight)
    out.in_proj.weight.data.zero_()
    assert attn.in_proj.weight.abs().max() > 0                       # a copy, not a view
    no_bias = mha.CausalMHA(64, 4, 2, bias=False).to_gqa(1)
    assert no_bias.in_proj.bias is None and no_bias.n_kv_heads == 1


@pytest.mark.parametrize("kv, pool, error, words", [
    (3, "mean", ValueError, ["n_kv_heads=3", "positive divisor", "4 K/V heads"]),
    (8, "mean", ValueError, ["n_kv_heads=8", "positive divisor"]),
    (0, "mean", ValueError, ["n_kv_heads=0"]),
    (-2, "mean", ValueError, ["n_kv_heads=-2"]),
    (2.0, "mean", TypeError, ["whole number", "2.0"]),
    (2, "max", ValueError, ["'max'", "'mean' or 'first'"]),
])
def test_to_gqa_refuses_in_one_sentence(kv, pool, error, words):
    with pytest.raises(error) as e:
        mha.CausalMHA(64, 8, 4).to_gqa(kv, pool=pool)
    for w in words:
        assert w in str(e.value)
    assert "\n" not in str(e.value)
