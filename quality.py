"""
What grouped-query (GQA) and multi-query (MQA) attention cost in quality, measured on real text, in minutes.

mha.py measures what sharing K/V heads saves; this file measures what it costs. It trains a tiny character-level
language model built around mha.CausalMHA on Python's own documentation (pydoc_data.topics, no download) and
reports validation loss in bits per character, with a 95 % confidence interval for every comparison.
  A. From scratch: MHA, GQA-4, GQA-2 and MQA, a seed's configurations sharing initialisation and batches, matched
     on width, not parameters (MQA has 12 % fewer). MHA and MQA train on 5 seeds: 81 % power to resolve MQA's cost
     at the pilot's point estimate (seeds 10 to 15), about 75 % over its uncertainty; GQA-4 and GQA-2 on 3.
  B. Conversion (Ainslie et al. 2023): each trained MHA of those 3 seeds becomes GQA/MQA by pooling its K/V heads
     and trains on as A would have gone on, for 5 % more steps (20 % for mean pooling), beside the MHA resumed alike.
  C. What each head of a trained MHA attends to, and its attention maps on a real passage.
  D. Head ablation (Michel et al. 2019): how much one trained MHA needs each of its heads.
It does not claim the cost at scale (d=64, two layers, minutes of training); no dropout, GPU, tokenizer.

Run it:   python quality.py           (6 minutes on 2 quiet cores, up to 13 on a slow or busy machine; writes figures/)
          python quality.py --quick   (half a minute: a smoke run for trying an edit; it resolves nothing)

Papers: Vaswani et al. 2017, arXiv:1706.03762; Shazeer 2019 (MQA), arXiv:1911.02150; Ainslie et al. 2023 (GQA),
arXiv:2305.13245; Michel, Levy and Neubig 2019, "Are Sixteen Heads Really Better than One?", arXiv:1905.10650.
Shapes, the alphabet of mha.py: B batch, T characters in a window, d model width, h query heads, kv K/V heads,
dh = d / h head width, V distinct characters (the vocabulary).
"""

import argparse
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
BLOCKS = 8            # D's intervals: over 8 blocks of 32 consecutive windows (batch means)
PASSAGE = 36          # characters of the passage whose attention maps are drawn (C)
WORKERS = 2           # processes that train models side by side, one torch thread each (see "on both cores")
STEP_SECONDS = 0.02   # a step in each of 2 workers side by side (16 to 42 ms on 2 cores, by the day): the estimate
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "figures")
FIGURES = ("quality.png", "trained_attention_maps.png")
BITS = (8, 4, 3, 2)   # E: the cache's numbers in these many bits, every model of A
BUDGETS = (2, 4, 8)   # E's answer: the best option within 1/2, 1/4 and 1/8 of MHA's bf16 bytes
SCALE_BYTES = 2       # E: a bf16 scale per group of dh numbers
DECODE_TOLERANCE = 1e-5   # E's check: a character at a time against a whole window (rounding)


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
        starts = torch.linspace(0, len(self.val) - CONTEXT - 1, EVAL_WINDOWS).long()
        self.val_x, self.val_y = windows(self.val, starts)  # (EVAL_WINDOWS, T) each

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

    def forward(self, x, need_weights=False, cache=None):  # x: (B, T, d); p: (B, h, T, T) or None
        # Training runs the fused call: faster, and the same function as the written-out one need_weights runs.
        if need_weights:
            a, p = self.attn(self.ln1(x), need_weights=True)
        else:
            a, p = self.attn(self.ln1(x), cache=cache, fused=True), None
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

    def forward(self, x, need_weights=False, caches=None):
        """x: (B, T) character ids -> logits (B, T, V), and with need_weights each layer's
        (B, h, T, T). With caches, a K/V cache per block (E), x holds the characters after those
        cached."""
        start = 0 if caches is None else caches[0].length  # where x's characters sit in the window
        h = self.embed(x) + self.pos[start:start + x.shape[1]]   # (B, T, d)
        maps = []
        for block, cache in zip(self.blocks, caches or [None] * len(self.blocks)):
            h, p = block(h, need_weights, cache)
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


def cache_bytes_per_token(n_kv_heads, bits=None):
    """KV-cache bytes one token adds: 2 (K and V) x layers x K/V heads x dh x bytes a number: 2,
    bf16, as mha.py's tables count (this model computes in float32). In fewer bits (E) a number takes
    bits / 8 bytes and its share of its group's bf16 scale, 2 / dh: at 4 bits and dh = 8,
    0.5 + 0.25 bytes, 6 bits a number, not 4. cache_bytes_per_token(8) == 512,
    cache_bytes_per_token(8, 4) == 192"""
    dh = D_MODEL // N_HEADS
    per_number = 2 if bits is None else bits / 8 + SCALE_BYTES / dh
    return round(mha.kv_cache_bytes(N_LAYERS, n_kv_heads, dh, 1, bytes_per_elem=per_number))


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
            curve[step] = window_losses(model, data).mean().item()
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
def window_losses(model, data, bits=None):
    """Validation bits/char of each of the EVAL_WINDOWS windows, (EVAL_WINDOWS,), 64 windows at a
    time; with bits, every attention's K and V kept in a QuantizedKVCache of that many bits (E)."""
    model.eval()
    logits = []
    for x in data.val_x.split(64):                         # (64, T) each
        caches = None if bits is None else quantized_caches(model, len(x), bits)
        logits.append(model(x, caches=caches))             # (64, T, V)
    logits = torch.cat(logits)                             # (N, T, V)
    model.train()
    nats = F.cross_entropy(logits.transpose(1, 2), data.val_y, reduction="none")          # (N, V, T) -> (N, T)
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


def paired(values, digits=3):
    """'+0.031 [-0.029, +0.091]': the mean paired difference and its 95 % interval ('+0.031' for one seed)."""
    ci, f = interval(values), f"{{:+.{digits}f}}".format
    return f(statistics.mean(values)) + ("" if ci is None else f" [{f(ci[0])}, {f(ci[1])}]")


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
def run_from_scratch(seeds, steps, run):
    """Train every configuration on its seeds. Returns {config: {seed: (model, validation bits/char, AdamW state)}}."""
    tasks = [(name, seed, steps) for name in CONFIGS for seed in seeds_of(name, seeds)]   # MHA, the longest, first
    done = run("A. from scratch", [(train_from_scratch, task, steps) for task in tasks])
    results = {name: {} for name in CONFIGS}
    for (name, seed, _), result in zip(tasks, done):
        results[name][seed] = result
    return results


def train_from_scratch(name, seed, steps):
    """One from-scratch model in a worker (WORKER holds its data): (model, its validation loss, AdamW's state)."""
    model, data = fresh_models(len(WORKER["data"].chars), seed)[name], WORKER["data"]
    opt = optimizer(model)
    return model, train(model, opt, data, data.batches(seed, steps), lr_at, {steps})[steps], opt.state_dict()


def gaps(scratch, name):
    """name minus MHA, one paired difference for each seed of name."""
    return [run[1] - scratch["MHA"][s][1] for s, run in scratch[name].items()]


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
        losses = [run[1] for run in scratch[name].values()]
        params = sum(p.numel() for p in next(iter(scratch[name].values()))[0].parameters())
        sd = f"{statistics.stdev(losses):.3f}" if len(losses) > 1 else ""
        compared = "" if name == "MHA" else f"{paired(gaps(scratch, name)):<25} {said[name]}"
        print(f"   {name:<7}{kv:>10}{params:>9,}{cache_bytes_per_token(kv):>16,}{len(losses):>7}"
              f"{statistics.mean(losses):>8.3f}{sd:>7}   {compared}".rstrip())
    sys.stdout.flush()


# ----------------------------------------------------------------------------- B. conversion
# Ainslie et al. continue pre-training a converted checkpoint on its own recipe for 5 % of its steps. Here A goes on:
# AdamW resumed (K/V rows' moments pooled like their weights), its last lr, its next batches; the control likewise.
def run_conversion(scratch, steps, run, seeds):
    """Every conversion of seeds' MHAs, trained on, and beside them D's ablation: ({seed: {(config, pool): {step:
    bits/char}}}, head_ablation's result). ("MHA", "none") is the control, the MHA resumed unchanged."""
    tasks = [(name, pool, seed, steps, scratch["MHA"][seed][0], scratch["MHA"][seed][2])
             for seed in seeds for name, pool in targets()]
    ablated, *done = run("B. conversion", [(head_ablation, (scratch["MHA"][seeds[0]][0],), 0)]
                         + [(convert_and_train, task, uptrain_steps(steps, task[1])) for task in tasks])
    curves = {seed: {} for seed in seeds}
    for (name, pool, seed, *_), curve in zip(tasks, done):
        curves[seed][name, pool] = curve
    return curves, ablated


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
              f"{statistics.mean([scratch[name][s][1] for s in seeds]):>11.3f}")
    print("   the control resumed, minus untouched (A's MHA), paired by seed: " + ", ".join(
        f"{label} {paired([c - u for c, u in zip(control[k], control[0])])}" for k, label in more))
    print(f"   {up} steps are {UPTRAIN:.0%} of A's, as in the paper, where 5 % of T5's training is tens of thousands "
          f"of steps on\n   far larger batches: {up} small updates at A's last lr show recovery starting, not where "
          "it ends.\n   B's intervals are each at 95%, not corrected for their number: read them as a description")


# ----------------------------------------------------------------------------- E. fewer bits
# The other way to a smaller cache: keep every K/V head, store each cached number in fewer bits.
# A group of numbers shares one scale s = max|x| / qmax, where qmax = 2^(bits - 1) - 1; each
# number x is kept as the whole number code = round(x / s), from -qmax to qmax, and comes back as
# code * s (symmetric, round to nearest). Here a group is one head's dh = 8 keys (or values) of one
# token, and s is stored in bf16: 2 bytes shared by 8 numbers. By hand, at 4 bits (qmax = 7):
#     x      = [0.6, -1.75, 0.1, 0.3, 1.0, -0.4, 0.0, 0.9]         s = 1.75 / 7 = 0.25
#     x / s  = [2.4, -7,    0.4, 1.2, 4,   -1.6, 0,   3.6]
#     codes  = [2,   -7,    0,   1,   4,   -2,   0,   4]
#     back   = [0.5, -1.75, 0.0, 0.25, 1.0, -0.5, 0.0, 1.0]        each within s / 2 of x
def quantize(x, bits):
    """x: (..., G) -> codes (..., G), int8 from -qmax to qmax, and scales (..., 1), bf16."""
    qmax = 2 ** (bits - 1) - 1
    scale = (x.abs().amax(-1, keepdim=True) / qmax).to(torch.bfloat16)   # (..., 1): one per group
    scale = scale.clamp_min(torch.finfo(torch.bfloat16).tiny)   # a group of zeros: codes 0, not 0/0
    # bf16 may round s down a little, so x / s can pass qmax by a hair: clamped.
    codes = torch.round(x / scale.to(x.dtype)).clamp(-qmax, qmax)
    return codes.to(torch.int8), scale


def dequantize(codes, scale, dtype):
    """code * s, in dtype: (..., G) and (..., 1) -> (..., G)."""
    return codes.to(dtype) * scale.to(dtype)


# Codes of fewer than 8 bits are packed: each 8 codes, shifted up by qmax to 0 .. 2 qmax, lie side
# by side in `bits` bytes, the first lowest. At 4 bits, two codes a byte: the codes above + 7 are
# [9, 0, 7, 8, 11, 5, 7, 11], so the bytes are [9 + 16 * 0, 7 + 16 * 8, 11 + 16 * 5, 7 + 16 * 11]
# = [9, 135, 91, 183].
def pack(codes, bits):
    """int8 codes (..., G), G a multiple of 8 -> uint8 (..., G * bits / 8)."""
    u = codes.long() + 2 ** (bits - 1) - 1                 # (..., G): 0 .. 2 qmax, within bits
    if bits == 8:
        return u.to(torch.uint8)                           # a code a byte
    u = u.unflatten(-1, (-1, 8))                           # (..., G) -> (..., G / 8, 8)
    word = (u << (bits * torch.arange(8))).sum(-1)         # (..., G / 8): 8 codes in 8 bits bits
    out = (word[..., None] >> (8 * torch.arange(bits))) & 255   # (..., G / 8, bits): its bytes
    return out.to(torch.uint8).flatten(-2)                 # -> (..., G * bits / 8)


def unpack(packed, bits):
    """pack's inverse: uint8 (..., G * bits / 8) -> int8 codes (..., G)."""
    if bits == 8:
        u = packed.long()                                  # (..., G)
    else:
        b = packed.long().unflatten(-1, (-1, bits))        # -> (..., G / 8, bits)
        word = (b << (8 * torch.arange(bits))).sum(-1)    # (..., G / 8)
        u = (word[..., None] >> (bits * torch.arange(8))) & (2 ** bits - 1)   # (..., G / 8, 8)
        u = u.flatten(-2)                                  # (..., G / 8, 8) -> (..., G)
    return (u - (2 ** (bits - 1) - 1)).to(torch.int8)


class QuantizedKVCache:
    """A KV cache that keeps K and V in `bits` bits as tokens arrive: packed codes, and a bf16 scale
    per group of dh numbers (one head of one token). mha.CausalMHA takes it as its cache: forward
    reads shape (B, kv, max_len, dh), dtype, device and length, and calls append(k, v)."""

    def __init__(self, batch, n_kv_heads, max_len, d_head, bits, dtype=torch.float32, device="cpu"):
        check_bits(bits, d_head)                           # one sentence if they cannot work
        self.shape = (batch, n_kv_heads, max_len, d_head)  # (B, kv, max_len, dh): what it can hold
        self.bits, self.dtype, self.device, self.length = bits, dtype, torch.device(device), 0
        codes = (batch, n_kv_heads, max_len, d_head * bits // 8)   # (B, kv, max_len, dh bits / 8)
        scales = (batch, n_kv_heads, max_len, 1)                   # (B, kv, max_len, 1)
        self.k_codes = torch.zeros(codes, dtype=torch.uint8, device=device)
        self.v_codes = torch.zeros(codes, dtype=torch.uint8, device=device)
        self.k_scales = torch.zeros(scales, dtype=torch.bfloat16, device=device)
        self.v_scales = torch.zeros(scales, dtype=torch.bfloat16, device=device)

    def append(self, k, v):
        """Round k, v: (B, kv, T, dh) into the next T positions; return all S so far, rounded,
        (B, kv, S, dh) in dtype."""
        S = self.length + k.shape[2]                       # tokens held after this call
        stored = ((k, self.k_codes, self.k_scales), (v, self.v_codes, self.v_scales))
        for x, codes, scales in stored:
            c, s = quantize(x, self.bits)                  # (B, kv, T, dh), (B, kv, T, 1)
            codes[:, :, self.length:S] = pack(c, self.bits)   # (B, kv, T, dh bits / 8)
            scales[:, :, self.length:S] = s
        self.length = S
        return self.read(self.k_codes, self.k_scales), self.read(self.v_codes, self.v_scales)

    def read(self, codes, scales):
        """The tokens held, back from their codes: (B, kv, S, dh) in dtype."""
        S = self.length
        return dequantize(unpack(codes[:, :, :S], self.bits), scales[:, :, :S], self.dtype)

    def nbytes(self):
        """Bytes of what it stores, read from its own tensors: codes and scales."""
        held = (self.k_codes, self.v_codes, self.k_scales, self.v_scales)
        return sum(t.numel() * t.element_size() for t in held)


def quantized_caches(model, batch, bits):
    """An empty QuantizedKVCache for each block of model, room for a window, in its dtype."""
    like = {"dtype": model.readout.weight.dtype, "device": model.readout.weight.device}
    return [QuantizedKVCache(batch, block.attn.n_kv_heads, CONTEXT, block.attn.d_head, bits, **like)
            for block in model.blocks]


def fewer_bits(model):
    """In a worker: {bits: validation bits/char} of model, its K and V cached in each of BITS."""
    return {bits: window_losses(model, WORKER["data"], bits).mean().item() for bits in BITS}


def run_fewer_bits(scratch, run):
    """Every model of A in each of BITS, on the workers: {(config, bits): {seed: bits/char}}; bits
    None is the model as trained (A's own loss)."""
    tasks = [(name, seed) for name in CONFIGS for seed in scratch[name]]
    calls = [(fewer_bits, (scratch[name][seed][0],), 0) for name, seed in tasks]
    losses = {(name, bits): {} for name in CONFIGS for bits in (None, *BITS)}
    for (name, seed), by_bits in zip(tasks, run("E. fewer bits", calls)):
        losses[name, None][seed] = scratch[name][seed][1]
        for bits, loss in by_bits.items():
            losses[name, bits][seed] = loss
    return losses


def kind(name, bits):
    """How an option shrinks MHA's cache: 'fewer heads', 'fewer bits', 'both' or 'neither'."""
    heads = CONFIGS[name] < N_HEADS
    if bits is None:
        return "fewer heads" if heads else "neither"
    return "both" if heads else "fewer bits"


def print_table_e(losses):
    print("\nE. Fewer bits: every model of A with its cached K and V rounded to n bits by a "
          "QuantizedKVCache (symmetric,\n   round to nearest, one bf16 scale per group of dh = 8 "
          "numbers: a head's keys, or values, of one token),\n   minus the same model as trained, "
          "paired by seed [95% interval over seeds]. Bytes a token: 2 (K and V)\n   x layers x K/V "
          "heads x dh x (bits / 8 + 2 / dh), codes and their scales; as trained ('full'): 2 bytes "
          "a\n   number (bf16), as mha.py's tables count, though these models compute in float32")
    print(f"   {'config':<7}{'K/V heads':>10}{'bits':>6}{'KV bytes/token':>16}{'seeds':>7}"
          f"{'mean':>8}   minus full [95% interval]")
    for (name, bits), by_seed in losses.items():
        full, kv = losses[name, None], CONFIGS[name]
        gap = "" if bits is None else paired([by_seed[s] - full[s] for s in by_seed], digits=4)
        print(f"   {name:<7}{kv:>10}{bits or 'full':>6}{cache_bytes_per_token(kv, bits):>16,}"
              f"{len(by_seed):>7}{statistics.mean(by_seed.values()):>8.3f}   {gap}".rstrip())


def print_answer(losses):
    """At each fraction of MHA's bytes in BUDGETS: the lowest mean loss of each kind that fits, each
    against the best, paired over the seeds both trained on; the answer is the best and every kind
    not resolved from it."""
    full = cache_bytes_per_token(N_HEADS)
    mean = {option: statistics.mean(by_seed.values()) for option, by_seed in losses.items()}

    def said(name, bits):
        how = "as trained" if bits is None else f"in {bits} bits"
        size = cache_bytes_per_token(CONFIGS[name], bits)
        return f"{name} {how} ({size} bytes), {mean[name, bits]:.3f}"

    print("\n   The answer at equal bytes: the lowest mean loss of each kind that fits, minus "
          "the best, paired over\n   the seeds both ran [95% interval]; the answer is the best and "
          "every kind not resolved from it")
    for fraction in BUDGETS:
        budget, best = full // fraction, {}
        for name, bits in sorted(losses, key=mean.get):
            if cache_bytes_per_token(CONFIGS[name], bits) <= budget:
                best.setdefault(kind(name, bits), (name, bits))   # the first of each kind: its best
        top, *others = sorted(best.values(), key=mean.get)
        answer = [kind(*top)]
        print(f"   1/{fraction} of MHA's {full} bytes a token, {budget}: the best is {kind(*top)}, "
              f"{said(*top)}")
        for option in others:
            diffs = [losses[option][s] - losses[top][s] for s in losses[option] if s in losses[top]]
            ci = interval(diffs)
            if ci is None or ci[0] <= 0:
                answer.append(kind(*option))
            print(f"      {kind(*option) + ':':<13}{said(*option)}; minus the best "
                  f"{paired(diffs, digits=4)}")
        for missing in sorted({"fewer heads", "fewer bits", "both"} - set(best)):
            print(f"      {missing + ':':<13}none fits")
        tie = " (not resolved between them)" if len(answer) > 1 else ""
        print(f"      answer: {' or '.join(answer)}{tie}")
    print("   At scale, papers round the caches of models as they are: KIVI (arXiv:2402.02750) "
          "to 2 bits, keys\n   per channel, values per token, the newest tokens in full precision; "
          "KVQuant\n   (arXiv:2401.18079) to 3 bits, keys per channel before RoPE, non-uniform "
          "levels. Both report\n   nearly full-precision quality on models of dh = 128, where a scale "
          "per group costs little,\n   among them models that already share K/V heads: at scale, "
          "servers do both")


def check_quantized_cache(model, data, seed, bits=4):
    """A trained model decoding one validation window a character at a time, each block's
    mha.CausalMHA with a QuantizedKVCache, against the whole window at once with the same rounding;
    and the caches' bytes, read from their tensors, against the formula. Prints the evidence."""
    x = data.val_x[:1]                                     # (1, T)
    with torch.no_grad():
        whole = model(x, caches=quantized_caches(model, 1, bits))   # (1, T, V)
        caches = quantized_caches(model, 1, bits)
        steps = [model(x[:, t:t + 1], caches=caches) for t in range(CONTEXT)]   # each (1, 1, V)
    diff = (torch.cat(steps, dim=1) - whole).abs().max().item()
    held, formula = sum(c.nbytes() for c in caches), CONTEXT * cache_bytes_per_token(N_HEADS, bits)
    ok = diff <= DECODE_TOLERANCE and held == formula
    print(f"   The cache itself, {bits} bits, the MHA of seed {seed}: a character at a time "
          f"against the whole window,\n   max |logits difference| = {diff:.2e} (tolerance "
          f"{DECODE_TOLERANCE:.0e}); its tensors hold {held:,} bytes, the formula\n   "
          f"{CONTEXT} tokens x {formula // CONTEXT} = {formula:,}   {'OK' if ok else 'FAIL'}")
    return ok


# ----------------------------------------------------------------------------- C. trained attention maps
def passage_start(text):
    """The first line of the text that opens with a capital and runs PASSAGE characters of plain prose."""
    plain = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ,.")
    return next(i for i in range(1, len(text) - PASSAGE)
                if text[i - 1] == "\n" and text[i].isupper() and set(text[i:i + PASSAGE]) <= plain)


@torch.no_grad()
def head_roles(model, data):
    """({role: (layers, h)}, {role: level}): each head's mean attention on four kinds of key (previous, itself,
    whitespace, word start) over the validation windows, and uniform causal attention's level, favouring none."""
    x, (N, T) = data.val_x, data.val_x.shape               # (N, T)
    maps = model(x, need_weights=True)[1]                   # each (N, h, T, T)
    space = torch.tensor([c.isspace() for c in data.chars])[x]        # (N, T)
    pos = torch.arange(T).expand_as(x)                                 # (N, T)
    # The start of the word that holds position i: the latest j <= i with j == 0 or a space at j - 1.
    after_space = torch.cat([torch.ones_like(space[:, :1]), space[:, :-1]], dim=1)   # (N, T)
    word_start = torch.where(after_space, pos, torch.zeros_like(pos)).cummax(dim=1).values  # (N, T)
    keys = torch.arange(T)
    masks = {"previous": (keys[None, :] == keys[:, None] - 1).expand(N, T, T),           # (N, T, T) each
             "itself": (keys[None, :] == keys[:, None]).expand(N, T, T),
             "whitespace": space[:, None, :].expand(N, T, T), "word start": keys == word_start[:, :, None]}

    def on(p, m):                                           # p (N, h, T, T), m (N, T, T) -> (h,)
        return (p * m[:, None].float())[:, :, 1:].sum(-1).mean((0, 2))   # row 0 can only see itself

    uniform = torch.tril(torch.ones(T, T)) / (keys[:, None] + 1)       # (T, T): row i is 1/(i+1) on keys 0..i
    roles = {role: torch.stack([on(p, m) for p in maps]) for role, m in masks.items()}   # (layers, h) each
    return roles, {role: on(uniform.expand(N, 1, T, T), m).item() for role, m in masks.items()}


def strongest(roles, chance, layer, head):
    """('itself', 7.7): the kind of key a head favours most, in multiples of uniform's level: a label, no more."""
    ratios = {r: roles[r][layer, head].item() / chance[r] for r in roles}
    top = max(ratios, key=ratios.get)
    return top, ratios[top]


def print_table_c(roles, chance, seed):
    best = divmod(int(roles["previous"].argmax()), N_HEADS)
    print(f"\nC. What each head of the trained MHA attends to (seed {seed}): mean attention on each kind of key, over "
          f"{EVAL_WINDOWS * CONTEXT:,}\n   validation characters. 'uniform' attends to every key so far alike; "
          "'favours most' is the kind of key, of\n   these four, with the largest multiple of that uniform level")
    print(f"   {'layer':>5}{'head':>5}" + "".join(f"{role:>12}" for role in roles) + "   favours most\n"
          + f"   {'uniform':>10}" + "".join(f"{chance[r]:>11.0%} " for r in roles).rstrip())
    for i in range(N_LAYERS):
        for j in range(N_HEADS):
            print(f"   {i:>5}{j:>5}" + "".join(f"{roles[r][i, j].item():>11.0%} " for r in roles)
                  + "  {}, {:.1f}x uniform".format(*strongest(roles, chance, i, j)))
    print(f"   most previous-character-like: {best[0]}.{best[1]}, {roles['previous'][best]:.0%} on the previous one")
    return best


# ----------------------------------------------------------------------------- D. head ablation
# Michel, Levy and Neubig (2019) silence heads of a trained model at test time and find that many can go with little
# loss. Table C tells a story about each head; here one trained model is asked how much it needs each one.
def without_heads(model, heads):
    """A copy of model with each (layer, head) in heads silenced: out_proj sees o = [o_0 | ... | o_7], so
    W o + b = W[:, 0:dh] o_0 + ... + b, and zeroing head j's dh columns of W zeroes o_j (Michel et al.'s mask)."""
    new, dh = copy.deepcopy(model), D_MODEL // N_HEADS
    with torch.no_grad():
        for layer, head in heads:
            new.blocks[layer].attn.out_proj.weight[:, head * dh:(head + 1) * dh] = 0.0   # W: (d, h * dh)
    return new


def head_ablation(model, data=None):
    """(each window's loss, {(layer, head): each window's loss rise with that head silenced})."""
    data, heads = data or WORKER["data"], [(i, j) for i in range(N_LAYERS) for j in range(N_HEADS)]
    base = window_losses(model, data)
    return base, {hd: window_losses(without_heads(model, [hd]), data) - base for hd in heads}


def block_means(rise):
    """Means of BLOCKS runs of consecutive windows: neighbours correlate, so D's intervals are over these."""
    return [b.mean().item() for b in torch.tensor_split(rise, BLOCKS)]


def print_table_d(ablation, roles, chance, seed, best):
    base, alone = ablation
    heads, rise = list(alone), {hd: alone[hd].mean().item() for hd in alone}
    rank = {hd: k + 1 for k, hd in enumerate(sorted(heads, key=rise.get, reverse=True))}
    lags = {k: [torch.corrcoef(torch.stack([r[:-k], r[k:]]))[0, 1].item() for r in alone.values()] for k in (1, 10)}
    width = len(alone[heads[0]]) // BLOCKS
    print(f"\nD. How much one trained MHA (seed {seed}) needs each head (Michel et al. 2019): the loss with one head's "
          f"output\n   zeroed before out_proj, minus the intact model's {base.mean():.3f} bits/char, on the same "
          f"{EVAL_WINDOWS} windows. The validation text\n   is the documentation's last topics, in name order, and a "
          f"window's rise correlates with its neighbours'\n   far along (over the heads, at lag 1 {min(lags[1]):+.2f} "
          f"to {max(lags[1]):+.2f}, at lag 10 {min(lags[10]):+.2f} to {max(lags[10]):+.2f}), so the [95% interval]\n"
          f"   is over {BLOCKS} blocks of {width} consecutive windows (90 % coverage, measured): the sampling of "
          "windows\n   for this one model, not other seeds. Rank 1: the head most needed; role: C's 'favours most'")
    print(f"   {'layer':>5}{'head':>5}   {'loss rise [95% interval]':<27}{'rank':>4}   role (C)")
    for hd in heads:
        role = "{}, {:.1f}x uniform".format(*strongest(roles, chance, *hd))
        print(f"   {hd[0]:>5}{hd[1]:>5}   {paired(block_means(alone[hd])):<27}{rank[hd]:>4}   {role}")
    print(f"   does C predict D? the most previous-character-like head ({best[0]}.{best[1]}) ranks {rank[best]} of "
          f"{len(heads)}, and the roles above are labels from four\n   kinds of key: 16 heads cannot show whether "
          "a role ranks importance")


# ----------------------------------------------------------------------------- figures
COLORS = {"MHA": "tab:blue", "GQA-4": "tab:green", "GQA-2": "tab:purple", "MQA": "tab:red"}   # as in mha.py's figures
ROLE_COLORS = {"previous": "tab:orange", "itself": "tab:olive", "whitespace": "tab:cyan", "word start": "tab:pink"}


def plot_quality(scratch, steps, ablation, roles, chance, seed):
    """Left: A's loss against KV-cache bytes per token. Right: D, each head's loss rise, coloured by its role (C)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    fig = Figure(figsize=(16, 5.5))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 2]})
    for name, kv in CONFIGS.items():
        losses, color = [run[1] for run in scratch[name].values()], COLORS.get(name)
        mean, b = statistics.mean(losses), cache_bytes_per_token(kv)
        low, high = interval(losses) or (mean, mean)
        left.errorbar([b], [mean], yerr=[[mean - low], [high - mean]], marker="o", capsize=4, color=color)
        left.scatter([b] * len(losses), losses, s=8, color=color, alpha=0.4)
        left.annotate(f"{name} ({len(losses)})", (b, mean), textcoords="offset points", xytext=(8, 4), fontsize=9)
    left.set_xscale("log", base=2)
    ticks = sorted(cache_bytes_per_token(kv) for kv in CONFIGS.values())
    left.set_xticks(ticks, [str(t) for t in ticks])
    left.minorticks_off()
    left.set(xlabel="KV cache per token (bytes, float32)", ylabel="validation loss (bits/char)")
    left.set_title(f"A. From scratch, {steps} steps: mean, bars: its 95% interval;\ndots: seeds (their number in "
                   "brackets)", fontsize=9)
    alone = ablation[1]
    for k, hd in enumerate(alone):
        rise = block_means(alone[hd])
        mean, (low, high) = statistics.mean(rise), interval(rise)
        right.bar(k, mean, color=ROLE_COLORS[strongest(roles, chance, *hd)[0]], yerr=[[mean - low], [high - mean]],
                  capsize=3)
    right.legend([Patch(color=c) for c in ROLE_COLORS.values()], [f"favours most (table C): {r}" for r in ROLE_COLORS],
                 fontsize=8)
    right.set_xticks(range(len(alone)), [f"{layer}.{head}" for layer, head in alone])
    right.axhline(0.0, color="black", lw=0.8)
    right.set(xlabel="layer.head", ylabel="loss rise with this head silenced (bits/char)")
    right.set_title(f"D. Each head of one trained MHA (seed {seed}) silenced alone, paired on {EVAL_WINDOWS} "
                    f"validation windows;\nbars: 95% interval over {BLOCKS} blocks of consecutive windows", fontsize=9)
    fig.suptitle(f"What sharing K/V heads costs: character-level LM on pydoc_data.topics, d={D_MODEL}, "
                 f"{N_HEADS} query heads, {N_LAYERS} layers, T={CONTEXT}, batch {BATCH}", fontsize=11)
    fig.tight_layout()
    return fig


def plot_trained_maps(model, data, seed, steps, best):
    """Every head of the trained MHA on a real passage from the validation text, characters as ticks."""
    from matplotlib.figure import Figure
    start = passage_start(data.val_text)
    text = data.val_text[start:start + PASSAGE]
    with torch.no_grad():
        maps = model(data.val[start:start + PASSAGE][None], need_weights=True)[1]   # (1, T) -> each (1, h, T, T)
    cols, rows = 4, N_LAYERS * N_HEADS // 4
    fig = Figure(figsize=(3.2 * cols + 1, 3.2 * rows + 0.8))
    labels = [{" ": "\u2423", "\n": "\u21b5"}.get(c, c) for c in text]   # a space as an open box, a newline as ↵
    for k, ax in enumerate(fig.subplots(rows, cols, squeeze=False).flat):
        layer, head = divmod(k, N_HEADS)
        im = ax.imshow(maps[layer][0, head].numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
        ax.set_title(f"layer {layer} head {head}" + ("  (previous char)" if (layer, head) == best else ""),
                     fontsize=9, fontweight="bold" if (layer, head) == best else "normal")
        ax.set_xticks(range(len(text)), labels, fontsize=5)
        ax.set_yticks(range(len(text)), labels, fontsize=5)
        ax.tick_params(length=0, pad=1)
    fig.subplots_adjust(left=0.03, right=0.92, bottom=0.03, top=1 - 1 / (3.2 * rows + 0.8), wspace=0.15, hspace=0.25)
    fig.colorbar(im, cax=fig.add_axes([0.935, 0.2, 0.012, 0.6]), label="attention probability")
    layer, head = best
    share = torch.diagonal(maps[layer][0, head], -1).mean()
    fig.suptitle(f"Trained MHA (d={D_MODEL}, {N_HEADS} heads, {N_LAYERS} layers, {steps} steps, seed {seed}), every "
                 "head on a validation passage; rows: query character, columns: key character\nlayer "
                 f"{layer} head {head} is the most previous-character-like: {share:.0%} of its attention here on the "
                 "character just before", fontsize=11)
    return fig


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
    """The data, then A and B (and D's evaluations, beside B) on the workers, each table printed when known."""
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
    curves, ablation = run_conversion(scratch, args.steps, run, args.seeds[:GQA_SEEDS])
    print_table_b(curves, scratch, args.steps)
    losses = run_fewer_bits(scratch, run)
    print_table_e(losses)
    ok = check_quantized_cache(scratch["MHA"][args.seeds[0]][0], data, args.seeds[0])
    print_answer(losses)
    return scratch, ablation, data, ok


def main(argv=None):
    args = parse_args(argv)        # a bad flag or --out-dir ends here, in one line (exit code 2)
    torch.set_num_threads(1)                               # tables C and D and the maps, like every model
    if args.quick:
        print(f"--quick: a smoke run for trying an edit ({args.steps} steps, seeds {' '.join(map(str, args.seeds))}); "
              "it resolves nothing")
    further = sum(uptrain_steps(args.steps, pool) for _, pool in targets())        # B's, for each converted seed
    total = sum(len(seeds_of(n, args.seeds)) for n in CONFIGS) * args.steps + len(args.seeds[:GQA_SEEDS]) * further
    estimate = total * STEP_SECONDS / WORKERS + 30        # 30 s to start, evaluate and draw
    print(f"This run: {total:,} training steps on {WORKERS} worker{'s' * (WORKERS > 1)}, about {estimate / 60:.1f} min "
          f"at {STEP_SECONDS * 1e3:.0f} ms a step in each (2 quiet cores have taken 16 to 42); the progress "
          "line on stderr tells how long here", flush=True)
    start = time.perf_counter()
    try:
        with workers(total) as run:
            scratch, ablation, data, ok = train_everything(args, run)
    except concurrent.futures.process.BrokenProcessPool:
        print("quality.py: error: a worker process stopped (killed, or out of memory?) before its models were "
              "trained; nothing was written", file=sys.stderr)
        return 1
    seed, trained = args.seeds[0], scratch["MHA"][args.seeds[0]][0]
    roles, chance = head_roles(trained, data)
    best = print_table_c(roles, chance, seed)
    print_table_d(ablation, roles, chance, seed, best)
    figures = [plot_quality(scratch, args.steps, ablation, roles, chance, seed),
               plot_trained_maps(trained, data, seed, args.steps, best)]
    for name, fig in zip(FIGURES, figures):
        fig.savefig(os.path.join(args.out_dir, name), dpi=100)   # Agg's PNG holds no date: the same bytes each run
    print(f"\nFigures written to {os.path.join(os.path.relpath(args.out_dir), '')}: {', '.join(FIGURES)}")
    wall = time.perf_counter() - start
    print(f"time: {wall / 60:.1f} min (estimated {estimate / 60:.1f}), {WORKERS} worker{'s' * (WORKERS > 1)} of 1 "
          f"thread: {wall * WORKERS / total * 1e3:.0f} ms a training step in each, all else included")
    return 0 if ok else 1


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


def check_bits(bits, d_head):
    """QuantizedKVCache's sizes: 2 to 8 bits; dh a multiple of 8 (pack takes codes 8 at a time)."""
    if bits not in range(2, 9):
        raise ValueError(f"bits={bits!r} must be a whole number from 2 to 8")
    if d_head % 8:
        raise ValueError(f"d_head={d_head} must be a multiple of 8: codes are packed 8 at a time")


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
