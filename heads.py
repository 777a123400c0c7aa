"""
What the heads of one trained multi-head attention model look at, and how many of them it needs.

quality.py asks what sharing K/V heads costs; this chapter opens one of its models instead. It
trains the MHA of quality.py's table A, seed 0 (its model, data and recipe, imported: on one thread,
the same model to the bit) and tests three things said of trained heads:
  C. "Most heads are hard to interpret": each head's mean attention on four kinds of key (the
     previous character, itself, whitespace, the start of its word) against what uniform causal
     attention puts there, and how many heads give at least half of it to one kind: a story.
  D. "Not every head matters" (Michel, Levy and Neubig 2019): the validation loss with one head
     silenced, with intervals over blocks of consecutive windows, whose coverage the run measures.
  The pruning curve: heads silenced one after another, least needed first, the loss against the
     heads left, and how many of the 16 can go before the loss rises by more than ALLOWED_RISE.
     The order is chosen on windows of the training text, never on the windows that score it.
It does not claim what heads do at scale (d=64, two layers, minutes of training), nor that four
kinds of key exhaust what a head does; pruned models are not trained again.

Run it:   python heads.py            (about a minute on 2 cores; writes figures/)
          python heads.py --quick    (half a minute: a smoke run for trying an edit)

Paper: Michel, Levy and Neubig 2019, "Are Sixteen Heads Really Better than One?", arXiv:1905.10650.
Shapes, the alphabet of mha.py: N windows, T characters in a window, d model width, h heads,
dh head width.
"""

import argparse
import copy
import math
import os
import statistics
import sys
import time

import torch

import quality

# ------------------------------------------------------------ knobs
SEED = 0              # the MHA of quality.py's table A trained on this seed
STEPS = quality.STEPS                 # its training steps (--steps): quality.py's recipe
QUICK_STEPS = quality.QUICK_STEPS     # --quick
STORY = 0.5           # a head "has a story" if this share of its attention goes to one kind of key
BLOCKS = 8            # intervals over 8 blocks of 32 consecutive windows (batch means)
STRETCHES = 8         # stretches of the training text on which the intervals' coverage is measured
QUICK_STRETCHES = 2   # --quick: too few to measure anything
RANK_WINDOWS = 256    # windows of the training text, evenly spaced, that order the heads (curve)
ALLOWED_RISE = 0.02   # bits/char: the pruning curve's question, about 1 % of the model's loss
PASSAGE = 36          # characters of the validation passage whose attention maps are drawn
STEP_SECONDS = 0.02   # a training step on one thread: the estimate
EVAL_SECONDS = 0.1    # the loss on 256 windows on one thread: the estimate
OUT_DIR = quality.OUT_DIR
FIGURES = ("trained_attention_maps.png", "pruning_curve.png")
KINDS = ("previous", "itself", "whitespace", "word start")
HEADS = [(layer, head) for layer in range(quality.N_LAYERS) for head in range(quality.N_HEADS)]


# ------------------------------------------------------------ the model
def train_mha(data, steps):
    """quality.py's MHA of seed SEED, trained by its recipe; progress on stderr every 10 s."""
    model = quality.fresh_models(len(data.chars), SEED)["MHA"]
    start, shown = time.perf_counter(), 0.0

    def lr(step, steps):                                   # quality's schedule, reporting
        nonlocal shown
        if time.perf_counter() - start - shown > 10:
            shown = time.perf_counter() - start
            print(f"training: step {step:,} of {steps:,}, {shown:.0f} s", file=sys.stderr)
        return quality.lr_at(step, steps)

    opt = quality.optimizer(model)
    loss = quality.train(model, opt, data, data.batches(SEED, steps), lr, {steps})[steps]
    return model, loss


# ------------------------------------------------------------ C. what each head favours
@torch.no_grad()
def head_shares(model, data):
    """({kind: (layers, h)}, {kind: level}): each head's mean attention on each kind of key over
    the validation windows, and the level of uniform causal attention, which favours no key."""
    x, (N, T) = data.val_x, data.val_x.shape               # (N, T)
    maps = model(x, need_weights=True)[1]                   # each (N, h, T, T)
    space = torch.tensor([c.isspace() for c in data.chars])[x]              # (N, T)
    pos = torch.arange(T).expand_as(x)                                       # (N, T)
    # The start of the word holding position i: the latest j <= i with j == 0 or a space at j - 1.
    after_space = torch.cat([torch.ones_like(space[:, :1]), space[:, :-1]], dim=1)   # (N, T)
    word_start = torch.where(after_space, pos, 0).cummax(dim=1).values               # (N, T)
    keys = torch.arange(T)
    masks = {"previous": (keys[None, :] == keys[:, None] - 1).expand(N, T, T),   # (N, T, T) each
             "itself": (keys[None, :] == keys[:, None]).expand(N, T, T),
             "whitespace": space[:, None, :].expand(N, T, T),
             "word start": keys == word_start[:, :, None]}

    def on(p, m):                                           # p (N, h, T, T), m (N, T, T) -> (h,)
        return (p * m[:, None].float())[:, :, 1:].sum(-1).mean((0, 2))   # row 0 sees only itself

    uniform = torch.tril(torch.ones(T, T)) / (keys[:, None] + 1)   # (T, T): 1/(i+1) on keys 0..i
    shares = {kind: torch.stack([on(p, m) for p in maps]) for kind, m in masks.items()}
    return shares, {kind: on(uniform.expand(N, 1, T, T), m).item() for kind, m in masks.items()}


def favourite(shares, chance, head):
    """('itself', 7.7): the kind of key a head favours most, in multiples of uniform's level."""
    ratios = {kind: shares[kind][head].item() / chance[kind] for kind in shares}
    top = max(ratios, key=ratios.get)
    return top, ratios[top]


def story(shares, head):
    """The kind of key holding at least STORY of a head's attention (the larger if two), or None."""
    held = {kind: shares[kind][head].item() for kind in shares}
    top = max(held, key=held.get)
    return top if held[top] >= STORY else None


def print_table_c(shares, chance):
    told = [hd for hd in HEADS if story(shares, hd)]
    print(f"\nC. What each head favours: its mean attention on each kind of key, over "
          f"{quality.EVAL_WINDOWS} validation windows.\n   'uniform' attends to every key so far "
          "alike; 'favours': the kind with the largest multiple of uniform;\n   'story': the kind "
          f"holding at least {STORY:.0%} of the head's attention (uniform puts at most "
          f"{max(chance.values()):.0%} on any)")
    print(f"   {'layer':>5}{'head':>5}" + "".join(f"{kind:>11}" for kind in KINDS)
          + f"   {'favours':<24}story")
    print(f"   {'uniform':>10}" + "".join(f"{chance[kind]:>11.0%}" for kind in KINDS))
    for hd in HEADS:
        top = "{}, {:.1f}x".format(*favourite(shares, chance, hd))
        print(f"   {hd[0]:>5}{hd[1]:>5}" + "".join(f"{shares[k][hd].item():>11.0%}" for k in KINDS)
              + f"   {top:<24}{story(shares, hd) or '-'}")
    holds = "holds here" if 2 * len(told) < len(HEADS) else "does not hold here"
    print(f"   {len(told)} of {len(HEADS)} heads have a story by these four kinds of key: 'most "
          f"heads are hard to interpret' {holds}.\n   A story says where a head looks, not what it "
          "does for the loss: that is table D", flush=True)


# ------------------------------------------------------------ D. one head at a time
# Michel, Levy and Neubig (2019) silence heads of a trained model at test time. Here each window's
# loss is measured with and without, so each rise is paired window by window.
def without_heads(model, heads):
    """A copy of model with each (layer, head) in heads silenced: out_proj sees the heads side by
    side, o = [o_0 | ... | o_7], so W o + b = W[:, 0:dh] o_0 + ... + b, and zeroing head j's dh
    columns of W zeroes o_j."""
    new, dh = copy.deepcopy(model), quality.D_MODEL // quality.N_HEADS
    with torch.no_grad():
        for layer, head in heads:
            new.blocks[layer].attn.out_proj.weight[:, head * dh:(head + 1) * dh] = 0.0   # (d, h dh)
    return new


def head_ablation(model, x, y):
    """(each window's loss (N,), {head: each window's loss rise with that head silenced (N,)})."""
    base = quality.window_losses(model, x, y)
    silenced = {hd: quality.window_losses(without_heads(model, [hd]), x, y) for hd in HEADS}
    return base, {hd: loss - base for hd, loss in silenced.items()}


def block_means(rise):
    """Means of BLOCKS runs of consecutive windows: neighbours correlate, so intervals use these."""
    return [b.mean().item() for b in torch.tensor_split(rise, BLOCKS)]


def stretches(data, n):
    """n stretches of the training text, each as long as the validation text and windowed alike."""
    size = len(data.val)
    return [quality.windows(data.train[k * size:(k + 1) * size], data.val_starts) for k in range(n)]


def coverage(model, data, n):
    """How often a head's interval from one stretch covers the mean rise of the other n - 1, its
    half width scaled by sqrt(1 + 1 / (n - 1)), as their mean is uncertain too: (covered, cases)."""
    rises = [head_ablation(model, x, y)[1] for x, y in stretches(data, n)]
    covered = 0
    for hd in HEADS:
        means = [r[hd].mean().item() for r in rises]
        for k, r in enumerate(rises):
            low, high = quality.interval(block_means(r[hd]))
            others = (sum(means) - means[k]) / (n - 1)
            half = (high - low) / 2 * math.sqrt(1 + 1 / (n - 1))
            covered += abs(others - (low + high) / 2) <= half
    return covered, len(HEADS) * n


def print_table_d(base, alone, shares, chance, covered, cases):
    rank = {hd: k + 1 for k, hd in enumerate(sorted(HEADS, key=lambda hd: -alone[hd].mean()))}
    lag1 = [torch.corrcoef(torch.stack([r[:-1], r[1:]]))[0, 1].item() for r in alone.values()]
    print(f"\nD. The loss with one head silenced (its output zeroed before out_proj), minus the "
          f"intact model's {base.mean():.3f}\n   bits/char, paired on the same {len(base)} "
          f"validation windows. Neighbouring windows' rises correlate (lag 1:\n   {min(lag1):+.2f} "
          f"to {max(lag1):+.2f} over the heads), so each [interval] is a t-interval over {BLOCKS} "
          f"blocks of {len(base) // BLOCKS}\n   consecutive windows, nominally 95 %. On "
          f"{cases // len(HEADS)} stretches of the training text, one stretch's\n   interval "
          f"covered the others' mean in {covered} of {cases} cases ({covered / cases:.0%}). "
          "Rank 1: the head most needed")
    print(f"   {'layer':>5}{'head':>5}   {'loss rise [interval]':<26}{'rank':>4}   favours (C)")
    for hd in HEADS:
        top = "{}, {:.1f}x".format(*favourite(shares, chance, hd))
        rise = quality.paired(block_means(alone[hd]))
        print(f"   {hd[0]:>5}{hd[1]:>5}   {rise:<26}{rank[hd]:>4}   {top}", flush=True)


# ------------------------------------------------------------ the pruning curve
def rank_windows(data):
    """RANK_WINDOWS evenly spaced windows of the training text: (starts, x, y)."""
    starts = torch.linspace(0, len(data.train) - quality.CONTEXT - 1, RANK_WINDOWS).long()
    return (starts, *quality.windows(data.train, starts))


def prune_order(model, x, y):
    """Every head, least needed first: each the one whose silencing, with those before it silenced
    too, raises the loss on windows x, y least."""
    order = []
    while len(order) < len(HEADS):
        left = [hd for hd in HEADS if hd not in order]
        loss = {hd: quality.window_losses(without_heads(model, order + [hd]), x, y).mean()
                for hd in left}
        order.append(min(left, key=loss.get))
    return order


def pruning_curve(model, data):
    """(order, [each validation window's rise with order's first k heads silenced, k = 0 .. 16]):
    the order chosen on the training text's windows, the rises measured on validation windows."""
    order = prune_order(model, *rank_windows(data)[1:])
    x, y = data.val_x, data.val_y
    base = quality.window_losses(model, x, y)
    return order, [quality.window_losses(without_heads(model, order[:k]), x, y) - base
                   for k in range(len(order) + 1)]


def can_go(rises):
    """How many heads go before the rise's interval first reaches above ALLOWED_RISE."""
    tops = [quality.interval(block_means(r))[1] for r in rises]   # 8 block means each
    return next((k - 1 for k, top in enumerate(tops) if top > ALLOWED_RISE), len(rises) - 1)


def print_curve(order, rises):
    print(f"\nThe pruning curve: heads silenced one after another, least needed first, in an order "
          f"chosen on\n   {RANK_WINDOWS} windows of the training text; the loss rise is measured "
          "on D's validation windows,\n   with D's intervals")
    print(f"   {'silenced':>8}{'left':>6}   {'the last':<10}loss rise [interval]")
    for k, rise in enumerate(rises):
        last = "-" if k == 0 else "{}.{}".format(*order[k - 1])
        print(f"   {k:>8}{len(order) - k:>6}   {last:<10}{quality.paired(block_means(rise))}")
    print(f"   {can_go(rises)} of {len(order)} heads can go before the loss rises by more than "
          f"{ALLOWED_RISE} bits/char (the interval's top above it)", flush=True)


# ------------------------------------------------------------ figures
def passage_start(text):
    """The first line of the text that opens with a capital and runs PASSAGE characters of prose."""
    plain = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ,.")
    return next(i for i in range(1, len(text) - PASSAGE)
                if text[i - 1] == "\n" and text[i].isupper() and set(text[i:i + PASSAGE]) <= plain)


def plot_maps(model, data, shares, chance, steps):
    """Every head on a real passage of the validation text, titled by what it favours."""
    from matplotlib.figure import Figure
    start = passage_start(data.val_text)
    text = data.val_text[start:start + PASSAGE]
    with torch.no_grad():
        maps = model(data.val[start:start + PASSAGE][None], need_weights=True)[1]   # (1, h, T, T)
    cols, rows = 4, len(HEADS) // 4
    fig = Figure(figsize=(3.2 * cols + 1, 3.2 * rows + 0.8))
    labels = [{" ": "\u2423", "\n": "\u21b5"}.get(c, c) for c in text]   # a space as ␣
    for hd, ax in zip(HEADS, fig.subplots(rows, cols).flat):
        im = ax.imshow(maps[hd[0]][0, hd[1]].numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
        told = story(shares, hd)
        title = "no story ({}, {:.1f}x)".format(*favourite(shares, chance, hd))
        if told:
            title = f"{told} {shares[told][hd]:.0%}"
        ax.set_title(f"layer {hd[0]} head {hd[1]}: {title}", fontsize=9,
                     fontweight="bold" if told else "normal")
        ax.set_xticks(range(len(text)), labels, fontsize=5)
        ax.set_yticks(range(len(text)), labels, fontsize=5)
        ax.tick_params(length=0, pad=1)
    fig.subplots_adjust(left=0.03, right=0.92, bottom=0.03, top=1 - 1 / (3.2 * rows + 0.8),
                        wspace=0.15, hspace=0.25)
    fig.colorbar(im, cax=fig.add_axes([0.935, 0.2, 0.012, 0.6]), label="attention probability")
    fig.suptitle(f"Trained MHA (d={quality.D_MODEL}, {quality.N_HEADS} heads, "
                 f"{quality.N_LAYERS} layers, {steps} steps, seed {SEED}) on a validation passage; "
                 "rows: query, columns: key.\nTitles: the kind of key holding at least "
                 f"{STORY:.0%} of a head's attention over all validation windows (bold), else "
                 "its favourite against uniform", fontsize=11)
    return fig


def plot_curve(order, rises, steps, covered):
    """The loss rise against the heads left, with its intervals (covered: their measured coverage)
    and the allowed rise."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    left = [len(order) - k for k in range(len(rises))]
    means = [statistics.mean(block_means(r)) for r in rises]
    cis = [quality.interval(block_means(r)) for r in rises]
    below = [m - low for m, (low, _) in zip(means, cis)]
    above = [high - m for m, (_, high) in zip(means, cis)]
    ax.errorbar(left, means, yerr=[below, above], marker="o", capsize=3)
    for k, (layer, head) in enumerate(order, start=1):
        ax.annotate(f"{layer}.{head}", (left[k], means[k]), xytext=(4, -10),
                    textcoords="offset points", size=7)
    ax.axhline(ALLOWED_RISE, color="tab:red", ls="--", lw=1, label=f"allowed rise, {ALLOWED_RISE}")
    ax.set_yscale("symlog", linthresh=0.05)
    ax.set_ylim(bottom=min(-0.01, min(low for low, _ in cis)))
    ax.invert_xaxis()
    ax.set(xlabel="heads left (label: the head silenced last)",
           ylabel="loss rise (bits/char; linear below 0.05, log above)")
    ax.legend(loc="upper left")
    ax.set_title(f"Pruning one trained MHA (seed {SEED}, {steps} steps), least needed head first: "
                 f"{can_go(rises)} of {len(order)} go\nbefore the rise can exceed "
                 f"{ALLOWED_RISE}; ordered on the training text, scored on {len(rises[0])} "
                 f"validation windows;\nbars: t-intervals over {BLOCKS} blocks of consecutive "
                 f"windows, nominally 95 %, {covered:.0%} coverage measured",
                 fontsize=9)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------ main
def main(argv=None):
    args = parse_args(argv)        # a bad flag or --out-dir ends here, in one line (exit code 2)
    torch.set_num_threads(1)       # as quality.py's workers: the same model to the bit
    n = len(HEADS)
    evals = n * (n + 1) // 2 + (n + 1) * (args.stretches + 2)   # the order, the rest
    estimate = args.steps * STEP_SECONDS + evals * EVAL_SECONDS + 10
    print(f"What one trained MHA's heads do, and how many it needs: quality.py's MHA of seed "
          f"{SEED}, {args.steps} steps,\nthen {evals} losses of 256 windows: about "
          f"{estimate / 60:.1f} min",
          flush=True)
    start = time.perf_counter()
    data = quality.Data(quality.load_text())
    model, loss = train_mha(data, args.steps)
    print(f"trained: validation loss {loss:.3f} bits/char", flush=True)
    shares, chance = head_shares(model, data)
    print_table_c(shares, chance)
    base, alone = head_ablation(model, data.val_x, data.val_y)
    covered, cases = coverage(model, data, args.stretches)
    print_table_d(base, alone, shares, chance, covered, cases)
    order, rises = pruning_curve(model, data)
    print_curve(order, rises)
    figures = [plot_maps(model, data, shares, chance, args.steps),
               plot_curve(order, rises, args.steps, covered / cases)]
    for name, fig in zip(FIGURES, figures):
        fig.savefig(os.path.join(args.out_dir, name), dpi=100)   # Agg's PNG holds no date
    print(f"\nFigures written to {os.path.join(os.path.relpath(args.out_dir), '')}: "
          f"{', '.join(FIGURES)}")
    print(f"time: {(time.perf_counter() - start) / 60:.1f} min (estimated {estimate / 60:.1f})")
    return 0


# ------------------------------------------------------------ plumbing (not the lesson)
def parse_args(argv=None):
    """The flags, defaulting to the knobs; a bad one, or a folder that cannot be made, ends here."""
    parser = argparse.ArgumentParser(prog="heads.py", description="What trained heads do.")
    parser.add_argument("--steps", type=int, help=f"training steps ({STEPS}; {QUICK_STEPS} quick)")
    parser.add_argument("--quick", action="store_true", help="a smoke run for trying an edit")
    parser.add_argument("--out-dir", default=OUT_DIR, help="where the figures go (figures/)")
    args = parser.parse_args(argv)
    args.steps = (QUICK_STEPS if args.quick else STEPS) if args.steps is None else args.steps
    args.stretches = QUICK_STRETCHES if args.quick else STRETCHES
    if args.steps < 1:
        parser.exit(2, f"heads.py: error: --steps {args.steps} must be at least 1\n")
    try:
        os.makedirs(args.out_dir, exist_ok=True)
    except OSError as e:
        parser.exit(2, f"heads.py: error: --out-dir {args.out_dir!r} cannot be made: "
                       f"{e.strerror}\n")
    return args


if __name__ == "__main__":
    try:
        code = main()
        sys.stdout.flush()                     # here, so that a closed pipe is caught below
    except KeyboardInterrupt:                  # Ctrl-C: one process, nothing left behind
        print("\nheads.py: interrupted", file=sys.stderr)
        code = 130
    except BrokenPipeError:                    # python heads.py | head: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    sys.exit(code)
