"""
Why fewer K/V heads make generation faster, measured: the attention of one decode step in a
Llama-7B-shaped layer, on this CPU.

  - A model generates text one token at a time. Each new token (T = 1) attends to the keys and
    values of every token before it, kept in the KV cache (mha.py), so each step reads the whole
    cache to do little arithmetic with it: MHA's step waits on memory. GQA and MQA read fewer bytes
    a step, and with few K/V heads the arithmetic can decide instead (the floor, below).
  - The run times mha.attend_grouped for MHA, GQA-8, GQA-4 and MQA at 256 to 8192 cached tokens
    against each step's roofline floor (Williams et al. 2009), from a read rate (bytes a second)
    and a FLOP rate (multiplies and adds a second) measured beside the steps, and each speed-up
    over MHA against the ratio of their floors, then the step's three parts alone, to see where
    its time goes; figures/decode_time.png draws the steps.
  - The copy trap, side by side: the textbook step copies each K/V head to its g query heads
    before reading it; mha.attend_grouped and PyTorch's fused call read it once, in place.
  - On a GPU (NVIDIA's H100), where models run in bf16 (2-byte numbers, defined below), every
    configuration is memory-bound: arithmetic from its datasheet, not a timing.
  - A machine busy with other programs gives timings that contradict each other: the run says
    NOT TRUSTWORTHY.
Not here: the rest of a layer (projections, MLP: they read the weights, the same for every
configuration), batches of requests.
Run:    python decode.py  (5 to 10 s; writes figures/decode_time.png; --help for its one flag)
Papers: Williams, Waterman, Patterson 2009, "Roofline" (CACM 52(4)); Shazeer 2019, MQA
        (arXiv:1911.02150); Ainslie et al. 2023, GQA (arXiv:2305.13245).
Shapes: mha.py's: B batch, T new tokens, S keys (cached and new), h query heads, kv K/V heads,
        g = h / kv query heads per K/V head, dh head width.
"""

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import mha

# ------------------------------------------------------------------ knobs
CONTEXTS = (256, 512, 1024, 2048, 4096, 8192)   # S: cached tokens at which a step is timed
KV_HEADS = mha.LLAMA_KV_HEADS  # kv of Llama-7B's 32 query heads (dh 128): MHA, GQA-8, GQA-4, MQA
ROUNDS = 7                     # each time is the best of this many rounds
MATMUL_N = 512                 # the FLOP rate: a (512, 512) @ (512, 512) float32 matmul
BUSY = 0.25                    # other programs keeping this many cores busy: timings untrustworthy
H100 = ("H100 SXM", 989e12, 3.35e12)   # NVIDIA's datasheet: dense bf16 FLOP/s, memory bytes/s
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "figures")


# ------------------------------------------------------------------ the roofline
# A decode step (T = 1) of one layer: each of the h query heads scores S cached keys,
# (1, dh) @ (dh, S), then averages S values with its weights, (1, S) @ (S, dh): S dh multiply-adds
# each, 2 FLOPs (floating-point operations) apiece. So
#     FLOPs = 4 h S dh    on    bytes = 2 kv S dh x 4    (K and V of kv heads, fp32: 4 bytes each)
# A machine reads at most so many bytes a second and does at most so many FLOPs a second, so a step
# takes at least
#     floor = max(bytes / read rate, FLOPs / FLOP rate)                         (the roofline)
# Which term decides is the step's FLOPs per byte (its arithmetic intensity): how much arithmetic
# it does with each byte it reads, 4 h S dh / (8 kv S dh) = g / 2 in fp32. Compare it with the
# machine's ridge, FLOP rate / read rate: the FLOPs it can do in the time it reads one byte. Below
# the ridge the bytes decide (memory-bound), above it the FLOPs (compute-bound).
# Worked example, with made-up round rates (the run measures the real ones): Llama-7B's layer at
# S = 8192 on a CPU reading 20 GB/s and computing 100 GFLOP/s (ridge 5):
#     MHA (g = 1):  134 MFLOP on 268 MB: 13.4 ms reading, 1.34 ms arithmetic: memory-bound;
#     MQA (g = 32): 134 MFLOP on 8.4 MB: 0.42 ms reading, 1.34 ms arithmetic: compute-bound,
#     so 32x fewer bytes would make MQA at most 10x faster on that CPU.
def decode_flops(n_heads, d_head, S):
    """FLOPs of one new token's attention over S keys, 4 h S dh.
    decode_flops(32, 128, 8192) == 134217728"""
    return 4 * n_heads * S * d_head


def decode_bytes(n_kv_heads, d_head, S, bytes_per_elem=4):
    """Bytes it reads: one layer's K and V.  decode_bytes(32, 128, 8192) == 268435456 (fp32), and
    134217728 with bytes_per_elem=2 (bf16, below)"""
    return mha.kv_cache_bytes(1, n_kv_heads, d_head, S, bytes_per_elem=bytes_per_elem)


def roofline(flops, n_bytes, read_rate, flop_rate):
    """(floor in seconds, 'memory' or 'compute': which rate sets it).  The example above, MQA:
    roofline(134217728, 8388608, 20e9, 100e9) == (0.00134217728, 'compute')"""
    reading, computing = n_bytes / read_rate, flops / flop_rate
    return (reading, "memory") if reading >= computing else (computing, "compute")


# ------------------------------------------------------------------ timing one decode step
@dataclass
class Timing:
    """What measure() found: best[what, kv, S], the best seconds of each call it timed ("step",
    "read", "textbook", "fused", "q k^T", "softmax", "p v"), and the square matmul's FLOP rate."""
    contexts: tuple
    kv_heads: tuple
    best: dict
    flop_rate: float
    elsewhere: float = 0.0     # cores other programs kept busy meanwhile (0: Linux did not say)

    def read_rate(self, kv, S):
        """Bytes per second of a sum over this step's own K and V."""
        return decode_bytes(kv, mha.LLAMA_D_HEAD, S) / self.best["read", kv, S]

    def floor(self, kv, S):
        """roofline() of the step with kv K/V heads over S cached tokens: (seconds, bound)."""
        flops = decode_flops(mha.LLAMA_HEADS, mha.LLAMA_D_HEAD, S)
        n_bytes = decode_bytes(kv, mha.LLAMA_D_HEAD, S)
        return roofline(flops, n_bytes, self.read_rate(kv, S), self.flop_rate)


def fused(q, k, v):
    """The same step in one call: PyTorch's fused attention, each K/V head shared by its g query
    heads. No mask: one new token sees every cached key."""
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)      # (B, h, 1, dh)


def step_parts(q, k, v):
    """mha.attend_grouped at T = 1 in its three parts, the scores q k^T, their softmax and p v,
    each with its input ready-made, to be timed alone: [(name, function, its arguments)]."""
    B, h, T, dh = q.shape
    kv = k.shape[1]
    q = q.view(B, kv, h // kv, T, dh) * math.sqrt(1.0 / dh)     # (B, kv, g, T, dh)
    scores = torch.einsum("bnite,bnse->bnits", q, k)            # (B, kv, g, T, S)
    p = scores.softmax(dim=-1)                                  # (B, kv, g, T, S)
    return [("q k^T", torch.einsum, ("bnite,bnse->bnits", q, k)),
            ("softmax", torch.softmax, (scores, -1)),
            ("p v", torch.einsum, ("bnits,bnse->bnite", p, v))]     # (B, kv, g, T, dh)


def measure(contexts=CONTEXTS, kv_heads=KV_HEADS, rounds=ROUNDS):
    """Times every call below once a round, rounds times, and keeps each call's best: a burst of
    other work slows one round of every call, not every round of one."""
    h, dh = mha.LLAMA_HEADS, mha.LLAMA_D_HEAD
    contexts, longest = tuple(sorted(contexts)), max(contexts)
    q = torch.randn(1, h, 1, dh)                           # (B, h, T, dh): one new token's queries
    a = torch.randn(MATMUL_N, MATMUL_N)
    # Each configuration's cache as a server fills it, K and V stacked: (2, B, kv, longest, dh).
    # A step over S tokens reads cache[:, :, :, :S], K and V each (B, kv, S, dh): views, not copies.
    caches = {kv: torch.randn(2, 1, kv, longest, dh) for kv in kv_heads}
    calls = [("matmul", None, None, torch.mm, (a, a))]     # (what, kv, S, function, its arguments)
    # Longest context first; at each, every configuration's read, then every step: the other
    # configurations' K and V pass through the CPU's caches between a step and its own read, so
    # neither finds them there.
    for S in sorted(contexts, reverse=True):
        for kv, cache in caches.items():
            calls.append(("read", kv, S, torch.sum, (cache[:, :, :, :S],)))
        for kv, cache in caches.items():
            calls.append(("step", kv, S, mha.attend_grouped, (q, *cache[:, :, :, :S])))
    for what, function in [("textbook", mha.attend_textbook), ("fused", fused)]:
        for kv, cache in caches.items():
            calls.append((what, kv, longest, function, (q, *cache)))
    for kv, cache in caches.items():
        for name, function, args in step_parts(q, *cache):
            calls.append((name, kv, longest, function, args))
    best = {}
    start = seconds_elsewhere()
    with torch.no_grad():
        for _ in range(rounds):
            for what, kv, S, function, args in calls:
                t0 = time.perf_counter()
                function(*args)
                best[what, kv, S] = min(best.get((what, kv, S), math.inf), time.perf_counter() - t0)
    end = seconds_elsewhere()
    # Other programs' CPU seconds per second of wall clock: the cores they kept busy meanwhile.
    elsewhere = (end[1] - start[1]) / (end[0] - start[0]) if start and end else 0.0
    flop_rate = 2 * MATMUL_N**3 / best["matmul", None, None]
    return Timing(contexts, tuple(kv_heads), best, flop_rate, elsewhere)


# ------------------------------------------------------------------ timings no quiet machine gives
def contradictions(timing, slack=0.1):
    """What would not happen on a quiet machine: other programs busy, a step faster than its floor
    (by more than slack), or a configuration with fewer K/V heads slower than one with more (from
    1024 tokens on, where the step is more than its fixed costs)."""
    problems = []
    if timing.elsewhere > BUSY:
        problems.append(f"other programs kept {timing.elsewhere:.1f} cores busy")
    kinds = sorted(timing.kv_heads, reverse=True)          # most K/V heads first
    for S in timing.contexts:
        for more, kv in zip([None] + kinds, kinds):
            t, floor = timing.best["step", kv, S], timing.floor(kv, S)[0]
            kind = mha.attention_kind(mha.LLAMA_HEADS, kv)
            if t < (1 - slack) * floor:
                problems.append(f"{kind} at {S} tokens took {t / floor:.0%} of its floor")
            if more is not None and S >= 1024 and t > (1 + slack) * timing.best["step", more, S]:
                slower_than = mha.attention_kind(mha.LLAMA_HEADS, more)
                problems.append(f"{kind} is slower than {slower_than} at {S} tokens")
    return problems


# ------------------------------------------------------------------ on a GPU
# GPUs serve models in bf16 (bfloat16): 2-byte numbers with float32's range and fewer digits, so a
# step reads half the bytes of fp32 for the same FLOPs: 4 h S dh / (4 kv S dh) = g FLOPs per byte.
# An H100's ridge (datasheet, H100 above): 989e12 / 3.35e12, 295 FLOPs per byte, far above any g.
# A model too big for one GPU splits its heads across several GPUs (tensor parallelism): each GPU
# holds some query heads and the K/V heads they read. With more GPUs than K/V heads, each K/V head
# is needed on several GPUs and stored on each, so the cache per GPU shrinks less than h / kv says.
# MQA's one K/V head is stored on every GPU: the GQA paper's case for GQA-8 over MQA on 8 or more.
def print_gpu(S=8192):
    """The comment above, computed. A GPU kernel's launch takes "on the order of microseconds"
    (Modal's GPU Glossary, "CUDA Graph": modal.com/gpu-glossary/host-software/cuda-graph)."""
    name, flop_rate, read_rate = H100
    h, dh, fewest = mha.LLAMA_HEADS, mha.LLAMA_D_HEAD, min(KV_HEADS)
    per_byte = [decode_flops(h, dh, S) / decode_bytes(kv, dh, S, 2) for kv in KV_HEADS]  # g
    n_bytes = decode_bytes(fewest, dh, S, 2)
    seconds, bound = roofline(decode_flops(h, dh, S), n_bytes, read_rate, flop_rate)
    print(f"\nOn an {name} ({flop_rate / 1e12:.0f} TFLOP/s dense bf16, "
          f"{read_rate / 1e12:.2f} TB/s: ridge {flop_rate / read_rate:.0f} FLOPs per byte) a bf16 "
          f"step does g FLOPs per byte,\n{min(per_byte):.0f} to {max(per_byte):.0f} here: every "
          "configuration is memory-bound there, at any batch, since each request reads its own "
          f"cache.\nAt batch 1 {mha.attention_kind(h, fewest)} at {S} tokens reads "
          f"{n_bytes / 1e6:.1f} MB a layer, {seconds * 1e6:.2f} us at {read_rate / 1e12:.2f} TB/s "
          f"({bound}-bound): about as long as launching\none GPU kernel takes (on the order of "
          "microseconds). The bytes saved show with many requests a step.")


# ------------------------------------------------------------------ main
def main(argv=None):
    args = parse_args(argv)        # a bad flag or --out-dir ends here, before any timing
    print(f"One decode step (T = 1) of a Llama-7B-shaped layer's attention: {mha.LLAMA_HEADS} "
          f"query heads, dh {mha.LLAMA_D_HEAD}, fp32, batch 1,\non {machine_name()}; each time the "
          f"best of {ROUNDS} interleaved rounds (several seconds).")
    timing = measure(CONTEXTS, KV_HEADS, ROUNDS)
    problems = contradictions(timing)
    print_steps(timing)
    print_longest(timing, problems)
    print_parts(timing)
    print_copy_trap(timing)
    print_gpu()
    path = os.path.join(args.out_dir, "decode_time.png")
    plot(timing, problems).savefig(path, dpi=100)
    print(f"\nFigure written to {os.path.relpath(path)}")
    return 0


# ------------------------------------------------------------------ the tables and the figure
def print_steps(timing):
    """Every step's time, and the share of its floor it reaches: floor / time."""
    print(f"\nStep time in ms (share of its floor reached), by cached tokens S; matmul "
          f"{timing.flop_rate / 1e9:.0f} GFLOP/s:")
    print("config " + "".join(f"{S:>14}" for S in timing.contexts))
    for kv in timing.kv_heads:
        times = [(timing.best["step", kv, S], timing.floor(kv, S)[0]) for S in timing.contexts]
        cells = [f"{t * 1e3:.3f} ({floor / t:.0%})" for t, floor in times]
        print(f"{mha.attention_kind(mha.LLAMA_HEADS, kv):<7}" + "".join(f"{c:>14}" for c in cells))


def print_longest(timing, problems):
    """The longest context in detail, each speed-up over MHA beside what the floors allow."""
    h, S, mha_kv = mha.LLAMA_HEADS, max(timing.contexts), max(timing.kv_heads)
    steps = {kv: timing.best["step", kv, S] for kv in timing.kv_heads}
    print(f"\nAt {S} tokens: floor = max(bytes / read rate, FLOPs / matmul rate), the read rate a "
          "sum's over the step's own K and V")
    print(f"{'config':<7}{'K+V MB':>8}{'FLOP/byte':>10}{'read GB/s':>10}{'ridge':>7}  {'bound':<8}"
          f"{'floor ms':>9}{'step ms':>9}{'reaches':>8}{'speed-up':>9}{'floors allow':>13}")
    for kv, step in steps.items():
        (floor, bound), rate = timing.floor(kv, S), timing.read_rate(kv, S)
        speedup, allowed = steps[mha_kv] / step, timing.floor(mha_kv, S)[0] / floor
        mb = decode_bytes(kv, mha.LLAMA_D_HEAD, S) / 1e6
        print(f"{mha.attention_kind(h, kv):<7}{mb:>8.1f}{h / kv / 2:>10.1f}{rate / 1e9:>10.1f}"
              f"{timing.flop_rate / rate:>7.1f}  {bound:<8}{floor * 1e3:>9.3f}{step * 1e3:>9.3f}"
              f"{floor / step:>8.0%}{speedup:>8.1f}x{allowed:>12.1f}x")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        print(f"NOT TRUSTWORTHY, the machine was busy while timing: {problems[0]}{more}")
        return
    fewest, kind = min(steps), mha.attention_kind(h, min(steps))
    print(f"These timings hold together. {kind} reads {mha_kv // fewest}x fewer bytes than "
          f"{mha.attention_kind(h, mha_kv)} and is {steps[mha_kv] / steps[fewest]:.1f}x faster; "
          f"its floor allows {timing.floor(mha_kv, S)[0] / timing.floor(fewest, S)[0]:.1f}x.")


def print_parts(timing):
    """The step's three parts at the longest context, each timed alone."""
    h, dh, S = mha.LLAMA_HEADS, mha.LLAMA_D_HEAD, max(timing.contexts)
    print(f"\nThe step's parts at {S} tokens, timed alone, ms: q k^T and p v, products of g query "
          "rows a K/V head, each with\nits GFLOP/s (the square matmul's: "
          f"{timing.flop_rate / 1e9:.0f}) and its GB/s of K or V read; the softmax, over h x S "
          "scores whatever kv is")
    print(f"{'config':<7}{'q k^T':>8}{'GFLOP/s':>9}{'GB/s':>6}{'softmax':>9}{'p v':>8}"
          f"{'GFLOP/s':>9}{'GB/s':>6}{'parts / step':>14}")
    flops = 2 * h * S * dh                                 # of one product
    for kv in timing.kv_heads:
        scores, softmax, values = [timing.best[part, kv, S] for part in ("q k^T", "softmax", "p v")]
        n_bytes = kv * S * dh * 4                          # of K, or of V: what one product reads
        cells = [f"{t * 1e3:>8.3f}{flops / t / 1e9:>9.0f}{n_bytes / t / 1e9:>6.0f}"
                 for t in (scores, values)]
        parts = (scores + softmax + values) / timing.best["step", kv, S]
        print(f"{mha.attention_kind(h, kv):<7}{cells[0]}{softmax * 1e3:>9.3f}{cells[1]}"
              f"{parts:>14.2f}")


def print_copy_trap(timing):
    """The textbook step, the grouped step and the fused call, side by side."""
    S = max(timing.contexts)
    print(f"\nThe copy trap at {S} tokens, ms: the textbook's repeat_interleave writes each K/V "
          "head out to its g query heads\n(a copy of the cache even for MHA, g = 1), "
          "mha.attend_grouped reads it in place, the fused call too (enable_gqa=True)")
    print(f"{'config':<7}{'textbook':>10}{'grouped':>9}{'fused':>8}")
    for kv in timing.kv_heads:
        book, grouped, one_call = (timing.best[w, kv, S] for w in ("textbook", "step", "fused"))
        kind = mha.attention_kind(mha.LLAMA_HEADS, kv)
        print(f"{kind:<7}{book * 1e3:>10.2f}{grouped * 1e3:>9.2f}"
              f"{one_call * 1e3:>8.2f}   grouped {book / grouped:.0f}x faster than copying, "
              f"{grouped / one_call:.2f}x the fused call's time")


def plot(timing, problems):
    """Left: step time against context, each floor dashed. Right: each configuration's roofline at
    the longest context, its roof set by its own read rate, and its step as a dot."""
    from matplotlib.figure import Figure
    h, dh, S = mha.LLAMA_HEADS, mha.LLAMA_D_HEAD, max(timing.contexts)
    fig = Figure(figsize=(12, 5))
    left, right = fig.subplots(1, 2)
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.11, top=0.84, wspace=0.22)
    intensity = [2.0 ** e for e in range(-3, 10)]          # FLOPs per byte, 1/8 to 512
    for i, kv in enumerate(timing.kv_heads):
        kind, color = mha.attention_kind(h, kv), f"C{i}"
        row = [timing.best["step", kv, s] for s in timing.contexts]
        left.plot(timing.contexts, [t * 1e3 for t in row], marker="o", color=color,
                  label=f"{kind} measured")
        floors = [timing.floor(kv, s)[0] * 1e3 for s in timing.contexts]
        left.plot(timing.contexts, floors, ls="--", color=color, label=f"{kind} floor")
        rate = timing.read_rate(kv, S)
        roof = [min(timing.flop_rate, rate * x) / 1e9 for x in intensity]
        right.plot(intensity, roof, color=color, lw=1,
                   label=f"{kind}'s roof: reads {rate / 1e9:.0f} GB/s")
        right.plot([h / kv / 2], [decode_flops(h, dh, S) / row[-1] / 1e9], "o", ms=8, color=color)
    log_axes(left, timing.contexts, [0.01, 0.1, 1, 10, 100], "cached tokens S",
             "ms per decode step")
    log_axes(right, [0.125, 0.5, 2, 4, 16, 64, 256], [1, 10, 100, 1000],
             "FLOPs per byte read (fp32 step: g / 2)", "GFLOP/s (the step's FLOPs / its time)")
    left.set_title("measured (solid) and its roofline floor (dashed)", fontsize=10)
    left.legend(fontsize=7, ncol=2)
    name, flop_rate, read_rate = H100
    right.axvline(flop_rate / read_rate, color="gray", ls=":", lw=1)
    right.text(flop_rate / read_rate, timing.flop_rate / 1e9 / 30, f"{name}'s ridge, bf16:\n"
               f"{flop_rate / read_rate:.0f} FLOPs per byte ", ha="right", fontsize=8)
    right.set_title(f"the roofline at {S} tokens: the dots are the steps (matmul "
                    f"{timing.flop_rate / 1e9:.0f} GFLOP/s)", fontsize=10)
    right.legend(fontsize=7, loc="lower right")
    title = (f"One decode step of a Llama-7B-shaped layer ({h} query heads, dh {dh}, fp32, "
             f"batch 1) on {machine_name()}")
    if problems:
        title += f"\nNOT TRUSTWORTHY: the machine was busy while timing ({problems[0]})"
    fig.suptitle(title, fontsize=11)
    return fig


def log_axes(ax, xticks, yticks, x_label, y_label):
    """Log-log axes with ticks at fixed places, labelled in plain numbers."""
    ax.set(xscale="log", yscale="log", xlabel=x_label, ylabel=y_label)
    ax.set_xticks(xticks, [f"{t:g}" for t in xticks])
    ax.set_yticks(yticks, [f"{t:g}" for t in yticks])
    ax.minorticks_off()


# ------------------------------------------------------------------ plumbing
def machine_name():
    """The CPU, as Linux names it, and PyTorch's threads: where the timings were taken."""
    import platform
    name = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        name = names[0] if names else name
    threads = torch.get_num_threads()
    return f"{name}, {threads} thread{'s' if threads > 1 else ''}"


def seconds_elsewhere():
    """(wall clock, CPU seconds other programs have run), from Linux's /proc/stat; else None."""
    try:
        with open("/proc/stat") as f:
            # user nice system idle iowait irq softirq steal
            ticks = [int(n) for n in f.readline().split()[1:9]]
    except OSError:
        return None
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    return time.perf_counter(), busy - time.process_time()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="decode.py",
                                     description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--out-dir", default=OUT_DIR,
                        help="folder for decode_time.png (default: figures/)")
    args = parser.parse_args(argv)
    try:
        os.makedirs(args.out_dir, exist_ok=True)
    except OSError as e:
        parser.exit(2, f"decode.py: error: --out-dir {args.out_dir} cannot be made: {e.strerror}\n")
    return args


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:                # python decode.py | head: the reader went away
        # As Python's docs on SIGPIPE advise:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
