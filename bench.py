"""
Benchmarks for mha.py, as ratios measured side by side in one run (absolute times on a shared machine
wobble; ratios of interleaved runs much less).

  1. CausalMHA.forward against nn.MultiheadAttention on a few shapes      goal: ours / torch <= 1.05
  2. the whole `python mha.py` against the bare `import torch, matplotlib.pyplot`   goal: <= 1.6
  3. one decode step of the whole module, d=4096, 32 heads, MHA / GQA-8 / MQA      goal: MQA >= 2x MHA
  4. the attention over the cache alone                                           goal: MQA >= 5x MHA
  5. MQA without copying K/V against repeat_interleave                             goal: >= 5x
  6. how much of the measured memory bandwidth MHA's cache read reaches

Run: python bench.py          (about a minute; needs about 2 GB of memory)
"""

import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

import mha

ROUNDS = 15            # interleaved rounds per comparison; each side's median is used


def interleaved(fns, rounds=ROUNDS):
    """Median seconds of each fn, calling them in turn round after round (after one warm-up each)."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(rounds):
        for t, fn in zip(times, fns):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def verdict(ok):
    return "goal met" if ok else "goal NOT met"


def forward_times(B, T, d, h):
    """Median seconds of (ours, nn.MultiheadAttention) on one (B, T, d) input, same weights."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(d, h, batch_first=True).eval()
    ours = mha.CausalMHA.from_torch(ref)
    x, mask = torch.randn(B, T, d), mha.causal_mask(T, T)
    with torch.no_grad():
        return interleaved([lambda: ours(x), lambda: ref(x, x, x, attn_mask=mask, need_weights=False)])


def bench_forward():
    print("1. forward, float32, no grad, eval: CausalMHA against nn.MultiheadAttention (same weights)")
    print(f"   {'B':>3}{'T':>6}{'d':>6}{'h':>4}{'ours ms':>10}{'torch ms':>10}{'ratio':>8}")
    worst = 0.0
    for B, T, d, h in [(8, 128, 512, 8), (4, 256, 768, 12), (1, 1024, 1024, 16), (64, 16, 256, 8)]:
        a, b = forward_times(B, T, d, h)
        worst = max(worst, a / b)
        print(f"   {B:>3}{T:>6}{d:>6}{h:>4}{a * 1e3:>10.2f}{b * 1e3:>10.2f}{a / b:>8.3f}")
    print(f"   worst ratio {worst:.3f}: {verdict(worst <= 1.05)} (<= 1.05)\n")


def bench_whole_run(rounds=5):
    print(f"2. whole run: `python mha.py` against `python -c 'import torch, matplotlib.pyplot'`, median of {rounds}")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, MPLBACKEND="Agg")
    with tempfile.TemporaryDirectory() as out:
        def script():
            subprocess.run([sys.executable, os.path.join(here, "mha.py"), "--out-dir", out], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)

        def floor():
            subprocess.run([sys.executable, "-c", "import torch, matplotlib.pyplot"], check=True, env=env,
                           stderr=subprocess.DEVNULL)

        run_s, floor_s = interleaved([script, floor], rounds)
    print(f"   mha.py {run_s:.2f} s, import floor {floor_s:.2f} s, ratio {run_s / floor_s:.2f}: "
          f"{verdict(run_s / floor_s <= 1.6)} (<= 1.6)\n")


def decode_module(kv, S, d, h):
    """A (d, h) module with kv K/V heads and a cache holding S tokens (written, so its pages are real)."""
    torch.manual_seed(0)
    attn = mha.CausalMHA(d, h, kv).eval()
    cache = attn.new_cache(1, S + 1)
    cache.k.normal_()
    cache.v.normal_()
    cache.length = S
    return attn, cache


KINDS = {"MHA": 32, "GQA-8": 8, "MQA": 1}


def decode_times(S, h=32, dh=128):
    """Median seconds at S cached tokens: whole steps and attention alone per kind, and MQA shared/copied.

    Also returns the bytes of MHA's cache.
    """
    x, q = torch.randn(1, 1, h * dh), torch.randn(1, h, 1, dh)
    modules = [decode_module(kv, S, h * dh, h) for kv in KINDS.values()]

    def step(attn, cache):
        cache.length = S                       # rewind, so every call decodes token S + 1
        attn(x, cache=cache)

    with torch.no_grad():
        steps = interleaved([lambda a=a, c=c: step(a, c) for a, c in modules])
        kvs = [(c.k[:, :, :S], c.v[:, :, :S]) for _, c in modules]
        parts = interleaved([lambda k=k, v=v: mha.attend(q, k, v) for k, v in kvs])
        k1, v1 = kvs[-1]
        shared, copied = interleaved([lambda: mha.attend(q, k1, v1), lambda: mha.attend_by_copying(q, k1, v1)])
    mha_bytes = kvs[0][0].nbytes + kvs[0][1].nbytes
    return dict(zip(KINDS, steps)), dict(zip(KINDS, parts)), shared, copied, mha_bytes


def bench_decode(contexts=(4096, 8192)):
    print("3-6. one decode step (1 new token, batch 1, float32), d=4096, 32 query heads of width 128")
    # A 256 MB buffer, 8x this CPU's 32 MB L3 cache, so that the read comes from main memory.
    bandwidth = mha.memory_bandwidth(torch.full((64 * 2**20,), 1.0), reps=10)
    for S in contexts:
        steps, parts, shared, copied, cache_bytes = decode_times(S)
        print(f"   {S} cached tokens")
        print(f"   {'':<7}{'whole step ms':>14}{'speedup':>9}{'attention ms':>14}{'speedup':>9}")
        for kind in KINDS:
            print(f"   {kind:<7}{steps[kind] * 1e3:>14.2f}{steps['MHA'] / steps[kind]:>8.1f}x"
                  f"{parts[kind] * 1e3:>14.3f}{parts['MHA'] / parts[kind]:>8.1f}x")
        whole, attn_only, nocopy = steps["MHA"] / steps["MQA"], parts["MHA"] / parts["MQA"], copied / shared
        goal = verdict(whole >= 2) + " (>= 2x at 4096)" if S == 4096 else "(the goal is set at 4096)"
        print(f"   MQA whole step {whole:.1f}x faster than MHA: {goal}")
        print(f"   MQA attention {attn_only:.1f}x faster than MHA: {verdict(attn_only >= 5)} (>= 5x)")
        print(f"   MQA attention without copying K/V {shared * 1e3:.3f} ms, with repeat_interleave "
              f"{copied * 1e3:.3f} ms: {nocopy:.1f}x, {verdict(nocopy >= 5)} (>= 5x)")
        speed = cache_bytes / parts["MHA"]
        print(f"   MHA reads its {cache_bytes / 1e6:.0f} MB cache at {speed / 1e9:.1f} GB/s, {speed / bandwidth:.0%} "
              f"of the {bandwidth / 1e9:.1f} GB/s a plain read reaches here\n")


def main():
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    bench_forward()
    bench_whole_run()
    bench_decode()


if __name__ == "__main__":
    main()
