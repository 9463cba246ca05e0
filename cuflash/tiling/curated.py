"""The curated plan tables: the tiles each kernel family launches, chosen by a person.

Design
------
* **One table per planned kernel family** (``flash_fwd``, ``flash_fwd_tc``, ...), for all its
  builds: a family's ``_masked`` kernel (built with the logit features, whose registers move
  ptxas' spill boundary) takes the same cells, which give its own pairs where they differ.  A
  table maps (dtype class, head-dim class, architecture class) to a *cell*: a few (block_q,
  block_kv) pairs, the default first, then alternatives.  The defaults are the plans the library launched before
  the tables existed (the planner's preference lists filtered by ptxas sweeps), kept as they
  were on sm_80 and sm_90; the alternatives are the next pairs of those lists.  A default's
  tiles move only when its cell is edited (its shared-memory layout follows the planner's
  rule for ``KernelTiling.smaller``).
* **Dtype classes**: the dtypes that share every plan -- the SIMT kernels' float16, bfloat16
  and float32 (float accumulators) against float64; float16 and bfloat16 on the tensor cores;
  float32 (3xTF32) alone.
* **Head-dim classes**: a kernel is compiled for one head dim ``c`` that holds d and dv (the
  columns past them zero in shared memory, never stored), so no (d, dv) pair multiplies the
  plans: the SIMT kernels use the smallest of ``SIMT_HEAD_DIM_CLASSES`` >= max(d, dv) (10
  classes); the tensor-core kernels use d itself when d == dv and max(d, dv) otherwise (their
  head dims are multiples of 16: 16 classes; flash_bwd_tf32's multiples of 32 up to 128: 4).
  A padded tensor-core build is compiled with ``-DCUFLASH_HEAD_DIMS_PADDED``, so the d == dv
  kernels compile exactly as before.
* **Architecture classes**, from the shared-memory limit a plan is made for: ``sm_90`` (227
  KB and above), ``sm_80`` (163 KB: A100), ``sm_86`` (99 KB: sm_86, sm_89; compiled for
  sm_80), ``sm_75`` (64 KB and below).  ``limit=None`` plans as ``sm_90``.  The tensor-core
  families have no ``sm_75`` cells (the runtime does not choose them there; asked for, they
  take the smallest class's cells that fit).
* **Choosing**: the default is the first pair of the cell that fits the limit (shared memory,
  the register rules, the occupancy floor), else of the other classes' cells (smaller limits
  first); nothing else is taken silently.  A request with one tile size given takes the
  first pair of the limit's cell with that size, else the largest pair the formulas allow.
  Explicit ``block_q`` and ``block_kv`` are honoured whenever the size formulas allow them --
  never refused for a ptxas spill: on a GPU, ``cuflash.kernels.check_compiled`` raises
  ``SpillError`` naming this table's cell when the compiled kernel uses local memory.
* **Evidence**: every pair of every cell is compiled with NVRTC (the options of
  ``cuflash.kernels.build_options``, ``-ftz=true`` included) for the architecture its class
  is compiled for, in every module that launches it (the serving and feature builds too; a
  cell's default also in the tensor-core kernels' padded build), and must use no local
  memory: the repository's tests/tiling/test_curated_plans.py, with bench/plan_sweep.py to compile
  and record them.

A cell is written ``BQxBKV BQxBKV ...`` (default first); ``-`` is a cell with no plan.
``... / BQxBKV ...`` gives the pairs of the tensor-core kernels' padded build (calls with d !=
dv) where its registers differ from the plain build's (``-`` after the ``/``: none, so such
calls run the SIMT kernel).  ``... ; BQxBKV ...`` gives the features build's pairs where they
differ, with a ``/`` of their own for its padded build (the pairs before it may be left out:
the plain build's); without ``;`` the features build takes the plain build's pairs, ``/``
included.  ``=`` repeats the cell to its left, and in place of one build's pairs (``= ;
64x32``) that build of the cell to its left.  The SIMT forward's alternatives are the serving
kernel's decoding tiles (block_q down to 8 at the default's block_kv), which it takes for
short query blocks; the SIMT backward has its default only.
"""

import re

__all__ = ["ARCH_CLASSES", "COMPILED_FOR", "CURATED", "CURATED_KERNELS", "cell", "table",
           "table_arches"]

# architecture classes, smallest shared-memory limit first, and the architecture each one's
# plans are compiled for
ARCH_CLASSES = ("sm_75", "sm_86", "sm_80", "sm_90")
COMPILED_FOR = {"sm_75": 75, "sm_86": 80, "sm_80": 80, "sm_90": 90}
_SIMT = ARCH_CLASSES
_TC = ("sm_86", "sm_80", "sm_90")


class Cell(tuple):
    """One build's pairs in a cell, default first; ``padded``: those of its padded build (calls
    with d != dv on the tensor cores) where the cell gives its own after ``/``, else None."""
    padded = None


def _pairs(text, line):
    words = [] if text == "-" else text.split()
    if not all(re.fullmatch(r"\d+x\d+", w) for w in words):
        raise ValueError(f"curated table row {line!r}: {text!r} is not a list of pairs")
    pairs = tuple(tuple(int(x) for x in w.split("x")) for w in words)
    if len(set(pairs)) != len(pairs):
        raise ValueError(f"curated table row {line!r}: a pair twice in one cell")
    return pairs


def _build(text, left, plain, line):
    """The Cell of one build's text ``pairs [/ pairs]``; ``=``: ``left`` (the same build of the
    cell to the left).  The features build (``plain``: the plain build's Cell) may leave out
    its pairs before a ``/``: the plain build's."""
    if text == "=":
        if left is None:
            raise ValueError(f"curated table row {line!r}: '=' with no cell to its left")
        return left
    main, slash, pad = (x.strip() for x in text.partition("/"))
    if not main and (plain is None or not slash):
        raise ValueError(f"curated table row {line!r}: a build without pairs ('-' for none)")
    out = Cell(_pairs(main, line) if main else plain)
    if slash:
        out.padded = _pairs(pad, line)
    return out


def _grid(arches, text):
    """{head-dim class: {arch class: (plain build's Cell, features build's Cell)}} from a
    table's rows ``c | cell | cell ...``, one cell per class of ``arches``."""
    out = {}
    for line in text.strip().splitlines():
        key, *cells = (x.strip() for x in line.split("|"))
        if len(cells) != len(arches):
            raise ValueError(f"curated table row {line!r}: {len(cells)} cells for {arches}")
        row, left = {}, (None, None)
        for arch, text in zip(arches, cells):
            text = "= ; =" if text == "=" else text   # both builds of the cell to the left
            plain_text, semi, feat_text = (x.strip() for x in text.partition(";"))
            plain = _build(plain_text, left[0], None, line)
            left = row[arch] = (plain, _build(feat_text, left[1], plain, line) if semi else plain)
        out[int(key)] = row
    return out


def _table(arches, **grids):
    """{dtype: grid} from ``dtype_class=text`` (the dtypes of a class joined by ``_``)."""
    return {dt: _grid(arches, text) for names, text in grids.items() for dt in names.split("_")}


CURATED = {}

# --------------------------------------------------------------------------
# SIMT forward (flash_fwd.cu: flash_fwd and the serving kernel flash_fwd_serving; with the
# logit features flash_fwd_masked and flash_fwd_serving_masked, whose pairs where they differ
# follow a ``;``).  Classes: max(d, dv).
#   sm_75 | sm_86 | sm_80 | sm_90
# The largest tiles the shared memory and the register rule (block_kv / 4 + dv / 4 <= 96
# accumulators per thread) allow, 8 rows per warp: 64 x 64 up to 32, 64 x 32 to 64, 32 x 32 to
# 128, 16 x 32 above; where a plan leaves fewer than 4 resident warps per SM (16 x 32 at 256 on
# sm_80's 163 KB) the next one.  float64 plans fell back where ptxas spilled them (8 B at
# 254-255 registers in the sweeps of every class pair).
# --------------------------------------------------------------------------
CURATED["flash_fwd"] = _table(
    _SIMT,
    float16_bfloat16_float32="""
      8 | 64x64 32x64 16x64 8x64 | = | = | =
     16 | 64x64 32x64 16x64 8x64 | = | = | =
     32 | 64x64 32x64 16x64 | 64x64 32x64 16x64 8x64 | = | =
     64 | 64x32 32x32 16x32 | 64x32 32x32 16x32 8x32 | = | =
     96 | 32x32 | 32x32 16x32 | 32x32 16x32 8x32 | =
    128 | 32x32 | 32x32 16x32 | 32x32 16x32 8x32 | =
    160 | 16x16 | = | 16x32 | 16x32 8x32
    192 | 64x8 32x8 16x8 | 16x16 | 16x32 | 16x32 8x32
    224 | 32x16 | 16x16 | 16x32 | =
    256 | 32x8 | 64x8 32x8 16x8 | 16x16 | 16x32
""",
    float64="""
      8 | 64x64 32x64 16x64 8x64 | = | = | =
     16 | 64x64 32x64 16x64 | 64x64 32x64 16x64 8x64 | = | =
     32 | 64x32 32x32 16x32 | 64x64 32x64 16x64 | 64x64 32x64 16x64 8x64 | =
     64 | 32x32 | 64x32 32x32 16x32 | 64x32 32x32 16x32 8x32 | =
     96 | 32x16 | 32x32 | 32x32 16x32 | =
    128 | 32x8 | 32x16 | 32x32 | 32x32 16x32
    160 | 32x8 | 32x16 | 16x16 | 16x32
    192 | 8x16 | 32x8 | 16x16 | =
    224 | 8x8 | 32x8 | 64x8 32x8 16x8 | 16x16
    256 | 8x8 | 32x8 | 32x16 ; 32x8 16x8 | 16x16 ; 8x8
""")

# --------------------------------------------------------------------------
# SIMT backward (flash_bwd.cu: flash_bwd_dkdv and flash_bwd_dq run with one plan's tiles, with
# the preprocess and dQ conversion in the same module; _masked with the features, which take
# the same pairs).
#   sm_75 | sm_86 | sm_80 | sm_90
# 64 x 64 up to 64, 32 x 32 to 128, 16 x 16 above (dK/dV and dQ accumulators at most 64 per
# thread); float64's where its doubles fit the shared memory.
# --------------------------------------------------------------------------
CURATED["flash_bwd_dkdv"] = _table(
    _SIMT,
    float16_bfloat16_float32="""
      8 | 64x64 | = | = | =
     16 | 64x64 | = | = | =
     32 | 32x64 | 64x64 | = | =
     64 | 32x32 | 64x64 | = | =
     96 | 32x32 | = | = | =
    128 | 16x32 | 32x32 | = | =
    160 | 16x16 | = | = | =
    192 | 16x16 | = | = | =
    224 | 16x16 | = | = | =
    256 | 8x16 | 16x16 | = | =
""",
    float64="""
      8 | 32x64 | 64x64 | = | =
     16 | 32x64 | 64x64 | = | =
     32 | 32x32 | 32x64 | 64x64 | =
     64 | 16x32 | 32x32 | 32x64 | 64x64
     96 | 16x16 | 16x32 | 32x32 | =
    128 | 16x8 | 16x16 | 32x32 | =
    160 | 8x16 | 16x16 | = | =
    192 | 8x8 | 8x16 | 16x16 | =
    224 | 8x8 | 8x16 | 16x16 | =
    256 | - | 8x16 | 16x16 | =
""")
CURATED["flash_bwd_dq"] = CURATED["flash_bwd_dkdv"]

# --------------------------------------------------------------------------
# Tensor-core forward (flash_fwd_tc.cu): float16/bfloat16 flash_fwd_tc, float32 flash_fwd_tf32
# (3xTF32); after a ``;`` the pairs of their _masked kernels (the logit features).
#   sm_86 | sm_80 | sm_90
# 4 warps of 32 rows where the accumulators fit (every K/V fragment feeds two MMAs) with the
# longest K/V tile those rows hold (128 x 64 up to 96, 128 x 32 to 128); above 128, 4 warps of
# 16 rows (64 x 32).  At d = 128 on sm_80 and sm_90, FlashAttention-2's 128 x 64 (32 rows per
# warp, 192 accumulators): half the rescale multiplies per MMA of 128 x 32, where the row max
# moves on every tile (bench/fa2_sass_compare.py); on an A100 in one K and one V buffer (68
# KB, two blocks per SM: KernelTiling.smaller), on an H100 in two stages (104 KB, two blocks).  The masked kernel keeps the band, the ALiBi slope and the dropout key
# beside S and O: at d = 64 and 80 128 x 64 spilled on sm_80, so it runs 128 x 32 there.
# flash_fwd_tf32 keeps hi and lo fragments besides: 128 x 32 up to 80, 128 x 16 to 128, 64 x 16
# above (64 x 32 after it where 64 x 16 spilled: one split of each Q fragment per 32 keys --
# 265 against 309 instructions per logit, flash_fwd_tf32_masked d = 256, sm_90 SASS).
# The masked kernels with the options of a launch (-ftz=true) and NVRTC 13.0 on sm_90:
# flash_fwd_tf32_masked d = 256 64 x 16 spills 36 B, so 64 x 32 is the default there; 64 x 32
# of flash_fwd_tc_masked at d = 128 spills 8 B.  The padded build (d != dv) keeps more
# registers (the column predicates): on sm_90 its defaults are 128 x 32 for
# flash_fwd_tc_masked at 80 (128 x 64 spills 12 B), 128 x 16 at 128 (128 x 32 spills 16 B),
# and 128 x 32 for flash_fwd_tf32_masked at 128 (16 rows per warp: 213 registers; 128 x 16
# and 64 x 16 spill 8 B); on sm_80 flash_fwd_tf32_masked at 256 has no padded plan (64 x 16
# spills 28 B, and every smaller one leaves fewer than 4 warps per SM): such calls take the
# sm_86 cell's 16 x 16 (one warp per SM on an A100; not yet timed against the SIMT kernel).
# --------------------------------------------------------------------------
CURATED["flash_fwd_tc"] = _table(_TC, float16_bfloat16="""
     16 | 128x64 128x32 64x64 | = | =
     32 | 128x64 128x32 64x64 | = | =
     48 | 128x64 128x32 64x64 | = | =
     64 | 128x64 128x32 64x64 ; 128x32 64x32 32x32 | = | 128x64 128x32 64x64
     80 | 128x64 128x32 64x32 ; 128x32 64x32 16x16 | 128x64 128x32 64x64 ; 128x32 64x32 32x32 | = ; / 128x32
     96 | 128x64 128x32 64x32 ; 128x32 64x32 16x16 | 128x64 128x32 64x64 ; 128x32 64x32 32x32 | =
    112 | 128x32 64x32 128x16 | = | =
    128 | 128x32 128x16 16x16 | 128x64 128x32 64x32 128x16 ; 128x32 64x32 128x16 | 128x64 128x32 64x32 128x16 / 128x32 64x32 128x16 ; 128x32 128x16 / 128x16
    144 | 64x32 64x16 32x16 | = | =
    160 | 64x32 64x16 32x16 | = | =
    176 | 64x32 64x16 32x16 | = | =
    192 | 64x32 64x16 32x16 | = | =
    208 | 64x32 64x16 32x16 | = | =
    224 | 64x32 64x16 32x16 | = | =
    240 | 64x32 64x16 32x16 | = | =
    256 | 64x32 64x16 | 64x32 64x16 32x16 | = ; 64x32 64x16 16x16
""")
CURATED["flash_fwd_tf32"] = _table(_TC, float32="""
     16 | 128x32 64x32 128x16 | = | =
     32 | 128x32 64x32 128x16 | = | =
     48 | 128x32 64x32 128x16 | = | =
     64 | 128x32 128x16 16x16 | 128x32 64x32 128x16 | =
     80 | 128x32 128x16 | 128x32 64x32 128x16 | =
     96 | 128x16 | 128x32 64x32 128x16 ; 128x16 16x16 | =
    112 | 128x16 | 128x16 64x16 16x16 | 128x16 64x16 32x16
    128 | 64x16 | 128x16 64x16 | 128x16 64x16 32x16 ; / 128x32
    144 | 64x16 | 64x16 64x32 32x16 | =
    160 | 64x16 | 64x16 64x32 32x16 | =
    176 | 64x16 | 64x16 64x32 32x16 | =
    192 | 32x16 | 64x16 64x32 32x16 | =
    208 | 32x16 | 64x16 64x32 32x16 | =
    224 | 32x16 | 64x16 | 64x16 64x32 32x16
    240 | 32x16 | 64x16 | 64x16 64x32 32x16
    256 | 16x16 | 64x16 ; / - | 64x16 64x32 32x16 ; 64x32
""")

# --------------------------------------------------------------------------
# The Hopper forward (flash_fwd_wgmma.cu, sm_90a): float16/bfloat16 at d = dv in 64..256 by 64;
# block_q is 128 (two consumer warpgroups of 64 rows).
#   sm_90
# 128 keys per tile where the accumulators fit (S's wgmma at N = 128: 1471 instructions per
# 1,000 HMMA-equivalents at d = 128 against 1707 at 64 keys, bench/results/hopper_sass_count.md),
# 96 at d = 192, 64 at d = 256 (O's 128 registers leave room for 32 of S).  At d = 128, 176 keys
# (FlashAttention-3's tile) count 1428 and 192 keys 1402, both with two stages in the 227 KB:
# alternatives until a GPU times them against 128.  NVRTC 13.0 spills none of these; bfloat16
# at d = 64 with 256 keys does.
# --------------------------------------------------------------------------
CURATED["flash_fwd_wgmma"] = _table(("sm_90",), float16_bfloat16="""
 64 | 128x128 128x64 128x192
128 | 128x128 128x64 128x176 128x192
192 | 128x96 128x64
256 | 128x64
""")

# --------------------------------------------------------------------------
# Tensor-core backward (flash_bwd_tc.cu, float16/bfloat16; after a ``;`` the pairs of
# flash_bwd_tc_masked, with the logit features).
#   sm_86 | sm_80 | sm_90
# 128 keys per block where the shared memory allows (K/V and the dQ reds amortised over the
# most work): 32 x 128 with 32 keys per warp up to d = 64; 64 x 128 with the query split
# (32 keys per warp pair, 32 queries per warp) up to 128 (kernel-report model at d = 128:
# 259 B of shared memory per HMMA at 64 x 128, 272 at 64 x 64, 336 at 32 x 128; FA2 256);
# 32 x 128 in two passes above.  At d = 64 on sm_80 / sm_90 FlashAttention-2's 128 x 128 (8
# warps, the query split, 64 queries per warp) and at d = 128 on sm_80 its 64 x 128: per
# 1,000 HMMA of the steady trip 3491 / 3394 and 2759 against 3825 / 3875 and 2972 for 32 x
# 128 and 64 x 64 (FA2 3538 / 3412 / 2788; bench/fa2_sass_compare.py).  On an A100 both
# take one dO buffer (160 and 156 KB, one block of 8 warps per SM, as FA2; 64 x 64 ran one
# block of 4 warps, 32 x 128 two of 4); on an H100 d = 64 goes from three blocks of 4 warps
# to one of 8 (178 KB, both buffers).  No GPU has timed them.
# The masked kernel's register budget is lower: where 32 x 128
# would take the query split (d <= 64), 64 x 128 gives each warp 32 queries again (40.5
# instructions per logit against 66.4 at d = 64, sm_80); where 64 x 128 would need two passes
# (d in 80..128), 128 x 64 in one pass on sm_90 (51.2 per logit against 91.6 at d = 128) and
# 32 x 128 or 64 x 64 below it.
# The masked kernel's padded build at 256 (d != dv; NVRTC 13.0, -ftz=true) spills with 16 x 32
# on sm_80 (12 B) and sm_90 (28 B) and 16 x 64 (12 B, 24 B): it runs 16 x 16 (233 and 245
# registers), which on sm_80's 163 KB leaves 3 warps per SM -- below the floor, so the sm_80
# cell has no padded pair and such calls take the sm_86 cell's.  The sm_86 cell at 128 has no
# 16 x 64: with the tail tile's masking of rows past Nq it spills 4 B (255 registers, sm_80).
# --------------------------------------------------------------------------
CURATED["flash_bwd_tc"] = _table(_TC, float16_bfloat16="""
     16 | 32x128 64x128 32x64 | = | = ; 32x128 64x128 16x64
     32 | 32x128 64x128 32x64 | = | = ; 16x64 16x32 16x16
     48 | 32x128 64x128 32x64 ; 64x128 64x64 32x128 | = | = ; 32x128 32x64 16x64
     64 | 32x128 32x64 16x64 ; 64x64 32x128 32x64 | 128x128 32x128 64x128 32x64 ; 64x128 64x64 32x128 | =
     80 | 64x64 32x128 32x64 | 64x128 64x64 32x128 | =
     96 | 64x64 32x128 32x64 ; 32x128 64x64 32x64 | 64x128 64x64 32x128 ; 32x128 64x64 64x128 | = ; 128x64 32x128 64x64
    112 | 32x64 16x64 16x32 | 64x128 64x64 32x128 ; 32x128 64x64 64x128 | = ; 128x64 32x128 64x64
    128 | 32x64 16x32 ; 32x64 16x64 16x32 | 64x128 64x64 32x128 32x64 ; 64x64 64x128 32x128 | 64x128 64x64 32x128 ; 128x64 64x64 64x128
    144 | 32x64 16x64 16x32 | 32x128 64x64 32x64 | =
    160 | 32x64 16x64 16x32 | 32x128 64x64 32x64 | =
    176 | 32x64 16x64 16x32 | 32x128 32x64 16x64 ; 32x128 64x64 32x64 | =
    192 | 16x64 | 32x128 64x64 32x64 ; 32x128 32x64 16x64 | 32x128 64x64 32x64
    208 | 16x64 | 32x64 16x64 16x32 | 32x128 32x64 16x64 ; 32x128 64x64 32x64
    224 | 16x64 | 16x64 16x32 ; 32x64 16x64 16x32 | 32x128 16x64 16x32 ; 32x128 64x64 32x64
    240 | 16x64 | 32x64 16x64 16x32 ; 16x64 16x32 | 32x128 32x64 16x64 ; 16x64 16x32 16x16
    256 | 16x32 ; / 16x16 | 32x64 16x64 16x32 ; 16x64 16x32 / - | 16x64 16x32 16x16 ; / 16x16
""")

# --------------------------------------------------------------------------
# The tensor-core backward's band-only build (flash_bwd_tc.cu with -DCUFLASH_BWD_BAND:
# flash_bwd_tc_band, a call whose only feature is a window), d == dv up to 128: the plain
# kernel's pairs (its registers but the band's test, its lean loop) less those where ptxas
# spills it (NVRTC 13.0, -ftz=true, both dtypes): 32 x 64 at d = 64 on sm_80 (8 B); at d = 112
# 64 x 128 on sm_90 (4 B); at d = 128 32 x 128 (20 B sm_80, 28 B sm_90), 32 x 64 on sm_80 (12 B;
# the sm_86 cell runs 16 x 64 instead: four warps as 32 x 64, which the plain kernel's cell has)
# and 64 x 64 on sm_90 (12 B).  Other calls with a window take flash_bwd_tc_masked.
#   sm_86 | sm_80 | sm_90
# --------------------------------------------------------------------------
_BAND_TEXT = """
     16 | 32x128 64x128 32x64 | = | =
     32 | 32x128 64x128 32x64 | = | =
     48 | 32x128 64x128 32x64 | = | =
     64 | 32x128 16x64 | 128x128 32x128 64x128 | =
     80 | 64x64 32x128 32x64 | 64x128 64x64 32x128 | =
     96 | 64x64 32x128 32x64 | 64x128 64x64 32x128 | =
    112 | 32x64 16x64 16x32 | 64x128 64x64 32x128 | 64x64 32x128
    128 | 16x64 16x128 16x32 | 64x128 64x64 | 64x128
"""
CURATED["flash_bwd_tc_band"] = _table(_TC, float16_bfloat16=_BAND_TEXT)


def _with_rows(text, rows):
    """A table's text with the rows of some head-dim classes replaced ({class: "row cells"})."""
    out = []
    for line in text.splitlines(keepends=True):
        c = line.split("|")[0].strip()
        out.append(f"{c:>7} | {rows[int(c)]}\n" if c.isdigit() and int(c) in rows else line)
    return "".join(out)


# --------------------------------------------------------------------------
# Its softcap build (-DCUFLASH_BWD_SOFTCAP too: flash_bwd_tc_softcap, a softcap and at most a
# window): the band build's pairs (its rows but two) less those where ptxas spills it (NVRTC
# 13.0, -ftz=true, both dtypes): 32 x 128 at d = 64 on sm_90 (12 B), 16 x 64 at d = 128 in the
# sm_86 cell (12 B; it runs 16 x 128 instead).  Where P^T stays in float32 for dS (kFloatP: the copies unrolled,
# so power-of-two head dims, and d >= 64 on sm_90) it runs the softcap's r form, elsewhere the
# masked kernel's tanh form (kernels_cu/flash_bwd_tc.cu).
#   sm_86 | sm_80 | sm_90
# --------------------------------------------------------------------------
CURATED["flash_bwd_tc_softcap"] = _table(_TC, float16_bfloat16=_with_rows(_BAND_TEXT, {
    64: "32x128 16x64 | 128x128 32x128 64x128 | 128x128 64x128",
    128: "16x128 16x32 | 64x128 64x64 | 64x128"}))

# --------------------------------------------------------------------------
# Its ALiBi build (-DCUFLASH_BWD_ALIBI: flash_bwd_tc_alibi, ALiBi and at most a window): the
# band build's pairs (its rows but one) less those where ptxas spills it (NVRTC 13.0, -ftz=true, both dtypes):
# 64 x 64 at d = 128 on sm_80 (16 B)
#   sm_86 | sm_80 | sm_90
# --------------------------------------------------------------------------
CURATED["flash_bwd_tc_alibi"] = _table(_TC, float16_bfloat16=_with_rows(_BAND_TEXT, {
    128: "16x64 16x128 16x32 | 64x128 | 64x128"}))

# --------------------------------------------------------------------------
# Its dropout build (-DCUFLASH_BWD_DROPOUT: flash_bwd_tc_dropout, dropout and at most a window):
# the band build's pairs less those where ptxas spills it (NVRTC 13.0, -ftz=true, both
# dtypes): 64 x 128 at d = 32 on sm_80 (12 B), 16 x 64 at d = 64 on sm_80 (4 B; the sm_86
# cell runs 64 x 64 instead) and 32 x 128 on sm_90 (20 B), 64 x 64 at d = 112 on sm_90 (20
# B; 32 x 128 and 32 x 64 there).
#   sm_86 | sm_80 | sm_90
# --------------------------------------------------------------------------
_DROPOUT_ROWS = {
    32: "32x128 32x64 | = | 32x128 64x128 32x64",
    64: "32x128 64x64 | 128x128 32x128 64x128 | 128x128 64x128",
    112: "32x64 16x64 16x32 | 64x128 64x64 32x128 | 32x128 32x64"}
CURATED["flash_bwd_tc_dropout"] = _table(_TC, float16_bfloat16=_with_rows(_BAND_TEXT, _DROPOUT_ROWS))

# --------------------------------------------------------------------------
# Its ALiBi + dropout build (-DCUFLASH_BWD_ALIBI -DCUFLASH_BWD_DROPOUT: flash_bwd_tc_alibi_dropout,
# ALiBi, dropout and at most a window): the dropout build's pairs less 16 x 64 at d = 128 in
# the sm_86 cell (8 B; it runs 16 x 128 instead)
#   sm_86 | sm_80 | sm_90
# --------------------------------------------------------------------------
CURATED["flash_bwd_tc_alibi_dropout"] = _table(_TC, float16_bfloat16=_with_rows(_BAND_TEXT, {
    **_DROPOUT_ROWS, 128: "16x128 16x32 | 64x128 64x64 | 64x128"}))

# --------------------------------------------------------------------------
# Its ALiBi + softcap build (-DCUFLASH_BWD_SOFTCAP -DCUFLASH_BWD_ALIBI: flash_bwd_tc_alibi_softcap,
# a softcap, ALiBi and at most a window): the softcap build's pairs less those where ptxas
# spills it (NVRTC 13.0, -ftz=true, both dtypes): 64 x 128 at d = 32 on sm_80 (8 B), 128 x
# 128 at d = 64 on sm_90 (12 B), at d = 128 64 x 64 on sm_80 (4 B) and 16 x 128 (16 B), where
# the sm_86 cell runs 32 x 64 (no spill here: 245 registers)
#   sm_86 | sm_80 | sm_90
# --------------------------------------------------------------------------
CURATED["flash_bwd_tc_alibi_softcap"] = _table(_TC, float16_bfloat16=_with_rows(_BAND_TEXT, {
    32: "32x128 32x64 | = | 32x128 64x128 32x64",
    64: "32x128 16x64 | 128x128 32x128 64x128 | 64x128",
    128: "32x64 16x64 16x32 | 64x128 | 64x128"}))



# --------------------------------------------------------------------------
# The Hopper backward (flash_bwd_wgmma.cu, sm_90a): float16/bfloat16 at d = dv = 64, 128,
# 192 or 256; one tile shape per head dim: 128 keys up to d = 128 (two consumer warpgroups of
# 64), 64 keys above (dK and dV of 128 keys do not fit the consumers' registers); 64 queries
# per tile.
#   sm_90
# --------------------------------------------------------------------------
CURATED["flash_bwd_wgmma"] = _table(("sm_90",), float16_bfloat16="""
 64 | 64x128
128 | 64x128
192 | 64x64
256 | 64x64
""")

# --------------------------------------------------------------------------
# float32's tensor-core backward (flash_bwd_tf32.cu; after a ``;`` flash_bwd_tf32_masked's,
# with the logit features): 16 keys per warp, dK and dV of (d + dv) / 2 plus block_q registers
# per thread.  The padded build at 64 on sm_90 spills 64 x 64 (12 B; NVRTC 13.0, -ftz=true)
# and runs 32 x 64 (217 registers); the masked padded build at 128 on sm_80 spills 16 x 64
# (28 B) and runs 16 x 32.
#   sm_86 | sm_80 | sm_90
# --------------------------------------------------------------------------
CURATED["flash_bwd_tf32"] = _table(_TC, float32="""
     32 | 64x64 32x64 32x32 | 64x64 32x64 64x32 | =
     64 | 32x64 16x32 | 64x64 32x64 32x32 | 64x64 32x64 32x32 / 32x64 ; 64x64 32x64 32x32
     96 | 16x64 | 32x64 16x64 16x32 | 32x64 16x64 32x32 ; 16x64 16x32
    128 | 16x32 | 16x64 16x32 ; / 16x32 | 16x64 16x32
""")


# kernel name -> (its table, whether it is the table's features build): each family, and its
# build with the logit features (``_masked``, -DCUFLASH_MASKS) but the Hopper kernels', which
# have none
CURATED_KERNELS = {**{k: (k, False) for k in CURATED},
                   **{f"{k}_masked": (k, True) for k in CURATED
                      if not k.endswith("_wgmma")
                      and not k.startswith("flash_bwd_tc_")}}  # (the lean builds: features built in)


def table(kernel):
    """{dtype: {head-dim class: {arch class: Cell}}}: the cells of ``kernel``'s build (of a
    ``_masked`` kernel: its table's features build); empty where it has no table."""
    family, features = CURATED_KERNELS.get(kernel, (None, False))
    return {dt: {c: {a: b[features] for a, b in row.items()} for c, row in grid.items()}
            for dt, grid in CURATED.get(family, {}).items()}


def table_arches(kernel):
    """The architecture classes ``kernel``'s table has cells for (none: no table)."""
    grids = CURATED.get(CURATED_KERNELS.get(kernel, (None,))[0])
    if not grids:
        return ()
    row = next(iter(next(iter(grids.values())).values()))
    return tuple(a for a in ARCH_CLASSES if a in row)


def cell(kernel, dtype, c, arch, padded=False):
    """The curated pairs of ``kernel`` for ``dtype`` at head-dim class ``c`` and architecture
    class ``arch``, default first: a tuple of (block_q, block_kv), empty where there is none;
    ``padded``: those of the padded build (the build's own after ``/``, else the same).  A
    ``_masked`` kernel takes its table's features build (the cell's after ``;``, else the
    same)."""
    family, features = CURATED_KERNELS.get(kernel, (None, False))
    builds = CURATED.get(family, {}).get(dtype, {}).get(c, {}).get(arch)
    if builds is None:
        return ()
    pairs = builds[features]
    return tuple(pairs) if not padded or pairs.padded is None else pairs.padded
