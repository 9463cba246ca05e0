"""Launching the SIMT kernels with the logit features (bias, window, ALiBi, softcap, dropout)."""

__all__ = ["wanted", "tiled_attention", "tiled_attention_backward"]


def wanted(bias, window, alibi_slopes, softcap, dropout_p, seed):
    """True when a call names any feature (the plain launchers serve the others unchanged)."""
    return not (bias is None and window is None and alibi_slopes is None and softcap is None
                and seed is None and (dropout_p == 0.0 and not isinstance(dropout_p, bool)))


def tiled_attention(runtime, q, k, v, scale, causal, block_q, block_kv, return_lse, **features):
    raise NotImplementedError("the kernels do not take the logit features yet")


def tiled_attention_backward(runtime, do, q, k, v, o, lse, scale, causal, block_q, block_kv,
                             deterministic, **features):
    raise NotImplementedError("the kernels do not take the logit features yet")
