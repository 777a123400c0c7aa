"""
Multi-head attention (MHA) and its grouped-query (GQA) and multi-query (MQA) variants, in one file.

CausalMHA is causal self-attention with one knob, n_kv_heads: equal to n_heads it is MHA
(Vaswani et al. 2017), a divisor of it GQA (Ainslie et al. 2023), 1 MQA (Shazeer 2019). Fewer K/V
heads shrink the KV cache; the run prints by how much for real models, checks our attention
against PyTorch's and draws three figures. Not here: decoding speed (decode.py), quality
(quality.py), trained heads (heads.py), what comes after GQA (mla.py); dropout, padding, positions.
Run:    python mha.py    (a few seconds; writes figures/)    python mha.py --n-kv-heads 2
Shapes: B batch, T new tokens in a call, S keys (tokens cached before the call, plus the T new),
        d model width, h query heads, kv key/value heads, g = h / kv query heads per K/V head,
        dh = d / h head width.
"""

import argparse
import math
import operator
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# ------------------------------------------------------------------ knobs
N_HEADS = 8          # h: query heads of the demo model
N_KV_HEADS = 4       # kv: key/value heads. 8 = MHA, 4 or 2 = GQA, 1 = MQA. Change it and rerun.
D_MODEL = 256        # d: model width, so each head is dh = 256 / 8 = 32 wide
SENTENCE = "the cat sat on the mat and the dog sat on it"   # the demo's T = 12 tokens
BATCH = 2            # B: sequences in the cached-decoding check
SEED = 0             # seeds every random number of the run
TOLERANCE = 2e-6     # allowed where float32 may round otherwise (by a few 1e-7)
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "figures")

# The cache tables: a Llama-7B-shaped model with 32, 8, 4 and 1 K/V heads, then published models.
LLAMA_LAYERS, LLAMA_HEADS, LLAMA_D_HEAD = 32, 32, 128
LLAMA_KV_HEADS = (32, 8, 4, 1)    # MHA, GQA-8, GQA-4, MQA
CACHE_TOKENS = 4096               # tokens in each cache
CACHE_BYTES_PER_ELEM = 2          # bytes per cached number (16-bit)
GPU_CACHE_GB = 40                 # GPU memory for caches, GB (1 GB = 1e9 bytes)


# ------------------------------------------------------------------ one head
# The README's formula, o = softmax(q k^T / sqrt(dh) + mask) v, for one head.
def causal_mask(T, S, dtype=torch.float32):
    """(T, S) mask for the scores: 0 where new token i may see key j, -inf where key j comes later
    (exp(-inf) = 0: no weight). New token i sits at position S - T + i among the keys: at i in a
    whole sequence (T == S), later when S - T keys were cached before it.
    causal_mask(3, 3) == [[0, -inf, -inf], [0, 0, -inf], [0, 0, 0]]   (a whole sequence)
    causal_mask(2, 3) == [[0, 0, -inf], [0, 0, 0]]                    (key 0 cached, 1 and 2 new)
    """
    # T=2, S=3: i = [[1], [2]], j = [[0, 1, 2]], so j > i, pair by pair, is [[F, F, T], [F, F, F]].
    i = torch.arange(T).view(T, 1) + (S - T)               # (T, 1): each new token's position
    j = torch.arange(S).view(1, S)                         # (1, S): each key's position
    future = j > i                                         # (T, S): key j comes after token i
    return torch.zeros(T, S, dtype=dtype).masked_fill(future, float("-inf"))


def attend_one_head(q, k, v):
    """softmax(q k^T / sqrt(dh) + causal mask) v for one head of one sequence; returns o and p.

    q: (T, dh), the queries of the T newest tokens; k, v: (S, dh), the keys and values of all S
    tokens so far, the newest last. Why / sqrt(dh): a score sums dh products; with numbers of
    variance 1 in q and k, each product has variance 1 and the sum dh, so dividing by sqrt(dh)
    brings it back to 1.
    """
    T, dh, S = q.shape[-2], q.shape[-1], k.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(dh)       # (T, dh) @ (dh, S) -> (T, S)
    scores = scores + causal_mask(T, S, q.dtype)           # (T, S): -inf at later keys
    p = scores.softmax(dim=-1)                             # (T, S): each row sums to 1
    return p @ v, p                                        # (T, S) @ (S, dh) -> (T, dh)


# ------------------------------------------------------------------ many heads, sharing K/V
# Head j attends with slice j of each token's q, k and v; query head i reads K/V head i // g.
def attention_kind(n_heads, n_kv_heads):
    """'MHA', 'MQA' or 'GQA-<kv>', named by its K/V heads.  attention_kind(32, 8) == 'GQA-8'."""
    if n_kv_heads == n_heads:
        return "MHA"
    return "MQA" if n_kv_heads == 1 else f"GQA-{n_kv_heads}"


def attend_textbook(q, k, v):
    """attend_one_head on every head of every sequence at once, as textbooks write it.

    q: (B, h, T, dh); k, v: (B, kv, S, dh). The same lines work: @, transpose(-2, -1) and the mask
    act on the last two dimensions and carry B and h along. For GQA each K/V head is first copied
    to its g query heads:

        query heads   q0  q1 | q2  q3          the same picture as k.repeat_interleave(g, dim=1),
        K/V heads       k0   |   k1            [k0, k0, k1, k1]; NOT k.repeat(1, g, 1, 1),
                                               [k0, k1, k0, k1], which silently pairs q1 with k1.
    """
    g = q.shape[1] // k.shape[1]                           # query heads per K/V head
    k = k.repeat_interleave(g, dim=1)                      # (B, kv, S, dh) -> (B, h, S, dh)
    v = v.repeat_interleave(g, dim=1)                      # (B, kv, S, dh) -> (B, h, S, dh)
    return attend_one_head(q, k, v)                        # (B, h, T, dh), (B, h, T, S)


def attend_grouped(q, k, v):
    """attend_textbook's o and p without copying K or V: the path CausalMHA takes.

    A copy costs time: it writes the keys and values out g times before a decode step reads them
    (decode.py measures it). Instead q is viewed in groups, (B, kv, g, T, dh), query heads n*g to
    n*g + g - 1 in group n. The two einsums below compute these loops, all at once:

        for b in range(B):
            for n in range(kv):            # K/V head n
                for i in range(g):         # query head n*g + i
                    o[b, n, i], p[b, n, i] = attend_one_head(q[b, n, i], k[b, n], v[b, n])

    einsum names each dimension by a letter (b batch, n K/V head, i query head in its group, t new
    token, s key, e head width), multiplies where letters agree, and sums over a letter the output
    lacks: "bnite,bnse->bnits" is, for every b, n, i, t, s, the sum over e of q[b, n, i, t, e] times
    k[b, n, s, e]. That is q k^T, with k[b, n] used by all g query heads of group n.
    """
    B, h, T, dh = q.shape
    kv, S = k.shape[1], k.shape[2]
    # Splitting one dimension in two (h = kv x g) never moves a number, so view works even on a
    # transposed q. Merging two into one may need a copy (the end of forward).
    q = q.view(B, kv, h // kv, T, dh)                      # (B, h, T, dh) -> (B, kv, g, T, dh)
    # q * sqrt(1 / dh) is the formula's / sqrt(dh), done first, in PyTorch's order.
    scores = torch.einsum("bnite,bnse->bnits", q * math.sqrt(1.0 / dh), k)   # (B, kv, g, T, S)
    if T > 1:                                              # one new token may see every key
        scores += causal_mask(T, S, q.dtype)               # in place: (T, S) for every b, n, i
    p = scores.softmax(dim=-1)                             # (B, kv, g, T, S)
    o = torch.einsum("bnits,bnse->bnite", p, v)            # (B, kv, g, T, dh)
    # einsum returns o and p in one piece, so view can merge (kv, g) back into h: head n*g + i.
    return o.view(B, h, T, dh), p.view(B, h, T, S)


# ------------------------------------------------------------------ the module, and its cache
@dataclass
class KVCache:
    """The keys and values of every token so far, k, v: (B, kv, max_len, dh); `length` are filled.

    Writing text, each step feeds the newest token alone, forward(x_new, cache=...): its keys and
    values are appended, and it attends to all kept ones. Queries are not kept.
    """
    k: torch.Tensor
    v: torch.Tensor
    length: int = 0

    # forward asks a cache only for these three, `length` and `append`.
    @property
    def shape(self):
        return tuple(self.k.shape)                         # (B, kv, max_len, dh)

    @property
    def dtype(self):
        return self.k.dtype

    @property
    def device(self):
        return self.k.device

    def append(self, k, v):
        """Write k, v: (B, kv, T, dh) after the cached ones; return all of them, (B, kv, S, dh)."""
        S = self.length + k.shape[2]                       # cached + T new
        self.k[:, :, self.length:S] = k                    # (B, kv, T, dh)
        self.v[:, :, self.length:S] = v
        self.length = S
        return self.k[:, :, :S], self.v[:, :, :S]


class CausalMHA(nn.Module):
    """Causal self-attention with h query heads and kv key/value heads (MHA, GQA or MQA).

    One projection, in_proj (W_q, W_k and W_v stacked), makes q, k and v. Its weight is (out, in),
    as nn.Linear keeps it: h*dh rows for the queries, then kv*dh for the keys and kv*dh for the
    values. So fewer K/V heads also mean fewer weights: W_k and W_v shrink by g. With kv == h this
    is nn.MultiheadAttention's in_proj_weight, so from_torch (below) can copy that in.
    """

    def __init__(self, d_model, n_heads, n_kv_heads=None, bias=True):
        super().__init__()
        if n_kv_heads is None:
            n_kv_heads = n_heads                           # the default is MHA
        check_sizes(d_model, n_heads, n_kv_heads)          # one sentence if they cannot work
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.d_head = d_model // n_heads
        self.in_proj = nn.Linear(d_model, (n_heads + 2 * n_kv_heads) * self.d_head, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x, need_weights=False, cache=None, fused=False):
        """x: (B, T, d) -> y: (B, T, d), and the weights p: (B, h, T, S) with need_weights.

        With a cache, x holds only the new tokens. fused=True: the same in one PyTorch call."""
        check_call(self, x, need_weights, cache, fused)    # before the cache is written
        B, T, _ = x.shape
        h, kv, dh = self.n_heads, self.n_kv_heads, self.d_head
        # A token's h*dh numbers are its h heads side by side. A REPL toy, 2 tokens, h=2, dh=2:
        # x = torch.arange(8.).view(1, 2, 4) holds, cut into heads at the bar,
        #     token 0:  0 1 | 2 3
        #     token 1:  4 5 | 6 7
        # x.view(1, 2, 2, 2) makes the cut; .transpose(1, 2) then puts heads before tokens, so
        # x.view(1, 2, 2, 2).transpose(1, 2)[0, 0] is head 0, [[0, 1], [4, 5]]. Without the
        # transpose, x.view(1, 2, 2, 2)[0, 0] is [[0, 1], [2, 3]]: token 0's two heads.
        qkv = self.in_proj(x)                              # (B, T, d) -> (B, T, (h + 2kv) dh)
        q, k, v = qkv.split([h * dh, kv * dh, kv * dh], dim=-1)
        q = q.view(B, T, h, dh).transpose(1, 2)            # (B, T, h*dh) -> (B, h, T, dh)
        k = k.view(B, T, kv, dh).transpose(1, 2)           # (B, T, kv*dh) -> (B, kv, T, dh)
        v = v.view(B, T, kv, dh).transpose(1, 2)           # (B, T, kv*dh) -> (B, kv, T, dh)
        if cache is not None:
            k, v = cache.append(k, v)                      # (B, kv, S, dh), S = cached + T
        if fused:
            # One call that never stores p; enable_gqa=True pairs query head i with K/V head i // g.
            # Its is_causal=True would be wrong with a cache: it lets new token i see keys 0 .. i,
            # where it must see 0 .. S - T + i.
            mask = causal_mask(T, k.shape[2], q.dtype)     # (T, S)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            p = None
        else:
            o, p = attend_grouped(q, k, v)                 # (B, h, T, dh), (B, h, T, S)
        # transpose moves no number, only how the tensor is walked: a token's heads still lie apart
        # in memory, so merging them needs reshape, which copies when it must (view refuses).
        o = o.transpose(1, 2).reshape(B, T, h * dh)        # (B, h, T, dh) -> (B, T, d)
        y = self.out_proj(o)                               # (B, T, d): one matrix mixes the heads
        return (y, p) if need_weights else y

    def new_cache(self, batch, max_len):
        """An empty KVCache for `batch` sequences of up to `max_len` tokens, like the weights."""
        shape = (batch, self.n_kv_heads, max_len, self.d_head)      # (B, kv, max_len, dh)
        like = {"dtype": self.in_proj.weight.dtype, "device": self.in_proj.weight.device}
        return KVCache(torch.zeros(shape, **like), torch.zeros(shape, **like))


# ------------------------------------------------------------------ the KV cache, in bytes
# The weights are paid once per copy of a model, the cache once per request, in every layer: with
# many requests the caches outweigh the weights. Sharing each K/V head among g query heads fits g
# times more requests.
def kv_cache_bytes(n_layers, n_kv_heads, d_head, seq_len, batch=1, bytes_per_elem=2):
    """2 (K and V) x layers x K/V heads x dh x tokens x batch x bytes per number.

    kv_cache_bytes(32, 32, 128, 4096) == 2147483648   (Llama-7B shape, 16-bit, 4k tokens: 2.15 GB)
    """
    return 2 * n_layers * n_kv_heads * d_head * seq_len * batch * bytes_per_elem


# ------------------------------------------------------------------ the checks
def from_torch(ref):
    """A CausalMHA (MHA) with the weights of an nn.MultiheadAttention(d, h, batch_first=True)."""
    bias = ref.in_proj_bias is not None
    attn = CausalMHA(ref.embed_dim, ref.num_heads, bias=bias).to(ref.in_proj_weight.dtype)
    # The names differ by one character: in_proj_weight there, in_proj.weight here.
    weights = {name.replace("in_proj_", "in_proj."): t for name, t in ref.state_dict().items()}
    attn.load_state_dict(weights)
    return attn.train(ref.training)


def check_against_torch(n_kv_heads, seed):
    """Ours against PyTorch on one sequence: MHA to the bit, GQA/MQA within TOLERANCE.

    With nn.MultiheadAttention's weights copied in, our MHA must give PyTorch's own numbers, which
    no wrong reshape could: written out against its need_weights=True path, fused against False.
    """
    T = len(SENTENCE.split())
    print(f"\n4. Against PyTorch on one sequence of {T} tokens, float32: max |ours - theirs|; for "
          "GQA/MQA\n   theirs repeats each K/V head for its query heads (to_torch)")
    torch.manual_seed(seed)
    ref = random_biases(nn.MultiheadAttention(D_MODEL, N_HEADS, batch_first=True).eval())
    x = torch.randn(1, T, D_MODEL)                         # (B=1, T, d)
    copy = from_torch(ref)                                 # PyTorch's weights in ours
    gqa = demo_module(n_kv_heads, seed)                    # ours, with your n_kv_heads
    ok, label = True, f"{attention_kind(N_HEADS, n_kv_heads):<5}"
    pairs = (("MHA  ", copy, ref, 0.0), (label, gqa, to_torch(gqa), TOLERANCE))
    for name, ours, theirs, tol in pairs:
        y, w, y_fused = differences(ours, theirs, x)
        ok &= report(f"{name} written out vs nn.MHA(need_weights=True)", y, tol)
        ok &= report(f"{name} the same, per-head weights p", w, tol)
        ok &= report(f"{name} fused vs nn.MHA(need_weights=False)", y_fused, tol)
    with torch.no_grad():
        sdpa = (gqa(x) - gqa(x, fused=True)).abs().max().item()
    ok &= report(f"{label} written out vs F.sdpa(enable_gqa=True)", sdpa, TOLERANCE)
    # A check that cannot fail proves nothing: a copy with two heads swapped must be caught.
    broken = differences(swap_query_heads(from_torch(ref), 0, 1), ref, x)[0]
    verdict = "DETECTED, as it must be" if broken > TOLERANCE else "NOT DETECTED: FAIL"
    label = "on purpose: query heads 0 and 1 swapped in the copy"
    print(f"  {label:<52} = {broken:.2e}  {verdict}  (must exceed {TOLERANCE:.0e})")
    return ok and broken > TOLERANCE


# ------------------------------------------------------------------ main
# The other checks, the printing, the figures and the flags come after main().
def main(argv=None):
    args = parse_args(argv)        # a bad flag or --out-dir ends here, in one line (exit code 2)
    kv = args.n_kv_heads
    heads = f"{kv} K/V head{'s' if kv > 1 else ''}"
    print(f"Causal attention, d={D_MODEL}, dh={D_MODEL // N_HEADS}, {N_HEADS} query heads reading "
          f"{heads}: {attention_kind(N_HEADS, kv)}, groups of {N_HEADS // kv}")
    print_cache_tables()
    ok = check_cache(kv, args.seed)
    ok &= check_grouped(kv, args.seed)
    ok &= check_against_torch(kv, args.seed)
    figures = {"attention_maps.png": plot_attention_maps(kv, args.seed),
               "kv_cache_size.png": plot_cache_sizes(), "head_layout.png": plot_head_layout(kv)}
    for name, fig in figures.items():
        fig.savefig(os.path.join(args.out_dir, name), dpi=100)
    where = os.path.join(os.path.relpath(args.out_dir), "")
    print(f"\nFigures written to {where}: {', '.join(figures)}")
    print("Now change N_KV_HEADS (or pass --n-kv-heads) and run again. "
          f"All checks: {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


# ------------------------------------------------------------------ the other checks, and helpers
def check_cache(n_kv_heads, seed):
    """Decoding with a cache (a prompt, 2 tokens, then one at a time) gives one full forward."""
    attn = demo_module(n_kv_heads, seed)                   # the demo's shape, random weights
    T = len(SENTENCE.split())
    x = torch.randn(BATCH, T, D_MODEL)                     # (B, T, d)
    sizes = [T // 2, 2] + [1] * (T - T // 2 - 2)           # T = 12: [6, 2, 1, 1, 1, 1]
    print(f"\n3. Our paths against each other, float32: a cache fed chunks of {sizes} tokens\n"
          f"   against one forward over all {T}, then attend_grouped against attend_textbook")
    ok = True
    with torch.no_grad():
        full = attn(x)                                     # (B, T, d)
        for fused in (False, True):
            cache, start, steps = attn.new_cache(BATCH, T), 0, []
            for n in sizes:
                steps.append(attn(x[:, start:start + n], cache=cache, fused=fused))   # (B, n, d)
                start += n
            diff = (torch.cat(steps, dim=1) - full).abs().max().item()
            path = "fused" if fused else "written out"
            ok &= report(f"{path}: max |cached - full forward|", diff, TOLERANCE)
    return ok


def check_grouped(n_kv_heads, seed):
    """attend_grouped gives the textbook's output and weights, also with cached keys (T < S)."""
    torch.manual_seed(seed)
    T, S, dh = 5, 12, D_MODEL // N_HEADS                   # 5 new tokens after 7 cached ones
    q = torch.randn(BATCH, N_HEADS, T, dh)                 # (B, h, T, dh)
    k, v = torch.randn(2, BATCH, n_kv_heads, S, dh)        # each (B, kv, S, dh)
    (o, p), (o_book, p_book) = attend_grouped(q, k, v), attend_textbook(q, k, v)
    diff = max((o - o_book).abs().max().item(), (p - p_book).abs().max().item())
    kind = attention_kind(N_HEADS, n_kv_heads)
    return report(f"{kind:<5} grouped vs textbook, {T} new tokens, {S} keys", diff, TOLERANCE)


def report(label, diff, tol):
    """Print one aligned line of evidence and return whether diff is within tol."""
    ok = diff <= tol
    rule = "must be exactly 0" if tol == 0 else f"tolerance {tol:.0e}"
    print(f"  {label:<52} = {diff:.2e}  {'OK' if ok else 'FAIL'}  ({rule})")
    return ok


def differences(attn, ref, x):
    """max |attn - ref| on x: [written-out output, its weights p, fused output]; ref an nn.MHA."""
    # A float mask: a bool one would send nn.MultiheadAttention down another path (LABNOTES.md).
    float_mask = causal_mask(x.shape[1], x.shape[1], x.dtype)   # (T, T)
    with torch.no_grad():
        # nn.MultiheadAttention takes query, key and value inputs apart: all three are x here.
        y_ref, w_ref = ref(x, x, x, attn_mask=float_mask, need_weights=True,
                           average_attn_weights=False)
        y_ref_fused = ref(x, x, x, attn_mask=float_mask, need_weights=False)[0]
        y, w = attn(x, need_weights=True)
        y_fused = attn(x, fused=True)
    pairs = ((y, y_ref), (w, w_ref), (y_fused, y_ref_fused))
    return [(a - b).abs().max().item() for a, b in pairs]


def demo_module(n_kv_heads, seed):
    """A CausalMHA of the demo's shape from this seed, its biases random like the reference's."""
    torch.manual_seed(seed)
    return random_biases(CausalMHA(D_MODEL, N_HEADS, n_kv_heads).eval())


def random_biases(module):
    """Random biases, in place: nn.MultiheadAttention's zeros would hide a bias in wrong rows."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return module


def to_torch(attn):
    """The nn.MultiheadAttention computing the same function as attn, its K/V heads copied out to h.

    For MHA the exact inverse of from_torch. For GQA/MQA each K/V head's dh rows of weights (and
    bias) are repeated for its g query heads: query head i gets K/V head i // g, [k0, k0, k1, k1].
    """
    h, kv, dh = attn.n_heads, attn.n_kv_heads, attn.d_head
    g = h // kv

    def widen(t):
        """A weight's rows (or a bias's): (h + 2kv) dh -> 3 h dh, K/V head i // g for query i."""
        q, k, v = t.split([h * dh, kv * dh, kv * dh])
        k_heads, v_heads = k.split(dh), v.split(dh)        # kv blocks of dh rows
        k = torch.cat([k_heads[i // g] for i in range(h)])  # kv dh -> h dh rows
        v = torch.cat([v_heads[i // g] for i in range(h)])
        return torch.cat([q, k, v])                        # (3 h dh, d), or (3 h dh,) for a bias

    ref = nn.MultiheadAttention(attn.d_model, h, bias=attn.in_proj.bias is not None,
                                batch_first=True, dtype=attn.in_proj.weight.dtype)
    wide = {}
    for name, t in attn.state_dict().items():
        wide[name.replace("in_proj.", "in_proj_")] = widen(t) if name.startswith("in_proj") else t
    ref.load_state_dict(wide)
    return ref.train(attn.training)


def swap_query_heads(attn, i, j):
    """Swap the query rows of heads i and j in place: a copy with two heads in the wrong order.

    Swapping two heads everywhere (q, k, v and out_proj's columns) would change nothing: their
    outputs would come out swapped, and out_proj's swapped columns would put them back. Swapping
    only their queries pairs head i's queries with head j's keys, as a wrong reshape would.
    """
    dh = attn.d_head
    with torch.no_grad():
        for t in (attn.in_proj.weight, attn.in_proj.bias):
            rows_i, rows_j = t[i * dh:(i + 1) * dh].clone(), t[j * dh:(j + 1) * dh].clone()
            t[i * dh:(i + 1) * dh], t[j * dh:(j + 1) * dh] = rows_j, rows_i
    return attn


# ------------------------------------------------------------------ the cache tables
# Published models: (layers, query heads, K/V heads, head width).
PUBLISHED_MODELS = {
    "Llama-2-7B": (32, 32, 32, 128),
    "Llama-2-70B": (80, 64, 8, 128),
    "Llama-3-8B": (32, 32, 8, 128),
    "Mistral-7B-v0.2": (32, 32, 8, 128),   # v0.1 attends to the last 4096 tokens only
    "Falcon-7B": (32, 71, 1, 64),          # 71 heads is right: 71 x 64 = 4544 = d
    "Falcon-40B": (60, 128, 8, 64),        # both Falcons trained at 2048 tokens: 4096 is a what-if
    "Gemma-2B (v1)": (18, 8, 1, 256),      # Gemma 1, not Gemma-2-2B (26 layers, 4 K/V heads)
}


def cache_bytes(layers, kv, dh, tokens=CACHE_TOKENS):
    """kv_cache_bytes at the tables' number size, batch 1."""
    return kv_cache_bytes(layers, kv, dh, tokens, bytes_per_elem=CACHE_BYTES_PER_ELEM)


def print_cache_tables():
    """Sections 1 and 2: the Llama-7B shape with 32, 8, 4 and 1 K/V heads, then published models."""
    print(f"\n1. KV cache of a Llama-7B-shaped model ({LLAMA_LAYERS} layers, {LLAMA_HEADS} query "
          f"heads, dh={LLAMA_D_HEAD},\n   {CACHE_BYTES_PER_ELEM}-byte numbers, {CACHE_TOKENS} "
          "tokens, batch 1)")
    print("   bytes = 2 (K and V) x layers x K/V heads x dh x tokens x bytes per number")
    mha_bytes = cache_bytes(LLAMA_LAYERS, LLAMA_HEADS, LLAMA_D_HEAD)
    print(f"   GB = 1e9 bytes: MHA's {mha_bytes:,} bytes are {mha_bytes / 1e9:.2f} GB "
          f"but {mha_bytes / 2**30:.2f} GiB")
    print("   shrink = h / kv = g; GQA-N has N K/V heads")
    print(f"   {'config':<8}{'n_kv_heads':>11}{'KV cache':>11}{'shrink':>8}")
    for kv in LLAMA_KV_HEADS:
        n = cache_bytes(LLAMA_LAYERS, kv, LLAMA_D_HEAD)
        kind = attention_kind(LLAMA_HEADS, kv)
        print(f"   {kind:<8}{kv:>11}{n / 1e9:>8.2f} GB{mha_bytes // n:>7}x")

    print(f"\n2. Published models at their own shapes ({CACHE_BYTES_PER_ELEM}-byte numbers, "
          f"{CACHE_TOKENS} tokens, batch 1):\n"
          f"   how many requests fit in {GPU_CACHE_GB} GB of cache")
    print(f"   {'model':<20}{'layers':>7}{'h':>5}{'kv':>5}{'dh':>5}  {'kind':<7}{'KV cache':>11}"
          f"{'requests':>10}")
    for name, (layers, h, kv, dh) in PUBLISHED_MODELS.items():
        variants = [(name, kv)]
        if name == "Llama-2-70B":                          # also as MHA and MQA
            variants += [(f"{name} if MHA", h), (f"{name} if MQA", 1)]
        for label, n_kv in variants:
            n = cache_bytes(layers, n_kv, dh)
            print(f"   {label:<20}{layers:>7}{h:>5}{n_kv:>5}{dh:>5}  {attention_kind(h, n_kv):<7}"
                  f"{n / 1e9:>8.2f} GB{int(GPU_CACHE_GB * 1e9 // n):>10}")
    print("   Weights are paid once per copy of the model, the cache once per request: with many\n"
          "   or long requests the caches decide how many fit, and fewer K/V heads fit more.")


# ------------------------------------------------------------------ figures
def plot_attention_maps(n_kv_heads, seed):
    """Each query head's weights on SENTENCE, titled in the colour of the K/V head it reads."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    words = SENTENCE.split()
    vocab = sorted(set(words))
    torch.manual_seed(seed)
    # A random vector per distinct word (x2 for contrast): the same word, the same vector.
    table = 2.0 * torch.randn(len(vocab), D_MODEL)
    x = table[[vocab.index(w) for w in words]].unsqueeze(0)   # (1, T, d)
    with torch.no_grad():
        _, p = demo_module(n_kv_heads, seed)(x, need_weights=True)   # (1, h, T, T)
    g, cols = N_HEADS // n_kv_heads, min(4, N_HEADS)
    rows = math.ceil(N_HEADS / cols)
    fig = Figure(figsize=(2.6 * cols + 1.2, 2.8 * rows + 0.9))
    fig.subplots_adjust(left=0.06, right=0.9, bottom=0.09, top=1 - 0.9 / (2.8 * rows + 0.9),
                        hspace=0.25, wspace=0.35)
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    cmap = colormaps["viridis"].with_extremes(bad="0.85")  # a future key, masked: light grey
    future = causal_mask(len(words), len(words)) < 0       # (T, T)
    for i, ax in enumerate(axes[:N_HEADS]):
        shown = p[0, i].masked_fill(future, float("nan"))  # (T, T), grey above the diagonal
        im = ax.imshow(shown.numpy(), cmap=cmap, vmin=0.0, vmax=1.0)
        ax.set_title(f"query head {i} reads K/V head {i // g}", fontsize=9, color=f"C{i // g % 10}")
        # Words under the bottom row and left of the left column only.
        bottom, left = i >= N_HEADS - cols, i % cols == 0
        ax.set_xticks(range(len(words)), words if bottom else [], fontsize=6, rotation=90)
        ax.set_yticks(range(len(words)), words if left else [], fontsize=6)
    for ax in axes[N_HEADS:]:
        ax.set_axis_off()
    axes[(rows - 1) * cols].set_xlabel("key (a word it may look at)", fontsize=8)
    axes[(rows - 1) * cols].set_ylabel("query (the word looking)", fontsize=8)
    fig.colorbar(im, cax=fig.add_axes([0.92, 0.15, 0.015, 0.65]),
                 label="attention weight p (each row sums to 1)")
    fig.suptitle(f"{attention_kind(N_HEADS, n_kv_heads)}: {N_HEADS} query heads, {n_kv_heads} K/V "
                 "heads, random weights. A word never looks at a later one (grey).\nA repeated "
                 "word has one key: within a row, every 'the' gets the same weight. Same-coloured "
                 "heads share keys, not queries.", fontsize=10)
    return fig


def plot_cache_sizes():
    """The KV cache of section 1's Llama-7B shapes against context length, a square at 4096."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(8, 4.8))
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.12, top=0.88)
    ax = fig.subplots()
    context = [2 ** i for i in range(9, 18)]               # 512 .. 131072 tokens
    for i, kv in enumerate(LLAMA_KV_HEADS):
        kind = attention_kind(LLAMA_HEADS, kv)
        at = cache_bytes(LLAMA_LAYERS, kv, LLAMA_D_HEAD) / 1e9
        sizes = [cache_bytes(LLAMA_LAYERS, kv, LLAMA_D_HEAD, S) / 1e9 for S in context]
        ax.plot(context, sizes, marker="o", ms=3, color=f"C{i}",
                label=f"{kind} ({kv} K/V heads): {at:.2f} GB at {CACHE_TOKENS} tokens")
        ax.plot([CACHE_TOKENS], [at], "s", ms=8, color=f"C{i}")
    ax.axhline(GPU_CACHE_GB, color="gray", ls="--", lw=1,
               label=f"{GPU_CACHE_GB} GB of GPU memory set aside for caches")
    ax.set(xscale="log", yscale="log")
    ax.set_xticks(context, [f"{S:g}" for S in context])
    ax.set_yticks([0.001, 0.01, 0.1, 1, 10, 100], ["0.001", "0.01", "0.1", "1", "10", "100"])
    ax.minorticks_off()
    ax.set_ylim(0.001, 150)                                # room for the legend under the MQA line
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("KV cache per request (GB, 1 GB = 1e9 bytes)")
    ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"KV cache of a Llama-7B-shaped model ({LLAMA_LAYERS} layers, {LLAMA_HEADS} query "
                 f"heads, dh={LLAMA_D_HEAD}), {CACHE_BYTES_PER_ELEM}-byte numbers, batch 1",
                 fontsize=10)
    return fig


def plot_head_layout(n_kv_heads):
    """Which query heads read which K/V head, for every valid n_kv_heads of the demo model."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle
    options = [kv for kv in range(N_HEADS, 0, -1) if N_HEADS % kv == 0]
    height = 1.5 * len(options) + 0.6
    fig = Figure(figsize=(max(6.0, 0.75 * N_HEADS + 2.5), height))
    fig.subplots_adjust(left=0.02, right=0.98, bottom=0.02, top=1 - 0.75 / height, hspace=0.35)
    for ax, kv in zip(fig.subplots(len(options), 1, squeeze=False)[:, 0], options):
        g, mine = N_HEADS // kv, kv == n_kv_heads
        # Query heads on top, coloured by their K/V head; K/V heads below, under their group.
        for i in range(N_HEADS):
            ax.add_patch(Rectangle((i + 0.1, 1.0), 0.8, 0.5, color=f"C{i // g % 10}"))
            ax.text(i + 0.5, 1.25, f"q{i}", ha="center", va="center", fontsize=8, color="white")
            ax.plot([i + 0.5, (i // g) * g + g / 2], [1.0, 0.5], color="gray", lw=0.8)
        for j in range(kv):
            box = Rectangle((j * g + 0.1, 0.0), g - 0.2, 0.5, color=f"C{j % 10}", alpha=0.85)
            ax.add_patch(box)
            ax.text(j * g + g / 2, 0.25, f"kv{j}", ha="center", va="center", fontsize=8,
                    color="white")
        label = (f"{attention_kind(N_HEADS, kv)}: n_kv_heads={kv}, "
                 f"{g} query head{'s' if g > 1 else ''} per K/V head")
        ax.set_title(label + ("   <- your N_KV_HEADS" if mine else ""), fontsize=9, loc="left",
                     fontweight="bold" if mine else "normal")
        ax.set_xlim(-0.1, N_HEADS + 0.1)
        ax.set_ylim(-0.1, 1.6)
        ax.axis("off")
    fig.suptitle(f"Which query heads share which K/V head ({N_HEADS} query heads, coloured by the "
                 "K/V head they read)", fontsize=11)
    return fig


# ------------------------------------------------------------------ flags, and bad input
def parse_args(argv=None):
    """The flags, each defaulting to its knob. A bad one ends the run in one line, exit code 2."""
    divisors = [kv for kv in range(N_HEADS, 0, -1) if N_HEADS % kv == 0]
    parser = argparse.ArgumentParser(prog="mha.py",
                                     description="MHA, GQA and MQA: cache tables, checks, figures.")
    parser.add_argument("--n-kv-heads", type=int, default=N_KV_HEADS,
                        help=f"K/V heads of the demo: a divisor of {N_HEADS} "
                             f"({N_HEADS} = MHA, 1 = MQA, else GQA)")
    parser.add_argument("--out-dir", default=OUT_DIR, help="folder the figures are written to")
    parser.add_argument("--seed", type=int, default=SEED, help="seed for every random number")
    args = parser.parse_args(argv)
    if args.n_kv_heads not in divisors:                    # the flag, or N_KV_HEADS as edited
        parser.exit(2, f"mha.py: error: n_kv_heads={args.n_kv_heads} must divide "
                       f"N_HEADS={N_HEADS}: one of {divisors}\n")
    try:
        os.makedirs(args.out_dir, exist_ok=True)
    except OSError as e:
        parser.exit(2, f"mha.py: error: --out-dir {args.out_dir!r} cannot be made: {e.strerror}\n")
    return args


def check_sizes(d_model, n_heads, n_kv_heads):
    """CausalMHA's sizes: whole numbers, d_model a multiple of n_heads, n_kv_heads a divisor."""
    for name, value in (("d_model", d_model), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        try:
            operator.index(value)                          # int or numpy.int64, not 64.0
        except TypeError:
            raise TypeError(f"{name} must be a whole number, got {value!r}") from None
    if n_heads < 1 or d_model < 1 or d_model % n_heads:
        raise ValueError(f"d_model={d_model} must be a positive multiple of n_heads={n_heads}")
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads} "
                         f"(1 = MQA, {n_heads} = MHA, a divisor in between = GQA)")


def check_call(attn, x, need_weights, cache, fused):
    """x (B, T, d) like the module's weights; a cache that fits x, refused before it is written."""
    weight = attn.in_proj.weight
    if x.dim() != 3 or x.shape[2] != attn.d_model or 0 in x.shape:
        raise ValueError(f"x must be (B, T, d_model={attn.d_model}) with B, T >= 1, "
                         f"got {tuple(x.shape)}")
    if x.dtype != weight.dtype or x.device != weight.device:
        raise TypeError(f"x is {x.dtype} on {x.device}, the module {weight.dtype} on "
                        f"{weight.device}: convert one of them with .to()")
    if need_weights and fused:
        raise ValueError("need_weights=True needs fused=False: the fused call returns no weights")
    if cache is None:
        return
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        raise RuntimeError("a cached call writes the cache in place, which autograd cannot follow: "
                           "call the module under torch.no_grad()")
    B, T, _ = x.shape
    max_len = cache.shape[2]
    want = (B, attn.n_kv_heads, max_len, attn.d_head)      # (B, kv, max_len, dh)
    if cache.shape != want:
        raise ValueError(f"the cache is {cache.shape}, this call needs {want}: "
                         "make it with new_cache()")
    if cache.dtype != weight.dtype or cache.device != weight.device:
        raise TypeError(f"the cache is {cache.dtype} on {cache.device}, the module {weight.dtype} "
                        f"on {weight.device}: make a new one with new_cache()")
    if cache.length + T > max_len:
        raise ValueError(f"the cache holds {cache.length} of its {max_len} tokens: "
                         f"{T} more do not fit")


if __name__ == "__main__":
    try:
        code = main()
        sys.stdout.flush()                                 # here, so a closed pipe is caught below
    except BrokenPipeError:
        # python mha.py | head: the reader left. End quietly, as Python's documentation advises.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    sys.exit(code)
