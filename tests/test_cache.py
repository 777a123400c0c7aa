"""The KV cache: its size by formula and in memory, cached decoding, and sharing K/V without copies."""

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
    with pytest.raises(ValueError) as e:
        attn(torch.randn(2, 3, 128), cache=cache)
    assert "6" in str(e.value) and "8" in str(e.value) and "3" in str(e.value)
    assert cache.length == 6 and torch.equal(cache.k, k) and torch.equal(cache.v, v)


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
