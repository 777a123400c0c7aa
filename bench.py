"""
What no chapter prints: what mha.py's module and its whole run cost, as ratios measured side by side
in one run (absolute times on a shared machine wobble; ratios of interleaved rounds much less).

  1. CausalMHA.forward against nn.MultiheadAttention with the same weights, each of our paths
     against the PyTorch path that does the same operations: fused against need_weights=False,
     written out against need_weights=True. Goal: at most FORWARD times PyTorch's time.
  2. The whole `python mha.py` against the bare `python -c "import torch, matplotlib.pyplot"`, the
     least any script that uses both can take. Goal: at most WHOLE_RUN times.
Decode speed is decode.py's. A busy machine shows as rounds whose ratios scatter: the last line then
says NOT TRUSTWORTHY instead of a verdict.

Run: python bench.py     (about half a minute)
"""

import argparse
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
FORWARD = 1.10         # goal of 1: a forward's time over PyTorch's doing the same operations
WHOLE_RUN = 1.5        # goal of 2: the whole run's time over importing torch and matplotlib
SHAPES = [(8, 128, 512, 8), (4, 256, 768, 12), (1, 1024, 1024, 16), (64, 16, 256, 8)]   # B, T, d, h


def interleaved(fns, rounds=ROUNDS):
    """Per-round seconds of each fn, called in turn round after round (after one warm-up each)."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(rounds):
        for t, fn in zip(times, fns):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return times


def ratio(a, b, what, noisy):
    """median(a) / median(b); appends to noisy if the per-round ratios scatter widely."""
    per_round = sorted(x / y for x, y in zip(a, b))
    q1, q3 = per_round[len(per_round) // 4], per_round[3 * len(per_round) // 4]
    r = statistics.median(a) / statistics.median(b)
    if (q3 - q1) / r > SCATTER:
        noisy.append(f"{what}: rounds scatter from {q1:.2f} to {q3:.2f}")
    return r


def forward_times(B, T, d, h, rounds=ROUNDS):
    """Per-round seconds of [ours fused, PyTorch's need_weights=False, ours written out, its
    need_weights=True]."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(d, h, batch_first=True).eval()
    ours = mha.from_torch(ref)
    x, mask = torch.randn(B, T, d), mha.causal_mask(T, T)
    with torch.no_grad():
        return interleaved([lambda: ours(x, fused=True),
                            lambda: ref(x, x, x, attn_mask=mask, need_weights=False),
                            lambda: ours(x),
                            lambda: ref(x, x, x, attn_mask=mask, need_weights=True)], rounds)


def bench_forward(noisy, shapes=SHAPES, rounds=ROUNDS):
    """Prints section 1; returns the worst ratio."""
    print("1. forward, float32, no grad, eval: CausalMHA against nn.MultiheadAttention "
          "(same weights), ms")
    print(f"   {'B':>3}{'T':>6}{'d':>6}{'h':>4}{'fused':>9}{'torch':>9}{'ratio':>7}{'written':>10}"
          f"{'torch':>9}{'ratio':>7}")
    worst = 0.0
    for B, T, d, h in shapes:
        fused, torch_fused, written, torch_written = forward_times(B, T, d, h, rounds)
        r_fused = ratio(fused, torch_fused, f"fused {B}x{T}x{d}", noisy)
        r_written = ratio(written, torch_written, f"written out {B}x{T}x{d}", noisy)
        worst = max(worst, r_fused, r_written)
        ms = [statistics.median(t) * 1e3 for t in (fused, torch_fused, written, torch_written)]
        print(f"   {B:>3}{T:>6}{d:>6}{h:>4}{ms[0]:>9.2f}{ms[1]:>9.2f}{r_fused:>7.3f}"
              f"{ms[2]:>10.2f}{ms[3]:>9.2f}{r_written:>7.3f}")
    print(f"   worst ratio {worst:.3f} (goal <= {FORWARD})\n")
    return worst


def bench_whole_run(noisy, rounds=5):
    """Prints section 2; returns the ratio."""
    print("2. `python mha.py` against `python -c 'import torch, matplotlib.pyplot'`, "
          f"median of {rounds} rounds")
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as out:
        def script():
            subprocess.run([sys.executable, os.path.join(here, "mha.py"), "--out-dir", out],
                           check=True, stdout=subprocess.DEVNULL)

        def floor():
            subprocess.run([sys.executable, "-c", "import torch, matplotlib.pyplot"], check=True)

        run_s, floor_s = interleaved([script, floor], rounds)
    r = ratio(run_s, floor_s, "whole run", noisy)
    print(f"   mha.py {statistics.median(run_s):.2f} s, "
          f"import floor {statistics.median(floor_s):.2f} s, ratio {r:.2f} (goal <= {WHOLE_RUN})\n")
    return r


def main(argv=None):
    argparse.ArgumentParser(prog="bench.py", description=__doc__.split("\n\n")[0].strip(),
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    noisy = []
    forward = bench_forward(noisy)
    whole = bench_whole_run(noisy)
    if noisy:
        more = f" (and {len(noisy) - 1} more)" if noisy[1:] else ""
        print(f"NOT TRUSTWORTHY, the machine was busy: {noisy[0]}{more}")
        return 1
    met = forward <= FORWARD and whole <= WHOLE_RUN
    print(f"forward {forward:.3f} (<= {FORWARD}), whole run {whole:.2f} (<= {WHOLE_RUN}): "
          f"{'every goal met' if met else 'a goal NOT met'}")
    return 0 if met else 1


if __name__ == "__main__":
    try:
        code = main()
        sys.stdout.flush()                                 # here, so a closed pipe is caught below
    except BrokenPipeError:
        # python bench.py | head: the reader left. End quietly, as Python's documentation advises.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    sys.exit(code)
