"""The lesson of mha.py: the mask, the formula, the grouped form, the cache, and the module against
PyTorch."""

import numpy as np
import pytest
import torch
from conftest import gqa_module
from torch import nn

import mha

DEMO = (mha.D_MODEL, mha.N_HEADS)
T_DEMO = len(mha.SENTENCE.split())


def torch_mha(d, h, dtype=torch.float32, bias=True, seed=0):
    """nn.MultiheadAttention with its own weight init and random (non-zero) biases, in eval mode."""
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(d, h, bias=bias, batch_first=True, dtype=dtype)
    return mha.random_biases(ref).eval()


# ------------------------------------------------------------------ exact: as PyTorch computes it
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mha_is_bit_identical_to_torch_at_the_demos_shapes(seed, bias, dtype):
    """The claim the tutorial is built on: written out against need_weights=True (output and
    weights), fused against need_weights=False, 0.0 on one sequence at the demo's shapes. CI runs it
    again on other MKL code paths."""
    ref = torch_mha(*DEMO, dtype=dtype, bias=bias, seed=seed)
    x = torch.randn(1, T_DEMO, mha.D_MODEL, dtype=dtype)
    assert mha.differences(mha.from_torch(ref), ref, x) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("kv", [4, 2, 1])
@pytest.mark.parametrize("B, T", [(1, T_DEMO), (2, 1), (3, 23)])
def test_gqa_matches_torch_with_repeated_kv(kv, B, T):
    attn = gqa_module(*DEMO, kv).eval()
    x = torch.randn(B, T, mha.D_MODEL)
    assert max(mha.differences(attn, mha.to_torch(attn), x)) <= mha.TOLERANCE
    x64 = x.double()
    assert max(mha.differences(attn.double(), mha.to_torch(attn.double()), x64)) <= 1e-12


def test_swapped_heads_are_detected_and_swapping_is_its_own_inverse():
    ref = torch_mha(*DEMO)
    x = torch.randn(1, T_DEMO, mha.D_MODEL)
    broken = mha.swap_query_heads(mha.from_torch(ref), 0, 1)
    assert mha.differences(broken, ref, x)[0] > 1e-3
    assert mha.differences(mha.swap_query_heads(broken, 0, 1), ref, x) == [0.0, 0.0, 0.0]


def test_to_torch_inverts_from_torch():
    ref = torch_mha(64, 4)
    back = mha.to_torch(mha.from_torch(ref))
    for name, t in ref.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name


# ------------------------------------------------------------------ the mask, the formula, grouping
@pytest.mark.parametrize("T, S", [(3, 3), (2, 3), (1, 5), (4, 9)])
def test_causal_mask_aligns_new_tokens_bottom_right(T, S):
    mask = mha.causal_mask(T, S)
    for i in range(T):
        for j in range(S):
            assert mask[i, j] == (0.0 if j <= S - T + i else float("-inf")), (i, j)


def test_the_one_head_example_is_the_readmes_by_hand():
    k = torch.tensor([[1., 0.], [0., 1.], [1., 1.]])
    q = torch.tensor([[1., 0.], [1., 0.], [1., 0.]])
    o, p = mha.attend_one_head(q, k, k)
    by_hand = torch.tensor([[1.0, 0, 0], [0.67, 0.33, 0], [0.40, 0.20, 0.40]])
    assert torch.allclose(p, by_hand, atol=0.005)
    assert torch.allclose(o[2], torch.tensor([0.8022, 0.5989]), atol=1e-4)


def test_the_textbook_is_one_head_at_a_time_with_head_i_reading_kv_head_i_over_g():
    q, k, v = torch.randn(2, 8, 5, 16), torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
    o, p = mha.attend_textbook(q, k, v)
    for b in range(2):
        for i in range(8):
            o1, p1 = mha.attend_one_head(q[b, i], k[b, i // 4], v[b, i // 4])
            assert torch.allclose(o[b, i], o1, atol=1e-6) and torch.allclose(p[b, i], p1, atol=1e-6)


@pytest.mark.parametrize("kv", [8, 4, 2, 1])
@pytest.mark.parametrize("T, S", [(12, 12), (1, 9), (3, 9)])
def test_grouped_is_the_textbook_without_the_copies(kv, T, S):
    q, k, v = torch.randn(2, 8, T, 32), torch.randn(2, kv, S, 32), torch.randn(2, kv, S, 32)
    (o, p), (o_book, p_book) = mha.attend_grouped(q, k, v), mha.attend_textbook(q, k, v)
    assert (o - o_book).abs().max() <= mha.TOLERANCE and (p - p_book).abs().max() <= mha.TOLERANCE


# ------------------------------------------------------------------ the cache
@pytest.mark.parametrize("kv", [8, 2, 1])
@pytest.mark.parametrize("chunks", [[6, 2, 1, 1, 1, 1], [1] * 12, [12]])
@pytest.mark.parametrize("fused", [False, True])
def test_cached_decoding_matches_the_full_forward(kv, chunks, fused):
    attn = gqa_module(*DEMO, kv).eval()
    x = torch.randn(2, 12, mha.D_MODEL)
    cache, steps, start = attn.new_cache(2, 12), [], 0
    with torch.no_grad():
        for n in chunks:
            steps.append(attn(x[:, start:start + n], cache=cache, fused=fused))
            start += n
        assert (torch.cat(steps, dim=1) - attn(x)).abs().max() <= mha.TOLERANCE
    assert cache.length == 12


@pytest.mark.parametrize("kv", [8, 4, 1])
def test_a_cache_holds_the_bytes_of_the_formula(kv):
    cache = mha.CausalMHA(*DEMO, kv).new_cache(batch=3, max_len=100)
    assert cache.k.shape == (3, kv, 100, 32) and cache.k.dtype == torch.float32
    want = mha.kv_cache_bytes(1, kv, 32, 100, batch=3, bytes_per_elem=4)
    assert cache.k.nbytes + cache.v.nbytes == want


def test_kv_cache_bytes_of_its_docstring_example():
    assert mha.kv_cache_bytes(32, 32, 128, 4096) == 2_147_483_648    # Llama-7B shape, 16-bit


# ------------------------------------------------------------------ refusals, before any write
@pytest.mark.parametrize("d, h, kv, error, words", [
    (250, 8, 4, ValueError, ["d_model=250", "multiple of n_heads=8"]),
    (256, 8, 3, ValueError, ["n_kv_heads=3", "divide n_heads=8"]),
    (256, 8, 0, ValueError, ["n_kv_heads=0"]),
    (256.0, 8, 4, TypeError, ["d_model", "whole number", "256.0"]),
    (256, 8, "4", TypeError, ["n_kv_heads", "'4'"]),
])
def test_sizes_that_cannot_work_are_refused_in_one_sentence(d, h, kv, error, words):
    with pytest.raises(error) as e:
        mha.CausalMHA(d, h, kv)
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), str(e.value)


def test_numpy_whole_numbers_are_sizes():
    attn = mha.CausalMHA(np.int64(64), np.int32(8), np.int64(2))
    assert attn(torch.randn(1, 3, 64)).shape == (1, 3, 64)


@pytest.mark.parametrize("x, error, words", [
    (torch.randn(2, 5), ValueError, ["(B, T, d_model=256)", "(2, 5)"]),
    (torch.randn(1, 5, 128), ValueError, ["(1, 5, 128)"]),
    (torch.randn(1, 0, 256), ValueError, ["(1, 0, 256)"]),
    (torch.randn(1, 5, 256, dtype=torch.float64), TypeError,
     ["torch.float64", "torch.float32", ".to()"]),
    (torch.empty(1, 5, 256, device="meta"), TypeError, ["on meta", "on cpu"]),
])
def test_a_wrong_x_is_refused_in_one_sentence(x, error, words):
    with pytest.raises(error) as e:
        mha.CausalMHA(*DEMO)(x)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_weights_from_the_fused_call_are_refused():
    with pytest.raises(ValueError, match="fused call returns no weights"):
        mha.CausalMHA(*DEMO)(torch.randn(1, 3, 256), need_weights=True, fused=True)


def refused_without_a_write(attn, cache, x, error, words):
    """The call raises error naming words, and the cache is exactly as it was."""
    k, v, length = cache.k.clone(), cache.v.clone(), cache.length
    with pytest.raises(error) as e:
        attn(x, cache=cache)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v) and cache.length == length


def test_a_cache_that_would_overflow_or_does_not_fit_is_refused_before_it_is_written():
    attn = gqa_module(*DEMO, 2).eval()
    cache = attn.new_cache(2, 8)
    with torch.no_grad():
        attn(torch.randn(2, 6, 256), cache=cache)
        refused_without_a_write(attn, cache, torch.randn(2, 3, 256), ValueError,
                                ["holds 6 of its 8", "3 more"])
        refused_without_a_write(attn, cache, torch.randn(1, 1, 256), ValueError,
                                ["(2, 2, 8, 32)", "(1, 2, 8, 32)"])
        other = gqa_module(*DEMO, 4).eval()
        refused_without_a_write(other, cache, torch.randn(2, 1, 256), ValueError, ["new_cache()"])
        attn(torch.randn(2, 2, 256), cache=cache)           # exactly full is fine
    assert cache.length == 8


def test_a_cache_in_another_dtype_or_on_another_device_is_refused_before_it_is_written():
    attn = gqa_module(*DEMO, 2).eval()
    cache = attn.new_cache(1, 8)
    with torch.no_grad():
        attn(torch.randn(1, 3, 256), cache=cache)
        # The module converted after its cache was made:
        attn.double()
        refused_without_a_write(attn, cache, torch.randn(1, 2, 256, dtype=torch.float64), TypeError,
                                ["torch.float32", "torch.float64", "new_cache()"])
        attn.float()
        # A meta tensor stands in for a GPU:
        elsewhere = mha.KVCache(*torch.zeros(2, 1, 2, 8, 32, device="meta"))
        with pytest.raises(TypeError, match="meta"):
            attn(torch.randn(1, 1, 256), cache=elsewhere)
        assert elsewhere.length == 0
        attn(torch.randn(1, 2, 256), cache=cache)           # the cache goes on where it stood
    assert cache.length == 5


def test_a_cached_call_under_autograd_is_refused_and_training_without_a_cache_works():
    attn = gqa_module(*DEMO, 2)
    cache = attn.new_cache(1, 4)
    refused_without_a_write(attn, cache, torch.randn(1, 1, 256), RuntimeError, ["torch.no_grad()"])
    attn(torch.randn(2, 5, 256)).sum().backward()
    assert attn.in_proj.weight.grad is not None


def test_a_check_line_says_fail_for_any_difference_where_0_is_claimed(capsys):
    assert not mha.report("exact", 6e-8, 0.0) and mha.report("exact", 0.0, 0.0)
    assert not mha.report("rounding", 3e-6, 2e-6) and mha.report("rounding", 1e-6, 2e-6)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[-2] for line in lines] == ["FAIL", "OK", "FAIL", "OK"]
