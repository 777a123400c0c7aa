"""
Multi-head latent attention (MLA): DeepSeek's answer to "what comes after GQA for the cache?", in one file.

The chapter after mha.py. What it shows, top to bottom:
  1. LatentAttention: keys and values of every head come from one latent c = x W_DKV (dc numbers per token),
     expanded per head by W_UK and W_UV, plus one RoPE key shared by all heads. The cache keeps c and that
     key: dc + dr numbers per token and layer, however many heads (DeepSeek-V2: 576, against MHA's 32,768).
  2. Weight absorption, proven: the naive path rebuilds every head's K and V from the cache; the absorbed
     path folds W_UK into the queries and applies W_UV after attention, and never builds them. The same
     function (within 1e-12 in float64), and its decode step IS multi-query attention with one K/V head
     [c; k_R] and values c. Why the RoPE key is decoupled: rotate the content keys and absorption breaks.
  3. The cache of DeepSeek-V2, V2-Lite and V3, next to MHA, GQA-8 and MQA of the same shape.
  4. One absorbed decode step timed against the same-shaped MHA and GQA-8 steps, on mha.py's roofline: about
     121 FLOPs per byte in fp32, so MLA decoding waits on arithmetic where MHA waits on memory.

What it does not do: query compression (DeepSeek-V2 has it, V2-Lite not; it saves activations, not cache),
YaRN's RoPE scaling, training, mixed precision, GPU kernels.

Run it:   python mla.py     (a few seconds on a 2-core CPU; writes figures/mla_*.png), then edit D_LATENT or
          D_ROPE below and rerun.

Papers: DeepSeek-AI 2024, "DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts Language
        Model", arXiv:2405.04434 (section 2.1: MLA).   DeepSeek-AI 2024, "DeepSeek-V3 Technical Report",
        arXiv:2412.19437.   Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position
        Embedding", arXiv:2104.09864.

Shapes: mha.py's alphabet (B batch, T new tokens, d model width, h query heads, kv K/V heads, dh head width,
S keys a query can see), plus dc the latent width and dr the RoPE width.
"""

import argparse
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import mha
from mha import whole_number

# ----------------------------------------------------------------------------- knobs
D_MODEL = 256        # d: model width
N_HEADS = 8          # h: query heads
D_HEAD = 32          # dh: width of each head's content query, key and value
D_LATENT = 128       # dc: width of the latent c, shared by all heads' keys and values (DeepSeek: 4 dh)
D_ROPE = 16          # dr: width of the RoPE query and key; even, since RoPE turns pairs (DeepSeek: dh / 2)
ROPE_BASE = 10000.0  # RoFormer's base: pair i of the RoPE key turns by position x base^(-2i / dr) radians
SEQ_LEN = 12         # T: tokens in the demo sequence
BATCH = 2            # B: sequences in the demo batch
SEED = 0             # every random number in the run comes from this seed
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "figures")

# Published shapes: (layers, h, dh, dc, dr), i.e. config.json's (num_hidden_layers, num_attention_heads,
# qk_nope_head_dim = v_head_dim, kv_lora_rank, qk_rope_head_dim), as published on Hugging Face by deepseek-ai.
DEEPSEEK = {
    "DeepSeek-V2": (60, 128, 128, 512, 64),       # arXiv:2405.04434 section 3.1.2; DeepSeek-V2 config.json
    "DeepSeek-V2-Lite": (27, 16, 128, 512, 64),   # arXiv:2405.04434 appendix B; DeepSeek-V2-Lite config.json
    "DeepSeek-V3": (61, 128, 128, 512, 64),       # arXiv:2412.19437 section 4.2; DeepSeek-V3 config.json
}
CACHE_TOKENS = 4096                 # context length of the cache table
CACHE_BYTES_PER_ELEM = 2            # bf16, as DeepSeek serves its cache
GQA_KV_HEADS = 8                    # the GQA the table and the timing compare with
DECODE_CONTEXTS = (1024, 2048, 4096)   # cached tokens at which one decode step is timed
DECODE_ROUNDS = 5                   # each time is the best of this many rounds
FIGURES = ["mla_cache.png", "mla_roofline.png"]


# ----------------------------------------------------------------------------- the module
def rope(x, positions, base=ROPE_BASE):
    """x with each pair (x[2i], x[2i+1]) of its last dimension turned by position x base^(-2i / dr) radians.

    x: (..., T, dr), positions: (T,). Two turned vectors' dot product depends only on the difference of
    their positions: that is how attention learns where a key lies relative to the query (RoFormer).
    rope(torch.tensor([[1.0, 0.0]]), torch.tensor([1])) == [[cos 1, sin 1]] == [[0.5403, 0.8415]]
    """
    dr = x.shape[-1]
    freq = base ** (-torch.arange(0, dr, 2, dtype=torch.float64) / dr)       # (dr/2,)
    angle = positions.to(torch.float64)[:, None] * freq                      # (T, dr/2), the same in every call
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x0, x1 = x.unflatten(-1, (dr // 2, 2)).unbind(-1)                        # (..., T, dr) -> 2 x (..., T, dr/2)
    turned = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)  # (..., T, dr/2, 2)
    return turned.flatten(-2)                                                # (..., T, dr)


def latent_attend(q_lat, q_rope, c, k_rope, scale):
    """softmax((q_lat c^T + q_R k_R^T) * scale + causal mask) c: every head reads the one latent, as in MQA.

    q_lat: (B, h, T, dc), queries with W_UK folded in; q_rope: (B, h, T, dr); c: (B, S, dc); k_rope: (B, S, dr).
    Returns (B, h, T, dc): each head's attention-weighted sum of latents.
    As mha.attend does for a K/V head, the h heads are stacked as h*T rows of the single shared "head"
    (row r is head r // T at token r % T: with T = 3, row 7 is head 2's token 1), so c and k_R are read
    once, where they lie in the cache; T = 1, a decode step, is h rows of one query each.
    """
    B, h, T, dc = q_lat.shape
    S = c.shape[1]
    q_lat = q_lat.reshape(B, h * T, dc)                    # (B, h*T, dc)
    q_rope = q_rope.reshape(B, h * T, -1)                  # (B, h*T, dr)
    scores = (q_lat @ c.transpose(1, 2) + q_rope @ k_rope.transpose(1, 2)) * scale   # (B, h*T, S)
    if T > 1:                                              # one new token sees every key: no mask
        scores = scores + mha.causal_mask(T, S, scores.dtype).repeat(h, 1)   # (h*T, S)
    return (scores.softmax(dim=-1) @ c).view(B, h, T, dc)  # (B, h*T, dc) -> (B, h, T, dc)


@dataclass
class LatentCache:
    """What MLA keeps of every past token: the latent c and the RoPE key, nothing per head.

    c: (B, max_len, dc), k_rope: (B, max_len, dr); the first `length` positions hold tokens.
    """
    c: torch.Tensor
    k_rope: torch.Tensor
    length: int = 0

    @property
    def nbytes(self):
        return self.c.nbytes + self.k_rope.nbytes

    def append(self, c, k_rope):
        """Write c: (B, T, dc), k_rope: (B, T, dr) after the cached tokens; return all: (B, S, dc), (B, S, dr)."""
        S = self.length + c.shape[1]
        self.c[:, self.length:S] = c
        self.k_rope[:, self.length:S] = k_rope
        self.length = S
        return self.c[:, :S], self.k_rope[:, :S]


class LatentAttention(nn.Module):
    """Causal, bias-free multi-head latent attention, as in DeepSeek-V2 without query compression.

    Head i's score for key s:  (q_C,i . k_C,i,s + q_R,i . k_R,s) / sqrt(dh + dr),  where
        c = x W_DKV (dc),  k_C,i = W_UK,i c,  v_i = W_UV,i c  (dh each),  k_R = RoPE(x W_KR) (dr, one for all heads),
        q_C,i from x W_Q (dh),  q_R,i = RoPE(x W_QR) (dr).
    Why the RoPE key is decoupled: q_C,i . k_C,i,s = (W_UK,i^T q_C,i) . c_s, so W_UK,i can move to the query
    side, once per query instead of once per cached token. Rotating k_C would put the rotation of key s
    between W_UK,i and c_s: RoPE_s(W_UK,i c_s), a matrix that changes with s, which no query can absorb.
    So the position travels in dr extra dimensions of its own, and c stays free of it.
    """

    def __init__(self, d_model, n_heads, d_head, d_latent, d_rope):
        super().__init__()
        d, h, dh, dc, dr = check_sizes(d_model, n_heads, d_head, d_latent, d_rope)
        self.d_model, self.n_heads, self.d_head, self.d_latent, self.d_rope = d, h, dh, dc, dr
        self.scale = (dh + dr) ** -0.5
        self.w_dkv = nn.Linear(d, dc, bias=False)          # down to the latent: the cache
        self.w_uk = nn.Linear(dc, h * dh, bias=False)      # up to every head's content key
        self.w_uv = nn.Linear(dc, h * dh, bias=False)      # up to every head's value
        self.w_kr = nn.Linear(d, dr, bias=False)           # the one RoPE key
        self.w_q = nn.Linear(d, h * dh, bias=False)        # content queries
        self.w_qr = nn.Linear(d, h * dr, bias=False)       # RoPE queries
        self.w_o = nn.Linear(h * dh, d, bias=False)

    def forward(self, x, cache=None, absorbed=False):
        """x: (B, T, d) -> (B, T, d). With a cache, x holds only the new tokens, which are appended to it."""
        B, T = check_call(self, x, cache, absorbed)         # one sentence on a bad call, before any write
        start = 0 if cache is None else cache.length
        q, q_rope, c, k_rope = self.project(x, start)
        if cache is not None:
            c, k_rope = cache.append(c, k_rope)            # (B, S, dc), (B, S, dr), S = cached + T
        if absorbed:
            o = self.expand_output(latent_attend(self.absorb_query(q), q_rope, c, k_rope, self.scale))
        else:
            o = self.naive_attention(q, q_rope, c, k_rope)
        return self.w_o(o.transpose(1, 2).reshape(B, T, -1))   # (B, h, T, dh) -> (B, T, h*dh) -> (B, T, d)

    def project(self, x, start):
        """Queries (B, h, T, dh), RoPE queries (B, h, T, dr), latent (B, T, dc), RoPE key (B, T, dr) of x,
        whose tokens sit at positions start, start + 1, ..."""
        B, T, _ = x.shape
        h, dh, dr = self.n_heads, self.d_head, self.d_rope
        positions = torch.arange(start, start + T)
        q = self.w_q(x).view(B, T, h, dh).transpose(1, 2)                      # (B, T, h, dh) -> (B, h, T, dh)
        q_rope = rope(self.w_qr(x).view(B, T, h, dr).transpose(1, 2), positions)  # (B, T, h, dr) -> (B, h, T, dr)
        return q, q_rope, self.w_dkv(x), rope(self.w_kr(x), positions)

    def naive_attention(self, q, q_rope, c, k_rope):
        """softmax((q_C k_C^T + q_R k_R^T) / sqrt(dh + dr) + mask) v, every head's k_C and v rebuilt from c."""
        B, h, T, dh = q.shape
        S = c.shape[1]
        k = self.w_uk(c).view(B, S, h, dh).transpose(1, 2)     # (B, S, h*dh) -> (B, S, h, dh) -> (B, h, S, dh)
        v = self.w_uv(c).view(B, S, h, dh).transpose(1, 2)     # (B, S, h*dh) -> (B, S, h, dh) -> (B, h, S, dh)
        k_rope = k_rope.unsqueeze(1)                           # (B, 1, S, dr): one key, broadcast to every head
        scores = (q @ k.transpose(2, 3) + q_rope @ k_rope.transpose(2, 3)) * self.scale   # (B, h, T, S)
        return (scores + mha.causal_mask(T, S, q.dtype)).softmax(dim=-1) @ v                # (B, h, T, dh)

    def absorb_query(self, q):
        """(B, h, T, dh) -> (B, h, T, dc): q_C,i -> W_UK,i^T q_C,i, whose dot product with c_s is q_C,i . k_C,i,s."""
        h, dh, dc = self.n_heads, self.d_head, self.d_latent
        # Row i*dh + r of w_uk.weight makes dimension r of head i's key (the naive path's view(B, S, h, dh)):
        # e.g. with dh = 32, row 70 is head 2's dimension 6. So head i's W_UK,i is rows i*dh .. i*dh + dh - 1.
        w_uk = self.w_uk.weight.view(h, dh, dc)            # (h*dh, dc) -> (h, dh, dc)
        return q @ w_uk                                    # (B, h, T, dh) @ (h, dh, dc) -> (B, h, T, dc)

    def expand_output(self, o_lat):
        """(B, h, T, dc) -> (B, h, T, dh): W_UV,i applied once to head i's weighted sum of latents,
        sum_s p_s (W_UV,i c_s) = W_UV,i (sum_s p_s c_s), instead of once to every cached token."""
        h, dh, dc = self.n_heads, self.d_head, self.d_latent
        w_uv = self.w_uv.weight.view(h, dh, dc)            # (h*dh, dc) -> (h, dh, dc), rows as in absorb_query
        return o_lat @ w_uv.transpose(1, 2)                # (B, h, T, dc) @ (h, dc, dh) -> (B, h, T, dh)
    # The paper says W_UK "can be absorbed into" the query projection and W_UV into W_O: multiplied ahead
    # of time. Applied on the fly, as here and in DeepSeek's own inference code, the matrices stay small:
    # at DeepSeek-V2's shape without query compression, W_Q times W_UK would hold h d dc = 335M numbers per
    # layer, against 92M for the two.

    def new_cache(self, batch, max_len):
        """An empty LatentCache for `batch` sequences of up to `max_len` tokens, in this module's dtype."""
        batch, max_len = whole_number("batch", batch), whole_number("max_len", max_len)
        if batch < 1 or max_len < 1:
            raise ValueError(f"a cache needs batch >= 1 and max_len >= 1, got batch={batch}, max_len={max_len}")
        dtype = self.w_dkv.weight.dtype
        n_bytes = batch * max_len * (self.d_latent + self.d_rope) * self.w_dkv.weight.element_size()
        if n_bytes > mha.memory_bytes():
            raise ValueError(f"a cache of batch={batch}, max_len={max_len} needs {n_bytes / 1e9:,.0f} GB, more "
                             f"than this machine's {mha.memory_bytes() / 1e9:.0f} GB of memory")
        return LatentCache(torch.zeros(batch, max_len, self.d_latent, dtype=dtype),   # (B, max_len, dc)
                           torch.zeros(batch, max_len, self.d_rope, dtype=dtype))     # (B, max_len, dr)


# ----------------------------------------------------------------------------- the checks
def demo_module(seed, dtype=torch.float32):
    """The knobs' LatentAttention and a (BATCH, SEQ_LEN, D_MODEL) input, both from seed."""
    torch.manual_seed(seed)
    attn = LatentAttention(D_MODEL, N_HEADS, D_HEAD, D_LATENT, D_ROPE).to(dtype).eval()
    return attn, torch.randn(BATCH, SEQ_LEN, D_MODEL, dtype=dtype)


def absorbed_vs_naive(attn, x):
    """max |absorbed - naive| / max |naive| over one full forward."""
    with torch.no_grad():
        return mha.relative_diff(attn(x, absorbed=True), attn(x))


def cached_vs_full(attn, x, absorbed, prompt):
    """Feed `prompt` tokens as one chunk, then the rest one at a time; relative difference to one full forward."""
    B, T, _ = x.shape
    cache = attn.new_cache(B, T)
    with torch.no_grad():
        steps = [attn(x[:, :prompt], cache=cache, absorbed=absorbed)]
        steps += [attn(x[:, t:t + 1], cache=cache, absorbed=absorbed) for t in range(prompt, T)]
        return mha.relative_diff(torch.cat(steps, dim=1), attn(x, absorbed=absorbed))


def mqa_identity_gap(attn, x):
    """The absorbed decode step of x's last token against PyTorch's multi-query attention, one K/V head:
    keys [c; k_R] (dc + dr wide), values c (dc wide), queries [W_UK,i^T q_C,i; q_R,i], scale 1/sqrt(dh + dr)."""
    B, T, _ = x.shape
    cache = attn.new_cache(B, T)
    with torch.no_grad():
        attn(x[:, :-1], cache=cache, absorbed=True)
        step = attn(x[:, -1:], cache=cache, absorbed=True)                   # (B, 1, d)
        q, q_rope, _, _ = attn.project(x[:, -1:], T - 1)                      # (B, h, 1, dh), (B, h, 1, dr)
        query = torch.cat([attn.absorb_query(q), q_rope], dim=-1)            # (B, h, 1, dc + dr)
        key = torch.cat([cache.c, cache.k_rope], dim=-1).unsqueeze(1)        # (B, 1, S, dc + dr): ONE K/V head
        value = cache.c.unsqueeze(1)                                         # (B, 1, S, dc): the latent itself
        o = F.scaled_dot_product_attention(query, key, value, scale=attn.scale, enable_gqa=True)  # (B, h, 1, dc)
        mqa = attn.w_o(attn.expand_output(o).transpose(1, 2).reshape(B, 1, -1))   # (B, h, 1, dh) -> (B, 1, d)
    return mha.relative_diff(mqa, step)


def rope_before_absorption_gap(attn, x):
    """The counter-example: RoPE on the content keys and queries, as in Llama, then W_UK absorbed anyway.

    The true scores are RoPE_t(q_C,i) . RoPE_s(W_UK,i c_s). All absorption can compute is the query turned
    first, (W_UK,i^T RoPE_t(q_C,i)) . c_s: the turn of key s is lost. Relative difference of the scores.
    """
    B, T, _ = x.shape
    h, dh = attn.n_heads, attn.d_head
    positions = torch.arange(T)
    with torch.no_grad():
        q, _, c, _ = attn.project(x, 0)
        k = attn.w_uk(c).view(B, T, h, dh).transpose(1, 2)                  # (B, T, h*dh) -> (B, h, T, dh)
        true = rope(q, positions) @ rope(k, positions).transpose(2, 3)       # (B, h, T, T)
        absorbed = attn.absorb_query(rope(q, positions)) @ c.unsqueeze(1).transpose(2, 3)  # (B, h, T, T)
    return mha.relative_diff(absorbed, true)


def run_checks(seed):
    """The evidence that absorption is right, and that it needs the decoupled RoPE. True if all pass."""
    print(f"1. Checks (B={BATCH}, T={SEQ_LEN}, d={D_MODEL}, h={N_HEADS}, dh={D_HEAD}, dc={D_LATENT}, dr={D_ROPE})")
    attn64, x64 = demo_module(seed, torch.float64)
    attn32, x32 = demo_module(seed)
    ok = mha.report("float64: max |absorbed - naive| / max |naive|", absorbed_vs_naive(attn64, x64), 1e-12)
    ok &= mha.report("float32: the same, exact in algebra but not rounding", absorbed_vs_naive(attn32, x32), 1e-5)
    ok &= mha.report("decode step vs MQA: key [c; k_R], value c (float64)", mqa_identity_gap(attn64, x64), 1e-12)
    prompt = SEQ_LEN // 2
    print(f"  cached, float32: {prompt} tokens in one chunk, then {SEQ_LEN - prompt} one at a time, against one "
          "full forward")
    for absorbed in (False, True):
        label = f"  {'absorbed' if absorbed else 'naive':<9} max |cached - full| / max |full|"
        ok &= mha.report(label, cached_vs_full(attn32, x32, absorbed, prompt), 1e-5)
    cache = attn32.new_cache(1, 512)
    want = latent_cache_bytes(1, D_LATENT, D_ROPE, 512, bytes_per_elem=4)
    ok &= cache.nbytes == want
    print(f"  512-token cache: {cache.nbytes:,} bytes allocated, {want:,} by the formula (dc + dr) x 512 x 4  "
          f"{'OK' if cache.nbytes == want else 'FAIL'}")
    broken = rope_before_absorption_gap(attn64, x64)
    print(f"  {'on purpose: RoPE on the content keys, then absorbed':<52} = {broken:.2e}  "
          f"{'FAIL, as it must' if broken > 1e-3 else 'NOT DETECTED'}")
    return ok and broken > 1e-3


# ----------------------------------------------------------------------------- the cache, in bytes
def latent_cache_bytes(n_layers, d_latent, d_rope, seq_len, batch=1, bytes_per_elem=2):
    """Bytes of an MLA cache: layers x (dc + dr) x tokens x batch x bytes per number.

    latent_cache_bytes(60, 512, 64, 4096) == 283115520   (DeepSeek-V2, bf16, 4k tokens: 0.28 GB)
    """
    return n_layers * (d_latent + d_rope) * seq_len * batch * bytes_per_elem


def cache_rows(layers, h, dh, dc, dr):
    """[(kind, numbers per token per layer, formula)] for one model's shape, the four kinds and the careless MLA."""
    return [("MHA", 2 * h * dh, "2 h dh"),
            (mha.attention_kind(h, GQA_KV_HEADS), 2 * GQA_KV_HEADS * dh, f"2 {GQA_KV_HEADS} dh"),
            ("MQA", 2 * dh, "2 dh"),
            ("MLA", dc + dr, "dc + dr"),
            ("MLA, careless", h * (2 * dh + dr), "h (2 dh + dr)")]   # every head's K (dh + dr wide) and V


def print_cache_table():
    layers, h, dh, dc, dr = DEEPSEEK["DeepSeek-V2"]
    n, n_mha = latent_cache_bytes(layers, dc, dr, CACHE_TOKENS), mha.kv_cache_bytes(layers, h, dh, CACHE_TOKENS)
    print(f"\n2. The cache in bf16, batch 1, {CACHE_TOKENS} tokens (GB = 1e9 bytes). DeepSeek-V2: latent_cache_bytes("
          f"{layers}, {dc}, {dr}, {CACHE_TOKENS})\n   = {n:,} bytes = {n / 1e9:.2f} GB, against {n_mha / 1e9:.1f} GB "
          "for MHA with the same layers, h and dh.\n   MLA careless: every head's K (dh + dr wide) and V rebuilt "
          "from the latent and kept.")
    rows = cache_rows(layers, h, dh, dc, dr)
    widths = [10, 9, 9, 10, 15]                           # one column per kind
    print(f"   {'numbers per token-layer:':<29}" + "".join(f"{f:>{w}}" for (_, _, f), w in zip(rows, widths)))
    print(f"   {'model':<17}{'layers':>7}{'h':>5}" + "".join(f"{k.replace(',', ''):>{w}}" for (k, _, _), w in
                                                           zip(rows, widths)) + f"{'MLA vs MHA':>12}")
    for name, shape in DEEPSEEK.items():
        rows = cache_rows(*shape)
        gbs = [shape[0] * numbers * CACHE_TOKENS * CACHE_BYTES_PER_ELEM / 1e9 for _, numbers, _ in rows]
        cells = "".join(f"{f'{x:.2f} GB':>{w}}" for x, w in zip(gbs, widths))
        print(f"   {name:<17}{shape[0]:>7}{shape[1]:>5}{cells}{rows[0][1] / rows[3][1]:>11.1f}x")
    print(f"   MLA keeps {dc + dr} numbers per token-layer, 2.25 times MQA's {2 * dh}, yet every head has keys and "
          "values of its own.")


# ----------------------------------------------------------------------------- decode time: a roofline
# An absorbed decode step (T = 1) over S cached tokens does q_lat c^T, q_R k_R^T and p c: 2 h S (2 dc + dr)
# FLOPs on S (dc + dr) numbers, h (2 dc + dr) / (2 (dc + dr)) = 121 FLOPs per byte in fp32 at DeepSeek-V2's
# shape (242 in bf16). mha.py's MHA/GQA step does 4 h S dh FLOPs on 2 kv S dh numbers: g / 2 per byte in fp32.
def mla_step_work(S, h, dc, dr):
    """(FLOPs, fp32 bytes) of one absorbed step.  mla_step_work(4096, 128, 512, 64) == (1140850688, 9437184)"""
    return 2 * h * S * (2 * dc + dr), S * (dc + dr) * 4


def gqa_step_work(S, h, kv, dh):
    """(FLOPs, fp32 bytes) of one MHA/GQA step.  gqa_step_work(4096, 128, 8, 128) == (268435456, 33554432)"""
    return 4 * h * S * dh, mha.kv_cache_bytes(1, kv, dh, S, bytes_per_elem=4)


def seconds_of(job):
    """Seconds that job() takes: one measurement, for measure_decode to keep the best of."""
    t0 = time.perf_counter()
    job()
    return time.perf_counter() - t0


@dataclass
class Step:
    """One timed decode step: its best `seconds`, and the best `read_seconds` of reading its n_bytes alone."""
    kind: str
    S: int
    flops: int
    n_bytes: int
    seconds: float = float("inf")
    read_seconds: float = float("inf")

    def floor(self, peak):
        """mha.roofline's (least seconds, 'memory' or 'compute'), at the bandwidth of this step's own bytes."""
        return mha.roofline(self.flops, self.n_bytes, mha.Ceilings(self.n_bytes / self.read_seconds, peak))


def measure_decode(contexts, rounds, seed):
    """[Step] of MLA (latent_attend), MHA and GQA (mha.attend) at DeepSeek-V2's layer shape in fp32, and the
    matmul ceiling in FLOP/s: the faster of a 512- and a 1024-wide square product.

    The bandwidth is measured on each step's own tensors (a 9 MB latent cache and a 537 MB MHA cache are
    not read at the same speed). Each round reads them all, then runs all the steps, longest context first:
    between a read and its step hundreds of MB pass, so both find the bytes out of the CPU's caches, as a
    step of a deep model does after the other layers. Each keeps its best round.
    """
    _, h, dh, dc, dr = DEEPSEEK["DeepSeek-V2"]
    s_max = max(contexts)
    torch.manual_seed(seed)
    c_all, k_rope_all = torch.full((1, s_max, dc), 0.01), torch.full((1, s_max, dr), 0.01)   # as LatentCache
    kv_bufs = {kv: torch.full((2, 1, kv, s_max, dh), 0.01) for kv in (h, GQA_KV_HEADS)}   # K, V: (B, kv, S, dh)
    q_lat, q_rope, q = torch.randn(1, h, 1, dc), torch.randn(1, h, 1, dr), torch.randn(1, h, 1, dh)
    runs = []                                             # (Step, the step, a read of the step's bytes)
    for S in sorted(contexts, reverse=True):
        c, k_rope = c_all[:, :S], k_rope_all[:, :S]       # (B, S, dc), (B, S, dr): views, nothing copied
        runs.append((Step("MLA", S, *mla_step_work(S, h, dc, dr)),
                     lambda c=c, k=k_rope: latent_attend(q_lat, q_rope, c, k, (dh + dr) ** -0.5),
                     lambda c=c, k=k_rope: (c.sum(), k.sum())))
        for kv, buf in kv_bufs.items():
            k, v = buf[:, :, :, :S]                       # (B, kv, S, dh) each: views
            runs.append((Step(mha.attention_kind(h, kv), S, *gqa_step_work(S, h, kv, dh)),
                         lambda k=k, v=v: mha.attend(q, k, v), buf[:, :, :, :S].sum))
    squares = {n: (torch.randn(n, n), torch.randn(n, n)) for n in (512, 1024)}
    best_matmul = dict.fromkeys(squares, float("inf"))
    start = mha.cpu_seconds()                             # to see what other programs ran meanwhile
    with torch.no_grad():
        for _ in range(rounds):
            for n, (a, b) in squares.items():
                best_matmul[n] = min(best_matmul[n], seconds_of(lambda a=a, b=b: a @ b))
            for step, _, read in runs:
                step.read_seconds = min(step.read_seconds, seconds_of(read))
            for step, run, _ in runs:
                step.seconds = min(step.seconds, seconds_of(run))
            for n, (a, b) in squares.items():           # again at the round's end: a busy moment misses one
                best_matmul[n] = min(best_matmul[n], seconds_of(lambda a=a, b=b: a @ b))
    steps = sorted((step for step, _, _ in runs), key=lambda step: step.S)   # stable: MLA, MHA, GQA per context
    return steps, max(2 * n**3 / t for n, t in best_matmul.items()), mha.cores_elsewhere(start)


def timing_contradictions(steps, peak, elsewhere=0.0, slack=0.1):
    """What in the measurements cannot be true of a quiet machine; [] when they hold together: other
    programs keeping more than a quarter of a core busy (`elsewhere` cores, as mha.cores_elsewhere measures
    them), a step more than `slack` under its floor, or faster than itself at a shorter context, or GQA
    slower than MHA (fewer bytes, the same FLOPs)."""
    problems, by_key = [], {(step.kind, step.S): step for step in steps}
    if elsewhere > 0.25:
        problems.append(f"other programs kept {elsewhere:.1f} cores busy")
    for step in steps:
        floor, _ = step.floor(peak)
        if step.seconds < (1 - slack) * floor:
            problems.append(f"{step.kind} at {step.S} tokens is {1 - step.seconds / floor:.0%} below its floor")
        if any(s.kind == step.kind and s.S < step.S and step.seconds < (1 - slack) * s.seconds for s in steps):
            problems.append(f"{step.kind} at {step.S} tokens is faster than at a shorter context")
        mha_step = by_key.get(("MHA", step.S))
        if step.kind.startswith("GQA") and step.seconds > (1 + slack) * mha_step.seconds:
            problems.append(f"{step.kind} is slower than MHA at {step.S} tokens")
    return problems


def time_the_trap(S, seed):
    """Seconds of the MLA step through F.sdpa(enable_gqa=True) with values (dc) narrower than keys (dc + dr):
    the MQA identity taken literally, the path this file does not teach. Timed once: it is slow."""
    _, h, dh, dc, dr = DEEPSEEK["DeepSeek-V2"]
    torch.manual_seed(seed)
    query, key = torch.randn(1, h, 1, dc + dr), torch.randn(1, 1, S, dc + dr)   # (B, h, 1, dc+dr), (B, 1, S, dc+dr)
    with torch.no_grad():
        return seconds_of(lambda: F.scaled_dot_product_attention(query, key, key[..., :dc], scale=(dh + dr) ** -0.5,
                                                                 enable_gqa=True))


def print_decode_table(steps, peak, problems, trap):
    _, h, dh, dc, dr = DEEPSEEK["DeepSeek-V2"]
    print(f"\n3. Decode step: one layer's attention at DeepSeek-V2's shape (h={h}, dh={dh}, dc={dc}, dr={dr}), fp32, "
          f"best of {DECODE_ROUNDS},\n   on {mha.machine_name()}. Ceilings measured in the same rounds: float32 "
          f"matmul {peak / 1e9:.0f} GFLOP/s, and each\n   step's own bytes read at the speed in the table. "
          "floor = max(bytes / read, FLOPs / matmul), in ms:")
    print(f"   {'context':>7}  {'kind':<7}{'FLOP/byte':>10}  {'bound':<8}{'read GB/s':>10}{'floor':>8}"
          f"{'measured':>10}{'reaches':>9}")
    for step in steps:
        floor, bound = step.floor(peak)
        print(f"   {step.S if step.kind == 'MLA' else '':>7}  {step.kind:<7}{step.flops / step.n_bytes:>10.1f}  "
              f"{bound:<8}{step.n_bytes / step.read_seconds / 1e9:>10.1f}{floor * 1e3:>8.3f}"
              f"{step.seconds * 1e3:>10.3f}{floor / step.seconds:>9.0%}")
    first = steps[0]
    print(f"   The same MLA step through F.sdpa(enable_gqa=True), values narrower than keys, at {first.S} tokens: "
          f"{trap * 1e3:.0f} ms,\n   {trap / first.seconds:.0f} times latent_attend's {first.seconds * 1e3:.2f} ms "
          "(timed once). latent_attend reads c and k_R where they lie.")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        print(f"   NOT TRUSTWORTHY, the machine was busy while timing: {problems[0]}{more}")
    else:
        print("   " + decode_lesson(steps, peak))


def decode_lesson(steps, peak):
    """What the measurements at the longest context say, in sentences made from them."""
    last = {step.kind: step for step in steps if step.S == steps[-1].S}
    bound = {kind: step.floor(peak)[1] for kind, step in last.items()}
    mla, mha_step = last["MLA"], last["MHA"]
    gqa = mha.attention_kind(DEEPSEEK["DeepSeek-V2"][1], GQA_KV_HEADS)
    gpu_name, gpu_flops, gpu_bandwidth = mha.GPU
    return (f"Memory-bound here: {', '.join(k for k, b in bound.items() if b == 'memory') or 'none'}; compute-bound: "
            f"{', '.join(k for k, b in bound.items() if b == 'compute') or 'none'}. At {mla.S} tokens: "
            f"{', '.join(f'{k} {s.seconds * 1e3:.1f} ms' for k, s in last.items())}.\n   MLA does "
            f"{mla.flops / mha_step.flops:.2f}x their FLOPs on 1/{mha_step.n_bytes / mla.n_bytes:.0f} of MHA's bytes: "
            f"its time is set by {'arithmetic, not by its cache' if bound['MLA'] == 'compute' else 'its bytes'}.\n"
            f"   In bf16 MLA does {2 * mla.flops / mla.n_bytes:.0f} FLOPs per byte, {gqa} "
            f"{2 * last[gqa].flops / last[gqa].n_bytes:.0f}. An {gpu_name}'s ridge is at "
            f"{gpu_flops / gpu_bandwidth:.0f}:\n   there MLA sits near it, {gqa} far below it, memory-bound.")


# ----------------------------------------------------------------------------- figures
def plot_cache():
    """Cache per token, all layers, of each DeepSeek model for the five ways to keep it (log scale)."""
    fig = mha.new_figure(10, 5)
    ax = fig.subplots()
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.14, top=0.88)
    names = list(DEEPSEEK)
    rows = [cache_rows(*DEEPSEEK[name]) for name in names]
    for j, color in enumerate(mha.COLORS[:len(rows[0])]):
        kb = [DEEPSEEK[name][0] * r[j][1] * CACHE_BYTES_PER_ELEM / 1e3 for name, r in zip(names, rows)]
        bars = ax.bar([i + (j - 2) * 0.16 for i in range(len(names))], kb, 0.16, color=color,
                      label=f"{rows[0][j][0]}: {rows[0][j][2]} per token-layer")
        ax.bar_label(bars, labels=[f"{v:,.0f}" for v in kb], fontsize=7, padding=2)
    ax.set_yscale("log")
    ax.set_ylim(5, 1.2e5)                                  # room above the bars for the legend
    ax.set_yticks([10, 100, 1000, 10000], ["10", "100", "1,000", "10,000"])
    ax.minorticks_off()
    ax.set_xticks(range(len(names)), [f"{n}\n{DEEPSEEK[n][0]} layers, h={DEEPSEEK[n][1]}" for n in names])
    ax.set_ylabel("cache per token, all layers (KB, 1 KB = 1000 bytes)")
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    ax.set_title(f"KV cache per token in bf16: MHA, GQA-{GQA_KV_HEADS}, MQA and MLA at DeepSeek's shapes "
                 "(dh=128, dc=512, dr=64)", fontsize=11)
    return fig


def plot_roofline(steps, peak, problems):
    """The measured steps on this CPU's roofline, drawn with MHA's bandwidth at the longest context."""
    _, h, dh, dc, dr = DEEPSEEK["DeepSeek-V2"]
    fig = mha.new_figure(8, 5.6)
    ax = fig.subplots()
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.1, top=0.84)
    longest = [step for step in steps if step.S == steps[-1].S]
    bandwidth = next(s.n_bytes / s.read_seconds for s in longest if s.kind == "MHA")
    intensity = sorted([2 ** e for e in range(-3, 11)] + [peak / bandwidth])   # 1/8 .. 1024, and the ridge
    ax.plot(intensity, [min(peak, bandwidth * x) / 1e9 for x in intensity], color="black",
            label=f"this CPU: {bandwidth / 1e9:.0f} GB/s (MHA's bytes), {peak / 1e9:.0f} GFLOP/s")
    for step, color in zip(longest, ["tab:blue", "tab:red", "tab:orange"]):
        x = step.flops / step.n_bytes
        ax.plot([x], [step.flops / step.seconds / 1e9], "o", ms=8, color=color,
                label=f"{step.kind}: {x:.1f} FLOPs per byte, {step.seconds * 1e3:.1f} ms")
    gpu_name, gpu_flops, gpu_bandwidth = mha.GPU
    ax.axvline(gpu_flops / gpu_bandwidth, color="gray", ls="--", lw=1,
               label=f"{gpu_name}'s ridge, {gpu_flops / gpu_bandwidth:.0f} FLOPs per byte (bf16)")
    mla_bf16 = 2 * longest[0].flops / longest[0].n_bytes                   # bf16 reads half the bytes
    ax.axvline(mla_bf16, color="tab:blue", ls=":", lw=1, label=f"MLA in bf16: {mla_bf16:.0f} FLOPs per byte")
    mha.log_axes(ax, [0.125, 1, 8, 64, 512], [1, 10, 100, 1000], xlabel=lambda x: f"{x:g}")
    ax.set_xlabel("arithmetic intensity (FLOPs per byte read, fp32)")
    ax.set_ylabel("GFLOP/s")
    ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"One decode step of one layer at {mha.tokens_label(steps[-1].S)} cached tokens, fp32, DeepSeek-V2 "
                 f"shape\n(h={h}, dh={dh}, dc={dc}, dr={dr}) on {mha.machine_name()}", fontsize=10)
    if problems:
        fig.text(0.5, 0.86, f"NOT TRUSTWORTHY: the machine was busy ({problems[0]})", ha="center", color="red",
                 fontsize=9)
    return fig


# ----------------------------------------------------------------------------- main
def main(argv=None):
    args = parse_args(argv)        # a bad flag, knob or --out-dir ends here, in one line (exit code 2)
    print(f"Multi-head latent attention, d={D_MODEL}, h={N_HEADS}, dh={D_HEAD}: caches dc + dr = {D_LATENT} + "
          f"{D_ROPE} = {D_LATENT + D_ROPE} numbers\nper token and layer, where MHA of the same heads caches "
          f"2 h dh = {2 * N_HEADS * D_HEAD}\n")
    ok = run_checks(args.seed)
    print_cache_table()
    steps, peak, elsewhere = measure_decode(tuple(sorted(set(DECODE_CONTEXTS))), DECODE_ROUNDS, args.seed)
    problems = timing_contradictions(steps, peak, elsewhere)
    print_decode_table(steps, peak, problems, time_the_trap(steps[0].S, args.seed))
    pngs = {"mla_cache.png": mha.png_bytes(plot_cache()),
            "mla_roofline.png": mha.png_bytes(plot_roofline(steps, peak, problems))}
    if not mha.write_figures("mla.py", args.out_dir, pngs):
        return 1
    print(f"\nFigures written to {mha.shown_path(args.out_dir)}: {', '.join(FIGURES)}")
    print(f"Now change D_LATENT or D_ROPE and run again. All checks: {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


# ----------------------------------------------------------------------------- plumbing (not the lesson)
# Each helper below exists so that a mistake a user can make ends in one sentence, not a traceback.
def check_sizes(d_model, n_heads, d_head, d_latent, d_rope):
    """The five sizes as ints, or TypeError / ValueError in one sentence naming the value and the rule."""
    sizes = {"d_model": d_model, "n_heads": n_heads, "d_head": d_head, "d_latent": d_latent, "d_rope": d_rope}
    sizes = {name: whole_number(name, value) for name, value in sizes.items()}
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1")
    if sizes["d_rope"] % 2:
        raise ValueError(f"d_rope={sizes['d_rope']} must be even: RoPE turns its dimensions in pairs")
    d, h, dh, dc, dr = sizes.values()
    weights = 4 * (d * (dc + dr + h * dh + h * dr) + 2 * dc * h * dh + h * dh * d)   # float32 bytes
    if weights > mha.memory_bytes():
        raise ValueError(f"these sizes need {weights / 1e9:,.0f} GB of weights, more than this machine's "
                         f"{mha.memory_bytes() / 1e9:.0f} GB of memory")
    return tuple(sizes.values())


def check_call(attn, x, cache, absorbed):
    """(B, T) of a forward call, or one sentence; a refused call writes nothing into the cache."""
    B, T = mha.check_x(x, attn.d_model, attn.w_dkv.weight)
    dtype = attn.w_dkv.weight.dtype
    if not isinstance(absorbed, bool):
        raise TypeError(f"absorbed must be True or False, got {absorbed!r}")
    if cache is None:
        return B, T
    if not isinstance(cache, LatentCache):
        raise TypeError(f"cache must be a LatentCache from new_cache(), got {type(cache).__name__}")
    tensors = [t for t in (cache.c, cache.k_rope) if isinstance(t, torch.Tensor)]
    mha.check_no_autograd([x, *tensors, *attn.parameters()])
    max_len = cache.c.shape[1] if isinstance(cache.c, torch.Tensor) and cache.c.dim() == 3 else "max_len"
    for name, t, width in (("latent c", cache.c, attn.d_latent), ("RoPE key", cache.k_rope, attn.d_rope)):
        want = (B, max_len, width)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or t.dtype != dtype:
            got = f"{tuple(t.shape)} in {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"the cache's {name} is {got}, this call needs {want} in {dtype}")
    mha.cache_writable({"latent c": cache.c, "RoPE key": cache.k_rope}, attn.w_dkv.weight.device)
    cache.length = mha.checked_length(cache.length, cache.c.shape[1], T)
    return B, T


def check_knobs():
    """Raise TypeError or ValueError, in one sentence naming the knob, unless every knob at the top can work."""
    check_sizes(D_MODEL, N_HEADS, D_HEAD, D_LATENT, D_ROPE)
    if not DECODE_CONTEXTS:
        raise ValueError("DECODE_CONTEXTS must hold at least one context length")
    counts = {"SEQ_LEN": SEQ_LEN, "BATCH": BATCH, "CACHE_TOKENS": CACHE_TOKENS, "DECODE_ROUNDS": DECODE_ROUNDS,
              "CACHE_BYTES_PER_ELEM": CACHE_BYTES_PER_ELEM, "GQA_KV_HEADS": GQA_KV_HEADS,
              **{f"DECODE_CONTEXTS[{i}]": S for i, S in enumerate(DECODE_CONTEXTS)}}
    for name, value in counts.items():
        if whole_number(name, value) < (2 if name == "SEQ_LEN" else 1):
            raise ValueError(f"{name}={value} must be at least {2 if name == 'SEQ_LEN' else 1}")
    if "DeepSeek-V2" not in DEEPSEEK:
        raise ValueError("DEEPSEEK must keep the 'DeepSeek-V2' shape: the decode timing uses it")
    real = isinstance(ROPE_BASE, (int, float)) and not isinstance(ROPE_BASE, bool)
    if not (real and math.isfinite(ROPE_BASE) and ROPE_BASE > 1):
        raise ValueError(f"ROPE_BASE={ROPE_BASE!r} must be a finite number above 1 (RoFormer's is 10000)")
    for name, value, most in [("D_MODEL", D_MODEL, 4096), ("SEQ_LEN", SEQ_LEN, 512), ("BATCH", BATCH, 64)]:
        if value > most:
            raise ValueError(f"{name}={value} must be at most {most}: the demo is checked in seconds")
    _, h, dh, dc, dr = DEEPSEEK["DeepSeek-V2"]                # the timed shape: K/V of MHA and GQA, the latent
    needed = max(DECODE_CONTEXTS) * 4 * (2 * (h + GQA_KV_HEADS) * dh + dc + dr)
    if needed > mha.DECODE_MEMORY:
        raise ValueError(f"DECODE_CONTEXTS up to {max(DECODE_CONTEXTS):,} tokens need {needed / 1e9:.1f} GB for the "
                         f"decode timing; at most {mha.DECODE_MEMORY / 1e9:.0f} GB")
    for name, (_, h, dh, dc, dr) in DEEPSEEK.items():
        check_sizes(1, h, dh, dc, dr)
        if h % GQA_KV_HEADS:
            raise ValueError(f"GQA_KV_HEADS={GQA_KV_HEADS} must divide {name}'s {h} heads")


def parse_args(argv=None):
    """The flags, each defaulting to its knob; a bad value or a knob that cannot work exits 2 in one line."""
    parser = mha.Parser(prog="mla.py", description="Multi-head latent attention (DeepSeek-V2): absorption "
                        "proven, the MQA identity, cache tables, decode timing on the roofline, figures.",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out-dir", default=OUT_DIR, help="folder the figures are written to")
    parser.add_argument("--seed", type=int, default=SEED, help="seed for every random number")
    args = parser.parse_args(argv)
    try:
        check_knobs()
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    if not 0 <= args.seed < 2**32:
        parser.error(f"--seed {args.seed} must be between 0 and 2**32 - 1")
    problem = mha.out_dir_problem(args.out_dir, FIGURES)
    if problem:
        parser.error(problem)
    return args


if __name__ == "__main__":
    mha.run_as_script(main)
