"""quality.py's table E: the quantizer against the hand example and PyTorch's own, the packing, the quantized
cache's bytes against the formula, decoding through mha.CausalMHA with it, and the answer on made-up losses."""

import pytest
import torch

import mha
import quality
from conftest import gqa_module

D, H, KV, T = 64, 8, 2, 12                                 # a CausalMHA of quality.py's width, GQA-2: dh = 8


# ----------------------------------------------------------------------------- the quantizer
def test_the_worked_example_in_the_comment_by_hand():
    x = torch.tensor([0.6, -1.75, 0.1, 0.3, 1.0, -0.4, 0.0, 0.9])
    codes, scale = quality.quantize(x, 4)
    assert scale.dtype == torch.bfloat16 and scale.item() == 0.25            # 1.75 / 7
    assert codes.tolist() == [2, -7, 0, 1, 4, -2, 0, 4]
    back = quality.dequantize(codes, scale, torch.float32)
    assert back.tolist() == [0.5, -1.75, 0.0, 0.25, 1.0, -0.5, 0.0, 1.0]
    assert quality.pack(codes, 4).tolist() == [9, 135, 91, 183]              # two codes a byte, + 7


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_the_quantizer_is_pytorchs_symmetric_one_with_a_scale_per_group(bits):
    """Against torch.fake_quantize_per_channel_affine, each group a channel, at our bf16 scales: the same
    round-to-nearest, to the last bit; and within half a step of x (a bf16 scale rounded down: a hair more)."""
    torch.manual_seed(bits)
    x = torch.randn(3, 5, 7, 8) * torch.rand(3, 5, 7, 1) * 4                 # groups of 8, scales apart
    codes, scale = quality.quantize(x, bits)
    qmax = 2 ** (bits - 1) - 1
    assert codes.dtype == torch.int8 and codes.abs().max() <= qmax and scale.shape == (3, 5, 7, 1)
    back = quality.dequantize(codes, scale, torch.float32)
    rows, s = x.reshape(-1, 8), scale.float().reshape(-1)                    # (groups, 8), (groups,)
    theirs = torch.fake_quantize_per_channel_affine(rows, s, torch.zeros_like(s, dtype=torch.int32), 0, -qmax, qmax)
    assert torch.equal(back.reshape(-1, 8), theirs)
    step_error = (back - x).abs() - scale.float() / 2                        # <= 0 but for the clamp's hair
    assert step_error.max() <= x.abs().amax() * 2 ** -8


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_packing_takes_bits_bytes_for_8_codes_and_unpacks_to_the_same(bits):
    qmax = 2 ** (bits - 1) - 1
    torch.manual_seed(0)
    codes = torch.randint(-qmax, qmax + 1, (2, 3, 5, 16), dtype=torch.int8)
    packed = quality.pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 5, 16 * bits // 8)
    assert torch.equal(quality.unpack(packed, bits), codes)
    if bits == 4:                                          # int4: the first code the low half of the byte
        assert torch.equal(packed, (codes[..., 0::2] + 7 + 16 * (codes[..., 1::2] + 7)).to(torch.uint8))


# ----------------------------------------------------------------------------- the cache
def test_its_bytes_read_from_its_tensors_equal_the_formula_int4_packed():
    """A model's caches after a whole window: codes and bf16 scales, as many bytes as cache_bytes_per_token
    says, for every configuration and number of bits; int4 holds dh = 8 codes in 4 bytes."""
    assert quality.cache_bytes_per_token(8) == 2 * 2 * 8 * 8 * 2 == 512     # bf16, mha.py's 2 bytes a number
    assert quality.cache_bytes_per_token(8, 4) == 2 * 2 * 8 * (8 // 2 + 2) == 192   # 4 bytes of codes + a scale
    x = torch.randint(20, (2, quality.CONTEXT))            # (B, T)
    for name, kv in quality.CONFIGS.items():
        model = quality.fresh_models(20, 0)[name]
        for bits in quality.BITS:
            caches = quality.quantized_caches(model, 2, bits)
            with torch.no_grad():
                model(x, caches=caches)
            held = sum(c.nbytes() for c in caches)
            assert held == 2 * quality.CONTEXT * quality.cache_bytes_per_token(kv, bits), (name, bits)
            if bits == 4:
                assert caches[0].k_codes.shape == (2, kv, quality.CONTEXT, 4)
                assert caches[0].k_codes.dtype == torch.uint8 and caches[0].v_scales.dtype == torch.bfloat16


@pytest.mark.parametrize("bits", [8, 4, 3])
def test_decoding_through_causal_mha_equals_the_whole_forward_with_the_same_rounding(bits):
    """mha.CausalMHA takes the cache as it is: chunks of 6, 2, then 1 token against all 12 at once, both
    rounded, within 1e-5; and the rounding is real: far from the forward without a cache."""
    attn = gqa_module(D, H, KV)
    x = torch.randn(2, T, D)                               # (B, T, d)
    with torch.no_grad():
        plain = attn(x)
        whole = attn(x, cache=quality.QuantizedKVCache(2, KV, T, D // H, bits))
        for fused in (False, True):
            cache, start, steps = quality.QuantizedKVCache(2, KV, T, D // H, bits), 0, []
            for n in (6, 2, 1, 1, 1, 1):
                steps.append(attn(x[:, start:start + n], cache=cache, fused=fused))
                start += n
            assert (torch.cat(steps, dim=1) - whole).abs().max() <= quality.DECODE_TOLERANCE
    assert cache.length == T
    assert (whole - plain).abs().max() > {8: 1e-4, 4: 1e-2, 3: 1e-2}[bits]


def test_the_cache_is_refused_by_causal_mha_when_it_does_not_match():
    """Its dtype and shape are honest answers: a float64 module, or a cache for other K/V heads, is refused."""
    x = torch.randn(2, T, D)
    with torch.no_grad():
        with pytest.raises(ValueError, match="the cache is"):
            gqa_module(D, H, KV)(x, cache=quality.QuantizedKVCache(2, KV * 2, T, D // H, 4))
        with pytest.raises(TypeError, match="the cache is torch.float32"):
            gqa_module(D, H, KV).double()(x.double(), cache=quality.QuantizedKVCache(2, KV, T, D // H, 4))
        with pytest.raises(ValueError, match="do not fit"):
            gqa_module(D, H, KV)(x, cache=quality.QuantizedKVCache(2, KV, T - 1, D // H, 4))


@pytest.mark.parametrize("bits, d_head, words", [(1, 8, "bits=1 must be"), (16, 8, "from 2 to 8"),
                                                 (4, 12, "d_head=12 must be a multiple of 8")])
def test_sizes_that_cannot_work_are_one_sentence(bits, d_head, words):
    with pytest.raises(ValueError, match=words):
        quality.QuantizedKVCache(1, 1, 4, d_head, bits)


def test_the_printed_check_says_ok_and_fails_on_a_count_without_scales(capsys, monkeypatch):
    torch.manual_seed(0)
    data = quality.Data("abcdefghij klmnopqrst" * 200)
    model = quality.CharLM(len(data.chars), quality.N_HEADS)
    assert quality.check_quantized_cache(model, data, 0, 4)
    assert "OK" in capsys.readouterr().out
    monkeypatch.setattr(quality, "SCALE_BYTES", 0)         # codes alone: the tensors hold more
    assert not quality.check_quantized_cache(model, data, 0, 4)
    assert "FAIL" in capsys.readouterr().out


# ----------------------------------------------------------------------------- table E and the answer
def made_up_losses():
    """{(config, bits): {seed: loss}}: MHA and MQA on seeds 0-4, the GQAs on 0-2; bits cost 0, 0.05, 0.2, 1.3."""
    base = {"MHA": 1.95, "GQA-4": 1.97, "GQA-2": 1.975, "MQA": 1.99}
    cost = {None: 0.0, 8: 0.0001, 4: 0.05, 3: 0.2, 2: 1.3}
    return {(name, bits): {s: base[name] + cost[bits] + 0.01 * s * (name == "MHA") + 0.001 * s
                           for s in range(5 if name in ("MHA", "MQA") else 3)}
            for name in quality.CONFIGS for bits in (None, *quality.BITS)}


def test_table_e_pairs_each_model_with_itself_as_trained(capsys):
    quality.print_table_e(made_up_losses())
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["GQA-4"]]
    assert [r[2:6] for r in rows] == [["full", "256", "3", "1.971"], ["8", "160", "3", "1.971"],
                                      ["4", "96", "3", "2.021"], ["3", "80", "3", "2.171"], ["2", "64", "3", "3.271"]]
    assert rows[2][6] == "+0.0500" and rows[1][6] == "+0.0001"   # the same offset on every seed: no spread


def test_the_answer_takes_the_best_of_each_kind_that_fits_and_pairs_over_common_seeds(capsys):
    """1/2 (256 bytes): GQA-4 as trained beats GQA-4 in 8 bits by 0.0001 on every seed (resolved), and MHA in 4
    bits (192) by 0.05 plus the seed offsets over the 3 seeds both ran; at 1/8 MHA in 2 bits needs 128."""
    quality.print_answer(made_up_losses())
    out = capsys.readouterr().out
    half, quarter, eighth = (part.splitlines() for part in out.split("1/")[1:4])
    assert half[0].endswith("256: the best is fewer heads, GQA-4 as trained (256 bytes), 1.971")
    assert half[1].split() == ["both:", "GQA-4", "in", "8", "bits", "(160", "bytes),", "1.971;", "minus", "the",
                               "best", "+0.0001", "[+0.0001,", "+0.0001]"]
    mha_4_bits = [1.95 + 0.05 + 0.011 * s - (1.97 + 0.001 * s) for s in range(3)]
    assert half[2].endswith(f"2.022; minus the best {quality.paired(mha_4_bits, digits=4)}")
    assert half[3] == "      answer: fewer heads"
    assert "MHA in 2 bits (128 bytes)" in quarter[2]
    assert eighth[2] == "      fewer bits:  none fits" and eighth[3] == "      answer: fewer heads"


def test_an_unresolved_difference_is_part_of_the_answer(capsys):
    losses = made_up_losses()
    for s, noise in zip(range(3), (0.001, -0.002, 0.0015)):   # 8 bits: +0.0001 on average, either sign
        losses["GQA-4", 8][s] = losses["GQA-4", None][s] + noise
    quality.print_answer(losses)
    out = capsys.readouterr().out.split("1/")[1]
    assert "answer: fewer heads or both (not resolved between them)" in out
