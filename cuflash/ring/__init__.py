"""Context-parallel (ring) attention: one sequence sharded across devices, exact.

Each rank holds a shard of the queries, keys and values along the sequence.  The key/value
shards travel around a ring of ranks; at every step a rank runs cuflash on its queries
against the block it holds and merges the partial ``(o, lse)`` by their log-sum-exp (the
split-KV combine).  The backward sends the key/value shards around again, with their
gradient accumulators following one step behind.

* :mod:`cuflash.ring.torch`: ``torch.distributed`` (gloo on CPUs, NCCL on GPUs), a
  ``torch.autograd.Function``.
* :mod:`cuflash.ring.jax`: ``shard_map`` and ``lax.ppermute`` over a mesh axis, a
  ``jax.custom_vjp`` function.

Neither framework is imported here.  Which cuflash calls a step makes (causal and window
masks from global positions, zigzag load balancing) is worked out once, framework-free,
in this package's planner.
"""
from ._plan import SHARDINGS, chunks_of, step_calls

__all__ = ["SHARDINGS", "chunks_of", "step_calls"]
