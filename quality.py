"""
What a smaller KV cache costs in quality, by fewer K/V heads (GQA, MQA) or fewer bits, on real text.

mha.py measures what sharing K/V heads saves; this file measures what it costs. It trains a tiny
character-level language model built around mha.CausalMHA on Python's own documentation
(pydoc_data.topics, no download) and reports validation bits per character, with a 95 % confidence
interval for every comparison. What the heads of such a model do is heads.py's question.
  A. From scratch: MHA, GQA-4, GQA-2 and MQA, a seed's configurations sharing initialisation and
     batches, matched on width, not parameters (MQA has 12 % fewer). MHA and MQA train on 5 seeds,
     81 % power to resolve MQA's cost if it is 1.7 of its spread (LABNOTES); the others on 3.
  B. Conversion (Ainslie et al. 2023): each trained MHA of those 3 seeds becomes GQA/MQA by pooling
     its K/V heads, and trains on as A would have for 5 % more steps (20 % for mean pooling).
  E. Fewer bits: every model of A, its cached K and V in 8, 4, 3 and 2 bits (a QuantizedKVCache,
     which mha.CausalMHA takes as it is); at 1/2, 1/4, 1/8 of MHA's bytes, heads, bits or both?
Not the cost at scale (d=64, two layers, minutes of training); no dropout, GPU or tokenizer.

Run it:   python quality.py           (6 min on 2 quiet cores, up to 13 when busy; writes figures/)
          python quality.py --quick   (half a minute: a smoke run to try an edit; resolves nothing)

Papers (arXiv): Vaswani et al. 2017, 1706.03762; Shazeer 2019, 1911.02150; Ainslie et al. 2023,
2305.13245; KIVI, Liu et al. 2024, 2402.02750; KVQuant, Hooper et al. 2024, 2401.18079.
Shapes as in mha.py, and T characters in a window, V distinct characters (the vocabulary).
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
LR = 7e-3             # AdamW's peak learning rate; high: a tiny model, a short budget
WARMUP = 0.1          # fraction of the steps over which the learning rate rises from 0 to LR
MIN_LR = 0.1          # the cosine decay ends at MIN_LR * LR
WEIGHT_DECAY = 0.1    # AdamW weight decay, on weight matrices only
CLIP = 1.0            # gradient norm is clipped to this
SEEDS = (0, 1, 2, 3, 4)   # MHA and MQA: a model a seed, its initialisation and data order
GQA_SEEDS = 3         # the others train on the first 3 seeds only; B converts those 3 MHAs
QUICK_STEPS, QUICK_SEEDS = 150, (0, 1)   # --quick: the smoke run
CONFIGS = {"MHA": 8, "GQA-4": 4, "GQA-2": 2, "MQA": 1}   # name: K/V heads of the 8-query-head model
POOLS = ("mean", "first", "random")    # how conversion makes a K/V head from its group (B)
UPTRAIN = 0.05        # further training after conversion, a fraction of A's steps: the paper's 5 %
UPTRAIN_LONG = 0.2    # the control and the mean-pooled conversions train on to this fraction too
VAL_FRACTION = 0.1    # the last tenth of the text is validation
EVAL_WINDOWS = 256    # validation loss: the mean over these windows, evenly spaced (16,384 chars)
WORKERS = 2           # processes training side by side, one thread each ("on both cores")
STEP_SECONDS = 0.02   # the estimate: a step in each of 2 workers (16 to 42 ms on 2 cores)
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "figures")
FIGURE = "quality.png"
BITS = (8, 4, 3, 2)   # E: the cache's numbers in these many bits, every model of A
BUDGETS = (2, 4, 8)   # E's answer: the best option within 1/2, 1/4 and 1/8 of MHA's bf16 bytes
DECODE_TOLERANCE = 1e-4   # E's check: float32 rounding of logits about 10 in size, two layers deep


# ----------------------------------------------------------------------------- the data
def load_text():
    """Python's documentation topics, in sorted order of their names: about 465k characters."""
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
        # Evenly spaced validation windows, the same for every model: inputs x, next characters y.
        self.val_starts = torch.linspace(0, len(self.val) - CONTEXT - 1, EVAL_WINDOWS).long()
        self.val_x, self.val_y = windows(self.val, self.val_starts)   # (EVAL_WINDOWS, T) each

    def batches(self, seed, steps):
        """The training windows of every step, (steps, B) start positions, from the seed alone."""
        g = torch.Generator().manual_seed(seed)
        return torch.randint(len(self.train) - CONTEXT - 1, (steps, BATCH), generator=g)


def windows(ids, starts):
    """Inputs x (B, T), the characters at starts .. starts + T - 1; targets y (B, T), one on."""
    w = ids[starts[:, None] + torch.arange(CONTEXT + 1)]   # (B, T + 1)
    return w[:, :-1], w[:, 1:]


# ----------------------------------------------------------------------------- the model
class Block(nn.Module):
    """x + attention(LayerNorm(x)), then x + MLP(LayerNorm(x)): the pre-LayerNorm block of GPT-2."""

    def __init__(self, n_kv_heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.attn = mha.CausalMHA(D_MODEL, N_HEADS, n_kv_heads)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, MLP_WIDTH), nn.GELU(),
                                 nn.Linear(MLP_WIDTH, D_MODEL))

    def forward(self, x, need_weights=False, cache=None):  # x: (B, T, d); p: (B, h, T, T) or None
        # Training runs the fused call (faster, the same function); the weights need the other.
        out = self.attn(self.ln1(x), need_weights=need_weights, cache=cache, fused=not need_weights)
        a, p = out if need_weights else (out, None)
        x = x + a
        return x + self.mlp(self.ln2(x)), p                # (B, T, d)


class CharLM(nn.Module):
    """Characters in, the next character's logits out: embeddings + positions, blocks, readout."""

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
        (B, h, T, T). With caches (a K/V cache per block, E), x follows the cached characters."""
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
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()) / math.log(2)   # (B*T, V), (B*T,)


def pool_kv_rows(t, attn, n_kv_heads, pool):
    """attn's in_proj rows t, each group of consecutive K/V heads made one, its mean or its first;
    query rows unchanged. 4 K/V heads to 2 by mean:
        [k0, k1 | k2, k3] -> [(k0 + k1) / 2, (k2 + k3) / 2]"""
    h, kv, dh, r = attn.n_heads, attn.n_kv_heads, attn.d_head, attn.n_kv_heads // n_kv_heads
    q, k, v = t.split([h * dh, kv * dh, kv * dh])
    k = k.unflatten(0, (n_kv_heads, r, dh))                # (kv dh, ...) -> (new kv, r, dh, ...)
    v = v.unflatten(0, (n_kv_heads, r, dh))                # (kv dh, ...) -> (new kv, r, dh, ...)
    k, v = (k[:, 0], v[:, 0]) if pool == "first" else (k.mean(1), v.mean(1))   # (new kv, dh, ...)
    return torch.cat([q, k.flatten(0, 1), v.flatten(0, 1)])


def to_gqa(attn, n_kv_heads, pool="mean"):
    """A new mha.CausalMHA with fewer K/V heads, made from attn as Ainslie et al. 2023 (section 2.2)
    do. Equal heads in a group give the same function (within 1e-6), others need training: B."""
    if n_kv_heads < 1 or attn.n_kv_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads={n_kv_heads} must be a positive divisor of the "
                         f"{attn.n_kv_heads} K/V heads")
    if pool not in ("mean", "first"):
        raise ValueError(f"pool={pool!r} must be 'mean' or 'first'")
    out = mha.CausalMHA(attn.d_model, attn.n_heads, n_kv_heads, attn.in_proj.bias is not None)
    pooled = {name: pool_kv_rows(t, attn, n_kv_heads, pool) if name.startswith("in_proj") else t
              for name, t in attn.state_dict().items()}
    out.to(attn.in_proj.weight.dtype).load_state_dict(pooled)
    return out.train(attn.training)


def with_kv_heads(model, n_kv_heads, pool, seed=0):
    """model with n_kv_heads K/V heads in every layer, by to_gqa's pool or "random": new K/V."""
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    for block in new.blocks:
        block.attn = to_gqa(block.attn, n_kv_heads, "first" if pool == "random" else pool)
        if pool == "random":
            # New K and V rows, U(-b, b) as nn.Linear draws them.
            rows, bound = slice(N_HEADS * block.attn.d_head, None), 1 / math.sqrt(D_MODEL)
            with torch.no_grad():
                for t in (block.attn.in_proj.weight, block.attn.in_proj.bias):
                    t[rows] = torch.rand(t[rows].shape, generator=g) * 2 * bound - bound
    return new


def fresh_models(vocab, seed):
    """{config: model} of one seed: its MHA, and that MHA with each group's first K/V head kept."""
    torch.manual_seed(seed)
    base = CharLM(vocab, N_HEADS)
    return {name: base if kv == N_HEADS else with_kv_heads(base, kv, "first")
            for name, kv in CONFIGS.items()}


def cache_bytes_per_token(n_kv_heads, bits=None):
    """KV-cache bytes a token adds: 2 (K and V) x layers x K/V heads x dh x 2 bytes a number (bf16,
    as mha.py counts; this model computes in float32). In n bits (E), n / 8 bytes and a share of the
    group's bf16 scale, 2 / dh: at 4 bits, 0.5 + 0.25 bytes. cache_bytes_per_token(8, 4) == 192"""
    dh = D_MODEL // N_HEADS
    per_number = 2 if bits is None else bits / 8 + 2 / dh   # codes, and a bf16 scale per dh
    return round(mha.kv_cache_bytes(N_LAYERS, n_kv_heads, dh, 1, bytes_per_elem=per_number))


# ----------------------------------------------------------------------------- training
def lr_at(step, steps):
    """Linear warmup over WARMUP * steps, then cosine from LR to MIN_LR * LR at the last step."""
    warm = max(1, round(WARMUP * steps))
    if step < warm:
        return LR * (step + 1) / warm
    done = (step - warm) / max(1, steps - 1 - warm)        # 0 .. 1
    return LR * (MIN_LR + (1 - MIN_LR) * 0.5 * (1 + math.cos(math.pi * done)))


def optimizer(model, state=None):
    """AdamW, weight decay on weight matrices only; resumed from state (its state_dict) if given."""
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and n != "pos"]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and n != "pos")]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95))
    if state is not None:
        opt.load_state_dict(copy.deepcopy(state))         # a copy: state may be shared
    return opt


def train(model, opt, data, starts, schedule, evaluate_at=()):
    """Train model in place with opt on starts (steps, B) at schedule(step, steps); return
    {step: validation bits/char before it} for each step in evaluate_at (len(starts): the end)."""
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
def window_losses(model, x, y, bits=None):
    """Bits/char of each window, (N,): inputs x (N, T) against next characters y (N, T), 64 windows
    at a time; with bits, every attention's K and V kept in a QuantizedKVCache of n bits (E)."""
    model.eval()
    logits = torch.cat([model(chunk, caches=quantized_caches(model, len(chunk), bits))
                        for chunk in x.split(64)])         # (N, T, V)
    model.train()
    nats = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")     # (N, V, T) -> (N, T)
    return nats.mean(1) / math.log(2)


# ----------------------------------------------------------------------------- 95 % intervals
# Two models of one seed share their initialisation and every batch, and are measured on the same
# windows, so a comparison is paired: one difference per seed. Over n seeds the differences have a
# mean and a standard deviation sd, and the mean's 95 % confidence interval is
#     mean +/- t(0.975, n - 1) * sd / sqrt(n)     (Student's t: with few seeds, sd is uncertain)
# With 5 seeds t is 2.776, so the mean must stand 1.24 sd clear of zero; with 3 seeds, 2.48 sd.
# T_975[df] = t(0.975, df):
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 120: 1.980}


def interval(values):
    """The 95 % confidence interval of the mean, (low, high), or None for a single value.
    interval([0.1, 0.2, 0.3]) == (0.2 - 4.303 * 0.1 / sqrt(3), 0.2 + ...) == (-0.048, 0.448)."""
    if len(values) < 2:
        return None
    # Between two rows of the table, the smaller df's t, which is larger: never too narrow.
    t = T_975[max(df for df in T_975 if df <= len(values) - 1)]
    half = t * statistics.stdev(values) / math.sqrt(len(values))
    return statistics.mean(values) - half, statistics.mean(values) + half


def paired(values, digits=3):
    """'+0.031 [-0.029, +0.091]': the mean paired difference, its 95 % interval (none for one)."""
    ci, f = interval(values), f"{{:+.{digits}f}}".format
    return f(statistics.mean(values)) + ("" if ci is None else f" [{f(ci[0])}, {f(ci[1])}]")


def verdict(diffs):
    """What the 95 % interval of the paired differences allows one to say, in words."""
    ci = interval(diffs)
    if ci is None:
        return "one seed: cannot judge"
    return "worse than MHA" if ci[0] > 0 else "better than MHA" if ci[1] < 0 else "not resolved"


def tested_in_order():
    """A's comparisons, fewest K/V heads first, each tested only if the one before was resolved."""
    return sorted((name for name, kv in CONFIGS.items() if kv != N_HEADS), key=CONFIGS.get)


def seeds_of(name, seeds):
    """MHA and the first configuration tested (MQA) train on every seed, the others on GQA_SEEDS."""
    return seeds if name == "MHA" or name == tested_in_order()[0] else seeds[:GQA_SEEDS]


# ----------------------------------------------------------------------------- A. from scratch
Trained = collections.namedtuple("Trained", "model loss opt_state")   # as a worker returns it


def run_from_scratch(seeds, steps, run):
    """Every configuration on its seeds, MHA (the longest) first: {config: {seed: Trained}}."""
    tasks = [(name, seed, steps) for name in CONFIGS for seed in seeds_of(name, seeds)]
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


def print_table_a(scratch, steps):
    ran = ", ".join(f"{name} {','.join(map(str, scratch[name]))}" for name in CONFIGS)
    print(f"\nA. From scratch, {steps} steps; validation bits/char, mean and standard deviation "
          f"over seeds ({ran})")
    print("   paired: a seed's configurations share their initialisation and every batch; the "
          "difference to MHA is its mean\n   over the seeds both ran and, in brackets, its 95% "
          "confidence interval. Tested in the order fixed\n   in advance, "
          f"{', '.join(tested_in_order())}, each only if the one before was resolved: the chance "
          "of any false verdict\n   among them is at most 5%. Matched on width: fewer K/V heads, "
          "fewer parameters")
    print(f"   {'config':<7}{'K/V heads':>10}{'params':>9}{'KV bytes/token':>16}{'seeds':>7}"
          f"{'mean':>8}{'sd':>7}   {'minus MHA [95% interval]':<25} verdict")
    # Each configuration minus the MHA of the same seed, for each seed of the configuration.
    gaps = {name: [run.loss - scratch["MHA"][s].loss for s, run in scratch[name].items()]
            for name in CONFIGS}
    said, previous = {}, None
    for name in tested_in_order():
        tested = previous is None or said[previous].endswith("than MHA")
        said[name] = verdict(gaps[name]) if tested else f"not tested ({previous} not resolved)"
        previous = name
    for name, kv in CONFIGS.items():
        losses = [run.loss for run in scratch[name].values()]
        params = sum(p.numel() for p in next(iter(scratch[name].values())).model.parameters())
        sd = f"{statistics.stdev(losses):.3f}" if len(losses) > 1 else ""
        compared = "" if name == "MHA" else f"{paired(gaps[name]):<25} {said[name]}"
        print(f"   {name:<7}{kv:>10}{params:>9,}{cache_bytes_per_token(kv):>16,}{len(losses):>7}"
              f"{statistics.mean(losses):>8.3f}{sd:>7}   {compared}".rstrip(), flush=True)


# ----------------------------------------------------------------------------- B. conversion
# Ainslie et al. continue pre-training a converted checkpoint on its recipe for 5 % of its steps.
# Here A goes on: AdamW resumed (K/V rows' moments pooled like their weights), its last lr, its
# next batches; the control likewise.
def run_conversion(scratch, steps, run, seeds):
    """Every conversion of seeds' MHAs, trained on: {seed: {(config, pool): {step: bits/char}}}.
    ("MHA", "none") is the control, the MHA resumed unchanged."""
    tasks = [(name, pool, seed, steps, scratch["MHA"][seed].model, scratch["MHA"][seed].opt_state)
             for seed in seeds for name, pool in targets()]
    done = run("B. conversion", [(convert_and_train, t, uptrain_steps(steps, t[1])) for t in tasks])
    curves = {seed: {} for seed in seeds}
    for (name, pool, seed, *_), curve in zip(tasks, done):
        curves[seed][name, pool] = curve
    return curves


def targets():
    """B's rows: the control, then each configuration of fewer K/V heads by each pool."""
    return [("MHA", "none")] + [(name, pool) for name in CONFIGS if name != "MHA" for pool in POOLS]


def uptrain_steps(steps, pool="first"):
    """How far a row of B trains on: UPTRAIN of A's steps, UPTRAIN_LONG for the control and mean."""
    return max(1, round((UPTRAIN_LONG if pool in ("none", "mean") else UPTRAIN) * steps))


def resumed_optimizer(new, model, state, pool):
    """AdamW for new, made from model by with_kv_heads(..., pool) or a copy (pool "none"), resumed
    from model's state: the K/V rows' moments pooled as their weights are (zero for random K/V)."""
    old, opt = optimizer(model, state), optimizer(new)
    for (name, p), (_, q) in zip(model.named_parameters(), new.named_parameters()):
        moments = dict(old.state[p])                       # step, exp_avg, exp_avg_sq
        if pool != "none" and ".attn.in_proj." in name:
            attn = model.get_submodule(name.rsplit(".", 2)[0])   # blocks.0.attn
            for key in ("exp_avg", "exp_avg_sq"):
                moments[key] = pool_kv_rows(moments[key], attn, new.blocks[0].attn.n_kv_heads,
                                            "first" if pool == "random" else pool)
                if pool == "random":
                    moments[key][N_HEADS * attn.d_head:] = 0.0   # new K/V rows: no history
        opt.state[q] = moments
    return opt


def convert_and_train(name, pool, seed, steps, model, state):
    """One conversion in a worker (pool "none": the control), trained on as A would have:
    {step: bits/char}. model's tensors are shared with every process, so it is copied."""
    data = WORKER["data"]
    kv = CONFIGS[name]
    new = copy.deepcopy(model) if pool == "none" else with_kv_heads(model, kv, pool, seed)
    up, last_lr = uptrain_steps(steps, pool), lr_at(steps - 1, steps)   # A's last: MIN_LR * LR
    opt = resumed_optimizer(new, model, state, pool)
    return train(new, opt, data, data.batches(seed, steps + up)[steps:], lambda step, _: last_lr,
                 {0, uptrain_steps(steps), up})


def print_table_b(curves, scratch, steps):
    seeds, up, long = list(curves), uptrain_steps(steps), uptrain_steps(steps, "mean")
    more = [(up, f"+{UPTRAIN:.0%}"), (long, f"+{UPTRAIN_LONG:.0%}")]
    print(f"\nB. Conversion of the trained MHA of seeds {', '.join(map(str, seeds))} (Ainslie et "
          "al. 2023, sections 2.1-2.2), then training on as A would\n   have gone on: A's AdamW "
          "state (the K/V rows' moments pooled as their weights are, zero for random K/V), A's "
          f"last lr\n   {lr_at(steps - 1, steps):g} held, the batches after A's; {up} steps "
          f"({UPTRAIN:.0%} of A's), {long} ({UPTRAIN_LONG:.0%}) for the control and mean pooling. "
          "The control\n   is the same MHA resumed in the same way. Validation bits/char, mean "
          "over seeds; each minus the control at the\n   same step, paired by seed [95% interval]")
    after = "".join(f"{c:>7}" for _, c in more)
    minus = "".join(f"{c + ' minus the control':<26}" for _, c in more)
    print(f"   {'config':<7}{'K/V from':<11}{'right after':>12}{after}   {minus}"
          f"{'scratch (A)':>11}")
    loss = {target: {k: [curves[s][target].get(k) for s in seeds] for k in (0, up, long)}
            for target in targets()}
    control = loss["MHA", "none"]
    for (name, pool), at in loss.items():
        done = [k for k, _ in more if None not in at[k]]   # the steps this row was trained to
        after = "".join(f"{statistics.mean(at[k]):>7.3f}" if k in done else f"{'-':>7}"
                        for k, _ in more)
        said = [paired([a - c for a, c in zip(at[k], control[k])]) for k in done]
        gap = "".join(f"{g:<26}" for g in said) if pool != "none" else ""
        label = "(control)" if pool == "none" else pool + " pool" * (pool == "mean")
        print(f"   {name:<7}{label:<11}{statistics.mean(at[0]):>12.3f}{after}   {gap:<52}"
              f"{statistics.mean([scratch[name][s].loss for s in seeds]):>11.3f}")
    print("   the control resumed, minus untouched (A's MHA), paired by seed: " + ", ".join(
        f"{label} {paired([c - u for c, u in zip(control[k], control[0])])}" for k, label in more))
    print(f"   {up} steps are {UPTRAIN:.0%} of A's, as in the paper, where 5 % of T5's training is "
          f"tens of thousands of steps on\n   far larger batches: {up} small updates at A's last "
          "lr show recovery starting, not where it ends.\n   B's intervals are each at 95%, not "
          "corrected for their number: read them as a description")


# ----------------------------------------------------------------------------- E. fewer bits
# The other way to a smaller cache: keep every K/V head, store each cached number in fewer bits.
# A group of numbers shares one scale s = max|x| / qmax, qmax = 2^(bits - 1) - 1; a number x is kept
# as code = round(x / s), from -qmax to qmax, and comes back as code * s (symmetric, round to
# nearest). A group here: one head's dh = 8 keys (or values) of one token, s in bf16. At 4 bits:
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


# Codes are packed: shifted up by qmax to 0 .. 2 qmax, each takes `bits` bits of a stream, lowest
# first, cut into bytes. At 4 bits, two codes a byte: the codes above + 7 are [9, 0, 7, 8, 11, 5,
# 7, 11], so the bytes are [9 + 16 * 0, 7 + 16 * 8, 11 + 16 * 5, 7 + 16 * 11] = [9, 135, 91, 183].
def pack(codes, bits):
    """int8 codes (..., G), G * bits a multiple of 8 -> uint8 (..., G * bits / 8)."""
    u = codes.long() + 2 ** (bits - 1) - 1                 # (..., G): 0 .. 2 qmax, within bits
    stream = (u[..., None] >> torch.arange(bits)) & 1      # (..., G, bits): each code's bits
    stream = stream.flatten(-2).unflatten(-1, (-1, 8))     # -> (..., G * bits / 8, 8): bytes
    return (stream << torch.arange(8)).sum(-1).to(torch.uint8)   # (..., G * bits / 8)


def unpack(packed, bits):
    """pack's inverse: uint8 (..., G * bits / 8) -> int8 codes (..., G)."""
    stream = (packed.long()[..., None] >> torch.arange(8)) & 1   # (..., G * bits / 8, 8): bits
    stream = stream.flatten(-2).unflatten(-1, (-1, bits))  # -> (..., G, bits): a code's bits
    u = (stream << torch.arange(bits)).sum(-1)             # (..., G): 0 .. 2 qmax
    return (u - (2 ** (bits - 1) - 1)).to(torch.int8)      # shifted back down by qmax


class QuantizedKVCache:
    """K and V in `bits` bits as tokens arrive: packed codes, a bf16 scale per head and token.
    CausalMHA takes it as its cache: forward asks shape, dtype, device, length and append."""

    def __init__(self, batch, n_kv_heads, max_len, d_head, bits, dtype=torch.float32, device="cpu"):
        check_bits(bits, d_head)                           # one sentence if they cannot work
        self.shape = (batch, n_kv_heads, max_len, d_head)  # (B, kv, max_len, dh): what it can hold
        self.bits, self.dtype, self.device, self.length = bits, dtype, torch.device(device), 0
        size = (2, batch, n_kv_heads, max_len)            # K and V side by side
        self.codes = torch.zeros((*size, d_head * bits // 8), dtype=torch.uint8, device=device)
        self.scales = torch.zeros((*size, 1), dtype=torch.bfloat16, device=device)   # bf16 s

    def append(self, k, v):
        """Round k, v: (B, kv, T, dh) into the next T places; return all S held, (B, kv, S, dh)."""
        S = self.length + k.shape[2]                       # tokens held after this call
        codes, scales = quantize(torch.stack([k, v]), self.bits)   # (2, B, kv, T, dh), (.., 1)
        self.codes[:, :, :, self.length:S] = pack(codes, self.bits)   # (2, B, kv, T, dh bits / 8)
        self.scales[:, :, :, self.length:S] = scales
        self.length = S
        codes = unpack(self.codes[:, :, :, :S], self.bits)          # (2, B, kv, S, dh)
        k, v = codes.to(self.dtype) * self.scales[:, :, :, :S].to(self.dtype)   # code * s
        return k, v

    def nbytes(self):
        """Bytes of what it stores, read from its own tensors: codes and scales."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales))


def quantized_caches(model, batch, bits):
    """An empty QuantizedKVCache for each block of model, room for a window; None for bits None."""
    if bits is None:
        return None
    like = {"dtype": model.readout.weight.dtype, "device": model.readout.weight.device}
    return [QuantizedKVCache(batch, b.attn.n_kv_heads, CONTEXT, b.attn.d_head, bits, **like)
            for b in model.blocks]


def run_fewer_bits(scratch, data, run):
    """{(config, bits): {seed: validation bits/char}}, bits None: as trained (A's own loss)."""
    losses = {(name, bits): {s: a.loss for s, a in scratch[name].items()} if bits is None else {}
              for name in CONFIGS for bits in (None, *BITS)}
    tasks = [(name, seed, bits) for name in CONFIGS for seed in scratch[name] for bits in BITS]
    calls = [(window_losses, (scratch[name][seed].model, data.val_x, data.val_y, bits), 0)
             for name, seed, bits in tasks]
    for (name, seed, bits), each in zip(tasks, run("E. fewer bits", calls)):
        losses[name, bits][seed] = each.mean().item()
    return losses


def kind(name, bits):
    """How an option shrinks MHA's cache: fewer K/V heads, fewer bits than bf16's 16, or both."""
    fewer_heads = CONFIGS[name] < N_HEADS
    if bits is None:
        return "fewer heads" if fewer_heads else "neither"
    return "both" if fewer_heads else "fewer bits"


def print_table_e(losses):
    mean = {option: statistics.mean(by_seed.values()) for option, by_seed in losses.items()}
    print("\nE. Fewer bits: every model of A, its cached K and V rounded to n bits (a bf16 scale "
          "per head and token),\n   minus the same model as trained, paired by seed [95% interval "
          "over seeds]. Bytes a token: 2 (K and V)\n   x layers x K/V heads x dh x (n / 8 + 2 / "
          "dh), codes and scales; as trained ('full'), 2 bytes a number")
    print(f"   {'config':<7}{'K/V heads':>10}{'bits':>6}{'KV bytes/token':>16}{'seeds':>7}"
          f"{'mean':>8}   minus full [95% interval]")
    for (name, bits), by_seed in losses.items():
        full, kv = losses[name, None], CONFIGS[name]
        gap = "" if bits is None else paired([by_seed[s] - full[s] for s in by_seed], digits=4)
        print(f"   {name:<7}{kv:>10}{bits or 'full':>6}{cache_bytes_per_token(kv, bits):>16,}"
              f"{len(by_seed):>7}{mean[name, bits]:>8.3f}   {gap}".rstrip())


def print_answer(losses):
    """Within each fraction of MHA's bytes in BUDGETS, each kind's best against the best of all."""
    full = cache_bytes_per_token(N_HEADS)
    mean = {option: statistics.mean(by_seed.values()) for option, by_seed in losses.items()}
    said = {(name, bits): f"{name} {'as trained' if bits is None else f'in {bits} bits'} "
            f"({cache_bytes_per_token(CONFIGS[name], bits)} bytes), {mean[name, bits]:.3f}"
            for name, bits in losses}
    print("\n   The answer at equal bytes: each kind's lowest mean loss that fits, minus the best, "
          "paired over the\n   seeds both ran [95% interval]; the answer: the best and each kind "
          "not resolved from it")
    for fraction in BUDGETS:
        budget, best = full // fraction, {}
        for name, bits in sorted(losses, key=mean.get):
            if cache_bytes_per_token(CONFIGS[name], bits) <= budget:
                best.setdefault(kind(name, bits), (name, bits))   # the first of each kind: its best
        top, *others = sorted(best.values(), key=mean.get)
        answer = [kind(*top)]
        print(f"   1/{fraction} of MHA's {full} bytes a token, {budget}: the best is {kind(*top)}, "
              f"{said[top]}")
        for option in others:
            diffs = [losses[option][s] - losses[top][s] for s in losses[option] if s in losses[top]]
            ci = interval(diffs)
            if ci is None or ci[0] <= 0:
                answer.append(kind(*option))
            print(f"      {kind(*option) + ':':<13}{said[option]}; minus the best "
                  f"{paired(diffs, digits=4)}")
        for missing in sorted({"fewer heads", "fewer bits", "both"} - set(best)):
            print(f"      {missing + ':':<13}none fits")
        tie = " (not resolved between them)" if len(answer) > 1 else ""
        print(f"      answer: {' or '.join(answer)}{tie}")
    print("   At scale, KIVI (2 bits) and KVQuant (3 bits) report near full-precision quality on\n"
          "   models of dh = 64 to 128 (a scale per group costs little), GQA models too: both")


def check_quantized_cache(model, data, seed, bits=4):
    """A window a character at a time through QuantizedKVCaches, against all at once; bytes."""
    x, caches = data.val_x[:1], quantized_caches(model, 1, bits)   # x: (1, T)
    with torch.no_grad():
        whole = model(x, caches=quantized_caches(model, 1, bits))   # (1, T, V)
        steps = torch.cat([model(x[:, t:t + 1], caches=caches) for t in range(CONTEXT)], dim=1)
    diff, held = (steps - whole).abs().max().item(), sum(c.nbytes() for c in caches)
    per_token = cache_bytes_per_token(N_HEADS, bits)       # the formula
    ok = diff <= DECODE_TOLERANCE and held == CONTEXT * per_token
    print(f"   The cache itself, {bits} bits, MHA seed {seed}, a character at a time against the "
          f"whole window:\n   max |logits difference| = {diff:.2e} (tolerance "
          f"{DECODE_TOLERANCE:.0e}); tensors {held:,} bytes, formula {CONTEXT} x {per_token}  "
          f"{'OK' if ok else 'FAIL'}")
    return ok


# ----------------------------------------------------------------------------- figures
# The colours of mha.py's figures.
COLORS = {"MHA": "tab:blue", "GQA-4": "tab:green", "GQA-2": "tab:purple", "MQA": "tab:red"}


def plot_quality(scratch, steps, losses):
    """Loss against the KV-cache bytes one token adds: A's configurations as trained (seeds, mean,
    interval) and E's, each in every number of bits (mean over seeds), on one axis."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(8, 5.5))
    ax = fig.subplots()
    mean = {option: statistics.mean(by_seed.values()) for option, by_seed in losses.items()}
    top = max(mean[option] for option in mean if (option[1] or 16) >= 4) + 0.04   # 3, 2 bits: off
    for name, kv in CONFIGS.items():
        # As trained: the seeds, their mean and its 95 % interval.
        x, trained = cache_bytes_per_token(kv), [run.loss for run in scratch[name].values()]
        y = statistics.mean(trained)
        low, high = interval(trained) or (y, y)
        ax.errorbar([x], [y], [[y - low], [high - y]], marker="o", capsize=4, color=COLORS[name])
        ax.scatter([x] * len(trained), trained, s=8, color=COLORS[name], alpha=0.4)
        ax.annotate(f"{name} ({len(trained)})", (x, y), xytext=(8, 4), textcoords="offset points",
                    size=9)
        xs = [cache_bytes_per_token(kv, bits) for bits in (None, *BITS)]
        ax.plot(xs, [min(mean[name, b], top) for b in (None, *BITS)], color=COLORS[name], lw=0.8)
        for bits, x in zip(BITS, xs[1:]):
            y, off = mean[name, bits], mean[name, bits] > top   # off the scale: a triangle on top
            ax.plot([x], [min(y, top)], "^" if off else "s", color=COLORS[name], ms=6)
            ax.annotate(f"{bits}", (x, min(y, top)), size=8, xytext=(-3, -12 if off else 5),
                        textcoords="offset points")
    for fraction in BUDGETS:                               # dotted: 1/2, 1/4, 1/8 of MHA's bytes
        ax.axvline(cache_bytes_per_token(N_HEADS) / fraction, color="gray", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ticks = [2 ** i for i in range(4, 10)]                 # 16 .. 512 bytes
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_ylim(top=top + 0.01)
    ax.set(xlabel="KV cache per token (bytes; n bits: codes and scales)", ylabel="loss (bits/char)")
    ax.set_title(f"What a smaller KV cache costs: char-level LM, pydoc_data.topics, d={D_MODEL}, "
                 f"{N_HEADS} query heads, {N_LAYERS} layers,\nT={CONTEXT}, {steps} steps. Circles: "
                 "as trained (bars: the mean's 95% interval; dots: seeds, counted in brackets);\n"
                 "squares: K and V in n bits (the number), mean over seeds, triangles above the "
                 "top; dotted: 1/2, 1/4, 1/8 of MHA", fontsize=9)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- on both cores
# A model this small splits badly over threads. On a 2-core AMD EPYC, two one-thread processes side
# by side trained the MHA at 48 steps a second, against 39 for one process on two threads and 27 on
# one. So models train in WORKERS one-thread processes (plumbing below); a model's numbers depend
# only on its task, never on which worker ran it or how many there are.
WORKER = {}   # in a worker process: the data


def start_worker():
    """Each worker, once, before its first task: one thread, and the data."""
    torch.set_num_threads(1)
    WORKER["data"] = Data(load_text())


# ----------------------------------------------------------------------------- main
def train_everything(args, run):
    """The data, then A, B and E on the workers, each table printed when known."""
    text = load_text()
    data = Data(text)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]   # another Python, another text
    print(f"What GQA and MQA cost in quality: a character-level LM, d={D_MODEL}, {N_HEADS} query "
          f"heads of width {D_MODEL // N_HEADS}, {N_LAYERS} layers, T={CONTEXT}, batch {BATCH}")
    print(f"data: pydoc_data.topics of Python {sys.version.split()[0]}: {len(text):,} characters, "
          f"{len(data.chars)} distinct, sha256 {digest}")
    print(f"      train {len(data.train):,} characters, validation {len(data.val):,} (the last "
          f"{VAL_FRACTION:.0%}); the loss is measured on {EVAL_WINDOWS} windows = "
          f"{EVAL_WINDOWS * CONTEXT:,} characters")
    print(f"torch {torch.__version__}, {WORKERS} worker process{'es' * (WORKERS > 1)} of 1 thread "
          "each: the same seeds give the same numbers to the bit, whatever the number of workers",
          flush=True)
    scratch = run_from_scratch(args.seeds, args.steps, run)
    print_table_a(scratch, args.steps)
    curves = run_conversion(scratch, args.steps, run, args.seeds[:GQA_SEEDS])
    print_table_b(curves, scratch, args.steps)
    losses = run_fewer_bits(scratch, data, run)
    print_table_e(losses)
    ok = check_quantized_cache(scratch["MHA"][args.seeds[0]].model, data, args.seeds[0])
    print_answer(losses)
    return scratch, losses, ok


def main(argv=None):
    args = parse_args(argv)        # a bad flag or --out-dir ends here, in one line (exit code 2)
    if args.quick:
        print(f"--quick: a smoke run ({args.steps} steps, seeds {args.seeds}): it resolves nothing")
    further = sum(uptrain_steps(args.steps, pool) for _, pool in targets())   # B's, a seed
    total = sum(len(seeds_of(name, args.seeds)) for name in CONFIGS) * args.steps
    total += len(args.seeds[:GQA_SEEDS]) * further
    estimate = total * STEP_SECONDS / WORKERS + 30        # 30 s to start, evaluate and draw
    worker_count = f"{WORKERS} worker{'s' * (WORKERS > 1)}"
    print(f"This run: {total:,} training steps on {worker_count}, about {estimate / 60:.1f} min at "
          f"{STEP_SECONDS * 1e3:.0f} ms a step in each (2 quiet cores have taken 16 to 42); the "
          "progress line on stderr tells how long here", flush=True)
    start = time.perf_counter()
    with workers(total) as run:
        scratch, losses, ok = train_everything(args, run)
    fig = plot_quality(scratch, args.steps, losses)
    fig.savefig(os.path.join(args.out_dir, FIGURE), dpi=100)   # Agg's PNG holds no date
    print(f"\nFigure written to {os.path.join(os.path.relpath(args.out_dir), FIGURE)}")
    wall = time.perf_counter() - start
    print(f"time: {wall / 60:.1f} min (estimated {estimate / 60:.1f}), {worker_count} of 1 thread: "
          f"{wall * WORKERS / total * 1e3:.0f} ms a training step in each, all else included")
    return 0 if ok else 1


# ----------------------------------------------------------------------------- plumbing
@contextlib.contextmanager
def workers(total):
    """run(part, calls): fn(*args) of each (fn, args, steps) on WORKERS processes, results in
    order, progress on stderr. A failing task or Ctrl-C stops every worker at once."""
    context = multiprocessing.get_context("spawn")        # a fresh interpreter: nothing inherited
    pool = concurrent.futures.ProcessPoolExecutor(WORKERS, context, initializer=start_worker)
    start, done, shown = time.perf_counter(), 0, (0.0, 0)

    def run(part, calls):
        nonlocal done, shown
        # Workers start during submit: born deaf to Ctrl-C, which the parent takes for them.
        ctrl_c = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            futures = {pool.submit(fn, *args): steps for fn, args, steps in calls}
        finally:
            signal.signal(signal.SIGINT, ctrl_c)
        for future in concurrent.futures.as_completed(futures):
            future.result()                              # a task's exception, raised here at once
            done, seconds = done + futures[future], time.perf_counter() - start
            if seconds - shown[0] > 10 or shown[1] < done == total:   # every 10 s, and the last
                shown = seconds, done
                left = seconds / max(done, 1) * (total - done)
                print(f"{part}: {done:,} of {total:,} training steps, "
                      f"{timedelta(seconds=round(seconds))} so far, "
                      f"~{timedelta(seconds=round(left))} left", file=sys.stderr, flush=True)
        return [future.result() for future in futures]

    try:
        yield run
    except BaseException:
        for p in multiprocessing.active_children():       # the pool would wait for busy ones
            p.terminate()
        raise
    finally:
        pool.shutdown(cancel_futures=True)


def check_bits(bits, d_head):
    """QuantizedKVCache's sizes: 2 to 8 bits, and a head's codes in whole bytes."""
    if bits not in range(2, 9) or d_head * bits % 8:
        raise ValueError(f"bits={bits!r} must be 2 to 8, and d_head={d_head} x bits a multiple of "
                         "8 (a head's codes fill whole bytes)")


def parse_args(argv=None):
    """The flags, defaulting to the knobs; a bad one, or a folder that cannot be made: one line."""
    parser = argparse.ArgumentParser(prog="quality.py", description="What GQA costs in quality.")
    parser.add_argument("--steps", type=int, help=f"steps of each model of A (default {STEPS})")
    parser.add_argument("--seeds", type=int, nargs="+", help="seeds of MHA and MQA (default SEEDS)")
    parser.add_argument("--quick", action="store_true", help="a smoke run to try an edit")
    parser.add_argument("--out-dir", default=OUT_DIR, help="where the figure goes (figures/)")
    args = parser.parse_args(argv)
    args.steps = (QUICK_STEPS if args.quick else STEPS) if args.steps is None else args.steps
    args.seeds = args.seeds or list(QUICK_SEEDS if args.quick else SEEDS)
    if args.steps < 1:
        parser.exit(2, f"quality.py: error: --steps {args.steps} must be at least 1\n")
    if CONFIGS.get("MHA") != N_HEADS or any(kv < 1 or N_HEADS % kv for kv in CONFIGS.values()):
        parser.exit(2, f"quality.py: error: CONFIGS={CONFIGS} (at the top of quality.py) must map "
                       f"'MHA' to N_HEADS={N_HEADS} and every name to a divisor of it\n")
    try:
        os.makedirs(args.out_dir, exist_ok=True)
    except OSError as e:
        parser.exit(2, f"quality.py: error: --out-dir {args.out_dir!r} cannot be made: "
                       f"{e.strerror}\n")
    return args


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:                              # the workers are stopped already
        print("\nquality.py: interrupted", file=sys.stderr)
        sys.exit(130)
