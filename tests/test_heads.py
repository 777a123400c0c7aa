"""heads.py: a tiny run through main(), its flags, the windows that order the heads against those
that score the curve, the greedy order and the answer on known numbers, table C's shares on made-up
attention, and table D's pieces (silencing a head, blocks, coverage)."""

import os
import re
import types

import pytest
import torch
from conftest import ROOT, run_main

import heads
import quality


@pytest.fixture(scope="module")
def data():
    return quality.Data(quality.load_text())


def head_lines(text):
    """The lines of a printed table that start with a layer and a head number."""
    return [line for line in text.splitlines() if "".join(line.split()[:2]).isdigit()]


# ------------------------------------------------------------ end to end
def test_a_tiny_run_prints_c_d_and_the_curve_and_writes_two_pngs(data, tmp_path, capsys,
                                                                  monkeypatch):
    """main() on 10 steps and 64 windows everywhere: nothing is learned, everything runs, and the
    model is quality.py's MHA of seed 0 trained by quality.py's own functions."""
    monkeypatch.setattr(quality, "EVAL_WINDOWS", 64)
    monkeypatch.setattr(heads, "RANK_WINDOWS", 64)
    monkeypatch.setattr(heads, "STRETCHES", 2)
    assert heads.main(["--steps", "10", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    table_c = out.split("C. What each head")[1].split("D. The loss")[0]
    table_d = out.split("D. The loss")[1].split("The pruning curve")[0]
    curve = out.split("The pruning curve")[1].split("Figures written")[0]
    assert len(head_lines(table_c)) == len(heads.HEADS) == 16
    assert "of 16 heads have a story by these four kinds of key" in table_c
    assert len(head_lines(table_d)) == 16 and all("[" in line for line in head_lines(table_d))
    assert "t-interval over 8 blocks of 8" in table_d and "of 32 cases" in table_d   # 16 heads x 2
    rows = [line.split() for line in curve.splitlines()]
    steps = [s for s in rows if len(s) > 2 and (s[0] + s[1]).isdigit()]
    assert [int(s[0]) for s in steps] == list(range(17))
    assert [int(s[1]) for s in steps] == list(range(16, -1, -1))
    assert sorted(s[2] for s in steps[1:]) == sorted(f"{i}.{j}" for i, j in heads.HEADS)   # once
    assert "heads can go before the loss rises by more than 0.02 bits/char" in curve
    for name in heads.FIGURES:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    small = quality.Data(quality.load_text())                          # 64 windows, as main's
    torch.manual_seed(0)
    model = quality.CharLM(len(small.chars), quality.N_HEADS)
    opt = quality.optimizer(model)
    loss = quality.train(model, opt, small, small.batches(0, 10), quality.lr_at, {10})
    assert f"trained: validation loss {loss[10]:.3f} bits/char" in out


def test_a_bad_flag_or_folder_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "a_file").write_text("not a folder")
    bad_folder = str(tmp_path / "a_file" / "figures")
    for argv, words in [(["--steps", "0"], "heads.py: error: --steps 0 must be at least 1\n"),
                        (["--out-dir", bad_folder], "cannot be made: Not a directory\n")]:
        code, out, err = run_main(heads.main, argv, capsys)
        assert (code, out) == (2, "") and err.endswith(words) and err.count("\n") == 1, err



def test_the_readmes_heads_numbers_are_those_of_the_run_the_lab_notes_quote():
    with open(os.path.join(ROOT, "LABNOTES.md")) as f:
        run = f.read().split("## heads.py")[1].split("```text\n")[1].split("```")[0]
    with open(os.path.join(ROOT, "README.md")) as f:
        chapter = " ".join(f.read().split("**What trained heads do")[1].split("![")[0].split())
    told, holds = re.search(r"(\d+) of 16 heads have a story .*interpret' (holds here|does not "
                            r"hold here)", run).groups()
    gone, rise = re.search(r"(\d+) of 16 heads can go before the loss rises by more than (\S+) "
                           r"bits", run).groups()
    assert f"{told} of the 16 heads give half their attention" in chapter
    assert f"\"most heads are hard to interpret\" {holds}" in chapter
    assert f"{gone} of 16 can go before the loss rises by more than {rise} bits per" in chapter

# ------------------------------------------------------------ the pruning curve
def positions(starts, offset):
    """Every character a window reads (inputs and targets), as positions in the whole text."""
    return {int(s) + offset + i for s in starts for i in range(quality.CONTEXT + 1)}


def test_the_windows_that_order_the_heads_are_disjoint_from_those_that_score(data, monkeypatch):
    """pruning_curve orders the heads on the windows prune_order is given and scores on those it
    passes to window_losses itself: no character of the one set is in the other."""
    seen, scored, real = {}, [], quality.window_losses

    def order_on(model, x, y):
        seen["x"], seen["y"] = x, y
        return list(heads.HEADS)

    def scoring(model, x, y):
        scored.append((x, y))
        return real(model, x, y)

    monkeypatch.setattr(heads, "prune_order", order_on)
    monkeypatch.setattr(quality, "window_losses", scoring)
    torch.manual_seed(0)
    heads.pruning_curve(quality.CharLM(len(data.chars), quality.N_HEADS), data)
    starts, x, y = heads.rank_windows(data)
    assert torch.equal(seen["x"], x) and torch.equal(seen["y"], y)
    assert len(scored) == 18                                                  # base, k = 0 .. 16
    assert all(torch.equal(sx, data.val_x) and torch.equal(sy, data.val_y) for sx, sy in scored)
    assert torch.equal(data.val_x, quality.windows(data.val, data.val_starts)[0])
    ranked, scoring_chars = positions(starts, 0), positions(data.val_starts, len(data.train))
    assert ranked and scoring_chars and not ranked & scoring_chars
    assert max(ranked) < len(data.train) <= min(scoring_chars)
    # The check can fail: a window of the training text that ended on the first validation
    # character would overlap the windows that score.
    assert positions([len(data.train) - quality.CONTEXT], 0) & scoring_chars


def silenced_heads(model):
    """The (layer, head)s whose out_proj columns without_heads zeroed."""
    dh = quality.D_MODEL // quality.N_HEADS
    return [(i, j) for i, j in heads.HEADS
            if model.blocks[i].attn.out_proj.weight[:, j * dh:(j + 1) * dh].abs().sum() == 0]


def test_prune_order_silences_the_least_needed_head_next_given_those_already_silenced(monkeypatch):
    """A made-up loss: each head costs its own amount, and head 0.1 costs 5 more once 1.0 is
    silenced. Greedy takes the cheapest next, so 0.1 moves behind heads that cost more alone.
    Silencing touches nothing but the silenced heads' columns of out_proj, on a copy."""
    cost = {hd: 0.01 * (k + 1) for k, hd in enumerate(heads.HEADS)}           # 0.0 cheapest
    cost[(1, 0)] = 0.0                                                           # 1.0 cheaper still
    torch.manual_seed(0)
    base = quality.CharLM(20, quality.N_HEADS)
    before = {n: p.clone() for n, p in base.named_parameters()}

    def loss(model, x, y):
        changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
        assert all(n.endswith("out_proj.weight") for n in changed), changed
        gone = silenced_heads(model)
        extra = 5.0 if (0, 1) in gone and (1, 0) in gone else 0.0
        return torch.full((len(x),), sum(cost[hd] for hd in gone) + extra)

    monkeypatch.setattr(quality, "window_losses", loss)
    order = heads.prune_order(base, torch.zeros(4, 3), None)
    assert order == [(1, 0)] + sorted((hd for hd in heads.HEADS if hd not in ((1, 0), (0, 1))),
                                      key=cost.get) + [(0, 1)]


def test_can_go_counts_the_heads_before_an_interval_reaches_above_the_allowed_rise():
    """Rises that are the same in every block have no width; 0.015 in half the blocks and 0.025 in
    the others has mean 0.02 and an interval reaching above it."""
    def flat(v):
        return torch.full((256,), v)

    wobbly = torch.tensor([0.015, 0.025] * 4).repeat_interleave(32)
    assert heads.can_go([flat(0.0), flat(0.01), flat(0.019), flat(0.03)]) == 2
    assert heads.can_go([flat(0.0), flat(0.01), wobbly, flat(0.0)]) == 1
    assert heads.can_go([flat(0.0)] * 17) == 16


# ------------------------------------------------------------ C. what each head favours
def test_head_shares_known_answer(data):
    """A model whose head 0 looks only at the previous character, the others only at themselves."""
    T, h = quality.CONTEXT, quality.N_HEADS

    class Fake(torch.nn.Module):
        def forward(self, x, need_weights=False):
            p = torch.zeros(len(x), h, T, T)
            p[:, :, 0, 0] = 1.0
            p[:, 0, torch.arange(1, T), torch.arange(T - 1)] = 1.0       # previous character
            p[:, 1:, torch.arange(1, T), torch.arange(1, T)] = 1.0       # itself
            return None, [p]

    shares, chance = heads.head_shares(Fake(), data)
    assert shares["previous"][0, 0].item() == pytest.approx(1.0) and shares["itself"][0, 0] == 0.0
    assert shares["itself"][0, 1].item() == pytest.approx(1.0) and shares["previous"][0, 1] == 0.0
    level = sum(1 / (i + 1) for i in range(1, T)) / (T - 1)       # uniform: 1/(i+1) on each key
    assert chance["previous"] == pytest.approx(level) and chance["itself"] == pytest.approx(level)
    assert heads.favourite(shares, chance, (0, 0)) == ("previous", pytest.approx(1 / level))
    assert heads.story(shares, (0, 0)) == "previous" and heads.story(shares, (0, 1)) == "itself"


def test_head_shares_finds_word_starts_and_a_story_needs_half_the_attention():
    """'ab ab': the word that holds each position starts at 0, 0, 0 (the space ends the first word),
    3, 3. Head 0 attends to exactly those keys; the others look at key 0 from row 1 and at the space
    from rows 2 to 4: a quarter on word starts (row 1's key 0), three quarters on whitespace."""
    data = types.SimpleNamespace(val_x=torch.tensor([[1, 2, 0, 1, 2]]), chars=[" ", "a", "b"])

    class Fake(torch.nn.Module):
        def forward(self, x, need_weights=False):
            p = torch.zeros(1, quality.N_HEADS, 5, 5)                       # (N, h, T, T)
            p[0, 0, torch.arange(5), torch.tensor([0, 0, 0, 3, 3])] = 1.0   # each word's start
            p[0, 1:, torch.arange(5), torch.tensor([0, 0, 2, 2, 2])] = 1.0  # the space
            return None, [p]

    shares, _ = heads.head_shares(Fake(), data)
    assert shares["word start"][0, 0].item() == pytest.approx(1.0)
    assert shares["word start"][0, 1].item() == pytest.approx(0.25)
    assert shares["whitespace"][0, 1] == 0.75
    assert heads.story(shares, (0, 1)) == "whitespace"
    assert shares["previous"][0, 1].item() == pytest.approx(0.5)              # rows 1 and 3
    shares["whitespace"][0, 1] = shares["previous"][0, 1] = 0.49             # under half: no story
    assert heads.story(shares, (0, 1)) is None


# ------------------------------------------------------------ D. one head at a time
def test_intervals_are_over_blocks_of_consecutive_windows():
    """8 blocks of 32 windows: block k of 0, 1, ..., 255 has mean 32 k + 15.5."""
    assert heads.block_means(torch.arange(256.0)) == [32 * k + 15.5 for k in range(8)]


def test_coverage_counts_the_intervals_that_cover_the_other_stretches_mean(monkeypatch):
    """Four stretches; every head's rise is 0.1 +/- 0.01 by block on three and 0.5 on the fourth:
    the fourth's interval misses the others' mean, and theirs miss a mean pulled to 0.2."""
    jitter = torch.tensor([-0.01, 0.01] * 4).repeat_interleave(4)              # 8 blocks of 4
    level = [0.1, 0.1, 0.1, 0.5]
    monkeypatch.setattr(heads, "stretches", lambda data, n: [(k, None) for k in range(n)])
    monkeypatch.setattr(heads, "head_ablation",
                        lambda model, k, y: (None, {hd: level[k] + jitter for hd in heads.HEADS}))
    assert heads.coverage(None, None, 4) == (0, 64)
    level[3] = 0.1
    assert heads.coverage(None, None, 4) == (64, 64)


def test_table_d_prints_each_heads_interval_over_its_blocks_and_ranks_by_its_rise(capsys):
    blocks = torch.tensor([0.1, 0.3, 0.2, 0.4, 0.3, 0.5, 0.2, 0.4])             # 8 block means
    alone = {hd: blocks.repeat_interleave(32) * (k + 1) for k, hd in enumerate(heads.HEADS)}
    shares = {kind: torch.ones(quality.N_LAYERS, quality.N_HEADS) for kind in heads.KINDS}
    chance = dict.fromkeys(shares, 0.1)
    heads.print_table_d(torch.full((256,), 2.0), alone, shares, chance, 100, 128)
    out = capsys.readouterr().out
    found = [re.search(r"(\S+ \[.+?\])\s+(\d+)   ", line).groups() for line in head_lines(out)]
    expected = [quality.paired((blocks * (k + 1)).tolist()) for k in range(16)]
    assert [ci for ci, _ in found] == expected
    assert [int(rank) for _, rank in found] == list(range(16, 0, -1))       # the largest ranks 1
    assert "in 100 of 128 cases (78%)" in out
