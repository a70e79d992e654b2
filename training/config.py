"""Configuration of a training run: frozen dataclasses, presets, overrides.

A run is fully described by one ``TrainConfig``. It is built in this order, each
layer overriding the previous one:

1. the defaults below,
2. a model preset (``MODEL_PRESETS``: decoder-only ``tiny``, ``small``, ``base``, ``large``,
   ``1b``; encoder-decoder ``t5-tiny``, ``t5-small``) and the run settings it brings
   (``PRESET_RUN_SETTINGS``, ``apply_preset``),
3. a JSON config file (``load_config_file``), nested like ``to_dict`` writes it,
4. command line flags,
5. dotted overrides such as ``model.d_model=128 optimizer.lr=1e-3``
   (``apply_overrides``).

The resolved config is written beside the checkpoints (``to_json``).

Vocabulary of sizes used everywhere in ``seqcache.training``:
  global batch size B: rows per step over all hosts; host batch: B / host count.
  sequence length: tokens per row of each feature the converter reads,
  ``sequence_length = {"targets": L}`` for a language model, ``{"inputs": Li,
  "targets": L}`` for an encoder-decoder model (encoder rows of Li tokens,
  decoder rows of L) and a prefix LM (rows of Li + L tokens). Tokens per step:
  B * (Li + L), Li = 0 for a language model.
  microbatches M: the global batch is split into M microbatches whose gradients
  are accumulated inside one compiled step (B must be divisible by M).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
import typing
from typing import Annotated, Any, Mapping, Sequence

from msgspec import Meta

from seqcache import bounded_json
from seqcache.lengths import ALL_FEATURES
from seqcache.training import models

COMPUTE_DTYPES = ("float32", "bfloat16")
# Every integer of a config lies in (-MAX_INTEGER, MAX_INTEGER); the sizes
# that shape arrays have their own bounds (``TrainConfig.validate``).
MAX_INTEGER = bounded_json.MAX_COUNT
MAX_GLOBAL_BATCH_SIZE = 2**24
MAX_SEQUENCE_LENGTH = bounded_json.MAX_SEQUENCE_LENGTH
MLP_ACTIVATIONS = ("swiglu", "geglu", "relu")
# The bounds a field's value must keep (``msgspec.Meta``, checked by ``validate``).
Positive = Annotated[int, Meta(ge=1)]
Count = Annotated[int, Meta(ge=0)]
# ``ModelConfig.attention``: the attention kernel (``seqcache.training.models.attention``).
ATTENTION_KERNELS = ("auto", "xla", "splash")
# The splash kernel's smallest block: its sequence lengths are multiples of it.
SPLASH_BLOCK = 128
# ``ModelConfig.remat``: what a layer keeps for the backward pass (``seqcache.training.models.layers``).
REMAT_POLICIES = ("none", "dots", "attention", "full")
CONVERTERS = ("lm", "prefix_lm", "encdec")
# The features the models read (``TrainConfig.sequence_length``'s keys).
MODEL_FEATURES = ("inputs", "targets")


def converter_features(converter: str | None) -> tuple[str, ...]:
    """The features feature converter ``converter`` reads, in order:
    ("targets",) for lm, ("inputs", "targets") for encdec and prefix_lm; ()
    for another name (``TrainConfig.validate`` refuses it)."""
    for arch in models.ARCHITECTURES.values():
        for name, features in arch.converters:
            if name == converter:
                return tuple(features)
    return ()


def _default_converter(architecture: str) -> str | None:
    """``models.default_converter``, None for an unknown architecture (refused by ``validate``)."""
    return models.default_converter(architecture) if architecture in models.ARCHITECTURES else None


class ConfigError(ValueError):
    """A config value, file or override is invalid (the message names it)."""


def _check_choice(field: str, value: Any, choices: Sequence) -> None:
    if value not in choices:
        raise ConfigError(f"{field} must be one of {choices} (got {value!r})")


def _check_bounds(config: Any, prefix: str) -> None:
    """Checks every field of the dataclass ``config`` against its type and
    ``msgspec.Meta`` bounds; ConfigError naming the field (after ``prefix``)."""
    bounded_json.convert(dataclasses.asdict(config), type(config), path="", prefix=prefix, error=ConfigError)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A model of the trainer (see ``seqcache.training.models``).

    Attributes:
      architecture: "decoder" (decoder-only Transformer) or "t5" (T5.1.1-style
        encoder-decoder), a key of ``seqcache.training.models.ARCHITECTURES``.
      vocab_size: number of token ids (embedding rows). None = take it from the
        data (the cache manifest's vocabulary of the ``targets`` feature).
      d_model: width of the residual stream.
      num_layers: number of Transformer blocks (t5: of the encoder).
      num_decoder_layers: t5 only: blocks of the decoder; None = num_layers.
      num_heads: attention heads per block.
      head_dim: width of one head; None = d_model // num_heads. Must be even
        for the decoder (rotary positions rotate pairs of dimensions).
      mlp_dim: hidden width of the MLP.
      mlp_activation: "swiglu" (gated SiLU; the decoder's only choice), "geglu"
        (gated GELU, T5.1.1) or "relu" (the original T5), Shazeer 2020, arXiv
        2002.05202.
      rope_theta: decoder only: base of the rotary position frequencies (RoFormer: 10000).
      relative_attention_num_buckets: t5 only: buckets of the relative position
        bias (T5: 32); half of them per direction in the bidirectional encoder.
      relative_attention_max_distance: t5 only: distances from this one on share
        the last bucket (T5: 128).
      norm_eps: epsilon of RMSNorm, added to the mean square.
      dropout_rate: dropout on attention probabilities and residual branches (0: none).
      dtype: compute dtype, "float32" or "bfloat16"; parameters, logits and the
        loss are always float32.
      tie_embeddings: True (default) uses the input embedding matrix, transposed,
        as the output projection (Press & Wolf 2017, arXiv 1608.05859; t5 then
        scales the logits by d_model ** -0.5, as T5 1.0); False adds a separate
        (d_model, vocab) output matrix (T5.1.1).
      share_embeddings: t5 only: the encoder and the decoder read one input
        embedding table (T5); False gives each its own.
      init_std: decoder only: standard deviation of the normal initialisation
        of matrices (t5 uses T5's fan-in initialisation, see its module).
      attention: the attention kernel: "xla" (the einsum path: scores and
        probabilities of shape (batch, heads, L, L) in float32), "splash"
        (Pallas splash attention from ``jax.experimental``: a fused kernel that
        never writes the (L, L) matrix to memory; on a TPU compiled, elsewhere
        run in Pallas interpret mode, slowly) or "auto" (splash on a TPU when
        every sequence length is a multiple of 128 and dropout is off, else
        xla). T5 runs cross-attention in splash, and with "splash" (not "auto")
        its self-attention, which adds the relative position bias, in Pallas
        flash attention with the bias as a kernel input.
      remat: what each layer keeps for the backward pass (``jax.checkpoint``):
        "none" (every activation), "dots" (the outputs of matrix
        multiplications without batch dimensions, the projections and the MLP,
        and attention's output; norms, rotary positions and activations are
        recomputed), "attention" (attention's output only) or "full" (only the
        layer's input; the whole layer is recomputed). Values are the same;
        memory and time differ (``seqcache.training.models.layers``).
      scan_layers: store the layers' parameters stacked along a leading
        'layers' axis and compile one layer, scanned over them
        (``jax.lax.scan``): compile time no longer grows with depth. Same
        initial values and losses as unscanned layers; the checkpoint's
        parameter tree differs (``blocks/attn/wq`` of shape (layers, ...)
        instead of ``blocks/0/attn/wq``), so a checkpoint resumes only with
        the setting it was saved with.
    """

    architecture: str = "decoder"
    vocab_size: Positive | None = None
    d_model: Positive = 64
    num_layers: Positive = 2
    num_decoder_layers: Positive | None = None
    num_heads: Positive = 4
    head_dim: int | None = None
    mlp_dim: Positive = 256
    mlp_activation: str = "swiglu"
    rope_theta: Annotated[float, Meta(gt=0.0)] = 10000.0
    relative_attention_num_buckets: Positive = 32
    relative_attention_max_distance: Positive = 128
    norm_eps: Annotated[float, Meta(gt=0.0)] = 1e-6
    dropout_rate: Annotated[float, Meta(ge=0.0, lt=1.0)] = 0.0
    dtype: str = "float32"
    tie_embeddings: bool = True
    share_embeddings: bool = True
    init_std: Annotated[float, Meta(gt=0.0)] = 0.02
    attention: str = "auto"
    remat: str = "none"
    scan_layers: bool = False

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

    @property
    def resolved_num_decoder_layers(self) -> int:
        return self.num_decoder_layers if self.num_decoder_layers is not None else self.num_layers

    def validate(self) -> None:
        """Raises ConfigError naming the field when a value cannot work
        (``model.d_model: expected `int` >= 1 (got 0)`` for a field's bounds)."""
        _check_choice("model.architecture", self.architecture, sorted(models.ARCHITECTURES))
        if self.vocab_size is None:
            raise ConfigError(
                "model.vocab_size is not set: pass a cache (the vocabulary size is read from its manifest) "
                "or set it, e.g. --set model.vocab_size=32128")
        _check_bounds(self, "model")
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ConfigError(
                f"model.d_model={self.d_model} is not divisible by model.num_heads={self.num_heads}; "
                "set model.head_dim explicitly or change one of them")
        if self.architecture == "decoder" and self.resolved_head_dim % 2:
            raise ConfigError(f"model head_dim must be even for rotary positions (got {self.resolved_head_dim})")
        _check_choice("model.mlp_activation", self.mlp_activation, MLP_ACTIVATIONS)
        if self.architecture == "decoder" and self.mlp_activation != "swiglu":
            raise ConfigError(
                f"model.mlp_activation={self.mlp_activation!r}: the decoder-only model has a SwiGLU MLP only "
                "(geglu and relu are for architecture 't5')")
        if self.architecture == "t5" and self.relative_attention_num_buckets < 4:
            raise ConfigError(
                f"model.relative_attention_num_buckets must be >= 4 for t5 (got {self.relative_attention_num_buckets})")
        _check_choice("model.dtype", self.dtype, COMPUTE_DTYPES)
        _check_choice("model.attention", self.attention, ATTENTION_KERNELS)
        _check_choice("model.remat", self.remat, REMAT_POLICIES)
        if self.attention == "splash" and self.dropout_rate > 0 and self.architecture == "decoder":
            raise ConfigError(
                f"model.attention='splash' has no dropout on attention probabilities (model.dropout_rate="
                f"{self.dropout_rate}); set model.dropout_rate=0 or model.attention=xla")


MODEL_PRESETS: dict[str, ModelConfig] = {
    # Trains in seconds on CPU; used by the tests.
    "tiny": ModelConfig(d_model=64, num_layers=2, num_heads=4, mlp_dim=256),
    # A few million parameters (plus embeddings); CPU benchmarks.
    "small": ModelConfig(d_model=256, num_layers=4, num_heads=4, mlp_dim=1024),
    # GPT-2 small shape (Radford et al. 2019: d_model 768, 12 layers) with 6 heads of 128
    # instead of 12 of 64 (a head of 128 fills the TPU's 128-wide matrix unit; 12 of 64
    # fill half of it) and SwiGLU width 2048 (about 8/3 * d_model). Unrolled, no remat.
    # Measured on one TPU v5e (B = 32, L = 1,024, bfloat16, splash): 51.8% MFU, step peak
    # 11.4 GB (12 heads of 64: 34.4%, 13.9 GB); the fit keeps it. A checkpoint of the
    # earlier shape is refused on resume (``seqcache.training.resume.check_structure``).
    "base": ModelConfig(d_model=768, num_layers=12, num_heads=6, mlp_dim=2048),
    # About 480 M parameters (plus embeddings): the largest decoder whose float32 parameters,
    # gradients and AdamW moments (16 bytes a parameter) leave room on one 16 GB chip for a
    # global batch of 32 rows of 1024 tokens. Layers unrolled, the matrix products and the
    # rotated queries and keys kept for the backward pass (remat=dots), the batch in 4
    # microbatches (``PRESET_RUN_SETTINGS``). Measured on one TPU v5e (B = 32, L = 1,024,
    # bfloat16, splash): 68.6% MFU, step peak 14.2 GB, compiled in 56 s. Scanned over its 16
    # layers (one compiled layer, 14 s) the same setting ran at 58.4% (15.4 GB): the scan
    # copies each layer's saved activations and gradients in and out of stacked buffers.
    "large": ModelConfig(d_model=1536, num_layers=16, num_heads=12, mlp_dim=4096, remat="dots"),
    # About 1 B parameters (0.96 B with 16,000 ids): 18 layers of d_model 2048, 16 heads
    # of 128, SwiGLU width 5632 (2.75 * d_model). With AdamW's moments (8 bytes a
    # parameter) it would not fit one 16 GB chip; Adafactor (``PRESET_RUN_SETTINGS``)
    # keeps a row and a column a matrix, so float32 parameters, gradients and their
    # accumulator take 12 bytes a parameter. Layers unrolled, remat=dots, the batch in 8
    # microbatches. Measured on one TPU v5e (B = 32, L = 1,024, bfloat16, splash): 74.1%
    # MFU, step peak 13.9 GB, compiled in 84 s (remat=attention: 60.3%, 11.0 GB; scanned
    # with remat=attention: 55.0%, 14.2 GB, and remat=dots did not fit).
    "1b": ModelConfig(d_model=2048, num_layers=18, num_heads=16, mlp_dim=5632, remat="dots"),
    # T5.1.1-style encoder-decoder (gated-GELU MLP, untied output layer, shared
    # input embeddings, relative position buckets); trains in seconds on CPU.
    "t5-tiny": ModelConfig(architecture="t5", d_model=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                           head_dim=16, mlp_dim=128, mlp_activation="geglu", tie_embeddings=False),
    # The dimensions of T5.1.1-small (t5x's t5_1_1/small.gin): d_model 512, 8 + 8
    # layers, 6 heads of 64, MLP 1024; about 77 M parameters with T5's 32128 ids.
    "t5-small": ModelConfig(architecture="t5", d_model=512, num_layers=8, num_decoder_layers=8, num_heads=6,
                            head_dim=64, mlp_dim=1024, mlp_activation="geglu", tie_embeddings=False),
}


# Fields of ``TrainConfig`` besides the model that a preset sets too (layer 2 of
# ``config_from_layers``): what the measurements on one TPU v5e picked. A flag,
# config file or override still replaces them.
PRESET_RUN_SETTINGS: dict[str, dict[str, Any]] = {
    "large": {"num_microbatches": 4},
    "1b": {"num_microbatches": 8, "optimizer": {"name": "adafactor", "lr": 1e-2}},
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The optimizer, AdamW (Loshchilov & Hutter 2019) by default or Adafactor
    (Shazeer & Stern 2018, arXiv 1804.04235), with linear warmup then cosine
    decay, and clipping of the gradient's global norm (Pascanu et al. 2013)
    before the update.

    Attributes:
      name: "adamw" or "adafactor" (``OPTIMIZERS``). A checkpoint resumes only
        with the optimizer it was saved with (their states differ).
      lr: peak learning rate, reached at the end of warmup. Adafactor's step
        is relative to each parameter's RMS (``multiply_by_parameter_scale``):
        t5x pre-trains T5 at 1e-2 (its rsqrt schedule after 10,000 warmup
        steps), not at AdamW's rates.
      warmup_steps: steps of linear warmup from 0 to ``lr``.
      decay_steps: total length of the schedule (warmup included); None = the
        run's ``steps``. After it the rate stays at ``lr * end_lr_ratio``.
      end_lr_ratio: final learning rate as a fraction of ``lr``.
      b1, b2, eps: AdamW only: the moments' decay rates and epsilon.
      weight_decay: AdamW only: decoupled weight decay, applied to matrices
        only (not to RMSNorm scales). Adafactor has none (t5x's default).
      clip_norm: maximum global L2 norm of the gradient; None disables
        clipping. Both optimizers.
      decay_rate: Adafactor only: the second moments' decay is
        1 - (step + 1) ** -decay_rate (t5x: 0.8).
      clipping_threshold: Adafactor only: each parameter's update is scaled
        down to an RMS of at most this (t5x: 1.0); None: no update clipping.
      factored: Adafactor only: second moments of a parameter with two
        dimensions of at least 128 kept as a row and a column factor (t5x:
        true); false keeps them whole, as large as the parameter.
      multiply_by_parameter_scale: Adafactor only: the step is ``lr`` times the
        parameter's RMS (at least 1e-3) (t5x: true); false: ``lr`` is absolute.
    """

    name: str = "adamw"
    lr: Annotated[float, Meta(ge=0.0)] = 3e-3
    warmup_steps: Count = 10
    decay_steps: Positive | None = None
    end_lr_ratio: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.1
    b1: Annotated[float, Meta(ge=0.0, lt=1.0)] = 0.9
    b2: Annotated[float, Meta(ge=0.0, lt=1.0)] = 0.95
    eps: Annotated[float, Meta(gt=0.0)] = 1e-8
    weight_decay: Annotated[float, Meta(ge=0.0)] = 0.1
    clip_norm: Annotated[float, Meta(gt=0.0)] | None = 1.0
    decay_rate: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.8
    clipping_threshold: Annotated[float, Meta(gt=0.0)] | None = 1.0
    factored: bool = True
    multiply_by_parameter_scale: bool = True

    def validate(self) -> None:
        """Raises ConfigError naming the field when a value cannot work."""
        _check_bounds(self, "optimizer")
        _check_choice("optimizer.name", self.name, OPTIMIZERS)


# ``OptimizerConfig.name``: the optimizers of ``seqcache.training.optimizer``.
OPTIMIZERS = ("adamw", "adafactor")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Shape of the device mesh, axes ('data', 'fsdp', 'model'); the product is
    the device count, and one axis may be -1 (the devices the others leave)."""

    data: int = -1
    fsdp: int = 1
    model: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Orbax checkpoints (see ``seqcache.training.checkpoints``).

    Attributes:
      directory: step folders, config.json and metrics.jsonl; None: no checkpoints.
      every_steps: save every this many steps, after the last one and on SIGTERM.
      max_to_keep: keep the most recent this many checkpoints.
      async_save: write checkpoints in a background thread while training goes on.
    """

    directory: str | None = None
    every_steps: Positive = 100
    max_to_keep: Positive = 3
    async_save: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where batches come from (used by the CLI to build feeders).

    Attributes:
      cache_dir: root of the caches (``CACHE_DIR/<task>/<split>``).
      task: a task name under ``cache_dir``, or a path to one cache folder.
      split: split of the training data.
      eval_split: split evaluated with exactly-once semantics; None = no eval.
      mixture: explicit mixture, cache path -> rate; replaces ``task`` when set.
      seed: the feeder's shuffle seed; None = ``DEFAULT_DATA_SEED``
        (``resolve_seeds``), never the run's ``seed``.
      converter: "lm" (the feeder's ``targets`` fields), "prefix_lm" (decoder-only
        model on an (inputs, targets) cache) or "encdec" (encoder-decoder), see
        ``seqcache.feeders.converters``; None = the model's default.
        ``seqcache train`` sets it from the model and the cache's features.
    """

    cache_dir: str | None = None
    task: str | None = None
    split: str = "train"
    eval_split: str | None = None
    mixture: dict | None = None
    seed: int | None = None
    converter: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run.

    Attributes:
      model, optimizer, mesh, checkpoint, data: see their classes.
      rules: logical axis rules preset: "dp", "fsdp", "tp" or "fsdp+tp"
        (``seqcache.training.partitioning.RULES``).
      steps: number of optimizer steps of the whole run (a resumed run continues
        up to this number).
      global_batch_size: rows per step over all hosts (B).
      sequence_length: dict str -> int, tokens per row of each feature the
        converter reads (``converter_features``): ``{"targets": L}`` for lm,
        ``{"inputs": Li, "targets": L}`` for encdec (encoder rows of Li,
        decoder rows of L) and prefix_lm (rows of Li + L). An int N, where a
        user gives one (in Python, ``--set sequence_length=N``,
        ``--sequence-length N``), is every feature's: kept as ``{"*": N}``
        (``seqcache.lengths.ALL_FEATURES``) and given to each feature the
        converter reads that the mapping does not name, when the config is
        made (the cache decides a decoder's converter: ``seqcache train``
        makes the config again with it). None, or a feature left out: the
        cache's own, which ``seqcache train`` fills in (``seqcache.lengths``: a
        given length only cuts rows shorter; one longer than the cache's is
        refused). A ``Trainer`` built in Python needs every one given. A
        config file of an earlier release, with an int ``sequence_length``
        (the targets') and ``inputs_sequence_length``, is read as this
        mapping (``config_from_dict``).
      num_microbatches: gradient accumulation inside the step (M divides B).
      loss_chunks: the output layer and the loss run over each (micro)batch in
        this many chunks of rows (``lax.scan``), each chunk's logits recomputed
        in the backward pass, so that the float32 (rows, length, vocab) logits
        of one chunk only are in memory at a time; 1 = all rows at once. The
        loss is the same up to float rounding.
      seed: seeds parameter initialisation and the per-step RNG
        (``fold_in(key(seed), step)``); the feeder has its own, ``data.seed``.
      eval_every: evaluate every this many steps (0 = only after the last step).
      eval_metrics: at each evaluation also decode the eval split and run the
        task's metrics (``seqcache.training.evaluation``) when its registered
        task has ``metric_fns``.
      metrics_file: JSON lines, one per step; None = ``<checkpoint dir>/metrics.jsonl``.
      tensorboard: also write TensorBoard event files next to the metrics file.
      progress: show a progress bar.
      fit: what the fit chose (``seqcache.training.fit``, ``seqcache train
        --fit auto``): the chosen ``num_microbatches``, ``model.remat`` and
        ``model.scan_layers``, how, and each candidate's compiled memory and
        probe time; None when no fit ran. A record, not a setting: the chosen
        values are in their own fields. A resumed run takes those fields from
        its config.json instead of fitting again.
    """

    model: ModelConfig = dataclasses.field(default_factory=lambda: MODEL_PRESETS["tiny"])
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    rules: str = "dp"
    steps: Positive = 100
    global_batch_size: Annotated[int, Meta(ge=1, lt=MAX_GLOBAL_BATCH_SIZE)] = 8
    sequence_length: dict[str, Annotated[int, Meta(ge=1, lt=MAX_SEQUENCE_LENGTH)]] | None = None
    num_microbatches: Positive = 1
    loss_chunks: Positive = 1
    seed: Annotated[int, Meta(ge=0, lt=2**32)] = 0
    eval_every: Count = 0
    eval_metrics: bool = True
    metrics_file: str | None = None
    tensorboard: bool = True
    progress: bool = True
    fit: dict | None = None

    @property
    def converter(self) -> str:
        """The resolved feature converter (``data.converter``, else the model's default)."""
        conv = self.data.converter
        return conv if conv is not None else models.default_converter(self.model.architecture)

    def __post_init__(self):
        """The sequence length as one mapping: an int N as {"*": N}, "*" given to
        every feature of the converter not named (``seqcache.lengths.sequence_lengths``).

        Raises:
          ConfigError: a length for a feature the models do not read."""
        value = self.sequence_length
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            value = {ALL_FEATURES: int(value)}
        if isinstance(value, Mapping):
            unknown = sorted(str(k) for k in value if k not in (*MODEL_FEATURES, ALL_FEATURES))
            if unknown:
                raise ConfigError(f"sequence_length: the models read features {list(MODEL_FEATURES)}, "
                                  f"not {unknown}")
            features = converter_features(self.data.converter or _default_converter(self.model.architecture))
            if ALL_FEATURES in value and features:
                value = {**{n: value.get(n, value[ALL_FEATURES]) for n in features},
                         **{n: v for n, v in value.items() if n not in features and n != ALL_FEATURES}}
            value = dict(value)
        object.__setattr__(self, "sequence_length", value)

    @property
    def tokens_per_step(self) -> int:
        """B * (tokens per row of every feature the converter reads): B * (Li + L)."""
        lengths = self.sequence_length or {}
        return self.global_batch_size * sum(lengths.get(f, 0) for f in converter_features(self.converter))

    def validate(self) -> None:
        """Raises ConfigError naming the field when a value cannot work
        (``global_batch_size: expected `int` >= 1 (got 0)`` for a field's bounds)."""
        self.model.validate()
        self.optimizer.validate()
        _check_bounds(self, "")
        self._validate_converter()
        self._validate_attention()
        if self.global_batch_size % self.num_microbatches:
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} is not divisible by "
                f"num_microbatches={self.num_microbatches}; set one that divides it, e.g. --set num_microbatches="
                f"{math.gcd(self.global_batch_size, self.num_microbatches)}")
        self._validate_lengths()

    def _validate_lengths(self) -> None:
        """Every feature the converter reads has a length."""
        if self.sequence_length is None:
            raise ConfigError("sequence_length is not set: give it (the cache's own is filled in by seqcache train)")
        missing = [f for f in converter_features(self.converter) if f not in self.sequence_length]
        if missing:
            example = ",".join(f"{f}=512" for f in missing)
            raise ConfigError(
                f"converter {self.converter!r} reads features {list(converter_features(self.converter))}, but "
                f"sequence_length = {self.sequence_length} has no length for {missing}; give it, e.g. "
                f"--sequence-length {example}, or train on a cache that records it")

    def _validate_attention(self) -> None:
        """model.attention=splash needs every length its kernel reads to be a
        multiple of ``SPLASH_BLOCK`` (the decoder's self-attention; T5's
        cross-attention, queries and keys)."""
        if self.model.attention != "splash":
            return
        conv = self.converter
        given = self.sequence_length or {}
        li, lt = given.get("inputs", 0), given.get("targets", 0)
        lengths = {"lm": [lt], "prefix_lm": [li + lt], "encdec": [lt, li]}.get(conv, [])
        if any(n % SPLASH_BLOCK for n in lengths):
            raise ConfigError(
                f"model.attention='splash' needs sequence lengths that are multiples of {SPLASH_BLOCK} (the "
                f"{conv} converter's are {lengths}); pack the cache to such a length or set model.attention=auto "
                "(splash where it applies, else the einsum path) or xla")

    def _validate_converter(self) -> None:
        conv = self.converter
        _check_choice("data.converter", conv, CONVERTERS)
        allowed = [c for c, _ in models.architecture(self.model.architecture).converters]
        if conv not in allowed:
            raise ConfigError(
                f"data.converter={conv!r} does not feed model architecture {self.model.architecture!r}, which reads "
                f"converters {allowed}")


# The feeder's seed when ``data.seed`` is unset.
DEFAULT_DATA_SEED = 0


def resolve_seeds(config: TrainConfig) -> TrainConfig:
    """The config with ``data.seed`` explicit (``DEFAULT_DATA_SEED`` when unset;
    never derived from ``seed``, so another initialisation reads the same stream).

    Raises:
      ConfigError: a data seed outside [0, 2**32).
    """
    data_seed = config.data.seed if config.data.seed is not None else DEFAULT_DATA_SEED
    if not 0 <= data_seed < 2**32:
        raise ConfigError(f"data.seed must be in [0, 2**32) (got {data_seed})")
    return dataclasses.replace(config, data=dataclasses.replace(config.data, seed=data_seed))


# -- dict / JSON round trip --------------------------------------------------


def to_dict(config: Any) -> dict:
    """The config as nested plain dicts (JSON-able)."""
    return dataclasses.asdict(config)


def to_json(config: Any) -> str:
    return json.dumps(to_dict(config), indent=2, sort_keys=True) + "\n"


def _is_dataclass_type(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """A JSON value as the annotated field type ``tp`` (``bounded_json.convert``,
    strict: no coercion but an integral float to an integer), with the bounds
    msgspec does not check: integers in (-2^53, 2^53), finite floats, objects
    at most 8 levels deep.

    Raises:
      ConfigError: ``{where}: expected `int | null` (got 'abc')`` or the bound
        the value breaks.
    """
    integral = isinstance(value, float) and value.is_integer() and abs(value) < MAX_INTEGER
    if integral and int in (tp, *typing.get_args(tp)):  # 3.0 is the integer 3
        value = int(value)
    out = bounded_json.convert(value, tp, path=where, error=ConfigError)
    if type(out) is int and not -MAX_INTEGER < out < MAX_INTEGER:
        raise ConfigError(f"{where}: {bounded_json.short(value)} is out of range, expected an integer in (-2^53, 2^53)")
    if type(out) is float and (type(value) is int and not -MAX_INTEGER < value < MAX_INTEGER or not math.isfinite(out)):
        raise ConfigError(f"{where}: expected a finite number (got {bounded_json.short(value)})")
    if isinstance(out, dict):
        bounded_json.check_tree(out, path=where, error=ConfigError, max_depth=8, what="value")
    return out


def _from_mapping(cls, raw: Mapping[str, Any], where: str, base: Any):
    types_ = typing.get_type_hints(cls)
    unknown = sorted(set(raw) - set(types_))
    if unknown:
        raise ConfigError(f"{where or 'config'}: unknown field(s) {unknown}; valid fields: {sorted(types_)}")
    values = {}
    for name, value in raw.items():
        sub = f"{where}.{name}" if where else name
        tp = types_[name]
        if _is_dataclass_type(tp) and isinstance(value, Mapping):
            values[name] = _from_mapping(tp, value, sub, getattr(base, name))
        else:
            values[name] = _coerce(value, tp, sub)
    return dataclasses.replace(base, **values)


def config_from_dict(raw: Mapping[str, Any], base: TrainConfig | None = None) -> TrainConfig:
    """Builds a TrainConfig from nested dicts; fields not given keep ``base``'s
    (default: ``TrainConfig()``) values. The sequence lengths are read by
    ``_one_length_field``: an int, and the ``inputs_sequence_length`` of
    config files of earlier releases, become the one mapping, merged over
    ``base``'s.

    Raises:
      ConfigError: an unknown field (the message lists the valid ones) or a value
        of the wrong type.
    """
    base = base if base is not None else TrainConfig()
    return _from_mapping(TrainConfig, _one_length_field(raw, base.sequence_length), "", base)


def _one_length_field(raw: Mapping[str, Any], before: Mapping[str, int] | None) -> Mapping[str, Any]:
    """``raw`` (a config layer: a file, a preset, an override) with its sequence
    lengths as the field ``sequence_length`` {feature: tokens}, over ``before``
    (the layers below): the one place an int ``sequence_length`` (every
    feature's, ``{"*": N}``) and the ``inputs_sequence_length`` of earlier
    releases (the inputs') are read. A mapping with "*" replaces ``before``,
    one without adds its features to it; null (None) leaves the lengths to the
    cache. ``raw`` without either field is returned as it is; a value of
    another type is left for the field's check (ConfigError)."""
    if "sequence_length" not in raw and "inputs_sequence_length" not in raw:
        return raw
    out = dict(raw)
    value = out.pop("sequence_length", {})
    inputs = out.pop("inputs_sequence_length", None)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = {ALL_FEATURES: value}
    if inputs is not None and (value is None or isinstance(value, Mapping)):
        value = {**(value or {}), "inputs": inputs}
    if isinstance(value, Mapping) and ALL_FEATURES not in value:
        value = {**(before or {}), **value}
    out["sequence_length"] = value
    return out


def load_config_file(path: str, base: TrainConfig | None = None) -> TrainConfig:
    """Reads a JSON config file (nested like ``to_json`` writes it) over ``base``.

    Raises:
      ConfigError: the file cannot be read or parsed, or has a bad field: of
        an unknown name, the wrong type or outside its bounds (named with the
        file, even where a later layer would set the field again).
    """
    raw = bounded_json.read_file(path, error=ConfigError, max_bytes=1 << 20, max_depth=16, what="config file")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a config file must hold a JSON object (got {type(raw).__name__})")
    try:
        config = config_from_dict(raw, base)
        _check_bounds(config, "")
        return config
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def _parse_scalar(text: str, key: str) -> Any:
    """The right-hand side of ``key=value``: none/null, true/false, JSON, else the text itself.

    Raises:
      ConfigError: NaN or Infinity, an integer too long to convert, an object with a key twice.
    """
    if text.lower() in ("none", "null"):
        return None
    if text.lower() in ("true", "false"):
        return text.lower() == "true"

    def no_constant(name):
        raise ConfigError(f"override {key!r}: {bounded_json.short(text)} is not a finite number")

    try:
        return json.loads(text, parse_constant=no_constant, object_pairs_hook=bounded_json.unique_keys)
    except ConfigError:
        raise
    except bounded_json.DuplicateKeyError as e:
        raise ConfigError(f"override {key!r}: {e} (JSON readers disagree on which value counts); keep one") from None
    except (json.JSONDecodeError, RecursionError):
        pass
    except ValueError:  # an integer of more digits than int() converts
        raise ConfigError(f"override {key!r}: {bounded_json.short(text)} is out of range") from None
    return text  # a bare string


# Where a new override starts inside one --set value: a dotted key and "="
# (or the end of the value) after white space outside JSON brackets and strings.
_KEY = re.compile(r"$|[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*=")


def split_overrides(values: Sequence[str]) -> list[str]:
    """The ``key=value`` overrides of ``--set`` values, each of which may hold
    several separated by white space (``"model.d_model=128 optimizer.lr=1e-3"``).
    A value runs to the next white space outside JSON brackets and strings that
    is followed by a dotted key and ``=``, so
    ``data.mixture={"caches/wiki/train": 3, "caches/code/train": 1}`` is one
    override. Returns them in order, stripped.
    """
    out: list[str] = []
    for value in values:
        current, depth, in_string, escaped = "", 0, False, False
        for i, c in enumerate(value):
            if in_string:
                in_string = not (c == '"' and not escaped)
                escaped = c == "\\" and not escaped
            elif c == '"':
                in_string = True
            elif c in "[{":
                depth += 1
            elif c in "]}":
                depth = max(depth - 1, 0)
            elif c.isspace() and depth == 0 and (not current.strip() or _KEY.match(value[i:].lstrip())):
                out += [current.strip()] if current.strip() else []
                current = ""
                continue
            current += c
        out += [current.strip()] if current.strip() else []
    return out


def apply_overrides(config: TrainConfig, overrides: Sequence[str]) -> TrainConfig:
    """Applies dotted ``key=value`` overrides, e.g. ``["model.d_model=128", "optimizer.lr=1e-3"]``;
    values are JSON where they parse (or none/null), else strings, checked
    against the field's type.

    Raises:
      ConfigError: no ``=``, an unknown key (the message lists the valid ones at that
        level), or a value of the wrong type.
    """
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value, e.g. model.d_model=128")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        config = _set_path(config, parts, text, key)
    return config


def _set_path(obj: Any, parts: list[str], text: str, key: str) -> Any:
    types_ = typing.get_type_hints(type(obj))
    name = parts[0]
    if isinstance(obj, TrainConfig) and name in ("sequence_length", "inputs_sequence_length") and len(parts) == 1:
        return _set_lengths(obj, name, _parse_scalar(text, key), key)
    if name not in types_:
        raise ConfigError(f"override {key!r}: {type(obj).__name__} has no field {name!r}; valid fields: {sorted(types_)}")
    tp = types_[name]
    if len(parts) > 1:
        child = getattr(obj, name)
        if not dataclasses.is_dataclass(child):
            raise ConfigError(f"override {key!r}: {name!r} is a value, not a group of fields")
        return dataclasses.replace(obj, **{name: _set_path(child, parts[1:], text, key)})
    if _is_dataclass_type(tp):
        first = next(iter(typing.get_type_hints(tp)))
        raise ConfigError(f"override {key!r}: {name!r} is a group; set one of its fields, e.g. {key}.{first}=...")
    value = _parse_scalar(text, key)
    if str in (tp, *typing.get_args(tp)) and not isinstance(value, str) and (value is not None or tp is str):
        # A string field given something that parses as JSON, e.g. "1"; or "none"
        # for a field that cannot be null (model.remat=none is the string).
        value = text.strip()
    return dataclasses.replace(obj, **{name: _coerce(value, tp, key)})


def _set_lengths(config: TrainConfig, name: str, value: Any, key: str) -> TrainConfig:
    """``--set sequence_length=...`` (an int N: every feature's; a mapping) or
    ``--set inputs_sequence_length=N`` (the inputs', as in earlier releases),
    read as a config layer (``_one_length_field``)."""
    try:
        return config_from_dict({name: value}, base=config)
    except ConfigError as e:
        raise ConfigError(f"override {key!r}: {e}") from None


def model_preset(name: str) -> ModelConfig:
    """The preset ``name`` from MODEL_PRESETS.

    Raises:
      ConfigError: unknown name (the message lists the presets).
    """
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; presets: {sorted(MODEL_PRESETS)}") from None


def apply_preset(config: TrainConfig, name: str) -> TrainConfig:
    """``config`` with the preset ``name``'s model and the run settings it
    brings (``PRESET_RUN_SETTINGS``, e.g. ``large``'s ``num_microbatches=4``).

    Raises:
      ConfigError: unknown name (the message lists the presets).
    """
    layer = {"model": to_dict(model_preset(name)), **PRESET_RUN_SETTINGS.get(name, {})}
    return config_from_dict(layer, base=config)


# -- the layers of a run's config ----------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommandLineFlags:
    """The ``seqcache train`` flags that set config fields (layer 4); None (for
    ``mesh`` also "") leaves a field as the layers below set it. ``cache_dir``,
    ``task``, ``split``, ``eval_split`` set ``data``'s fields, ``checkpoint_dir``
    ``checkpoint.directory``, ``mesh`` (``"data=2,fsdp=4,model=1"``,
    ``partitioning.parse_mesh_flag``) the mesh, ``sequence_length``
    ({feature: tokens}, ``"*"`` for every feature the converter reads, as
    ``--sequence-length`` gives it; or an int, every feature's) the field of
    that name (over the lengths of the layers below: ``_one_length_field``);
    the others the ``TrainConfig`` fields of those names.
    """

    cache_dir: str | None = None
    task: str | None = None
    split: str | None = None
    eval_split: str | None = None
    steps: int | None = None
    global_batch_size: int | None = None
    sequence_length: Mapping[str, int] | int | None = None
    rules: str | None = None
    seed: int | None = None
    tensorboard: bool | None = None
    mesh: str | None = None
    checkpoint_dir: str | None = None


def apply_flags(config: TrainConfig, flags: CommandLineFlags) -> TrainConfig:
    """``config`` with the fields the flags give (those not None) replaced.

    Raises:
      ConfigError: a sequence length for a feature the models do not read.
      seqcache.training.partitioning.PartitioningError: a malformed ``mesh``.
    """
    given = {f.name: getattr(flags, f.name) for f in dataclasses.fields(flags) if getattr(flags, f.name) is not None}
    data = {k: given.pop(k) for k in ("cache_dir", "task", "split", "eval_split") if k in given}
    updates: dict[str, Any] = {k: v for k, v in given.items() if k not in ("mesh", "checkpoint_dir")}
    if flags.sequence_length is not None:  # over the layers below, as a config file's
        updates["sequence_length"] = _one_length_field({"sequence_length": flags.sequence_length},
                                                       config.sequence_length)["sequence_length"]
    updates["data"] = dataclasses.replace(config.data, **data)
    if flags.mesh:
        from seqcache.training import partitioning  # optional: jax (keeps config readable without it)

        updates["mesh"] = MeshConfig(**partitioning.parse_mesh_flag(flags.mesh))
    if flags.checkpoint_dir is not None:
        updates["checkpoint"] = dataclasses.replace(config.checkpoint, directory=flags.checkpoint_dir)
    return dataclasses.replace(config, **updates)


def config_from_layers(*, preset: str | None = None, config_file: str | None = None,
                       flags: CommandLineFlags | None = None, overrides: Sequence[str] = (),
                       converter: str | None = None) -> TrainConfig:
    """A run's config from its layers (see the module docstring; ``preset`` and
    ``config_file`` None or "": none), then ``resolve_seeds``. Not validated: the
    cache may still fill in fields such as ``model.vocab_size``. ``converter``:
    the ``data.converter`` under the layers (``seqcache train``: the one the
    cache decides), so that a length given for every feature (``"*"``) is given
    to each feature it reads.

    Raises:
      ConfigError: an unknown preset, a bad config file, a bad override or a
        data seed outside [0, 2**32).
      seqcache.training.partitioning.PartitioningError: a malformed mesh flag.
    """
    config = TrainConfig(data=DataConfig(converter=converter))
    if preset:
        config = apply_preset(config, preset)
    if config_file:
        config = load_config_file(config_file, base=config)
    if flags is not None:
        config = apply_flags(config, flags)
    config = apply_overrides(config, overrides)
    return resolve_seeds(config)
