"""Model FLOPs of a training step and model FLOPs utilisation (MFU).

Model FLOPs are the floating point operations the model's mathematics needs,
whatever the implementation does: 2 FLOPs per multiply-add, matrix products
only (norms, softmax, activations, the optimizer and the embedding lookup are
left out), and a training step is 3 x the forward pass (the backward pass
computes two products for each of the forward's: the gradients of the
activations and of the weights). Causal attention is counted at half of the
full (length x length) products, as MaxText's
``calculate_tflops_training_per_device`` counts it (``maxtext_utils.py``,
``causal_attention_flops = noncausal_attention_flops / 2``); activations
recomputed by rematerialisation are not counted (they are hardware FLOPs, not
model FLOPs; PaLM, Chowdhery et al. 2022, arXiv 2204.02311, appendix B).

MFU = achieved model FLOP/s per chip / the chip's peak FLOP/s. The peak is the
dense bf16 matrix peak (``PEAK_BF16_TFLOPS``) whatever ``model.dtype`` is, so
that runs in float32 and bfloat16 are compared against the same hardware.

Units: FLOPs (counts), TFLOP/s = 1e12 FLOPs per second, per chip (a JAX
device). This module imports no JAX (``device_kind_of`` reads a mesh given to it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# Dense (no sparsity) bf16 peak of one chip, TFLOP/s, by ``jax.Device.device_kind``
# (JAX names TPU v5e "TPU v5 lite", v5p "TPU v5" and v6e "TPU v6 lite"; the
# product names are accepted too). Sources:
#   TPU v4   275  Cloud TPU system architecture, https://cloud.google.com/tpu/docs/v4
#                 ("peak compute per chip (bf16)")
#   TPU v5e  197  https://cloud.google.com/tpu/docs/v5e ("peak compute per chip (bf16)")
#   TPU v5p  459  https://cloud.google.com/tpu/docs/v5p ("peak compute per chip (bf16)")
#   TPU v6e  918  https://cloud.google.com/tpu/docs/v6e ("peak compute per chip (bf16)")
# GPUs, matched by substring of the device kind (``peak_tflops``):
#   A100     312  NVIDIA A100 Tensor Core GPU datasheet, BF16 Tensor Core 312 TFLOPS
#                 (624 is with sparsity), SXM and PCIe alike
#   H100     989  NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: BF16 Tensor Core
#                 1,979 TFLOPS with sparsity, half of it dense
PEAK_BF16_TFLOPS: dict[str, float] = {
    "TPU v4": 275.0,
    "TPU v5 lite": 197.0,
    "TPU v5e": 197.0,
    "TPU v5": 459.0,
    "TPU v5p": 459.0,
    "TPU v6 lite": 918.0,
    "TPU v6e": 918.0,
    "NVIDIA A100": 312.0,
    "NVIDIA H100": 989.0,
}

# GPU families matched by substring: "NVIDIA A100-SXM4-40GB", "NVIDIA H100 80GB HBM3".
_GPU_FAMILIES = ("A100", "H100")
# H100 variants with another peak than the SXM part's (the datasheet's H100 NVL and
# PCIe columns: 1,671 and 1,513 TFLOPS with sparsity): unknown, not the SXM guess.
_OTHER_H100 = ("PCIE", "NVL")

_TPU_KINDS = {kind.casefold(): peak for kind, peak in PEAK_BF16_TFLOPS.items() if kind.startswith("TPU")}


def peak_tflops(device_kind: str) -> float | None:
    """The dense bf16 peak of one chip in TFLOP/s (``PEAK_BF16_TFLOPS``) for a
    ``jax.Device.device_kind`` such as "TPU v5 lite" or "NVIDIA H100 80GB HBM3";
    None for any other device (the CPU included): never a guess.

    TPU kinds match exactly (ignoring case and surrounding blanks: "TPU v5" is
    v5p, "TPU v5 lite" v5e); GPU kinds by the substring "A100" or "H100" (an
    H100 PCIe or NVL, whose peaks differ from the SXM part's, gives None).
    """
    kind = str(device_kind).strip()
    if kind.casefold() in _TPU_KINDS:
        return _TPU_KINDS[kind.casefold()]
    upper = kind.upper()
    for family in _GPU_FAMILIES:
        if family in upper:
            if family == "H100" and any(variant in upper for variant in _OTHER_H100):
                return None
            return PEAK_BF16_TFLOPS[f"NVIDIA {family}"]
    return None


def model_flops_per_step(config) -> float:
    """Model FLOPs of one training step (forward and backward) over the global
    batch of a ``seqcache.training.config.TrainConfig``, a float count.

    With B = ``global_batch_size``, d = ``d_model``, H heads of width hd, MLP
    width f, vocabulary V, and n = 3 matrices in a gated MLP ("swiglu",
    "geglu"), 2 in "relu":

    - ``decoder`` (converter ``lm``: T = L tokens per row; ``prefix_lm``: T = Li + L,
      counted as causal throughout), with N = layers * (4 d H hd + n d f) + V d
      the weights multiplied per token (the output projection, tied or not; the
      input lookup is no product)::

          B * T * (6 N + 6 layers H hd T)

      (attention: 12 layers H hd T for QK^T and PV, forward and backward,
      halved for causal).
    - ``t5`` (``encdec``: Li encoder tokens, L decoder tokens per row)::

          enc = 6 enc_layers (4 d H hd + n d f) + 12 enc_layers H hd Li
          dec = 6 (dec_layers (6 d H hd + n d f) + V d)
                + 6 dec_layers H hd L                  # causal self-attention
                + 12 dec_layers H hd Li                # cross-attention
          kv  = 6 dec_layers 2 d H hd                  # cross-attention keys and values
          B * (Li * (enc + kv) + L * dec)

      (the decoder's 6 d H hd: self-attention's 4 projections, cross-attention's
      query and output; its keys and values are computed once per encoder token).

    The convention (3 x forward, matmuls only, causal attention at half, no
    rematerialisation) is MaxText's ``calculate_tflops_training_per_device``.

    Raises:
      ValueError: an architecture or converter this count does not know.
    """
    m = config.model
    b, lengths = config.global_batch_size, config.sequence_length or {}
    length, inputs = lengths.get("targets", 0), lengths.get("inputs", 0)
    d, heads, hd, f, vocab = m.d_model, m.num_heads, m.resolved_head_dim, m.mlp_dim, m.vocab_size
    n_mlp = 2 if m.mlp_activation == "relu" else 3
    if m.architecture == "decoder":
        conv = config.converter
        if conv not in ("lm", "prefix_lm"):
            raise ValueError(f"model_flops_per_step: the decoder reads converter 'lm' or 'prefix_lm' (got {conv!r})")
        tokens = length + (inputs if conv == "prefix_lm" else 0)
        n_mm = m.num_layers * (4 * d * heads * hd + n_mlp * d * f) + vocab * d
        return float(b * tokens * (6 * n_mm + 6 * m.num_layers * heads * hd * tokens))
    if m.architecture == "t5":
        enc_layers, dec_layers = m.num_layers, m.resolved_num_decoder_layers
        enc = 6 * enc_layers * (4 * d * heads * hd + n_mlp * d * f) + 12 * enc_layers * heads * hd * inputs
        dec = (6 * (dec_layers * (6 * d * heads * hd + n_mlp * d * f) + vocab * d)
               + 6 * dec_layers * heads * hd * length + 12 * dec_layers * heads * hd * inputs)
        cross_kv = 6 * dec_layers * 2 * d * heads * hd
        return float(b * (inputs * (enc + cross_kv) + length * dec))
    raise ValueError(f"model_flops_per_step: no FLOP count for model architecture {m.architecture!r} "
                     "(known: 'decoder', 't5')")


def flops_per_token(config) -> float:
    """``model_flops_per_step(config)`` per token of the step (``config.tokens_per_step``:
    B * (Li + L), padding included), FLOPs per token."""
    return model_flops_per_step(config) / config.tokens_per_step


def tflops_per_s_per_device(flops_per_step: float, step_time_s: float, num_devices: int) -> float:
    """Achieved model TFLOP/s per chip: ``flops_per_step / step_time_s /
    num_devices / 1e12`` (inf for a step time that is not positive).

    Raises:
      ValueError: ``num_devices`` < 1.
    """
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1 (got {num_devices=})")
    if not step_time_s > 0:
        return math.inf
    return flops_per_step / step_time_s / num_devices / 1e12


def mfu(flops_per_step: float, step_time_s: float, num_devices: int, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation, a fraction (1.0 = every chip at its peak):
    ``tflops_per_s_per_device(...) / peak_tflops``; None when the peak is
    unknown (``peak_tflops`` None). A value above 1 means the FLOP count or the
    peak is wrong for this model or chip.

    Raises:
      ValueError: ``num_devices`` < 1, or a peak that is not positive.
    """
    if peak_tflops is None:
        return None
    if not peak_tflops > 0:
        raise ValueError(f"peak_tflops must be > 0 (got {peak_tflops=})")
    return tflops_per_s_per_device(flops_per_step, step_time_s, num_devices) / peak_tflops


def device_kind_of(mesh: Any) -> str:
    """The ``device_kind`` of a ``jax.sharding.Mesh``'s first device (a mesh's
    devices are of one kind), e.g. "TPU v5 lite" or "cpu"."""
    return str(mesh.devices.flat[0].device_kind)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunFlops:
    """The per-run constants of the FLOP metrics, computed once per run.

    Attributes:
      flops_per_step: ``model_flops_per_step(config)``, FLOPs.
      flops_per_token: ``flops_per_token(config)``, FLOPs per token.
      num_devices: chips of the trainer's mesh (all hosts').
      peak_tflops: ``peak_tflops`` of the mesh's device kind, TFLOP/s per chip;
        None when unknown (the CPU).
    """

    flops_per_step: float
    flops_per_token: float
    num_devices: int
    peak_tflops: float | None

    @classmethod
    def of(cls, config, mesh) -> RunFlops:
        """The constants of a run of ``config`` (a ``TrainConfig``) on ``mesh`` (a ``jax.sharding.Mesh``)."""
        return cls(flops_per_step=model_flops_per_step(config), flops_per_token=flops_per_token(config),
                   num_devices=int(mesh.size), peak_tflops=peak_tflops(device_kind_of(mesh)))

    def step_metrics(self, step_time_s: float) -> dict[str, float | None]:
        """The FLOP fields of a step's metrics record: ``model_flops_per_token``
        (FLOPs per token), ``tflops_per_s_per_device`` (achieved model TFLOP/s per
        chip) and ``mfu`` (a fraction; None when the peak is unknown)."""
        return {
            "model_flops_per_token": self.flops_per_token,
            "tflops_per_s_per_device": tflops_per_s_per_device(self.flops_per_step, step_time_s, self.num_devices),
            "mfu": mfu(self.flops_per_step, step_time_s, self.num_devices, self.peak_tflops),
        }
