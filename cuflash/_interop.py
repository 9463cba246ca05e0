"""What :mod:`cuflash.torch` and :mod:`cuflash.jax` share: layouts and bfloat16 bit views.

Neither framework is imported here.  The helpers work on anything with
``.shape``, ``.ndim`` and ``.swapaxes`` (NumPy, CuPy, torch and JAX arrays all
have them), so the framework modules stay small and the layout rule is
written once.

Layouts
-------
``"bhnd"`` is cuflash's own convention and PyTorch SDPA's: ``(..., H, N, d)``.
``"bnhd"`` is flash-attn's: ``(..., N, H, d)``.  A ``bnhd`` input is handed to
cuflash as the swapped view ``x.swapaxes(-3, -2)``, which costs no copy since
every cuflash backend takes strided inputs; results come back through the same
swap (the swap is its own inverse), again as views.
"""
import numpy as np

__all__ = ["LAYOUTS", "check_layout", "to_bhnd", "from_bhnd", "layout_error",
           "bfloat16_dtype", "is_bfloat16"]

LAYOUTS = ("bhnd", "bnhd")


def check_layout(layout, **arrays):
    """ValueError for a layout not in :data:`LAYOUTS`, or for a ``bnhd`` array of ``arrays``
    (by name; only ``.ndim`` and ``.shape`` are read) without a heads axis."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose 'bhnd' ((..., H, N, d), as "
                         "torch SDPA) or 'bnhd' ((..., N, H, d), as flash-attn)")
    if layout == "bnhd":
        for name, a in arrays.items():
            if a.ndim < 3:
                raise ValueError(f"layout='bnhd' needs {name} of shape (..., N, H, d) with "
                                 f"at least 3 dims, got shape {tuple(a.shape)}")


def to_bhnd(x, layout):
    """``x`` as cuflash's ``(..., H, N, d)``: a swapped view for ``bnhd``, ``x`` itself else."""
    return x.swapaxes(-3, -2) if layout == "bnhd" else x


# the swap of the two axes is its own inverse
from_bhnd = to_bhnd


def layout_error(err, layout):
    """A cuflash shape error, with a note that ``bnhd`` shapes were shown swapped."""
    if layout != "bnhd":
        return err
    return type(err)(f"{err} [layout='bnhd': the shapes above are the (..., H, N, d) views "
                     "of the (..., N, H, d) inputs]")


def bfloat16_dtype():
    """``ml_dtypes.bfloat16`` as a NumPy dtype (NumPy has no bfloat16 of its own)."""
    try:
        import ml_dtypes  # optional: only bfloat16 arrays need it
    except ImportError as e:
        raise ImportError("bfloat16 arrays in NumPy/CuPy need ml_dtypes: "
                          "pip install ml_dtypes") from e
    return np.dtype(ml_dtypes.bfloat16)


def is_bfloat16(dtype):
    """True for ml_dtypes' bfloat16 (checked by name: ml_dtypes need not be installed)."""
    dt = np.dtype(dtype)
    # NumPy's own floats have kind "f"; only the name lookup of others is slow-ish
    return dt.kind == "V" and dt.name == "bfloat16"
