"""
What grouped-query (GQA) and multi-query (MQA) attention cost in quality, measured on real text, in minutes.

mha.py measures what sharing K/V heads saves (bytes, decode time). This file measures what it costs: it
trains a tiny character-level language model built around mha.CausalMHA on Python's own documentation and
reports validation loss in bits per character, with a 95 % confidence interval for every comparison.

What this file shows, top to bottom:
  1. The data: the text of pydoc_data.topics, shipped with CPython (no download), split by position into
     training text and validation text (the last VAL_FRACTION of it).
  2. The model: pre-LayerNorm transformer blocks (attention, then an MLP), learned positions, 8 query heads.
  3. Paired differences and their 95 % intervals (Student's t), from which every verdict follows.
  A. From scratch: MHA, GQA-4, GQA-2 and MQA, every configuration of a seed starting from the same
     initialisation and seeing the same batches, so the differences to MHA are paired by seed.
  B. Conversion (Ainslie et al. 2023, section 2.1): each trained MHA becomes GQA/MQA by mean-pooling its
     K/V heads (or keeping each group's first head, or starting them afresh), then trains a little more.
  C. Trained attention maps: every head of a trained MHA on a real passage, and what each head attends to.
  D. Head ablation (Michel et al. 2019): how much the trained MHA needs each head, how many can go, and
     whether C's roles predict it.
  Figures: figures/quality.png and figures/trained_attention_maps.png.
  The models train in WORKERS processes side by side, one thread each (the section before main() says why).

What it deliberately does not do: claim the cost at scale. The model is tiny (d=64, two layers) and trained
for minutes, so its numbers are about this scale only; and the default run, which fits 6 minutes on 2 cores,
resolves none of the costs from scratch (their 95 % intervals include zero): the longer run below resolves
MQA's. No dropout, no GPU, no tokenizer, no sampling of text.

Run it:   python quality.py                 (about 5 minutes on 2 CPU cores; writes figures/)
          python quality.py --steps 2500    (the longer run, about 13 minutes)

Papers: Vaswani et al. 2017, "Attention Is All You Need", arXiv:1706.03762.
        Shazeer 2019, "Fast Transformer Decoding: One Write-Head Is All You Need", arXiv:1911.02150.
        Ainslie et al. 2023, "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head
        Checkpoints", arXiv:2305.13245.
        Michel, Levy and Neubig 2019, "Are Sixteen Heads Really Better than One?", arXiv:1905.10650.

Shapes, the alphabet of mha.py: B batch, T characters in a window, d model width, h query heads, kv K/V
heads, dh = d / h head width; and V, the number of distinct characters (the vocabulary).
"""

import argparse
import concurrent.futures
import copy
import ctypes
import hashlib
import math
import multiprocessing
import os
import signal
import sys
import threading
import time

try:                                    # Ctrl-C while torch loads, in the first second: one line, not 39
    import torch
    import torch.nn.functional as F
    from torch import nn

    import mha
except KeyboardInterrupt:
    if __name__ != "__main__":
        raise
    print(f"\n{os.path.basename(sys.argv[0])}: interrupted", file=sys.stderr)
    sys.exit(130)

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
PRUNE_MARKS = (1, 2, 4, 8, 12)         # D: the pruning curve is printed after these many heads are gone
PRUNE_LIMIT = 0.05    # D: how many heads can go before the loss rises by more than this (bits/char)
WORKERS = 2           # processes that train models side by side, one torch thread each (see "on both cores")
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


def train(model, data, starts, schedule, evaluate_at=(), tick=None):
    """Train model in place on the windows at starts (steps, B); return {step: validation bits/char}.

    schedule(step, steps) gives each step's learning rate. Validation is measured before the steps listed
    in evaluate_at (a step equal to len(starts) means after the last). tick(), if given, is called after
    every step with the step's seconds: in a worker it counts the step for the progress line.
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
        if tick:
            tick(time.perf_counter() - t0)
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


# ----------------------------------------------------------------------------- paired differences, 95 % intervals
# Every comparison here is paired: two models of one seed share their initialisation and every batch, so
# their difference on the same validation windows cancels most of what the seed alone decides. Over n
# seeds the differences have a mean and a standard deviation sd, and the mean's 95 % confidence interval
# is   mean +/- t(0.975, n - 1) * sd / sqrt(n)   (Student's t: with few seeds, sd is itself uncertain).
# With 3 seeds t is 4.303, so the mean must stand 2.5 sd clear of zero; with 1 seed there is no sd at all.

T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 120: 1.980}   # df: t(0.975, df)


def t_975(df):
    """The 0.975 quantile of Student's t with df degrees of freedom, from the table above.

    Between two rows it takes the smaller df, whose t is larger: the interval is then a little too wide,
    never too narrow. t_975(2) == 4.303, t_975(11) == 2.228 (the exact value is 2.201).
    """
    return T_975[max(k for k in T_975 if k <= df)]


def average(values):
    """The mean over seeds, sum / n: one definition, so every table and panel rounds alike."""
    return sum(values) / len(values)


def spread(values):
    """Standard deviation over seeds (n - 1 in the denominator); None for a single seed."""
    if len(values) < 2:
        return None
    mean = average(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def interval(values):
    """The 95 % confidence interval of the mean, (low, high), or None for a single value.

    interval([0.1, 0.2, 0.3]) == (0.2 - 4.303 * 0.1 / sqrt(3), 0.2 + ...) == (-0.048, 0.448), rounded.
    """
    if len(values) < 2:
        return None
    half = t_975(len(values) - 1) * spread(values) / math.sqrt(len(values))
    return average(values) - half, average(values) + half


def paired(values):
    """'+0.031 [-0.029, +0.091]': the mean paired difference and its 95 % interval ('+0.031' for one seed)."""
    ci = interval(values)
    text = f"{average(values):+.3f}"
    return text if ci is None else text + f" [{ci[0]:+.3f}, {ci[1]:+.3f}]"


def verdict(diffs, worse="worse than MHA", better="better than MHA"):
    """What the 95 % interval of the paired differences allows one to say, in words."""
    ci = interval(diffs)
    if ci is None:
        return "one seed: cannot judge"
    if ci[0] > 0:
        return worse
    if ci[1] < 0:
        return better
    return "not resolved at this budget"


# ----------------------------------------------------------------------------- A. from scratch
def run_from_scratch(data, seeds, steps, workers):
    """Train every configuration of every seed. Returns {seed: {config: (model, final bits/char, curve)}}."""
    tasks = [(name, seed, steps) for name in CONFIGS for seed in seeds]    # the longest (MHA) first
    done = workers.run("A. from scratch", [(train_from_scratch, task) for task in tasks])
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
    curve = train(model, data, data.batches(seed, steps), lr_at, evaluate_at=marks, tick=WORKER["tick"])
    return model.state_dict(), curve


def print_table_a(results, steps):
    seeds = list(results)
    print(f"\nA. From scratch: {steps} steps, {len(seeds)} seed{'s' * (len(seeds) > 1)} "
          f"({', '.join(map(str, seeds))}); validation bits/char, mean and standard deviation over seeds")
    print("   paired: each seed's configurations share their initialisation and every batch; the difference to "
          "MHA\n   is its mean over seeds and, in brackets, the 95% confidence interval of that mean")
    print(f"   {'config':<7}{'K/V heads':>10}{'params':>9}{'KV bytes/token':>16}{'mean':>8}{'sd':>7}"
          f"   {'minus MHA, paired [95% interval]':<33} verdict")
    for name, kv in CONFIGS.items():
        model = results[seeds[0]][name][0]
        losses = [results[s][name][1] for s in seeds]
        sd = spread(losses)
        diffs = [results[s][name][1] - results[s]["MHA"][1] for s in seeds]
        compared = "" if name == "MHA" else f"{paired(diffs):<33} {verdict(diffs)}"
        print(f"   {name:<7}{kv:>10}{n_params(model):>9,}{cache_bytes_per_token(model):>16,}{average(losses):>8.3f}"
              f"{'' if sd is None else f'{sd:.3f}':>7}   {compared}".rstrip())


# ----------------------------------------------------------------------------- B. conversion
def run_conversion(scratch, steps, workers, ablated_seed):
    """Convert each seed's trained MHA to every smaller configuration with every pool, and train on; and
    meanwhile, on the same workers, table D's ablation of ablated_seed's trained MHA.

    Returns {seed: {(config, pool): {step: bits/char}}}, steps counted from the conversion, and what
    head_ablation returns. The further training sees the batches that come after the original steps in the
    seed's data order, the same for every conversion of a seed; ("MHA", "none") is the trained MHA itself,
    trained on the same way.
    """
    targets = [("MHA", "none")] + [(n, p) for n in CONFIGS if n != "MHA" for p in POOLS]
    tasks = [(name, pool, seed, steps, runs["MHA"][0].state_dict())
             for seed, runs in scratch.items() for name, pool in targets]
    ablation = (ablate_heads, (scratch[ablated_seed]["MHA"][0].state_dict(),))
    ablated, *done = workers.run("B. conversion", [ablation] + [(convert_and_train, task) for task in tasks])
    curves = {seed: {} for seed in scratch}
    for (name, pool, seed, _, _), curve in zip(tasks, done):
        curves[seed][name, pool] = curve
    return curves, ablated


def uptrain_steps(steps):
    """The further training after conversion, in steps: UPTRAIN of the original steps, at least 1 and 2, so
    that the two columns of table B are never the same evaluation (--steps 4: 1 and 2)."""
    first = max(1, round(UPTRAIN[0] * steps))
    return [first, max(first + 1, round(UPTRAIN[1] * steps))]


def convert_and_train(name, pool, seed, steps, mha_weights):
    """One conversion, as a worker runs it: the trained MHA to config by pool, then the further training."""
    data, up = WORKER["data"], uptrain_steps(steps)
    trained = CharLM(len(data.chars), N_HEADS)
    trained.load_state_dict(mha_weights)
    model = trained if pool == "none" else with_kv_heads(trained, CONFIGS[name], pool, seed)
    starts = data.batches(seed, steps + up[-1])[steps:]
    return train(model, data, starts, uptrain_lr_at, evaluate_at={0, *up}, tick=WORKER["tick"])


def print_table_b(curves, scratch, steps):
    seeds, up = list(curves), uptrain_steps(steps)
    print(f"\nB. Conversion of each trained MHA (Ainslie et al. 2023, section 2.1), then further training at "
          f"lr {UPTRAIN_LR:g}\n   validation bits/char, mean over {len(seeds)} seed{'s' * (len(seeds) > 1)}; "
          f"+{UPTRAIN[0]:.0%} = {up[0]} step{'s' * (up[0] > 1)}, +{UPTRAIN[1]:.0%} = {up[1]} steps more than "
          f"the {steps} of A")
    print(f"   {'config':<7}{'K/V from':<13}{'right after':>12}{f'+{UPTRAIN[0]:.0%}':>8}{f'+{UPTRAIN[1]:.0%}':>8}"
          f"{'from scratch (A)':>18}")
    for (name, pool) in curves[seeds[0]]:
        cells = "".join(f"{average([curves[s][name, pool][k] for s in seeds]):>{w}.3f}"
                        for k, w in ((0, 12), (up[0], 8), (up[1], 8)))
        scratch_loss = average([scratch[s][name][1] for s in seeds])
        label = "(trained)" if pool == "none" else pool + (" pool" if pool == "mean" else "")
        print(f"   {name:<7}{label:<13}{cells}{scratch_loss:>18.3f}")
    # Two findings of Ainslie et al. (their Figure 4), each a paired difference by seed, with its interval.
    for title, column, other in (("right after conversion", 0, "random"), (f"after +{UPTRAIN[1]:.0%}", up[1], "first")):
        print(f"   mean pool minus {other} {'K/V' if other == 'random' else 'head'}, {title}, paired by seed "
              "[95% interval]:")
        for name in (n for n in CONFIGS if n != "MHA"):
            diffs = [curves[s][name, "mean"][column] - curves[s][name, other][column] for s in seeds]
            print(f"      {name:<7}{paired(diffs):<28}{verdict(diffs, 'mean pool worse', 'mean pool better')}")


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


def strongest(roles, chance, layer, head):
    """The kind of key a head favours most, as a multiple of uniform attention's level: ('itself', 7.7)."""
    ratios = {r: roles[r][layer, head].item() / chance[r] for r in roles}
    top = max(ratios, key=ratios.get)
    return top, ratios[top]


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
            top, ratio = strongest(roles, chance, i, j)
            print(f"   {i:>5}{j:>5}" + "".join(f"{roles[r][i, j].item():>11.0%} " for r in roles)
                  + f"  {top}, {ratio:.1f}x uniform")
    print(f"   most previous-character-like: layer {layer} head {head}, {prev[layer, head]:.0%} of its attention "
          "on the character just before")
    return layer, head


# ----------------------------------------------------------------------------- D. head ablation
# Michel, Levy and Neubig (2019) silence heads of a trained model at test time and find that many can go
# with little loss: the number of heads is not a measure of what the model needs. Table C tells a story
# about each head; here the model is asked how much it needs each one. Evaluations only, no training.

def without_heads(model, heads):
    """A copy of model with every (layer, head) in heads silenced: its output zeroed before out_proj.

    out_proj sees the heads side by side, o = [o_0 | o_1 | ... | o_7] (each dh wide), so
    out_proj(o) = W o + b = W[:, 0:dh] o_0 + W[:, dh:2dh] o_1 + ... + b: zeroing head j's dh columns of W is
    the same as zeroing o_j (Michel et al.'s mask of 0), or as removing o_j and its columns altogether.
    """
    new = copy.deepcopy(model)
    dh = D_MODEL // N_HEADS
    with torch.no_grad():
        for layer, head in heads:
            new.blocks[layer].attn.out_proj.weight[:, head * dh:(head + 1) * dh] = 0.0   # W: (d, h * dh)
    return new


@torch.no_grad()
def window_losses(model, data):
    """Validation bits/char of each of the EVAL_WINDOWS windows, (EVAL_WINDOWS,), so that two models can
    be compared window by window (paired); their mean is what evaluate() gives, up to rounding."""
    model.eval()
    logits = torch.cat([model(data.val_x[i:i + 64]) for i in range(0, EVAL_WINDOWS, 64)])   # (N, T, V)
    model.train()
    nats = F.cross_entropy(logits.transpose(1, 2), data.val_y, reduction="none")          # (N, V, T) -> (N, T)
    return nats.mean(1) / math.log(2)


def head_ablation(model, data):
    """Michel et al.'s test-time ablation of a trained MHA. Returns (base, alone, order, curve):

    base, the intact model's (EVAL_WINDOWS,) window losses; alone[(layer, head)], the (EVAL_WINDOWS,) rise
    of each window's loss with only that head silenced; order, the heads from the least needed (smallest
    rise alone) to the most, the order in which Michel et al. prune them; curve[k], the mean loss with the
    first k heads of order silenced together (curve[0]: intact; one head always stays).
    """
    heads = [(i, j) for i in range(N_LAYERS) for j in range(N_HEADS)]
    base = window_losses(model, data)
    alone = {hd: window_losses(without_heads(model, [hd]), data) - base for hd in heads}
    order = sorted(heads, key=lambda hd: alone[hd].mean().item())
    curve = [base.mean().item()] + [window_losses(without_heads(model, order[:k]), data).mean().item()
                                    for k in range(1, len(heads))]
    return base, alone, order, curve


def ablate_heads(mha_weights):
    """head_ablation, as a worker runs it beside the conversions of B."""
    data = WORKER["data"]
    model = CharLM(len(data.chars), N_HEADS)
    model.load_state_dict(mha_weights)
    return head_ablation(model, data)


def heads_that_can_go(curve):
    """How many heads pruning removes before the loss rises by more than PRUNE_LIMIT."""
    over = [k for k, loss in enumerate(curve) if loss - curve[0] > PRUNE_LIMIT]
    return over[0] - 1 if over else len(curve) - 1


def rank_correlation(a, b):
    """Spearman's rank correlation: +1 if b orders the items exactly as a does, -1 if exactly reversed."""
    ranks = torch.stack([torch.tensor(v).argsort().argsort().double() for v in (a, b)])   # (2, n)
    return torch.corrcoef(ranks)[0, 1].item()


def print_table_d(ablation, roles, chance, seed):
    _, alone, order, curve = ablation
    heads = list(alone)
    rise = {hd: alone[hd].mean().item() for hd in heads}
    rank = {hd: k + 1 for k, hd in enumerate(sorted(heads, key=rise.get, reverse=True))}
    print(f"\nD. How much the trained MHA needs each head (seed {seed}; Michel et al. 2019): the loss with one head's "
          f"output\n   zeroed before out_proj, minus the intact model's {curve[0]:.3f} bits/char, paired on the same "
          f"{EVAL_WINDOWS} windows;\n   [95% interval] over those windows; rank 1 is the head the model needs most; "
          "role: table C's strongest")
    print(f"   {'layer':>5}{'head':>5}   {'loss rise [95% interval]':<27}{'rank':>4}   role (C)")
    for layer, head in heads:
        top, ratio = strongest(roles, chance, layer, head)
        print(f"   {layer:>5}{head:>5}   {paired(alone[layer, head].tolist()):<27}{rank[layer, head]:>4}   "
              f"{top}, {ratio:.1f}x uniform")
    marks = [k for k in (0, *PRUNE_MARKS) if k < len(curve)]
    print("   pruning, the least needed head first (smallest rise alone), the heads gone staying gone:")
    print("   heads gone  " + "".join(f"{k:>8}" for k in marks))
    print("   bits/char   " + "".join(f"{curve[k]:>8.3f}" for k in marks))
    print("   rise        " + "".join(f"{curve[k] - curve[0]:>+8.3f}" for k in marks))
    print("   order: " + ", ".join(f"{layer}.{head}" for layer, head in order) + "  (layer.head)")
    can_go = heads_that_can_go(curve)
    if can_go < len(curve) - 1:
        print(f"   {can_go} of {len(heads)} heads can go before the loss rises by more than {PRUNE_LIMIT} bits/char; "
              f"the next takes it to {curve[can_go + 1] - curve[0]:+.3f}")
    else:
        print(f"   {can_go} of {len(heads)} heads can go and the loss has not risen by more than {PRUNE_LIMIT} "
              "bits/char")
    prev = roles["previous"]
    layer, head = divmod(int(prev.argmax()), N_HEADS)
    print(f"   does C predict D? the most previous-character-like head ({layer}.{head}) ranks {rank[layer, head]} of "
          f"{len(heads)}")
    print("   rank correlation (Spearman; +1 if C predicted D perfectly) of a head's 'strongest' multiple of uniform")
    print(f"   with its loss rise: {correlation(heads, roles, chance, rise):+.2f} over all heads, "
          + ", ".join(f"{correlation([hd for hd in heads if hd[0] == i], roles, chance, rise):+.2f} within layer {i}"
                      for i in range(N_LAYERS)))


def correlation(heads, roles, chance, rise):
    """Spearman's rank correlation of how sharp each head is (table C) with how much it is needed (D)."""
    return rank_correlation([strongest(roles, chance, *hd)[1] for hd in heads], [rise[hd] for hd in heads])


# ----------------------------------------------------------------------------- figures
COLORS = {"MHA": "tab:red", "GQA-4": "tab:green", "GQA-2": "tab:purple", "MQA": "tab:blue"}
POOL_STYLE = {"mean": "-", "first": "--", "random": ":"}


def plot_quality(scratch, curves, steps, ablation, roles, chance):
    """Top: loss against KV-cache bytes per token; the paired gap to MHA along training (does it close with
    more steps?); conversion curves. Bottom: table D, each head's importance and the pruning curve."""
    seeds = list(scratch)
    several = len(seeds) > 1
    fig = mha.new_figure(16, 10)
    grid = fig.add_gridspec(2, 3)
    left, middle, right = (fig.add_subplot(grid[0, k]) for k in range(3))
    heads_ax, prune_ax = fig.add_subplot(grid[1, :2]), fig.add_subplot(grid[1, 2])
    for name in CONFIGS:
        b = cache_bytes_per_token(scratch[seeds[0]][name][0])
        losses = [scratch[s][name][1] for s in seeds]
        mean, ci = average(losses), interval(losses)
        bar = [[mean - ci[0]], [ci[1] - mean]] if ci else None
        left.errorbar([b], [mean], yerr=bar, marker="o", capsize=4, color=COLORS[name], label=name)
        left.scatter([b] * len(losses), losses, s=8, color=COLORS[name], alpha=0.4)
        left.annotate(name, (b, mean), textcoords="offset points", xytext=(8, 4), fontsize=9)
        if name == "MHA":
            middle.axhline(0.0, color=COLORS[name], lw=1, label="MHA")
            continue
        marks = sorted(k for k in scratch[seeds[0]][name][2] if k > 0)
        gaps = [[scratch[s][name][2][k] - scratch[s]["MHA"][2][k] for s in seeds] for k in marks]  # paired
        middle.plot(marks, [average(g) for g in gaps], color=COLORS[name], marker="o", ms=3, label=name)
        if several:
            middle.fill_between(marks, [interval(g)[0] for g in gaps], [interval(g)[1] for g in gaps],
                                color=COLORS[name], alpha=0.12, lw=0)
    left.set_xscale("log", base=2)
    ticks = sorted(cache_bytes_per_token(scratch[seeds[0]][n][0]) for n in CONFIGS)
    left.set_xticks(ticks, [str(t) for t in ticks])
    left.minorticks_off()
    left.set_xlabel("KV cache per token (bytes, float32)")
    left.set_ylabel("validation loss (bits/char)")
    shows = "bars: 95% interval of the mean" if several else "one seed"
    left.set_title(f"From scratch, {steps} steps, {len(seeds)} seed(s): mean, {shows}; dots: seeds", fontsize=9)
    middle.set_xlabel("training step")
    middle.set_ylabel("validation loss minus MHA's, same seed (bits/char)")
    middle.set_title(f"From scratch: the gap to MHA along training, mean over {len(seeds)} seed(s)"
                     + (",\nband: its 95% interval (excludes 0: resolved)" if several else ""), fontsize=9)
    middle.legend(fontsize=8)
    for name in CONFIGS:
        for pool in (["none"] if name == "MHA" else POOLS):
            marks = sorted(curves[seeds[0]][name, pool])
            mean = [average([curves[s][name, pool][k] for s in seeds]) for k in marks]
            label = "MHA, not converted" if pool == "none" else f"{name} {pool}"
            right.plot([steps + k for k in marks], mean, color=COLORS[name], ls=POOL_STYLE.get(pool, "-"),
                       marker="o", ms=3, label=label)
        right.axhline(average([scratch[s][name][1] for s in seeds]), color=COLORS[name], lw=0.8, alpha=0.6)
    right.set_xlabel(f"training steps (the MHA's {steps}, then further training)")
    right.set_ylabel("validation loss (bits/char)")
    right.set_title("Converted from the trained MHA, mean over seeds;\nthin lines: each config from scratch",
                    fontsize=9)
    right.legend(fontsize=7, ncol=2)
    plot_ablation(heads_ax, prune_ax, ablation, roles, chance, seeds[0])
    fig.suptitle(f"What sharing K/V heads costs: character-level LM on pydoc_data.topics, d={D_MODEL}, "
                 f"{N_HEADS} query heads, {N_LAYERS} layers, T={CONTEXT}, batch {BATCH}", fontsize=11)
    fig.tight_layout()
    return fig


ROLE_COLORS = {"previous": "tab:orange", "itself": "tab:olive", "whitespace": "tab:cyan", "word start": "tab:pink"}


def plot_ablation(heads_ax, prune_ax, ablation, roles, chance, seed):
    """Table D: each head's loss rise alone, coloured by its role in table C; the pruning curve."""
    from matplotlib.patches import Patch
    _, alone, _, curve = ablation
    heads = list(alone)
    for k, hd in enumerate(heads):
        rise = alone[hd].tolist()
        low, high = interval(rise)
        top = strongest(roles, chance, *hd)[0]
        heads_ax.bar(k, average(rise), color=ROLE_COLORS[top], yerr=[[average(rise) - low], [high - average(rise)]],
                     capsize=3)
    heads_ax.legend([Patch(color=c) for c in ROLE_COLORS.values()], [f"strongest in C: {r}" for r in ROLE_COLORS],
                    fontsize=8)
    heads_ax.set_xticks(range(len(heads)), [f"{layer}.{head}" for layer, head in heads])
    heads_ax.axhline(0.0, color="black", lw=0.8)
    heads_ax.set_xlabel("layer.head")
    heads_ax.set_ylabel("loss rise with this head silenced (bits/char)")
    heads_ax.set_title(f"D. Each head of the trained MHA (seed {seed}) silenced alone, paired on {EVAL_WINDOWS} "
                       "validation windows; bars: 95% interval over those windows", fontsize=9)
    prune_ax.plot(range(len(curve)), curve, marker="o", ms=3, color="black")
    prune_ax.axhline(curve[0] + PRUNE_LIMIT, color="tab:red", lw=0.8, ls="--",
                     label=f"intact + {PRUNE_LIMIT} bits/char")
    can_go = heads_that_can_go(curve)
    prune_ax.annotate(f"{can_go} heads can go", (can_go, curve[can_go]), textcoords="offset points",
                      xytext=(-10, 14), fontsize=8, ha="right")
    prune_ax.set_xlabel(f"heads silenced together (of {len(heads)}), the least needed alone first")
    prune_ax.set_ylabel("validation loss (bits/char)")
    prune_ax.set_title(f"D. Pruning the trained MHA (seed {seed}), head after head", fontsize=9)
    prune_ax.legend(fontsize=8)


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
# 37 ms a step each: 1.4 times the work done per second. So every model trains in a worker process of
# concurrent.futures.ProcessPoolExecutor on exactly one thread, WORKERS at a time. A model's numbers depend
# only on its task (configuration, seed, steps), never on which worker ran it or how many workers there are.
WORKER = {}   # in a worker process: the data, and tick(), which counts a training step for the progress line


# ----------------------------------------------------------------------------- main
def train_everything(args, workers):
    """The data, then parts A and B (and D's evaluations, beside B) on the workers, each table printed as
    soon as it is known."""
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
    print_table_a(scratch, args.steps)
    sys.stdout.flush()

    curves, ablation = run_conversion(scratch, args.steps, workers, args.seeds[0])
    print_table_b(curves, scratch, args.steps)
    return scratch, curves, ablation, data


def main(argv=None):
    args = parse_args(argv)        # a bad flag, knob or --out-dir ends here, in one line (exit code 2)
    torch.set_num_threads(1)                               # tables C and D and the maps, like every model
    models = len(args.seeds) * len(CONFIGS)
    conversions = len(args.seeds) * (1 + (len(CONFIGS) - 1) * len(POOLS))
    progress = Progress(models * args.steps + conversions * uptrain_steps(args.steps)[-1])
    try:
        with Workers(progress) as workers:
            scratch, curves, ablation, data = train_everything(args, workers)
    except concurrent.futures.process.BrokenProcessPool:
        progress.clear()
        print(f"quality.py: error: a worker process stopped (exit code {workers.exit_code()}: killed, or out of "
              "memory?) before its models were trained; nothing was written", file=sys.stderr)
        return 1

    trained = scratch[args.seeds[0]]["MHA"][0]
    roles, chance = head_roles(trained, data)
    best = print_table_c(roles, chance, args.seeds[0])
    print_table_d(ablation, roles, chance, args.seeds[0])
    figures = [plot_quality(scratch, curves, args.steps, ablation, roles, chance),
               plot_trained_maps(trained, data, args.seeds[0], args.steps, best)]
    pngs = {name: mha.png_bytes(fig) for name, fig in zip(FIGURES, figures)}
    if not mha.write_figures("quality.py", args.out_dir, pngs):
        return 1
    print(f"\nFigures written to {mha.shown_path(args.out_dir)}: {', '.join(FIGURES)}")
    print(progress.summary(*workers.steps))
    return 0


# ----------------------------------------------------------------------------- plumbing (not the lesson)
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
    shares = " and ".join(f"{f * 100:g}%%" for f in UPTRAIN if isinstance(f, (int, float)))   # %% is argparse's %
    parser = mha.Parser(prog="quality.py", description="Train a tiny character-level LM with MHA, GQA and MQA and "
                        "measure what sharing K/V heads costs in validation loss.",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=whole_positive, default=STEPS,
                        help="training steps of each from-scratch model; further training after conversion is "
                             f"{shares or 'none'} of it")
    parser.add_argument("--seeds", type=seed_value, nargs="+", default=list(SEEDS),
                        help="one or more seeds: each gives an initialisation and a data order")
    parser.add_argument("--out-dir", default=OUT_DIR, help="folder the two figures are written to")
    args = parser.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds {' '.join(map(str, args.seeds))} must be different from each other")
    if CONFIGS.get("MHA") != N_HEADS or any(not isinstance(kv, int) or kv < 1 or N_HEADS % kv for kv in CONFIGS.values()):
        parser.error(f"CONFIGS={CONFIGS} (at the top of quality.py) must map 'MHA' to N_HEADS={N_HEADS} and every name "
                     "to a positive divisor of it")
    fractions = UPTRAIN if isinstance(UPTRAIN, tuple) else ()
    if len(fractions) != 2 or not all(isinstance(f, (int, float)) and 0 < f <= 1 for f in fractions) \
            or fractions[0] >= fractions[1]:
        parser.error(f"UPTRAIN={UPTRAIN!r} (at the top of quality.py) must be two fractions of the steps, "
                     "growing, in (0, 1]")
    if isinstance(WORKERS, bool) or not isinstance(WORKERS, int) or WORKERS < 1:
        parser.error(f"WORKERS={WORKERS!r} (at the top of quality.py) must be a whole number of processes, at least 1")
    problem = mha.out_dir_problem(args.out_dir, FIGURES)
    if problem:
        parser.error(problem)
    return args


class Progress:
    """One line on stderr: which part trains, its steps done of all, the time so far and left. On a terminal
    it is rewritten in place; otherwise (a pipe, a file) a plain line is written every PLAIN_EVERY seconds."""

    def __init__(self, total_steps, stream=sys.stderr):
        self.total, self.stream, self.tty = total_steps, stream, stream.isatty()
        self.start = self.last = time.perf_counter()
        self.width = 0

    def show(self, part, done):
        now = time.perf_counter()
        if now - self.last < (0.5 if self.tty else PLAIN_EVERY):
            return
        self.last = now
        left = (now - self.start) / max(done, 1) * (self.total - done)
        line = (f"{part}: {done:,} of {self.total:,} training steps, elapsed {clock(now - self.start)}, "
                f"left ~{clock(left)}")
        self.stream.write("\r" + line.ljust(self.width) if self.tty else line + "\n")
        self.width = len(line)
        self.stream.flush()

    def clear(self):
        """Remove the rewritten line before a table is printed to the same terminal."""
        if self.tty and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0

    def summary(self, steps, seconds):
        """The wall time and the mean time of a training step: a busy machine shows here."""
        return (f"time: {(time.perf_counter() - self.start) / 60:.1f} min, {WORKERS} worker{'s' * (WORKERS > 1)} "
                f"of 1 thread; a training step took {seconds / max(steps, 1) * 1e3:.0f} ms on average")


def clock(seconds):
    """clock(75.3) == '1:15'."""
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


class Workers:
    """WORKERS processes of a ProcessPoolExecutor, with the three things the standard pool leaves to us:
    the progress line, stopping at once (a failing task, Ctrl-C: the running tasks are not waited for), and
    which exit code a dead worker had (BrokenProcessPool does not say)."""

    def __init__(self, progress):
        context = multiprocessing.get_context("spawn")        # a fresh interpreter: no threads or locks inherited
        self.steps = context.Array("d", 2)                    # training steps done by all workers, their seconds
        self.before = set(multiprocessing.active_children())
        self.pool = concurrent.futures.ProcessPoolExecutor(WORKERS, context, initializer=start_worker,
                                                           initargs=(os.getpid(), self.steps))
        self.progress, self.processes = progress, []

    def run(self, part, calls):
        """fn(*args) for every (fn, args) in calls, on the workers; the results in the order of calls."""
        ctrl_c = signal.signal(signal.SIGINT, signal.SIG_IGN)   # the pool starts its workers as tasks arrive:
        try:                                                     # born ignoring Ctrl-C, even while they start
            futures = [self.pool.submit(fn, *args) for fn, args in calls]
        finally:
            signal.signal(signal.SIGINT, ctrl_c)
        self.processes = list(set(multiprocessing.active_children()) - self.before)
        waiting = futures
        while waiting:
            done, waiting = concurrent.futures.wait(waiting, 0.5, concurrent.futures.FIRST_EXCEPTION)
            for future in done:
                future.result()                # a worker's exception, raised here with its traceback, at once
            self.progress.show(part, int(self.steps[0]))
        self.progress.clear()
        return [future.result() for future in futures]

    def exit_code(self):
        """The exit code of the worker that died. The pool then stops the others with SIGTERM, so theirs is
        -15: the one that is not is the one that died first (-15 too if it was itself stopped by SIGTERM)."""
        codes = [p.exitcode for p in self.processes]
        return next((c for c in codes if c != -signal.SIGTERM), -signal.SIGTERM)

    def __enter__(self):
        return self

    def __exit__(self, kind, *exc):
        if kind is not None:                                  # failed or interrupted: stop them, busy or not
            for p in self.processes:
                p.terminate()
        self.progress.clear()
        self.pool.shutdown(cancel_futures=True)


def start_worker(parent, steps):
    """Each worker process, once, before its first task: it dies with the parent, uses one thread, and
    reads the data itself."""
    die_with_parent(parent)
    torch.set_num_threads(1)
    WORKER["data"] = Data(load_text())

    def tick(seconds):
        with steps.get_lock():
            steps[0] += 1
            steps[1] += seconds
    WORKER["tick"] = tick


def die_with_parent(parent):
    """End this process when the parent process dies, however it dies (a SIGKILL runs none of its code).

    On Linux the kernel does it: prctl(PR_SET_PDEATHSIG, SIGKILL). Elsewhere a thread checks every second
    whether the parent is still the one that started us. Either way, a parent already gone ends us now.
    """
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)          # 1 = PR_SET_PDEATHSIG, from <linux/prctl.h>
    else:
        def watch():
            while os.getppid() == parent:
                time.sleep(1.0)
            os._exit(1)
        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent:
        os._exit(1)


if __name__ == "__main__":
    mha.run_as_script(main)     # ends quietly if the reader goes away (python quality.py | head)
