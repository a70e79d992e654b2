"""Model FLOPs and MFU: the count against a hand count over the matrices of the
models' actual parameters, the chips' peak table, the helpers, and the FLOP
fields of a real (CPU) run's metrics."""

import math

import jax
import numpy as np
import pytest

from seqcache.cli.commands.train import throughput_summary
from seqcache.training import config as C
from seqcache.training import flops as F
from seqcache.training.metrics import ProgressBar, read_metrics, read_tensorboard
from seqcache.training.models.common import abstract_model, split_params
from seqcache_training_test_fakes import FEEDER_KWARGS, FakeFeeder, tiny_config_dict


def _param_sizes(model_cfg: C.ModelConfig) -> dict[str, int]:
    """Path ("blocks/0/attn/wq") -> element count of every parameter of the model."""
    params = split_params(abstract_model(model_cfg))[1]
    return {"/".join(str(getattr(k, "key", k)) for k in path): math.prod(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}


def _train_config(model: C.ModelConfig, *, batch: int, length: int, inputs: int | None = None,
                  converter: str | None = None) -> C.TrainConfig:
    lengths = {"targets": length, **({"inputs": inputs} if inputs is not None else {})}
    cfg = C.TrainConfig(model=model, global_batch_size=batch, sequence_length=lengths,
                        data=C.DataConfig(converter=converter))
    cfg.validate()
    return cfg


def test_a_tiny_decoder_written_out():
    # d=8, 1 layer, 2 heads of 4, SwiGLU width 16, 10 ids (tied), 2 rows of 4 tokens.
    # Weights per token: 4*8*2*4 (q, k, v, o) + 3*8*16 (gate, up, down) + 10*8
    # (output projection) = 256 + 384 + 80 = 720 multiply-adds, so 2 * 720 FLOPs
    # forward and 3 * 1440 = 4320 for training. Attention per token: QK^T and PV
    # over 4 keys, 2 heads of 4: 2 * (2 * 2*4*4) = 128 FLOPs forward, halved for
    # causal: 64, x 3: 192. (4320 + 192) * 2 rows * 4 tokens = 36096.
    cfg = _train_config(C.ModelConfig(vocab_size=10, d_model=8, num_layers=1, num_heads=2, mlp_dim=16),
                        batch=2, length=4)
    assert F.model_flops_per_step(cfg) == 36096.0
    assert F.flops_per_token(cfg) == 4512.0


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("converter, inputs", [("lm", None), ("prefix_lm", 3)])
def test_decoder_count_matches_its_parameters(tie, converter, inputs):
    model = C.ModelConfig(vocab_size=11, d_model=8, num_layers=2, num_heads=2, head_dim=6, mlp_dim=12,
                          tie_embeddings=tie)
    b, length = 3, 5
    cfg = _train_config(model, batch=b, length=length, inputs=inputs, converter=converter)
    sizes = _param_sizes(model)
    # Matrices a token is multiplied by: every block's, and the output projection
    # (the table itself when tied, else 'unembedding', the table being a lookup);
    # RMSNorm scales are no matrices.
    per_token = sum(n for name, n in sizes.items() if name.startswith("blocks/") and not name.endswith("/scale"))
    per_token += sizes["unembedding"] if not tie else sizes["embedding"]
    t = length + (inputs or 0)  # a prefix LM's rows hold inputs and targets
    h, hd = 2, 6
    # Per row and layer, forward: QK^T and PV, t*t*h*hd multiply-adds each; causal: half.
    attention_forward = 2 * (2 * t * t * h * hd) / 2
    forward = b * (t * 2 * per_token + 2 * attention_forward)
    assert F.model_flops_per_step(cfg) == 3 * forward
    assert F.flops_per_token(cfg) == 3 * forward / (b * t)
    assert cfg.tokens_per_step == b * t


@pytest.mark.parametrize("activation, tie, share", [("geglu", False, True), ("relu", True, False)])
def test_t5_count_matches_its_parameters(activation, tie, share):
    model = C.ModelConfig(architecture="t5", vocab_size=13, d_model=8, num_layers=2, num_decoder_layers=3,
                          num_heads=2, head_dim=6, mlp_dim=12, mlp_activation=activation, tie_embeddings=tie,
                          share_embeddings=share)
    b, length, inputs = 2, 5, 7
    cfg = _train_config(model, batch=b, length=length, inputs=inputs)
    sizes = _param_sizes(model)

    def matrices(prefix, keep=lambda name: True):
        return sum(n for name, n in sizes.items()
                   if name.startswith(prefix) and not name.endswith("/scale") and keep(name))

    def cross_kv(name):
        return "/cross_attn/wk" in name or "/cross_attn/wv" in name

    # Not products: RMSNorm scales, the relative bias tables (encoder_bias,
    # decoder_bias: looked up), the input embeddings (looked up) unless the
    # output projection is the decoder's table (tied).
    encoder = matrices("encoder_layers/")
    keys_values = matrices("decoder_layers/", cross_kv)  # read the encoder's output: once per encoder token
    decoder = matrices("decoder_layers/", lambda name: not cross_kv(name))
    decoder += sizes["output"] if not tie else sizes["decoder_embedding" if not share else "embedding"]
    assert ("output" in sizes) == (not tie)
    h, hd = 2, 6
    attention = (2 * 2 * inputs * inputs * h * hd          # encoder: bidirectional, 2 layers
                 + 3 * (2 * length * length * h * hd / 2  # decoder self-attention: causal, 3 layers
                        + 2 * length * inputs * h * hd))  # cross-attention
    forward = b * (2 * (inputs * (encoder + keys_values) + length * decoder) + 2 * attention)
    assert F.model_flops_per_step(cfg) == 3 * forward
    assert F.flops_per_token(cfg) == 3 * forward / (b * (inputs + length))


def test_unknown_architecture_is_an_error():
    cfg = C.TrainConfig(model=C.ModelConfig(architecture="mamba", vocab_size=8))
    with pytest.raises(ValueError, match="no FLOP count for model architecture 'mamba'"):
        F.model_flops_per_step(cfg)


@pytest.mark.parametrize("kind, peak", [
    ("TPU v4", 275.0), ("TPU v5 lite", 197.0), ("TPU v5e", 197.0), ("TPU v5", 459.0), ("TPU v5p", 459.0),
    ("TPU v6 lite", 918.0), ("TPU v6e", 918.0), (" tpu V5 LITE ", 197.0),
    ("NVIDIA A100-SXM4-40GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA H100 80GB HBM3", 989.0),
    # Unknown: never a guess.
    ("cpu", None), ("TPU v3", None), ("TPU v5 litex", None), ("TPU v7", None), ("", None),
    ("NVIDIA H100 PCIe", None), ("NVIDIA H100 NVL", None), ("Tesla V100-SXM2-16GB", None),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_peak_table(kind, peak):
    assert F.peak_tflops(kind) == peak


def test_cpu_has_no_peak():
    kind = jax.devices("cpu")[0].device_kind
    assert F.peak_tflops(kind) is None
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:2]), ("data",))
    run = F.RunFlops.of(_train_config(C.ModelConfig(vocab_size=10, d_model=8, num_layers=1, num_heads=2,
                                                    mlp_dim=16), batch=2, length=4), mesh)
    assert run == F.RunFlops(flops_per_step=36096.0, flops_per_token=4512.0, num_devices=2, peak_tflops=None)
    assert run.step_metrics(0.5) == {"model_flops_per_token": 4512.0,
                                     "tflops_per_s_per_device": 36096.0 / 0.5 / 2 / 1e12, "mfu": None}


def test_rate_and_mfu():
    # 4e14 FLOPs in 2 s on 4 chips: 50 TFLOP/s per chip; on v5e (197) that is 50/197.
    assert F.tflops_per_s_per_device(4e14, 2.0, 4) == 50.0
    assert F.mfu(4e14, 2.0, 4, 197.0) == pytest.approx(50.0 / 197.0)
    assert F.mfu(4e14, 2.0, 4, None) is None
    assert F.tflops_per_s_per_device(4e14, 0.0, 4) == math.inf
    with pytest.raises(ValueError, match="num_devices must be >= 1"):
        F.tflops_per_s_per_device(4e14, 2.0, 0)
    with pytest.raises(ValueError, match="peak_tflops must be > 0"):
        F.mfu(4e14, 2.0, 4, 0.0)


def test_summary_medians_leave_out_the_first_step():
    records = [{"model_flops_per_token": 10.0, "tokens_per_s": 1.0, "tflops_per_s_per_device": 0.1, "mfu": 0.01},
               {"model_flops_per_token": 10.0, "tokens_per_s": 5.0, "tflops_per_s_per_device": 0.5, "mfu": 0.05},
               {"model_flops_per_token": 10.0, "tokens_per_s": 9.0, "tflops_per_s_per_device": 0.9, "mfu": 0.09},
               {"model_flops_per_token": 10.0, "tokens_per_s": 7.0, "tflops_per_s_per_device": 0.7, "mfu": 0.07}]
    assert throughput_summary(records) == {"model_flops_per_token": 10.0, "tokens_per_s": 7.0,
                                           "tflops_per_s_per_device": 0.7, "mfu": 0.07}
    one = [{**records[0], "mfu": None}]
    assert throughput_summary(one) == {"model_flops_per_token": 10.0, "tokens_per_s": 1.0,
                                       "tflops_per_s_per_device": 0.1, "mfu": None}
    assert throughput_summary([]) == dict.fromkeys(("model_flops_per_token", "tokens_per_s",
                                                    "tflops_per_s_per_device", "mfu"))


def test_progress_bar_shows_tflops_and_mfu():
    bar = ProgressBar(total=4, start=0, enabled=True)
    try:
        bar.update(completed=1, loss=2.5, tokens_per_s=1234.0, tflops_per_s_per_device=0.01234, mfu=None)
        assert {k: bar._progress.tasks[0].fields[k] for k in ("tflops", "mfu")} == {"tflops": "0.0123", "mfu": "-"}
        bar.update(completed=2, loss=2.4, tokens_per_s=1234.0, tflops_per_s_per_device=98.5, mfu=0.5)
        assert {k: bar._progress.tasks[0].fields[k] for k in ("tflops", "mfu")} == {"tflops": "98.5", "mfu": "50.0%"}
    finally:
        bar.close()


def test_a_cpu_run_writes_the_flop_fields(tmp_path):
    from seqcache.training import trainer as T

    metrics_file = tmp_path / "metrics.jsonl"
    cfg = C.config_from_dict(tiny_config_dict(metrics_file=str(metrics_file)))
    trainer = T.Trainer(cfg, devices=jax.devices()[:1])
    result = trainer.fit(FakeFeeder(**FEEDER_KWARGS))
    lines = [line for line in read_metrics(str(metrics_file)) if "loss" in line]
    assert [line["step"] for line in lines] == list(range(cfg.steps))
    per_token = F.flops_per_token(cfg)
    # 1 layer, d 32, 4 heads of 8, SwiGLU 64, 64 ids (tied), 16 tokens per row:
    # 6 * (4*32*4*8 + 3*32*64 + 64*32) + 6 * 4*8*16 = 6 * 12288 + 3072.
    assert per_token == 6 * 12288 + 3072
    for line in lines:
        assert line["model_flops_per_token"] == per_token
        assert line["tflops_per_s_per_device"] == pytest.approx(
            per_token * cfg.tokens_per_step / line["step_time_s"] / 1 / 1e12)
        assert line["mfu"] is None  # the CPU's peak is unknown
    assert result.metrics == lines
    # TensorBoard gets the numbers, not the null.
    got = read_tensorboard(str(tmp_path / "tensorboard"))
    assert "train/tflops_per_s_per_device" in got and "train/model_flops_per_token" in got
    assert "train/mfu" not in got
