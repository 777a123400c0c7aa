"""
Benchmarks for mha.py, as ratios measured side by side in one run (absolute times on a shared machine
wobble; ratios of interleaved runs much less), and a last line that says whether the numbers hold together.

  1. CausalMHA.forward against nn.MultiheadAttention on a few shapes, each path against PyTorch's own
     that does the same operations, a batch's rows in another order (measured: 0.87 to 1.10)  goal: <= FORWARD
  2. the whole `python mha.py` against the bare `import torch, matplotlib.pyplot`  goal: <= 2
  3. one decode step of one layer, d=4096, 32 query heads, MHA / GQA-8 / MQA, at 4096 and 8192 tokens:
     the whole module, and the attention over the cache alone, each against its roofline floor,
     max(bytes / read rate, FLOPs / matmul rate), with both rates measured in the same rounds on the
     same bytes. The goals come from the floors:
       every attention (mha.attend, as the tutorial writes it) reaches at least REACH of its floor (its
       matmuls of a few rows per K/V head are neither a plain read nor a large square matmul);
       MQA is faster than MHA by at least REACH times the ratio of their floors: the least speed-up the
       first goal allows, with MHA at its floor and MQA at REACH of its (whole step and attention);
  4. MQA's attention reading its one K/V head in place, against copying it to 32 heads first
     (into a buffer allocated once, as a server would; a fresh allocation per step adds noise)  goal: >= 5x

A busy machine shows up as contradictions: a configuration with fewer K/V heads slower than one with
more, an attention faster than its roofline floor, rounds whose ratios scatter widely, or other programs
keeping a quarter of a core or more busy meanwhile (measured, where Linux says). Then the last line says
NOT TRUSTWORTHY and what it saw.

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
FORWARD = 1.10         # how much slower than PyTorch doing the same operations a forward may be
REACH = 0.2            # the share of its roofline floor each measured attention must reach
KINDS = {"MHA": 32, "GQA-8": 8, "MQA": 1}   # K/V heads of the 32-query-head layer
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


# ----------------------------------------------------------------------------- 1. forward
def forward_times(B, T, d, h, rounds=ROUNDS):
    """Per-round seconds of ours and nn.MultiheadAttention on one (B, T, d) input, same weights, like with
    like: fused against PyTorch's need_weights=False path, written out against its need_weights=True path."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(d, h, batch_first=True).eval()
    ours = mha.from_torch(ref)
    x, mask = torch.randn(B, T, d), mha.causal_mask(T, T)
    with torch.no_grad():
        return interleaved([lambda: ours(x, fused=True), lambda: ref(x, x, x, attn_mask=mask, need_weights=False),
                            lambda: ours(x), lambda: ref(x, x, x, attn_mask=mask, need_weights=True)], rounds)


def bench_forward():
    print("1. forward, float32, no grad, eval: CausalMHA against nn.MultiheadAttention (same weights), ms")
    print(f"   {'B':>3}{'T':>6}{'d':>6}{'h':>4}{'fused':>9}{'torch':>9}{'ratio':>7}{'written':>10}{'torch':>9}"
          f"{'ratio':>7}")
    worst = 0.0
    for B, T, d, h in [(8, 128, 512, 8), (4, 256, 768, 12), (1, 1024, 1024, 16), (64, 16, 256, 8)]:
        fused, torch_default, written, torch_weights = forward_times(B, T, d, h)
        r1 = ratio(fused, torch_default, f"fused {B}x{T}x{d}")
        r2 = ratio(written, torch_weights, f"written {B}x{T}x{d}")
        worst = max(worst, r1, r2)
        ms = [statistics.median(t) * 1e3 for t in (fused, torch_default, written, torch_weights)]
        print(f"   {B:>3}{T:>6}{d:>6}{h:>4}{ms[0]:>9.2f}{ms[1]:>9.2f}{r1:>7.3f}{ms[2]:>9.2f}{ms[3]:>9.2f}{r2:>8.3f}")
    print(f"   worst ratio {worst:.3f}: {verdict(worst <= FORWARD)} (<= {FORWARD})\n")


# ----------------------------------------------------------------------------- 2. the whole run
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
          f"ratio {r:.2f}: {verdict(r <= 2)} (<= 2)\n")


# ----------------------------------------------------------------------------- 3 and 4. decoding
def decode_module(kv, S, d, h):
    """A (d, h) module with kv K/V heads and a cache holding S tokens (written, so its pages are real)."""
    torch.manual_seed(0)
    attn = mha.CausalMHA(d, h, kv).eval()
    cache = attn.new_cache(1, S + 1)
    cache.k.normal_()
    cache.v.normal_()
    cache.length = S
    return attn, cache


def weight_bytes(attn):
    return sum(p.nbytes for p in attn.parameters())


def products(q, k, v):
    """mha.attend's two matrix products of a decode step alone, (k q^T)^T and p v (p = the raw scores), without
    its scaling and softmax: how much of a decode step they take shows where the step's time goes."""
    B, h, T, dh = q.shape
    kv, S = k.shape[1], k.shape[2]
    scores = torch.bmm(k.reshape(B * kv, S, dh), q.reshape(B * kv, h // kv * T, dh).transpose(1, 2))
    scores = scores.transpose(1, 2).contiguous()           # (B*kv, g*T, S), laid out as attend's softmax returns p
    return torch.bmm(scores, v.reshape(B * kv, S, dh))     # (B*kv, g*T, S) @ (B*kv, S, dh)


def decode_times(S, h=32, dh=128, rounds=ROUNDS):
    """Per-round seconds at S cached tokens, {kind: [...]}: whole steps, attention alone, its two products
    alone, a read of each attention's K and V, and MQA's attention with its K/V copied to h heads; and the
    matmul's FLOP/s."""
    x, q = torch.randn(1, 1, h * dh), torch.randn(1, h, 1, dh)
    modules = {kind: decode_module(kv, S, h * dh, h) for kind, kv in KINDS.items()}
    a, b = torch.randn(mha.MATMUL_N, mha.MATMUL_N), torch.randn(mha.MATMUL_N, mha.MATMUL_N)

    def step(attn, cache):
        cache.length = S                       # rewind, so every call decodes token S + 1
        attn(x, cache=cache)

    def read(k, v):
        k.sum()
        v.sum()

    k1, v1 = modules["MQA"][1].k[:, :, :S], modules["MQA"][1].v[:, :, :S]
    copies = torch.empty(2, 1, h, S, dh)       # MQA's K and V copied to h heads: allocated once

    def copied():                              # mha.attend_textbook's copies, minus their allocation
        copies[0].copy_(k1.expand(1, h, S, dh))
        copies[1].copy_(v1.expand(1, h, S, dh))
        return torch.nn.functional.scaled_dot_product_attention(q, copies[0], copies[1])

    with torch.no_grad():
        steps = interleaved([lambda a=a, c=c: step(a, c) for a, c in modules.values()], rounds)
        kvs = [(c.k[:, :, :S], c.v[:, :, :S]) for _, c in modules.values()]
        *timed, matmul = interleaved([lambda k=k, v=v: mha.attend(q, k, v) for k, v in kvs]
                                     + [lambda k=k, v=v: products(q, k, v) for k, v in kvs]
                                     + [lambda k=k, v=v: read(k, v) for k, v in kvs] + [lambda: a @ b], rounds)
        shared, copy = interleaved([lambda: mha.attend(q, k1, v1), copied], rounds)
    n = len(KINDS)
    parts, alone, reads = dict(zip(KINDS, timed[:n])), dict(zip(KINDS, timed[n:2 * n])), dict(zip(KINDS, timed[2 * n:]))
    weights = {kind: weight_bytes(attn) for kind, (attn, _) in modules.items()}
    return dict(zip(KINDS, steps)), parts, alone, reads, shared, copy, 2 * mha.MATMUL_N**3 / min(matmul), weights


def check_order(times, what, S):
    """Fewer K/V heads read fewer bytes: a kind more than 10% slower than one with more is a contradiction."""
    for more, fewer in itertools.pairwise(KINDS):
        if statistics.median(times[fewer]) > 1.1 * statistics.median(times[more]):
            CONTRADICTIONS.append(f"{what} at {S} tokens: {fewer} slower than {more}")


def bench_decode(contexts=(4096, 8192), h=32, dh=128):
    print(f"3-4. one decode step (1 new token, batch 1, float32), d={h * dh}, {h} query heads of width {dh}")
    print(f"   floor = max(bytes / read rate, FLOPs / matmul rate); goals: each attention reaches {REACH:.0%} "
          f"of its floor,\n   MQA's speed-up over MHA at least {REACH:.0%} of the ratio of their floors")
    for S in contexts:
        steps, parts, alone, reads, shared, copy, flops, weights = decode_times(S, h, dh)
        check_order(steps, "whole step", S)
        check_order(parts, "attention", S)
        flop = mha.decode_flops(h, dh, S)
        memory = mha.decode_bytes(KINDS["MHA"], dh, S) / min(reads["MHA"])   # the largest K/V: from memory
        floors, step_floors = {}, {}
        print(f"   {S} cached tokens; matmul {flops / 1e9:.0f} GFLOP/s, MHA's K/V read at {memory / 1e9:.1f} GB/s")
        print(f"   {'':<7}{'step ms':>9}{'floor':>8}{'speedup':>9}{'attention ms':>14}{'read GB/s':>11}{'floor':>8}"
              f"{'reaches':>9}{'speedup':>9}{'products':>10}")
        for kind, kv in KINDS.items():
            n_bytes = mha.decode_bytes(kv, dh, S)
            ceilings = mha.Ceilings(bandwidth=n_bytes / min(reads[kind]), flops=flops)
            floors[kind] = mha.roofline(flop, n_bytes, ceilings)[0]
            step_floors[kind] = (weights[kind] + n_bytes) / memory    # weights and K/V, read from memory
            best, median = min(parts[kind]), statistics.median(parts[kind])
            if best < 0.9 * floors[kind]:
                CONTRADICTIONS.append(f"attention {kind} at {S} tokens {1 - best / floors[kind]:.0%} below its floor")
            print(f"   {kind:<7}{statistics.median(steps[kind]) * 1e3:>9.2f}{step_floors[kind] * 1e3:>8.2f}"
                  f"{ratio(steps['MHA'], steps[kind], f'whole step {kind}'):>8.1f}x{median * 1e3:>14.3f}"
                  f"{ceilings.bandwidth / 1e9:>11.1f}{floors[kind] * 1e3:>8.3f}{floors[kind] / median:>9.0%}"
                  f"{ratio(parts['MHA'], parts[kind], f'attention {kind}'):>8.1f}x"
                  f"{statistics.median(alone[kind]) / median:>10.0%}")
        print("   products: the attention's two matrix products alone, (k q^T)^T and p v, as a share of it")
        lowest = min(floors[kind] / statistics.median(parts[kind]) for kind in KINDS)
        print(f"   every attention reaches at least {lowest:.0%} of its floor: {verdict(lowest >= REACH)} "
              f"(>= {REACH:.0%})")
        whole = statistics.median(steps["MHA"]) / statistics.median(steps["MQA"])
        attn_only = statistics.median(parts["MHA"]) / statistics.median(parts["MQA"])
        whole_goal, attn_goal = [REACH * f["MHA"] / f["MQA"] for f in (step_floors, floors)]
        print(f"   MQA whole step {whole:.1f}x faster than MHA: {verdict(whole >= whole_goal)} (>= {whole_goal:.1f}x)")
        print(f"   MQA attention {attn_only:.1f}x faster than MHA: {verdict(attn_only >= attn_goal)} "
              f"(>= {attn_goal:.1f}x)")
        nocopy = ratio(copy, shared, "copying K/V")
        print(f"   MQA attention without copying K/V {statistics.median(shared) * 1e3:.3f} ms, copied to {h} heads "
              f"first {statistics.median(copy) * 1e3:.3f} ms: {nocopy:.1f}x, {verdict(nocopy >= 5)} (>= 5x)\n")


def main(argv=None):
    parser = mha.Parser(prog="bench.py", description="Benchmarks for mha.py: ratios measured side by side in one "
                        "run, goals from the roofline, and a last line that says whether the timings hold together.")
    parser.parse_args(argv)
    print(f"torch {torch.__version__}, {mha.machine_name()}\n")
    mha.keep_freed_memory()                    # as mha.py's timing does: no page faults timed, for every path
    start = mha.cpu_seconds()
    bench_forward()
    bench_whole_run()
    bench_decode()
    elsewhere = mha.cores_elsewhere(start)
    if elsewhere > 0.25:
        CONTRADICTIONS.insert(0, f"other programs kept {elsewhere:.1f} cores busy")
    if CONTRADICTIONS:
        print(f"NOT TRUSTWORTHY, the machine was busy: {'; '.join(CONTRADICTIONS[:3])}"
              f"{f' (and {len(CONTRADICTIONS) - 3} more)' if len(CONTRADICTIONS) > 3 else ''}")
    else:
        print("These timings hold together: no ratio scattered, no order broken, nothing beat its roofline.")
    return 0


if __name__ == "__main__":
    mha.run_as_script(main)
