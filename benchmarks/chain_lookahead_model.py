"""The state chain's numerics with its next chunk's ``k S`` formed ahead (CPU, one head, no
GPU): whether the fused kernel may take the state update off its serial chain.

    python benchmarks/chain_lookahead_model.py

The shipped chain forms each chunk's ``P_{t+1} = k_{t+1} S_{t+1}`` from the updated state,
so every chunk waits for ``S_{t+1} = d_t S_t + k_t^T vs_t`` (``d_t = 2^g_last``, ``vs_t``
the chunk's scaled v_new) before its first product. Expanded, ``P_{t+1} = d_t (k_{t+1}
S_t) + (k_{t+1} k_t^T) vs_t``: one chunk ahead the first term comes from the state the
chain already has, and the second is a [64, 64] product of ``vs_t`` with a key-by-key
block; two chunks ahead ``k_{t+1} S_t`` itself expands the same way from ``S_{t-1}``,
so that no product on the chain waits for a state update. Rows per form (an 8,192-token
walk, 64-token chunks, K = V = 128, fp32 truth beside bf16 wherever the kernel's operands
are bf16: S, k, q, v, T_u, v_new, the scaled v_new, the scores and the key blocks;
accumulators fp32), relative RMS error of o and of the final state, for keys drawn
independent and drawn around one shared direction (mean cosine about 0.9).
"""
import torch

L, C, K, V = 8192, 64, 128, 128


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def exact(x: torch.Tensor) -> torch.Tensor:
    return x


def inputs(shared: float, length: int = L, seed: int = 0):
    """q, k, v (rounded to bf16), the gates ``g`` (natural log, per token) and beta of a
    ``length``-token walk; keys around one direction drawn ``shared`` times as long as theirs."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(length, K, generator=gen) + shared * torch.randn(1, K, generator=gen)
    k = torch.nn.functional.normalize(k, dim=-1)
    q = torch.nn.functional.normalize(torch.randn(length, K, generator=gen), dim=-1)
    v = torch.randn(length, V, generator=gen)
    g = 0.5 * torch.nn.functional.logsigmoid(torch.randn(length, generator=gen) + 4)
    beta = torch.rand(length, generator=gen).sigmoid()
    return bf16(q), bf16(k), bf16(v), g, beta


def walk(q, k, v, g, beta, form: str, r=bf16):
    """o [L, V] and the final S [K, V] of the chunk walk in ``form``: ``shipped`` (P from the
    updated state), ``ahead1`` / ``ahead2`` (P from the state one / two chunks back and the
    key blocks), with ``r`` rounding every operand the kernel holds in bf16 (:func:`exact`:
    none, the truth)."""
    S = torch.zeros(K, V)
    o = torch.empty(q.shape[0], V)
    back = []  # (S_t as rounded, k_t, vs_t, d_t) of the last two chunks
    strict = torch.ones(C, C).tril(-1).bool()
    causal = torch.ones(C, C).tril().bool()
    for c0 in range(0, q.shape[0], C):
        kc, qc, vc = k[c0:c0 + C], q[c0:c0 + C], v[c0:c0 + C]
        gc, bc = g[c0:c0 + C].cumsum(0), beta[c0:c0 + C]
        decay = torch.exp(gc[:, None] - gc[None, :])
        a = (bc[:, None] * (kc @ kc.T) * decay).masked_fill(~strict, 0)
        t_u = r(torch.linalg.inv(torch.eye(C) + a) * bc[None, :])
        if form == "shipped" or not back:
            P = kc @ r(S)
        elif form == "ahead1" or len(back) < 2:
            S1, k1, vs1, d1 = back[-1]
            P = d1 * (kc @ S1) + r(kc @ k1.T) @ vs1
        else:
            (S2, k2, vs2, d2), (_, k1, vs1, d1) = back
            ahead = d2 * (kc @ S2) + r(kc @ k2.T) @ vs2
            P = d1 * ahead + r(kc @ k1.T) @ vs1
        v_new = t_u @ r(vc - torch.exp(gc)[:, None] * P)
        scores = r(((qc @ kc.T) * decay).masked_fill(~causal, 0))
        o[c0:c0 + C] = (qc @ r(S)) * torch.exp(gc)[:, None] + scores @ r(v_new)
        vs = r(v_new * torch.exp(gc[-1] - gc)[:, None])
        back = (back + [(r(S), kc, vs, torch.exp(gc[-1]))])[-2:]
        S = S * torch.exp(gc[-1]) + kc.T @ vs
    return o, S


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()


def main() -> None:
    print("| keys | form | o error | state error |")
    print("| --- | --- | ---: | ---: |")
    for label, shared in (("independent", 0.0), ("shared direction", 3.0)):
        x = inputs(shared)
        o_ref, s_ref = walk(*x, "shipped", exact)
        for form in ("shipped", "ahead1", "ahead2"):
            o, s = walk(*x, form)
            print(f"| {label} | {form} | {rel_rms(o, o_ref):.2e} | {rel_rms(s, s_ref):.2e} |")


if __name__ == "__main__":
    main()
