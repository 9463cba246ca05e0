"""A scaling model of context-parallel (ring) attention: compute and transfer per ring step.

    python bench/ring_model.py --N 131072,1048576 --ranks 8 --head-dim 128 \
        --link NVLink=450,IB-NDR=50

For each setting it prints, per rank and per ring step, the attention compute time
(FLOPs / a TFLOP/s rate) and the transfer time (bytes of the block sent / link bandwidth
+ latency), whether the transfer hides behind the compute (the ring posts the next
block's transfer before the step's compute), and the resulting time of the whole ring.
It is a model: nothing here runs on a GPU or a network.  The formula is in
docs/context_parallel.md.

Inputs and their defaults
-------------------------
* ``--fwd-tflops`` / ``--fwdbwd-tflops``: default 340.8 and 272.0, cuflash float16
  d=128 non-causal forward and forward+backward at B=4 H=16 N=4096 on an H200
  (``bench/results/gpu/h200_2026-11-27_device_check_bench.txt``).  The backward alone then
  runs at ``2.5 / (3.5 / fwdbwd - 1 / fwd)`` TFLOP/s.  A ring step is a rectangle
  without mask (zigzag: half a square, every step), so the non-causal rate is used.
  float32 has no default (pass the rates).
* ``--link NAME=GB/s``: bandwidth per direction of the link a rank sends on (one send
  and one receive per rank at a time, so a full-duplex link carries both).  Examples:
  NVLink on an H100 SXM about 450 GB/s per direction, InfiniBand NDR 400 Gb/s = 50 GB/s.
* ``--latency-us``: added to every transfer (default 0).
"""
import argparse
import math

BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
# cuflash float16 d=128 non-causal, B=4 H=16 N=4096, H200 (see the module docstring)
DEFAULT_TFLOPS = {"fwd": 340.8, "fwdbwd": 272.0}


def bwd_tflops(fwd, fwdbwd):
    """The backward's rate from the forward's and the forward+backward's (3.5 = 1 + 2.5)."""
    return 2.5 / (3.5 / fwdbwd - 1.0 / fwd)


def step(N, ranks, B, H, Hk, d, dtype, causal, link_gbs, fwd_tflops, fwdbwd_tflops,
         latency_us=0.0):
    """The model of one setting: a dict of per-step and whole-ring times in ms."""
    if N % (2 * ranks if causal else ranks):
        raise ValueError(f"N={N} does not split over {ranks} ranks "
                         f"({'2 * ranks chunks (zigzag)' if causal else 'ranks chunks'})")
    n = N // ranks
    work = 0.5 if causal else 1.0        # zigzag: every step is half an n x n block
    f_fwd = 4.0 * B * H * n * n * d * work
    f_bwd = 2.5 * f_fwd
    t_fwd = f_fwd / (fwd_tflops * 1e12) * 1e3
    t_bwd = f_bwd / (bwd_tflops(fwd_tflops, fwdbwd_tflops) * 1e12) * 1e3
    kv_bytes = B * Hk * n * 2 * d * BYTES[dtype]            # K and V of one shard
    dkv_bytes = B * Hk * n * 2 * d * 4                      # dK, dV accumulators in float32
    lat = latency_us * 1e-3
    c_fwd = kv_bytes / (link_gbs * 1e9) * 1e3 + lat
    c_bwd = (kv_bytes + dkv_bytes) / (link_gbs * 1e9) * 1e3 + 2 * lat
    # W steps of compute; a transfer before each of the W - 1 later steps (forward), the
    # backward's dK/dV one step behind adds one last transfer that nothing hides
    ring_fwd = t_fwd + (ranks - 1) * max(t_fwd, c_fwd) if ranks > 1 else t_fwd
    ring_bwd = (t_bwd + (ranks - 1) * max(t_bwd, c_bwd)
                + dkv_bytes / (link_gbs * 1e9) * 1e3 + lat) if ranks > 1 else t_bwd
    return dict(N=N, ranks=ranks, n=n, B=B, H=H, Hk=Hk, d=d, dtype=dtype, causal=causal,
                link=link_gbs, kv_mb=kv_bytes / 1e6, t_fwd=t_fwd, c_fwd=c_fwd,
                t_bwd=t_bwd, c_bwd=c_bwd, ring_fwd=ring_fwd, ring_bwd=ring_bwd,
                ideal_fwd=ranks * t_fwd, ideal_bwd=ranks * t_bwd,
                hides_fwd=c_fwd <= t_fwd, hides_bwd=c_bwd <= t_bwd,
                n_min_fwd=min_local_len(H, Hk, dtype, causal, link_gbs, fwd_tflops))


def min_local_len(H, Hk, dtype, causal, link_gbs, fwd_tflops):
    """The local length from which the forward's K/V transfer hides (latency 0):
    ``n >= Hk * bytes * R / (2 * work * H * BW)``, from ``4 B H n^2 d work / R >= 2 B Hk n d
    bytes / BW``."""
    work = 0.5 if causal else 1.0
    return math.ceil(Hk * BYTES[dtype] * fwd_tflops * 1e12 / (2 * work * H * link_gbs * 1e9))


def _ms(x):
    return f"{x:.3g}"


def table(rows, names):
    out = ["| N | ranks | n/rank | H/Hk | d | causal | link | K/V MB | fwd step: compute / "
           "transfer ms | hides | bwd step: compute / transfer ms | hides | ring fwd+bwd ms "
           "(compute only) | n/rank to hide fwd |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r['N']} | {r['ranks']} | {r['n']} | {r['H']}/{r['Hk']} | {r['d']} | "
            f"{'yes' if r['causal'] else 'no'} | {names[r['link']]} | {r['kv_mb']:.3g} | "
            f"{_ms(r['t_fwd'])} / {_ms(r['c_fwd'])} | {'yes' if r['hides_fwd'] else 'NO'} | "
            f"{_ms(r['t_bwd'])} / {_ms(r['c_bwd'])} | {'yes' if r['hides_bwd'] else 'NO'} | "
            f"{_ms(r['ring_fwd'] + r['ring_bwd'])} ({_ms(r['ideal_fwd'] + r['ideal_bwd'])}) | "
            f"{r['n_min_fwd']} |")
    return "\n".join(out)


def _ints(s):
    return [int(x) for x in s.split(",")]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--N", type=_ints, default=[131072, 1048576], help="global lengths")
    p.add_argument("--ranks", type=_ints, default=[8], help="ring sizes")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (no GQA)")
    p.add_argument("--head-dim", type=_ints, default=[128])
    p.add_argument("--dtype", choices=sorted(BYTES), default="bfloat16")
    p.add_argument("--causal", choices=["yes", "no", "both"], default="yes")
    p.add_argument("--link", default="NVLink=450,IB-NDR=50",
                   help="NAME=GB/s per direction, comma-separated")
    p.add_argument("--latency-us", type=float, default=0.0)
    p.add_argument("--fwd-tflops", type=float, default=None)
    p.add_argument("--fwdbwd-tflops", type=float, default=None)
    a = p.parse_args(argv)
    if a.dtype == "float32" and (a.fwd_tflops is None or a.fwdbwd_tflops is None):
        p.error("float32 has no measured default rate: pass --fwd-tflops and --fwdbwd-tflops")
    fwd = a.fwd_tflops or DEFAULT_TFLOPS["fwd"]
    fwdbwd = a.fwdbwd_tflops or DEFAULT_TFLOPS["fwdbwd"]
    links = {}
    for item in a.link.split(","):
        name, gbs = item.split("=")
        links[float(gbs)] = name
    causals = {"yes": [True], "no": [False], "both": [False, True]}[a.causal]
    rows = [step(N, W, a.batch, a.heads, a.kv_heads or a.heads, d, a.dtype, c, bw, fwd, fwdbwd,
                 a.latency_us)
            for N in a.N for W in a.ranks for d in a.head_dim for c in causals for bw in links]
    print(f"# ring attention model: {a.dtype}, B={a.batch}, rates {fwd:g} TFLOP/s forward, "
          f"{bwd_tflops(fwd, fwdbwd):.4g} backward (from {fwdbwd:g} forward+backward), "
          f"latency {a.latency_us:g} us per transfer")
    print(table(rows, {bw: f"{name} {bw:g} GB/s" for bw, name in links.items()}))


if __name__ == "__main__":
    main()
