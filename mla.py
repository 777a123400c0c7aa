"""
Multi-head latent attention (MLA): DeepSeek's answer to "what comes after GQA for the cache?", in one file.

The chapter after mha.py. What it shows, top to bottom:
  1. LatentAttention: keys and values of every head come from one latent c = x W_DKV (dc numbers per token),
     expanded per head by W_UK and W_UV, plus one RoPE key k_R shared by all heads (RoPE, rope() below: query and
     key each turned by an angle that grows with its position, so that their score sees how far apart they are).
     The cache keeps c and k_R: dc + dr numbers per token and layer, however many heads (DeepSeek-V2: 576,
     against MHA's 32,768).
  2. Weight absorption, proven: the naive path rebuilds every head's K and V from the cache; the absorbed path
     folds W_UK into the queries and applies W_UV after attention, and never builds them. The same function
     (within 1e-12 in float64), and its decode step IS multi-query attention with one K/V head [c; k_R] and
     values c. Why the RoPE key is decoupled: rotate the content keys and absorption breaks.
  3. The cache of DeepSeek-V2, V2-Lite and V3, next to MHA, GQA-8 and MQA of the same shape.
  4. The absorbed decode step's attention (latent_attend; the projections, as for MHA and GQA-8, not timed)
     against MHA's and GQA-8's, each against its floor as mha.py measures it: at 98 FLOPs per byte (fp32,
     1024 tokens, queries and output counted) MLA waits on arithmetic, MHA on memory.

Not here: query compression (DeepSeek-V2 has it, V2-Lite not: it saves activations, not cache); the RMSNorm
on the latent (kv_a_layernorm): it comes before caching and its scale folds into W_UK and W_UV, so absorption
and the cache size are unaffected; a quantized cache (see CACHE_BYTES_PER_ELEM); YaRN's RoPE scaling;
training; GPU kernels.

Run:    python mla.py  (a few seconds on a 2-core CPU), then edit D_LATENT or D_ROPE and run it again.
Papers: DeepSeek-AI 2024, "DeepSeek-V2", arXiv:2405.04434 (section 2.1: MLA); DeepSeek-AI 2024, "DeepSeek-V3
        Technical Report", arXiv:2412.19437; Su et al. 2021, "RoFormer", arXiv:2104.09864.
Shapes: mha.py's (B batch, T new tokens, d model width, h query heads, kv K/V heads, dh head width, S keys a
        query can see), plus dc the latent width and dr the RoPE width.
"""

import argparse
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import mha

# ----------------------------------------------------------------------------- knobs
D_MODEL = 256        # d: model width
N_HEADS = 8          # h: query heads
D_HEAD = 32          # dh: width of each head's content query, key and value
D_LATENT = 128       # dc: width of the latent c, shared by all heads' keys and values (DeepSeek: 4 dh)
D_ROPE = 16          # dr: width of the RoPE query and key; even, since RoPE turns pairs (DeepSeek: dh / 2)
ROPE_BASE = 10000.0  # RoFormer's base: pair i of the RoPE key turns by position * base^(-2i / dr) radians
SEQ_LEN = 12         # T: tokens in the demo sequence
BATCH = 2            # B: sequences in the demo batch
SEED = 0             # every random number in the run comes from this seed

# Published shapes (layers, h, dh, dc, dr): config.json's num_hidden_layers, num_attention_heads,
# qk_nope_head_dim = v_head_dim, kv_lora_rank, qk_rope_head_dim, on Hugging Face (deepseek-ai).
DEEPSEEK = {
    "DeepSeek-V2": (60, 128, 128, 512, 64),       # arXiv:2405.04434 section 3.1.2; DeepSeek-V2 config.json
    "DeepSeek-V2-Lite": (27, 16, 128, 512, 64),   # arXiv:2405.04434 appendix B; DeepSeek-V2-Lite config.json
    "DeepSeek-V3": (61, 128, 128, 512, 64),       # arXiv:2412.19437 section 4.2; DeepSeek-V3 config.json
}
CACHE_TOKENS = 4096                 # context length of the cache table
CACHE_BYTES_PER_ELEM = 2            # 2 = bf16, the table's convention (DeepSeek-V2 quantizes to about 6 bits)
GQA_KV_HEADS = 8                    # the GQA the table and the timing compare with
DECODE_CONTEXTS = (1024, 2048, 4096)   # cached tokens at which a decode step of DeepSeek-V2's shape is timed
DECODE_ROUNDS = 5                   # each time is the best of this many rounds

# ----------------------------------------------------------------------------- the module
def rope(x, positions, base=ROPE_BASE):
    """x with each pair (x[2i], x[2i+1]) of its last dimension turned by position * base^(-2i / dr) radians.

    x: (..., T, dr), positions: (T,). Two turned vectors' dot product depends only on the difference of their
    positions: that is how attention learns where a key lies relative to the query (RoFormer). With R_p the turn
    at position p, (R_t q) . (R_s k) = q . (R_(s-t) k): turning both back by t changes no dot product. E.g. in 2-D,
    q = k = (1, 0) at positions 3 and 5 give cos 2, as they would at 0 and 2.
    rope(torch.tensor([[1.0, 0.0]]), torch.tensor([1])) == [[cos 1, sin 1]] == [[0.5403, 0.8415]]
    """
    dr = x.shape[-1]
    freq = base ** (-torch.arange(0, dr, 2, dtype=torch.float64) / dr)       # (dr/2,)
    angle = positions.to(torch.float64)[:, None] * freq                      # (T, dr/2): pair i at each position
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x0, x1 = x.unflatten(-1, (dr // 2, 2)).unbind(-1)                        # (..., T, dr) -> 2 x (..., T, dr/2)
    turned = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)  # (..., T, dr/2, 2)
    return turned.flatten(-2)                                                # (..., T, dr)


def latent_attend(q_lat, q_rope, c, k_rope, scale):
    """softmax((q_lat c^T + q_R k_R^T) * scale + causal mask) c: every head reads the one latent, as in MQA.

    q_lat: (B, h, T, dc), queries with W_UK folded in; q_rope: (B, h, T, dr); c: (B, S, dc); k_rope: (B, S, dr).
    Returns (B, h, T, dc). As mha.attend does for a K/V head, the h heads are stacked as h*T rows of one shared
    "head" (row r is head r // T at token r % T: with T = 3, row 7 is head 2's token 1), so c and k_R are read
    once, where they lie in the cache; a decode step (T = 1) is h rows of one query each.
    """
    (B, h, T, dc), S = q_lat.shape, c.shape[1]
    q_lat = q_lat.reshape(B, h * T, dc)                    # (B, h*T, dc)
    q_rope = q_rope.reshape(B, h * T, -1)                  # (B, h*T, dr)
    scores = (q_lat @ c.transpose(1, 2) + q_rope @ k_rope.transpose(1, 2)) * scale   # (B, h*T, S)
    if T > 1:                                              # the mask, per head; a decode step (T = 1) needs none
        scores = scores + mha.causal_mask(T, S, scores.dtype).tile(h, 1)     # (h*T, S)
    return (scores.softmax(dim=-1) @ c).view(B, h, T, dc)  # (B, h*T, dc) -> (B, h, T, dc)


@dataclass
class LatentCache:
    """What MLA keeps of every past token, nothing per head: c (B, max_len, dc) and k_rope (B, max_len, dr),
    of which the first `length` positions hold tokens."""
    c: torch.Tensor
    k_rope: torch.Tensor
    length: int = 0

    nbytes = property(lambda self: self.c.nbytes + self.k_rope.nbytes)

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
    side, once per query instead of once per cached token. Rotating k_C would put the turn R_s of key s between
    them: q_C,i . (R_s W_UK,i c_s) = (W_UK,i^T R_s^T q_C,i) . c_s, and W_UK,i^T R_s^T changes with every key s: no
    one absorbed query serves them all (rope() shows what R_s is).
    So the position travels in dr extra dimensions of its own, and c stays free of it.
    """

    def __init__(self, d_model, n_heads, d_head, d_latent, d_rope):
        super().__init__()
        check_sizes(d_model, n_heads, d_head, d_latent, d_rope)   # one sentence if they cannot work (plumbing)
        d, h, dh, dc, dr = d_model, n_heads, d_head, d_latent, d_rope
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
        check_call(self, x, cache)                          # one sentence on a bad call, before any write
        B, T, _ = x.shape
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
        """q (B, h, T, dh), q_R (B, h, T, dr), c (B, T, dc), k_R (B, T, dr) of x at positions start, start + 1, ..."""
        B, T, _ = x.shape
        h, dh, dr = self.n_heads, self.d_head, self.d_rope
        positions = torch.arange(start, start + T)
        q = self.w_q(x).view(B, T, h, dh).transpose(1, 2)                      # (B, T, h, dh) -> (B, h, T, dh)
        q_rope = rope(self.w_qr(x).view(B, T, h, dr).transpose(1, 2), positions)  # (B, T, h, dr) -> (B, h, T, dr)
        return q, q_rope, self.w_dkv(x), rope(self.w_kr(x), positions)

    def naive_attention(self, q, q_rope, c, k_rope):
        """softmax((q_C k_C^T + q_R k_R^T) / sqrt(dh + dr) + mask) v, every head's k_C and v rebuilt from c."""
        (B, h, T, dh), S = q.shape, c.shape[1]
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
    # The paper says W_UK "can be absorbed into" W_Q and W_UV into W_O: multiplied ahead of time. Applied on the
    # fly, as here and in DeepSeek's inference code, they stay small: at DeepSeek-V2-Lite's shape (d = 2048, h = 16,
    # no query compression) W_Q W_UK holds h d dc = 16.8M numbers per layer, the two 5.2M (V2: 101M against 34M).

    def new_cache(self, batch, max_len):
        """An empty LatentCache for `batch` sequences of up to `max_len` tokens, in the weights' dtype and device."""
        mha.check_counts([("batch", batch, 1), ("max_len", max_len, 1)])   # (B, max_len, dc), (B, max_len, dr)
        w = self.w_dkv.weight
        return LatentCache(*(torch.zeros(batch, max_len, width, dtype=w.dtype, device=w.device)
                             for width in (self.d_latent, self.d_rope)))


# ----------------------------------------------------------------------------- the checks
def demo_module(seed, dtype=torch.float32):
    """The knobs' LatentAttention and a (BATCH, SEQ_LEN, D_MODEL) input, both from seed."""
    torch.manual_seed(seed)
    return (LatentAttention(D_MODEL, N_HEADS, D_HEAD, D_LATENT, D_ROPE).to(dtype).eval(),
            torch.randn(BATCH, SEQ_LEN, D_MODEL, dtype=dtype))


def absorbed_vs_naive(attn, x):
    """max |absorbed - naive| / max |naive| over one full forward."""
    with torch.no_grad():
        return mha.relative_diff(attn(x, absorbed=True), attn(x))


def cached_vs_full(attn, x, absorbed, chunks):
    """Feed x in `chunks`, (start, end) pairs (T > 1 after cached tokens uses the mask's offset), as mha.check_cache
    does; relative difference to one full forward."""
    cache = attn.new_cache(x.shape[0], x.shape[1])
    with torch.no_grad():
        steps = [attn(x[:, start:end], cache=cache, absorbed=absorbed) for start, end in chunks]
        return mha.relative_diff(torch.cat(steps, dim=1), attn(x, absorbed=absorbed))


def mqa_identity_gap(attn, x):
    """The absorbed decode step of x's last token against PyTorch's multi-query attention, one K/V head:
    keys [c; k_R] (dc + dr wide), values c (dc wide), queries [W_UK,i^T q_C,i; q_R,i], scale 1/sqrt(dh + dr).
    A check, not the way to run it: with values narrower than keys SDPA on CPU falls back to its math kernel, which
    repeat_interleaves K and V out to all h heads (570 MB at DeepSeek-V2's shape and 1024 tokens; lab notes)."""
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
    first, (W_UK,i^T RoPE_t(q_C,i)) . c_s: the turn of key s is lost. Relative difference of the scores."""
    (B, T, _), positions = x.shape, torch.arange(x.shape[1])
    with torch.no_grad():
        q, _, c, _ = attn.project(x, 0)
        k = attn.w_uk(c).view(B, T, attn.n_heads, attn.d_head).transpose(1, 2)   # (B, T, h*dh) -> (B, h, T, dh)
        true = rope(q, positions) @ rope(k, positions).transpose(2, 3)       # (B, h, T, T)
        absorbed = attn.absorb_query(rope(q, positions)) @ c.unsqueeze(1).transpose(2, 3)  # (B, h, T, T)
    return mha.relative_diff(absorbed, true)


def run_checks(seed):
    """The evidence that absorption is right, and that it needs the decoupled RoPE. True if all pass."""
    print(f"1. Checks (B={BATCH}, T={SEQ_LEN}, d={D_MODEL}, h={N_HEADS}, dh={D_HEAD}, dc={D_LATENT}, dr={D_ROPE})")
    (attn64, x64), (attn32, x32) = demo_module(seed, torch.float64), demo_module(seed)
    ok = mha.report("float64: max |absorbed - naive| / max |naive|", absorbed_vs_naive(attn64, x64), 1e-12)
    ok &= mha.report("float32: the same, exact in algebra but not rounding", absorbed_vs_naive(attn32, x32), 1e-5)
    ok &= mha.report("decode step vs MQA: key [c; k_R], value c (float64)", mqa_identity_gap(attn64, x64), 1e-12)
    chunks = mha.prompt_chunks(SEQ_LEN)                    # as mha.check_cache feeds them: SEQ_LEN = 12: 0:6, 6:8, ...
    sizes = [end - start for start, end in chunks]         # SEQ_LEN = 12: 6, 2, 1, 1, 1, 1
    print(f"  cached, float32: chunks of {sizes} tokens, against one full forward")
    for absorbed in (False, True):
        label = f"  {'absorbed' if absorbed else 'naive':<9} max |cached - full| / max |full|"
        ok &= mha.report(label, cached_vs_full(attn32, x32, absorbed, chunks), 1e-5)
    n, want = attn32.new_cache(1, 512).nbytes, latent_cache_bytes(1, D_LATENT, D_ROPE, 512, bytes_per_elem=4)
    print(f"  512-token cache: {n:,} bytes allocated, {want:,} by the formula (dc + dr) x 512 x 4  "
          f"{'OK' if n == want else 'FAIL'}")
    broken = rope_before_absorption_gap(attn64, x64)
    print(f"  {'on purpose: RoPE on the content keys, then absorbed':<52} = {broken:.2e}  "
          f"{'DETECTED, as it must be' if broken > 1e-3 else 'NOT DETECTED'}  (must exceed 1e-03)")
    return ok and n == want and broken > 1e-3


# ----------------------------------------------------------------------------- the cache, in bytes
def latent_cache_bytes(n_layers, d_latent, d_rope, seq_len, batch=1, bytes_per_elem=2):
    """Bytes of an MLA cache: layers x (dc + dr) x tokens x batch x bytes per number.
    latent_cache_bytes(60, 512, 64, 4096) == 283115520   (DeepSeek-V2, bf16, 4k tokens: 0.28 GB)"""
    return n_layers * (d_latent + d_rope) * seq_len * batch * bytes_per_elem


def cache_rows(layers, h, dh, dc, dr):
    """[(kind, numbers per token per layer, formula)] for one model's shape, the four kinds and the careless MLA."""
    return [("MHA", 2 * h * dh, "2 h dh"), (mha.attention_kind(h, GQA_KV_HEADS), 2 * GQA_KV_HEADS * dh,
            f"2 {GQA_KV_HEADS} dh"), ("MQA", 2 * dh, "2 dh"), ("MLA", dc + dr, "dc + dr"),
            ("MLA, careless", h * (2 * dh + dr), "h (2 dh + dr)")]   # every head's K (dh + dr wide) and V


# ----------------------------------------------------------------------------- decode time: a roofline
# An absorbed decode step (T = 1) over S cached tokens does q_lat c^T, q_R k_R^T and p c: 2 h S (2 dc + dr) FLOPs.
# It reads S (dc + dr) cached numbers and h (dc + dr) of queries, and writes h dc of output: at DeepSeek-V2's shape
# the queries and output are a fifth of the bytes at 1024 tokens, so they are counted (97.8 FLOPs per byte in fp32,
# 114 at 4096 tokens; 121 for the cache alone). mha.attend's step: 4 h S dh FLOPs on 2 kv S dh numbers, and 2 h dh.
def mla_step_work(S, h, dc, dr):
    """(FLOPs, fp32 bytes moved, of them cached).  mla_step_work(1024, 128, 512, 64) == (285212672, 2916352, 2359296)"""
    return 2 * h * S * (2 * dc + dr), 4 * (S + h) * (dc + dr) + 4 * h * dc, 4 * S * (dc + dr)


def gqa_step_work(S, h, kv, dh):
    """The same for mha.attend.  gqa_step_work(4096, 128, 8, 128) == (268435456, 33685504, 33554432)"""
    return mha.decode_flops(h, dh, S), mha.decode_bytes(kv, dh, S) + 8 * h * dh, mha.decode_bytes(kv, dh, S)


@dataclass
class Step:                        # one decode step: its work, and the best seconds of it and of a read of its cache
    kind: str
    S: int
    flops: int
    n_bytes: int                   # moved: the cache, the queries, the output
    cache_bytes: int               # of them, the cache: what the read is timed on
    seconds: float = math.inf
    read_seconds: float = math.inf

    def floor(self, matmul_flops):              # mha.roofline, the bytes moving as fast as its cache was read
        return mha.roofline(self.flops, self.n_bytes, mha.Ceilings(self.cache_bytes / self.read_seconds, matmul_flops))


# ----------------------------------------------------------------------------- main
# What main() calls that is not above (the cache table, the timing, the plumbing) comes after it.
def main(argv=None):
    args = parse_args(argv)        # a bad flag or knob ends here, in one line (exit code 2)
    print(f"Multi-head latent attention, d={D_MODEL}, h={N_HEADS}, dh={D_HEAD}: caches dc + dr = {D_LATENT} + "
          f"{D_ROPE} = {D_LATENT + D_ROPE} numbers\nper token and layer, where MHA of the same heads caches "
          f"2 h dh = {2 * N_HEADS * D_HEAD}\n")
    ok = run_checks(args.seed)
    print_cache_table()
    steps, flops, elsewhere = measure_decode(DECODE_CONTEXTS, DECODE_ROUNDS, args.seed)
    problems = timing_contradictions(steps, flops, elsewhere)
    print_decode_table(steps, flops, problems)
    print(f"\nNow change D_LATENT or D_ROPE and run again. All checks: {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


# ----------------------------------------------------------------------------- the cache table, the decode timing
def print_cache_table():
    """Section 2: the cache of DeepSeek's models under each kind of attention, and what MLA keeps."""
    layers, h, dh, dc, dr = DEEPSEEK["DeepSeek-V2"]
    n = latent_cache_bytes(layers, dc, dr, CACHE_TOKENS, bytes_per_elem=CACHE_BYTES_PER_ELEM)
    n_mha = mha.kv_cache_bytes(layers, h, dh, CACHE_TOKENS, bytes_per_elem=CACHE_BYTES_PER_ELEM)
    print(f"\n2. The cache, batch 1, {CACHE_TOKENS} tokens, {CACHE_BYTES_PER_ELEM} bytes per number (2 = bf16, a "
          "convention: DeepSeek-V2 quantizes\n   its own to about 6 bits). GB = 1e9 bytes. DeepSeek-V2: "
          f"latent_cache_bytes({layers}, {dc}, {dr}, {CACHE_TOKENS})\n   = {n:,} bytes = {n / 1e9:.2f} GB, against "
          f"{n_mha / 1e9:.1f} GB for MHA of the same layers, h and dh.\n   MLA careless: every head's K (dh + dr "
          "wide) and V rebuilt from the latent and kept.")
    rows, widths = cache_rows(layers, h, dh, dc, dr), [10, 9, 9, 10, 15]    # one column per kind
    print(f"   {'numbers per token-layer:':<29}" + "".join(f"{f:>{w}}" for (_, _, f), w in zip(rows, widths)))
    print(f"   {'model':<17}{'layers':>7}{'h':>5}" + "".join(f"{k.replace(',', ''):>{w}}" for (k, _, _), w in
                                                           zip(rows, widths)) + f"{'MLA vs MHA':>12}")
    for name, shape in DEEPSEEK.items():
        rows = cache_rows(*shape)
        gbs = [shape[0] * numbers * CACHE_TOKENS * CACHE_BYTES_PER_ELEM / 1e9 for _, numbers, _ in rows]
        cells = "".join(f"{f'{x:.2f} GB':>{w}}" for x, w in zip(gbs, widths))
        print(f"   {name:<17}{shape[0]:>7}{shape[1]:>5}{cells}{rows[0][1] / rows[3][1]:>11.1f}x")
    print(f"   MLA keeps {dc + dr} numbers per token-layer, {(dc + dr) / (2 * dh):g} times MQA's {2 * dh}, yet every "
          "head has keys and values of its own.")


def measure_decode(contexts, rounds, seed):
    """([Step] by context, the matmul's FLOP/s, the cores other programs kept busy): MLA (latent_attend), MHA and
    GQA (mha.attend) at DeepSeek-V2's shape in fp32, in rounds ordered as mha.measure_decode's, best of them."""
    _, h, dh, dc, dr = DEEPSEEK["DeepSeek-V2"]
    s_max, scale = max(contexts), (dh + dr) ** -0.5
    torch.manual_seed(seed)
    q_lat, q_rope, q = torch.randn(1, h, 1, dc), torch.randn(1, h, 1, dr), torch.randn(1, h, 1, dh)
    c, k_rope = torch.full((1, s_max, dc), 0.01), torch.full((1, s_max, dr), 0.01)     # as in a LatentCache
    pairs = {kv: torch.full((2, 1, kv, s_max, dh), 0.01) for kv in (h, GQA_KV_HEADS)}  # K, V: (B, kv, max_len, dh)
    by_context = []                                        # per context: [(Step, the step and its arguments, its cache)]
    for S in sorted(set(contexts), reverse=True):
        cache = (c[:, :S], k_rope[:, :S])                  # (B, S, dc), (B, S, dr): views, nothing copied
        runs = [(Step("MLA", S, *mla_step_work(S, h, dc, dr)), (latent_attend, q_lat, q_rope, *cache, scale), cache)]
        for kv, pair in pairs.items():
            runs.append((Step(mha.attention_kind(h, kv), S, *gqa_step_work(S, h, kv, dh)),
                         (mha.attend, q, *pair[:, :, :, :S]), (pair[:, :, :, :S],)))   # K, V: (B, kv, S, dh)
        by_context.append(runs)
    a, matmul = torch.randn(mha.MATMUL_N, mha.MATMUL_N), math.inf
    mha.keep_freed_memory()                                # as mha.py does: no page faults timed
    start = mha.cpu_seconds()
    with torch.no_grad():
        for _ in range(rounds):
            t0 = time.perf_counter()
            a @ a
            matmul = min(matmul, time.perf_counter() - t0)
            for runs in by_context:                        # a context's every read, then every step, as in mha.py
                for step, _, cache in runs:
                    t0 = time.perf_counter()
                    [t.sum() for t in cache]               # every number of its cache read once
                    step.read_seconds = min(step.read_seconds, time.perf_counter() - t0)
                for step, (fn, *args), _ in runs:
                    t0 = time.perf_counter()
                    fn(*args)
                    step.seconds = min(step.seconds, time.perf_counter() - t0)
    steps = sorted((step for runs in by_context for step, _, _ in runs), key=lambda step: step.S)   # MLA, MHA, GQA
    return steps, 2 * mha.MATMUL_N**3 / matmul, mha.cores_elsewhere(start)


def timing_contradictions(steps, matmul_flops, elsewhere=0.0, slack=0.1):
    """[] or what cannot be true of a quiet machine: others busy, a step under its floor, GQA slower than MHA."""
    problems = [f"other programs kept {elsewhere:.1f} cores busy"] if elsewhere > 0.25 else []
    mha_at = {step.S: step.seconds for step in steps if step.kind == "MHA"}
    for step in steps:
        floor = step.floor(matmul_flops)[0]
        if step.seconds < (1 - slack) * floor:
            problems.append(f"{step.kind} at {step.S} tokens is {1 - step.seconds / floor:.0%} below its floor")
        if step.kind.startswith("GQA") and step.S >= 1024 and step.seconds > (1 + slack) * mha_at[step.S]:
            problems.append(f"{step.kind} is slower than MHA at {step.S} tokens")
    return problems


def print_decode_table(steps, matmul_flops, problems):
    """Section 3: each step against its floor, then what they say, or NOT TRUSTWORTHY on a busy machine."""
    _, h, dh, dc, dr = DEEPSEEK["DeepSeek-V2"]
    print(f"\n3. Decode step: one layer's attention at DeepSeek-V2's shape (h={h}, dh={dh}, dc={dc}, dr={dr}), fp32,\n"
          f"   best of {DECODE_ROUNDS} rounds on {mha.machine_name()}. Ceilings measured in the same rounds: a "
          f"{mha.MATMUL_N}x{mha.MATMUL_N}\n   matmul at {matmul_flops / 1e9:.0f} GFLOP/s, and a read (a sum) of each "
          "step's own cache. floor = max(bytes / read\n   rate, FLOPs / matmul rate), bytes of its cache, queries and "
          "output:")
    print(f"   {'context':>7}  {'kind':<7}{'FLOP/byte':>10}{'read GB/s':>11}  {'bound':<8}{'floor ms':>9}"
          f"{'measured':>10}{'reaches':>9}{'vs MHA':>8}")
    mha_at = {step.S: step.seconds for step in steps if step.kind == "MHA"}
    for step in steps:
        floor, bound = step.floor(matmul_flops)
        print(f"   {step.S if step.kind == 'MLA' else '':>7}  {step.kind:<7}{step.flops / step.n_bytes:>10.1f}"
              f"{step.cache_bytes / step.read_seconds / 1e9:>11.1f}  {bound:<8}{floor * 1e3:>9.3f}"
              f"{step.seconds * 1e3:>10.3f}{floor / step.seconds:>9.0%}{mha_at[step.S] / step.seconds:>7.1f}x")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        print(f"   NOT TRUSTWORTHY, the machine was busy while timing: {problems[0]}{more}")
        return
    last = {step.kind: step for step in steps if step.S == steps[-1].S}
    mla, mha_step, gqa = last["MLA"], last["MHA"], last[mha.attention_kind(h, GQA_KV_HEADS)]
    gpu_name, gpu_flops, gpu_bandwidth = mha.GPU
    ridge, mla_bf16 = gpu_flops / gpu_bandwidth, 2 * mla.flops / mla.n_bytes      # FLOPs per byte
    print(f"   At {mla.S} tokens MLA does {mla.flops / mha_step.flops:.2f}x MHA's FLOPs on 1/"
          f"{mha_step.n_bytes / mla.n_bytes:.0f} of its bytes and is {mha_step.seconds / mla.seconds:.1f}x faster "
          f"({mla.floor(matmul_flops)[1]}-bound,\n   MHA {mha_step.floor(matmul_flops)[1]}-bound). In bf16 (half the "
          f"bytes) MLA does {mla_bf16:.0f} FLOPs per byte, {gqa.kind} {2 * gqa.flops / gqa.n_bytes:.0f}: an "
          f"{gpu_name}'s\n   ridge is at {ridge:.0f}: MLA's step lies {'below' if mla_bf16 < ridge else 'above'} it, "
          f"at {mla_bf16 / ridge:.2f}x the ridge, and {gqa.kind}'s far below it, waiting on memory.")


# ----------------------------------------------------------------------------- plumbing: bad input in one sentence
# As in mha.py: one sentence, before anything is computed, for what a learner can get wrong; PyTorch's for the rest.
def check_sizes(d_model, n_heads, d_head, d_latent, d_rope):
    """LatentAttention's sizes: whole numbers from 1, d_rope even."""
    mha.check_counts([("d_model", d_model, 1), ("n_heads", n_heads, 1), ("d_head", d_head, 1),
                      ("d_latent", d_latent, 1), ("d_rope", d_rope, 1)])
    if d_rope % 2:
        raise ValueError(f"d_rope={d_rope} must be even: RoPE turns its dimensions in pairs")


def check_call(attn, x, cache):
    """A call attn(x, cache) that can work. A refused call leaves the cache as it was."""
    mha.check_x(x, attn.d_model, attn.w_dkv.weight)
    if cache is None:
        return
    if not isinstance(cache, LatentCache):
        raise TypeError(f"cache must be a LatentCache, as new_cache() makes, got {type(cache).__name__}")
    mha.check_no_autograd([x, *attn.parameters()])
    B, max_len = x.shape[0], cache.c.shape[1]
    mha.check_cache_fits(x, {"latent c": (cache.c, (B, max_len, attn.d_latent)),
                             "RoPE key": (cache.k_rope, (B, max_len, attn.d_rope))}, cache.length, max_len)


def parse_args(argv=None):
    """The flag, defaulting to its knob; a bad flag or a knob that cannot work exits 2 in one line."""
    parser = mha.Parser(prog="mla.py", description="Multi-head latent attention (DeepSeek-V2): absorption proven, "
                        "the MQA identity, the cache of DeepSeek's models, a decode step on the roofline.",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--seed", type=int, default=SEED, help="seed for every random number")
    args = parser.parse_args(argv)
    counts = [("SEQ_LEN", SEQ_LEN, 2), ("BATCH", BATCH, 1), ("CACHE_TOKENS", CACHE_TOKENS, 1),   # SEQ_LEN: a prompt
              ("CACHE_BYTES_PER_ELEM", CACHE_BYTES_PER_ELEM, 1), ("GQA_KV_HEADS", GQA_KV_HEADS, 1),  # and a token more
              ("DECODE_ROUNDS", DECODE_ROUNDS, 1), *((f"DECODE_CONTEXTS[{i}]", S, 1) for i, S in
                                                      enumerate(DECODE_CONTEXTS))]
    try:
        check_sizes(D_MODEL, N_HEADS, D_HEAD, D_LATENT, D_ROPE)
        mha.check_counts(counts)
        if any(h % GQA_KV_HEADS for _, h, _, _, _ in DEEPSEEK.values()):
            raise ValueError(f"GQA_KV_HEADS={GQA_KV_HEADS} must divide the heads of every model in DEEPSEEK")
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    if not DECODE_CONTEXTS:
        parser.error("DECODE_CONTEXTS must hold at least one context length")
    if not 0 <= args.seed < 2**32:
        parser.error(f"--seed {args.seed} must be between 0 and 2**32 - 1")
    return args


if __name__ == "__main__":
    mha.run_as_script(main)
