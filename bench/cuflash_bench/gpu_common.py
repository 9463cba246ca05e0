"""What the GPU benchmark's sections share: the FLOP convention, the decode
configurations and how numbers are printed.

Every other module of the harness may import this one; it imports none of them.
"""
import math

__all__ = ["MODE_FACTOR", "DECODE", "flops", "sig"]

MODE_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
# decode configurations (B, H, Hk) of the decode and KV-cache sections: MHA at batch 1 and 8,
# GQA with 4 query heads per kv head (FlashAttention-2 on an H100: 0.36 ms for B1 H32 Nk=65536,
# 0.10 ms for B8 H32/8 Nk=8192, from the project's GPU baseline notes)
DECODE = {"cuda": ((1, 32, 32), (8, 32, 32), (8, 32, 8)),
          "emulator": ((1, 4, 4), (2, 4, 4), (2, 4, 2))}


def flops(B, H, Nq, Nk, d, causal, mode):
    """FLOPs of one call, flash-attn convention: forward ``4 B H Nq Nk d`` (halved when causal
    with ``Nq == Nk``), backward 2.5x, forward + backward 3.5x that."""
    f = 4.0 * B * H * Nq * Nk * d
    if causal and Nq == Nk:
        f /= 2
    return f * MODE_FACTOR[mode]


def sig(x, n=4):
    """``x`` with ``n`` significant digits and no exponent unless it is below 1e-3."""
    if x is None or not math.isfinite(x):
        return "n/a"
    if x == 0 or abs(x) < 1e-3:
        return f"{x:.{n - 1}e}"
    decimals = max(0, n - 1 - int(math.floor(math.log10(abs(x)))))
    return f"{x:,.{decimals}f}"
