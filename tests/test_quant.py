"""quality.py's table E: the quantizer against the hand example and PyTorch's own, the packing, the
quantized cache's bytes against the formula, decoding through mha.CausalMHA with it, and the answer
on made-up losses."""

import os
import re

import pytest
import torch
from conftest import ROOT, gqa_module

import mha
import quality

D, H, KV, T = 64, 8, 2, 12                                 # quality.py's width, GQA-2: dh = 8
DH = D // H


def cache(bits):
    """An empty QuantizedKVCache for 2 sequences of the module above."""
    return quality.QuantizedKVCache(2, KV, T, DH, bits)


# ----------------------------------------------------------------------------- the quantizer
def test_the_worked_example_in_the_comment_by_hand():
    x = torch.tensor([0.6, -1.75, 0.1, 0.3, 1.0, -0.4, 0.0, 0.9])
    codes, scale = quality.quantize(x, 4)
    assert scale.dtype == torch.bfloat16 and scale.item() == 0.25            # 1.75 / 7
    assert codes.tolist() == [2, -7, 0, 1, 4, -2, 0, 4]
    back = codes.float() * scale.float()
    assert back.tolist() == [0.5, -1.75, 0.0, 0.25, 1.0, -0.5, 0.0, 1.0]
    assert quality.pack(codes, 4).tolist() == [9, 135, 91, 183]              # two codes a byte


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_the_quantizer_is_pytorchs_symmetric_one_with_a_scale_per_group(bits):
    """Against torch.fake_quantize_per_channel_affine, each group a channel, at our bf16 scales: the
    same round to nearest, to the last bit."""
    torch.manual_seed(bits)
    x = torch.randn(3, 5, 7, 8) * torch.rand(3, 5, 7, 1) * 4                 # groups of 8
    codes, scale = quality.quantize(x, bits)
    qmax = 2 ** (bits - 1) - 1
    assert codes.dtype == torch.int8 and codes.abs().max() <= qmax
    back = codes.float() * scale.float()
    rows, s = x.reshape(-1, 8), scale.float().reshape(-1)  # (groups, 8), (groups,)
    zero = torch.zeros_like(s, dtype=torch.int32)
    theirs = torch.fake_quantize_per_channel_affine(rows, s, zero, 0, -qmax, qmax)
    assert torch.equal(back.reshape(-1, 8), theirs)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_packing_takes_bits_bytes_for_8_codes_and_unpacks_to_the_same(bits):
    qmax = 2 ** (bits - 1) - 1
    torch.manual_seed(0)
    codes = torch.randint(-qmax, qmax + 1, (2, 3, 5, 16), dtype=torch.int8)
    packed = quality.pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 5, 16 * bits // 8)
    assert torch.equal(quality.unpack(packed, bits), codes)


# ----------------------------------------------------------------------------- the cache
def test_its_bytes_read_from_its_tensors_equal_the_formula_int4_packed():
    """A model's caches after a whole window hold, in codes and bf16 scales, the bytes that
    cache_bytes_per_token says, for every configuration and bits."""
    assert quality.cache_bytes_per_token(8) == 2 * 2 * 8 * 8 * 2 == 512     # bf16: 2 a number
    assert quality.cache_bytes_per_token(8, 4) == 2 * 2 * 8 * (8 // 2 + 2) == 192   # + a scale
    x = torch.randint(20, (2, quality.CONTEXT))            # (B, T)
    for name, kv in quality.CONFIGS.items():
        model = quality.fresh_models(20, 0)[name]
        for bits in quality.BITS:
            caches = quality.quantized_caches(model, 2, bits)
            with torch.no_grad():
                model(x, need_weights=bits == 2, caches=caches)   # asking for p keeps the cache
            held = sum(c.nbytes() for c in caches)
            assert [c.length for c in caches] == [quality.CONTEXT] * quality.N_LAYERS
            formula = 2 * quality.CONTEXT * quality.cache_bytes_per_token(kv, bits)   # B = 2
            assert held == formula, (name, bits)


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
def test_append_gives_back_each_k_and_v_rounded_within_a_step(bits):
    """Each number comes back rounded, within half its group's step (a step here: bf16's hair)."""
    torch.manual_seed(bits)
    k, v = torch.randn(2, 2, KV, T, DH)                    # each (B, kv, T, dh)
    for back, x in zip(cache(bits).append(k, v), (k, v)):
        assert 0 < (back - x).abs().max() <= x.abs().max() / (2 ** (bits - 1) - 1)


@pytest.mark.parametrize("bits", [4, 2])
def test_decoding_through_causal_mha_equals_the_whole_forward_with_the_same_rounding(bits):
    """mha.CausalMHA takes the cache as it is: chunks of 6, 2, then 1 token against all 12 at once,
    both rounded, within mha.py's TOLERANCE; and the rounding is real: far from the forward without
    a cache. (The projections of one token and of twelve may differ in their last bit, and a number
    that close to a code boundary rounds the other way: at 8 bits, 3 of 150 random modules.)"""
    attn = gqa_module(D, H, KV)
    x = torch.randn(2, T, D)                               # (B, T, d)
    with torch.no_grad():
        plain, whole = attn(x), attn(x, cache=cache(bits))
        for fused in (False, True):
            steps, start, held = [], 0, cache(bits)
            for n in (6, 2, 1, 1, 1, 1):
                steps.append(attn(x[:, start:start + n], cache=held, fused=fused))
                start += n
            assert (torch.cat(steps, dim=1) - whole).abs().max() <= mha.TOLERANCE   # 2e-6
    assert (whole - plain).abs().max() > 1e-2


def test_causal_mha_refuses_a_quantized_cache_without_room():
    """Its shape is an honest answer: one token short, refused before anything is written."""
    short = quality.QuantizedKVCache(2, KV, T - 1, DH, 4)
    with pytest.raises(ValueError, match="do not fit"), torch.no_grad():
        gqa_module(D, H, KV)(torch.randn(2, T, D), cache=short)
    assert short.length == 0 and not short.codes.any()


@pytest.mark.parametrize("bits, d_head, words", [(1, 8, "bits=1 must be"), (16, 8, "be 2 to 8"),
                                                 (3, 12, "d_head=12 x bits a multiple of 8")])
def test_sizes_that_cannot_work_are_one_sentence(bits, d_head, words):
    with pytest.raises(ValueError, match=words):
        quality.QuantizedKVCache(1, 1, 4, d_head, bits)


def test_the_printed_check_says_ok_and_fails_on_a_count_without_scales(capsys, monkeypatch):
    torch.manual_seed(0)
    data = quality.Data("abcdefghij klmnopqrst" * 200)
    model = quality.CharLM(len(data.chars), quality.N_HEADS)
    assert quality.check_quantized_cache(model, data, 0, 4)
    assert "OK" in capsys.readouterr().out
    codes_alone = lambda kv, bits=None: 2 * quality.N_LAYERS * kv * 8 * bits // 8
    monkeypatch.setattr(quality, "cache_bytes_per_token", codes_alone)   # the scales forgotten
    assert not quality.check_quantized_cache(model, data, 0, 4)
    assert "FAIL" in capsys.readouterr().out


# ----------------------------------------------------------------------------- table E, the answer
def made_up_losses():
    """{(config, bits): {seed: loss}}: MHA and MQA on seeds 0-4, the GQAs on 0-2; 8, 4, 3 and 2 bits
    cost 0.0001, 0.05, 0.2 and 1.3; the seeds' losses rise by 0.001 a seed, MHA's by 0.011."""
    base = {"MHA": 1.95, "GQA-4": 1.97, "GQA-2": 1.975, "MQA": 1.99}
    cost = {None: 0.0, 8: 0.0001, 4: 0.05, 3: 0.2, 2: 1.3}
    seeds = {"MHA": 5, "GQA-4": 3, "GQA-2": 3, "MQA": 5}
    return {(name, bits): {s: base[name] + cost[bits] + (0.011 if name == "MHA" else 0.001) * s
                           for s in range(seeds[name])}
            for name in quality.CONFIGS for bits in (None, *quality.BITS)}


def test_table_e_pairs_each_model_with_itself_as_trained(capsys):
    quality.print_table_e(made_up_losses())
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["GQA-4"]]
    assert [r[2:6] for r in rows] == [["full", "256", "3", "1.971"], ["8", "160", "3", "1.971"],
                                      ["4", "96", "3", "2.021"], ["3", "80", "3", "2.171"],
                                      ["2", "64", "3", "3.271"]]
    assert rows[1][6] == "+0.0001" and rows[2][6] == "+0.0500"   # the same on every seed


def test_the_answer_takes_the_best_of_each_kind_that_fits_and_pairs_over_common_seeds(capsys):
    """1/2 (256 bytes): GQA-4 as trained beats GQA-4 in 8 bits by 0.0001 on every seed, resolved,
    and MHA in 4 bits (192 bytes) by 0.05 and the seeds' offsets over the 3 seeds both ran; at 1/8
    nothing of MHA fits: in 2 bits it needs 128 bytes."""
    quality.print_answer(made_up_losses())
    parts = capsys.readouterr().out.split("1/")[1:4]
    half, quarter, eighth = (part.splitlines() for part in parts)
    assert half[0].endswith("256: the best is fewer heads, GQA-4 as trained (256 bytes), 1.971")
    assert half[1].split() == ["both:", "GQA-4", "in", "8", "bits", "(160", "bytes),", "1.971;",
                               "minus", "the", "best", "+0.0001", "[+0.0001,", "+0.0001]"]
    mha_4_bits = [1.95 + 0.05 + 0.011 * s - (1.97 + 0.001 * s) for s in range(3)]
    assert half[2].endswith(f"2.022; minus the best {quality.paired(mha_4_bits, digits=4)}")
    assert half[3] == "      answer: fewer heads"
    assert "MHA in 2 bits (128 bytes)" in quarter[2]
    assert eighth[2] == "      fewer bits:  none fits" and eighth[3] == "      answer: fewer heads"


def test_an_unresolved_difference_is_part_of_the_answer(capsys):
    losses = made_up_losses()
    for s, noise in zip(range(3), (0.001, -0.002, 0.0015)):   # 8 bits: either sign
        losses["GQA-4", 8][s] = losses["GQA-4", None][s] + noise
    quality.print_answer(losses)
    half = capsys.readouterr().out.split("1/")[1]
    assert "answer: fewer heads or both (not resolved between them)" in half


def test_the_readmes_answer_is_that_of_the_run_the_lab_notes_quote():
    """The README's numbers for table E are those LABNOTES quotes from a default run."""
    with open(os.path.join(ROOT, "LABNOTES.md")) as f:
        run = f.read().split("## Fewer bits: table E")[1].split("```text\n")[1].split("```")[0]
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = " ".join(f.read().split("Or fewer bits: table E")[1].split("![")[0].split())
    number = r"([+-]\d\.\d{4}) \[([+-]\d\.\d{4}), ([+-]\d\.\d{4})\]"
    half = re.search(r"fewer bits: +MHA in 4 bits .* minus the best " + number, run).groups()
    quarter = re.search(r"fewer bits: +MHA in 2 bits .* minus the best " + number, run).groups()
    assert "MHA in 4 bits not resolved from it ({} [{}, {}])".format(*half) in readme
    quarter = "{:+.2f} [{:+.2f}, {:+.2f}]".format(*map(float, quarter))
    assert f"MHA needs 2 bits, {quarter} behind GQA-2" in readme
    in_answer = r" 8 bits \(\d+ bytes\), [\d.]+; minus the best ([+-][\d.]+)"
    in_table = r"\n   \S+ +\d +8 +\d+ +\d +[\d.]+ +([+-][\d.]+)"
    eight = [float(g) for g in re.findall(in_answer, run) + re.findall(in_table, run)]
    assert len(eight) == 5 and max(eight) <= 0.001 and "8 bits on top cost at most +0.001" in readme
    answers = re.findall(r"\n      answer: (.*)", run)
    assert len(answers) == 3 and answers[2] == "fewer heads"   # 1/2, 1/4, 1/8 of MHA's bytes
    assert all(a.startswith("fewer heads") for a in answers)
    assert "At this scale, fewer heads" in readme
