"""
Multi-head latent attention (MLA): DeepSeek's answer to "what comes after GQA for the cache?".

The chapter after mha.py. What it shows, top to bottom:
  1. LatentAttention: the keys and values of all heads are made from one latent c = W_DKV x, dc
     numbers per token: head i's content key is W_UK,i c, its value W_UV,i c, so all of them lie in
     the same dc-dimensional space. Position comes in through one RoPE key k_R, shared by all heads
     (RoPE, rope() below: query and key each turned by an angle that grows with its position, so
     that their score sees how far apart they are). The cache keeps [c; k_R]: dc + dr numbers per
     token and layer, however many heads (DeepSeek-V2: 576, against MHA's 32,768).
  2. Weight absorption: the naive path rebuilds every head's K and V from the cache, as MHA with
     keys [k_C,i; k_R]; the absorbed path folds W_UK into the queries and applies W_UV after
     attention, and never builds them. The algebra in LatentAttention's docstring says both compute
     the same function; the float64 check confirms it to 1e-12. The absorbed path IS multi-query
     attention: all h query heads read one K/V head, key [c; k_R] and value c, as mha.attend_grouped
     reads a group's (checked against PyTorch's own MQA call). Why the RoPE key is decoupled: a
     counter-example turns the content keys, as Llama does, and shows that absorption then drops
     each key's turn, which changes the scores.
  3. The cache of DeepSeek-V2, V2-Lite and V3, next to MHA, GQA-8 and MQA of the same shape, and a
     figure of it per token and layer (figures/mla_cache.png).

Not here: query compression (DeepSeek-V2 has it, V2-Lite not: it saves activations, not cache); the
RMSNorm on the latent (kv_a_layernorm): it comes before caching and its scale folds into W_UK and
W_UV, so absorption and the cache size are unaffected; a quantized cache (see CACHE_BYTES_PER_ELEM);
YaRN's RoPE scaling; training; GPU kernels; timing (decode.py times a decode step).

Run:    python mla.py [--out-dir DIR]  (a few seconds on a 2-core CPU),
        then edit D_LATENT or D_ROPE and rerun.
Papers: DeepSeek-AI 2024, "DeepSeek-V2", arXiv:2405.04434 (section 2.1: MLA);
        DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", arXiv:2412.19437;
        Su et al. 2021, "RoFormer", arXiv:2104.09864.
Shapes: mha.py's (B batch, T new tokens, S keys a query can see, d model width, h query heads,
        dh head width), plus dc the latent width and dr the RoPE width.
"""

import argparse
import numbers
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import mha

# ------------------------------------------------------------------ knobs
D_MODEL = 256        # d: model width
N_HEADS = 8          # h: query heads
D_HEAD = 32          # dh: width of each head's content query, key and value
D_LATENT = 128       # dc: latent width; every head's keys and values come from it (DeepSeek: 4 dh)
D_ROPE = 16          # dr: RoPE query and key width; even, as RoPE turns pairs (DeepSeek: dh / 2)
ROPE_BASE = 10000.0  # RoFormer's base: pair i turns by position * base^(-2i / dr) radians
SEQ_LEN = 12         # T: tokens in the demo sequence, at least 2 (a prompt and a token more)
BATCH = 2            # B: sequences in the demo batch
SEED = 0             # every random number in the run comes from this seed
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "figures")

# Published shapes (layers, h, dh, dc, dr): config.json's num_hidden_layers, num_attention_heads,
# qk_nope_head_dim = v_head_dim, kv_lora_rank, qk_rope_head_dim, on Hugging Face (deepseek-ai),
# and in the papers:
DEEPSEEK = {
    "DeepSeek-V2": (60, 128, 128, 512, 64),       # arXiv:2405.04434 section 3.1.2
    "DeepSeek-V2-Lite": (27, 16, 128, 512, 64),   # arXiv:2405.04434 appendix B
    "DeepSeek-V3": (61, 128, 128, 512, 64),       # arXiv:2412.19437 section 4.2
}
CACHE_TOKENS = 4096                 # context length of the cache table
CACHE_BYTES_PER_ELEM = 2            # 2 = bf16, a convention (DeepSeek-V2 quantizes to ~6 bits)
GQA_KV_HEADS = 8                    # the GQA the table compares with; must divide every model's h


# ------------------------------------------------------------------ the module
def rope(x, positions, base=ROPE_BASE):
    """x with each pair (x[2i], x[2i+1]) turned by its position * base^(-2i / dr) radians.

    x: (..., T, dr), positions: (T,). Two turned vectors' dot product depends only on the difference
    of their positions: that is how attention learns where a key lies relative to the query
    (RoFormer). With R_p the turn at position p, (R_t q) . (R_s k) = q . (R_(s-t) k): turning both
    back by t changes no dot product. E.g. in 2-D, q = k = (1, 0) at positions 3 and 5 give cos 2,
    as they would at 0 and 2.
    Pair 0 turns by 1 radian per position; with dr = 4, pair 1 by 10000^(-2/4) = 0.01:
    rope(torch.tensor([[1.0, 0.0, 1.0, 0.0]]), torch.tensor([1]))
        == [[cos 1, sin 1, cos 0.01, sin 0.01]]
    """
    dr = x.shape[-1]
    freq = base ** (-torch.arange(0, dr, 2, dtype=torch.float64) / dr)       # (dr/2,)
    angle = positions.to(torch.float64)[:, None] * freq                      # (T, dr/2)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    # (..., T, dr) -> (..., T, dr/2, 2) -> x0, x1: the first and second numbers of every pair
    x0, x1 = x.unflatten(-1, (dr // 2, 2)).unbind(-1)                        # 2 x (..., T, dr/2)
    turned = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)  # (..., T, dr/2, 2)
    return turned.flatten(-2)                                                # (..., T, dr)


def latent_attend(query, kv, d_latent, scale):
    """softmax(query [c; k_R]^T * scale + causal mask) c: mha.attend_grouped's form with g = h.

    query: (B, h, T, dc + dr); kv: (B, S, dc + dr), rows [c; k_R], read once by all h heads.
    Returns (B, h, T, dc). Not mha.attend_grouped itself: it wants values as wide as keys and
    divides by sqrt(key width), where the value c is the key's first dc numbers and MLA's scale is
    1 / sqrt(dh + dr). einsum's letters as there: b batch, h query head, t new token, s key,
    e width; "bhte,bse->bhts" is q k^T, with kv[b] used by every head.
    """
    T, S = query.shape[2], kv.shape[1]
    # A score is q_lat . c + q_R . k_R; an output, a weighted sum of latents c.
    scores = torch.einsum("bhte,bse->bhts", query * scale, kv)        # (B, h, T, S)
    p = (scores + mha.causal_mask(T, S, query.dtype)).softmax(dim=-1)  # (B, h, T, S)
    return torch.einsum("bhts,bse->bhte", p, kv[..., :d_latent])       # (B, h, T, dc)


@dataclass
class LatentCache:
    """What MLA keeps of every past token, nothing per head: kv (B, max_len, dc + dr), row t
    holding token t's [c_t; k_R,t], the latent and the turned RoPE key. Only the first `length`
    rows hold tokens."""
    kv: torch.Tensor
    length: int = 0

    def append(self, kv):
        """Write kv: (B, T, dc + dr) after the cached tokens; return them all: (B, S, dc + dr)."""
        S = self.length + kv.shape[1]
        self.kv[:, self.length:S] = kv
        self.length = S
        return self.kv[:, :S]


class LatentAttention(nn.Module):
    """Causal, bias-free multi-head latent attention, as in DeepSeek-V2 without query compression.

    Head i's score for key s:  (q_C,i . k_C,i,s + q_R,i . k_R,s) / sqrt(dh + dr),  where
        c = W_DKV x (dc),   k_C,i = W_UK,i c,   v_i = W_UV,i c   (dh each),
        k_R = RoPE(W_KR x)  (dr, one for all heads),
        q_C,i from W_Q x (dh),   q_R,i = RoPE(W_QR x) (dr).
    Absorption: q_C,i . k_C,i,s = q_C,i . (W_UK,i c_s) = (W_UK,i^T q_C,i) . c_s, so W_UK,i moves to
    the query side, applied once per query instead of once per cached token; and
        sum_s p_s (W_UV,i c_s) = W_UV,i (sum_s p_s c_s),
    so W_UV,i is applied once to the weighted sum of latents. Neither changes the function, only
    the rounding.
    Why the RoPE key is decoupled: rotating k_C would put the turn R_s of key s between them,
        q_C,i . (R_s W_UK,i c_s) = (W_UK,i^T R_s^T q_C,i) . c_s,
    and W_UK,i^T R_s^T changes with every key s: no one absorbed query serves them all. So the
    position travels in dr extra dimensions of its own, and c stays free of it.
    """

    def __init__(self, d_model, n_heads, d_head, d_latent, d_rope):
        super().__init__()
        check_sizes(d_model=d_model, n_heads=n_heads, d_head=d_head, d_latent=d_latent,
                    d_rope=d_rope)
        d, h, dh, dc, dr = d_model, n_heads, d_head, d_latent, d_rope
        self.d_model, self.n_heads, self.d_head, self.d_latent, self.d_rope = d, h, dh, dc, dr
        self.w_dkv = nn.Linear(d, dc, bias=False)          # down to the latent: the cache
        self.w_uk = nn.Linear(dc, h * dh, bias=False)      # up to every head's content key
        self.w_uv = nn.Linear(dc, h * dh, bias=False)      # up to every head's value
        self.w_kr = nn.Linear(d, dr, bias=False)           # the one RoPE key
        self.w_q = nn.Linear(d, h * dh, bias=False)        # content queries
        self.w_qr = nn.Linear(d, h * dr, bias=False)       # RoPE queries
        self.w_o = nn.Linear(h * dh, d, bias=False)

    def forward(self, x, cache=None, absorbed=False):
        """x: (B, T, d) -> (B, T, d). With a cache, x holds only the new tokens, appended to it."""
        # A bad call ends in one sentence, before anything is written.
        check_call(self, x, cache)
        B, T, _ = x.shape
        start = 0 if cache is None else cache.length              # the new tokens' first position
        positions = torch.arange(start, start + T)
        h, dh, dr = self.n_heads, self.d_head, self.d_rope
        q = self.w_q(x).view(B, T, h, dh).transpose(1, 2)         # (B, T, h, dh) -> (B, h, T, dh)
        q_rope = self.w_qr(x).view(B, T, h, dr).transpose(1, 2)   # (B, T, h, dr) -> (B, h, T, dr)
        q_rope = rope(q_rope, positions)
        c = self.w_dkv(x)                                         # (B, T, dc): the latent
        k_rope = rope(self.w_kr(x), positions)                    # (B, T, dr): one for all heads
        kv = torch.cat([c, k_rope], dim=-1)                       # (B, T, dc + dr): [c; k_R]
        if cache is not None:
            kv = cache.append(kv)                                 # (B, S, dc + dr), S = cached + T
        if absorbed:
            o = self.absorbed_attention(q, q_rope, kv)
        else:
            o = self.naive_attention(q, q_rope, kv)
        o = o.transpose(1, 2).reshape(B, T, -1)                   # (B, h, T, dh) -> (B, T, h*dh)
        return self.w_o(o)                                        # (B, T, d)

    def naive_attention(self, q, q_rope, kv):
        """MHA with h K/V heads, rebuilt from the cache: head i's key [k_C,i; k_R], value v_i."""
        (B, h, _, dh), S = q.shape, kv.shape[1]
        c, k_rope = kv.split([self.d_latent, self.d_rope], dim=-1)   # (B, S, dc), (B, S, dr)
        k = self.w_uk(c).view(B, S, h, dh).transpose(1, 2)       # (B, S, h, dh) -> (B, h, S, dh)
        v = self.w_uv(c).view(B, S, h, dh).transpose(1, 2)       # (B, S, h, dh) -> (B, h, S, dh)
        # The one RoPE key, the same for every head:
        k_rope = k_rope.unsqueeze(1).expand(B, h, S, self.d_rope)   # (B, S, dr) -> (B, h, S, dr)
        keys = torch.cat([k, k_rope], dim=-1)                    # (B, h, S, dh + dr)
        queries = torch.cat([q, q_rope], dim=-1)                 # (B, h, T, dh + dr)
        # attend_one_head divides the scores by sqrt(key width): sqrt(dh + dr), as MLA does.
        return mha.attend_one_head(queries, keys, v)[0]          # (B, h, T, dh)

    def absorbed_attention(self, q, q_rope, kv):
        """MQA: every head's query [W_UK,i^T q_C,i; q_R,i] against one key [c; k_R], value c."""
        query = torch.cat([self.absorb_query(q), q_rope], dim=-1)    # (B, h, T, dc + dr)
        scale = (self.d_head + self.d_rope) ** -0.5                  # 1 / sqrt(dh + dr)
        o_lat = latent_attend(query, kv, self.d_latent, scale)       # (B, h, T, dc)
        return self.expand_output(o_lat)                             # (B, h, T, dh)

    def absorb_query(self, q):
        """(B, h, T, dh) -> (B, h, T, dc): each q_C,i -> W_UK,i^T q_C,i.
        Its dot product with a latent c_s is the naive score's q_C,i . k_C,i,s."""
        h, dh, dc = self.n_heads, self.d_head, self.d_latent
        # Row i*dh + r of w_uk.weight makes dimension r of head i's key (the naive path's
        # view(B, S, h, dh)): e.g. with dh = 32, row 70 is head 2's dimension 6. So head i's
        # W_UK,i is rows i*dh .. i*dh + dh - 1.
        w_uk = self.w_uk.weight.view(h, dh, dc)   # (h*dh, dc) -> (h, dh, dc)
        return q @ w_uk                           # (B, h, T, dh) @ (h, dh, dc) -> (B, h, T, dc)

    def expand_output(self, o_lat):
        """(B, h, T, dc) -> (B, h, T, dh): W_UV,i applied once to the weighted sum of latents."""
        h, dh, dc = self.n_heads, self.d_head, self.d_latent
        w_uv = self.w_uv.weight.view(h, dh, dc)   # (h*dh, dc) -> (h, dh, dc), rows as W_UK's
        return o_lat @ w_uv.transpose(1, 2)       # (B, h, T, dc) @ (h, dc, dh) -> (B, h, T, dh)
    # The paper says W_UK "can be absorbed into" W_Q and W_UV into W_O: multiplied ahead of time.
    # Applied on the fly, as here and in DeepSeek's inference code, they stay small: at
    # DeepSeek-V2-Lite's shape (d = 2048, h = 16, no query compression) W_Q W_UK holds
    # h d dc = 16.8M numbers per layer, the two 5.2M (V2: 101M against 34M).

    def new_cache(self, batch, max_len):
        """An empty LatentCache for `batch` sequences of up to `max_len` tokens, in the weights'
        dtype and device."""
        check_sizes(batch=batch, max_len=max_len)
        w = self.w_dkv.weight
        kv = torch.zeros(batch, max_len, self.d_latent + self.d_rope,
                         dtype=w.dtype, device=w.device)        # (B, max_len, dc + dr)
        return LatentCache(kv)


# ------------------------------------------------------------------ the checks
def demo_module(seed, dtype=torch.float32):
    """The knobs' LatentAttention and a (BATCH, SEQ_LEN, D_MODEL) input, both from seed."""
    torch.manual_seed(seed)
    return (LatentAttention(D_MODEL, N_HEADS, D_HEAD, D_LATENT, D_ROPE).to(dtype).eval(),
            torch.randn(BATCH, SEQ_LEN, D_MODEL, dtype=dtype))


def absorbed_vs_naive(attn, x):
    """max |absorbed - naive| / max |naive| over one full forward."""
    with torch.no_grad():
        return relative_diff(attn(x, absorbed=True), attn(x))


def prompt_chunks(T):
    """(start, end) of the chunks a cache is fed: a prompt of T // 2 tokens, then 2 at once, then
    1 at a time; the 2-token chunk is the one whose mask is offset.
    prompt_chunks(7) == [(0, 3), (3, 5), (5, 6), (6, 7)]"""
    prompt = T // 2
    return [(0, prompt), (prompt, min(prompt + 2, T))] + [(t, t + 1) for t in range(prompt + 2, T)]


def cached_vs_full(attn, x, absorbed, chunks):
    """Relative difference of x fed through a cache in `chunks` (start, end) and in one forward."""
    cache = attn.new_cache(x.shape[0], x.shape[1])
    with torch.no_grad():
        steps = [attn(x[:, start:end], cache=cache, absorbed=absorbed) for start, end in chunks]
        return relative_diff(torch.cat(steps, dim=1), attn(x, absorbed=absorbed))


def mqa_identity_gap(attn, x):
    """The absorbed decode step of x's last token against PyTorch's own multi-query attention, one
    K/V head: keys [c; k_R] (dc + dr wide), values c (dc wide), queries [W_UK,i^T q_C,i; q_R,i],
    scale 1/sqrt(dh + dr)."""
    B, T, _ = x.shape
    cache = attn.new_cache(B, T)
    with torch.no_grad():
        attn(x[:, :-1], cache=cache, absorbed=True)
        step = attn(x[:, -1:], cache=cache, absorbed=True)          # (B, 1, d)
        h, dh, dr = attn.n_heads, attn.d_head, attn.d_rope
        last = x[:, -1:]                                            # (B, 1, d)
        q = attn.w_q(last).view(B, 1, h, dh).transpose(1, 2)        # (B, 1, h, dh) -> (B, h, 1, dh)
        q_rope = attn.w_qr(last).view(B, 1, h, dr).transpose(1, 2)  # (B, 1, h, dr) -> (B, h, 1, dr)
        q_lat = attn.absorb_query(q)                                # (B, h, 1, dc)
        q_rope = rope(q_rope, torch.tensor([T - 1]))                # turned at position T - 1
        query = torch.cat([q_lat, q_rope], dim=-1)                  # (B, h, 1, dc + dr)
        # ONE K/V head for all h query heads: key [c; k_R], value the latent c itself.
        key = cache.kv.unsqueeze(1)                                 # (B, 1, S, dc + dr)
        value = cache.kv[..., :attn.d_latent].unsqueeze(1)          # (B, 1, S, dc)
        o_lat = F.scaled_dot_product_attention(query, key, value, scale=(dh + dr) ** -0.5,
                                               enable_gqa=True)     # (B, h, 1, dc)
        o = attn.expand_output(o_lat)                               # (B, h, 1, dh)
        o = o.transpose(1, 2).reshape(B, 1, -1)                     # (B, h, 1, dh) -> (B, 1, h*dh)
        mqa = attn.w_o(o)                                           # (B, 1, d)
    return relative_diff(mqa, step)


def turned_keys_gap(attn, x):
    """The counter-example: RoPE on the content keys and queries, as in Llama, then W_UK absorbed
    anyway. The scores are R_t q_C,i . R_s (W_UK,i c_s); all absorption can compute is
    (W_UK,i^T R_t q_C,i) . c_s, which drops the turn R_s of key s. Relative difference of the two,
    over the scores of x's sequence."""
    (B, T, _), positions = x.shape, torch.arange(x.shape[1])
    h, dh = attn.n_heads, attn.d_head
    with torch.no_grad():
        q = attn.w_q(x).view(B, T, h, dh).transpose(1, 2)               # (B, h, T, dh)
        c = attn.w_dkv(x)                                               # (B, T, dc)
        k = attn.w_uk(c).view(B, T, h, dh).transpose(1, 2)              # (B, h, T, dh)
        true = rope(q, positions) @ rope(k, positions).transpose(2, 3)  # (B, h, T, T)
        q_lat = attn.absorb_query(rope(q, positions))                   # (B, h, T, dc)
        absorbed = q_lat @ c.unsqueeze(1).transpose(2, 3)               # (B, h, T, T)
    return relative_diff(absorbed, true)


def run_checks(seed):
    """Evidence that absorption's algebra holds in code, and what a turned content key would do."""
    print(f"1. Checks (B={BATCH}, T={SEQ_LEN}, d={D_MODEL}, h={N_HEADS}, dh={D_HEAD}, "
          f"dc={D_LATENT}, dr={D_ROPE})")
    (attn64, x64), (attn32, x32) = demo_module(seed, torch.float64), demo_module(seed)
    ok = report("float64: max |absorbed - naive| / max |naive|",
                absorbed_vs_naive(attn64, x64), 1e-12)
    ok &= report("float32: the same, exact in algebra but not rounding",
                 absorbed_vs_naive(attn32, x32), 1e-5)
    ok &= report("decode step vs PyTorch's MQA: key [c; k_R], value c",
                 mqa_identity_gap(attn64, x64), 1e-12)
    chunks = prompt_chunks(SEQ_LEN)
    sizes = [end - start for start, end in chunks]
    print(f"  cached, float32: chunks of {sizes} tokens, against one full forward")
    for absorbed in (False, True):
        label = f"  {'absorbed' if absorbed else 'naive':<9} max |cached - full| / max |full|"
        ok &= report(label, cached_vs_full(attn32, x32, absorbed, chunks), 1e-5)
    n = attn32.new_cache(1, 512).kv.nbytes
    want = latent_cache_bytes(1, D_LATENT, D_ROPE, 512, bytes_per_elem=4)
    print(f"  512-token cache: {n:,} bytes allocated, {want:,} by the formula (dc + dr) x 512 x 4  "
          f"{'OK' if n == want else 'FAIL'}")
    turned = turned_keys_gap(attn64, x64)
    print("  on purpose: RoPE on the content keys, then W_UK absorbed anyway, "
          "which drops each key's turn R_s:")
    verdict = "CHANGED, as it must" if turned > 1e-3 else "NOT CHANGED  FAIL"
    print(f"  {'  max |scores without R_s - scores| / max |scores|':<52} = {turned:.2e}  "
          f"{verdict}  (must exceed 1e-03)")
    return ok and n == want and turned > 1e-3


# ------------------------------------------------------------------ the cache, in bytes
def latent_cache_bytes(n_layers, d_latent, d_rope, seq_len, batch=1, bytes_per_elem=2):
    """Bytes of an MLA cache: layers x (dc + dr) x tokens x batch x bytes per number.
    latent_cache_bytes(60, 512, 64, 4096) == 283115520   (DeepSeek-V2, bf16, 4k tokens: 0.28 GB)"""
    return n_layers * (d_latent + d_rope) * seq_len * batch * bytes_per_elem


def cache_rows(layers, h, dh, dc, dr):
    """[(kind, numbers per token and layer, formula)] for MHA, GQA, MQA, MLA and careless MLA."""
    return [("MHA", 2 * h * dh, "2 h dh"),
            (mha.attention_kind(h, GQA_KV_HEADS), 2 * GQA_KV_HEADS * dh, "2 kv dh"),
            ("MQA", 2 * dh, "2 dh"),
            ("MLA", dc + dr, "dc + dr"),
            # every head's K (dh + dr wide) and V, kept:
            ("MLA careless", h * (2 * dh + dr), "h (2 dh + dr)")]


def print_cache_table():
    """Section 2: the cache of DeepSeek's models under each attention, and what MLA keeps."""
    layers, h, dh, dc, dr = DEEPSEEK["DeepSeek-V2"]
    n = latent_cache_bytes(layers, dc, dr, CACHE_TOKENS, bytes_per_elem=CACHE_BYTES_PER_ELEM)
    n_mha = mha.kv_cache_bytes(layers, h, dh, CACHE_TOKENS, bytes_per_elem=CACHE_BYTES_PER_ELEM)
    print(f"\n2. The cache, batch 1, {CACHE_TOKENS} tokens, {CACHE_BYTES_PER_ELEM} bytes per "
          "number (2 = bf16, a convention: DeepSeek-V2 quantizes\n"
          "   its own to about 6 bits). GB = 1e9 bytes. DeepSeek-V2: "
          f"latent_cache_bytes({layers}, {dc}, {dr}, {CACHE_TOKENS})\n"
          f"   = {n:,} bytes = {n / 1e9:.2f} GB, against {n_mha / 1e9:.1f} GB for MHA of the same "
          "layers, h and dh.\n"
          "   MLA careless: every head's K (dh + dr wide) and V rebuilt from the latent and kept.")
    widths = [10, 9, 9, 10, 15]                            # one column per kind
    rows = cache_rows(layers, h, dh, dc, dr)
    formulas = "".join(f"{f:>{w}}" for (_, _, f), w in zip(rows, widths))
    print(f"   {'numbers per token-layer:':<29}{formulas}")
    kinds = "".join(f"{kind:>{w}}" for (kind, _, _), w in zip(rows, widths))
    print(f"   {'model':<17}{'layers':>7}{'h':>5}{kinds}{'MLA vs MHA':>12}")
    for name, shape in DEEPSEEK.items():
        rows = cache_rows(*shape)
        gbs = [shape[0] * count * CACHE_TOKENS * CACHE_BYTES_PER_ELEM / 1e9 for _, count, _ in rows]
        cells = "".join(f"{f'{gb:.2f} GB':>{w}}" for gb, w in zip(gbs, widths))
        print(f"   {name:<17}{shape[0]:>7}{shape[1]:>5}{cells}{rows[0][1] / rows[3][1]:>11.1f}x")
    print(f"   MLA keeps {dc + dr} numbers per token-layer, {(dc + dr) / (2 * dh):g} times MQA's "
          f"{2 * dh}. From them each head rebuilds a content key\n"
          f"   and a value of its own, all in the span of the one {dc}-wide latent; "
          "all heads share one RoPE key.")


def plot_cache():
    """The figure: numbers and bytes cached per token-layer at DeepSeek-V2's shapes, log scale."""
    from matplotlib.figure import Figure  # here, so that importing mla stays quick
    _, h, dh, dc, dr = DEEPSEEK["DeepSeek-V2"]
    rows = cache_rows(0, h, dh, dc, dr)[:4]                # MHA, GQA-8, MQA, MLA
    n_mha, n_mla = rows[0][1], rows[3][1]
    fig = Figure(figsize=(9, 3.6))
    ax = fig.subplots()
    ax.set_xscale("log")
    ax.set_xlim(100, 1e6)
    ax.xaxis.set_major_formatter(lambda value, _: f"{value:,.0f}")    # 1,000 rather than 10^3
    for y, (kind, count, formula) in zip(range(len(rows), 0, -1), rows):   # MHA on top
        ax.barh(y, count, color="tab:orange" if kind == "MLA" else "tab:blue")
        share = "" if count == n_mha else f", 1/{n_mha / count:.3g} of MHA's"
        label = f"{count:,} numbers = {count * CACHE_BYTES_PER_ELEM:,} bytes{share}"
        ax.text(count * 1.15, y, label, va="center", fontsize=9)
    ax.set_yticks(range(len(rows), 0, -1), [f"{kind}\n{formula}" for kind, _, formula in rows])
    ax.set_xlabel("numbers cached per token and layer (log scale); "
                  f"bytes at {CACHE_BYTES_PER_ELEM} per number")
    ax.set_title(f"The cache per token and layer at DeepSeek-V2's shapes: "
                 f"h={h}, dh={dh}, dc={dc}, dr={dr}\n"
                 f"MLA keeps {n_mla:,} numbers where MHA keeps {n_mha:,}: "
                 f"{n_mha / n_mla:.1f}x fewer", fontsize=10)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------ main
def main(argv=None):
    args = parse_args(argv)        # a bad flag, knob or folder ends here in one line, exit code 2
    print(f"Multi-head latent attention, d={D_MODEL}, h={N_HEADS}, dh={D_HEAD}: "
          f"caches dc + dr = {D_LATENT} + {D_ROPE} = {D_LATENT + D_ROPE} numbers\n"
          "per token and layer, where MHA of the same heads caches "
          f"2 h dh = {2 * N_HEADS * D_HEAD}\n")
    ok = run_checks(args.seed)
    print_cache_table()
    path = os.path.join(args.out_dir, "mla_cache.png")
    plot_cache().savefig(path, dpi=100)
    print(f"\n3. The figure of the cache per token and layer at DeepSeek-V2's shapes, written to "
          f"{os.path.join(os.path.relpath(args.out_dir), '')}: mla_cache.png")
    print(f"\nNow change D_LATENT or D_ROPE and run again. All checks: {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


# ------------------------------------------------------------------ plumbing: bad input
# What a learner can get wrong ends in one sentence naming the value and the rule, before anything
# is computed or written; the rest gets Python's or PyTorch's own error.
def check_sizes(**sizes):
    """Every size a whole number of at least 1 (numpy's too), d_rope even."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name}={value!r} must be a whole number of at least 1")
    if sizes.get("d_rope", 0) % 2:
        raise ValueError(f"d_rope={sizes['d_rope']} must be even: "
                         "RoPE turns its dimensions in pairs")


def check_call(attn, x, cache):
    """A call attn(x, cache) that can work: x (B, T, d) in the weights' dtype and device; a cache
    that fits it, not under autograd. A refused call leaves the cache as it was."""
    w = attn.w_dkv.weight
    if (not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[2] != attn.d_model
            or 0 in x.shape):
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be (B, T, d_model={attn.d_model}) with B, T >= 1, got {shape}")
    if x.dtype != w.dtype or x.device != w.device:
        raise TypeError(f"x is {x.dtype} on {x.device}, the module {w.dtype} on {w.device}: "
                        "convert one with .to()")
    if cache is None:
        return
    if torch.is_grad_enabled() and any(p.requires_grad for p in [x, *attn.parameters()]):
        raise RuntimeError("decoding with a cache writes it in place, which autograd cannot "
                           "follow: call the module under torch.no_grad() or "
                           "torch.inference_mode()")
    kv, (B, T, _) = cache.kv, x.shape
    want = (B, kv.shape[1], attn.d_latent + attn.d_rope)
    if tuple(kv.shape) != want or kv.dtype != x.dtype or kv.device != x.device:
        raise ValueError(f"the cache is {tuple(kv.shape)} in {kv.dtype} on {kv.device}; "
                         f"this call needs {want} in {x.dtype} on {x.device}: "
                         "make it with new_cache()")
    if not 0 <= cache.length <= kv.shape[1] - T:
        raise ValueError(f"the cache holds {cache.length} of its {kv.shape[1]} tokens: "
                         f"{T} more do not fit")


def report(label, diff, tol):
    """Print one aligned line of evidence and return whether diff is within tol."""
    ok = diff <= tol
    print(f"  {label:<52} = {diff:.2e}  {'OK' if ok else 'FAIL'}  (tolerance {tol:.0e})")
    return ok


def relative_diff(a, b):
    """max |a - b| / max |b|: a difference in units of b's own size, whatever the input's scale."""
    return ((a - b).abs().max() / b.abs().max()).item()


def parse_args(argv=None):
    """The flags, defaulting to their knobs. A bad flag, a knob that cannot work or a folder that
    cannot be written ends here, in one line and exit code 2, before anything is computed."""
    parser = argparse.ArgumentParser(
        prog="mla.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Multi-head latent attention (DeepSeek-V2): absorption checked, the MQA "
                    "identity, the cache of DeepSeek's models and its figure.")
    parser.add_argument("--seed", type=int, default=SEED, help="seed for every random number")
    parser.add_argument("--out-dir", default=OUT_DIR,
                        help="folder for mla_cache.png, made if missing")
    args = parser.parse_args(argv)
    try:
        check_sizes(d_model=D_MODEL, n_heads=N_HEADS, d_head=D_HEAD, d_latent=D_LATENT,
                    d_rope=D_ROPE, BATCH=BATCH, CACHE_TOKENS=CACHE_TOKENS,
                    GQA_KV_HEADS=GQA_KV_HEADS)
    except ValueError as e:
        parser.exit(2, f"mla.py: error: {e}\n")
    if isinstance(SEQ_LEN, bool) or not isinstance(SEQ_LEN, int) or SEQ_LEN < 2:
        parser.exit(2, f"mla.py: error: SEQ_LEN={SEQ_LEN!r} must be a whole number of at least 2\n")
    if any(h % GQA_KV_HEADS for _, h, _, _, _ in DEEPSEEK.values()):
        parser.exit(2, f"mla.py: error: GQA_KV_HEADS={GQA_KV_HEADS} must divide "
                       "every model's heads in DEEPSEEK\n")
    try:
        os.makedirs(args.out_dir, exist_ok=True)
    except OSError as e:
        parser.exit(2, f"mla.py: error: --out-dir {args.out_dir!r} cannot be made: {e.strerror}\n")
    return args


if __name__ == "__main__":
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # python mla.py | head: the reader left. Python's docs on SIGPIPE say to silence stdout
        # and exit 1.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    sys.exit(code)
