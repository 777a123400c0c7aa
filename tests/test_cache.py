"""The KV cache: its size by formula and in memory, cached decoding, sharing K/V without copies, the roofline."""

import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, gqa_module, record_calls
from torch.profiler import ProfilerActivity, profile

import mha


def module(h, kv, dtype=torch.float32, d=128, seed=0):
    return gqa_module(d, h, kv, dtype, seed).eval()


# ----------------------------------------------------------------------------- sizes
def test_kv_cache_bytes_known_answers():
    assert mha.kv_cache_bytes(32, 32, 128, 4096) == 2147483648            # Llama-7B MHA: 2.15 GB, 2.00 GiB
    assert mha.kv_cache_bytes(80, 8, 128, 4096) == 1342177280             # Llama-2-70B, GQA-8
    assert mha.kv_cache_bytes(80, 64, 128, 4096) == 10737418240           # ... if it had 64 K/V heads
    assert mha.kv_cache_bytes(80, 1, 128, 4096) == 167772160              # ... as MQA: 0.17 GB
    assert mha.kv_cache_bytes(32, 8, 128, 4096, batch=3, bytes_per_elem=4) == 3 * 2 * 536870912
    assert [mha.llama_cache_bytes(kv) for kv in (32, 8, 4, 1)] == [2147483648 // r for r in (1, 4, 8, 32)]


def test_the_printed_tables(capsys):
    mha.print_cache_tables(4)                              # the demo's g = 2: the 32-head shape's GQA-16
    out = capsys.readouterr().out
    assert "GQA-16           16    1.07 GB      2x   <- g = 2" in out and "no row has" not in out
    assert "MHA's 2,147,483,648 bytes are 2.15 GB but 2.00 GiB" in out
    for row in ["Llama-2-7B               32   32   32  128  MHA        2.15 GB        18",
                "Llama-2-70B              80   64    8  128  GQA-8      1.34 GB        29",
                "Llama-2-70B if MHA       80   64   64  128  MHA       10.74 GB         3",
                "Llama-2-70B if MQA       80   64    1  128  MQA        0.17 GB       238",
                "Falcon-7B                32   71    1   64  MQA        0.03 GB      1192"]:
        assert row in out, row


def test_a_demo_g_that_no_row_has_is_said(monkeypatch, capsys):
    monkeypatch.setattr(mha, "N_HEADS", 6)                 # 6 query heads, 2 K/V heads: g = 3 does not divide 32
    mha.print_cache_tables(2)
    out = capsys.readouterr().out
    assert "(no row has your demo's g = 3: 32 query heads do not split into groups of 3)" in out
    assert "<- g =" not in out


@pytest.mark.parametrize("kv", [8, 4, 1])
def test_new_cache_shape_dtype_and_bytes(kv):
    cache = module(8, kv, torch.float64).new_cache(batch=3, max_len=50)
    assert cache.k.shape == cache.v.shape == (3, kv, 50, 16)
    assert cache.k.dtype == torch.float64 and cache.length == 0
    assert cache.k.nbytes + cache.v.nbytes == mha.kv_cache_bytes(1, kv, 16, 50, batch=3, bytes_per_elem=8)


def test_new_cache_is_made_where_the_weights_are():
    """A module moved to another device gets its cache there ('meta' stands in for a GPU: no memory, no data)."""
    cache = mha.CausalMHA(32, 4, 2).to("meta").new_cache(batch=2, max_len=5)
    assert cache.k.device.type == cache.v.device.type == "meta" and cache.k.shape == (2, 2, 5, 8)


# ----------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("kv", [8, 2, 1])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("chunks", [[7, 1, 1, 1, 1, 1], [1] * 12, [3, 4, 1, 4], [12]])
@pytest.mark.parametrize("fused", [False, True])
def test_cached_decoding_matches_full_forward(kv, dtype, tol, chunks, fused):
    attn = module(8, kv, dtype)
    x = torch.randn(2, sum(chunks), 128, dtype=dtype)
    cache = attn.new_cache(2, 20)
    outs, t = [], 0
    with torch.no_grad():
        full = attn(x)
        for n in chunks:
            outs.append(attn(x[:, t:t + n], cache=cache, fused=fused))
            t += n
    assert cache.length == sum(chunks)
    diff = mha.relative_diff(torch.cat(outs, dim=1), full)
    assert diff <= tol, f"kv={kv} {dtype} chunks {chunks}: max |cached - full| / max |full| = {diff:.3e}"


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
    """By construction: the same step on the same cache contents."""
    attn = module(8, 1)
    cache = attn.new_cache(1, 10)
    x = torch.randn(1, 6, 128)
    with torch.no_grad():
        attn(x[:, :5], cache=cache)
        first = attn(x[:, 5:], cache=cache)
        cache.length = 5
        again = attn(x[:, 5:], cache=cache)
    assert torch.equal(first, again) and cache.length == 6


def float64_twin(attn):
    twin = mha.CausalMHA(attn.d_model, attn.n_heads, attn.n_kv_heads).eval()
    twin.load_state_dict(attn.state_dict())
    return twin.double()


@pytest.mark.parametrize("kv", [8, 2, 1])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 10.0, 100.0])
def test_cached_decoding_is_as_accurate_as_the_full_forward_at_any_scale(kv, scale):
    """Relative to the output's size, cached and full agree within 1e-5 for inputs up to 10x unit scale,
    and there the cached result is no farther from a float64 reference than 2x the full forward's error plus
    1e-6. At 100x the scores reach about 1e4, where float32 rounding alone moves the softmax: both paths sit
    at that limit, and the cached one is held to 10x the full forward's error (measured: 4.7x under
    MKL_CBWR=COMPATIBLE, in the written-out attend)."""
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
    slack = 2 if scale <= 10 else 10
    assert cached_err <= slack * full_err + 1e-6, f"scale {scale}: cached {cached_err:.2e}, full {full_err:.2e}"


def test_relative_diff_known_answer():
    assert mha.relative_diff(torch.tensor([1.0, 21.0], dtype=torch.float64),
                             torch.tensor([2.0, 20.0], dtype=torch.float64)) == 0.05


# ----------------------------------------------------------------------------- no copies of K/V
def largest_allocation(fn):
    """Bytes of the largest single allocation made while fn() runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(e.self_cpu_memory_usage for e in prof.events())


@pytest.mark.parametrize("kv", [2, 1])
@pytest.mark.parametrize("fused", [False, True])
def test_a_decode_step_allocates_no_copy_of_k_or_v(kv, fused):
    """The largest allocation of a step through the module is at most the scores, h x S numbers: never
    K or V (kv x S x dh), let alone K copied out to h heads."""
    h, dh, S = 16, 64, 4096
    attn = mha.CausalMHA(h * dh, h, kv).eval()
    cache = attn.new_cache(1, S)
    cache.length = S - 1
    x = torch.randn(1, 1, h * dh)
    with torch.no_grad():
        step = largest_allocation(lambda: attn(x, cache=cache, fused=fused))
    assert step <= h * S * 4 < cache.k.nbytes, f"a decode step allocated {step} bytes; its K is {cache.k.nbytes}"


def test_the_textbook_s_copies_are_seen_by_the_profiler():
    """The check above can fail: attend_textbook's repeat_interleave shows up as an allocation of K copied out
    to h heads; attend, on the same numbers, allocates no more than its scores."""
    h, kv, S, dh = 16, 1, 4096, 64
    q, k, v = torch.randn(1, h, 1, dh), torch.randn(1, kv, S, dh), torch.randn(1, kv, S, dh)
    repeated = h * S * dh * 4
    assert largest_allocation(lambda: mha.attend_textbook(q, k, v)) >= repeated
    assert largest_allocation(lambda: mha.attend(q, k, v)) <= h * S * 4 < repeated


# ----------------------------------------------------------------------------- caches a user can get wrong
def refused_without_a_write(attn, cache, x, error, words):
    """The call raises error with words in one sentence, and the cache is exactly as it was."""
    k, v, length = cache.k.clone(), cache.v.clone(), cache.length
    with pytest.raises(error) as e:
        attn(x, cache=cache)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert "\n" not in str(e.value)
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v) and cache.length == length


@torch.no_grad()
def test_overflow_is_refused_and_leaves_the_cache_as_it_was():
    attn = module(8, 2)
    cache = attn.new_cache(2, 8)
    attn(torch.randn(2, 6, 128), cache=cache)
    refused_without_a_write(attn, cache, torch.randn(2, 3, 128), ValueError, ["holds 6 of its 8 tokens", "3 more"])
    cache.length = -1                                      # rewound too far
    refused_without_a_write(attn, cache, torch.randn(2, 1, 128), ValueError, ["holds -1"])


@torch.no_grad()
@pytest.mark.parametrize("cache, words", [
    (module(8, 2).new_cache(3, 8), ["(3, 2, 8, 16)", "(2, 2, 8, 16)"]),              # batch 3, x has 2
    (module(8, 4).new_cache(2, 8), ["(2, 4, 8, 16)", "(2, 2, 8, 16)"]),              # 4 K/V heads, module has 2
    (module(8, 2, torch.float64).new_cache(2, 8), ["torch.float64", "new_cache()"]),
])
def test_a_cache_that_does_not_fit_the_call_is_refused(cache, words):
    refused_without_a_write(module(8, 2), cache, torch.randn(2, 1, 128), ValueError, words)


@torch.no_grad()
def test_a_hand_built_cache_with_a_wrong_v_is_refused_before_k_is_written():
    cache = mha.KVCache(torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 8))
    refused_without_a_write(module(8, 2), cache, torch.randn(1, 2, 128), ValueError, ["V as (1, 2, 8, 8)"])


@pytest.mark.parametrize("cache, words", [("c", ["KVCache", "str"]), ((1, 2), ["KVCache", "tuple"])])
def test_a_cache_that_is_not_a_kvcache_is_refused(cache, words):
    with torch.no_grad(), pytest.raises(TypeError) as e:
        module(8, 2)(torch.randn(1, 1, 128), cache=cache)
    assert all(w in str(e.value) for w in words)


def test_a_cached_call_under_autograd_is_refused():
    """The module's weights require grad, as a fresh module's do: the in-place write is refused first."""
    attn = module(8, 2)
    cache = attn.new_cache(1, 8)
    refused_without_a_write(attn, cache, torch.randn(1, 2, 128), RuntimeError, ["torch.no_grad()", "in place"])
    for p in attn.parameters():
        p.requires_grad_(False)
    refused_without_a_write(attn, cache, torch.randn(1, 2, 128, requires_grad=True), RuntimeError, ["autograd"])
    attn(torch.randn(1, 2, 128), cache=cache)              # nothing for autograd to follow: allowed
    assert cache.length == 2


def test_training_without_a_cache_still_works():
    attn = module(8, 2)
    attn(torch.randn(2, 5, 128)).sum().backward()
    assert attn.in_proj.weight.grad is not None


@pytest.mark.parametrize("batch, max_len, error", [(1.5, 10, TypeError), (True, 10, TypeError), ("1", 10, TypeError),
                                                   (0, 10, ValueError), (1, 0, ValueError), (1, -3, ValueError)])
def test_new_cache_takes_whole_numbers_from_1(batch, max_len, error):
    with pytest.raises(error):
        module(8, 2).new_cache(batch, max_len)


# ----------------------------------------------------------------------------- the roofline
def test_decode_flops_and_bytes_known_answers():
    assert mha.decode_flops(32, 128, 4096) == 4 * 32 * 4096 * 128 == 67108864
    assert mha.decode_bytes(32, 128, 4096) == 2 * 32 * 4096 * 128 * 4 == 134217728
    for kv in (32, 8, 4, 1):            # g / 2 FLOPs per byte in fp32, g in 16 bits
        assert mha.decode_flops(32, 128, 1000) / mha.decode_bytes(kv, 128, 1000) == 32 / kv / 2
        assert mha.decode_flops(32, 128, 1000) / mha.decode_bytes(kv, 128, 1000, bytes_per_elem=2) == 32 / kv


def test_roofline_picks_the_slower_ceiling_and_names_the_ridge():
    ceilings = mha.Ceilings(bandwidth=40e9, flops=160e9)
    assert ceilings.ridge == 4.0
    assert mha.roofline(2e9, 1e9, ceilings) == (1e9 / 40e9, "memory")       # 2 FLOPs a byte: below the ridge
    assert mha.roofline(8e9, 1e9, ceilings) == (8e9 / 160e9, "compute")     # 8 FLOPs a byte: above it
    assert mha.roofline(4e9, 1e9, ceilings) == (0.025, "ridge")             # at it
    assert mha.roofline(4.03e9, 1e9, ceilings)[1] == "ridge"                # within 1 %
    assert mha.roofline(4.1e9, 1e9, ceilings)[1] == "compute"               # beyond


def fake_timing(ceilings, contexts=mha.DECODE_CONTEXTS, slower=1.5, kv_heads=(32, 8, 4, 1)):
    """A DecodeTiming as a quiet machine with these ceilings would measure it: every read at `bandwidth`,
    every step `slower` x above its roofline floor."""
    reads = {kv: [mha.decode_bytes(kv, 128, S) / ceilings.bandwidth for S in contexts] for kv in kv_heads}
    timing = mha.DecodeTiming(tuple(contexts), {}, reads, ceilings.flops, rounds=5)
    timing.steps = {kv: [slower * timing.floor(kv, S)[0] for S in contexts] for kv in kv_heads}
    return timing


def test_a_step_has_the_read_ceiling_of_its_own_bytes():
    timing = fake_timing(mha.Ceilings(40e9, 160e9), (512, 8192))
    timing.reads[1][0] /= 4                               # MQA's 512-token K and V read 4x faster: in cache
    assert timing.ceilings(1, 512) == mha.Ceilings(160e9, 160e9)
    assert timing.ceilings(32, 512) == timing.ceilings(1, 8192) == mha.Ceilings(40e9, 160e9)
    assert timing.floor(32, 8192) == mha.roofline(mha.decode_flops(32, 128, 8192), mha.decode_bytes(32, 128, 8192),
                                                  mha.Ceilings(40e9, 160e9))


def test_timing_contradictions_on_a_quiet_and_a_busy_machine():
    contexts = (512, 1024, 8192)
    timing = fake_timing(mha.Ceilings(40e9, 160e9), contexts)
    assert mha.timing_contradictions(timing) == []
    timing.steps[32][2] *= 0.5                            # MHA at 8192 tokens: 25% under its floor
    timing.steps[1][1] *= 20                              # MQA at 1024 tokens: slower than GQA-4
    assert mha.timing_contradictions(timing) == [
        "MQA is slower than GQA-4 at 1024 tokens", "MHA at 8192 tokens is 25% below its floor"]
    timing = fake_timing(mha.Ceilings(40e9, 160e9), contexts)
    timing.steps[1][0] *= 20                              # at 512 tokens the order is not checked
    assert mha.timing_contradictions(timing) == []
    timing.elsewhere = 0.9                                # another program held most of a core throughout
    assert mha.timing_contradictions(timing) == ["other programs kept 0.9 cores busy"]


def test_printed_floors_are_the_roofline(capsys):
    """Every floor in the printed table is max(bytes / read, FLOPs / matmul), and reaches is floor / measured."""
    ceilings = mha.Ceilings(40e9, 120e9)                   # ridge 3: GQA-4 (4 FLOPs a byte) above it
    mha.print_decode_table(fake_timing(ceilings, slower=2.0), [])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["MHA"], ["GQA-8"], ["GQA-4"], ["MQA"])
            and len(line.split()) == 8]
    assert [r[0] for r in rows] == ["MHA", "GQA-8", "GQA-4", "MQA"]
    for kind, per_byte, read, ridge, bound, floor_ms, measured_ms, reach in rows:
        kv = 32 // int(2 * float(per_byte))
        want = mha.roofline(mha.decode_flops(32, 128, 8192), mha.decode_bytes(kv, 128, 8192), ceilings)
        assert float(floor_ms) == pytest.approx(want[0] * 1e3, abs=1e-3) and bound == want[1], kind
        assert read == "40.0" and ridge == "3.0" and reach == "50%"
    assert "NOT TRUSTWORTHY" not in out
    assert "MQA reads 32x fewer bytes than MHA for the same FLOPs and is 6.0x faster" in out   # 13.42 ms / 2.24 ms
    assert max(len(line) for line in out.splitlines()) <= 120


def test_a_busy_machine_is_said_and_drawn(capsys):
    timing = fake_timing(mha.Ceilings(40e9, 160e9))
    timing.steps[1] = [t * 30 for t in timing.steps[1]]
    problems = mha.timing_contradictions(timing)
    mha.print_decode_table(timing, problems)
    out = capsys.readouterr().out
    assert "NOT TRUSTWORTHY, the machine was busy while timing: MQA is slower than GQA-4" in out
    assert "fewer bytes" not in out
    fig = mha.plot_decode_time(timing, problems)
    assert any("NOT TRUSTWORTHY" in t.get_text() for t in fig.texts)


def test_the_decode_figure_builds_from_a_fake_measurement():
    """Two panels: time against context with the floors, and the roofline with four dots."""
    timing = fake_timing(mha.Ceilings(40e9, 160e9))
    fig = mha.plot_decode_time(timing, [])
    left, right = fig.axes
    assert len(left.lines) == 8 and not any("NOT TRUSTWORTHY" in t.get_text() for t in fig.texts)
    for i, kv in enumerate((32, 8, 4, 1)):       # each configuration's times, then its floor, dashed, per context
        measured, floor = left.lines[2 * i], left.lines[2 * i + 1]
        assert list(measured.get_xdata()) == list(floor.get_xdata()) == list(timing.contexts)
        assert list(measured.get_ydata()) == pytest.approx([t * 1e3 for t in timing.steps[kv]])
        assert list(floor.get_ydata()) == pytest.approx([timing.floor(kv, S)[0] * 1e3 for S in timing.contexts])
        assert floor.get_linestyle() == "--"
    dots = [line for line in right.lines if line.get_marker() == "o"]
    assert [d.get_xdata()[0] for d in dots] == [0.5, 2.0, 4.0, 16.0]
    for d, kv in zip(dots, (32, 8, 4, 1)):       # each dot at its measured GFLOP/s: floor's rate / 1.5
        floor = timing.floor(kv, 8192)[0]
        assert d.get_ydata()[0] == pytest.approx(mha.decode_flops(32, 128, 8192) / (1.5 * floor) / 1e9)
    assert "H100" in " ".join(right.get_legend_handles_labels()[1])
    assert mha.png_bytes(fig)[:8] == b"\x89PNG\r\n\x1a\n"


def test_measure_decode_on_tiny_contexts(monkeypatch):
    """The measurement runs, sorts its contexts and returns one step and one read time per context; each step
    and each read gets the K and V of its own configuration and context, not the whole preallocated cache."""
    timed = []                                   # what each timed call got: ("step", K's, V's shape) or ("read", shape)
    record_calls(monkeypatch, mha, "attend", timed, lambda q, k, v: ("step", k.shape, v.shape))
    record_calls(monkeypatch, torch, "sum", timed, lambda t: ("read", t.shape))
    timing = mha.measure_decode(contexts=(32, 16, 32), kv_heads=(32, 1), rounds=2)
    one_round = []
    for S in (32, 16):                           # longest context first; at each, every read, then every step
        one_round += [("read", (2, 1, kv, S, 128)) for kv in (32, 1)]      # K and V: (2, B, kv, S, dh)
        one_round += [("step", (1, kv, S, 128), (1, kv, S, 128)) for kv in (32, 1)]   # K, V: (B, kv, S, dh)
    assert timed == 2 * one_round
    assert timing.contexts == (16, 32) and timing.rounds == 2 and timing.elsewhere >= 0.0
    for table in (timing.steps, timing.reads):
        assert list(table) == [32, 1] and all(len(row) == 2 and min(row) > 0 for row in table.values())
    assert 1e8 < timing.ceilings(32, 32).bandwidth < 1e13 and 1e8 < timing.flops < 1e14


def test_keep_freed_memory_stops_the_page_faults_of_a_steps_megabyte_blocks():
    """A decode step makes, writes and frees 1 MB blocks (scores, weights). Three such blocks, twenty times over,
    straight from glibc's malloc: with glibc as it is each round faults their 768 pages in again (it unmaps or
    trims what was freed); after keep_freed_memory, none. Either of its two settings alone leaves the faults.
    In a fresh process, glibc's own malloc variables cleared (they would set the same thresholds)."""
    import platform
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("keep_freed_memory tunes glibc's malloc only")
    code = """if True:
        import ctypes, resource, mha
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
        mha.keep_freed_memory()
        def step():
            blocks = [libc.malloc(1 << 20) for _ in range(3)]
            for block in blocks:
                ctypes.memset(block, 1, 1 << 20)            # written, as scores are: its pages are real
            for block in blocks:
                libc.free(block)
        step(), step()                                      # the first steps fault their pages in once
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(20):
            step()
        print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 20)"""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("MALLOC_") and name != "GLIBC_TUNABLES"}
    plain, kept = [int(subprocess.run([sys.executable, "-c", c], capture_output=True, text=True, check=True,
                                      cwd=ROOT, env=env).stdout)
                   for c in (code.replace("mha.keep_freed_memory()", "pass"), code)]
    assert plain >= 700 and kept == 0, (plain, kept)      # 3 MB: 768 pages of 4 KiB


def test_a_busy_machine_is_caught_by_the_real_measurement():
    """Another core kept busy by a spinning process while the decode steps are timed: the run says so.
    The best of several rounds hides a moment of load, not a program that spins throughout."""
    if mha.cpu_seconds() is None:
        pytest.skip("no /proc/stat here: what other programs use cannot be measured")
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)                                   # let it start spinning
        timing = mha.measure_decode(contexts=(256, 1024, 2048, 4096), rounds=8)   # about a second
    finally:
        spinner.kill()
        spinner.wait()
    # The spinner shares the 2 cores with the timing's own 2 threads: about 2/3 of a core, less on a busy host (0.49
    # once). The run flags more than 0.25 cores; 1.5 or more would mean this process's own time was counted too.
    assert 0.25 < timing.elsewhere < 1.5, timing.elsewhere
    assert mha.timing_contradictions(timing)[0] == f"other programs kept {timing.elsewhere:.1f} cores busy"


def test_cores_elsewhere_is_the_machine_s_busy_time_less_this_process_s(monkeypatch):
    """(wall, machine busy, own) from 0, 10, 2 to 2, 13, 3: others used 3 - 1 = 2 CPU seconds in 2 s, one core."""
    monkeypatch.setattr(mha, "cpu_seconds", lambda: (2.0, 13.0, 3.0))
    assert mha.cores_elsewhere((0.0, 10.0, 2.0)) == 1.0
    assert mha.cores_elsewhere((0.0, 12.0, 1.0)) == 0.0          # all of it was this process's own
    assert mha.cores_elsewhere(None) == 0.0                       # not measurable: nothing is claimed


def test_the_decode_figure_says_floors_coincide_only_where_two_are_compute_bound():
    """The left panel explains coinciding floors only in a run where two of them are compute-bound."""
    def title(ceilings):
        return mha.plot_decode_time(fake_timing(ceilings), []).axes[0].get_title()
    assert "coincide" not in title(mha.Ceilings(40e9, 640e9))    # ridge 16: MQA (16 FLOPs a byte) at it, alone
    assert "coincide at every S:" in title(mha.Ceilings(40e9, 120e9))   # ridge 3: GQA-4 and MQA compute-bound
    timing = fake_timing(mha.Ceilings(40e9, 120e9))
    timing.reads[4][-1] *= 2                              # GQA-4's K and V read at 20 GB/s at 8192: ridge 6, memory
    said = mha.plot_decode_time(timing, []).axes[0].get_title()
    assert "compute-bound floors coincide at S = 256, 512, 1024, 2048, 4096:" in said, said      # where they do


def test_the_cache_figure_draws_the_rows_of_section_1(capsys):
    """kv_cache_size.png has a line per row of section 1's table, the demo's g marked in both, for any knob."""
    for n_kv_heads in (4, 2, 1, 8):
        mha.print_cache_tables(n_kv_heads)
        table = capsys.readouterr().out.split("shrink\n")[1].split("\n\n")[0].splitlines()
        labels = [t.get_text() for t in mha.plot_cache_sizes(n_kv_heads).axes[0].get_legend().get_texts()]
        assert [line.split()[0] for line in table] == [label.split()[0] for label in labels], n_kv_heads
        assert [("<- g =" in line) for line in table] == [("as in your demo" in label) for label in labels]
        assert sum("as in your demo" in label for label in labels) == 1


def test_the_cache_figure_labels_each_context_it_draws():
    """Every context with a dot, and CACHE_TOKENS under the squares, has its own labelled tick (reader 73)."""
    ax = mha.plot_cache_sizes(4).axes[0]
    dots = sorted({x for line in ax.get_lines() if line.get_marker() == "o" for x in line.get_xdata()})
    assert dots[0] == 512 and mha.CACHE_TOKENS in dots
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"{x:g}" for x in dots]
