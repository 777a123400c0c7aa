"""
Multi-head attention, and its grouped-query (GQA) and multi-query (MQA) variants, in one file.

What this file shows, top to bottom:
  1. CausalMHA: causal self-attention with one knob, n_kv_heads. n_kv_heads == n_heads is multi-head
     attention (MHA, Vaswani et al. 2017); a divisor of n_heads is grouped-query attention (GQA, Ainslie
     et al. 2023), where each group of query heads shares one key/value head; 1 is multi-query attention
     (MQA, Shazeer 2019), where all query heads share a single key/value head.
  2. The proof that every reshape is right: with the weights of PyTorch's own nn.MultiheadAttention
     copied in, CausalMHA gives the same output to the last bit (max difference exactly 0.0).
  3. The KV cache in bytes, for a Llama-7B-shaped model and for published models: that cache, not the
     weights, caps how many users a GPU can serve, and sharing K/V heads shrinks it by n_heads / n_kv_heads.
  4. Decoding with a real cache, token by token, without ever copying K/V back to n_heads.
  5. Decode time against the roofline: a step does g / 2 FLOPs per byte it reads (fp32), so it waits on
     memory below the machine's ridge and on arithmetic above it. Both ceilings are measured in the same
     run, the read rate on the very bytes each step reads, and the timings say so when they contradict
     each other, as they do on a busy machine.
  After main(): printing the decode table and checking it, the figures (attention maps, cache sizes,
  which query heads share which K/V head, decode time against the roofline), and the plumbing.

What it deliberately does not do: train (the weights are random, so the attention maps show the causal
triangle; quality.py measures what GQA costs, mla.py what comes after it), dropout, padding masks,
cross-attention, positional encodings.

Run it:   python mha.py                     (a few seconds on a 2-core CPU; writes figures/)
          python mha.py --n-kv-heads 2      (or edit N_KV_HEADS below, and rerun)

Papers: Vaswani et al. 2017, "Attention Is All You Need", arXiv:1706.03762.
        Shazeer 2019, "Fast Transformer Decoding: One Write-Head Is All You Need", arXiv:1911.02150.
        Ainslie et al. 2023, "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head
        Checkpoints", arXiv:2305.13245.
        Williams, Waterman and Patterson 2009, "Roofline: An Insightful Visual Performance Model for
        Multicore Architectures", Communications of the ACM.

Shapes, one alphabet throughout:
  B batch, T tokens in this call, d model width, h query heads, kv key/value heads, g = h / kv query heads
  per K/V head, dh = d / h head width, S keys a query can see (cached tokens plus the new ones).
"""

import argparse
import errno
import functools
import io
import itertools
import math
import operator
import os
import platform
import sys
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

# The KV-cache table, its figure and the decode timing use Llama-7B-shaped attention.
LLAMA_LAYERS, LLAMA_HEADS, LLAMA_D_HEAD = 32, 32, 128    # layers, query heads, head width
LLAMA_KV_HEADS = (32, 8, 4, 1)    # K/V heads compared: MHA, GQA-8, GQA-4, MQA (each divides 32; 32 is MHA)
CACHE_TOKENS = 4096               # context length of the tables
CACHE_BYTES_PER_ELEM = 2          # bytes per cached number: 2 = fp16/bf16, 1 = fp8, 4 = fp32
GPU_CACHE_GB = 40                 # memory set aside for the cache on one GPU, GB (1 GB = 1e9 bytes)
DECODE_CONTEXTS = (256, 512, 1024, 2048, 4096, 8192)   # cached tokens at which a decode step is timed
DECODE_ROUNDS = 5                 # each decode time is the best of this many rounds
DECODE_MEMORY = 4e9               # bytes of K and V the decode timing may allocate (caps DECODE_CONTEXTS)
MATMUL_N = 512                    # the FLOP/s ceiling: a (512, 512) @ (512, 512) float32 product
GPU = ("H100 SXM", 989e12, 3.35e12)  # for comparison, datasheet: dense bf16 FLOP/s, memory bytes/s

# Published shapes: (layers, query heads, K/V heads, head width).
PUBLISHED_MODELS = {
    "Llama-2-7B": (32, 32, 32, 128),
    "Llama-2-70B": (80, 64, 8, 128),
    "Llama-3-8B": (32, 32, 8, 128),
    "Mistral-7B": (32, 32, 8, 128),
    "Falcon-7B": (32, 71, 1, 64),
    "Falcon-40B": (60, 128, 8, 64),
    "Gemma-2B": (18, 8, 1, 256),
}


# ----------------------------------------------------------------------------- the module
def attention_kind(n_heads, n_kv_heads):
    """'MHA', 'MQA' or 'GQA-<kv>'.  attention_kind(8, 8) == 'MHA'; attention_kind(32, 8) == 'GQA-8'."""
    if n_kv_heads == n_heads:
        return "MHA"
    return "MQA" if n_kv_heads == 1 else f"GQA-{n_kv_heads}"


def causal_mask(T, S, dtype=torch.float32):
    """(T, S) additive mask: 0 where new token i may see key j, -inf where j lies in its future.

    The T new tokens are the last T of the S keys, so token i sees keys 0 .. S - T + i.
    causal_mask(2, 3) == [[0, 0, -inf], [0, 0, 0]]
    Not F.scaled_dot_product_attention(is_causal=True): with T < S it aligns the triangle top-left, so
    new token i would see only keys 0 .. i and miss most of the cache.
    """
    return torch.full((T, S), float("-inf"), dtype=dtype).triu(S - T + 1)


def attend(q, k, v, need_weights=False):
    """softmax(q k^T / sqrt(dh) + causal mask) v, where each K/V head serves its g query heads in place.

    q: (B, h, T, dh), the queries of the T newest tokens; k, v: (B, kv, S, dh), all keys and values so
    far, the T newest last. Returns o: (B, h, T, dh) and, with need_weights, p: (B, h, T, S).

    Query head i reads K/V head i // g, so consecutive query heads form a group (h=4, kv=2, g=2):

        query heads   q0  q1 | q2  q3          the same picture as k.repeat_interleave(g, dim=1),
        K/V heads       k0   |   k1            [k0, k0, k1, k1]; NOT k.repeat(1, g, 1, 1),
                                               [k0, k1, k0, k1], which silently pairs q1 with k1.

    Instead of copying k and v g times, stack each group's g queries as g*T rows of one "head" of
    width dh, so a single K/V head is read once by all of them: the sharing costs no memory.
    """
    B, h, T, dh = q.shape
    kv, S = k.shape[1], k.shape[2]
    g = h // kv
    # Row r of group j is query head j*g + r // T at token r % T. E.g. h=8, kv=2 (g=4), T=3: group 1
    # holds heads 4..7, and its row 5 is head 4 + 5 // 3 = 5 at token 5 % 3 = 2. q is a permuted view
    # of the projection, so this reshape copies q (T tokens' worth); k and v are read where they lie.
    q = q.reshape(B, kv, g * T, dh)                        # (B, kv, g*T, dh)
    # (g*T, S): the (T, S) mask once for each query head of a group. A decode step (T = 1) needs
    # none, since a single new token sees every key.
    mask = causal_mask(T, S, q.dtype).repeat(g, 1) if T > 1 or need_weights else None
    if need_weights:
        # nn.MultiheadAttention's order when it returns weights: q scaled by sqrt(1/dh) first, then
        # q k^T + mask in one baddbmm (another order can change the last bit). This path copies a
        # cache's k and v when it merges B and kv: it is for looking at weights, not for serving.
        q = q * math.sqrt(1.0 / dh)
        scores = torch.baddbmm(mask, q.reshape(B * kv, g * T, dh),  # (B*kv, g*T, dh)
                               k.reshape(B * kv, S, dh).transpose(1, 2))  # (B*kv, dh, S)
        p = scores.softmax(dim=-1)                         # (B*kv, g*T, S)
        o = torch.bmm(p, v.reshape(B * kv, S, dh))         # (B*kv, g*T, dh)
        return o.view(B, h, T, dh), p.view(B, h, T, S)    # (B, h, T, dh), (B, h, T, S)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, kv, g*T, dh)
    return o.reshape(B, h, T, dh), None                    # (B, h, T, dh)


def attend_by_copying(q, k, v):
    """The counter-example: attention after copying each K/V head g times back up to h heads.

    It gives the right answer, but a decode step then writes and reads an MHA-sized copy of the whole
    cache, so MQA becomes slower than MHA: the memory that GQA saved is spent again on every token.
    Kept as the counter-example: a test shows with PyTorch's profiler that it allocates that copy, and
    bench.py times the copy against attend().
    """
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1)                      # (B, h, S, dh), a real copy
    v = v.repeat_interleave(g, dim=1)                      # (B, h, S, dh)
    return F.scaled_dot_product_attention(q, k, v)         # (B, h, 1, dh): a decode step, no mask


@dataclass
class KVCache:
    """Keys and values of every token seen so far, preallocated to max_len tokens.

    k, v: (B, kv, max_len, dh); only the first `length` positions hold tokens. Setting `length` back
    rewinds the cache (what is after it is overwritten by the next step).
    """
    k: torch.Tensor
    v: torch.Tensor
    length: int = 0

    @property
    def nbytes(self):
        return self.k.nbytes + self.v.nbytes

    def append(self, k, v):
        """Write k, v: (B, kv, T, dh) after the cached tokens; return all of them, (B, kv, S, dh)."""
        S = self.length + k.shape[2]
        self.k[:, :, self.length:S] = k
        self.v[:, :, self.length:S] = v
        self.length = S
        return self.k[:, :, :S], self.v[:, :, :S]


class CausalMHA(nn.Module):
    """Causal self-attention with h query heads and kv key/value heads (MHA, GQA or MQA).

    One input projection makes q, k and v. Its output rows are every query head, then every key head,
    then every value head, dh rows each: with kv == h exactly nn.MultiheadAttention's in_proj_weight.
    Every public method first checks its arguments (check_* in the plumbing, after main()), so that a
    mistake ends in one sentence naming the value and the rule, before anything is computed or written.
    """

    def __init__(self, d_model, n_heads, n_kv_heads=None, bias=True):
        super().__init__()
        d_model, n_heads, n_kv_heads = check_sizes(d_model, n_heads, n_kv_heads, bias)
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.d_head = d_model // n_heads
        self.in_proj = nn.Linear(d_model, (n_heads + 2 * n_kv_heads) * self.d_head, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x, need_weights=False, cache=None):
        """x: (B, T, d) -> y: (B, T, d), or (y, attention weights (B, h, T, S)) with need_weights.

        With a cache, x holds only the new tokens: their keys and values are appended to the cache and
        they attend to everything cached before them and to each other, causally.
        """
        B, T = check_call(self, x, need_weights, cache)
        h, kv, dh = self.n_heads, self.n_kv_heads, self.d_head
        # The textbook form projects x as it is and splits the heads off:
        #     q = q.view(B, T, h, dh).transpose(1, 2)      # (B, T, h, dh) -> (B, h, T, dh)
        # We project time-major, (T, B, d), as nn.MultiheadAttention does. The same numbers land in the
        # same places, but on some CPUs the two layouts round differently in the last bit (README,
        # "Identical to the bit"); this way the check against PyTorch is exact on every CPU.
        qkv = self.in_proj(x.transpose(0, 1))              # (T, B, (h + 2kv) dh)
        q, k, v = qkv.split([h * dh, kv * dh, kv * dh], dim=-1)
        q = q.view(T, B, h, dh).permute(1, 2, 0, 3)        # (T, B, h, dh) -> (B, h, T, dh)
        k = k.view(T, B, kv, dh).permute(1, 2, 0, 3)       # (T, B, kv, dh) -> (B, kv, T, dh)
        v = v.view(T, B, kv, dh).permute(1, 2, 0, 3)       # (T, B, kv, dh) -> (B, kv, T, dh)
        if cache is not None:
            k, v = cache.append(k, v)                      # (B, kv, S, dh), S = cached + T
        o, p = attend(q, k, v, need_weights)               # (B, h, T, dh)
        o = o.permute(2, 0, 1, 3).reshape(T * B, h * dh)   # (B, h, T, dh) -> (T*B, d): heads side by side
        y = self.out_proj(o).view(T, B, -1).transpose(0, 1)  # (T*B, d) -> (B, T, d)
        return (y, p) if need_weights else y

    def new_cache(self, batch, max_len):
        """An empty KVCache for `batch` sequences of up to `max_len` tokens, in this module's dtype."""
        batch, max_len = check_cache_size(self, batch, max_len)
        shape = (batch, self.n_kv_heads, max_len, self.d_head)      # (B, kv, max_len, dh)
        dtype = self.in_proj.weight.dtype
        return KVCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))

    @classmethod
    def from_torch(cls, ref):
        """A CausalMHA (MHA) with the weights of an nn.MultiheadAttention(d, h, batch_first=True)."""
        check_copyable(ref)
        has_bias = ref.in_proj_bias is not None
        attn = cls(ref.embed_dim, ref.num_heads, bias=has_bias).to(ref.in_proj_weight.dtype)
        with torch.no_grad():
            attn.in_proj.weight.copy_(ref.in_proj_weight)
            attn.out_proj.weight.copy_(ref.out_proj.weight)
            if has_bias:
                attn.in_proj.bias.copy_(ref.in_proj_bias)
                attn.out_proj.bias.copy_(ref.out_proj.bias)
        return attn.train(ref.training)

    def to_torch(self):
        """The nn.MultiheadAttention computing the same function, K/V heads copied out to h heads.

        For MHA this is the exact inverse of from_torch. For GQA/MQA each K/V head's dh rows of weights
        are repeated for its g query heads (repeat_interleave: [k0, k0, k1, k1], as in attend()).
        """
        h, kv, dh, d = self.n_heads, self.n_kv_heads, self.d_head, self.d_model
        g = h // kv
        has_bias = self.in_proj.bias is not None
        dtype = self.in_proj.weight.dtype
        ref = nn.MultiheadAttention(d, h, bias=has_bias, batch_first=True, dtype=dtype)

        with torch.no_grad():
            w = self.in_proj.weight                        # ((h + 2kv) dh, d), plus the bias as a column:
            if has_bias:                                   # each row's weights and bias travel together
                w = torch.cat([w, self.in_proj.bias.unsqueeze(1)], dim=1)   # ((h + 2kv) dh, d + 1)
            q, k, v = w.split([h * dh, kv * dh, kv * dh])
            k = k.unflatten(0, (kv, dh)).repeat_interleave(g, dim=0).flatten(0, 1)   # (kv, dh, .) -> (h*dh, .)
            v = v.unflatten(0, (kv, dh)).repeat_interleave(g, dim=0).flatten(0, 1)   # (kv, dh, .) -> (h*dh, .)
            w = torch.cat([q, k, v])                       # (3 h dh, d [+ 1])
            ref.in_proj_weight.copy_(w[:, :d])
            ref.out_proj.weight.copy_(self.out_proj.weight)
            if has_bias:
                ref.in_proj_bias.copy_(w[:, d])
                ref.out_proj.bias.copy_(self.out_proj.bias)
        return ref.train(self.training)

    def to_gqa(self, n_kv_heads, pool="mean"):
        """A new CausalMHA with fewer K/V heads, made from this one as Ainslie et al. 2023 (section 2.1) do.

        Queries and out_proj are copied. The K/V heads are cut into n_kv_heads groups of r consecutive
        heads (the groups of repeat_interleave), and each group becomes one head: the mean of its r
        heads' weight and bias rows (pool="mean"), or its first head's (pool="first").
            4 K/V heads to 2, mean:   [k0, k1 | k2, k3] -> [(k0 + k1) / 2, (k2 + k3) / 2]
        A converted model needs some further training ("uptraining") to recover its quality. Where a
        group's heads are already equal, the result computes the same function within rounding (a relative
        1e-6 in float32, 1e-12 in float64): narrower matrices may be multiplied along another code path.
        """
        new_kv = check_to_gqa(self, n_kv_heads, pool)
        kv, h, dh = self.n_kv_heads, self.n_heads, self.d_head
        r = kv // new_kv

        def pool_heads(t):                                 # rows of r*new_kv heads -> rows of new_kv heads
            t = t.unflatten(0, (new_kv, r, dh))            # (new_kv*r*dh, ...) -> (new_kv, r, dh, ...)
            pooled = t[:, 0] if pool == "first" else t.mean(1)   # (new_kv, dh, ...)
            return pooled.flatten(0, 1)                    # (new_kv*dh, ...)

        def narrow(t):                                     # rows (h + 2kv) dh -> (h + 2 new_kv) dh
            q, k, v = t.split([h * dh, kv * dh, kv * dh])
            return torch.cat([q, pool_heads(k), pool_heads(v)])

        has_bias = self.in_proj.bias is not None
        out = CausalMHA(self.d_model, h, new_kv, bias=has_bias).to(self.in_proj.weight.dtype)
        with torch.no_grad():
            out.in_proj.weight.copy_(narrow(self.in_proj.weight))
            out.out_proj.weight.copy_(self.out_proj.weight)
            if has_bias:
                out.in_proj.bias.copy_(narrow(self.in_proj.bias))
                out.out_proj.bias.copy_(self.out_proj.bias)
        return out.train(self.training)


# ----------------------------------------------------------------------------- checks against PyTorch
def max_diff_vs_torch(attn, x, ref=None, need_weights=False):
    """max |ours - nn.MultiheadAttention| on x, for the output (and the per-head weights if asked).

    ref defaults to attn.to_torch(). The reference gets the float causal mask (-inf above the
    diagonal), as a user of PyTorch would write it. Returns (output diff, weights diff or None).
    """
    ref = attn.to_torch() if ref is None else ref
    T = x.shape[1]
    with torch.no_grad():
        y_ref, w_ref = ref(x, x, x, attn_mask=causal_mask(T, T, x.dtype), need_weights=need_weights,
                           average_attn_weights=False)
        if not need_weights:
            return (attn(x) - y_ref).abs().max().item(), None
        y, w = attn(x, need_weights=True)
    return (y - y_ref).abs().max().item(), (w - w_ref).abs().max().item()


def max_diff_vs_sdpa(attn, x):
    """max |ours - F.scaled_dot_product_attention(enable_gqa=True)| on x, projections done by hand.

    By hand means the textbook way, batch-major, which can round differently in the last bit (see forward):
    so this check has a tolerance. is_causal=True is right here, where T == S (see causal_mask).
    """
    B, T, _ = x.shape
    h, kv, dh = attn.n_heads, attn.n_kv_heads, attn.d_head
    with torch.no_grad():
        q, k, v = attn.in_proj(x).split([h * dh, kv * dh, kv * dh], dim=-1)
        q = q.view(B, T, h, dh).transpose(1, 2)            # (B, T, h, dh) -> (B, h, T, dh)
        k = k.view(B, T, kv, dh).transpose(1, 2)           # (B, T, kv, dh) -> (B, kv, T, dh)
        v = v.view(B, T, kv, dh).transpose(1, 2)           # (B, T, kv, dh) -> (B, kv, T, dh)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, h, T, dh)
        y_ref = attn.out_proj(o.transpose(1, 2).reshape(B, T, h * dh))  # (B, h, T, dh) -> (B, T, d)
        return (attn(x) - y_ref).abs().max().item()


def swap_query_heads(attn, i, j):
    """Swap the query rows of heads i and j in place: a copy with two heads in the wrong order.

    Swapping two heads everywhere (their q, k, v rows and their columns of out_proj) would change
    nothing, since the heads are summed in the end. Swapping them in one place only pairs head i's
    queries with head j's keys: the kind of mistake a wrong reshape makes.
    """
    if not (0 <= i < attn.n_heads and 0 <= j < attn.n_heads):
        raise ValueError(f"query heads {i} and {j} must both lie in 0 .. {attn.n_heads - 1}")
    dh = attn.d_head
    with torch.no_grad():
        for t in (attn.in_proj.weight, attn.in_proj.bias):
            if t is not None:
                rows_i, rows_j = t[i * dh:(i + 1) * dh].clone(), t[j * dh:(j + 1) * dh].clone()
                t[i * dh:(i + 1) * dh], t[j * dh:(j + 1) * dh] = rows_j, rows_i
    return attn


def report(label, diff, tol):
    """Print one aligned line of evidence and return whether diff is within tol."""
    ok = diff <= tol
    rule = "must be exactly 0" if tol == 0 else f"tolerance {tol:.0e}"
    print(f"  {label:<52} = {diff:.2e}  {'OK' if ok else 'FAIL'}  ({rule})")
    return ok


def random_biases(module, seed):
    """Give every bias of module random values, in place, and return module.

    nn.MultiheadAttention starts with zero biases, which would hide a bias copied to the wrong rows.
    """
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return module


def demo_reference(seed):
    """The nn.MultiheadAttention the checks copy (random biases) and the input x: (B, T, d) they run on."""
    torch.manual_seed(seed)
    ref = random_biases(nn.MultiheadAttention(D_MODEL, N_HEADS, batch_first=True).eval(), seed + 1)
    return ref, torch.randn(BATCH, SEQ_LEN, D_MODEL)


def run_checks(n_kv_heads, seed):
    """The evidence that the module is right. Returns True if every check passes."""
    print(f"1. Checks against PyTorch (float32, B={BATCH}, T={SEQ_LEN}, d={D_MODEL}, h={N_HEADS})")
    ref, x = demo_reference(seed)
    copy = CausalMHA.from_torch(ref)
    y_diff, _ = max_diff_vs_torch(copy, x, ref)
    ok = report("MHA   max |ours - nn.MultiheadAttention|", y_diff, 0.0)
    y_diff, w_diff = max_diff_vs_torch(copy, x, ref, need_weights=True)
    ok &= report("MHA   same, need_weights=True: outputs", y_diff, 0.0)
    ok &= report("MHA   same, need_weights=True: per-head weights", w_diff, 0.0)

    kind = attention_kind(N_HEADS, n_kv_heads)
    torch.manual_seed(seed + 2)
    ours = random_biases(CausalMHA(D_MODEL, N_HEADS, n_kv_heads).eval(), seed + 3)
    y_diff, _ = max_diff_vs_torch(ours, x)
    ok &= report(f"{kind:<5} max |ours - nn.MHA with K/V heads repeated|", y_diff, 2e-6)
    y_diff, w_diff = max_diff_vs_torch(ours, x, need_weights=True)
    ok &= report(f"{kind:<5} same, need_weights=True: outputs", y_diff, 2e-6)
    ok &= report(f"{kind:<5} same, need_weights=True: per-head weights", w_diff, 2e-6)
    ok &= report(f"{kind:<5} max |ours - F.sdpa(enable_gqa=True)|", max_diff_vs_sdpa(ours, x), 2e-6)

    broken, _ = max_diff_vs_torch(swap_query_heads(CausalMHA.from_torch(ref), 0, 1), x, ref)
    print(f"  {'on purpose: query heads 0 and 1 swapped in the copy':<52} = {broken:.2e}  "
          f"{'FAIL, as it must' if broken > 0 else 'NOT DETECTED'}")
    return ok and broken > 0


# ----------------------------------------------------------------------------- the KV cache, in bytes
def kv_cache_bytes(n_layers, n_kv_heads, d_head, seq_len, batch=1, bytes_per_elem=2):
    """Bytes of the KV cache: 2 (K and V) x layers x K/V heads x dh x tokens x batch x bytes per number.

    kv_cache_bytes(32, 32, 128, 4096) == 2147483648   (Llama-7B shape, fp16, 4k tokens: 2.15 GB)
    """
    return 2 * n_layers * n_kv_heads * d_head * seq_len * batch * bytes_per_elem


def llama_cache_bytes(n_kv_heads, tokens=CACHE_TOKENS):
    """The cache of the Llama-7B shape above with n_kv_heads K/V heads, batch 1."""
    return kv_cache_bytes(LLAMA_LAYERS, n_kv_heads, LLAMA_D_HEAD, tokens, bytes_per_elem=CACHE_BYTES_PER_ELEM)


def gb(n_bytes):
    return n_bytes / 1e9


def cache_dtype():
    """The number format CACHE_BYTES_PER_ELEM stands for, for titles: 'fp16' for 2 bytes."""
    return {1: "fp8", 2: "fp16", 4: "fp32"}.get(CACHE_BYTES_PER_ELEM, f"{CACHE_BYTES_PER_ELEM}-byte numbers")


def print_cache_table(n_kv_heads):
    """The Llama-7B-shaped table, with the row whose group size g is the demo's marked (and added if missing)."""
    print(f"\n2. KV cache of a Llama-7B-shaped model ({LLAMA_LAYERS} layers, {LLAMA_HEADS} query heads, "
          f"dh={LLAMA_D_HEAD}, {cache_dtype()}, {CACHE_TOKENS} tokens, batch 1)")
    print("   bytes = 2 (K and V) x layers x K/V heads x dh x tokens x bytes per number")
    mha_bytes = llama_cache_bytes(LLAMA_HEADS)
    print(f"   GB = 1e9 bytes: MHA's {mha_bytes:,} bytes are {gb(mha_bytes):.2f} GB but {mha_bytes / 2**30:.2f} GiB")
    g = N_HEADS // n_kv_heads                              # query heads per K/V head in the demo
    same_g = LLAMA_HEADS // g if LLAMA_HEADS % g == 0 else None
    rows = set(LLAMA_KV_HEADS)
    if same_g is not None:
        rows.add(same_g)
    print(f"   {'config':<8}{'n_kv_heads':>11}{'KV cache':>11}{'shrink':>8}")
    for kv in sorted(rows, reverse=True):
        n = llama_cache_bytes(kv)
        note = f"   <- g = {g} query heads per K/V head, as in your demo" if kv == same_g else ""
        print(f"   {attention_kind(LLAMA_HEADS, kv):<8}{kv:>11}{gb(n):>8.2f} GB{mha_bytes // n:>7}x{note}")
    if same_g is None:
        print(f"   (your demo's g = {g} does not divide {LLAMA_HEADS} query heads: no row has it)")


def published_rows():
    """(name, layers, h, kv, dh, cache bytes at CACHE_TOKENS tokens, requests that fit in GPU_CACHE_GB)."""
    rows = []
    for name, (layers, h, kv, dh) in PUBLISHED_MODELS.items():
        variants = [(name, kv)]
        if name == "Llama-2-70B":        # the classic worked example: also as MHA and as MQA
            variants += [(f"{name} if MHA", h), (f"{name} if MQA", 1)]
        for label, n_kv in variants:
            n = kv_cache_bytes(layers, n_kv, dh, CACHE_TOKENS, bytes_per_elem=CACHE_BYTES_PER_ELEM)
            rows.append((label, layers, h, n_kv, dh, n, int(GPU_CACHE_GB * 1e9 // n)))
    return rows


def print_published_table():
    print(f"\n3. Published models at their own shapes ({cache_dtype()}, {CACHE_TOKENS} tokens, batch 1): "
          f"how many requests fit in {GPU_CACHE_GB} GB of cache")
    print(f"   {'model':<20}{'layers':>7}{'h':>5}{'kv':>5}{'dh':>5}  {'kind':<7}{'KV cache':>11}{'requests':>10}")
    for label, layers, h, kv, dh, n, fit in published_rows():
        print(f"   {label:<20}{layers:>7}{h:>5}{kv:>5}{dh:>5}  {attention_kind(h, kv):<7}"
              f"{gb(n):>8.2f} GB{fit:>10}")
    print("   The weights are paid once per GPU; the cache once per request. So the cache decides how many"
          "\n   users one GPU serves at a time, and GQA/MQA multiply that number by h / kv.")


# ----------------------------------------------------------------------------- decoding with a cache
def check_cache(n_kv_heads, seed):
    """Real caches: their bytes against the formula, and cached decoding against one full forward."""
    ok, max_len = True, 512
    print(f"\n4. Decoding with a real cache (d={D_MODEL}, h={N_HEADS}, dh={D_MODEL // N_HEADS}, fp32)")
    for kv in sorted({N_HEADS, n_kv_heads, 1}, reverse=True):
        cache = CausalMHA(D_MODEL, N_HEADS, kv).new_cache(batch=1, max_len=max_len)
        want = kv_cache_bytes(1, kv, D_MODEL // N_HEADS, max_len, bytes_per_elem=4)
        ok &= cache.nbytes == want
        print(f"  {attention_kind(N_HEADS, kv):<5} {max_len}-token cache: {cache.nbytes:>9,} bytes allocated, "
              f"{want:>9,} by the formula  {'OK' if cache.nbytes == want else 'FAIL'}")

    # Feed a prompt as one chunk, then the rest one token at a time; compare with one forward over all.
    torch.manual_seed(seed + 4)
    attn = random_biases(CausalMHA(D_MODEL, N_HEADS, n_kv_heads).eval(), seed + 5)
    x = torch.randn(BATCH, SEQ_LEN, D_MODEL)
    cache, prompt = attn.new_cache(BATCH, SEQ_LEN), SEQ_LEN // 2
    with torch.no_grad():
        full = attn(x)
        steps = [attn(x[:, :prompt], cache=cache)]
        steps += [attn(x[:, t:t + 1], cache=cache) for t in range(prompt, SEQ_LEN)]
    diff = relative_diff(torch.cat(steps, dim=1), full)
    print(f"  {attention_kind(N_HEADS, n_kv_heads)} cache fed {prompt} tokens, then {SEQ_LEN - prompt} one at a time:")
    return ok & report("      max |cached - full forward| / max |full forward|", diff, 1e-5)


def relative_diff(a, b):
    """max |a - b| / max |b|: a difference in units of b's own size, so it does not grow with the input's scale."""
    return ((a - b).abs().max() / b.abs().max()).item()


# ----------------------------------------------------------------------------- decode time: a roofline
# A decode step (T = 1) of one layer does 4 h S dh FLOPs (q k^T and p v, 2 per multiply-add) and reads
# 2 kv S dh numbers (K and V): h / (2 kv) = g / 2 FLOPs per byte in fp32, g in a 16-bit type. A machine
# has two ceilings, the bytes per second it reads and the FLOPs per second it computes, so
#     least time of a step = max(bytes / bandwidth, FLOPs / peak FLOP/s)        (the roofline)
# Below the ridge, peak / bandwidth FLOPs per byte, the bytes decide (memory-bound); above it, the FLOPs.
# How fast bytes can be read depends on where they lie: a few MB stay in the CPU's caches, hundreds of
# MB come from memory. So each step's read ceiling is measured on its own K and V.
def decode_flops(n_heads, d_head, S):
    """FLOPs of one new token's attention over S keys: 4 h S dh.  decode_flops(32, 128, 4096) == 67108864"""
    return 4 * n_heads * S * d_head


def decode_bytes(n_kv_heads, d_head, S, bytes_per_elem=4):
    """Bytes it reads, one layer's K and V.  decode_bytes(32, 128, 4096) == 134217728 in fp32."""
    return kv_cache_bytes(1, n_kv_heads, d_head, S, bytes_per_elem=bytes_per_elem)


@dataclass
class Ceilings:
    """What a machine can do at most: read `bandwidth` bytes/s, compute `flops` FLOP/s."""
    bandwidth: float
    flops: float

    @property
    def ridge(self):
        """The FLOPs per byte at which the two ceilings meet."""
        return self.flops / self.bandwidth


def roofline(flops, n_bytes, ceilings):
    """(least seconds, 'memory' or 'compute'): max(bytes / bandwidth, FLOPs / peak) and which one it is.

    roofline(100, 10, Ceilings(bandwidth=1, flops=100)) == (10.0, 'memory'): 10 FLOPs a byte, ridge 100.
    """
    memory, compute = n_bytes / ceilings.bandwidth, flops / ceilings.flops
    return (memory, "memory") if memory >= compute else (compute, "compute")


@dataclass
class DecodeTiming:
    """What measure_decode saw. steps and reads: {kv: [seconds, one per context]}, the best round of a
    decode step and of one read of the same K and V; flops: a float32 matmul's FLOP/s; elsewhere: how
    many of the machine's cores other programs kept busy meanwhile (0 on a quiet machine)."""
    contexts: tuple
    steps: dict
    reads: dict
    flops: float
    rounds: int = 1
    elsewhere: float = 0.0

    def ceilings(self, kv, S):
        """The step's two ceilings: the rate at which its own K and V were read, and the matmul's FLOP/s."""
        seconds = self.reads[kv][self.contexts.index(S)]
        return Ceilings(bandwidth=decode_bytes(kv, LLAMA_D_HEAD, S) / seconds, flops=self.flops)

    def floor(self, kv, S):
        """roofline() of the step with kv K/V heads over S cached tokens: (least seconds, bound)."""
        flops, n_bytes = decode_flops(LLAMA_HEADS, LLAMA_D_HEAD, S), decode_bytes(kv, LLAMA_D_HEAD, S)
        return roofline(flops, n_bytes, self.ceilings(kv, S))

    def memory(self):
        """The ceilings of the largest K and V (the most K/V heads, the longest context): read from memory."""
        return self.ceilings(max(self.steps), max(self.contexts))


def measure_decode(contexts=DECODE_CONTEXTS, kv_heads=LLAMA_KV_HEADS, rounds=DECODE_ROUNDS):
    """Time one decode step of one layer's attention for every K/V head count and context: a DecodeTiming.

    Every configuration's K and V lie side by side in one buffer, as a server preallocates them (their
    contents do not change the time). A round times one matrix multiply, then, longest context first,
    each step and right after it a read of the same K and V. The step finds its bytes where the steps
    before left them; the read finds them as near as they can be, so its rate is a ceiling the step
    cannot beat. Every round visits every measurement, so a moment of load from elsewhere cannot land
    on one alone, and each keeps its best round (the first, which warms up, rarely counts).
    """
    contexts = tuple(sorted(set(contexts)))
    h, dh, s_max = LLAMA_HEADS, LLAMA_D_HEAD, max(contexts)
    pool = torch.full((sum(2 * kv * s_max * dh for kv in kv_heads),), 0.01)   # float32, written: in memory
    pairs, start = {}, 0
    for kv in kv_heads:
        n = 2 * kv * s_max * dh
        pairs[kv] = pool[start:start + n].view(2, 1, kv, s_max, dh)   # K and V: (2, B, kv, s_max, dh)
        start += n
    q = torch.randn(1, h, 1, dh)                           # (B, h, 1, dh): one new token
    a, b = torch.randn(MATMUL_N, MATMUL_N), torch.randn(MATMUL_N, MATMUL_N)
    jobs = {"matmul": (torch.mm, a, b)}                    # key: (function, its arguments), in round order
    for S in reversed(contexts):
        for kv in kv_heads:
            k, v = pairs[kv][:, :, :, :S]                  # (B, kv, S, dh) each
            jobs["step", kv, S] = (attend, q, k, v)
            jobs["read", kv, S] = (torch.sum, pairs[kv][:, :, :, :S])   # the same bytes, (2, B, kv, S, dh)
    best = dict.fromkeys(jobs, float("inf"))
    start = cpu_seconds()                                  # to see what other programs ran meanwhile
    with torch.no_grad():
        for _ in range(rounds):
            for key, (fn, *args) in jobs.items():
                t0 = time.perf_counter()
                fn(*args)
                best[key] = min(best[key], time.perf_counter() - t0)
    return DecodeTiming(contexts, steps={kv: [best["step", kv, S] for S in contexts] for kv in kv_heads},
                        reads={kv: [best["read", kv, S] for S in contexts] for kv in kv_heads},
                        flops=2 * MATMUL_N**3 / best["matmul"], rounds=rounds, elsewhere=cores_elsewhere(start))


# ----------------------------------------------------------------------------- main
def main(argv=None):
    args = parse_args(argv)        # a bad flag, knob or --out-dir ends here, in one line (exit code 2)
    kv = args.n_kv_heads
    print(f"Causal attention, d={D_MODEL}, dh={D_MODEL // N_HEADS}, {N_HEADS} query heads reading {kv} K/V "
          f"head{'s' if kv > 1 else ''}: {attention_kind(N_HEADS, kv)}, groups of {N_HEADS // kv}\n")
    ok = run_checks(kv, args.seed)
    print_cache_table(kv)
    print_published_table()
    ok &= check_cache(kv, args.seed)
    timing = measure_decode(DECODE_CONTEXTS, LLAMA_KV_HEADS, DECODE_ROUNDS)
    problems = timing_contradictions(timing)
    print_decode_table(timing, problems)

    figures = {"attention_maps.png": plot_attention_maps(kv, args.seed),
               "kv_cache_size.png": plot_cache_sizes(),
               "head_layout.png": plot_head_layout(kv),
               "decode_time.png": plot_decode_time(timing, problems)}
    if not write_figures("mha.py", args.out_dir, {name: png_bytes(fig) for name, fig in figures.items()}):
        return 1
    print(f"\nFigures written to {shown_path(args.out_dir)}: {', '.join(figures)}")
    print(f"Now change N_KV_HEADS (or pass --n-kv-heads) and run again. All checks: {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


# ----------------------------------------------------------------------------- the decode table, and its self-check
# What main() prints of the timing, and what it checks before it draws a conclusion from it.
def timing_contradictions(timing, slack=0.1, elsewhere=0.25):
    """What in the measurements cannot be true of a quiet machine; [] when they hold together.

    Other programs keeping more than `elsewhere` of a core busy; a step more than `slack` faster than its
    roofline floor; or, from 1024 cached tokens on, a step more than `slack` slower than the same step with
    more K/V heads (more bytes, the same FLOPs). The best of several rounds hides a moment of load, not a
    program that runs throughout, so that one is measured directly.
    """
    problems = []
    if timing.elsewhere > elsewhere:
        problems.append(f"other programs kept {timing.elsewhere:.1f} cores busy")
    for kv, row in timing.steps.items():
        for S, t in zip(timing.contexts, row):
            floor, _ = timing.floor(kv, S)
            if t < (1 - slack) * floor:
                problems.append(f"{attention_kind(LLAMA_HEADS, kv)} at {S} tokens is {1 - t / floor:.0%} "
                                "below its floor")
    ordered = sorted(timing.steps, reverse=True)
    for i, S in enumerate(timing.contexts):
        for more, fewer in itertools.pairwise(ordered):
            if S >= 1024 and timing.steps[fewer][i] > (1 + slack) * timing.steps[more][i]:
                problems.append(f"{attention_kind(LLAMA_HEADS, fewer)} is slower than "
                                f"{attention_kind(LLAMA_HEADS, more)} at {S} tokens")
    return problems


def print_decode_table(timing, problems):
    h, dh, contexts, kinds = LLAMA_HEADS, LLAMA_D_HEAD, timing.contexts, list(timing.steps)
    s_max, i_max = max(contexts), len(contexts) - 1
    rates = {(kv, S): timing.ceilings(kv, S).bandwidth for kv in kinds for S in contexts}
    fastest = max(rates, key=rates.get)
    memory = timing.memory()
    print(f"\n5. Decode step: one layer's attention over its cache ({h} query heads, dh={dh}, fp32), "
          f"best of {timing.rounds}")
    print(f"   on {machine_name()}. The ceilings, measured in the same rounds:")
    print(f"   float32 matmul   {timing.flops / 1e9:.0f} GFLOP/s")
    faster = rates[fastest] > 1.2 * memory.bandwidth       # did smaller K and V read 20 % faster than memory?
    print(f"   reading K and V  {memory.bandwidth / 1e9:.1f} GB/s for {attention_kind(h, max(kinds))}'s "
          f"{decode_bytes(max(kinds), dh, s_max) / 1e6:,.0f} MB at {s_max} tokens (from memory)")
    if faster:
        print(f"                    up to {rates[fastest] / 1e9:.0f} GB/s for {attention_kind(h, fastest[0])}'s "
              f"{decode_bytes(fastest[0], dh, fastest[1]) / 1e6:,.1f} MB at {fastest[1]} tokens (in the CPU caches)")
    else:
        print("                    and no smaller K and V read faster: the CPU caches did not help here")
    print(f"   From memory, the ridge is at {memory.ridge:.1f} FLOPs per byte.")
    print("   A step does 4 h S dh FLOPs on 2 kv S dh numbers of 4 bytes: g / 2 FLOPs per byte.")
    print("   floor = max(bytes / read, FLOPs / matmul), the least time a step can take; at "
          f"{s_max} tokens, in ms:")
    print(f"   {'config':<7}{'FLOP/byte':>10}  {'bound':<8}{'bytes/read':>11}{'FLOPs/mm':>10}{'floor':>8}"
          f"{'measured':>10}{'reaches':>9}")
    for kv in kinds:
        n_bytes, n_flops = decode_bytes(kv, dh, s_max), decode_flops(h, dh, s_max)
        ceilings = timing.ceilings(kv, s_max)
        floor, bound = timing.floor(kv, s_max)
        t = timing.steps[kv][i_max]
        print(f"   {attention_kind(h, kv):<7}{n_flops / n_bytes:>10.1f}  {bound:<8}"
              f"{n_bytes / ceilings.bandwidth * 1e3:>11.3f}{n_flops / ceilings.flops * 1e3:>10.3f}"
              f"{floor * 1e3:>8.3f}{t * 1e3:>10.3f}{floor / t:>9.0%}")
    print("   ms per step at every context; roof: the share of its floor it reaches; and the speed-up over MHA:")
    print(f"   {'context':>7}" + "".join(f" |{attention_kind(h, kv):>8}{'roof':>5}{'vs MHA':>7}" for kv in kinds))
    for i, S in enumerate(contexts):
        cells = ""
        for kv in kinds:
            t = timing.steps[kv][i]
            cells += f" |{t * 1e3:>8.3f}{timing.floor(kv, S)[0] / t:>5.0%}{timing.steps[h][i] / t:>6.1f}x"
        print(f"   {S:>7}{cells}")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        print(f"   NOT TRUSTWORTHY, the machine was busy while timing: {problems[0]}{more}")
        return
    print("   " + decode_lesson(timing))


def decode_lesson(timing):
    """What the measurements say, in sentences made from them."""
    h, S = LLAMA_HEADS, max(timing.contexts)
    bounds = {kv: timing.floor(kv, S)[1] for kv in timing.steps}
    memory = [attention_kind(h, kv) for kv in timing.steps if bounds[kv] == "memory"]
    compute = [attention_kind(h, kv) for kv in timing.steps if bounds[kv] == "compute"]
    fewest = min(timing.steps)
    speedup = timing.steps[h][-1] / timing.steps[fewest][-1]
    text = f"Memory-bound here: {', '.join(memory) or 'none'}; compute-bound: {', '.join(compute) or 'none'}."
    text += (f"\n   {attention_kind(h, fewest)} reads {h // fewest}x fewer bytes than MHA for the same FLOPs, and "
             f"at {S} tokens it is {speedup:.1f}x faster")
    gpu_name, gpu_flops, gpu_bandwidth = GPU
    gpu_compute = [attention_kind(h, kv) for kv in timing.steps if h / kv > gpu_flops / gpu_bandwidth]   # bf16: g
    text += (f".\n   An {gpu_name} has its ridge at {gpu_flops / gpu_bandwidth:.0f} FLOPs per byte, a bf16 step does g: "
             f"{'compute-bound there: ' + ', '.join(gpu_compute) if gpu_compute else 'all are memory-bound there'}.")
    return text


# ----------------------------------------------------------------------------- figures
COLORS = ["tab:red", "tab:orange", "tab:green", "tab:blue", "tab:purple", "tab:brown", "tab:pink"]


def plot_attention_maps(n_kv_heads, seed):
    """Each head's causal attention probabilities on one random sequence, from need_weights=True."""
    torch.manual_seed(seed + 6)
    attn = CausalMHA(D_MODEL, N_HEADS, n_kv_heads).eval()
    x = 2.0 * torch.randn(1, SEQ_LEN, D_MODEL)           # (B=1, T, d); x2 so the maps have contrast
    with torch.no_grad():
        _, p = attn(x, need_weights=True)                  # (1, h, T, T)
    g = N_HEADS // n_kv_heads
    cols = min(4, N_HEADS)
    rows = math.ceil(N_HEADS / cols)
    fig = new_figure(2.2 * cols + 1.2, 2.3 * rows + 0.7)
    fig.subplots_adjust(left=0.07, right=0.88, bottom=0.1, top=1 - 0.7 / (2.3 * rows + 0.7), wspace=0.08,
                        hspace=0.3)
    grid, ticks = fig.add_gridspec(rows, cols), list(range(0, SEQ_LEN, max(1, SEQ_LEN // 4)))
    for i in range(N_HEADS):
        row, col = divmod(i, cols)
        ax = fig.add_subplot(grid[row, col])
        im = ax.imshow(p[0, i].numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
        ax.set_title(f"query head {i} (K/V head {i // g})", fontsize=9)
        ax.set_xticks(ticks if row == rows - 1 else [])    # positions on the outer edges only
        ax.set_yticks(ticks if col == 0 else [])
        ax.tick_params(labelsize=7)
        if row == rows - 1:
            ax.set_xlabel("key position", fontsize=8)
        if col == 0:
            ax.set_ylabel("query position", fontsize=8)
    fig.colorbar(im, cax=fig.add_axes([0.9, 0.15, 0.015, 0.65]), label="attention probability")
    fig.suptitle(f"Per-head causal attention, {attention_kind(N_HEADS, n_kv_heads)}: {N_HEADS} query heads share "
                 f"{n_kv_heads} K/V heads, d={D_MODEL}, T={SEQ_LEN}\nrandom untrained weights: each row sums "
                 "to 1 over the keys at or before the query", fontsize=10)
    return fig


def plot_cache_sizes():
    """KV-cache GB of the Llama-7B shape per configuration: at CACHE_TOKENS, and against context."""
    fig = new_figure(11, 4.2)
    left, right = fig.subplots(1, 2)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.13, top=0.84, wspace=0.25)
    kinds = [attention_kind(LLAMA_HEADS, kv) for kv in LLAMA_KV_HEADS]
    sizes = [gb(llama_cache_bytes(kv)) for kv in LLAMA_KV_HEADS]
    bars = left.bar(kinds, sizes, color=COLORS[:len(kinds)])
    left.bar_label(bars, labels=[f"{s:.2f} GB" for s in sizes], fontsize=9)
    left.set_ylabel("KV cache per request (GB, 1 GB = 1e9 bytes)")
    left.set_title(f"{CACHE_TOKENS} tokens, {cache_dtype()}, batch 1", fontsize=10)
    context = [2 ** i for i in range(9, 18)]               # 512 .. 131072 tokens
    for kind, kv, color in zip(kinds, LLAMA_KV_HEADS, COLORS):
        right.plot(context, [gb(llama_cache_bytes(kv, s)) for s in context], marker="o", ms=3, color=color,
                   label=f"{kind} ({kv} K/V heads)")
    right.axhline(GPU_CACHE_GB, color="gray", ls="--", lw=1)
    right.text(context[0], GPU_CACHE_GB * 1.15, f"{GPU_CACHE_GB} GB of GPU memory", fontsize=8, color="gray")
    log_axes(right, context[::2], [0.01, 0.1, 1, 10, 100])
    right.set_xlabel("context length (tokens)")
    right.set_ylabel("KV cache per request (GB)")
    right.set_title("the cache grows linearly with context", fontsize=10)
    right.legend(fontsize=8)
    fig.suptitle(f"KV cache of a Llama-7B-shaped model ({LLAMA_LAYERS} layers, {LLAMA_HEADS} query heads, "
                 f"dh={LLAMA_D_HEAD})", fontsize=11)
    return fig


def plot_head_layout(n_kv_heads):
    """Which query heads read which K/V head, for every valid n_kv_heads of the demo model."""
    from matplotlib import colormaps
    from matplotlib.patches import Rectangle
    options = [kv for kv in range(N_HEADS, 0, -1) if N_HEADS % kv == 0]
    height = 1.5 * len(options) + 0.6
    fig = new_figure(max(6.0, 0.75 * N_HEADS + 2.5), height)
    axes = fig.subplots(len(options), 1, squeeze=False)[:, 0]
    fig.subplots_adjust(left=0.02, right=0.98, bottom=0.02, top=1 - 0.75 / height, hspace=0.35)
    cmap = colormaps["tab10"]
    for ax, kv in zip(axes, options):
        g = N_HEADS // kv
        for i in range(N_HEADS):                           # query heads, top row
            ax.add_patch(Rectangle((i + 0.1, 1.0), 0.8, 0.5, color=cmap(i // g % 10)))
            ax.text(i + 0.5, 1.25, f"q{i}", ha="center", va="center", fontsize=8, color="white")
            ax.plot([i + 0.5, (i // g) * g + g / 2], [1.0, 0.5], color="gray", lw=0.8)
        for j in range(kv):                                # K/V heads, bottom row, under their group
            ax.add_patch(Rectangle((j * g + 0.1, 0.0), g - 0.2, 0.5, color=cmap(j % 10), alpha=0.85))
            ax.text(j * g + g / 2, 0.25, f"kv{j}", ha="center", va="center", fontsize=8, color="white")
        label = f"{attention_kind(N_HEADS, kv)}: n_kv_heads={kv}, {g} query head{'s' if g > 1 else ''} per K/V head"
        mine = kv == n_kv_heads
        ax.set_title(label + ("   <- your N_KV_HEADS" if mine else ""), fontsize=9, loc="left",
                     fontweight="bold" if mine else "normal")
        ax.set_xlim(-0.1, N_HEADS + 0.1)
        ax.set_ylim(-0.1, 1.6)
        ax.axis("off")
        if mine:
            ax.add_patch(Rectangle((-0.08, -0.08), N_HEADS + 0.16, 1.66, fill=False, ec="black", lw=1.5))
    fig.suptitle(f"Which query heads share which K/V head ({N_HEADS} query heads)", fontsize=11)
    return fig


def plot_decode_time(timing, problems):
    """Left: decode time against context, roofline floors dashed. Middle: the read rate against the bytes
    read, the CPU's caches at the left. Right: the roofline from memory, with the steps at the longest context."""
    h, dh, contexts, s_max = LLAMA_HEADS, LLAMA_D_HEAD, timing.contexts, max(timing.contexts)
    fig = new_figure(17, 5.4)
    left, middle, right = fig.subplots(1, 3)
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.11, top=0.8, wspace=0.25)
    for (kv, row), color in zip(timing.steps.items(), COLORS):
        kind = attention_kind(h, kv)
        left.plot(contexts, [t * 1e3 for t in row], marker="o", color=color, label=f"{kind} measured")
        left.plot(contexts, [timing.floor(kv, S)[0] * 1e3 for S in contexts], ls="--", color=color, lw=1,
                  label=f"{kind} roofline floor")
        middle.plot([decode_bytes(kv, dh, S) / 1e6 for S in contexts],
                    [timing.ceilings(kv, S).bandwidth / 1e9 for S in contexts], marker="o", color=color, label=kind)
    log_axes(left, contexts, [0.01, 0.1, 1, 10, 100])
    left.set_xlabel("cached context S (tokens)")
    left.set_ylabel("time per decode step (ms)")
    left.set_title("measured, and the least time the two ceilings allow", fontsize=10)
    left.legend(fontsize=7, ncol=2)
    middle.set_xscale("log")
    middle.set_xlabel("K and V read by one step (MB)")
    middle.set_ylabel("read rate of those very bytes (GB/s)")
    middle.set_title("each step's own K and V read once: the rate its floor uses", fontsize=10)
    middle.legend(fontsize=8)

    memory, fastest = timing.memory(), max(timing.ceilings(kv, S).bandwidth for kv in timing.steps for S in contexts)
    intensity = sorted([2 ** e for e in range(-3, 11)] + [memory.ridge])   # FLOPs per byte, 1/8 .. 1024
    right.plot(intensity, [min(memory.flops, memory.bandwidth * x) / 1e9 for x in intensity], color="black",
               label=f"from memory: {memory.bandwidth / 1e9:.0f} GB/s, {memory.flops / 1e9:.0f} GFLOP/s")
    if fastest > 1.2 * memory.bandwidth:                  # a smaller K and V read faster: a roof of its own
        right.plot(intensity, [min(memory.flops, fastest * x) / 1e9 for x in intensity], color="black", ls=":",
                   label=f"from the CPU caches: up to {fastest / 1e9:.0f} GB/s")
    right.axvline(memory.ridge, color="black", ls=":", lw=1)
    right.text(memory.ridge * 1.1, memory.flops / 1e9 * 3, f"ridge {memory.ridge:.1f} FLOPs/byte", fontsize=8)
    right.text(memory.ridge / 1.3, memory.flops / 1e9 * 1.4, "memory-bound", fontsize=8, color="gray", ha="right")
    right.text(memory.ridge * 1.3, memory.flops / 1e9 * 1.4, "compute-bound", fontsize=8, color="gray")
    gpu_name, gpu_flops, gpu_bandwidth = GPU
    right.axvline(gpu_flops / gpu_bandwidth, color="gray", ls="--", lw=1,
                  label=f"{gpu_name} ridge: {gpu_flops / 1e12:.0f} TFLOP/s bf16 / {gpu_bandwidth / 1e12:.2f} TB/s"
                        f" = {gpu_flops / gpu_bandwidth:.0f}")
    flops = decode_flops(h, dh, s_max)
    for (kv, row), color in zip(timing.steps.items(), COLORS):
        right.plot([flops / decode_bytes(kv, dh, s_max)], [flops / row[-1] / 1e9], "o", ms=8, color=color,
                   label=f"{attention_kind(h, kv)}: g / 2 = {h / kv / 2:g} FLOPs per byte")
    log_axes(right, [0.125, 1, 8, 64, 512], [1, 10, 100, 1000], xlabel=lambda x: f"{x:g}")
    right.set_xlabel("arithmetic intensity (FLOPs per byte read)")
    right.set_ylabel("GFLOP/s")
    right.set_title(f"the roofline; dots: measured at {s_max} tokens", fontsize=10)
    right.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"One decode step of one layer's attention, {h} query heads, dh={dh}, fp32, on {machine_name()}",
                 fontsize=11)
    if problems:
        fig.text(0.5, 0.86, "NOT TRUSTWORTHY: the machine was busy while timing, and these numbers contradict "
                 f"each other ({problems[0]})", ha="center", color="red", fontsize=10)
    return fig


def tokens_label(n):
    """tokens_label(8192) == '8k' (multiples of 1024); tokens_label(512) == '512'; tokens_label(5000) == '5,000'."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else f"{n:,}"


def log_axes(ax, xticks, yticks, xlabel=tokens_label):
    """Log-log axes with ticks at fixed places, in plain text (matplotlib's math text costs 0.25 s a figure)."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(xticks, [xlabel(t) for t in xticks])
    ax.set_yticks(yticks, [f"{t:g}" for t in yticks])
    ax.minorticks_off()


def new_figure(width, height):
    """A matplotlib Figure on the Agg canvas: no display, no global pyplot state."""
    from matplotlib.figure import Figure
    return Figure(figsize=(width, height))


def png_bytes(fig):
    """The figure as PNG bytes. Agg's PNG holds no date, only matplotlib's version: same code, same bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


# ----------------------------------------------------------------------------- plumbing (not the lesson)
# Each helper below exists so that a mistake a user can make ends in one sentence, not a traceback, and
# leaves nothing behind: the module's arguments, the flags and knobs, the output folder, the streams.
def whole_number(name, value):
    """value as an int if it is a whole number (int, numpy integer, ...), else TypeError in one sentence.

    whole_number("n", np.int64(4)) == 4; whole_number("n", 4.0), ("n", "4") and ("n", True) raise.
    """
    try:
        if not isinstance(value, bool):
            return operator.index(value)
    except TypeError:
        pass
    raise TypeError(f"{name} must be a whole number, got {value!r}")


def check_sizes(d_model, n_heads, n_kv_heads, bias=True):
    """CausalMHA's sizes as ints (n_kv_heads None means n_heads); else one sentence naming the value and the rule."""
    if not isinstance(bias, bool):
        raise TypeError(f"bias must be True or False, got {bias!r}")
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    d_model, n_heads, n_kv_heads = (whole_number(name, value) for name, value in
                                    (("d_model", d_model), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads)))
    if n_heads < 1:
        raise ValueError(f"n_heads must be at least 1, got {n_heads}")
    if d_model < 1 or d_model % n_heads:
        raise ValueError(f"d_model={d_model} must be a positive multiple of n_heads={n_heads}")
    if not 1 <= n_kv_heads <= n_heads or n_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads={n_kv_heads} must be a positive divisor of n_heads={n_heads} "
                         f"(1 = MQA, {n_heads} = MHA, a divisor in between = GQA)")
    weights = 4 * d_model * (d_model // n_heads * (n_heads + 2 * n_kv_heads) + d_model)   # float32 bytes
    if weights > memory_bytes():
        raise ValueError(f"d_model={d_model} needs {weights / 1e9:,.0f} GB of weights, more than this "
                         f"machine's {memory_bytes() / 1e9:.0f} GB of memory")
    return d_model, n_heads, n_kv_heads


def check_call(attn, x, need_weights, cache):
    """(B, T) of a valid call attn(x, need_weights, cache); else one sentence naming what was given and
    what is needed, raised before anything is computed or written (a refused call leaves the cache as it was)."""
    weight = attn.in_proj.weight
    B, T = check_x(x, attn.d_model, weight)
    if not isinstance(need_weights, bool):
        raise TypeError(f"need_weights must be True or False, got {need_weights!r}")
    S = T + (cache.length if isinstance(cache, KVCache) and isinstance(cache.length, int) else 0)
    g, n_bytes = attn.n_heads // attn.n_kv_heads, weight.element_size()
    needed = (B * attn.n_heads * T * S if need_weights else 0) + (g * T * S if T > 1 or need_weights else 0)
    if needed * n_bytes > memory_bytes():
        raise ValueError(f"attending {T} tokens to {S} keys needs {needed * n_bytes / 1e9:,.0f} GB for the mask and "
                         f"weights, more than this machine's {memory_bytes() / 1e9:.0f} GB: feed fewer tokens at once")
    if cache is None:
        return B, T
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a KVCache, as new_cache() makes, got {type(cache).__name__}")
    tensors = {"K": cache.k, "V": cache.v}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"the cache's {name} must be a tensor, got {type(t).__name__}")
    check_no_autograd([x, *tensors.values(), *attn.parameters()])
    want = (B, attn.n_kv_heads, cache.k.shape[2] if cache.k.dim() == 4 else "max_len", attn.d_head)
    for name, t in tensors.items():
        if tuple(t.shape) != want or t.dtype != weight.dtype:
            raise ValueError(f"the cache holds {name} of shape {tuple(t.shape)} in {t.dtype}, "
                             f"this call needs {want} in {weight.dtype}")
    cache_writable(tensors, weight.device)
    cache.length = checked_length(cache.length, cache.k.shape[2], T)
    return B, T


def check_no_autograd(tensors):
    """A cached call writes the cache in place: refuse it while autograd would follow any of these tensors."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError("decoding with a cache writes it in place, which autograd cannot follow: call "
                           "the module under torch.no_grad() or torch.inference_mode()")


def cache_writable(tensors, device):
    """A cache's two named tensors, {name: tensor}, must be dense, on device, writable here, and use memory of
    their own; else one sentence. Shared by mha's KVCache and mla's LatentCache."""
    for name, t in tensors.items():
        if t.device != device or t.layout != torch.strided:
            raise ValueError(f"the cache's {name} must be an ordinary dense tensor on {device}, got a {t.layout} "
                             f"one on {t.device}")
        if t.is_inference() and not torch.is_inference_mode_enabled():
            raise RuntimeError(f"the cache's {name} was made under torch.inference_mode(), so only a call "
                               "under torch.inference_mode() can write it")
        if shares_memory(t):
            raise ValueError(f"positions of the cache's {name} share memory (a stride of 0?), so writing one "
                             "would overwrite another: give it memory of its own")
    (first, a), (second, b) = tensors.items()
    if shares_memory(a, b):
        raise ValueError(f"the cache's {first} and {second} share memory, so writing {second} would overwrite "
                         f"{first}: give each its own tensor")


def checked_length(length, max_len, T):
    """A cache's length as an int, if T more tokens fit in max_len; else one sentence."""
    length = whole_number("cache.length", length)
    if not 0 <= length <= max_len - T:
        raise ValueError(f"the cache holds {length} of at most {max_len} tokens and cannot take {T} more")
    return length


def check_x(x, d_model, weight):
    """(B, T) of an input x: (B, T, d_model) for a module whose weights are `weight`; else one sentence."""
    if isinstance(x, torch.Tensor) and (x.is_nested or x.layout != torch.strided):
        raise TypeError(f"x must be an ordinary dense tensor, got a {'nested' if x.is_nested else x.layout} one")
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != d_model:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must have shape (B, T, {d_model}), got {got}")
    B, T = x.shape[0], x.shape[1]
    if not weight.dtype.is_floating_point:
        raise TypeError(f"this module computes in {weight.dtype}; attention needs a real floating-point dtype")
    if T < 1 or B < 1:
        raise ValueError(f"x must hold at least one token of one sequence, got shape {tuple(x.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype} but this module computes in {weight.dtype}; convert one to the other")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but this module is on {weight.device}; move one to the other")
    if x.is_inference() and torch.is_grad_enabled() and not torch.is_inference_mode_enabled() \
            and weight.requires_grad:
        raise RuntimeError("x was made under torch.inference_mode(), which autograd cannot follow: call the "
                           "module under torch.no_grad() or torch.inference_mode(), or pass x.clone()")
    return B, T


def shares_memory(a, b=None):
    """Whether two elements of a (with b None), or an element of a and one of b, lie at the same address.

    Strides or address ranges decide at once in the usual cases; where they cannot, element by element.
    K and V interleaved in one buffer do not share memory; a tensor expanded with a stride of 0 does.
    """
    if b is None:
        extent = 1                                         # elements spanned by the dimensions seen so far
        for stride, n in sorted((s, n) for n, s in zip(a.shape, a.stride()) if n > 1):
            if stride < extent:
                offsets = element_offsets(a)
                return offsets.unique().numel() < offsets.numel()
            extent += stride * (n - 1)
        return False
    (a0, a1), (b0, b1) = byte_range(a), byte_range(b)
    if a1 <= b0 or b1 <= a0:
        return False
    if (a.data_ptr() - b.data_ptr()) % a.element_size() or a.element_size() != b.element_size():
        return True                                        # elements that could meet part-way: say they do
    first = min(a.data_ptr(), b.data_ptr())
    a_layout, b_layout = (((t.data_ptr() - first) // t.element_size(), tuple(t.shape), t.stride()) for t in (a, b))
    return layouts_meet(*a_layout, *b_layout)


@functools.lru_cache(maxsize=16)
def layouts_meet(start_a, shape_a, stride_a, start_b, shape_b, stride_b):
    """Whether two strided layouts (first element, shape, strides, in elements) use a common element: one
    mark per element of their span, once per pair of layouts (a cache keeps its layout from step to step)."""
    ends = [start + sum((n - 1) * s for n, s in zip(shape, stride)) for start, shape, stride in
            ((start_a, shape_a, stride_a), (start_b, shape_b, stride_b))]
    marks = torch.zeros(max(ends) + 1, dtype=torch.bool)
    marks.as_strided(shape_a, stride_a, start_a).fill_(True)
    return bool(marks.as_strided(shape_b, stride_b, start_b).any())


def element_offsets(t):
    """The offset of every element of t from its first, in elements: (t.numel(),) int64."""
    offsets = torch.zeros((), dtype=torch.long)
    for n, stride in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(n) * stride    # (..., n)
    return offsets.flatten()


def byte_range(t):
    """(first byte, last byte + 1) of the memory t's elements can touch."""
    last = sum((n - 1) * stride for n, stride in zip(t.shape, t.stride())) if t.numel() else -1
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def check_cache_size(attn, batch, max_len):
    batch, max_len = whole_number("batch", batch), whole_number("max_len", max_len)
    if batch < 1 or max_len < 1:
        raise ValueError(f"a cache needs batch >= 1 and max_len >= 1, got batch={batch}, max_len={max_len}")
    n_bytes = 2 * batch * attn.n_kv_heads * max_len * attn.d_head * attn.in_proj.weight.element_size()
    if n_bytes > memory_bytes():
        raise ValueError(f"a cache of batch={batch}, max_len={max_len} needs {n_bytes / 1e9:,.0f} GB, more than "
                         f"this machine's {memory_bytes() / 1e9:.0f} GB of memory")
    return batch, max_len


def memory_bytes():
    """The machine's memory in bytes (infinite where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return math.inf


def check_copyable(ref):
    """from_torch copies only what CausalMHA computes: one sentence for anything else."""
    if not isinstance(ref, nn.MultiheadAttention):
        raise TypeError(f"from_torch copies an nn.MultiheadAttention, got {type(ref).__name__}")
    same_dims = ref.kdim == ref.vdim == ref.embed_dim
    if not (ref.batch_first and same_dims and ref.bias_k is None and not ref.add_zero_attn):
        raise ValueError("from_torch copies only nn.MultiheadAttention(d, h, batch_first=True) "
                         "without kdim, vdim, add_bias_kv or add_zero_attn")
    if ref.dropout and ref.training:
        raise ValueError(f"from_torch needs dropout=0.0 in training mode (CausalMHA has no dropout), got "
                         f"{ref.dropout}; in eval mode dropout does nothing and is accepted")


def check_to_gqa(attn, n_kv_heads, pool):
    new_kv = whole_number("n_kv_heads", n_kv_heads)
    if new_kv < 1 or attn.n_kv_heads % new_kv:
        raise ValueError(f"n_kv_heads={new_kv} must be a positive divisor of this module's {attn.n_kv_heads} "
                         "K/V heads")
    if not isinstance(pool, str) or pool not in ("mean", "first"):
        raise ValueError(f"pool={pool!r} must be 'mean' or 'first'")
    return new_kv


class Parser(argparse.ArgumentParser):
    def error(self, message):                              # one line and exit 2, without the usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv=None):
    """The flags, each defaulting to its knob; a bad value, a knob that cannot work or an --out-dir that
    cannot take the figures exits 2 in one line, before anything is computed."""
    parser = Parser(prog="mha.py", description="Multi-head, grouped-query and multi-query attention: "
                    "checks, KV-cache tables, decode timings and figures.",
                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--n-kv-heads", type=int, default=N_KV_HEADS,
                        help=f"K/V heads of the demo model: {N_HEADS} = MHA, a divisor of {N_HEADS} = GQA, 1 = MQA")
    parser.add_argument("--out-dir", default=OUT_DIR, help="folder the figures are written to")
    parser.add_argument("--seed", type=int, default=SEED, help="seed for every random number")
    args = parser.parse_args(argv)
    try:
        check_knobs()
        check_sizes(D_MODEL, N_HEADS, args.n_kv_heads)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    if not 0 <= args.seed < 2**32:
        parser.error(f"--seed {args.seed} must be between 0 and 2**32 - 1")
    problem = out_dir_problem(args.out_dir, FIGURES)
    if problem:
        parser.error(problem)
    return args


FIGURES = ["attention_maps.png", "kv_cache_size.png", "head_layout.png", "decode_time.png"]


def check_knobs():
    """Raise TypeError or ValueError, in one sentence naming the knob, unless every knob at the top can work."""
    check_sizes(D_MODEL, N_HEADS, N_HEADS)
    for kv in LLAMA_KV_HEADS:
        check_sizes(LLAMA_HEADS * LLAMA_D_HEAD, LLAMA_HEADS, kv)
    if LLAMA_HEADS not in LLAMA_KV_HEADS:
        raise ValueError(f"LLAMA_KV_HEADS={LLAMA_KV_HEADS} must include LLAMA_HEADS={LLAMA_HEADS}, the MHA baseline")
    for name, (layers, h, kv, dh) in PUBLISHED_MODELS.items():
        check_sizes(h * dh, h, kv)
        whole_number(f"the layers of {name}", layers)
    if not DECODE_CONTEXTS:
        raise ValueError("DECODE_CONTEXTS must hold at least one context length")
    counts = {"SEQ_LEN": SEQ_LEN, "BATCH": BATCH, "LLAMA_LAYERS": LLAMA_LAYERS, "CACHE_TOKENS": CACHE_TOKENS,
              "CACHE_BYTES_PER_ELEM": CACHE_BYTES_PER_ELEM, "DECODE_ROUNDS": DECODE_ROUNDS, "MATMUL_N": MATMUL_N,
              **{f"DECODE_CONTEXTS[{i}]": S for i, S in enumerate(DECODE_CONTEXTS)}}
    for name, value in counts.items():
        if whole_number(name, value) < 1:
            raise ValueError(f"{name}={value} must be at least 1")
    real = isinstance(GPU_CACHE_GB, (int, float)) and not isinstance(GPU_CACHE_GB, bool)
    if not (real and math.isfinite(GPU_CACHE_GB) and GPU_CACHE_GB > 0):
        raise ValueError(f"GPU_CACHE_GB={GPU_CACHE_GB!r} must be a positive, finite number of GB")
    gpu_numbers = GPU[1:] if isinstance(GPU, tuple) and len(GPU) == 3 else ()
    if not (len(gpu_numbers) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                          and math.isfinite(v) and v > 0 for v in gpu_numbers)):
        raise ValueError(f"GPU={GPU!r} must be (name, FLOP/s, bytes/s) with two positive, finite numbers")
    if MATMUL_N > 4096:
        raise ValueError(f"MATMUL_N={MATMUL_N} must be at most 4096: the FLOP/s ceiling is timed in every round")
    if SEQ_LEN < 2:
        raise ValueError(f"SEQ_LEN={SEQ_LEN} must be at least 2: a single token attends only to itself, so "
                         "its output is v whatever the queries, and no check could see a wrong query")
    if N_HEADS < 2:
        raise ValueError(f"N_HEADS={N_HEADS} must be at least 2: the check that must fail swaps query heads 0 and 1")
    for name, value, most in [("D_MODEL", D_MODEL, 4096), ("N_HEADS", N_HEADS, 64), ("SEQ_LEN", SEQ_LEN, 512),
                              ("BATCH", BATCH, 64)]:
        if value > most:
            raise ValueError(f"{name}={value} must be at most {most}: the demo is checked and drawn in seconds")
    needed = sum(decode_bytes(kv, LLAMA_D_HEAD, max(DECODE_CONTEXTS)) for kv in LLAMA_KV_HEADS)
    if needed > DECODE_MEMORY:
        raise ValueError(f"DECODE_CONTEXTS up to {max(DECODE_CONTEXTS):,} tokens need {needed / 1e9:.1f} GB of "
                         f"K and V for the decode timing; at most {DECODE_MEMORY / 1e9:.0f} GB")


def out_dir_problem(folder, names):
    """Why names cannot be written into folder, in one sentence, or None. It tries: it makes the folder
    if need be and a file in it, then removes both, so the disk is left as it was."""
    if not folder:
        return "--out-dir is empty: name a folder"
    parent = folder
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent.rstrip(os.sep))
    if parent and not os.path.isdir(parent):
        return f"{parent!r} is a file, not a folder, so the figures cannot go to {folder!r}"
    made = []
    try:
        made = make_folders(folder)
        for name in names:                                 # each figure's path: a regular file or nothing
            path = os.path.join(folder, name)
            if os.path.lexists(path) and not os.path.isfile(path):
                return f"{path!r} exists and is not a file; remove it or choose another --out-dir"
        probe = temporary_name(os.path.join(folder, max(names, key=len)))   # the longest path written
        with open(probe, "xb"):
            pass
        os.unlink(probe)
    except OSError as e:
        if e.errno == errno.ENOENT and os.path.isdir(folder):
            return f"the folder {folder!r} exists but does not accept new files"
        return f"cannot write files in the folder {folder!r}: {e.strerror or e}"
    finally:
        remove_folders(made)
    return None


def make_folders(folder):
    """Make folder and any missing parents; return the folders made, outermost first."""
    missing, path = [], folder.rstrip(os.sep) or os.sep   # as given: the system resolves links and ..
    while path and not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    made = []
    try:
        for path in reversed(missing):
            os.mkdir(path)
            made.append(path)
    except OSError:
        remove_folders(made)
        raise
    return made


def remove_folders(made):
    """Remove the folders make_folders made, innermost first, where they are still empty."""
    for path in reversed(made):
        try:
            os.rmdir(path)
        except OSError:
            pass


def temporary_name(path):
    """Where write_all puts path's bytes until they are complete."""
    return f"{path}.{os.getpid()}.tmp"


def write_all(files):
    """Write {path: bytes}: every file to a temporary name beside it, then each renamed over its path.

    A full disk or an interruption leaves no partial file and no temporary one. OSError names the path
    that failed and says which paths, if any, were already replaced (only a rename can fail that late).
    """
    pending, done, path = {}, [], None
    try:
        for path, data in files.items():
            pending[path] = temporary_name(path)
            with open(pending[path], "xb") as f:
                f.write(data)
        for path in list(pending):
            os.replace(pending[path], path)
            del pending[path]
            done.append(os.path.basename(path))
    except OSError as e:
        said = f"written before it: {', '.join(done)}" if done else "nothing was written"
        raise OSError(e.errno, f"{e.strerror}; {said}", path) from e
    finally:
        for tmp in pending.values():
            if os.path.exists(tmp):
                os.unlink(tmp)


def write_figures(prog, folder, pngs):
    """write_all of {name: PNG bytes} into folder, made if need be; on failure one line on stderr, False,
    and no folder left behind that this call made."""
    made = []
    try:
        made = make_folders(folder)
        write_all({os.path.join(folder, name): png for name, png in pngs.items()})
    except (OSError, KeyboardInterrupt) as e:
        remove_folders(made)
        if isinstance(e, KeyboardInterrupt):
            raise
        print(f"{prog}: error: cannot write {e.filename!r}: {e.strerror}", file=sys.stderr)
        return False
    return True


def machine_name():
    """The CPU the timings ran on, e.g. 'AMD EPYC, 2 threads, AVX2' (the model name Linux reports)."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    threads = torch.get_num_threads()
    return f"{name}, {threads} thread{'s' if threads > 1 else ''}, {torch.backends.cpu.get_cpu_capability()}"


def cpu_seconds():
    """(wall clock, CPU seconds the whole machine was busy, CPU seconds of this process and its children).

    The machine's from /proc/stat (Linux; time a hypervisor stole from this VM counts as busy), so that
    cores_elsewhere() can tell what other programs used; None where there is no /proc/stat.
    """
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    except (OSError, ValueError):
        return None
    own = os.times()
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    return time.perf_counter(), busy, own.user + own.system + own.children_user + own.children_system


def cores_elsewhere(start):
    """How many cores other programs kept busy, on average, since start = cpu_seconds(); 0 if unknown."""
    end = cpu_seconds()
    if start is None or end is None or end[0] <= start[0]:
        return 0.0
    return max(0.0, ((end[1] - start[1]) - (end[2] - start[2])) / (end[0] - start[0]))


def shown_path(folder):
    """Where the folder really is (links and .. resolved): relative to here if it is below here, else whole."""
    real = os.path.realpath(folder)
    shown = os.path.relpath(real)
    return os.path.join(real if shown.startswith("..") else shown, "")


def run_as_script(main):
    """sys.exit(main()), where a closed or full standard output, a reader that goes away (python mha.py |
    head, as Python's docs advise) and Ctrl-C each end in at most one line, never a traceback."""
    prog = os.path.basename(sys.argv[0])
    if sys.stdout is None:                                 # python mha.py >&-
        print(f"{prog}: error: standard output is closed", file=sys.stderr or sys.stdout)
        sys.exit(1)
    for stream in (sys.stdout, sys.stderr):                # a folder name the terminal cannot show: \x escapes
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:                                # the reader went away: nothing more to say
        code = 1
    except KeyboardInterrupt:                              # Ctrl-C: one line and the shell's code for it
        print(f"\n{prog}: interrupted", file=sys.stderr)
        code = 130
    except OSError as e:                                   # a write to a full or broken standard output
        unwritable = e.filename is None and e.errno in (errno.ENOSPC, errno.EIO, errno.EFBIG, errno.EDQUOT)
        if stdout_works() and not unwritable:              # another error: not ours to explain
            raise
        print(f"{prog}: error: cannot write to standard output: {e.strerror}", file=sys.stderr)
        code = 1
    if not stdout_works():                                 # so that the exit's own flush is silent too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(code)


def stdout_works():
    try:
        sys.stdout.flush()
        return True
    except OSError:
        return False


if __name__ == "__main__":
    run_as_script(main)
