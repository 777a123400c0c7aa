"""The KV cache: its size by formula and in memory, cached decoding, and sharing K/V without copies."""

import subprocess
import sys
import time

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import mha


def module(h, kv, dtype=torch.float32, d=128, seed=0):
    torch.manual_seed(seed)
    return mha.random_biases(mha.CausalMHA(d, h, kv).to(dtype).eval(), seed + 1)


# ----------------------------------------------------------------------------- sizes
def test_kv_cache_bytes_known_answers():
    assert mha.kv_cache_bytes(32, 32, 128, 4096) == 2147483648            # Llama-7B MHA: 2.15 GB, 2.00 GiB
    assert mha.kv_cache_bytes(80, 8, 128, 4096) == 1342177280             # Llama-2-70B, GQA-8
    assert mha.kv_cache_bytes(80, 64, 128, 4096) == 10737418240           # ... if it had 64 K/V heads
    assert mha.kv_cache_bytes(80, 1, 128, 4096) == 167772160              # ... as MQA: 0.17 GB
    assert mha.kv_cache_bytes(32, 8, 128, 4096, batch=3, bytes_per_elem=4) == 3 * 2 * 536870912


def test_llama7b_table_numbers():
    shrink = {kv: mha.kv_cache_bytes(32, 32, 128, 4096) / mha.kv_cache_bytes(32, kv, 128, 4096) for kv in (8, 4, 1)}
    assert shrink == {8: 4, 4: 8, 1: 32}
    assert [round(mha.gb(mha.kv_cache_bytes(32, kv, 128, 4096)), 2) for kv in (32, 8, 4, 1)] == [2.15, 0.54, 0.27, 0.07]


def test_published_models_table():
    rows = {r[0]: r for r in mha.published_rows()}
    assert rows["Llama-2-7B"][5] == 2147483648 and rows["Llama-2-7B"][6] == 18
    assert rows["Llama-2-70B"][5] == 1342177280 and rows["Llama-2-70B"][6] == 29
    assert round(mha.gb(rows["Llama-2-70B if MHA"][5]), 1) == 10.7
    assert round(mha.gb(rows["Llama-2-70B if MQA"][5]), 2) == 0.17
    assert rows["Llama-3-8B"][5] == rows["Mistral-7B"][5] == 536870912
    assert rows["Falcon-7B"][1:5] == (32, 71, 1, 64) and rows["Falcon-7B"][5] == 33554432
    assert rows["Falcon-40B"][5] == 2 * 60 * 8 * 64 * 4096 * 2
    assert rows["Gemma-2B"][5] == 2 * 18 * 1 * 256 * 4096 * 2
    for name, layers, h, kv, dh, n, fit in rows.values():
        assert fit == int(40e9 // n) and fit * n <= 40e9 < (fit + 1) * n, name


@pytest.mark.parametrize("kv", [8, 4, 1])
def test_new_cache_shape_dtype_and_bytes(kv):
    attn = module(8, kv, torch.float64)
    cache = attn.new_cache(batch=3, max_len=50)
    assert cache.k.shape == cache.v.shape == (3, kv, 50, 16)
    assert cache.k.dtype == torch.float64 and cache.length == 0
    assert cache.nbytes == mha.kv_cache_bytes(1, kv, 16, 50, batch=3, bytes_per_elem=8)


# ----------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("kv", [8, 2, 1])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("chunks", [[7, 1, 1, 1, 1, 1], [1] * 12, [3, 4, 1, 4], [12]])
def test_cached_decoding_matches_full_forward(kv, dtype, tol, chunks):
    attn = module(8, kv, dtype)
    x = torch.randn(2, sum(chunks), 128, dtype=dtype)
    cache = attn.new_cache(2, 20)
    outs, t = [], 0
    with torch.no_grad():
        full = attn(x)
        for n in chunks:
            outs.append(attn(x[:, t:t + n], cache=cache))
            t += n
    assert cache.length == sum(chunks)
    diff = (torch.cat(outs, dim=1) - full).abs().max().item()
    assert diff <= tol, f"kv={kv} {dtype} chunks {chunks}: max |cached - full| = {diff:.3e}"


def test_cached_weights_cover_the_cache_causally():
    attn = module(8, 2)
    cache = attn.new_cache(1, 10)
    with torch.no_grad():
        attn(torch.randn(1, 4, 128), cache=cache)
        _, p = attn(torch.randn(1, 3, 128), cache=cache, need_weights=True)
    assert p.shape == (1, 8, 3, 7)
    assert p[0, :, 0, 5:].abs().max() == 0 and p[0, :, 1, 6:].abs().max() == 0   # token 4 sees 0..4
    assert p[0, :, 2].min() > 0                                                     # token 6 sees 0..6


def test_rewinding_the_cache_repeats_the_step():
    attn = module(8, 1)
    cache = attn.new_cache(1, 10)
    x = torch.randn(1, 6, 128)
    with torch.no_grad():
        attn(x[:, :5], cache=cache)
        first = attn(x[:, 5:], cache=cache)
        cache.length = 5
        again = attn(x[:, 5:], cache=cache)
    assert torch.equal(first, again) and cache.length == 6


def test_overflow_is_refused_and_leaves_the_cache_as_it_was():
    attn = module(8, 2)
    cache = attn.new_cache(2, 8)
    with torch.no_grad():
        attn(torch.randn(2, 6, 128), cache=cache)
    k, v = cache.k.clone(), cache.v.clone()
    with torch.no_grad(), pytest.raises(ValueError) as e:
        attn(torch.randn(2, 3, 128), cache=cache)
    assert "6" in str(e.value) and "8" in str(e.value) and "3" in str(e.value)
    assert cache.length == 6 and torch.equal(cache.k, k) and torch.equal(cache.v, v)


@torch.no_grad()
def test_cache_of_another_shape_is_refused():
    attn = module(8, 2)
    with pytest.raises(ValueError, match="cache"):
        attn(torch.randn(3, 1, 128), cache=attn.new_cache(2, 8))          # batch 3 into a batch-2 cache
    with pytest.raises(ValueError, match="cache"):
        attn(torch.randn(2, 1, 128), cache=module(8, 4).new_cache(2, 8))  # 4 K/V heads, module has 2
    with pytest.raises(ValueError, match="float64"):
        attn(torch.randn(2, 1, 128), cache=module(8, 2, torch.float64).new_cache(2, 8))
    with pytest.raises(ValueError, match="max_len"):
        attn.new_cache(1, 0)
    cache = attn.new_cache(2, 8)
    cache.length = -1                                                  # rewound too far
    with pytest.raises(ValueError, match="holds -1 of at most 8"):
        attn(torch.randn(2, 1, 128), cache=cache)


# ----------------------------------------------------------------------------- no copies of K/V
def largest_allocation(fn):
    """Bytes of the largest single allocation made while fn() runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(e.self_cpu_memory_usage for e in prof.events())


def decode_step_allocation(kv, S, h=16, dh=64):
    """Largest allocation of one decode step at S cached tokens, and the bytes of that cache's K."""
    attn = mha.CausalMHA(h * dh, h, kv).eval()
    cache = attn.new_cache(1, S)
    cache.length = S - 1
    x = torch.randn(1, 1, h * dh)
    with torch.no_grad():
        return largest_allocation(lambda: attn(x, cache=cache)), cache.k.nbytes


@pytest.mark.parametrize("kv", [2, 1])
def test_decode_step_allocates_nothing_that_grows_with_the_cache(kv):
    short, _ = decode_step_allocation(kv, 1024)
    step, own_k = decode_step_allocation(kv, 4096)
    repeated = own_k * 16 // kv                      # K copied out to all 16 query heads
    assert step == short, f"a decode step's largest allocation grew with the cache: {short} -> {step} bytes"
    assert step < own_k / 8, f"a decode step allocated {step} bytes; the cache's own K is {own_k}"
    assert repeated >= 16 * step


def test_the_copying_counter_example_is_seen_by_the_profiler():
    """The check above can fail: repeat_interleave's copy shows up as an allocation of the repeated size."""
    h, kv, S, dh = 16, 1, 4096, 64
    q, k, v = torch.randn(1, h, 1, dh), torch.randn(1, kv, S, dh), torch.randn(1, kv, S, dh)
    repeated = h * S * dh * 4
    assert largest_allocation(lambda: mha.attend_by_copying(q, k, v)) >= repeated
    assert largest_allocation(lambda: mha.attend(q, k, v)) < repeated / 64


# ----------------------------------------------------------------------------- accuracy at any scale
def float64_twin(attn):
    twin = mha.CausalMHA(attn.d_model, attn.n_heads, attn.n_kv_heads).eval()
    twin.load_state_dict(attn.state_dict())
    return twin.double()


@pytest.mark.parametrize("kv", [8, 2, 1])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 10.0, 100.0])
def test_cached_decoding_is_as_accurate_as_the_full_forward_at_any_scale(kv, scale):
    """Relative to the output's size, cached and full agree within 1e-5 for inputs up to 10x unit scale;
    at any scale the cached result is no farther from a float64 reference than the full forward."""
    attn = module(8, kv, seed=3)
    x = scale * torch.randn(2, 12, 128)
    cache = attn.new_cache(2, 12)
    with torch.no_grad():
        full = attn(x)
        cached = torch.cat([attn(x[:, :7], cache=cache)] + [attn(x[:, t:t + 1], cache=cache) for t in range(7, 12)], 1)
        exact = float64_twin(attn)(x.double())
    if scale <= 10:
        assert mha.relative_diff(cached, full) <= 1e-5
    full_err, cached_err = mha.relative_diff(full.double(), exact), mha.relative_diff(cached.double(), exact)
    assert cached_err <= 2 * full_err + 1e-6, f"scale {scale}: cached {cached_err:.2e}, full {full_err:.2e}"


def test_relative_diff_known_answer():
    assert mha.relative_diff(torch.tensor([1.0, 21.0], dtype=torch.float64),
                             torch.tensor([2.0, 20.0], dtype=torch.float64)) == 0.05


# ----------------------------------------------------------------------------- caches a user can get wrong
def filled(attn, n=4, B=1):
    cache = attn.new_cache(B, 10)
    with torch.no_grad():
        attn(torch.randn(B, n, 128), cache=cache)
    return cache


def refused_without_a_write(attn, cache, error, words, x=None, grad=False):
    """The call raises `error` with every word, in one line, and leaves the cache's tensors untouched."""
    k, v, length = cache.k.clone(), cache.v.clone(), cache.length
    x = torch.randn(cache.k.shape[0], 1, 128) if x is None else x
    with torch.set_grad_enabled(grad), pytest.raises(error) as e:
        attn(x, cache=cache)
    for w in words:
        assert w in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v) and cache.length == length
    return str(e.value)


def test_a_cached_call_under_autograd_is_refused():
    attn = module(8, 2)
    cache = filled(attn)
    msg = refused_without_a_write(attn, cache, RuntimeError, ["torch.no_grad()", "torch.inference_mode()"],
                                  grad=True)
    assert "in place" in msg and not cache.k.requires_grad
    x = torch.randn(1, 1, 128, requires_grad=True)                  # frozen weights, but x asks for grads
    attn.requires_grad_(False)
    refused_without_a_write(attn, cache, RuntimeError, ["torch.no_grad()"], x=x, grad=True)
    with torch.inference_mode():
        assert attn(torch.randn(1, 1, 128), cache=cache).shape == (1, 1, 128)


def test_a_trainable_bias_alone_is_enough_to_refuse_a_cached_call_under_autograd():
    """The weights frozen but a bias trainable: backward() would fail on the in-place write later."""
    attn = module(8, 2)
    cache = filled(attn)
    attn.requires_grad_(False)
    attn.in_proj.bias.requires_grad_(True)
    refused_without_a_write(attn, cache, RuntimeError, ["torch.no_grad()"], grad=True)
    attn.in_proj.bias.requires_grad_(False)
    attn.out_proj.bias.requires_grad_(True)
    refused_without_a_write(attn, cache, RuntimeError, ["torch.no_grad()"], grad=True)


def test_training_without_a_cache_still_works():
    attn = module(8, 2).train()
    attn(torch.randn(2, 5, 128)).square().mean().backward()
    assert attn.in_proj.weight.grad.abs().max() > 0


@pytest.mark.parametrize("length, words", [(5.0, ["cache.length", "whole number", "5.0"]),
                                           (None, ["cache.length", "None"]),
                                           ("5", ["cache.length", "'5'"]),
                                           (True, ["cache.length", "True"])])
def test_a_cache_length_that_is_not_a_whole_number_is_refused(length, words):
    attn = module(8, 2)
    cache = filled(attn)
    k, v = cache.k.clone(), cache.v.clone()
    cache.length = length
    with torch.no_grad(), pytest.raises(TypeError) as e:
        attn(torch.randn(1, 1, 128), cache=cache)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v)


def test_a_numpy_length_is_a_whole_number():
    np = pytest.importorskip("numpy")
    attn = module(8, 2)
    cache = filled(attn)
    cache.length = np.int64(4)
    with torch.no_grad():
        attn(torch.randn(1, 1, 128), cache=cache)
    assert cache.length == 5 and type(cache.length) is int


def test_a_hand_built_cache_with_a_wrong_v_is_refused_before_k_is_written():
    attn = module(8, 2)
    k = torch.zeros(1, 2, 10, 16)
    refused_without_a_write(attn, mha.KVCache(k, torch.zeros(1, 2, 10, 16, dtype=torch.float64)), ValueError,
                            ["V", "float64", "float32"])
    refused_without_a_write(attn, mha.KVCache(k, torch.zeros(1, 2, 10, 8)), ValueError, ["V", "(1, 2, 10, 8)"])
    refused_without_a_write(attn, mha.KVCache(k, torch.zeros(1, 2, 12, 16)), ValueError, ["V", "(1, 2, 12, 16)",
                                                                                     "(1, 2, 10, 16)"])
    with torch.no_grad(), pytest.raises(TypeError, match="the cache's V must be a tensor, got list"):
        attn(torch.randn(1, 1, 128), cache=mha.KVCache(k, [0.0]))
    assert k.abs().max() == 0


@pytest.mark.parametrize("make", [lambda buf: (buf, buf), lambda buf: (buf, buf[:, :, :]),
                                  lambda buf: (buf[:, :, :6], buf[:, :, 4:])])
def test_k_and_v_sharing_memory_are_refused(make):
    attn = module(8, 2)
    k, v = make(torch.zeros(1, 2, 10, 16))
    refused_without_a_write(attn, mha.KVCache(k, v), ValueError, ["share memory"])


def test_k_and_v_in_one_buffer_side_by_side_are_fine():
    """One allocation holding K and V apart, as a server might preallocate them, is not sharing."""
    attn = module(8, 2)
    buf = torch.zeros(2, 1, 2, 10, 16)
    cache = mha.KVCache(buf[0], buf[1])
    x = torch.randn(1, 3, 128)
    with torch.no_grad():
        assert mha.relative_diff(attn(x, cache=cache), attn(x)) <= 1e-6   # another layout: a tolerance
    assert not mha.shares_memory(buf[0], buf[1]) and mha.shares_memory(buf[0], buf[0, :, :1])


@pytest.mark.parametrize("packed", ["interleaved", "halves"])
def test_k_and_v_interleaved_in_one_buffer_are_fine(packed):
    """K and V as disjoint views of one packed buffer, whose address ranges meet: not sharing, and exact."""
    attn = module(8, 2)
    if packed == "interleaved":                           # (B, max_len, 2, kv, dh): K and V of a token side by side
        buf = torch.zeros(1, 10, 2, 2, 16)
        k, v = buf[:, :, 0].transpose(1, 2), buf[:, :, 1].transpose(1, 2)   # (B, kv, max_len, dh) each
    else:                                                 # (B, kv, max_len, 2 dh): K in the first half of each row
        buf = torch.zeros(1, 2, 10, 32)
        k, v = buf[..., :16], buf[..., 16:]
    assert mha.byte_range(k)[1] > mha.byte_range(v)[0]   # the ranges meet, so only the elements can tell
    assert not mha.shares_memory(k, v)
    x = torch.randn(1, 4, 128)
    cache = mha.KVCache(k, v)
    with torch.no_grad():
        steps = torch.cat([attn(x[:, :3], cache=cache), attn(x[:, 3:], cache=cache)], dim=1)
        assert mha.relative_diff(steps, attn(x)) <= 1e-6
    assert buf.count_nonzero() == 2 * 4 * 2 * 16          # every written number landed in its own place


def test_shares_memory_element_by_element():
    buf = torch.arange(24.0)
    assert mha.shares_memory(buf[0:12:2], buf[4:20:2])      # even elements of both: 4, 6, 8, 10 meet
    assert not mha.shares_memory(buf[0:12:2], buf[1:13:2])  # even and odd: ranges meet, elements do not
    assert mha.shares_memory(torch.zeros(3, 1).expand(3, 4))         # stride 0: four positions, one number
    assert not mha.shares_memory(torch.zeros(3, 4).t())
    assert mha.shares_memory(buf.as_strided((3, 4), (2, 1)))        # rows of 4 starting every 2: they meet
    assert not mha.shares_memory(buf.as_strided((3, 4), (8, 2)))


@pytest.mark.parametrize("which", ["K", "V"])
def test_a_cache_with_a_stride_of_0_is_refused_before_anything_is_written(which):
    """V expanded from one token would be refused by PyTorch only after K was written."""
    attn = module(8, 2)
    shared = torch.zeros(1, 2, 1, 16).expand(1, 2, 10, 16)
    k, v = (shared, torch.zeros(1, 2, 10, 16)) if which == "K" else (torch.zeros(1, 2, 10, 16), shared)
    refused_without_a_write(attn, mha.KVCache(k, v), ValueError, [f"the cache's {which}", "share memory"])


@pytest.mark.parametrize("cache, words", [("c", ["KVCache", "str"]), ((1, 2), ["KVCache", "tuple"])])
def test_a_cache_that_is_not_a_kvcache_is_refused(cache, words):
    with torch.no_grad(), pytest.raises(TypeError) as e:
        module(8, 2)(torch.randn(1, 1, 128), cache=cache)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_a_cache_made_under_inference_mode_is_refused_elsewhere():
    attn = module(8, 2)
    with torch.inference_mode():
        cache = attn.new_cache(1, 10)
        attn(torch.randn(1, 2, 128), cache=cache)
    with torch.no_grad(), pytest.raises(RuntimeError, match="made under torch.inference_mode()"):
        attn(torch.randn(1, 1, 128), cache=cache)
    assert cache.length == 2
    with torch.inference_mode():
        assert attn(torch.randn(1, 1, 128), cache=cache).shape == (1, 1, 128) and cache.length == 3


def test_need_weights_must_be_a_bool():
    with pytest.raises(TypeError, match="need_weights must be True or False, got 'yes'"):
        module(8, 2)(torch.randn(1, 2, 128), need_weights="yes")


@pytest.mark.parametrize("batch, max_len, error", [(1.5, 10, TypeError), (True, 10, TypeError), ("1", 10, TypeError),
                                                   (1, 10.0, TypeError), (0, 10, ValueError), (1, -1, ValueError)])
def test_new_cache_takes_whole_numbers_only(batch, max_len, error):
    with pytest.raises(error) as e:
        module(8, 2).new_cache(batch, max_len)
    assert repr(batch) in str(e.value) or repr(max_len) in str(e.value) or "max_len" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_cache_or_a_module_larger_than_memory_is_refused_in_one_sentence():
    with pytest.raises(ValueError, match=r"a cache of batch=1000, max_len=1000000000 needs [\d,]+ GB, more than"):
        module(8, 2).new_cache(1000, 10**9)
    with pytest.raises(ValueError, match=r"d_model=10000000 needs [\d,]+ GB of weights, more than"):
        mha.CausalMHA(10**7, 8)


def test_numpy_integers_are_whole_numbers():
    np = pytest.importorskip("numpy")
    attn = mha.CausalMHA(np.int64(64), np.int32(8), np.int16(2))
    assert (attn.d_model, attn.n_heads, attn.n_kv_heads) == (64, 8, 2) and type(attn.d_model) is int
    assert attn.new_cache(np.int64(2), np.int64(5)).k.shape == (2, 2, 5, 8)


# ----------------------------------------------------------------------------- the roofline
def test_decode_flops_and_bytes_known_answers():
    assert mha.decode_flops(32, 128, 4096) == 4 * 32 * 4096 * 128 == 67108864
    assert mha.decode_bytes(32, 128, 4096) == 2 * 32 * 4096 * 128 * 4 == 134217728
    assert mha.decode_bytes(1, 128, 4096, bytes_per_elem=2) == 2 * 4096 * 128 * 2
    for kv in (32, 8, 4, 1):            # g / 2 FLOPs per byte in fp32, g in 16 bits
        assert mha.decode_flops(32, 128, 1000) / mha.decode_bytes(kv, 128, 1000) == 32 / kv / 2
        assert mha.decode_flops(32, 128, 1000) / mha.decode_bytes(kv, 128, 1000, bytes_per_elem=2) == 32 / kv


def test_roofline_picks_the_slower_ceiling_on_either_side_of_the_ridge():
    ceilings = mha.Ceilings(bandwidth=40e9, flops=160e9)
    assert ceilings.ridge == 4.0
    assert mha.roofline(2e9, 1e9, ceilings) == (1e9 / 40e9, "memory")       # 2 FLOPs a byte: below the ridge
    assert mha.roofline(8e9, 1e9, ceilings) == (8e9 / 160e9, "compute")     # 8 FLOPs a byte: above it
    floor, bound = mha.roofline(4e9, 1e9, ceilings)                          # at the ridge both are equal
    assert floor == 0.025 and bound == "memory"
    timing = fake_timing(ceilings, (4096,))
    assert timing.floor(32, 4096)[1] == "memory"                               # MHA: 0.5 FLOPs a byte
    assert timing.floor(1, 4096)[1] == "compute"                               # MQA: 16


def fake_timing(ceilings, contexts=mha.DECODE_CONTEXTS, slower=1.5, kv_heads=(32, 8, 4, 1)):
    """A DecodeTiming as a quiet machine with these ceilings would measure it: every read at `bandwidth`,
    every step `slower` x above its roofline floor."""
    reads = {kv: [mha.decode_bytes(kv, 128, S) / ceilings.bandwidth for S in contexts] for kv in kv_heads}
    timing = mha.DecodeTiming(tuple(contexts), steps={}, reads=reads, flops=ceilings.flops, rounds=5)
    timing.steps = {kv: [slower * timing.floor(kv, S)[0] for S in contexts] for kv in kv_heads}
    return timing


def test_a_step_has_the_ceilings_of_its_own_bytes():
    timing = fake_timing(mha.Ceilings(40e9, 160e9), (512, 8192))
    timing.reads[1][0] /= 4                               # MQA's 512-token K and V read 4x faster: in cache
    assert timing.ceilings(1, 512) == mha.Ceilings(160e9, 160e9)
    assert timing.ceilings(32, 512) == timing.ceilings(1, 8192) == timing.memory() == mha.Ceilings(40e9, 160e9)
    assert timing.floor(32, 8192) == mha.roofline(mha.decode_flops(32, 128, 8192), mha.decode_bytes(32, 128, 8192),
                                                  mha.Ceilings(40e9, 160e9))


def test_timing_contradictions_on_a_quiet_and_a_busy_machine():
    contexts = (512, 1024, 8192)
    timing = fake_timing(mha.Ceilings(40e9, 160e9), contexts)
    assert mha.timing_contradictions(timing) == []
    timing.steps[32][2] *= 0.5                            # MHA at 8192 tokens: 25% under its floor
    timing.steps[1][1] *= 20                              # MQA at 1024 tokens: slower than GQA-4
    assert mha.timing_contradictions(timing) == [
        "MHA at 8192 tokens is 25% below its floor", "MQA is slower than GQA-4 at 1024 tokens"]
    timing = fake_timing(mha.Ceilings(40e9, 160e9), contexts)
    timing.steps[1][0] *= 20                              # at 512 tokens the order is not checked
    assert mha.timing_contradictions(timing) == []
    at_floor = fake_timing(mha.Ceilings(40e9, 160e9), contexts, slower=1.0)
    assert mha.timing_contradictions(at_floor) == []
    at_floor.reads[32][0] *= 2                            # MHA's 512-token read was timed while something else ran
    assert mha.timing_contradictions(at_floor) == ["MHA at 512 tokens is 50% below its floor"]
    at_floor.reads[32][0] /= 2
    at_floor.elsewhere = 0.9                              # another program held most of a core throughout
    assert mha.timing_contradictions(at_floor) == ["other programs kept 0.9 cores busy"]


def test_printed_floors_are_the_roofline(capsys):
    """Every floor in the printed table is max(bytes / read, FLOPs / matmul), never more."""
    timing = fake_timing(mha.Ceilings(40e9, 120e9), slower=2.0)    # ridge 3: GQA-4 (4 FLOPs a byte) above it
    mha.print_decode_table(timing, [])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()
            if line.split()[:1] in (["MHA"], ["GQA-8"], ["GQA-4"], ["MQA"]) and len(line.split()) == 8]
    assert [r[0] for r in rows] == ["MHA", "GQA-8", "GQA-4", "MQA"]
    for kind, per_byte, bound, memory_ms, compute_ms, floor_ms, measured_ms, reach in rows:
        assert float(floor_ms) == max(float(memory_ms), float(compute_ms))
        assert bound == ("memory" if float(memory_ms) >= float(compute_ms) else "compute") and reach == "50%"
    assert [r[2] for r in rows] == ["memory", "memory", "compute", "compute"]
    assert "Memory-bound here: MHA, GQA-8; compute-bound: GQA-4, MQA." in out and "NOT TRUSTWORTHY" not in out
    assert "fp32), best of 5" in out and "the ridge is at 3.0 FLOPs per byte" in out
    assert max(len(line) for line in out.splitlines()) <= 100


def test_the_fastest_read_is_named_as_the_cache(capsys):
    timing = fake_timing(mha.Ceilings(40e9, 120e9), slower=2.0)
    timing.reads[4][1] /= 3                               # GQA-4 at 512 tokens: 120 GB/s, from the caches
    mha.print_decode_table(timing, [])
    out = capsys.readouterr().out
    assert "40.0 GB/s for MHA's 268 MB at 8192 tokens (from memory)" in out
    assert "up to 120 GB/s for GQA-4's 2.1 MB at 512 tokens (in the CPU caches)" in out
    timing.reads[4][1] *= 3                               # no faster than memory after all
    mha.print_decode_table(timing, [])
    assert "no smaller K and V read faster" in capsys.readouterr().out


def test_a_busy_machine_is_said_and_drawn(capsys):
    timing = fake_timing(mha.Ceilings(40e9, 160e9))
    timing.steps[1] = [t * 30 for t in timing.steps[1]]
    problems = mha.timing_contradictions(timing)
    mha.print_decode_table(timing, problems)
    out = capsys.readouterr().out
    assert "NOT TRUSTWORTHY, the machine was busy while timing: MQA is slower than GQA-4" in out
    assert "Memory-bound here" not in out
    fig = mha.plot_decode_time(timing, problems)
    assert any("NOT TRUSTWORTHY" in t.get_text() for t in fig.texts)


def test_the_decode_figure_builds_from_a_fake_measurement():
    """Three panels: time against context with the floors, read rate against bytes, the roofline with four dots."""
    timing = fake_timing(mha.Ceilings(40e9, 160e9))
    timing.reads[1][0] /= 2                               # MQA at 256 tokens: read at 80 GB/s
    fig = mha.plot_decode_time(timing, [])
    left, middle, right = fig.axes
    assert len(left.lines) == 8 and not any("NOT TRUSTWORTHY" in t.get_text() for t in fig.texts)
    assert [list(line.get_ydata()) for line in middle.lines][3][:2] == [80.0, 40.0]
    dots = [line for line in right.lines if line.get_marker() == "o"]
    assert [d.get_xdata()[0] for d in dots] == [0.5, 2.0, 4.0, 16.0]
    for d, kv in zip(dots, (32, 8, 4, 1)):       # each dot at its measured GFLOP/s: floor's rate / 1.5
        floor = timing.floor(kv, 8192)[0]
        assert d.get_ydata()[0] == pytest.approx(mha.decode_flops(32, 128, 8192) / (1.5 * floor) / 1e9)
    labels = " ".join(right.get_legend_handles_labels()[1])
    assert "H100" in labels and "from the CPU caches: up to 80 GB/s" in labels
    assert mha.png_bytes(fig)[:8] == b"\x89PNG\r\n\x1a\n"


def test_measure_decode_on_tiny_contexts():
    """The measurement runs, sorts its contexts and returns one time and one read per context."""
    timing = mha.measure_decode(contexts=(32, 16, 32), kv_heads=(32, 1), rounds=2)
    assert timing.contexts == (16, 32) and timing.rounds == 2 and timing.elsewhere >= 0.0
    for table in (timing.steps, timing.reads):
        assert list(table) == [32, 1] and all(len(row) == 2 and min(row) > 0 for row in table.values())
    assert 1e8 < timing.memory().bandwidth < 1e13 and 1e8 < timing.flops < 1e14


@pytest.mark.parametrize("n, label", [(512, "512"), (1024, "1k"), (8192, "8k"), (1000, "1,000"), (2000, "2,000"),
                                      (5000, "5,000"), (10000, "10,000"), (3072, "3k")])
def test_tokens_label(n, label):
    assert mha.tokens_label(n) == label


def test_a_busy_machine_is_caught_by_the_real_measurement():
    """Another core kept busy by a spinning process while the decode steps are timed: the run says so.

    The best of several rounds hides a moment of load, but not a program that spins throughout (measured:
    with one, the rounds agree with each other and no step beats its floor), so that is measured directly.
    """
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)                                   # let it start spinning
        timing = mha.measure_decode(contexts=(256, 1024, 2048), rounds=5)
    finally:
        spinner.kill()
        spinner.wait()
    if mha.cpu_seconds() is None:
        pytest.skip("no /proc/stat here: what other programs use cannot be measured")
    assert timing.elsewhere > 0.5, timing.elsewhere
    assert mha.timing_contradictions(timing)[0] == f"other programs kept {timing.elsewhere:.1f} cores busy"


def test_cores_elsewhere_is_the_machine_s_busy_time_less_this_process_s(monkeypatch):
    """(wall, machine busy, own) from 0, 10, 2 to 2, 13, 3: others used 3 - 1 = 2 CPU seconds in 2 s, one core."""
    monkeypatch.setattr(mha, "cpu_seconds", lambda: (2.0, 13.0, 3.0))
    assert mha.cores_elsewhere((0.0, 10.0, 2.0)) == 1.0
    assert mha.cores_elsewhere((0.0, 12.0, 1.0)) == 0.0          # all of it was this process's own
    assert mha.cores_elsewhere(None) == 0.0                       # not measurable: nothing is claimed


def test_cpu_seconds_reads_this_machine():
    first = mha.cpu_seconds()
    if first is None:
        pytest.skip("no /proc/stat here")
    sum(range(10**7))                                             # some CPU time of this process's own
    second = mha.cpu_seconds()
    assert second[0] > first[0] and second[1] >= first[1] and second[2] > first[2]


def test_a_packed_cache_is_checked_once_per_layout_not_once_per_step():
    """K and V side by side in each row of one buffer: the element check runs once, then is remembered."""
    attn = module(8, 2)
    buf = torch.zeros(1, 2, 4096, 32)
    cache = mha.KVCache(buf[..., :16], buf[..., 16:])
    mha.layouts_meet.cache_clear()
    with torch.no_grad():
        for _ in range(3):
            attn(torch.randn(1, 1, 128), cache=cache)
    info = mha.layouts_meet.cache_info()
    assert (info.misses, info.hits) == (1, 2) and cache.length == 3


@pytest.mark.parametrize("case", ["too many tokens", "complex", "sparse K"])
def test_calls_that_would_fail_after_writing_are_refused_before(case):
    attn = module(8, 2)
    cache = attn.new_cache(1, 200_000)
    x, words = torch.randn(1, 150_000, 128), "feed fewer tokens at once"
    if case == "complex":
        attn, cache = attn.to(torch.complex64), attn.to(torch.complex64).new_cache(1, 10)
        x, words = torch.randn(1, 2, 128, dtype=torch.complex64), "real floating-point dtype"
    elif case == "sparse K":
        cache = mha.KVCache(torch.zeros(1, 2, 10, 16).to_sparse(), torch.zeros(1, 2, 10, 16))
        x, words = torch.randn(1, 2, 128), "ordinary dense tensor"
    with torch.no_grad(), pytest.raises((ValueError, TypeError), match=words):
        attn(x, cache=cache)
    assert cache.length == 0
    if case != "sparse K":
        assert not cache.k.any() and not cache.v.any()


def test_an_inference_x_under_autograd_is_one_sentence():
    with torch.inference_mode():
        x = torch.randn(1, 3, 128)
    with pytest.raises(RuntimeError, match="x was made under torch.inference_mode()"):
        module(8, 2)(x)
    with torch.no_grad():
        assert module(8, 2)(x).shape == (1, 3, 128)
