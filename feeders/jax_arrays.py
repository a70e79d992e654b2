"""Global ``jax.Array`` batches from host-local feeder batches.

Each host's feeder returns its own B / H rows; ``make_global_batch`` assembles them
into arrays of the global shape (B, ...) sharded over the mesh's batch axes with
``jax.make_array_from_process_local_data``, without moving data between hosts.
JAX is imported when the function is called, so the feeder core imports without it.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

# Mesh axes that split the batch, in this order, when present (the training mesh is
# ('data', 'fsdp', 'model'); 'model' replicates the batch).
DEFAULT_BATCH_AXES = ("data", "fsdp")


def batch_sharding(mesh, batch_axes: Sequence[str] | None = None):
    """``NamedSharding(mesh, P(batch_axes))``: the leading (batch) dimension split
    over ``batch_axes`` (default: those of 'data', 'fsdp' the mesh has, else all
    its axes), the other dimensions replicated."""
    from jax.sharding import NamedSharding, PartitionSpec

    if batch_axes is None:
        batch_axes = tuple(a for a in DEFAULT_BATCH_AXES if a in mesh.axis_names) or tuple(mesh.axis_names)
    for a in batch_axes:
        if a not in mesh.axis_names:
            raise ValueError(f"batch axis {a!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
    return NamedSharding(mesh, PartitionSpec(tuple(batch_axes)))


def make_global_batch(host_batch: Mapping[str, np.ndarray], sharding_or_mesh: Any, *,
                      batch_axes: Sequence[str] | None = None) -> dict:
    """Host-local batch -> dict of global ``jax.Array``.

    Args:
      host_batch: name -> numpy array (B / H, ...), as ``Feeder.get_batch`` returns.
      sharding_or_mesh: a ``jax.sharding.Mesh`` (the batch dimension is split over
        ``batch_axes``), one ``jax.sharding.Sharding`` for every array, or a dict
        name -> Sharding.
      batch_axes: mesh axes of the batch dimension when a Mesh is given (default:
        see ``batch_sharding``).

    Returns:
      name -> ``jax.Array`` of global shape (B, ...), B = (B / H) * H.

    Raises:
      ValueError: the batch dimension does not divide over the sharding's devices
        (JAX's message names the shapes), or a batch axis not in the mesh.
      KeyError: a dict of shardings that lacks one of the batch's names.
    """
    import jax
    from jax.sharding import Mesh

    if isinstance(sharding_or_mesh, Mesh):
        shardings = {k: batch_sharding(sharding_or_mesh, batch_axes) for k in host_batch}
    elif isinstance(sharding_or_mesh, Mapping):
        missing = [k for k in host_batch if k not in sharding_or_mesh]
        if missing:
            raise KeyError(f"no sharding given for {missing} (shardings for {sorted(sharding_or_mesh)})")
        shardings = dict(sharding_or_mesh)
    else:
        shardings = {k: sharding_or_mesh for k in host_batch}
    out = {}
    for name, local in host_batch.items():
        local = np.asarray(local)
        global_shape = (local.shape[0] * jax.process_count(),) + local.shape[1:]
        out[name] = jax.make_array_from_process_local_data(shardings[name], local, global_shape)
    return out
