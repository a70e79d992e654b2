"""Device mesh and logical axis rules.

Parameters carry *logical* axis names (``nnx.with_partitioning``), e.g. an
attention query matrix of shape (d_model, heads, head_dim) is named
``('embed', 'heads', 'kv')``. A rules table maps each logical axis to a mesh axis
(or to None: replicated). This is the scheme of t5x/flax "logical axis rules";
the tables here are this project's own.

Mesh axes:
  'data'   pure data parallelism: the batch is split, parameters are replicated.
  'fsdp'   fully sharded data parallelism (ZeRO-3, Rajbhandari et al. 2020,
           arXiv 1910.02054): the batch is split *and* parameters and optimizer
           state are sharded along their 'embed' dimension, gathered per use.
  'model'  tensor parallelism in the style of Megatron-LM (Shoeybi et al. 2019,
           arXiv 1909.08053): attention heads and the MLP hidden dimension are
           split; the residual stream is replicated over 'model'.

The batch dimension is always split over ('data', 'fsdp') together.

Rules presets (``RULES``): ``dp`` replicates every parameter; ``fsdp`` shards
'embed' over 'fsdp'; ``tp`` 'heads' and 'mlp' over 'model'; ``fsdp+tp`` both.
RMSNorm scales ('norm'), T5's relative position buckets ('relpos_buckets'),
the leading axis of scanned layers' stacked parameters ('layers') and
'vocab' stay replicated in every preset: they are small, and a replicated
'vocab' keeps any vocabulary size usable whatever the mesh.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "model")
BATCH_AXES = ("data", "fsdp")


_BASE = {**dict.fromkeys(("vocab", "embed", "heads", "kv", "mlp", "norm", "relpos_buckets", "layers")),
         "batch": BATCH_AXES,
         **dict.fromkeys(("length", "act_embed", "act_heads", "act_mlp", "act_vocab"))}
_TP = dict.fromkeys(("heads", "mlp", "act_heads", "act_mlp"), "model")

RULES: dict[str, dict[str, Any]] = {
    "dp": dict(_BASE),
    "fsdp": {**_BASE, "embed": "fsdp"},
    "tp": {**_BASE, **_TP},
    "fsdp+tp": {**_BASE, "embed": "fsdp", **_TP},
}


class PartitioningError(ValueError):
    """A mesh or a logical axis rule cannot be applied (the message names the
    parameter path, its shape and the mesh axis)."""


def get_rules(name: str) -> dict[str, Any]:
    """A copy of the rules preset ``name`` (logical axis -> mesh axis, tuple of mesh axes, or None).

    Raises:
      PartitioningError: unknown preset name (the message lists the presets).
    """
    try:
        return dict(RULES[name])
    except KeyError:
        raise PartitioningError(f"unknown rules preset {name!r}; presets: {sorted(RULES)}") from None


def resolve_mesh_shape(shape: Mapping[str, int], num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, model) sizes with one -1 filled in so that the product is ``num_devices``.

    Raises:
      PartitioningError: more than one -1, a size < 1, or a product that does not
        match the number of devices.
    """
    sizes = [int(shape.get(a, 1)) for a in MESH_AXES]
    unknown = [a for a, s in zip(MESH_AXES, sizes) if s == -1]
    if len(unknown) > 1:
        raise PartitioningError(f"mesh {dict(zip(MESH_AXES, sizes))}: at most one axis may be -1 (got {unknown})")
    for a, s in zip(MESH_AXES, sizes):
        if s != -1 and s < 1:
            raise PartitioningError(f"mesh axis {a!r} has size {s}; sizes must be >= 1 (or -1 for 'the rest')")
    known = int(np.prod([s for s in sizes if s != -1]))
    if unknown:
        if num_devices % known:
            raise PartitioningError(
                f"mesh {dict(zip(MESH_AXES, sizes))}: {num_devices} devices are not divisible by {known}, "
                f"so axis {unknown[0]!r} cannot take the rest")
        sizes[MESH_AXES.index(unknown[0])] = num_devices // known
    if int(np.prod(sizes)) != num_devices:
        raise PartitioningError(
            f"mesh {dict(zip(MESH_AXES, sizes))} has {int(np.prod(sizes))} devices but {num_devices} are available; "
            "make the product of data*fsdp*model equal the device count (or set one axis to -1)")
    return tuple(sizes)  # type: ignore[return-value]


def make_mesh(shape: Mapping[str, int], devices: Sequence[Any] | None = None) -> Mesh:
    """A ('data', 'fsdp', 'model') mesh from ``jax.make_mesh``, axes of type Auto
    (shardings are given at the jit boundary; XLA propagates them inside).

    Args:
      shape: axis name -> size, e.g. ``{"data": 2, "fsdp": 4, "model": 1}``; one
        size may be -1 ("the remaining devices").
      devices: default ``jax.devices()``.

    Raises:
      PartitioningError: see ``resolve_mesh_shape``.
    """
    devices = list(devices) if devices is not None else jax.devices()
    sizes = resolve_mesh_shape(shape, len(devices))
    return jax.make_mesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def parse_mesh_flag(text: str) -> dict[str, int]:
    """Parses ``"data=2,fsdp=4,model=1"`` (any subset; missing axes are 1).

    Raises:
      PartitioningError: a malformed item or an unknown axis name.
    """
    out: dict[str, int] = {}
    for item in text.replace(" ", "").split(","):
        if not item:
            continue
        if "=" not in item:
            raise PartitioningError(f"--mesh item {item!r} must look like axis=size, e.g. data=2,fsdp=4,model=1")
        name, value = item.split("=", 1)
        if name not in MESH_AXES:
            raise PartitioningError(f"--mesh: unknown axis {name!r}; axes are {MESH_AXES}")
        try:
            out[name] = int(value)
        except ValueError:
            raise PartitioningError(f"--mesh: size of {name!r} must be an integer (got {value!r})") from None
    for a in MESH_AXES:
        out.setdefault(a, 1)
    return out


def logical_to_spec(logical_axes: Sequence[str | None], shape: Sequence[int], rules: Mapping[str, Any], mesh: Mesh,
                    *, path: str = "<array>") -> P:
    """The PartitionSpec on ``mesh`` of an array of ``shape`` with one logical
    axis name (or None = replicated) per dimension; ``rules`` map logical axes
    to a mesh axis, a tuple of them or None; ``path`` (e.g. ``blocks/0/attn/wq``)
    names the array in messages.

    Raises:
      PartitioningError: naming ``path``, ``shape`` and the mesh axis: a name
        count other than the rank, a logical axis without rule, a mesh axis not
        in the mesh or used twice, a dimension not divisible by its mesh axes.
    """
    shape = tuple(int(s) for s in shape)
    if len(logical_axes) != len(shape):
        raise PartitioningError(
            f"parameter {path} with shape {shape} has {len(logical_axes)} logical axis names "
            f"{tuple(logical_axes)}; expected one per dimension")
    spec = []
    used: dict[str, int] = {}
    for dim, (name, size) in enumerate(zip(logical_axes, shape)):
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise PartitioningError(
                f"parameter {path} with shape {shape}: logical axis {name!r} (dimension {dim}) has no rule; "
                f"the rules table knows {sorted(rules)}")
        rule = rules[name]
        axes = () if rule is None else (rule,) if isinstance(rule, str) else tuple(rule)
        total = 1
        for axis in axes:
            if axis not in mesh.shape:
                raise PartitioningError(
                    f"parameter {path} with shape {shape}: logical axis {name!r} maps to mesh axis {axis!r}, "
                    f"which is not in the mesh {dict(mesh.shape)}")
            if axis in used:
                raise PartitioningError(
                    f"parameter {path} with shape {shape}: mesh axis {axis!r} is used by dimensions "
                    f"{used[axis]} and {dim}; a mesh axis can shard only one dimension")
            used[axis] = dim
            total *= mesh.shape[axis]
        if size % total:
            sizes = ", ".join(f"{a!r} of size {mesh.shape[a]}" for a in axes)
            raise PartitioningError(
                f"parameter {path} with shape {shape}: dimension {dim} (logical axis {name!r}, size {size}) "
                f"is not divisible by mesh axis {sizes}; change the mesh or the model size, or use rules "
                f"that replicate {name!r}")
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*spec)


def _path_str(path: Sequence[Any]) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def param_specs(abstract_params: Any, logical_axes: Any, rules: Mapping[str, Any], mesh: Mesh) -> Any:
    """PartitionSpecs for a parameter tree (arrays or ShapeDtypeStructs) whose
    ``logical_axes`` tree (``models.common.logical_axes``) gives each leaf's names.

    Raises:
      PartitioningError: see ``logical_to_spec`` (the message names the parameter path).
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
    names = treedef.flatten_up_to(logical_axes)
    specs = [
        logical_to_spec(n, leaf.shape, rules, mesh, path=_path_str(path)) for (path, leaf), n in zip(flat, names)
    ]
    return jax.tree_util.tree_unflatten(treedef, specs)


def named_shardings(specs: Any, mesh: Mesh) -> Any:
    """PartitionSpec tree -> NamedSharding tree."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a (batch, length) array: rows split over ('data', 'fsdp')."""
    return NamedSharding(mesh, P(BATCH_AXES, None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def data_parallel_size(mesh: Mesh) -> int:
    """Number of batch shards: size of 'data' times size of 'fsdp'."""
    return int(mesh.shape["data"] * mesh.shape["fsdp"])


# Activation sharding: the models call ``constrain(x, logical axes)``; inside
# ``activation_rules`` it is a ``with_sharding_constraint``, outside a no-op.
_ACTIVE = threading.local()


@contextlib.contextmanager
def activation_rules(mesh: Mesh, rules: Mapping[str, Any]):
    """Within this context (while tracing), ``constrain`` applies ``rules`` on ``mesh``."""
    previous = getattr(_ACTIVE, "value", None)
    _ACTIVE.value = (mesh, dict(rules))
    try:
        yield
    finally:
        _ACTIVE.value = previous


def active() -> tuple[Mesh, dict[str, Any]] | None:
    """(mesh, rules) of the enclosing ``activation_rules``, or None outside one."""
    return getattr(_ACTIVE, "value", None)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on an activation by logical axis names (no-op outside
    ``activation_rules``)."""
    active = getattr(_ACTIVE, "value", None)
    if active is None:
        return x
    mesh, rules = active
    spec = logical_to_spec(logical_axes, x.shape, rules, mesh, path="<activation>")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
