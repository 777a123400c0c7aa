"""
Benchmarks for mha.py, as ratios measured side by side in one run (absolute times on a shared machine
wobble; ratios of interleaved runs much less), and a last line that says whether the numbers hold together.

  1. CausalMHA.forward against nn.MultiheadAttention on a few shapes      goal: ours / torch <= 1.05
  2. the whole `python mha.py` against the bare `import torch, matplotlib.pyplot`   goal: <= 1.4
  3. one decode step of the whole module, d=4096, 32 heads, MHA / GQA-8 / MQA      goal: MQA >= 2x MHA
  4. the attention over the cache alone                                           goal: MQA >= 5x MHA
  5. MQA without copying K/V against repeat_interleave                             goal: >= 5x
  6. each configuration's attention against its roofline floor, max(bytes / read, FLOPs / matmul),
     with both ceilings measured in the same rounds

A busy machine shows up as contradictions: a configuration with fewer K/V heads slower than one with
more, an attention faster than its roofline floor, or rounds whose ratios scatter widely. Then the last
line says NOT TRUSTWORTHY and what it saw.

Run: python bench.py          (about a minute; needs about 2 GB of memory)
"""

import itertools
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
SCATTER = 0.5          # a ratio whose middle half of rounds spans more than half of it is noise
                       # (a quarter fired on a quiet machine: repeat_interleave's 268 MB copy varies)
CONTRADICTIONS = []    # what this run saw that a quiet machine would not show


def interleaved(fns, rounds=ROUNDS):
    """Per-round seconds of each fn, calling them in turn round after round (after one warm-up each)."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(rounds):
        for t, fn in zip(times, fns):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return times


def ratio(a, b, what):
    """median(a) / median(b), noting a contradiction if the per-round ratios scatter widely."""
    per_round = sorted(x / y for x, y in zip(a, b))
    q1, q3 = per_round[len(per_round) // 4], per_round[3 * len(per_round) // 4]
    r = statistics.median(a) / statistics.median(b)
    if (q3 - q1) / r > SCATTER:
        CONTRADICTIONS.append(f"{what}: rounds scatter from {q1:.2f} to {q3:.2f}")
    return r


def verdict(ok):
    return "goal met" if ok else "goal NOT met"


def forward_times(B, T, d, h, rounds=ROUNDS):
    """Per-round seconds of (ours, nn.MultiheadAttention) on one (B, T, d) input, same weights."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(d, h, batch_first=True).eval()
    ours = mha.CausalMHA.from_torch(ref)
    x, mask = torch.randn(B, T, d), mha.causal_mask(T, T)
    with torch.no_grad():
        return interleaved([lambda: ours(x), lambda: ref(x, x, x, attn_mask=mask, need_weights=False)], rounds)


def bench_forward():
    print("1. forward, float32, no grad, eval: CausalMHA against nn.MultiheadAttention (same weights)")
    print(f"   {'B':>3}{'T':>6}{'d':>6}{'h':>4}{'ours ms':>10}{'torch ms':>10}{'ratio':>8}")
    worst = 0.0
    for B, T, d, h in [(8, 128, 512, 8), (4, 256, 768, 12), (1, 1024, 1024, 16), (64, 16, 256, 8)]:
        a, b = forward_times(B, T, d, h)
        r = ratio(a, b, f"forward {B}x{T}x{d}")
        worst = max(worst, r)
        print(f"   {B:>3}{T:>6}{d:>6}{h:>4}{statistics.median(a) * 1e3:>10.2f}{statistics.median(b) * 1e3:>10.2f}"
              f"{r:>8.3f}")
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
    r = ratio(run_s, floor_s, "whole run")
    print(f"   mha.py {statistics.median(run_s):.2f} s, import floor {statistics.median(floor_s):.2f} s, "
          f"ratio {r:.2f}: {verdict(r <= 1.4)} (<= 1.4)\n")


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


def decode_times(S, h=32, dh=128, rounds=ROUNDS):
    """Per-round seconds at S cached tokens: whole steps and attention alone per kind, MQA shared and
    copied, and the two ceilings (a 256 MiB read, a 512^3 matmul) timed in the attention's rounds."""
    x, q = torch.randn(1, 1, h * dh), torch.randn(1, h, 1, dh)
    modules = [decode_module(kv, S, h * dh, h) for kv in KINDS.values()]
    buf = torch.full((mha.READ_BUFFER_BYTES // 4,), 1.0)
    a, b = torch.randn(mha.MATMUL_N, mha.MATMUL_N), torch.randn(mha.MATMUL_N, mha.MATMUL_N)

    def step(attn, cache):
        cache.length = S                       # rewind, so every call decodes token S + 1
        attn(x, cache=cache)

    with torch.no_grad():
        steps = interleaved([lambda a=a, c=c: step(a, c) for a, c in modules], rounds)
        kvs = [(c.k[:, :, :S], c.v[:, :, :S]) for _, c in modules]
        *parts, read, matmul = interleaved([lambda k=k, v=v: mha.attend(q, k, v) for k, v in kvs]
                                           + [buf.sum, lambda: a @ b], rounds)
        k1, v1 = kvs[-1]
        shared, copied = interleaved([lambda: mha.attend(q, k1, v1), lambda: mha.attend_by_copying(q, k1, v1)],
                                     rounds)
    ceilings = mha.Ceilings(bandwidth=buf.nbytes / min(read), flops=2 * mha.MATMUL_N**3 / min(matmul))
    return dict(zip(KINDS, steps)), dict(zip(KINDS, parts)), shared, copied, ceilings


def check_order(times, what, S):
    """Fewer K/V heads read fewer bytes: a kind more than 10% slower than one with more is a contradiction."""
    for more, fewer in itertools.pairwise(KINDS):
        if statistics.median(times[fewer]) > 1.1 * statistics.median(times[more]):
            CONTRADICTIONS.append(f"{what} at {S} tokens: {fewer} slower than {more}")


def bench_decode(contexts=(4096, 8192)):
    print("3-6. one decode step (1 new token, batch 1, float32), d=4096, 32 query heads of width 128")
    for S in contexts:
        steps, parts, shared, copied, ceilings = decode_times(S)
        check_order(steps, "whole step", S)
        check_order(parts, "attention", S)
        print(f"   {S} cached tokens")
        print(f"   {'':<7}{'whole step ms':>14}{'speedup':>9}{'attention ms':>14}{'speedup':>9}")
        for kind in KINDS:
            print(f"   {kind:<7}{statistics.median(steps[kind]) * 1e3:>14.2f}"
                  f"{ratio(steps['MHA'], steps[kind], f'whole step {kind}'):>8.1f}x"
                  f"{statistics.median(parts[kind]) * 1e3:>14.3f}"
                  f"{ratio(parts['MHA'], parts[kind], f'attention {kind}'):>8.1f}x")
        whole = statistics.median(steps["MHA"]) / statistics.median(steps["MQA"])
        attn_only = statistics.median(parts["MHA"]) / statistics.median(parts["MQA"])
        nocopy = ratio(copied, shared, "copying K/V")
        goal = verdict(whole >= 2) + " (>= 2x at 4096)" if S == 4096 else "(the goal is set at 4096)"
        print(f"   MQA whole step {whole:.1f}x faster than MHA: {goal}")
        print(f"   MQA attention {attn_only:.1f}x faster than MHA: {verdict(attn_only >= 5)} (>= 5x)")
        print(f"   MQA attention without copying K/V {statistics.median(shared) * 1e3:.3f} ms, with "
              f"repeat_interleave {statistics.median(copied) * 1e3:.3f} ms: {nocopy:.1f}x, {verdict(nocopy >= 5)} (>= 5x)")
        print(f"   roofline: read {ceilings.bandwidth / 1e9:.1f} GB/s, matmul {ceilings.flops / 1e9:.0f} GFLOP/s, "
              f"ridge {ceilings.ridge:.1f} FLOPs per byte")
        for kind, kv in KINDS.items():
            floor, bound = mha.roofline(mha.decode_flops(32, 128, S), mha.decode_bytes(kv, 128, S), ceilings)
            best = min(parts[kind])
            if best < 0.9 * floor:
                CONTRADICTIONS.append(f"attention {kind} at {S} tokens {1 - best / floor:.0%} below its floor")
            print(f"   {kind:<7}{bound}-bound, floor {floor * 1e3:.3f} ms: the attention reaches "
                  f"{floor / statistics.median(parts[kind]):.0%} of it")
        print()


def main():
    print(f"torch {torch.__version__}, {mha.machine_name()}\n")
    bench_forward()
    bench_whole_run()
    bench_decode()
    if CONTRADICTIONS:
        print(f"NOT TRUSTWORTHY, the machine was busy: {'; '.join(CONTRADICTIONS[:3])}"
              f"{f' (and {len(CONTRADICTIONS) - 3} more)' if len(CONTRADICTIONS) > 3 else ''}")
    else:
        print("These timings hold together: no ratio scattered, no order broken, nothing beat its roofline.")


if __name__ == "__main__":
    main()
