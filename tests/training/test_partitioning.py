"""Mesh construction and logical axis rules, including their error messages."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from seqcache.training import config as C
from seqcache.training import model as M
from seqcache.training import partitioning as Pt

MODEL = C.ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4, mlp_dim=64)


def _specs(rules, mesh_shape, cfg=MODEL):
    abstract = M.abstract_model(cfg)
    _, params = M.split_params(abstract)
    mesh = Pt.make_mesh(mesh_shape)
    return Pt.param_specs(params, M.logical_axes(abstract), Pt.get_rules(rules), mesh)


def test_mesh_shapes_and_flag():
    assert jax.device_count() == 8
    mesh = Pt.make_mesh({"data": -1, "fsdp": 2, "model": 2})
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "model": 2}
    assert Pt.parse_mesh_flag("data=2,fsdp=4") == {"data": 2, "fsdp": 4, "model": 1}
    with pytest.raises(Pt.PartitioningError, match="has 6 devices but 8 are available"):
        Pt.make_mesh({"data": 3, "fsdp": 2, "model": 1})
    with pytest.raises(Pt.PartitioningError, match="unknown axis 'pipe'"):
        Pt.parse_mesh_flag("pipe=2")


def test_presets_shard_the_documented_dimensions():
    dp = _specs("dp", {"data": 8})
    assert dp["blocks"][0]["attn"]["wq"] == P(None, None, None)
    fsdp = _specs("fsdp", {"data": 1, "fsdp": 8})
    assert fsdp["blocks"][0]["attn"]["wq"] == P("fsdp", None, None)
    assert fsdp["blocks"][0]["mlp"]["w_down"] == P(None, "fsdp")
    assert fsdp["embedding"] == P(None, "fsdp")
    tp = _specs("tp", {"data": 2, "model": 4})
    assert tp["blocks"][0]["attn"]["wq"] == P(None, "model", None)
    assert tp["blocks"][0]["attn"]["wo"] == P("model", None, None)
    assert tp["blocks"][0]["mlp"]["w_gate"] == P(None, "model")
    assert tp["blocks"][0]["mlp"]["w_down"] == P("model", None)
    both = _specs("fsdp+tp", {"fsdp": 2, "model": 4})
    assert both["blocks"][0]["mlp"]["w_up"] == P("fsdp", "model")
    assert both["blocks"][0]["attn_norm"]["scale"] == P(None)


def test_indivisible_rule_names_parameter_shape_and_mesh_axis():
    # 4 heads cannot be split over a 'model' axis of size 8.
    with pytest.raises(Pt.PartitioningError) as err:
        _specs("tp", {"data": 1, "model": 8})
    text = str(err.value)
    assert "blocks/0/attn/w" in text
    assert "(32, 4, 8)" in text or "(4, 8, 32)" in text
    assert "'model' of size 8" in text
    assert "'heads'" in text


def test_unknown_logical_axis_names_parameter():
    rules = Pt.get_rules("dp")
    del rules["mlp"]
    abstract = M.abstract_model(MODEL)
    _, params = M.split_params(abstract)
    with pytest.raises(Pt.PartitioningError, match=r"parameter blocks/0/mlp/w_\w+ with shape \(\d+, \d+\): logical axis 'mlp'"):
        Pt.param_specs(params, M.logical_axes(abstract), rules, Pt.make_mesh({"data": 8}))


def test_rule_to_missing_mesh_axis_is_refused():
    mesh = Pt.make_mesh({"data": 8})
    with pytest.raises(Pt.PartitioningError, match="mesh axis 'pipe', which is not in the mesh"):
        Pt.logical_to_spec(("embed",), (8,), {"embed": "pipe"}, mesh, path="w")


def test_unknown_preset():
    with pytest.raises(Pt.PartitioningError, match="presets"):
        Pt.get_rules("zero2")
