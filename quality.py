"""
What grouped-query (GQA) and multi-query (MQA) attention cost in quality, measured on real text, in minutes.

mha.py measures what sharing K/V heads saves; this file measures what it costs. It trains a tiny character-level
language model built around mha.CausalMHA on Python's own documentation (pydoc_data.topics, no download) and
reports validation loss in bits per character, with a 95 % confidence interval for every comparison.
What the heads of one such trained model do, and how many it needs, is heads.py's question.
  A. From scratch: MHA, GQA-4, GQA-2 and MQA, a seed's configurations sharing initialisation and batches, matched
     on width, not parameters (MQA has 12 % fewer). MHA and MQA train on 5 seeds: 81 % power to resolve MQA's cost
     at the pilot's point estimate (seeds 10 to 15), about 75 % over its uncertainty; GQA-4 and GQA-2 on 3.
  B. Conversion (Ainslie et al. 2023): each trained MHA of those 3 seeds becomes GQA/MQA by pooling its K/V heads
     and trains on as A would have gone on, for 5 % more steps (20 % for mean pooling), beside the MHA resumed alike.
It does not claim the cost at scale (d=64, two layers, minutes of training); no dropout, GPU, tokenizer.

Run it:   python quality.py           (6 minutes on 2 quiet cores, up to 13 on a slow or busy machine; writes figures/)
          python quality.py --quick   (half a minute: a smoke run for trying an edit; it resolves nothing)

Papers: Vaswani et al. 2017, arXiv:1706.03762; Shazeer 2019 (MQA), arXiv:1911.02150; Ainslie et al. 2023 (GQA),
arXiv:2305.13245. Shapes, the alphabet of mha.py: B batch, T characters in a window, d model width,
h query heads, kv K/V heads, dh = d / h head width, V distinct characters (the vocabulary).
"""

import argparse
import collections
import concurrent.futures
import contextlib
import copy
import hashlib
import math
import multiprocessing
import os
import signal
import statistics
import sys
import threading
import time
from datetime import timedelta

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
STEPS = 1800          # training steps of each from-scratch model (--steps)
LR = 7e-3             # peak learning rate of AdamW; high, because the model is tiny and the budget short
WARMUP = 0.1          # fraction of the steps over which the learning rate rises linearly from 0 to LR
MIN_LR = 0.1          # the cosine decay ends at MIN_LR * LR
WEIGHT_DECAY = 0.1    # AdamW weight decay, on weight matrices only
CLIP = 1.0            # gradient norm is clipped to this
SEEDS = (0, 1, 2, 3, 4)   # MHA and MQA train once per seed, an initialisation and a data order (--seeds)
GQA_SEEDS = 3         # the other configurations train on the first 3 seeds only; B converts those 3 MHAs
QUICK_STEPS, QUICK_SEEDS = 150, (0, 1)   # --quick: the smoke run
CONFIGS = {"MHA": 8, "GQA-4": 4, "GQA-2": 2, "MQA": 1}   # name: K/V heads of the 8-query-head model
POOLS = ("mean", "first", "random")    # how conversion makes a K/V head from its group (B)
UPTRAIN = 0.05        # further training after conversion, a fraction of A's steps: the paper's 5 %
UPTRAIN_LONG = 0.2    # the control and the mean-pooled conversions train on to this fraction too
VAL_FRACTION = 0.1    # the last tenth of the text is validation
EVAL_WINDOWS = 256    # validation loss is the mean over these many windows, evenly spaced: 16,384 characters
WORKERS = 2           # processes that train models side by side, one torch thread each (see "on both cores")
STEP_SECONDS = 0.02   # a step in each of 2 workers side by side (16 to 42 ms on 2 cores, by the day): the estimate
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "figures")
FIGURE = "quality.png"


# ----------------------------------------------------------------------------- the data
def load_text():
    """Python's documentation topics as one string, in sorted order of their names: about 465k characters."""
    from pydoc_data.topics import topics
    return "\n".join(topics[name] for name in sorted(topics))


class Data:
    """The text as character ids, split by position: train first, validation last."""

    def __init__(self, text):
        self.chars = sorted(set(text))                     # id -> character
        lookup = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
        cut = int(len(text) * (1 - VAL_FRACTION))
        self.train, self.val, self.val_text = ids[:cut], ids[cut:], text[cut:]
        # Evenly spaced validation windows in text order, the same for every model: inputs x, next characters y.
        self.val_starts = torch.linspace(0, len(self.val) - CONTEXT - 1, EVAL_WINDOWS).long()
        self.val_x, self.val_y = windows(self.val, self.val_starts)   # (EVAL_WINDOWS, T) each

    def batches(self, seed, steps):
        """The training windows of every step, (steps, B) start positions, from the seed alone."""
        g = torch.Generator().manual_seed(seed)
        return torch.randint(len(self.train) - CONTEXT - 1, (steps, BATCH), generator=g)


def windows(ids, starts):
    """Inputs x: (B, T), the characters at starts .. starts + T - 1, and targets y: (B, T), one further on."""
    w = ids[starts[:, None] + torch.arange(CONTEXT + 1)]   # (B, T + 1)
    return w[:, :-1], w[:, 1:]


# ----------------------------------------------------------------------------- the model
class Block(nn.Module):
    """x + attention(LayerNorm(x)), then x + MLP(LayerNorm(x)): the pre-LayerNorm block of GPT-2."""

    def __init__(self, n_kv_heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.attn = mha.CausalMHA(D_MODEL, N_HEADS, n_kv_heads)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, MLP_WIDTH), nn.GELU(), nn.Linear(MLP_WIDTH, D_MODEL))

    def forward(self, x, need_weights=False):              # x: (B, T, d); p: (B, h, T, T) or None
        # Training runs the fused call: faster, and the same function as the written-out one need_weights runs.
        a, p = self.attn(self.ln1(x), need_weights=True) if need_weights else (self.attn(self.ln1(x), fused=True), None)
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
        nn.init.normal_(self.embed.weight, 0.0, 0.02)
        nn.init.normal_(self.pos, 0.0, 0.02)

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


def pool_kv_rows(t, attn, n_kv_heads, pool):
    """attn's in_proj rows t with each group of consecutive K/V heads made one, their mean or the group's first:
        4 K/V heads to 2, mean:   [k0, k1 | k2, k3] -> [(k0 + k1) / 2, (k2 + k3) / 2]    (query rows unchanged)"""
    h, kv, dh, r = attn.n_heads, attn.n_kv_heads, attn.d_head, attn.n_kv_heads // n_kv_heads
    q, k, v = t.split([h * dh, kv * dh, kv * dh])
    k = k.unflatten(0, (n_kv_heads, r, dh))                # (kv dh, ...) -> (n_kv_heads, r, dh, ...)
    v = v.unflatten(0, (n_kv_heads, r, dh))                # (kv dh, ...) -> (n_kv_heads, r, dh, ...)
    k, v = (k[:, 0], v[:, 0]) if pool == "first" else (k.mean(1), v.mean(1))   # (n_kv_heads, dh, ...)
    return torch.cat([q, k.flatten(0, 1), v.flatten(0, 1)])


def to_gqa(attn, n_kv_heads, pool="mean"):
    """A new mha.CausalMHA with fewer K/V heads, made from attn as Ainslie et al. 2023 (section 2.2) do; equal heads
    in a group give the same function (within 1e-6), others need further training: table B."""
    if n_kv_heads < 1 or attn.n_kv_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads={n_kv_heads} must be a positive divisor of the {attn.n_kv_heads} K/V heads")
    if pool not in ("mean", "first"):
        raise ValueError(f"pool={pool!r} must be 'mean' or 'first'")
    out = mha.CausalMHA(attn.d_model, attn.n_heads, n_kv_heads, attn.in_proj.bias is not None)
    pooled = {name: pool_kv_rows(t, attn, n_kv_heads, pool) if name.startswith("in_proj") else t
              for name, t in attn.state_dict().items()}
    out.to(attn.in_proj.weight.dtype).load_state_dict(pooled)
    return out.train(attn.training)


def with_kv_heads(model, n_kv_heads, pool, seed=0):
    """model with n_kv_heads K/V heads in every layer, by to_gqa's pool, or "random": new K/V as nn.Linear draws."""
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    for block in new.blocks:
        block.attn = to_gqa(block.attn, n_kv_heads, "first" if pool == "random" else pool)
        if pool == "random":
            rows, bound = slice(N_HEADS * block.attn.d_head, None), 1 / math.sqrt(D_MODEL)   # K, V rows; U(-b, b)
            with torch.no_grad():
                for t in (block.attn.in_proj.weight, block.attn.in_proj.bias):
                    t[rows] = torch.rand(t[rows].shape, generator=g) * 2 * bound - bound
    return new


def fresh_models(vocab, seed):
    """{config: model} of one seed: its MHA, and that MHA with each group's first K/V head kept (a fresh GQA)."""
    torch.manual_seed(seed)
    base = CharLM(vocab, N_HEADS)
    return {name: base if kv == N_HEADS else with_kv_heads(base, kv, "first") for name, kv in CONFIGS.items()}


def cache_bytes_per_token(n_kv_heads):
    """KV-cache bytes one token adds: 2 (K and V) x layers x K/V heads x dh x 4 bytes (this model's float32)."""
    return mha.kv_cache_bytes(N_LAYERS, n_kv_heads, D_MODEL // N_HEADS, 1, bytes_per_elem=4)


# ----------------------------------------------------------------------------- training
def lr_at(step, steps):
    """Linear warmup over WARMUP * steps, then cosine from LR down to MIN_LR * LR at the last step."""
    warm = max(1, round(WARMUP * steps))
    if step < warm:
        return LR * (step + 1) / warm
    done = (step - warm) / max(1, steps - 1 - warm)        # 0 .. 1
    return LR * (MIN_LR + (1 - MIN_LR) * 0.5 * (1 + math.cos(math.pi * done)))


def optimizer(model, state=None):
    """AdamW, weight decay on weight matrices only; given state (an AdamW state_dict of model), resumed from it."""
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and n != "pos"]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and n != "pos")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95))
    if state is not None:
        opt.load_state_dict(copy.deepcopy(state))         # a copy: state's tensors may be another process's too
    return opt


def train(model, opt, data, starts, schedule, evaluate_at=()):
    """Train model in place with opt on starts (steps, B) at schedule(step, steps); return {step: validation
    bits/char before that step} for each step in evaluate_at (len(starts): after the last)."""
    steps, curve = len(starts), {}
    for step in range(steps + 1):
        if step in evaluate_at:
            curve[step] = window_losses(model, data.val_x, data.val_y).mean().item()
        if step == steps:
            return curve
        for group in opt.param_groups:
            group["lr"] = schedule(step, steps)
        x, y = windows(data.train, starts[step])           # (B, T), (B, T)
        loss = bits_per_char(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()


@torch.no_grad()
def window_losses(model, x, y):
    """Bits/char of each window, (N,): inputs x (N, T) against next characters y (N, T), 64 windows at a time."""
    model.eval()
    logits = torch.cat([model(x[i:i + 64]) for i in range(0, len(x), 64)])   # (N, T, V)
    model.train()
    nats = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")     # (N, V, T) -> (N, T)
    return nats.mean(1) / math.log(2)


# ----------------------------------------------------------------------------- paired differences, 95 % intervals
# Two models of one seed share their initialisation and every batch, and are measured on the same windows,
# so a comparison is paired: one difference per seed. Over n seeds the differences have a mean and a
# standard deviation sd, and the mean's 95 % confidence interval is
#     mean +/- t(0.975, n - 1) * sd / sqrt(n)     (Student's t: with few seeds, sd is itself uncertain).
# With 5 seeds t is 2.776, so the mean must stand 1.24 sd clear of zero; with 3 seeds, 2.48 sd.
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 120: 1.980}   # df: t(0.975, df)


def t_975(df):
    """t(0.975, df) from the table; between two rows the smaller df's, larger: an interval never too narrow.
    t_975(2) == 4.303, t_975(11) == 2.228 (the exact value is 2.201)."""
    return T_975[max(k for k in T_975 if k <= df)]


def interval(values):
    """The 95 % confidence interval of the mean, (low, high), or None for a single value.
    interval([0.1, 0.2, 0.3]) == (0.2 - 4.303 * 0.1 / sqrt(3), 0.2 + ...) == (-0.048, 0.448), rounded."""
    if len(values) < 2:
        return None
    half = t_975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return statistics.mean(values) - half, statistics.mean(values) + half


def paired(values):
    """'+0.031 [-0.029, +0.091]': the mean paired difference and its 95 % interval ('+0.031' for one seed)."""
    ci = interval(values)
    return f"{statistics.mean(values):+.3f}" + ("" if ci is None else f" [{ci[0]:+.3f}, {ci[1]:+.3f}]")


def verdict(diffs):
    """What the 95 % interval of the paired differences allows one to say, in words."""
    ci = interval(diffs)
    if ci is None:
        return "one seed: cannot judge"
    return "worse than MHA" if ci[0] > 0 else "better than MHA" if ci[1] < 0 else "not resolved"


def tested_in_order():
    """A's comparisons, fewest K/V heads first, each tested only if the one before was resolved (a fixed
    sequence): any false verdict among them stays at most 5 %, no interval widened (Holm: the smallest p at 1.7 %)."""
    return sorted((name for name, kv in CONFIGS.items() if kv != N_HEADS), key=CONFIGS.get)


def seeds_of(name, seeds):
    """MHA and the first configuration tested (MQA) train on every seed, the others on the first GQA_SEEDS."""
    return seeds if name == "MHA" or name == tested_in_order()[0] else seeds[:GQA_SEEDS]


# ----------------------------------------------------------------------------- A. from scratch
# One model of table A as its worker returns it: the model, its validation bits/char, AdamW's state_dict.
Trained = collections.namedtuple("Trained", "model loss opt_state")


def run_from_scratch(seeds, steps, run):
    """Train every configuration on its seeds. Returns {config: {seed: Trained}}."""
    tasks = [(name, seed, steps) for name in CONFIGS for seed in seeds_of(name, seeds)]   # MHA, the longest, first
    done = run("A. from scratch", [(train_from_scratch, task, steps) for task in tasks])
    results = {name: {} for name in CONFIGS}
    for (name, seed, _), result in zip(tasks, done):
        results[name][seed] = result
    return results


def train_from_scratch(name, seed, steps):
    """One from-scratch model in a worker (WORKER holds its data), trained: a Trained."""
    model, data = fresh_models(len(WORKER["data"].chars), seed)[name], WORKER["data"]
    opt = optimizer(model)
    loss = train(model, opt, data, data.batches(seed, steps), lr_at, {steps})[steps]
    return Trained(model, loss, opt.state_dict())


def gaps(scratch, name):
    """name minus MHA, one paired difference for each seed of name."""
    return [run.loss - scratch["MHA"][s].loss for s, run in scratch[name].items()]


def print_table_a(scratch, steps):
    print(f"\nA. From scratch, {steps} steps; validation bits/char, mean and standard deviation over seeds ("
          + ", ".join(f"{name} {','.join(map(str, scratch[name]))}" for name in CONFIGS) + ")")
    print("   paired: a seed's configurations share their initialisation and every batch; the difference to MHA "
          "is its mean\n   over the seeds both ran and, in brackets, its 95% confidence interval. Tested in the order "
          f"fixed\n   in advance, {', '.join(tested_in_order())}, each only if the one before was resolved: the chance "
          "of any false verdict\n   among them is at most 5%. Matched on width: fewer K/V heads, fewer parameters")
    print(f"   {'config':<7}{'K/V heads':>10}{'params':>9}{'KV bytes/token':>16}{'seeds':>7}{'mean':>8}{'sd':>7}"
          f"   {'minus MHA [95% interval]':<25} verdict")
    said, previous = {}, None
    for name in tested_in_order():
        tested = previous is None or said[previous].endswith("than MHA")
        said[name] = verdict(gaps(scratch, name)) if tested else f"not tested ({previous} not resolved)"
        previous = name
    for name, kv in CONFIGS.items():
        losses = [run.loss for run in scratch[name].values()]
        params = sum(p.numel() for p in next(iter(scratch[name].values())).model.parameters())
        sd = f"{statistics.stdev(losses):.3f}" if len(losses) > 1 else ""
        compared = "" if name == "MHA" else f"{paired(gaps(scratch, name)):<25} {said[name]}"
        print(f"   {name:<7}{kv:>10}{params:>9,}{cache_bytes_per_token(kv):>16,}{len(losses):>7}"
              f"{statistics.mean(losses):>8.3f}{sd:>7}   {compared}".rstrip(), flush=True)


# ----------------------------------------------------------------------------- B. conversion
# Ainslie et al. continue pre-training a converted checkpoint on its own recipe for 5 % of its steps. Here A goes on:
# AdamW resumed (K/V rows' moments pooled like their weights), its last lr, its next batches; the control likewise.
def run_conversion(scratch, steps, run, seeds):
    """Every conversion of seeds' MHAs, trained on: {seed: {(config, pool): {step: bits/char}}}.
    ("MHA", "none") is the control, the MHA resumed unchanged."""
    tasks = [(name, pool, seed, steps, scratch["MHA"][seed].model, scratch["MHA"][seed].opt_state)
             for seed in seeds for name, pool in targets()]
    done = run("B. conversion", [(convert_and_train, task, uptrain_steps(steps, task[1])) for task in tasks])
    curves = {seed: {} for seed in seeds}
    for (name, pool, seed, *_), curve in zip(tasks, done):
        curves[seed][name, pool] = curve
    return curves


def targets():
    """B's rows: the control, then each configuration of fewer K/V heads by each pool."""
    return [("MHA", "none")] + [(name, pool) for name in CONFIGS if name != "MHA" for pool in POOLS]


def uptrain_steps(steps, pool="first"):
    """How far a row of B trains on: UPTRAIN of A's steps, UPTRAIN_LONG for the control and mean pooling; at least 1."""
    return max(1, round((UPTRAIN_LONG if pool in ("none", "mean") else UPTRAIN) * steps))


def resumed_optimizer(new, model, state, pool):
    """AdamW for new, made from model by with_kv_heads(..., pool) or a copy (pool "none"), resumed from model's state:
    step counts and moments as they were, the K/V rows' moments pooled as their weights are, zero for random K/V."""
    old, opt = optimizer(model, state), optimizer(new)
    for (name, p), (_, q) in zip(model.named_parameters(), new.named_parameters()):
        moments = dict(old.state[p])                       # step, exp_avg, exp_avg_sq
        if pool != "none" and ".attn.in_proj." in name:
            attn = model.get_submodule(name.rsplit(".", 2)[0])   # blocks.0.attn.in_proj.weight -> blocks.0.attn
            for key in ("exp_avg", "exp_avg_sq"):
                moments[key] = pool_kv_rows(moments[key], attn, new.blocks[0].attn.n_kv_heads,
                                            "first" if pool == "random" else pool)
                if pool == "random":
                    moments[key][N_HEADS * attn.d_head:] = 0.0   # new K/V rows: no history
        opt.state[q] = moments
    return opt


def convert_and_train(name, pool, seed, steps, model, state):
    """One conversion in a worker (pool "none": the control), trained on as A would have: {step: bits/char}."""
    data = WORKER["data"]                                  # model's tensors are shared with every process: copy
    new = copy.deepcopy(model) if pool == "none" else with_kv_heads(model, CONFIGS[name], pool, seed)
    up, last_lr = uptrain_steps(steps, pool), lr_at(steps - 1, steps)           # A's last: MIN_LR * LR
    return train(new, resumed_optimizer(new, model, state, pool), data, data.batches(seed, steps + up)[steps:],
                 lambda step, _: last_lr, {0, uptrain_steps(steps), up})


def print_table_b(curves, scratch, steps):
    seeds, up, long = list(curves), uptrain_steps(steps), uptrain_steps(steps, "mean")
    more = [(up, f"+{UPTRAIN:.0%}"), (long, f"+{UPTRAIN_LONG:.0%}")]
    print(f"\nB. Conversion of the trained MHA of seeds {', '.join(map(str, seeds))} (Ainslie et al. 2023, sections "
          f"2.1-2.2), then training on as A would\n   have gone on: A's AdamW state (the K/V rows' moments pooled as "
          f"their weights are, zero for random K/V), A's last lr\n   {lr_at(steps - 1, steps):g} held, the batches "
          f"after A's; {up} steps ({UPTRAIN:.0%} of A's), {long} ({UPTRAIN_LONG:.0%}) for the control and mean "
          "pooling. The control\n   is the same MHA resumed in the same way. Validation bits/char, mean over seeds; "
          "each minus the control at the\n   same step, paired by seed [95% interval]")
    print(f"   {'config':<7}{'K/V from':<11}{'right after':>12}" + "".join(f"{c:>7}" for _, c in more) + "   "
          + "".join(f"{c + ' minus the control':<26}" for _, c in more) + f"{'scratch (A)':>11}")
    loss = {target: {k: [curves[s][target].get(k) for s in seeds] for k in (0, up, long)} for target in targets()}
    control = loss["MHA", "none"]
    for (name, pool), at in loss.items():
        done = [k for k, _ in more if None not in at[k]]   # the steps this row was trained to
        after = "".join(f"{statistics.mean(at[k]):>7.3f}" if k in done else f"{'-':>7}" for k, _ in more)
        gap = "".join(f"{paired([a - c for a, c in zip(at[k], control[k])]) if k in done else '':<26}" for k, _ in more)
        label = "(control)" if pool == "none" else pool + " pool" * (pool == "mean")
        print(f"   {name:<7}{label:<11}{statistics.mean(at[0]):>12.3f}{after}   {gap if pool != 'none' else '':<52}"
              f"{statistics.mean([scratch[name][s].loss for s in seeds]):>11.3f}")
    print("   the control resumed, minus untouched (A's MHA), paired by seed: " + ", ".join(
        f"{label} {paired([c - u for c, u in zip(control[k], control[0])])}" for k, label in more))
    print(f"   {up} steps are {UPTRAIN:.0%} of A's, as in the paper, where 5 % of T5's training is tens of thousands "
          f"of steps on\n   far larger batches: {up} small updates at A's last lr show recovery starting, not where "
          "it ends.\n   B's intervals are each at 95%, not corrected for their number: read them as a description")


# ----------------------------------------------------------------------------- figures
COLORS = {"MHA": "tab:blue", "GQA-4": "tab:green", "GQA-2": "tab:purple", "MQA": "tab:red"}   # as in mha.py's figures


def plot_quality(scratch, steps):
    """Each configuration's loss against the KV-cache bytes one token adds: its seeds, their mean, its interval."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(7, 5))
    ax = fig.subplots()
    for name, kv in CONFIGS.items():
        plot_point(ax, name, cache_bytes_per_token(kv), [run.loss for run in scratch[name].values()])
    ax.set_xscale("log", base=2)
    ticks = sorted(cache_bytes_per_token(kv) for kv in CONFIGS.values())
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set(xlabel="KV cache per token (bytes, float32)", ylabel="validation loss (bits/char)")
    ax.set_title(f"What sharing K/V heads costs: a char-level LM on pydoc_data.topics, d={D_MODEL},\n"
                 f"{N_HEADS} query heads, {N_LAYERS} layers, T={CONTEXT}, {steps} steps from scratch; "
                 "bars: the mean's 95% interval,\ndots: seeds (their number in brackets)", fontsize=9)
    fig.tight_layout()
    return fig


def plot_point(ax, name, x, losses):
    """One point of the figure: a model's losses over seeds at x, its cache bytes per token."""
    mean, color = statistics.mean(losses), COLORS.get(name)
    low, high = interval(losses) or (mean, mean)
    ax.errorbar([x], [mean], yerr=[[mean - low], [high - mean]], marker="o", capsize=4, color=color)
    ax.scatter([x] * len(losses), losses, s=8, color=color, alpha=0.4)
    ax.annotate(f"{name} ({len(losses)})", (x, mean), xytext=(8, 4), textcoords="offset points", size=9)


# ----------------------------------------------------------------------------- on both cores
# A model this small splits badly over threads. On a 2-core AMD EPYC a training step of the MHA took 37 ms on
# one thread, 26 ms on two, and 42 ms in each of two one-thread processes side by side: 48 steps a second, against
# 39 and 27. So models train in WORKERS one-thread processes (a ProcessPoolExecutor, in the plumbing below); a
# model's numbers depend only on its task, never on which worker ran it or how many there are.
WORKER = {}   # in a worker process: the data


def start_worker(parent):
    """Each worker, once, before its first task: one thread, the data, and a watch on its parent."""
    torch.set_num_threads(1)
    threading.Thread(target=exit_with_parent, args=(parent,), daemon=True).start()
    WORKER["data"] = Data(load_text())


def exit_with_parent(parent):
    """End this worker within half a second of its parent's end, even by kill -9 (the worker gets a new parent)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


# ----------------------------------------------------------------------------- main
def train_everything(args, run):
    """The data, then A and B on the workers, each table printed when known: A's {config: {seed: Trained}}."""
    text = load_text()
    data, digest = Data(text), hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]   # another Python, another text
    print(f"What GQA and MQA cost in quality: a character-level LM, d={D_MODEL}, {N_HEADS} query heads of width "
          f"{D_MODEL // N_HEADS}, {N_LAYERS} layers, T={CONTEXT}, batch {BATCH}\ndata: pydoc_data.topics of Python "
          f"{sys.version.split()[0]}: {len(text):,} characters, {len(data.chars)} distinct, sha256 {digest}\n      "
          f"train {len(data.train):,} characters, validation {len(data.val):,} (the last {VAL_FRACTION:.0%}); the "
          f"loss is measured on {EVAL_WINDOWS} windows = {EVAL_WINDOWS * CONTEXT:,} characters\ntorch "
          f"{torch.__version__}, {WORKERS} worker process{'es' * (WORKERS > 1)} of 1 thread each: the same seeds give "
          "the same numbers to the bit, whatever the number of workers", flush=True)
    scratch = run_from_scratch(args.seeds, args.steps, run)
    print_table_a(scratch, args.steps)
    curves = run_conversion(scratch, args.steps, run, args.seeds[:GQA_SEEDS])
    print_table_b(curves, scratch, args.steps)
    return scratch


def main(argv=None):
    args = parse_args(argv)        # a bad flag or --out-dir ends here, in one line (exit code 2)
    if args.quick:
        print(f"--quick: a smoke run ({args.steps} steps, seeds {args.seeds}): it resolves nothing")
    further = sum(uptrain_steps(args.steps, pool) for _, pool in targets())        # B's, for each converted seed
    total = sum(len(seeds_of(n, args.seeds)) for n in CONFIGS) * args.steps + len(args.seeds[:GQA_SEEDS]) * further
    estimate = total * STEP_SECONDS / WORKERS + 30        # 30 s to start, evaluate and draw
    print(f"This run: {total:,} training steps on {WORKERS} worker{'s' * (WORKERS > 1)}, about {estimate / 60:.1f} min "
          f"at {STEP_SECONDS * 1e3:.0f} ms a step in each (2 quiet cores have taken 16 to 42); the progress "
          "line on stderr tells how long here", flush=True)
    start = time.perf_counter()
    try:
        with workers(total) as run:
            scratch = train_everything(args, run)
    except concurrent.futures.process.BrokenProcessPool:
        print("quality.py: error: a worker process stopped (killed, or out of memory?) before its models were "
              "trained; nothing was written", file=sys.stderr)
        return 1
    fig = plot_quality(scratch, args.steps)
    fig.savefig(os.path.join(args.out_dir, FIGURE), dpi=100)   # Agg's PNG holds no date: the same bytes
    print(f"\nFigure written to {os.path.join(os.path.relpath(args.out_dir), FIGURE)}")
    wall = time.perf_counter() - start
    print(f"time: {wall / 60:.1f} min (estimated {estimate / 60:.1f}), {WORKERS} worker{'s' * (WORKERS > 1)} of 1 "
          f"thread: {wall * WORKERS / total * 1e3:.0f} ms a training step in each, all else included")
    return 0


# ----------------------------------------------------------------------------- plumbing (not the lesson)
@contextlib.contextmanager
def workers(total):
    """run(part, calls): fn(*args) of each (fn, args, steps) on WORKERS processes, results in order, progress on
    stderr. A failing task or Ctrl-C stops every worker at once (the pool itself would wait for busy ones)."""
    context = multiprocessing.get_context("spawn")        # a fresh interpreter: no threads or locks inherited
    pool = concurrent.futures.ProcessPoolExecutor(WORKERS, context, initializer=start_worker, initargs=(os.getpid(),))
    start, done, shown = time.perf_counter(), 0, (0.0, 0)

    def run(part, calls):
        nonlocal done, shown
        ctrl_c = signal.signal(signal.SIGINT, signal.SIG_IGN)   # workers start during submit: born deaf to
        try:                                                     # Ctrl-C, which the parent takes for them
            futures = {pool.submit(fn, *args): steps for fn, args, steps in calls}
        finally:
            signal.signal(signal.SIGINT, ctrl_c)
        for future in concurrent.futures.as_completed(futures):
            future.result()                              # a task's exception, raised here at once
            done, seconds = done + futures[future], time.perf_counter() - start
            if seconds - shown[0] > 10 or shown[1] < done == total:   # a line at most every 10 s, and the last
                shown = seconds, done
                left = seconds / max(done, 1) * (total - done)
                print(f"{part}: {done:,} of {total:,} training steps, {timedelta(seconds=round(seconds))} so far, "
                      f"~{timedelta(seconds=round(left))} left", file=sys.stderr, flush=True)
        return [future.result() for future in futures]

    try:
        yield run
    except BaseException:
        for p in multiprocessing.active_children():
            p.terminate()
        raise
    finally:
        pool.shutdown(cancel_futures=True)


def parse_args(argv=None):
    """The flags, defaulting to the knobs; a bad one, or a folder that cannot be made, ends the run in one line."""
    parser = argparse.ArgumentParser(prog="quality.py", description="What sharing K/V heads costs in quality.")
    parser.add_argument("--steps", type=int, help=f"steps of each from-scratch model ({STEPS}; {QUICK_STEPS} quick)")
    parser.add_argument("--seeds", type=int, nargs="+", help=f"seeds of MHA and MQA; the others take the first "
                        f"{GQA_SEEDS} ({' '.join(map(str, SEEDS))}; {' '.join(map(str, QUICK_SEEDS))} quick)")
    parser.add_argument("--quick", action="store_true", help="the smoke run for trying an edit: it resolves nothing")
    parser.add_argument("--out-dir", default=OUT_DIR, help="where the figures go (default: figures/)")
    args = parser.parse_args(argv)
    args.steps = (QUICK_STEPS if args.quick else STEPS) if args.steps is None else args.steps
    args.seeds = args.seeds or list(QUICK_SEEDS if args.quick else SEEDS)
    if args.steps < 1:
        parser.exit(2, f"quality.py: error: --steps {args.steps} must be at least 1\n")
    if CONFIGS.get("MHA") != N_HEADS or any(kv < 1 or N_HEADS % kv for kv in CONFIGS.values()):
        parser.exit(2, f"quality.py: error: CONFIGS={CONFIGS} (at the top of quality.py) must map 'MHA' to "
                       f"N_HEADS={N_HEADS} and every name to a divisor of it\n")
    try:
        os.makedirs(args.out_dir, exist_ok=True)
    except OSError as e:
        parser.exit(2, f"quality.py: error: --out-dir {args.out_dir!r} cannot be made: {e.strerror}\n")
    return args


if __name__ == "__main__":
    try:
        code = main()
        sys.stdout.flush()                                 # here, so that a closed pipe is caught below
    except KeyboardInterrupt:                              # Ctrl-C: the workers are stopped already (workers())
        print("\nquality.py: interrupted", file=sys.stderr)
        code = 130
    except BrokenPipeError:                                # python quality.py | head: the reader left; end quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # as Python's documentation advises
        code = 1
    sys.exit(code)
