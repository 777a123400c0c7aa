"""
Multi-head attention, and its grouped-query (GQA) and multi-query (MQA) variants, in one file.

  - CausalMHA: causal self-attention with one knob, n_kv_heads. Equal to n_heads it is multi-head attention
    (MHA, Vaswani et al. 2017); a divisor in between is grouped-query attention (GQA, Ainslie et al. 2023),
    where each group of query heads shares one key/value head; 1 is multi-query attention (MQA, Shazeer 2019).
  - The attention written out: one head as the formula reads, softmax(q k^T / sqrt(dh) + mask) v; all heads with
    each K/V head copied (the textbook); attend(), the same without the copies; then PyTorch's fused call.
  - The output: 1 and 2, the KV cache of real models in bytes; 3, decoding with a real cache, attend against the
    textbook; on a second pass, 4: MHA with nn.MultiheadAttention's weights gives its output to the last bit (0.0)
    on a sequence, GQA/MQA to 2e-6; 5: a decode step's time against its floor. A first pass skips "a second pass".
Not here: training and what GQA costs (quality.py), what may come after GQA (mla.py), dropout, padding, positions.
Run:    python mha.py  (a few seconds; writes figures/)     python mha.py --n-kv-heads 2  (or edit N_KV_HEADS)
Papers: Vaswani et al. 2017 (arXiv:1706.03762), Shazeer 2019 (1911.02150), Ainslie et al. 2023 (2305.13245).
Shapes: B batch, T tokens in this call, d model width, h query heads, kv key/value heads, g = h / kv query
        heads per K/V head, dh = d / h head width, S keys in the call (cached plus new tokens).
"""

import argparse
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# ----------------------------------------------------------------------------- knobs
N_HEADS = 8          # h: query heads of the demo model
N_KV_HEADS = 4       # kv: key/value heads. 8 = MHA, 4 or 2 = GQA, 1 = MQA. Change it and rerun.
D_MODEL = 256        # d: model width, so each head is dh = 256 / 8 = 32 wide
SEQ_LEN = 12         # T: tokens in the demo sequence (and the side of each attention map)
BATCH = 2            # B: sequences in the demo batch
SEED = 0             # every random number in the run comes from this seed
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "figures")
FIGURES = ["attention_maps.png", "kv_cache_size.png", "head_layout.png", "stacking.png", "decode_time.png"]

# Section 1's table, the cache figure and the decode timing use Llama-7B-shaped attention.
LLAMA_LAYERS, LLAMA_HEADS, LLAMA_D_HEAD = 32, 32, 128    # layers, query heads, head width
LLAMA_KV_HEADS = (32, 8, 4, 1)    # K/V heads compared: MHA, GQA-8, GQA-4, MQA (section 1 adds your g's row)
CACHE_TOKENS = 4096               # context length of the tables
CACHE_BYTES_PER_ELEM = 2          # bytes per cached number: 2 = fp16/bf16, 1 = fp8, 4 = fp32
GPU_CACHE_GB = 40                 # GPU memory set aside for the cache, GB (1 GB = 1e9 bytes)
DECODE_CONTEXTS = (256, 512, 1024, 2048, 4096, 8192)   # section 5: cached tokens at which a decode step is timed
DECODE_ROUNDS = 5                 # section 5: each decode time is the best of this many rounds
MATMUL_N = 512                    # section 5's FLOP/s ceiling: a (512, 512) @ (512, 512) float32 product
GPU = ("H100 SXM", 989e12, 3.35e12)  # section 5 compares with it, datasheet: dense bf16 FLOP/s, memory bytes/s

# Published shapes: (layers, query heads, K/V heads, head width).
PUBLISHED_MODELS = {
    "Llama-2-7B": (32, 32, 32, 128),
    "Llama-2-70B": (80, 64, 8, 128),
    "Llama-3-8B": (32, 32, 8, 128),
    "Mistral-7B-v0.2": (32, 32, 8, 128),   # v0.1 attends to the last 4096 tokens only: its cache stops there
    "Falcon-7B": (32, 71, 1, 64),          # 71 heads is right: 71 x 64 = 4544 = d
    "Falcon-40B": (60, 128, 8, 64),        # both Falcons trained at 2048 tokens: 4096 is a what-if
    "Gemma-2B (v1)": (18, 8, 1, 256),     # Gemma 1, not Gemma-2-2B (26 layers, 4 K/V heads)
}


# ----------------------------------------------------------------------------- the module
def attention_kind(n_heads, n_kv_heads):
    """'MHA', 'MQA' or 'GQA-<kv>', named by its K/V heads.  attention_kind(32, 8) == 'GQA-8'."""
    if n_kv_heads == n_heads:
        return "MHA"
    return "MQA" if n_kv_heads == 1 else f"GQA-{n_kv_heads}"


def causal_mask(T, S, dtype=torch.float32):
    """(T, S) additive mask: 0 where new token i may see key j, -inf where key j lies in its future (after the
    softmax, exp(-inf) = 0: a future key gets no weight at all). New token i sits at position S - T + i among the
    keys: at i in a whole sequence (T == S); later with a cache (KVCache, below), where S - T keys came before it.
    causal_mask(3, 3) == [[0, -inf, -inf], [0, 0, -inf], [0, 0, 0]]   (a whole sequence: T == S)
    causal_mask(2, 3) == [[0, 0, -inf], [0, 0, 0]]                    (key 0 cached, keys 1 and 2 new)
    """
    i = torch.arange(T).view(T, 1) + (S - T)               # (T, 1): where each new token sits; T=2, S=3: [[1], [2]]
    j = torch.arange(S).view(1, S)                         # (1, S): each key's position; S=3: [[0, 1, 2]]
    future = j > i                                         # (T, S): key j after token i; row 0: [0 1 2] > 1 -> F F T
    return torch.zeros(T, S, dtype=dtype).masked_fill(future, float("-inf"))


def attend_one_head(q, k, v):
    """softmax(q k^T / sqrt(dh) + causal mask) v for one head of one sequence; returns o and p.

    q: (T, dh), the queries of the T newest tokens; k, v: (S, dh), the keys and values of all S tokens so far,
    the T newest last. A query scores every key by a dot product: a sum of dh products of independent numbers
    of mean 0 and standard deviation 1. Each product has variance 1, variances of independent terms add, so the
    sum has variance dh and standard deviation sqrt(dh): dividing by it keeps the softmax from saturating (one
    weight near 1, the rest near 0). The softmax turns a query's scores into weights p that sum to 1; o is the
    values' average, weighted by p. The README's example, in a REPL (from mha import *):
    k = torch.tensor([[1., 0.], [0., 1.], [1., 1.]])       # (S, dh) = (3, 2): the keys, also the values
    q = torch.tensor([[1., 0.], [1., 0.], [1., 0.]])       # (T, dh) = (3, 2): every query (1, 0)
    attend_one_head(q, k, k)[0][2]                         # token 2: tensor([0.8022, 0.5989])
    """
    T, dh, S = q.shape[-2], q.shape[-1], k.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(dh) + causal_mask(T, S, q.dtype)   # (T, dh) @ (dh, S) -> (T, S)
    p = scores.softmax(dim=-1)                             # (T, S): each row sums to 1
    return p @ v, p                                        # (T, S) @ (S, dh) -> (T, dh)


def attend_textbook(q, k, v):
    """attend_one_head on every head of every sequence at once, as textbooks write it; returns o and p.

    q: (B, h, T, dh); k, v: (B, kv, S, dh). The same lines work: @, transpose(-2, -1) and the (T, S) mask act on
    the last two dimensions and carry B and h along. For GQA each K/V head is first copied to its g query heads:

        query heads   q0  q1 | q2  q3          the same picture as k.repeat_interleave(g, dim=1),
        K/V heads       k0   |   k1            [k0, k0, k1, k1]; NOT k.repeat(1, g, 1, 1),
                                               [k0, k1, k0, k1], which silently pairs q1 with k1.
    """
    g = q.shape[1] // k.shape[1]                           # query heads per K/V head
    k = k.repeat_interleave(g, dim=1)                      # (B, kv, S, dh) -> (B, h, S, dh): query head i gets i // g
    v = v.repeat_interleave(g, dim=1)                      # (B, kv, S, dh) -> (B, h, S, dh)
    return attend_one_head(q, k, v)                        # (B, h, T, dh), (B, h, T, S)


@dataclass
class KVCache:
    """Keys and values of every token seen so far, k, v: (B, kv, max_len, dh), preallocated to max_len tokens.

    A model generates one token at a time, and each new token attends to every token before it. Their keys
    and values never change (in every layer a token's k and v depend on it and earlier tokens only), so they
    are kept, and each step projects the new token alone: forward(x_new, cache=...). Queries are not kept:
    only the new token's is ever used. Only the first `length` positions hold tokens.
    """
    k: torch.Tensor
    v: torch.Tensor
    length: int = 0

    def append(self, k, v):
        """Write k, v: (B, kv, T, dh) after the cached tokens; return all of them, (B, kv, S, dh)."""
        S = self.length + k.shape[2]                       # tokens held after this call: cached + T new
        self.k[:, :, self.length:S] = k                    # into positions length .. S-1 of max_len: (B, kv, T, dh)
        self.v[:, :, self.length:S] = v
        self.length = S
        return self.k[:, :, :S], self.v[:, :, :S]


class CausalMHA(nn.Module):
    """Causal self-attention with h query heads and kv key/value heads (MHA, GQA or MQA).

    One projection, in_proj (W_q, W_k and W_v stacked), makes q, k and v. Its weight is (out, in), as nn.Linear keeps
    it: a row per output number, every query head's dh rows, then every key head's, then every value head's. With
    kv == h it is laid out as nn.MultiheadAttention's in_proj_weight, so from_torch (second pass) can copy that in.
    """

    def __init__(self, d_model, n_heads, n_kv_heads=None, bias=True):
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads     # the default is MHA
        check_sizes(d_model, n_heads, n_kv_heads)          # raises a one-sentence error if they cannot work (plumbing)
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.d_head = d_model // n_heads
        self.in_proj = nn.Linear(d_model, (n_heads + 2 * n_kv_heads) * self.d_head, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x, need_weights=False, cache=None, fused=False):
        """x: (B, T, d) -> y: (B, T, d), or (y, attention weights (B, h, T, S)) with need_weights.

        With a cache, x holds only the new tokens: their keys and values are appended to the cache, and each attends
        to all cached tokens and the new ones up to itself. fused=True: the same in one PyTorch call (attend_fused)."""
        check_call(self, x, need_weights, cache, fused)    # a one-sentence error, before the cache is written
        B, T, _ = x.shape
        h, kv, dh = self.n_heads, self.n_kv_heads, self.d_head
        # Each token's h*dh numbers are its h heads side by side. A REPL toy: x = torch.arange(8.).view(1, 2, 4)
        # is token 0 = 0 1 2 3, token 1 = 4 5 6 7 (2 tokens, h=2, dh=2), drawn cut into heads of dh:
        #     token 0:  0 1 | 2 3      view(1, 2, 2, 2) cuts each token at the bar, transpose(1, 2) puts heads before
        #     token 1:  4 5 | 6 7      tokens: x.view(1, 2, 2, 2).transpose(1, 2)[0, 0] is head 0: [[0, 1], [4, 5]].
        # Without the transpose, x.view(1, 2, 2, 2)[0, 0] is [[0, 1], [2, 3]]: token 0's two heads, not head 0.
        qkv = self.in_proj(x)                              # (B, T, d) -> (B, T, (h + 2kv) dh)
        q, k, v = qkv.split([h * dh, kv * dh, kv * dh], dim=-1)
        q = q.view(B, T, h, dh).transpose(1, 2)            # (B, T, h*dh) -> (B, T, h, dh) -> (B, h, T, dh)
        k = k.view(B, T, kv, dh).transpose(1, 2)           # (B, T, kv*dh) -> (B, kv, T, dh)
        v = v.view(B, T, kv, dh).transpose(1, 2)           # (B, T, kv*dh) -> (B, kv, T, dh)
        if cache is not None:
            k, v = cache.append(k, v)                      # (B, kv, S, dh), S = cached + T
        if fused:
            o, p = attend_fused(q, k, v), None             # (B, h, T, dh)
        else:
            o, p = attend(q, k, v)                         # attend_textbook's o, p without copying K/V (second pass)
        # Back: transpose(1, 2) puts tokens first again but moves no number (only how the tensor is walked), so a
        # token's heads lie apart in memory unless T or h is 1: reshape copies them together, where view would refuse.
        o = o.transpose(1, 2).reshape(B, T, h * dh)        # (B, h, T, dh) -> (B, T, h*dh = d): heads side by side
        y = self.out_proj(o)                               # (B, T, d): one matrix mixes the heads
        return (y, p) if need_weights else y

    def new_cache(self, batch, max_len):
        """An empty KVCache for `batch` sequences of up to `max_len` tokens, on the weights' device, in their dtype."""
        check_counts([("batch", batch, 1), ("max_len", max_len, 1)])
        shape = (batch, self.n_kv_heads, max_len, self.d_head)      # (B, kv, max_len, dh)
        like = {"dtype": self.in_proj.weight.dtype, "device": self.in_proj.weight.device}
        return KVCache(torch.zeros(shape, **like), torch.zeros(shape, **like))


# ----------------------------------------------------------------------------- the KV cache, in bytes
def kv_cache_bytes(n_layers, n_kv_heads, d_head, seq_len, batch=1, bytes_per_elem=2):
    """Bytes of the KV cache: 2 (K and V) x layers x K/V heads x dh x tokens x batch x bytes per number.

    kv_cache_bytes(32, 32, 128, 4096) == 2147483648   (Llama-7B shape, fp16, 4k tokens: 2.15 GB)
    """
    return 2 * n_layers * n_kv_heads * d_head * seq_len * batch * bytes_per_elem


# ----------------------------------------------------------------------------- decoding with a cache
def check_cache(n_kv_heads, seed):
    """Real caches: their bytes against the formula, cached decoding against one full forward; the textbook."""
    ok, max_len = True, 512
    print(f"\n3. Cached decoding; attend vs the textbook (d={D_MODEL}, h={N_HEADS}, dh={D_MODEL // N_HEADS}, fp32)")
    for kv in sorted({N_HEADS, n_kv_heads, 1}, reverse=True):     # MHA, yours and MQA, each once
        cache = CausalMHA(D_MODEL, N_HEADS, kv).new_cache(batch=1, max_len=max_len)
        n = cache.k.nbytes + cache.v.nbytes                # the bytes its K and V tensors hold
        want = kv_cache_bytes(1, kv, D_MODEL // N_HEADS, max_len, bytes_per_elem=4)
        ok &= (n == want)                                  # ok stays True only while every check passes
        print(f"  {attention_kind(N_HEADS, kv):<5} {max_len}-token cache, one layer, batch 1: {n:>9,} bytes allocated, "
              f"{want:>9,} by the formula  {'OK' if n == want else 'FAIL'}")
    # Feed a prompt, 2 tokens at once (causal_mask's second example), then one at a time; vs one forward over all.
    attn = random_module(n_kv_heads, seed + 2)             # the demo's shape, random weights (after main())
    x = torch.randn(BATCH, SEQ_LEN, D_MODEL)               # (B, T, d)
    cache = attn.new_cache(BATCH, SEQ_LEN)                 # room for all SEQ_LEN tokens of each sequence
    chunks = prompt_chunks(SEQ_LEN)                        # (start, end), after main(); 12: 0:6, 6:8, 8:9, ..., 11:12
    with torch.no_grad():
        full = attn(x)
        steps = [attn(x[:, start:end], cache=cache) for start, end in chunks]
    print(f"  {attention_kind(N_HEADS, n_kv_heads)} cache fed chunks of {[step.shape[1] for step in steps]} tokens:")
    diff = relative_diff(torch.cat(steps, dim=1), full)    # max |a - b| / max |b|; it and report() after main()
    ok &= report("      max |cached - full forward| / max |full forward|", diff, 1e-5)
    q = torch.randn(BATCH, N_HEADS, SEQ_LEN, D_MODEL // N_HEADS)            # random q: (B, h, T, dh)
    k = torch.randn(BATCH, n_kv_heads, SEQ_LEN, D_MODEL // N_HEADS)         # random k: (B, kv, T, dh)
    v = torch.randn(BATCH, n_kv_heads, SEQ_LEN, D_MODEL // N_HEADS)         # random v: (B, kv, T, dh)
    textbook = relative_diff(attend(q, k, v)[0], attend_textbook(q, k, v)[0])   # forward's attend, and with copies
    label = f"{attention_kind(N_HEADS, n_kv_heads):<5} max |attend - textbook| / max |textbook|"
    return ok & report(label, textbook, 2e-6)


# ----------------------------------------------------------------------------- a second pass: attend, checks vs PyTorch
def attend(q, k, v):
    """attend_textbook without the copies (shapes as there): CausalMHA's default path, timed in section 5.

    The g query heads of a group are stacked as the g*T rows of one "head", which reads its K/V head once,
    never g copies of it. Nothing else changes: a row of q @ k^T comes from its own query row alone, and the
    softmax and p @ v work row by row, so each row gets what its own head would have: figures/stacking.png
    draws it on a toy, and section 3's last line checks it. To see it in a REPL (from mha import *):
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)   # h=4, kv=2, T=3
    (attend(q, k, v)[0] - attend_textbook(q, k, v)[0]).abs().max()      # a few 1e-7: rounding, nothing more
    q = torch.tensor([0., 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]).view(1, 4, 3, 1)   # dh=1: head i's 3 queries are i
    q.reshape(1, 2, 2, 3, 1).reshape(2, 6)   # as attend stacks them: block 0 = 0 0 0 1 1 1, block 1 = 2 2 2 3 3 3
    Bits: with g = 1 (MHA) and T > 1 nothing is stacked: nn.MultiheadAttention's operations in its order, same bits.
    """
    B, h, T, dh = q.shape
    kv, S = k.shape[1], k.shape[2]
    g = h // kv
    # Query heads are numbered group by group: heads j*g .. j*g + g - 1 all read K/V head j. Splitting h into
    # (kv, g), then merging g with T, stacks each group's g heads as the g*T rows of one block:
    #     h=4, kv=2 (g=2), T=3:   block 0: q0t0 q0t1 q0t2 q1t0 q1t1 q1t2  -> all read k0, v0  (figures/stacking.png)
    #                             block 1: q2t0 q2t1 q2t2 q3t0 q3t1 q3t2  -> all read k1, v1
    #     the demo's q (README):  (2, 8, 12, 32) -> (2, 4, 2, 12, 32) -> (8, 24, 32), 8 blocks of 24 rows
    # q * sqrt(1 / dh) scales every score as the textbook's / sqrt(dh) does. (Bits: scaling q first is PyTorch's order.)
    q = q.reshape(B, kv, g, T, dh)                         # (B, h, T, dh) -> (B, kv, g, T, dh): h = kv x g
    q = q.reshape(B * kv, g * T, dh) * math.sqrt(1.0 / dh)   # -> (B*kv, g*T, dh): block b*kv+j: sequence b, group j
    k = k.reshape(B * kv, S, dh)                           # (B, kv, S, dh) -> (B*kv, S, dh): one K, not g copies
    v = v.reshape(B * kv, S, dh)                           # (B, kv, S, dh) -> (B*kv, S, dh)
    # bmm: one matrix product per block of the stack, so its K/V head is read once for all g query heads.
    if T == 1:                                             # a decode step: one new token sees every key, no mask
        # (k q^T)^T is q k^T to rounding; with the long k on the left it ran 1.1-1.6x faster on an AMD EPYC (LABNOTES).
        scores = torch.bmm(k, q.transpose(1, 2)).transpose(1, 2)   # (B*kv, S, g) -> (B*kv, g, S)
    else:                                                  # rows go head by head, each head's T the same mask:
        mask = causal_mask(T, S, q.dtype).tile(g, 1)       # (T, S) -> (g*T, S): g whole copies (tile, not interleave)
        scores = torch.baddbmm(mask, q, k.transpose(1, 2))   # baddbmm(M, X, Y) = M + X @ Y, each block: (B*kv, g*T, S)
    p = scores.softmax(dim=-1)                             # (B*kv, g*T, S): each row sums to 1
    o = torch.bmm(p, v)                                    # (B*kv, g*T, S) @ (B*kv, S, dh) -> (B*kv, g*T, dh)
    return o.view(B, h, T, dh), p.view(B, h, T, S)         # un-stacked: (B*kv, g*T, ...) -> (B, h, T, ...)


def attend_fused(q, k, v):
    """The same attention in one fused call, the one nn.MultiheadAttention(need_weights=False) makes on a float mask.

    softmax(q k^T / sqrt(dh) + mask) v on attend's stacked rows, (B, kv, g*T, dh); no mask at T = 1, as in attend.
    It never stores p, which often makes it faster, and can round differently from attend() in the last bit.
    Why not SDPA's is_causal=True: it lets row r see keys 0 .. r, right only for one head of a whole sequence. A
    stacked row r = (head, t) must see keys 0 .. t, and with a cache (T < S) new token t must see keys 0 .. S - T + t.
    For one head, causal_mask(T, S) is torch.nn.attention.bias.causal_lower_right(T, S).
    """
    B, h, T, dh = q.shape
    kv, S = k.shape[1], k.shape[2]
    q = q.reshape(B, kv, (h // kv) * T, dh)                # (B, h, T, dh) -> (B, kv, g*T, dh), as in attend
    mask = causal_mask(T, S, q.dtype).tile(h // kv, 1) if T > 1 else None     # (g*T, S), as in attend
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)   # (B, kv, g*T, dh); it scales by 1/sqrt(dh) itself
    return o.reshape(B, h, T, dh)                          # (B, kv, g*T, dh) -> (B, h, T, dh)


def from_torch(ref):
    """A CausalMHA (MHA) with the weights of an nn.MultiheadAttention(d, h, batch_first=True)."""
    check_copyable(ref)
    attn = CausalMHA(ref.embed_dim, ref.num_heads, bias=ref.in_proj_bias is not None).to(ref.in_proj_weight.dtype)
    # Their names differ by one character: in_proj_weight there, in_proj.weight here.
    attn.load_state_dict({name.replace("in_proj_", "in_proj."): t for name, t in ref.state_dict().items()})
    return attn.train(ref.training)


def to_torch(attn):
    """The nn.MultiheadAttention computing the same function as attn, its K/V heads copied out to h heads.

    For MHA the exact inverse of from_torch. For GQA/MQA each K/V head's dh rows of weights (and bias)
    are repeated for its g query heads: query head i gets K/V head i // g, [k0, k0, k1, k1], as in attend_textbook.
    """
    h, kv, dh = attn.n_heads, attn.n_kv_heads, attn.d_head
    g = h // kv

    def widen(t):                                      # a weight's rows (or a bias's), (h + 2kv) dh -> 3 h dh
        q, k, v = t.split([h * dh, kv * dh, kv * dh])
        k_heads, v_heads = k.split(dh), v.split(dh)    # kv blocks of dh rows, a block per K/V head
        k = torch.cat([k_heads[i // g] for i in range(h)])   # query head i reads K/V head i // g: kv dh -> h dh rows
        v = torch.cat([v_heads[i // g] for i in range(h)])   # [v0, v0, v1, v1] for h=4, kv=2, as in attend_textbook
        return torch.cat([q, k, v])                    # (3 h dh, d), or (3 h dh,) for a bias

    ref = nn.MultiheadAttention(attn.d_model, h, bias=attn.in_proj.bias is not None, batch_first=True,
                                dtype=attn.in_proj.weight.dtype)
    ref.load_state_dict({name.replace("in_proj.", "in_proj_"): widen(t) if name.startswith("in_proj") else t
                         for name, t in attn.state_dict().items()})
    return ref.train(attn.training)


def max_diff_vs_torch(attn, x, ref=None, fused=False):
    """max |ours - nn.MultiheadAttention| on x: (output, per-head weights or None); ref: to_torch(attn).

    Written out, ours meets PyTorch's need_weights=True path, which writes attention out in the same order; fused,
    its need_weights=False path, which calls the same fused kernel. Both get a float causal mask: with a bool mask,
    in eval mode under no_grad, nn.MultiheadAttention takes a third path (its fast path) that rounds otherwise.
    """
    ref = to_torch(attn) if ref is None else ref
    mask = causal_mask(x.shape[1], x.shape[1], x.dtype)    # (T, T)
    with torch.no_grad():
        # nn.MultiheadAttention takes query, key and value inputs apart: all three are x in self-attention
        y_ref, w_ref = ref(x, x, x, attn_mask=mask, need_weights=not fused, average_attn_weights=False)
        if fused:
            return (attn(x, fused=True) - y_ref).abs().max().item(), None
        y, w = attn(x, need_weights=True)
    return (y - y_ref).abs().max().item(), (w - w_ref).abs().max().item()


def swap_query_heads(attn, i, j):
    """Swap the query rows of heads i and j in place: a copy with two heads in the wrong order.

    Swapping two heads everywhere (q, k, v and out_proj's columns) would change nothing: their outputs would
    come out swapped, and out_proj's swapped columns would put them back. Swapping only their queries pairs
    head i's queries with head j's keys, as a wrong reshape would.
    """
    dh = attn.d_head
    with torch.no_grad():
        for t in (attn.in_proj.weight, attn.in_proj.bias):
            if t is not None:
                rows_i, rows_j = t[i * dh:(i + 1) * dh].clone(), t[j * dh:(j + 1) * dh].clone()
                t[i * dh:(i + 1) * dh], t[j * dh:(j + 1) * dh] = rows_j, rows_i
    return attn


def run_checks(n_kv_heads, seed):
    """The evidence that the module is right. Returns True if every check passes."""
    print(f"\n4. Checks against PyTorch, each line max |ours - theirs| (fp32, T={SEQ_LEN}; B=1 if exact, else {BATCH})")
    torch.manual_seed(seed)                                # the reference, nn.MHA, with random (not 0) biases
    ref = random_biases(nn.MultiheadAttention(D_MODEL, N_HEADS, batch_first=True).eval())
    x = torch.randn(BATCH, SEQ_LEN, D_MODEL)               # (B, T, d)
    one = x[:1]                                            # (1, T, d): the first sequence alone
    copy = from_torch(ref)
    y_diff, w_diff = max_diff_vs_torch(copy, one, ref)
    ok = report("MHA   written out vs nn.MHA(need_weights=True)", y_diff, 0.0)   # prints it, True if OK
    ok &= report("MHA   the same, per-head weights", w_diff, 0.0)
    ok &= report("MHA   fused vs nn.MHA(need_weights=False)", max_diff_vs_torch(copy, one, ref, fused=True)[0], 0.0)
    with torch.no_grad():                                  # its two paths differ: each 0.0 above matched one of them
        mask = causal_mask(SEQ_LEN, SEQ_LEN)
        own = ref(one, one, one, attn_mask=mask)[0] - ref(one, one, one, attn_mask=mask, need_weights=False)[0]
    print(f"  {'      nn.MHA need_weights=True vs =False':<52} = {own.abs().max():.2e}  (PyTorch against itself: "
          "not a check)")
    # Bits: for a batch nn.MHA projects a transposed view: bias added after the product, rows (T, B): other rounding.
    if BATCH > 1:
        ok &= report(f"MHA   at batch {BATCH}, computed in another order", max_diff_vs_torch(copy, x, ref)[0], 2e-6)

    kind = attention_kind(N_HEADS, n_kv_heads)
    ours = random_module(n_kv_heads, seed + 1)
    y_diff, w_diff = max_diff_vs_torch(ours, x)
    ok &= report(f"{kind:<5} written out vs nn.MHA, K/V heads repeated", y_diff, 2e-6)
    ok &= report(f"{kind:<5} the same, per-head weights", w_diff, 2e-6)
    ok &= report(f"{kind:<5} fused vs that nn.MHA(need_weights=False)", max_diff_vs_torch(ours, x, fused=True)[0], 2e-6)
    sdpa = max_diff_vs_sdpa(ours, x)                       # the textbook was section 3's; F.sdpa broadcasts K/V
    ok &= report(f"{kind:<5} written out vs F.sdpa(enable_gqa=True)", sdpa, 2e-6)

    # A check that cannot fail proves nothing: a wrong copy must exceed the batch line's tolerance, not only 0.
    broken, _ = max_diff_vs_torch(swap_query_heads(from_torch(ref), 0, 1), x, ref)
    print(f"  {'on purpose: query heads 0 and 1 swapped in the copy':<52} = {broken:.2e}  "
          f"{'DETECTED, as it must be' if broken > 2e-6 else 'NOT DETECTED'}  (must exceed 2e-06)")
    return ok and broken > 2e-6


# ----------------------------------------------------------------------------- a second pass: decode time, a roofline
# A decode step (T = 1) of one layer: each head's query times S cached keys, (1, dh) @ (dh, S), then its weights
# times S values, (1, S) @ (S, dh): S dh multiply-adds each, 2 FLOPs apiece. Over h heads, 4 h S dh FLOPs, on the
# K and V of kv heads: 2 kv S dh numbers read.
# A machine reads so many bytes and computes so many FLOPs per second at most, so a step takes at least
#     floor = max(bytes / read rate, FLOPs / FLOP rate)                                  (the roofline)
# E.g. Llama-7B's MHA at 8192 tokens, fp32: 134 MFLOP on 268 MB. At 20 GB/s and 100 GFLOP/s the read takes
# 13.4 ms and the arithmetic 1.3 ms: the step waits on memory. MQA reads 32x fewer bytes (0.4 ms), so its FLOPs decide.
# Which one decides: the FLOPs per byte, 4 h S dh / (2 kv S dh x 4 bytes) = g / 2 in fp32, against the ridge,
# FLOP rate / read rate (5 in the example): MHA's 0.5 lies below it, the bytes decide; MQA's 16 above, the FLOPs.
# The run measures both rates, not the CPU's peaks: a 512x512 matmul, and a sum over each step's own K and V.
def decode_flops(n_heads, d_head, S):
    """FLOPs of one new token's attention over S keys: 4 h S dh.  decode_flops(32, 128, 4096) == 67108864"""
    return 4 * n_heads * S * d_head


def decode_bytes(n_kv_heads, d_head, S, bytes_per_elem=4):
    """Bytes it reads, one layer's K and V (fp32, as timed here).  decode_bytes(32, 128, 4096) == 134217728"""
    return kv_cache_bytes(1, n_kv_heads, d_head, S, bytes_per_elem=bytes_per_elem)


def roofline(flops, n_bytes, ceilings):
    """(least seconds, bound): max(bytes / bandwidth, FLOPs / flops), ceilings holding the two rates (Ceilings,
    after main()), and which ceiling sets it: 'memory', 'compute', or 'ridge' where the two lie within 1 %.
    roofline(100, 10, Ceilings(bandwidth=1, flops=100)) == (10.0, 'memory'): 10 FLOPs a byte, ridge 100.
    """
    memory, compute = n_bytes / ceilings.bandwidth, flops / ceilings.flops
    if abs(memory - compute) <= 0.01 * max(memory, compute):
        return max(memory, compute), "ridge"
    return (memory, "memory") if memory > compute else (compute, "compute")


# ----------------------------------------------------------------------------- main
# What main() calls that is not above (the tables, the timing, the figures, the plumbing) comes after it.
def main(argv=None):
    args = parse_args(argv)        # a bad flag, --out-dir or edited knob ends here, in one line (exit code 2)
    kv = args.n_kv_heads
    print(f"Causal attention, d={D_MODEL}, dh={D_MODEL // N_HEADS}, {N_HEADS} query heads reading {kv} K/V "
          f"head{'s' if kv > 1 else ''}: {attention_kind(N_HEADS, kv)}, groups of {N_HEADS // kv}")
    print_cache_tables(kv)
    ok = check_cache(kv, args.seed)
    ok &= run_checks(kv, args.seed)
    timing = measure_decode(DECODE_CONTEXTS, LLAMA_KV_HEADS, DECODE_ROUNDS)
    problems = timing_contradictions(timing)              # timings that contradict each other: a busy machine
    print_decode_table(timing, problems)
    figures = [plot_attention_maps(kv, args.seed), plot_cache_sizes(kv), plot_head_layout(kv), plot_stacking(),
               plot_decode_time(timing, problems)]                  # in the order of FIGURES, their file names
    if not write_figures("mha.py", args.out_dir, {name: png_bytes(fig) for name, fig in zip(FIGURES, figures)}):
        return 1
    print(f"\nFigures written to {os.path.join(os.path.relpath(args.out_dir), '')}: {', '.join(FIGURES)}")
    print(f"Now change N_KV_HEADS (or pass --n-kv-heads) and run again. All checks: {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


# ----------------------------------------------------------------------------- helpers of the checks
def max_diff_vs_sdpa(attn, x):
    """max |ours - F.sdpa(enable_gqa=True)|: PyTorch's own call for GQA, which broadcasts K/V to the query heads."""
    B, T, _ = x.shape
    h, kv, dh = attn.n_heads, attn.n_kv_heads, attn.d_head
    with torch.no_grad():
        y = attn(x)
        q, k, v = attn.in_proj(x).split([h * dh, kv * dh, kv * dh], dim=-1)   # as forward does
        q = q.view(B, T, h, dh).transpose(1, 2)            # (B, T, h, dh) -> (B, h, T, dh)
        k = k.view(B, T, kv, dh).transpose(1, 2)           # (B, T, kv, dh) -> (B, kv, T, dh)
        v = v.view(B, T, kv, dh).transpose(1, 2)           # (B, T, kv, dh) -> (B, kv, T, dh)
        # is_causal=True is right here: T == S, nothing stacked
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)   # (B, h, T, dh)
        y_ref = attn.out_proj(o.transpose(1, 2).reshape(B, T, h * dh))   # (B, h, T, dh) -> (B, T, d)
    return (y - y_ref).abs().max().item()


def prompt_chunks(T):
    """(start, end) of the chunks a cache is fed, here and in mla.py: a prompt of T // 2 tokens, 2, then 1 at a time."""
    prompt = T // 2
    chunks = [(0, prompt), (prompt, min(prompt + 2, T))]   # the prompt, then 2 tokens (T > 2) at once,
    return chunks + [(start, start + 1) for start in range(prompt + 2, T)]   # then one token at a time


def random_module(n_kv_heads, seed):
    """A CausalMHA of the demo's shape from this seed, its biases random like the reference's."""
    torch.manual_seed(seed)
    return random_biases(CausalMHA(D_MODEL, N_HEADS, n_kv_heads).eval())


def random_biases(module):
    """Random biases, in place: nn.MultiheadAttention's zeros would hide a bias copied to the wrong rows."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return module


def report(label, diff, tol):
    """Print one aligned line of evidence and return whether diff is within tol."""
    ok = diff <= tol
    rule = "must be exactly 0" if tol == 0 else f"tolerance {tol:.0e}"
    print(f"  {label:<52} = {diff:.2e}  {'OK' if ok else 'FAIL'}  ({rule})")
    return ok


def relative_diff(a, b):
    """max |a - b| / max |b|: a difference in units of b's own size, whatever the input's scale."""
    return ((a - b).abs().max() / b.abs().max()).item()


# ----------------------------------------------------------------------------- the cache tables
def llama_rows(n_kv_heads):
    """(section 1's K/V heads, most first; the one whose g is the demo's, GQA-16's 16 by default, or None)."""
    g = N_HEADS // n_kv_heads
    same_g = LLAMA_HEADS // g if LLAMA_HEADS % g == 0 else None
    rows = set(LLAMA_KV_HEADS) if same_g is None else set(LLAMA_KV_HEADS) | {same_g}
    return sorted(rows, reverse=True), same_g


def llama_cache_bytes(n_kv_heads, tokens=CACHE_TOKENS):
    """The cache of the Llama-7B shape of the knobs with n_kv_heads K/V heads, batch 1."""
    return kv_cache_bytes(LLAMA_LAYERS, n_kv_heads, LLAMA_D_HEAD, tokens, bytes_per_elem=CACHE_BYTES_PER_ELEM)


def print_cache_tables(n_kv_heads):
    """Sections 1 and 2: the Llama-7B shape per configuration (the demo's g marked), then published models."""
    print(f"\n1. KV cache of a Llama-7B-shaped model ({LLAMA_LAYERS} layers, {LLAMA_HEADS} query heads, "
          f"dh={LLAMA_D_HEAD}, {CACHE_BYTES_PER_ELEM}-byte numbers, {CACHE_TOKENS} tokens, batch 1)")
    print("   bytes = 2 (K and V) x layers x K/V heads x dh x tokens x bytes per number")
    mha_bytes = llama_cache_bytes(LLAMA_HEADS)
    print(f"   GB = 1e9 bytes: MHA's {mha_bytes:,} bytes are {mha_bytes / 1e9:.2f} GB but {mha_bytes / 2**30:.2f} GiB")
    g = N_HEADS // n_kv_heads                              # query heads per K/V head in the demo
    rows, same_g = llama_rows(n_kv_heads)                  # same_g: the Llama row with the demo's g
    print("   shrink = h / kv = g, the query heads per K/V head; GQA-N is named by its N K/V heads, not by g")
    print(f"   {'config':<8}{'n_kv_heads':>11}{'KV cache':>11}{'shrink':>8}")
    for kv in rows:
        n = llama_cache_bytes(kv)
        note = (f"   <- g = {g}, as in your demo: its {N_HEADS} query heads over {n_kv_heads}, "
                f"this row's {LLAMA_HEADS} over {kv}")
        print(f"   {attention_kind(LLAMA_HEADS, kv):<8}{kv:>11}{n / 1e9:>8.2f} GB{mha_bytes // n:>7}x"
              f"{note if kv == same_g else ''}")
    if same_g is None:                                     # e.g. N_HEADS = 6, N_KV_HEADS = 2: g = 3
        print(f"   (no row has your demo's g = {g}: {LLAMA_HEADS} query heads do not split into groups of {g})")

    print(f"\n2. Published models at their own shapes ({CACHE_BYTES_PER_ELEM}-byte numbers, {CACHE_TOKENS} tokens, "
          f"batch 1): how many requests fit in {GPU_CACHE_GB} GB of cache")
    print(f"   {'model':<20}{'layers':>7}{'h':>5}{'kv':>5}{'dh':>5}  {'kind':<7}{'KV cache':>11}{'requests':>10}")
    for name, (layers, h, kv, dh) in PUBLISHED_MODELS.items():
        variants = [(name, kv)]
        if name == "Llama-2-70B":                          # the classic worked example: also as MHA and MQA
            variants += [(f"{name} if MHA", h), (f"{name} if MQA", 1)]
        for label, n_kv in variants:
            n = kv_cache_bytes(layers, n_kv, dh, CACHE_TOKENS, bytes_per_elem=CACHE_BYTES_PER_ELEM)
            print(f"   {label:<20}{layers:>7}{h:>5}{n_kv:>5}{dh:>5}  {attention_kind(h, n_kv):<7}"
                  f"{n / 1e9:>8.2f} GB{int(GPU_CACHE_GB * 1e9 // n):>10}")
    print("   The weights are paid once per copy of the model, the cache once per request: with many requests, or\n"
          "   long ones, the cache decides how many fit at a time, and fewer K/V heads let more of them fit.")


# ----------------------------------------------------------------------------- the decode timing and its table
@dataclass
class Ceilings:
    """The two rates a floor is built from: read `bandwidth` bytes/s, compute `flops` FLOP/s."""
    bandwidth: float
    flops: float

    @property
    def ridge(self):
        return self.flops / self.bandwidth                 # the FLOPs per byte at which the two ceilings meet


@dataclass
class DecodeTiming:
    """What measure_decode saw: best seconds {kv: [one per context]} of the steps and of their K/V reads."""
    contexts: tuple
    steps: dict
    reads: dict
    flops: float                                           # the matmul's FLOP/s
    rounds: int = 1
    elsewhere: float = 0.0                                 # cores that other programs kept busy meanwhile

    def ceilings(self, kv, S):
        """The step's two ceilings: how fast its own K and V were read, and how fast a big matmul ran."""
        seconds = self.reads[kv][self.contexts.index(S)]
        return Ceilings(bandwidth=decode_bytes(kv, LLAMA_D_HEAD, S) / seconds, flops=self.flops)

    def floor(self, kv, S):
        """roofline() of the step with kv K/V heads over S cached tokens: (least seconds, bound)."""
        flops, n_bytes = decode_flops(LLAMA_HEADS, LLAMA_D_HEAD, S), decode_bytes(kv, LLAMA_D_HEAD, S)
        return roofline(flops, n_bytes, self.ceilings(kv, S))


def measure_decode(contexts=DECODE_CONTEXTS, kv_heads=LLAMA_KV_HEADS, rounds=DECODE_ROUNDS):
    """Best-of-rounds times of attend's decode step, a sum of its K/V, and a matmul, interleaved (see LABNOTES)."""
    contexts = tuple(sorted(set(contexts)))
    keep_freed_memory()                                    # else each step page-faults its scores in anew
    q = torch.randn(1, LLAMA_HEADS, 1, LLAMA_D_HEAD)       # (B, h, 1, dh): one new token
    a = torch.randn(MATMUL_N, MATMUL_N)
    # Each configuration's K and V, preallocated: (2, B, kv, max_len, dh); its steps read slices (B, kv, S, dh).
    pairs = {kv: torch.full((2, 1, kv, max(contexts), LLAMA_D_HEAD), 0.01) for kv in kv_heads}
    jobs = [("matmul", 0, math.inf, torch.mm, (a, a))]     # (what, kv, S, function, its arguments)
    # Longest context first; at each, every configuration's read, then every step: other data passes through the
    # CPU's caches between a step and its own read, so neither finds its K and V there from the other.
    for S in reversed(contexts):
        jobs += [("reads", kv, S, torch.sum, (pair[:, :, :, :S],)) for kv, pair in pairs.items()]
        jobs += [("steps", kv, S, attend, (q, *pair[:, :, :, :S])) for kv, pair in pairs.items()]
    best = {}
    start = cpu_seconds()                                  # to see what other programs ran meanwhile
    with torch.no_grad():
        for _ in range(rounds):                            # every job once a round: load cannot hit one alone
            for what, kv, S, fn, args in jobs:
                t0 = time.perf_counter()
                fn(*args)
                best[what, kv, S] = min(best.get((what, kv, S), math.inf), time.perf_counter() - t0)
    steps = {kv: [best["steps", kv, S] for S in contexts] for kv in kv_heads}
    reads = {kv: [best["reads", kv, S] for S in contexts] for kv in kv_heads}
    return DecodeTiming(contexts, steps, reads, flops=2 * MATMUL_N**3 / best["matmul", 0, math.inf],
                        rounds=rounds, elsewhere=cores_elsewhere(start))


def timing_contradictions(timing, slack=0.1, busy=0.25):
    """What cannot be true of a quiet machine: other programs busy, a step below its floor, fewer heads slower."""
    problems = [f"other programs kept {timing.elsewhere:.1f} cores busy"] if timing.elsewhere > busy else []
    kinds = sorted(timing.steps, reverse=True)             # most K/V heads first
    for i, S in enumerate(timing.contexts):
        for j, kv in enumerate(kinds):
            t, floor, kind = timing.steps[kv][i], timing.floor(kv, S)[0], attention_kind(LLAMA_HEADS, kv)
            if t < (1 - slack) * floor:
                problems.append(f"{kind} at {S} tokens is {1 - t / floor:.0%} below its floor")
            if j and S >= 1024 and t > (1 + slack) * timing.steps[kinds[j - 1]][i]:
                problems.append(f"{kind} is slower than {attention_kind(LLAMA_HEADS, kinds[j - 1])} at {S} tokens")
    return problems


def print_decode_table(timing, problems):
    """Section 5: the ceilings and floors at the longest context, and what they say (every context is drawn)."""
    h, kinds, s_max = LLAMA_HEADS, list(timing.steps), max(timing.contexts)
    print(f"\n5. Decode step: one layer's attention (attend) over its cache, {h} query heads, dh={LLAMA_D_HEAD}, "
          f"fp32,\n   on {machine_name()}, best of {timing.rounds} rounds. At {s_max} tokens:")
    print("   floor = max(bytes / read rate, FLOPs / matmul rate), both rates timed in the same rounds: the read")
    print(f"   rate is that of a sum over the row's own K and V, the matmul rate a {MATMUL_N}x{MATMUL_N} matmul's, "
          f"{timing.flops / 1e9:.0f} GFLOP/s.")
    print("   ridge = matmul rate / read rate: FLOPs per byte below it are memory-bound, above it compute-bound;")
    print("   bound 'ridge' means the two floors lie within 1 % of each other.")
    print(f"   {'config':<7}{'FLOP/byte':>10}{'read GB/s':>11}{'ridge':>7}  {'bound':<8}{'floor ms':>9}{'measured':>10}"
          f"{'reaches':>9}")
    for kv in kinds:
        (floor, bound), t, roof = timing.floor(kv, s_max), timing.steps[kv][-1], timing.ceilings(kv, s_max)
        print(f"   {attention_kind(h, kv):<7}{h / kv / 2:>10.1f}{roof.bandwidth / 1e9:>11.1f}{roof.ridge:>7.1f}  "
              f"{bound:<8}{floor * 1e3:>9.3f}{t * 1e3:>10.3f}{floor / t:>9.0%}")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        print(f"   NOT TRUSTWORTHY, the machine was busy while timing: {problems[0]}{more}")
        return
    fewest, (gpu_name, gpu_flops, gpu_bandwidth) = min(kinds), GPU
    print(f"   {attention_kind(h, fewest)} reads {h // fewest}x fewer bytes than MHA for the same FLOPs and is "
          f"{timing.steps[h][-1] / timing.steps[fewest][-1]:.1f}x faster. The gap to the floor: PyTorch runs\n"
          "   a step's thin products (g query rows by S keys) below both ceilings; the softmax adds more (LABNOTES.md).\n"
          f"   On an {gpu_name} (ridge {gpu_flops / gpu_bandwidth:.0f} FLOPs/byte) a bf16 step does g FLOPs per "
          "byte: all of these are memory-bound\n   there, at any batch, since each request reads its own cache.")


# ----------------------------------------------------------------------------- figures
def plot_attention_maps(n_kv_heads, seed):
    """Each head's causal attention probabilities on one random sequence."""
    attn = random_module(n_kv_heads, seed + 3)
    x = 2.0 * torch.randn(1, SEQ_LEN, D_MODEL)             # (B=1, T, d); x2 so the maps have contrast
    with torch.no_grad():
        _, p = attn(x, need_weights=True)                  # (1, h, T, T)
    cols = min(4, N_HEADS)
    rows = math.ceil(N_HEADS / cols)
    fig = new_figure(2.2 * cols + 1.2, 2.3 * rows + 0.7)
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    fig.subplots_adjust(left=0.07, right=0.88, bottom=0.1, top=1 - 0.7 / (2.3 * rows + 0.7), hspace=0.3)
    for i, ax in enumerate(axes[:N_HEADS]):
        im = ax.imshow(p[0, i].numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
        ax.set_title(f"query head {i} (K/V head {i // (N_HEADS // n_kv_heads)})", fontsize=9)
        ax.tick_params(labelsize=7)
    for ax in axes[N_HEADS:]:
        ax.set_axis_off()
    axes[(rows - 1) * cols].set_xlabel("key position", fontsize=8)
    axes[(rows - 1) * cols].set_ylabel("query position", fontsize=8)
    fig.colorbar(im, cax=fig.add_axes([0.9, 0.15, 0.015, 0.65]), label="attention probability")
    fig.suptitle(f"Per-head causal attention, {attention_kind(N_HEADS, n_kv_heads)}: {N_HEADS} query heads share "
                 f"{n_kv_heads} K/V heads, d={D_MODEL}, T={SEQ_LEN}\nrandom untrained weights: each row sums "
                 "to 1 over the keys at or before the query", fontsize=10)
    return fig


def plot_cache_sizes(n_kv_heads):
    """KV-cache GB of the Llama-7B shape per row of section 1's table, against context, labelled at CACHE_TOKENS."""
    fig = new_figure(8, 4.8)
    ax = fig.subplots()
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.12, top=0.86)
    context = [2 ** i for i in range(9, 18)]               # 512 .. 131072 tokens
    rows, same_g = llama_rows(n_kv_heads)                  # section 1's rows, its extra one among them
    for kv in rows:
        i = LLAMA_KV_HEADS.index(kv) if kv in LLAMA_KV_HEADS else len(LLAMA_KV_HEADS)   # MHA C0, ..., as elsewhere
        kind, at = attention_kind(LLAMA_HEADS, kv), llama_cache_bytes(kv) / 1e9
        mine = f", g = {N_HEADS // n_kv_heads} as in your demo" if kv == same_g else ""
        ax.plot(context, [llama_cache_bytes(kv, S) / 1e9 for S in context], marker="o", ms=3, color=f"C{i}",
                label=f"{kind} ({kv} K/V heads{mine}): {at:.2f} GB at {CACHE_TOKENS} tokens")
        ax.plot([CACHE_TOKENS], [at], "s", ms=8, color=f"C{i}")
    ax.axhline(GPU_CACHE_GB, color="gray", ls="--", lw=1)
    ax.text(context[0], GPU_CACHE_GB * 1.15, f"{GPU_CACHE_GB} GB of GPU memory set aside for the cache", fontsize=8,
            color="gray")
    log_axes(ax, sorted({*context, CACHE_TOKENS}), [0.001, 0.01, 0.1, 1, 10, 100])   # a tick at each dot and square
    ax.set_ylim(0.001, 150)                                # room for the legend under the MQA line
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("KV cache per request (GB, 1 GB = 1e9 bytes)")
    ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"KV cache of a Llama-7B-shaped model ({LLAMA_LAYERS} layers, {LLAMA_HEADS} query heads, "
                 f"dh={LLAMA_D_HEAD}), {CACHE_BYTES_PER_ELEM}-byte numbers, batch 1", fontsize=10)
    return fig


def plot_head_layout(n_kv_heads):
    """Which query heads read which K/V head, for every valid n_kv_heads of the demo model."""
    from matplotlib.patches import Rectangle
    options = [kv for kv in range(N_HEADS, 0, -1) if N_HEADS % kv == 0]
    height = 1.5 * len(options) + 0.6
    fig = new_figure(max(6.0, 0.75 * N_HEADS + 2.5), height)
    fig.subplots_adjust(left=0.02, right=0.98, bottom=0.02, top=1 - 0.75 / height, hspace=0.35)
    for ax, kv in zip(fig.subplots(len(options), 1, squeeze=False)[:, 0], options):
        g, mine = N_HEADS // kv, kv == n_kv_heads
        for i in range(N_HEADS):                           # query heads, top row, coloured by their K/V head
            ax.add_patch(Rectangle((i + 0.1, 1.0), 0.8, 0.5, color=f"C{i // g % 10}"))
            ax.text(i + 0.5, 1.25, f"q{i}", ha="center", va="center", fontsize=8, color="white")
            ax.plot([i + 0.5, (i // g) * g + g / 2], [1.0, 0.5], color="gray", lw=0.8)
        for j in range(kv):                                # K/V heads, bottom row, under their group
            ax.add_patch(Rectangle((j * g + 0.1, 0.0), g - 0.2, 0.5, color=f"C{j % 10}", alpha=0.85))
            ax.text(j * g + g / 2, 0.25, f"kv{j}", ha="center", va="center", fontsize=8, color="white")
        label = f"{attention_kind(N_HEADS, kv)}: n_kv_heads={kv}, {g} query head{'s' if g > 1 else ''} per K/V head"
        ax.set_title(label + ("   <- your N_KV_HEADS" if mine else ""), fontsize=9, loc="left",
                     fontweight="bold" if mine else "normal")
        ax.set_xlim(-0.1, N_HEADS + 0.1)
        ax.set_ylim(-0.1, 1.6)
        ax.axis("off")
    fig.suptitle(f"Which query heads share which K/V head ({N_HEADS} query heads, coloured by the K/V head they read)",
                 fontsize=11)
    return fig


def plot_stacking():
    """attend's stacking on a toy (h=4, kv=2, T=S=3): the textbook's weights per query head, and attend's blocks."""
    from matplotlib import colormaps
    h, kv, T, dh = 4, 2, 3, 8
    g = h // kv
    torch.manual_seed(0)
    q, k, v = torch.randn(1, h, T, dh), torch.randn(1, kv, T, dh), torch.randn(1, kv, T, dh)
    heads = attend_textbook(q, k, v)[1][0]                 # (h, T, S): one (T, S) block per query head
    blocks = attend(q, k, v)[1].reshape(kv, g * T, T)      # (1, h, T, S) -> (kv, g*T, S): attend's own rows
    cmap = colormaps["viridis"].with_extremes(bad="0.85")  # a masked (future) key: grey

    def draw(ax, weights, rows, title):
        future = causal_mask(T, T).tile(len(rows) // T, 1) < 0          # (rows, S): where the mask is -inf
        ax.imshow(weights.masked_fill(future, float("nan")).numpy(), cmap=cmap, vmin=0.0, vmax=1.0)
        for r in range(len(rows)):
            for c in range(T):
                w = weights[r, c].item()
                ax.text(c, r, "masked" if future[r, c] else f"{w:.2f}", ha="center", va="center", fontsize=7,
                        color="black" if future[r, c] or w > 0.5 else "white")
        ax.set_xticks(range(T), [f"key {j}" for j in range(T)], fontsize=7)
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
        ax.set_title(title, fontsize=8)

    fig = new_figure(10, 5.6)
    grid = fig.add_gridspec(2, 4, width_ratios=[1, 1, 1.3, 1.3], left=0.06, right=0.98, bottom=0.05, top=0.84,
                            wspace=0.6, hspace=0.4)
    for i in range(h):
        copy = " (a copy)" if i % g else ""
        draw(fig.add_subplot(grid[i // 2, i % 2]), heads[i], [f"q{i}t{t}" for t in range(T)],
             f"textbook: q{i} with k{i // g}{copy}")
    for j in range(kv):
        ax = fig.add_subplot(grid[:, 2 + j])
        draw(ax, blocks[j], [f"q{j * g + r // T}t{r % T}" for r in range(g * T)],
             f"attend, block {j}: q{j * g} and q{j * g + 1}\nread k{j} once; the mask tiled")
        ax.axhline(T - 0.5, color="white", lw=2)           # where the block's second query head begins
    fig.suptitle(f"How attend stacks a group (a toy: h={h} query heads, kv={kv} K/V heads, g={g}, T=S={T}): the "
                 "same weights p to rounding, left one\n(T, S) block per query head, K/V copied; right one (g*T, S) "
                 "block per K/V head, read once. Grey: a future key, -inf in the mask, weight 0", fontsize=10)
    return fig


def plot_decode_time(timing, problems):
    """Left: decode time against context, floors dashed. Right: each row's roofline and its step at the longest S."""
    h, dh, contexts, s_max = LLAMA_HEADS, LLAMA_D_HEAD, timing.contexts, max(timing.contexts)
    fig = new_figure(13, 5.4)
    left, right = fig.subplots(1, 2)
    fig.subplots_adjust(left=0.06, right=0.99, bottom=0.11, top=0.82, wspace=0.2)
    flops = decode_flops(h, dh, s_max)
    for i, (kv, row) in enumerate(timing.steps.items()):
        kind = attention_kind(h, kv)
        left.plot(contexts, [t * 1e3 for t in row], marker="o", color=f"C{i}", label=f"{kind} measured")
        left.plot(contexts, [timing.floor(kv, S)[0] * 1e3 for S in contexts], ls="--", color=f"C{i}", lw=1,
                  label=f"{kind} floor")
        roof = timing.ceilings(kv, s_max)                  # each row's own roof: its own read rate
        intensity = sorted([2 ** e for e in range(-3, 11)] + [roof.ridge])   # FLOPs per byte, 1/8 .. 1024
        right.plot(intensity, [min(roof.flops, roof.bandwidth * x) / 1e9 for x in intensity], color=f"C{i}",
                   lw=1 + 1.5 * (len(timing.steps) - 1 - i))   # widest first: a roof under another still shows
        per_byte = flops / decode_bytes(kv, dh, s_max)     # its FLOPs per byte, g / 2
        right.plot([per_byte], [flops / row[-1] / 1e9], "o", ms=8, color=f"C{i}",
                   label=f"{kind}: g / 2 = {h / kv / 2:g} FLOPs per byte; roof {roof.bandwidth / 1e9:.0f} GB/s, "
                         f"ridge {roof.ridge:.1f}")
        right.plot([per_byte, per_byte], [flops / row[-1] / 1e9, flops / timing.floor(kv, s_max)[0] / 1e9],
                   ls=":", lw=1, color=f"C{i}")            # from the step up to its roof: FLOPs / its floor
    log_axes(left, contexts, [0.01, 0.1, 1, 10, 100])
    left.set_xlabel("cached context S (tokens)")
    left.set_ylabel("time per decode step (ms)")
    shared = [S for S in contexts if sum(timing.floor(kv, S)[1] != "memory" for kv in timing.steps) > 1]
    why = ""
    if shared:                                             # contexts where two floors or more are compute-bound
        where = "at every S" if shared == list(contexts) else f"at S = {', '.join(map(str, shared))}"
        why = f";\ncompute-bound floors coincide {where}:\nthe same FLOPs at one matmul rate"
    left.set_title("measured, and its floor from the two rates measured beside it" + why, fontsize=10)
    left.legend(fontsize=7, ncol=2)
    roof = timing.ceilings(h, s_max)                       # MHA's, to place the words
    right.text(roof.ridge / 4, roof.flops / 1e9 / 2.2, "memory-bound:\nthe bytes decide", fontsize=8, ha="right")
    right.text(roof.ridge * 3, roof.flops / 1e9 * 1.3, f"compute-bound: the FLOPs decide\n(matmul "
               f"{roof.flops / 1e9:.0f} GFLOP/s)", fontsize=8)
    gpu_name, gpu_flops, gpu_bandwidth = GPU
    right.axvline(gpu_flops / gpu_bandwidth, color="gray", ls="--", lw=1,
                  label=f"{gpu_name} ridge: {gpu_flops / 1e12:.0f} TFLOP/s bf16 / {gpu_bandwidth / 1e12:.2f} TB/s"
                        f" = {gpu_flops / gpu_bandwidth:.0f} (a bf16 step: g FLOPs/byte)")
    log_axes(right, sorted({0.125, 64, 512, *(h / kv / 2 for kv in timing.steps)}), [1, 10, 100, 1000])   # at the dots
    right.set_xlabel("arithmetic intensity (FLOPs per byte read)")
    right.set_ylabel("GFLOP/s")
    right.set_title(f"Each configuration's roofline (its own read rate, so its own ridge),\n"
                    f"and its step at {s_max} tokens, dotted up to its own roof", fontsize=10)
    right.legend(fontsize=7, loc="lower right")
    title = f"One decode step of one layer's attention, {h} query heads, dh={dh}, fp32, on {machine_name()}"
    if problems:
        title += f"\nNOT TRUSTWORTHY: the machine was busy while timing ({problems[0]})"
    fig.suptitle(title, fontsize=11)
    return fig


def log_axes(ax, xticks, yticks):
    """Log-log axes with ticks at fixed places, labelled in plain numbers."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(xticks, [f"{t:g}" for t in xticks])
    ax.set_yticks(yticks, [f"{t:g}" for t in yticks])
    ax.minorticks_off()


def new_figure(width, height):
    """A Figure on the Agg canvas (no display, no pyplot state); axes placed by hand: auto layouts double the time."""
    from matplotlib.figure import Figure
    return Figure(figsize=(width, height))


def png_bytes(fig):
    """The figure as PNG bytes: Agg's PNG holds no date, so the same code draws the same bytes."""
    import io
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


# ----------------------------------------------------------------------------- plumbing: bad input in one sentence
# What a learner can get wrong ends in one sentence naming the value and the rule, before anything is
# computed or written. What only an adversary builds (caches whose K and V overlap, sparse or nested
# tensors, ...) gets PyTorch's own error.
def whole_number(name, value):
    """value itself if it is an int (not a bool), else one sentence naming it."""
    if isinstance(value, bool) or not isinstance(value, int):     # an int, and not True or False
        raise TypeError(f"{name} must be a whole number, got {value!r}")
    return value


def check_counts(counts):
    """Each knob of [(name, value, least)] a whole number of at least `least`, else one sentence naming it."""
    for name, value, least in counts:
        if whole_number(name, value) < least:
            raise ValueError(f"{name}={value} must be at least {least}")


def check_sizes(d_model, n_heads, n_kv_heads):
    """CausalMHA's sizes: whole numbers, d_model a multiple of n_heads, n_kv_heads a divisor of n_heads."""
    for name, value in (("d_model", d_model), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        whole_number(name, value)
    if n_heads < 1 or d_model < 1 or d_model % n_heads:
        raise ValueError(f"d_model={d_model} must be a positive multiple of n_heads={n_heads}")
    if not 1 <= n_kv_heads <= n_heads or n_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads={n_kv_heads} must be a positive divisor of n_heads={n_heads} "
                         f"(1 = MQA, {n_heads} = MHA, a divisor in between = GQA)")


def check_x(x, d_model, weight):
    """x must be a (B, T, d_model) tensor of at least one token, in weight's dtype and on its device."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[2] != d_model or 0 in x.shape:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be (B, T, d_model={d_model}) with B, T >= 1, got {shape}")
    if x.dtype != weight.dtype or x.device != weight.device:
        raise TypeError(f"x is {x.dtype} on {x.device}, the module {weight.dtype} on {weight.device}: "
                        "convert one of them with .to()")


def check_no_autograd(tensors):
    """A cached call writes the cache in place: refuse it while autograd would follow any of these tensors."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError("decoding with a cache writes it in place, which autograd cannot follow: call "
                           "the module under torch.no_grad() or torch.inference_mode()")


def check_call(attn, x, need_weights, cache, fused):
    """A call attn(x, need_weights, cache, fused) that can work. A refused call leaves the cache as it was."""
    check_x(x, attn.d_model, attn.in_proj.weight)
    if need_weights and fused:
        raise ValueError("need_weights=True needs the written-out attention: the fused call returns no weights")
    if cache is None:
        return
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a KVCache, as new_cache() makes, got {type(cache).__name__}")
    check_no_autograd([x, *attn.parameters()])
    want = (x.shape[0], attn.n_kv_heads, cache.k.shape[2], attn.d_head)   # (B, kv, max_len, dh)
    check_cache_fits(x, {"K": (cache.k, want), "V": (cache.v, want)}, cache.length, cache.k.shape[2])


def check_cache_fits(x, tensors, length, max_len):
    """A cache's {name: (tensor, shape needed)} in x's dtype and device, with room for x (KVCache, mla's too)."""
    for name, (t, want) in tensors.items():
        if tuple(t.shape) != want or t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"the cache holds its {name} as {tuple(t.shape)} in {t.dtype} on {t.device}; this call "
                             f"needs {want} in {x.dtype} on {x.device}: make it with new_cache()")
    if not 0 <= length <= max_len - x.shape[1]:
        raise ValueError(f"the cache holds {length} of its {max_len} tokens: {x.shape[1]} more do not fit")


def check_copyable(ref):
    """from_torch copies only what CausalMHA can compute: self-attention, batch first, no dropout in training."""
    if not isinstance(ref, nn.MultiheadAttention):
        raise TypeError(f"from_torch copies an nn.MultiheadAttention, got {type(ref).__name__}")
    if not (ref.batch_first and ref._qkv_same_embed_dim and ref.bias_k is None and not ref.add_zero_attn):
        raise ValueError("from_torch copies only nn.MultiheadAttention(d, h, batch_first=True) "
                         "without kdim, vdim, add_bias_kv or add_zero_attn")
    if ref.dropout and ref.training:
        raise ValueError(f"from_torch needs dropout=0.0 in training mode (CausalMHA has no dropout), got {ref.dropout}")


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag ends in one line, without the usage block."""
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv=None):
    """The flags, each defaulting to its knob; a bad flag, knob or --out-dir exits 2 in one line."""
    parser = Parser(prog="mha.py", description="Multi-head, grouped-query and multi-query attention: "
                    "checks, KV-cache tables, decode timings and figures.",
                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--n-kv-heads", type=int, default=N_KV_HEADS,
                        help=f"K/V heads of the demo model: {N_HEADS} = MHA, a divisor of {N_HEADS} = GQA, 1 = MQA")
    parser.add_argument("--out-dir", default=OUT_DIR, help="folder the figures are written to")
    parser.add_argument("--seed", type=int, default=SEED, help="seed for every random number")
    args = parser.parse_args(argv)
    try:
        check_sizes(D_MODEL, N_HEADS, args.n_kv_heads)
        check_counts([("SEQ_LEN", SEQ_LEN, 2), ("BATCH", BATCH, 1), ("DECODE_ROUNDS", DECODE_ROUNDS, 1),
                      ("MATMUL_N", MATMUL_N, 1), ("CACHE_TOKENS", CACHE_TOKENS, 1),
                      ("CACHE_BYTES_PER_ELEM", CACHE_BYTES_PER_ELEM, 1),
                      *((f"DECODE_CONTEXTS[{i}]", S, 1) for i, S in enumerate(DECODE_CONTEXTS))])
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    if not DECODE_CONTEXTS:
        parser.error("DECODE_CONTEXTS must hold at least one context length")
    if LLAMA_HEADS not in LLAMA_KV_HEADS or any(not isinstance(kv, int) or kv < 1 or LLAMA_HEADS % kv
                                                for kv in LLAMA_KV_HEADS):
        parser.error(f"LLAMA_KV_HEADS={LLAMA_KV_HEADS} must hold {LLAMA_HEADS} (MHA) and divisors of it only")
    if not 0 <= args.seed < 2**32:
        parser.error(f"--seed {args.seed} must be between 0 and 2**32 - 1")
    problem = out_dir_problem(args.out_dir, FIGURES)
    if problem:
        parser.error(problem)
    return args


def out_dir_problem(folder, names):
    """Why `names` cannot be written into folder, or None: checked at start, the folder made only at the end."""
    if not folder:
        return "--out-dir '' names no folder"
    parent = folder
    while not os.path.isdir(parent):                       # the nearest folder that exists
        if os.path.lexists(parent):
            return f"{parent!r} is not a folder, so the figures cannot go to {folder!r}"
        parent = os.path.dirname(parent.rstrip(os.sep)) or "."
    for path in (os.path.join(folder, name) for name in names):
        if os.path.lexists(path) and not os.path.isfile(path):
            return f"{path!r} exists and is not a file; remove it or choose another --out-dir"
    try:                                                   # a file made there, and gone again at once
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        return f"cannot write into {folder!r}: {e.strerror}"
    return None


def write_figures(prog, folder, pngs):
    """Write {name: PNG bytes} via temporary files renamed into place: no half-written figure; False on failure."""
    temporary = [os.path.join(folder, name + ".tmp") for name in pngs]
    try:
        os.makedirs(folder, exist_ok=True)
        for tmp, png in zip(temporary, pngs.values()):
            with open(tmp, "wb") as f:
                f.write(png)
        for tmp in temporary:
            os.replace(tmp, tmp[:-len(".tmp")])
        return True
    except OSError as e:
        print(f"{prog}: error: cannot write {e.filename!r}: {e.strerror}", file=sys.stderr)
        return False
    finally:
        for tmp in temporary:
            if os.path.exists(tmp):
                os.unlink(tmp)


def machine_name():
    """The CPU the timings ran on, e.g. 'AMD EPYC, 2 threads, AVX2' (the model name Linux reports)."""
    import platform
    name = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        name = names[0] if names else name
    threads = torch.get_num_threads()
    return f"{name}, {threads} thread{'s' if threads > 1 else ''}, {torch.backends.cpu.get_cpu_capability()}"


def keep_freed_memory():
    """For the rest of the process, glibc keeps freed memory: left to itself it may unmap a step's freed 1 MB
    blocks (scores, weights) or trim them off the heap, and the next step pays a page fault per 4 KiB to get
    them back, which a server reusing its buffers does not. Fixed thresholds also stop glibc's own adjusting
    of them. A no-op without glibc."""
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, 1 << 30)                          # M_TRIM_THRESHOLD: keep up to 1 GiB free at the top
        libc.mallopt(-3, 32 << 20)                         # M_MMAP_THRESHOLD: blocks under 32 MiB from the heap
    except (OSError, AttributeError):                      # no glibc (macOS, Windows, musl)
        pass


def cpu_seconds():
    """(wall clock, busy CPU seconds of the machine (/proc/stat), of this process and its children); None off Linux."""
    if not os.path.exists("/proc/stat"):
        return None
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    own = os.times()
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    return time.perf_counter(), busy, own.user + own.system + own.children_user + own.children_system


def cores_elsewhere(start):
    """How many cores other programs kept busy, on average, since start = cpu_seconds(); 0 if unknown."""
    end = cpu_seconds()
    if start is None or end is None or end[0] <= start[0]:
        return 0.0
    return max(0.0, ((end[1] - start[1]) - (end[2] - start[2])) / (end[0] - start[0]))


def run_as_script(main):
    """sys.exit(main()): a closed, full or broken stdout, Ctrl-C and out of memory end in one line, no traceback."""
    import errno
    prog = os.path.basename(sys.argv[0])
    if sys.stdout is None:                                 # python mha.py >&-
        print(f"{prog}: error: standard output is closed", file=sys.stderr)
        sys.exit(1)
    stdout_gone = False
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:                                # the reader went away: nothing more to say
        code, stdout_gone = 1, True
    except KeyboardInterrupt:                              # Ctrl-C: one line and the shell's code for it
        print(f"\n{prog}: interrupted", file=sys.stderr)
        code = 130
    except OSError as e:                                   # python mha.py > /dev/full
        if e.filename is not None or e.errno not in (errno.ENOSPC, errno.EIO):
            raise
        print(f"{prog}: error: cannot write to standard output: {e.strerror}", file=sys.stderr)
        code, stdout_gone = 1, True
    except (MemoryError, RuntimeError) as e:               # PyTorch's words: "can't allocate memory"
        if not isinstance(e, MemoryError) and "allocate memory" not in str(e):
            raise
        print(f"{prog}: error: out of memory; make the knobs smaller", file=sys.stderr)
        code = 1
    if stdout_gone:                                        # so that the exit's own flush of stdout is quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(code)


if __name__ == "__main__":
    run_as_script(main)
