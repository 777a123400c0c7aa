"""
What grouped-query (GQA) and multi-query (MQA) attention cost in quality, measured on real text, in minutes.

mha.py measures what sharing K/V heads saves (bytes, decode time). This file measures what it costs: it
trains a tiny character-level language model built around mha.CausalMHA on Python's own documentation and
reports validation loss in bits per character.

What this file shows, top to bottom:
  1. The data: the text of pydoc_data.topics, shipped with CPython (no download), split by position into
     training text and validation text (the last VAL_FRACTION of it).
  2. The model: pre-LayerNorm transformer blocks (attention, then an MLP), learned positions, 8 query heads.
  A. From scratch: MHA, GQA-4, GQA-2 and MQA, every configuration of a seed starting from the same
     initialisation and seeing the same batches, so the differences to MHA are paired by seed.
  B. Conversion (Ainslie et al. 2023, section 2.1): each trained MHA becomes GQA/MQA by mean-pooling its
     K/V heads (or keeping each group's first head, or starting them afresh), then trains a little more.
  C. Trained attention maps: every head of a trained MHA on a real passage, and what each head attends to.
  Figures: figures/quality.png and figures/trained_attention_maps.png.
  The models train in WORKERS processes side by side, one thread each (the section before main() says why).

What it deliberately does not do: claim the cost at scale. The model is tiny (d=64, two layers) and trained
for minutes, so its numbers are about this scale only, and at the default 1000 steps the seed spread is as
large as the gaps of GQA-4 and GQA-2 (the README also quotes a run with --steps 2500, where MQA's and
GQA-2's gaps stand clear of it). No dropout, no GPU, no tokenizer, no sampling of text.

Run it:   python quality.py                 (about 5 minutes on 2 CPU cores; writes figures/)
          python quality.py --steps 2500    (the longer run the README quotes, about 13 minutes)

Papers: Vaswani et al. 2017, "Attention Is All You Need", arXiv:1706.03762.
        Shazeer 2019, "Fast Transformer Decoding: One Write-Head Is All You Need", arXiv:1911.02150.
        Ainslie et al. 2023, "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head
        Checkpoints", arXiv:2305.13245.

Shapes, the alphabet of mha.py: B batch, T characters in a window, d model width, h query heads, kv K/V
heads, dh = d / h head width; and V, the number of distinct characters (the vocabulary).
"""

import argparse
import copy
import hashlib
import math
import multiprocessing
import os
import queue
import signal
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from torch import nn

import mha

# ----------------------------------------------------------------------------- knobs
D_MODEL = 64          # d: model width
N_HEADS = 8           # h: query heads, so each head is dh = 64 / 8 = 8 wide
N_LAYERS = 2          # transformer blocks
MLP_WIDTH = 256       # hidden units of each block's MLP (4 d)
CONTEXT = 64          # T: characters the model sees at once (and learned positions)
BATCH = 16            # B: windows per training step
STEPS = 1000          # training steps of each from-scratch model (--steps)
LR = 7e-3             # peak learning rate of AdamW; high, because the model is tiny and the budget short
WARMUP = 0.1          # fraction of the steps over which the learning rate rises linearly from 0 to LR
MIN_LR = 0.1          # the cosine decay ends at MIN_LR * LR
WEIGHT_DECAY = 0.1    # AdamW weight decay, on weight matrices only
CLIP = 1.0            # gradient norm is clipped to this
SEEDS = (0, 1, 2)     # one initialisation and one data order per seed (--seeds)
CONFIGS = {"MHA": 8, "GQA-4": 4, "GQA-2": 2, "MQA": 1}   # name: K/V heads of the 8-query-head model
POOLS = ("mean", "first", "random")    # how conversion makes a K/V head from its group (B)
UPTRAIN = (0.05, 0.10)                 # further training after conversion, as fractions of the steps
UPTRAIN_LR = LR / 4   # constant learning rate of that further training, after its warmup
UPTRAIN_WARMUP = 5    # steps of linear warmup of the further training (the optimizer starts afresh)
VAL_FRACTION = 0.1    # the last tenth of the text is validation
EVAL_WINDOWS = 256    # validation loss is the mean over these many windows, evenly spaced: 16,384 characters
PASSAGE = 36          # characters of the passage whose attention maps are drawn (C)
WORKERS = 2           # processes that train models side by side, one torch thread each (see "on both cores")
SLOW = 3.0            # a stretch of steps this many times slower than the run's fastest is flagged
PLAIN_EVERY = 5.0     # seconds between progress lines when stderr is not a terminal
BYTES_PER_NUMBER = 4  # the KV cache of this float32 model
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "figures")
FIGURES = ("quality.png", "trained_attention_maps.png")


# ----------------------------------------------------------------------------- the data
def load_text():
    """Python's documentation topics as one string, in sorted order of their names: about 465k characters."""
    from pydoc_data.topics import topics
    return "\n".join(topics[name] for name in sorted(topics))


def describe_text(text):
    """One line naming where the text came from, so that a run on another Python is not mistaken for this one."""
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
    return (f"pydoc_data.topics of Python {sys.version.split()[0]}: {len(text):,} characters, "
            f"{len(set(text))} distinct, sha256 {digest}")


class Data:
    """The text as character ids, split by position: train first, validation last."""

    def __init__(self, text):
        self.chars = sorted(set(text))                     # id -> character
        lookup = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
        cut = int(len(text) * (1 - VAL_FRACTION))
        self.train, self.val = ids[:cut], ids[cut:]
        self.val_text = text[cut:]
        # Evenly spaced validation windows, the same for every model: inputs x and next characters y.
        starts = torch.linspace(0, len(self.val) - CONTEXT - 1, EVAL_WINDOWS).long()
        self.val_x, self.val_y = windows(self.val, starts)  # (EVAL_WINDOWS, T) each

    def batches(self, seed, steps):
        """The training windows of every step, (steps, B) start positions, from the seed alone."""
        g = torch.Generator().manual_seed(seed)
        return torch.randint(len(self.train) - CONTEXT - 1, (steps, BATCH), generator=g)


def windows(ids, starts):
    """Inputs x: (B, T), the characters at starts .. starts + T - 1, and targets y: (B, T), one further on."""
    offsets = torch.arange(CONTEXT + 1)
    w = ids[starts[:, None] + offsets]                     # (B, T + 1)
    return w[:, :-1], w[:, 1:]


def baselines(data):
    """Validation bits/char of the unigram and bigram models of the training text (add-one smoothing).

    They bracket what any model should beat: no context, and one character of context.
    """
    V = len(data.chars)
    pairs = torch.zeros(V, V).index_put_((data.train[:-1], data.train[1:]), torch.tensor(1.0), accumulate=True)
    unigram = (pairs.sum(0) + 1) / (pairs.sum() + V)       # (V,), p(next)
    bigram = (pairs + 1) / (pairs.sum(1, keepdim=True) + V)  # (V, V), p(next | this)
    x, y = data.val_x.flatten(), data.val_y.flatten()
    return -unigram[y].log2().mean().item(), -bigram[x, y].log2().mean().item()


# ----------------------------------------------------------------------------- the model
class Block(nn.Module):
    """x + attention(LayerNorm(x)), then x + MLP(LayerNorm(x)): the pre-LayerNorm block of GPT-2."""

    def __init__(self, n_kv_heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.attn = mha.CausalMHA(D_MODEL, N_HEADS, n_kv_heads)
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, MLP_WIDTH), nn.GELU(), nn.Linear(MLP_WIDTH, D_MODEL))

    def forward(self, x, need_weights=False):              # x: (B, T, d)
        if need_weights:
            a, p = self.attn(self.ln1(x), need_weights=True)   # (B, T, d), (B, h, T, T)
        else:
            a, p = self.attn(self.ln1(x)), None
        x = x + a
        return x + self.mlp(self.ln2(x)), p                # (B, T, d)


class CharLM(nn.Module):
    """Characters in, the next character's logits out: embeddings + positions, blocks, LayerNorm, readout."""

    def __init__(self, vocab, n_kv_heads):
        super().__init__()
        self.embed = nn.Embedding(vocab, D_MODEL)
        self.pos = nn.Parameter(torch.zeros(CONTEXT, D_MODEL))   # (T, d), learned
        self.blocks = nn.ModuleList(Block(n_kv_heads) for _ in range(N_LAYERS))
        self.ln = nn.LayerNorm(D_MODEL)
        self.readout = nn.Linear(D_MODEL, vocab)
        with torch.no_grad():
            self.embed.weight.normal_(0.0, 0.02)
            self.pos.normal_(0.0, 0.02)

    @property
    def n_kv_heads(self):
        return self.blocks[0].attn.n_kv_heads

    def forward(self, x, need_weights=False):
        """x: (B, T) character ids -> logits (B, T, V), and with need_weights each layer's (B, h, T, T)."""
        h = self.embed(x) + self.pos[:x.shape[1]]          # (B, T, d)
        maps = []
        for block in self.blocks:
            h, p = block(h, need_weights)
            maps.append(p)
        logits = self.readout(self.ln(h))                  # (B, T, V)
        return (logits, maps) if need_weights else logits


def bits_per_char(logits, y):
    """Mean cross-entropy in bits: -log2 p(the true next character). logits (B, T, V), y (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()) / math.log(2)   # (B*T, V) against (B*T,)


def with_kv_heads(model, n_kv_heads, pool, seed=0):
    """A copy of model whose every attention has n_kv_heads K/V heads, made by CausalMHA.to_gqa.

    pool "mean" and "first" are to_gqa's; "random" keeps the queries and gives the new K/V heads fresh
    random weights (nn.Linear's own initial distribution), so the model must learn them again.
    """
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    for block in new.blocks:
        block.attn = block.attn.to_gqa(n_kv_heads, "first" if pool == "random" else pool)
        if pool == "random":
            rows = slice(N_HEADS * block.attn.d_head, None)     # every K row, then every V row
            bound = 1 / math.sqrt(D_MODEL)                      # nn.Linear's U(-1/sqrt(d), 1/sqrt(d))
            with torch.no_grad():
                for t in (block.attn.in_proj.weight, block.attn.in_proj.bias):
                    t[rows] = torch.rand(t[rows].shape, generator=g) * 2 * bound - bound
    return new


def fresh_models(vocab, seed):
    """{config: model} of one seed, all from one initialisation.

    The MHA is drawn from the seed; every other configuration is that MHA with, in each group of K/V
    heads, the first one kept (to_gqa pool="first"). The kept heads have exactly the distribution of a
    freshly made CausalMHA, and everything else (queries, MLP, embeddings) is the same to the bit.
    """
    torch.manual_seed(seed)
    base = CharLM(vocab, N_HEADS)
    return {name: base if kv == N_HEADS else with_kv_heads(base, kv, "first") for name, kv in CONFIGS.items()}


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def cache_bytes_per_token(model):
    """KV-cache bytes one token adds: 2 (K and V) x layers x K/V heads x dh x 4 bytes (float32)."""
    return mha.kv_cache_bytes(N_LAYERS, model.n_kv_heads, D_MODEL // N_HEADS, 1, bytes_per_elem=BYTES_PER_NUMBER)


# ----------------------------------------------------------------------------- training
def lr_at(step, steps):
    """Linear warmup over WARMUP * steps, then cosine from LR down to MIN_LR * LR at the last step."""
    warm = max(1, round(WARMUP * steps))
    if step < warm:
        return LR * (step + 1) / warm
    done = (step - warm) / max(1, steps - 1 - warm)        # 0 .. 1
    return LR * (MIN_LR + (1 - MIN_LR) * 0.5 * (1 + math.cos(math.pi * done)))


def uptrain_lr_at(step, steps):
    """Further training after conversion: a short linear warmup, then constant UPTRAIN_LR."""
    return UPTRAIN_LR * min(1.0, (step + 1) / UPTRAIN_WARMUP)


def optimizer(model):
    """AdamW with weight decay on the weight matrices only (not on biases, LayerNorms or positions)."""
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and n != "pos"]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and n != "pos")]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}],
                             lr=LR, betas=(0.9, 0.95))


def train(model, data, starts, schedule, progress, label, evaluate_at=()):
    """Train model in place on the windows at starts (steps, B); return {step: validation bits/char}.

    schedule(step, steps) gives each step's learning rate. Validation is measured before the steps listed
    in evaluate_at (a step equal to len(starts) means after the last). progress.step() hears of every step:
    a Progress line here, or in a worker a Report that sends it to the main process's line.
    """
    steps, opt, curve = len(starts), optimizer(model), {}
    model.train()
    for step in range(steps + 1):
        if step in evaluate_at:
            curve[step] = evaluate(model, data)
        if step == steps:
            break
        for group in opt.param_groups:
            group["lr"] = schedule(step, steps)
        t0 = time.perf_counter()
        x, y = windows(data.train, starts[step])           # (B, T), (B, T)
        loss = bits_per_char(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        progress.step(label, step + 1, steps, loss.item(), time.perf_counter() - t0)
    return curve


@torch.no_grad()
def evaluate(model, data):
    """Validation bits per character over the EVAL_WINDOWS fixed windows, in chunks of 64 windows."""
    model.eval()
    total = 0.0
    for i in range(0, EVAL_WINDOWS, 64):
        x, y = data.val_x[i:i + 64], data.val_y[i:i + 64]  # (64, T) each
        total += bits_per_char(model(x), y).item() * len(x)
    model.train()
    return total / EVAL_WINDOWS


# ----------------------------------------------------------------------------- the progress line
def clock(seconds):
    """clock(75.3) == '1:15'."""
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


class Progress:
    """One line on stderr: what trains, its step and loss, the time so far and left, and a warning if slow.

    On a terminal the line is rewritten in place; otherwise (a pipe, a file) a plain line is written every
    PLAIN_EVERY seconds. The pace is watched in stretches of 10 training steps: a stretch SLOW times slower
    than the fastest so far means another process is using the cores, and the line says so.
    """

    def __init__(self, total_steps, stream=sys.stderr):
        self.total, self.done, self.stream = total_steps, 0, stream
        self.tty = stream.isatty()
        self.start = self.last_print = time.perf_counter()
        self.first = None                                  # when the first step began (workers start slowly)
        self.stretch = []                                  # seconds of the steps of the current stretch
        self.fastest = self.slowest = None                 # seconds per step, over whole stretches
        self.slowdown = 1.0                                # the last stretch against the fastest
        self.width = 0

    def step(self, label, step, steps, loss, seconds):
        self.done += 1
        self.first = self.first or time.perf_counter() - seconds
        self.stretch.append(seconds)
        if len(self.stretch) == 10:
            pace = sum(self.stretch) / 10
            self.stretch = []
            self.fastest = min(pace, self.fastest or pace)
            self.slowest = max(pace, self.slowest or pace)
            self.slowdown = pace / self.fastest
        now = time.perf_counter()
        if now - self.last_print < (0.2 if self.tty else PLAIN_EVERY):
            return
        self.last_print = now
        elapsed = now - self.start
        left = (now - self.first) / self.done * (self.total - self.done)
        line = (f"{label:<22} step {step:>5}/{steps:<5} loss {loss:5.3f} bits/char  elapsed {clock(elapsed)}  "
                f"left ~{clock(left)}")
        if self.slowdown >= SLOW:
            line += f"  SLOW: steps take {self.slowdown:.0f}x as long as earlier in this run (cores busy?)"
        if self.tty:
            self.stream.write("\r" + line.ljust(self.width))
            self.width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def clear(self):
        """Remove the rewritten line before the tables are printed to the same terminal."""
        if self.tty and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0

    def summary(self):
        """The wall time, and the fastest and slowest pace, so that a busy machine shows in the output."""
        minutes = (time.perf_counter() - self.start) / 60
        text = f"time: {minutes:.1f} min, {WORKERS} worker{'s' * (WORKERS > 1)} of 1 thread"
        if self.fastest:
            text += (f"; a training step took {self.fastest * 1e3:.0f} ms at the fastest, "
                     f"{self.slowest * 1e3:.0f} ms at the slowest (means over stretches of 10 steps)")
        return text


# ----------------------------------------------------------------------------- A. from scratch
def average(values):
    """The mean over seeds, sum / n: one definition, so every table and panel rounds alike."""
    return sum(values) / len(values)


def spread(values):
    """Standard deviation over seeds (n - 1 in the denominator); None for a single seed."""
    if len(values) < 2:
        return None
    mean = average(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def pm(values, sign=""):
    """'2.538 +/- 0.034' (mean and spread over seeds), or '2.538' with one seed; sign="+" shows the sign."""
    mean, s = average(values), spread(values)
    return f"{mean:{sign}.3f} +/- {s:.3f}" if s is not None else f"{mean:{sign}.3f}"


def verdict(diffs):
    """The paired difference to MHA against its spread over seeds, in words."""
    mean, s = average(diffs), spread(diffs)
    if s is None:
        return "one seed: no spread to judge noise by"
    if abs(mean) <= s:
        return "within noise"
    return f"{'worse' if mean > 0 else 'better'} than MHA, {abs(mean) / max(s, 1e-12):.1f}x the spread"


def run_from_scratch(data, seeds, steps, workers):
    """Train every configuration of every seed. Returns {seed: {config: (model, final bits/char, curve)}}."""
    tasks = [(name, seed, steps) for name in CONFIGS for seed in seeds]    # the longest (MHA) first
    done = workers.run(train_from_scratch, tasks)
    results = {seed: {} for seed in seeds}
    for (name, seed, _), (weights, curve) in zip(tasks, done):
        model = CharLM(len(data.chars), CONFIGS[name])
        model.load_state_dict(weights)
        results[seed][name] = (model, curve[steps], curve)
    return results


def train_from_scratch(name, seed, steps):
    """One from-scratch model, as a worker trains it (WORKER holds the worker's data, see "on both cores"):
    returns its weights and its validation curve."""
    data = WORKER["data"]
    model = fresh_models(len(data.chars), seed)[name]
    marks = {round(steps * k / 8) for k in range(9)}       # validation along the way, for the gap along training
    curve = train(model, data, data.batches(seed, steps), lr_at, WORKER["report"], f"A {name} seed {seed}",
                  evaluate_at=marks)
    return model.state_dict(), curve


def print_table_a(results, steps):
    seeds = list(results)
    print(f"\nA. From scratch: {steps} steps, {len(seeds)} seed{'s' * (len(seeds) > 1)} "
          f"({', '.join(map(str, seeds))}); validation bits/char, mean +/- standard deviation over seeds")
    print("   paired: each seed's configurations share their initialisation and every batch")
    print(f"   {'config':<7}{'K/V heads':>10}{'params':>9}{'KV bytes/token':>16}{'val bits/char':>22}"
          f"{'minus MHA, paired':>24}  verdict")
    for name, kv in CONFIGS.items():
        model = results[seeds[0]][name][0]
        losses = [results[s][name][1] for s in seeds]
        diffs = [results[s][name][1] - results[s]["MHA"][1] for s in seeds]
        paired = "" if name == "MHA" else pm(diffs, "+")
        judged = "" if name == "MHA" else verdict(diffs)
        print(f"   {name:<7}{kv:>10}{n_params(model):>9,}{cache_bytes_per_token(model):>16,}{pm(losses):>22}"
              f"{paired:>24}  {judged}".rstrip())


# ----------------------------------------------------------------------------- B. conversion
def run_conversion(scratch, steps, workers):
    """Convert each seed's trained MHA to every smaller configuration with every pool, and train on.

    Returns {seed: {(config, pool): {step: bits/char}}}, steps counted from the conversion. The further
    training sees the batches that come after the original steps in the seed's data order, the same for
    every conversion of a seed; ("MHA", "none") is the trained MHA itself, trained on the same way.
    """
    targets = [("MHA", "none")] + [(n, p) for n in CONFIGS if n != "MHA" for p in POOLS]
    tasks = [(name, pool, seed, steps, runs["MHA"][0].state_dict())
             for seed, runs in scratch.items() for name, pool in targets]
    done = workers.run(convert_and_train, tasks)
    curves = {seed: {} for seed in scratch}
    for (name, pool, seed, _, _), curve in zip(tasks, done):
        curves[seed][name, pool] = curve
    return curves, uptrain_steps(steps)


def uptrain_steps(steps):
    """The further training after conversion, in steps: UPTRAIN of the original steps, at least 1 each."""
    return [max(1, round(f * steps)) for f in UPTRAIN]


def convert_and_train(name, pool, seed, steps, mha_weights):
    """One conversion, as a worker runs it: the trained MHA to config by pool, then the further training."""
    data, up = WORKER["data"], uptrain_steps(steps)
    trained = CharLM(len(data.chars), N_HEADS)
    trained.load_state_dict(mha_weights)
    model = trained if pool == "none" else with_kv_heads(trained, CONFIGS[name], pool, seed)
    starts = data.batches(seed, steps + up[-1])[steps:]
    return train(model, data, starts, uptrain_lr_at, WORKER["report"], f"B {name} {pool} seed {seed}",
                 evaluate_at={0, *up})


def print_table_b(curves, scratch, steps, up):
    seeds = list(curves)
    print(f"\nB. Conversion of each trained MHA (Ainslie et al. 2023, section 2.1), then further training at "
          f"lr {UPTRAIN_LR:g}\n   validation bits/char, mean over {len(seeds)} seed{'s' * (len(seeds) > 1)}; "
          f"+{UPTRAIN[0]:.0%} = {up[0]} steps, +{UPTRAIN[1]:.0%} = {up[1]} steps more than the {steps} of A")
    print(f"   {'config':<7}{'K/V from':<13}{'right after':>12}{f'+{UPTRAIN[0]:.0%}':>8}{f'+{UPTRAIN[1]:.0%}':>8}"
          f"{'from scratch (A)':>18}")

    for (name, pool) in curves[seeds[0]]:
        cells = "".join(f"{average([curves[s][name, pool][k] for s in seeds]):>{w}.3f}"
                        for k, w in ((0, 12), (up[0], 8), (up[1], 8)))
        scratch_loss = average([scratch[s][name][1] for s in seeds])
        label = "(trained)" if pool == "none" else pool + (" pool" if pool == "mean" else "")
        print(f"   {name:<7}{label:<13}{cells}{scratch_loss:>18.3f}")
    # Two findings of Ainslie et al. (their Figure 4), checked against the numbers above.
    targets = [n for n in CONFIGS if n != "MHA"]
    beats = {n: average([curves[s][n, "mean"][0] for s in seeds]) < average([curves[s][n, "random"][0] for s in seeds])
             for n in targets}
    gap = average([curves[s][n, "first"][up[1]] - curves[s][n, "mean"][up[1]] for s in seeds for n in targets])
    print(f"   right after conversion, mean pool beats random K/V for every target: "
          f"{'yes' if all(beats.values()) else 'NO (' + ', '.join(n for n, b in beats.items() if not b) + ')'}")
    print(f"   after +{UPTRAIN[1]:.0%}, mean pool beats first head on average over targets and seeds: "
          f"{'yes' if gap > 0 else 'NO'}, by {gap:+.3f} bits/char")


# ----------------------------------------------------------------------------- C. trained attention maps
def passage_start(text):
    """The first line of the text that opens with a capital and runs PASSAGE characters of plain prose."""
    plain = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ,.")
    for i in range(1, len(text) - PASSAGE):
        if text[i - 1] == "\n" and text[i].isupper() and set(text[i:i + PASSAGE]) <= plain:
            return i
    raise ValueError(f"no line of {PASSAGE} characters of plain prose in the validation text")


def head_roles(model, data):
    """Mean attention of every head on four kinds of key over all validation windows, and the same for
    uniform causal attention (every key so far alike): the level a head reaches by favouring nothing.

    Returns ({role: (layers, h) tensor}, {role: float}). Roles: the previous character, the character
    itself, whitespace (spaces and newlines), and the first character of the current word (just after the
    last whitespace). Uniform attention puts 28% of itself on whitespace here, about the share of whitespace
    in the text: a head at 28% on whitespace favours nothing.
    """
    x = data.val_x                                          # (N, T)
    with torch.no_grad():
        model.eval()
        _, maps = model(x, need_weights=True)               # each (N, h, T, T)
        model.train()
    N, T = x.shape
    space = torch.tensor([c.isspace() for c in data.chars])[x]        # (N, T)
    pos = torch.arange(T).expand_as(x)                                 # (N, T)
    # The start of the word that holds position i: the latest j <= i with j == 0 or a space at j - 1.
    after_space = torch.cat([torch.ones_like(space[:, :1]), space[:, :-1]], dim=1)   # (N, T)
    word_start = torch.where(after_space, pos, torch.zeros_like(pos)).cummax(dim=1).values  # (N, T)
    keys = torch.arange(T)
    masks = {
        "previous": (keys[None, :] == keys[:, None] - 1).expand(N, T, T),            # (N, T, T)
        "itself": (keys[None, :] == keys[:, None]).expand(N, T, T),
        "whitespace": space[:, None, :].expand(N, T, T),
        "word start": keys[None, None, :] == word_start[:, :, None],
    }

    def on(p, m):                                           # p (N, h, T, T), m (N, T, T) -> (h,)
        return (p * m[:, None].float())[:, :, 1:].sum(-1).mean((0, 2))   # row 0 can only see itself

    uniform = torch.tril(torch.ones(T, T)) / (keys[:, None] + 1)       # (T, T): row i is 1/(i+1) on keys 0..i
    roles = {role: torch.stack([on(p, m) for p in maps]) for role, m in masks.items()}   # (layers, h) each
    chance = {role: on(uniform.expand(N, 1, T, T), m).item() for role, m in masks.items()}
    return roles, chance


def print_table_c(roles, chance, seed):
    prev = roles["previous"]
    layer, head = divmod(int(prev.argmax()), N_HEADS)
    print(f"\nC. What each head of the trained MHA attends to (seed {seed}): mean attention on each kind "
          f"of key,\n   over {EVAL_WINDOWS * CONTEXT:,} validation characters. 'uniform' attends to every key so "
          "far alike; 'strongest' is\n   the kind of key a head favours most, as a multiple of that uniform level")
    print(f"   {'layer':>5}{'head':>5}" + "".join(f"{role:>12}" for role in roles) + "   strongest")
    print((f"   {'uniform':>10}" + "".join(f"{chance[r]:>11.0%} " for r in roles)).rstrip())
    for i in range(N_LAYERS):
        for j in range(N_HEADS):
            ratios = {r: roles[r][i, j].item() / chance[r] for r in roles}
            top = max(ratios, key=ratios.get)
            print(f"   {i:>5}{j:>5}" + "".join(f"{roles[r][i, j].item():>11.0%} " for r in roles)
                  + f"  {top}, {ratios[top]:.1f}x uniform")
    print(f"   most previous-character-like: layer {layer} head {head}, {prev[layer, head]:.0%} of its attention "
          "on the character just before")
    return layer, head


# ----------------------------------------------------------------------------- figures
COLORS = {"MHA": "tab:red", "GQA-4": "tab:green", "GQA-2": "tab:purple", "MQA": "tab:blue"}
POOL_STYLE = {"mean": "-", "first": "--", "random": ":"}


def plot_quality(scratch, curves, steps, up):
    """Left: loss against KV-cache bytes per token. Middle: the paired gap to MHA along training (does it
    close with more steps?). Right: conversion curves."""
    seeds = list(scratch)
    fig = mha.new_figure(16, 5)
    left, middle, right = fig.subplots(1, 3)
    for name in CONFIGS:
        b = cache_bytes_per_token(scratch[seeds[0]][name][0])
        losses = [scratch[s][name][1] for s in seeds]
        mean, s = average(losses), spread(losses) or 0.0
        left.errorbar([b], [mean], yerr=[s], marker="o", capsize=4, color=COLORS[name], label=name)
        left.scatter([b] * len(losses), losses, s=8, color=COLORS[name], alpha=0.4)
        left.annotate(name, (b, mean), textcoords="offset points", xytext=(8, 4), fontsize=9)
        if name == "MHA":
            middle.axhline(0.0, color=COLORS[name], lw=1, label="MHA")
            continue
        marks = sorted(k for k in scratch[seeds[0]][name][2] if k > 0)
        gaps = [[scratch[s][name][2][k] - scratch[s]["MHA"][2][k] for s in seeds] for k in marks]  # paired
        mean = [average(g) for g in gaps]
        middle.plot(marks, mean, color=COLORS[name], marker="o", ms=3, label=name)
        if len(seeds) > 1:
            sd = [spread(g) for g in gaps]
            middle.fill_between(marks, [m - d for m, d in zip(mean, sd)], [m + d for m, d in zip(mean, sd)],
                                color=COLORS[name], alpha=0.12, lw=0)
    left.set_xscale("log", base=2)
    ticks = sorted(cache_bytes_per_token(scratch[seeds[0]][n][0]) for n in CONFIGS)
    left.set_xticks(ticks, [str(t) for t in ticks])
    left.minorticks_off()
    left.set_xlabel("KV cache per token (bytes, float32)")
    left.set_ylabel("validation loss (bits/char)")
    left.set_title(f"From scratch, {steps} steps: mean +/- sd over {len(seeds)} seed(s), dots = seeds", fontsize=9)
    middle.set_xlabel("training step")
    middle.set_ylabel("validation loss minus MHA's, same seed (bits/char)")
    middle.set_title(f"From scratch: the gap to MHA along training, mean over {len(seeds)} seed(s), "
                     "band +/- sd", fontsize=9)
    middle.legend(fontsize=8)
    for name in CONFIGS:
        if name == "MHA":
            pools = ["none"]
        else:
            pools = POOLS
        for pool in pools:
            marks = sorted(curves[seeds[0]][name, pool])
            mean = [average([curves[s][name, pool][k] for s in seeds]) for k in marks]
            label = "MHA, not converted" if pool == "none" else f"{name} {pool}"
            right.plot([steps + k for k in marks], mean, color=COLORS[name], ls=POOL_STYLE.get(pool, "-"),
                       marker="o", ms=3, label=label)
        scratch_mean = average([scratch[s][name][1] for s in seeds])
        right.axhline(scratch_mean, color=COLORS[name], lw=0.8, alpha=0.6)
    right.set_xlabel(f"training steps (the MHA's {steps}, then further training)")
    right.set_ylabel("validation loss (bits/char)")
    right.set_title("Converted from the trained MHA, mean over seeds;\nthin lines: each config from scratch",
                    fontsize=9)
    right.legend(fontsize=7, ncol=2)
    fig.suptitle(f"What sharing K/V heads costs: character-level LM on pydoc_data.topics, d={D_MODEL}, "
                 f"{N_HEADS} query heads, {N_LAYERS} layers, T={CONTEXT}, batch {BATCH}", fontsize=11)
    fig.tight_layout()
    return fig


def shown(c):
    """How a character appears as a tick label: a space as an open box, a newline as a return arrow."""
    return {" ": "\u2423", "\n": "\u21b5"}.get(c, c)


def plot_trained_maps(model, data, seed, steps, best):
    """Every head of the trained MHA on a real passage from the validation text, characters as ticks."""
    start = passage_start(data.val_text)
    text = data.val_text[start:start + PASSAGE]
    x = data.val[start:start + PASSAGE][None]               # (1, T)
    with torch.no_grad():
        model.eval()
        _, maps = model(x, need_weights=True)               # each (1, h, T, T)
        model.train()
    cols, rows = 4, N_LAYERS * N_HEADS // 4
    fig = mha.new_figure(3.2 * cols + 1, 3.2 * rows + 0.8)
    axes = fig.subplots(rows, cols, squeeze=False)
    labels = [shown(c) for c in text]
    for k, ax in enumerate(axes.flat):
        layer, head = divmod(k, N_HEADS)
        im = ax.imshow(maps[layer][0, head].numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
        ax.set_title(f"layer {layer} head {head}" + ("  (previous char)" if (layer, head) == best else ""),
                     fontsize=9, fontweight="bold" if (layer, head) == best else "normal")
        ax.set_xticks(range(len(text)), labels, fontsize=5)
        ax.set_yticks(range(len(text)), labels, fontsize=5)
        ax.tick_params(length=0, pad=1)
    fig.subplots_adjust(left=0.03, right=0.92, bottom=0.03, top=1 - 1.0 / (3.2 * rows + 0.8), wspace=0.15,
                        hspace=0.25)
    fig.colorbar(im, cax=fig.add_axes([0.935, 0.2, 0.012, 0.6]), label="attention probability")
    layer, head = best
    p = maps[layer][0, head]
    fig.suptitle(f"Trained MHA (d={D_MODEL}, {N_HEADS} heads, {N_LAYERS} layers, {steps} steps, seed {seed}), every "
                 "head on a validation passage; rows: query character, columns: key character\n"
                 f"layer {layer} head {head} is the most previous-character-like: {torch.diagonal(p, -1).mean():.0%} "
                 "of its attention here on the character just before", fontsize=11)
    return fig


# ----------------------------------------------------------------------------- on both cores
# A model this small splits badly over threads: on the 2-core machine this was written on, a training step
# took 26 ms on two threads and 38 ms on one, while two processes of one thread each, side by side, took
# 37 ms a step each: 1.4 times the work done per second. So every model trains in a worker process on
# exactly one thread, WORKERS at a time. A model's numbers depend only on its task (configuration, seed,
# steps), never on which worker ran it or how many workers there are.

WORKER = {}   # in a worker process: the data, and where its progress goes


def work(inbox, outbox):
    """A worker's life: one thread, the data, then tasks from inbox until it is stopped.

    Everything it says goes to outbox: ("step", ...) for the progress line, ("done", i, result) for task i,
    or ("failed", traceback) if a task raised, so the main process can stop at once instead of at the end.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)           # Ctrl-C is the main process's to handle
    torch.set_num_threads(1)
    WORKER["data"], WORKER["report"] = Data(load_text()), Report(outbox)
    while True:
        i, fn, task = inbox.get()
        try:
            outbox.put(("done", i, fn(*task)))
        except Exception:  # noqa: BLE001 -- whatever it is, the main process raises it with this traceback
            outbox.put(("failed", traceback.format_exc()))


class Report:
    """Stands in for the progress line inside a worker: train() calls step(), the main process prints."""

    def __init__(self, outbox):
        self.outbox = outbox

    def step(self, *args):
        self.outbox.put(("step", *args))


class Workers:
    """n worker processes that run tasks, while the main process keeps the progress line up to date."""

    def __init__(self, n, progress):
        context = multiprocessing.get_context("spawn")    # a fresh interpreter: no threads or locks inherited
        self.inbox, self.outbox, self.progress = context.Queue(), context.Queue(), progress
        self.processes = [context.Process(target=work, args=(self.inbox, self.outbox), daemon=True)
                          for _ in range(n)]
        ctrl_c = signal.signal(signal.SIGINT, signal.SIG_IGN)   # a worker is born ignoring Ctrl-C, so one
        try:                                                     # pressed while it starts cannot reach it
            for p in self.processes:
                p.start()
        finally:
            signal.signal(signal.SIGINT, ctrl_c)

    def run(self, fn, tasks):
        """fn(*task) for every task, spread over the workers; the results in the order of the tasks."""
        for i, task in enumerate(tasks):
            self.inbox.put((i, fn, task))
        results = {}
        while len(results) < len(tasks):
            for p in self.processes:                       # checked on every message: the others keep talking
                if not p.is_alive():
                    raise ChildProcessError(f"a worker process stopped (exit code {p.exitcode}: killed, or "
                                            "out of memory?) before its models were trained")
            try:
                kind, *message = self.outbox.get(timeout=0.5)
            except queue.Empty:
                continue
            if kind == "step":
                self.progress.step(*message)
            elif kind == "failed":
                raise RuntimeError(f"a worker process failed:\n{message[0]}")
            else:
                results[message[0]] = message[1]
        return [results[i] for i in range(len(tasks))]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.processes:                           # idle or not: nothing they hold is needed now
            p.terminate()
        for p in self.processes:
            p.join()


# ----------------------------------------------------------------------------- main
def whole_positive(text):
    """argparse type for --steps: a positive whole number, or one line naming the value and the rule."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 1 <= value <= 100_000:      # 100,000 steps: about an hour for each model
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive whole number, at most 100,000")
    return value


def seed_value(text):
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number from 0 to 2**32 - 1")
    return value


def parse_args(argv=None):
    parser = mha.Parser(prog="quality.py", description="Train a tiny character-level LM with MHA, GQA and MQA and "
                    "measure what sharing K/V heads costs in validation loss.",
                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=whole_positive, default=STEPS,
                        help="training steps of each from-scratch model; further training after conversion is "
                             f"{UPTRAIN[0] * 100:g}%% and {UPTRAIN[1] * 100:g}%% of it")   # %% is argparse's %
    parser.add_argument("--seeds", type=seed_value, nargs="+", default=list(SEEDS),
                        help="one or more seeds: each gives an initialisation and a data order")
    parser.add_argument("--out-dir", default=OUT_DIR, help="folder the two figures are written to")
    args = parser.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds {' '.join(map(str, args.seeds))} must be different from each other")
    return args


def train_everything(args, workers, progress):
    """The data, then parts A and B on the workers, each table printed as soon as it is known."""
    text = load_text()
    data = Data(text)
    unigram, bigram = baselines(data)
    print(f"What GQA and MQA cost in quality: a character-level LM, d={D_MODEL}, {N_HEADS} query heads of "
          f"width {D_MODEL // N_HEADS}, {N_LAYERS} layers, T={CONTEXT}, batch {BATCH}")
    print(f"data: {describe_text(text)}")
    print(f"      train {len(data.train):,} characters, validation {len(data.val):,} (the last "
          f"{VAL_FRACTION:.0%}); the loss is measured on {EVAL_WINDOWS} windows = {EVAL_WINDOWS * CONTEXT:,} "
          "characters")
    print(f"      validation bits/char of a unigram model {unigram:.2f}, of a bigram model {bigram:.2f}")
    print(f"torch {torch.__version__}, {WORKERS} worker process{'es' * (WORKERS > 1)} of 1 thread each: the same "
          "seeds give the same numbers to the bit, whatever the number of workers")
    sys.stdout.flush()

    scratch = run_from_scratch(data, args.seeds, args.steps, workers)
    progress.clear()
    print_table_a(scratch, args.steps)
    sys.stdout.flush()

    curves, up = run_conversion(scratch, args.steps, workers)
    progress.clear()
    print_table_b(curves, scratch, args.steps, up)
    return scratch, curves, up, data


def main(argv=None):
    args = parse_args(argv)
    problem = mha.out_dir_problem(args.out_dir, FIGURES)
    if problem:
        print(f"quality.py: error: {problem}", file=sys.stderr)
        return 1
    torch.set_num_threads(1)                               # table C and the maps, like every model: one thread
    up_steps = uptrain_steps(args.steps)[-1]
    conversions = 1 + (len(CONFIGS) - 1) * len(POOLS)
    progress = Progress(len(args.seeds) * (len(CONFIGS) * args.steps + conversions * up_steps))
    try:
        with Workers(WORKERS, progress) as workers:        # they start while the data is read here
            scratch, curves, up, data = train_everything(args, workers, progress)
    except ChildProcessError as e:
        progress.clear()
        print(f"quality.py: error: {e}; nothing was written", file=sys.stderr)
        return 1

    trained = scratch[args.seeds[0]]["MHA"][0]
    best = print_table_c(*head_roles(trained, data), args.seeds[0])
    figures = [plot_quality(scratch, curves, args.steps, up),
               plot_trained_maps(trained, data, args.seeds[0], args.steps, best)]
    pngs = {name: mha.png_bytes(fig) for name, fig in zip(FIGURES, figures)}
    if not mha.write_figures("quality.py", args.out_dir, pngs):
        return 1
    print(f"\nFigures written to {mha.shown_path(args.out_dir)}: {', '.join(FIGURES)}")
    print(progress.summary())
    return 0


if __name__ == "__main__":
    mha.run_as_script(main)     # ends quietly if the reader goes away (python quality.py | head)
