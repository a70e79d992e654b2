"""A deterministic stand-in for ``seqcache.feeders.Feeder`` with the same interface.

Rows are synthetic packed sequences derived only from (seed, example index):
segments of random length whose tokens follow a fixed bigram rule from a random
start token, so that a model can learn them and the loss goes down. A dataset
has ``num_examples`` rows; epoch e visits them in the order of a permutation
seeded by (seed, e). Global position p = step * B + row.

With ``num_epochs`` set, the stream is finite: positions past the end give
padding rows (segment id 0, loss weight 0), and iteration stops after the batch
holding the last real row — the same contract as the real feeder.
"""

from __future__ import annotations

import numpy as np

FEATURES = ("targets", "targets_segment_ids", "targets_positions", "targets_loss_weights")


class FakeFeeder:
    FIELDS = FEATURES
    KIND = "fake"

    def __init__(
        self,
        *,
        cache=None,
        mixture=None,
        global_batch_size: int,
        sequence_length: int,
        host_index: int | None = None,
        host_count: int | None = None,
        seed: int = 0,
        num_epochs: int | None = None,
        start_step: int = 0,
        num_examples: int = 64,
        vocab_size: int = 64,
    ):
        self.cache = cache
        self.global_batch_size = global_batch_size
        self.sequence_length = sequence_length
        self.host_index = 0 if host_index is None else host_index
        self.host_count = 1 if host_count is None else host_count
        if global_batch_size % self.host_count:
            raise ValueError(f"global batch {global_batch_size} not divisible by {self.host_count} hosts")
        self.seed = seed
        self.num_epochs = num_epochs
        self.step = start_step
        self.num_examples = num_examples
        self.vocab_size = vocab_size
        self.closed = False
        self.batches_read = 0

    # -- rows --------------------------------------------------------------------

    def example(self, index: int) -> dict[str, np.ndarray]:
        """The packed row of example ``index`` (independent of epoch and position)."""
        length, vocab = self.sequence_length, self.vocab_size
        rng = np.random.default_rng([self.seed, 7, index])
        targets = np.zeros(length, np.int32)
        segments = np.zeros(length, np.int32)
        positions = np.zeros(length, np.int32)
        start, seg = 0, 0
        while length - start >= 3:
            n = int(rng.integers(3, max(4, length - start + 1)))
            n = min(n, length - start)
            seg += 1
            token = int(rng.integers(1, vocab))
            for i in range(n):
                targets[start + i] = token
                token = (3 * token + 1) % (vocab - 1) + 1
            segments[start : start + n] = seg
            positions[start : start + n] = np.arange(n)
            start += n
            if rng.random() < 0.3:
                break  # leave the rest of the row as padding
        weights = (segments > 0).astype(np.float32)
        return {
            "targets": targets,
            "targets_segment_ids": segments,
            "targets_positions": positions,
            "targets_loss_weights": weights,
        }

    def _padding_row(self):
        z = np.zeros(self.sequence_length, np.int32)
        return {"targets": z, "targets_segment_ids": z, "targets_positions": z,
                "targets_loss_weights": np.zeros(self.sequence_length, np.float32)}

    def _end(self) -> int | None:
        return None if self.num_epochs is None else self.num_examples * self.num_epochs

    def row_at(self, position: int) -> dict[str, np.ndarray]:
        end = self._end()
        if end is not None and position >= end:
            return self._padding_row()
        epoch, i = divmod(position, self.num_examples)
        order = np.random.default_rng([self.seed, 11, epoch]).permutation(self.num_examples)
        return self.example(int(order[i]))

    def get_batch(self, step: int) -> dict[str, np.ndarray]:
        per_host = self.global_batch_size // self.host_count
        first = step * self.global_batch_size + self.host_index * per_host
        rows = [self.row_at(first + r) for r in range(per_host)]
        self.batches_read += 1
        return {k: np.stack([row[k] for row in rows]) for k in self.FIELDS}

    # -- iteration and state ------------------------------------------------------

    def num_batches(self) -> int | None:
        end = self._end()
        return None if end is None else -(-end // self.global_batch_size)

    def __iter__(self):
        return self

    def __next__(self):
        n = self.num_batches()
        if n is not None and self.step >= n:
            raise StopIteration
        batch = self.get_batch(self.step)
        self.step += 1
        return batch

    def state(self) -> dict:
        return {
            "kind": self.KIND,
            "global_batch_size": self.global_batch_size,
            "sequence_length": self.sequence_length,
            "seed": self.seed,
            "num_epochs": self.num_epochs,
            "num_examples": self.num_examples,
            "vocab_size": self.vocab_size,
            "step": self.step,
        }

    @classmethod
    def restore(cls, state: dict, *, host_index=None, host_count=None) -> "FakeFeeder":
        return cls(
            global_batch_size=state["global_batch_size"],
            sequence_length=state["sequence_length"],
            seed=state["seed"],
            num_epochs=state["num_epochs"],
            num_examples=state["num_examples"],
            vocab_size=state["vocab_size"],
            start_step=state["step"],
            host_index=host_index,
            host_count=host_count,
        )

    def close(self):
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


ENCDEC_FIELDS = ("encoder_input_tokens", "encoder_segment_ids", "encoder_positions", "decoder_target_tokens",
                 "decoder_input_tokens", "decoder_loss_weights", "decoder_segment_ids", "decoder_positions")


class FakeEncDecFeeder(FakeFeeder):
    """The same stream of examples as ``FakeFeeder`` (same permutations, epochs,
    padding rows and state), as packed (inputs, targets) rows with t5x's field
    names, as ``ConvertedFeeder("encdec")`` gives them: the encoder reads
    segments of random tokens, decoder segment k translates encoder segment k
    token by token (a fixed map) and is shorter by a random amount. Encoder and
    decoder rows have ``sequence_length`` tokens each."""

    FIELDS = ENCDEC_FIELDS
    KIND = "fake-encdec"

    def example(self, index: int) -> dict[str, np.ndarray]:
        from seqcache.feeders.converters import autoregressive_inputs

        length, vocab = self.sequence_length, self.vocab_size
        rng = np.random.default_rng([self.seed, 13, index])
        row = {k: np.zeros(length, np.int32) for k in ENCDEC_FIELDS}
        start, seg = 0, 0
        while length - start >= 3:
            n = min(int(rng.integers(3, max(4, length - start + 1))), length - start)
            m = max(1, n - int(rng.integers(0, 3)))  # the target is a little shorter
            seg += 1
            tokens = rng.integers(1, vocab, n)
            row["encoder_input_tokens"][start:start + n] = tokens
            row["encoder_segment_ids"][start:start + n] = seg
            row["encoder_positions"][start:start + n] = np.arange(n)
            row["decoder_target_tokens"][start:start + m] = (5 * tokens[:m] + 3) % (vocab - 1) + 1
            row["decoder_segment_ids"][start:start + m] = seg
            row["decoder_positions"][start:start + m] = np.arange(m)
            start += n
            if rng.random() < 0.3:
                break
        row["decoder_input_tokens"] = autoregressive_inputs(row["decoder_target_tokens"][None],
                                                            row["decoder_segment_ids"][None])[0]
        row["decoder_loss_weights"] = (row["decoder_segment_ids"] > 0).astype(np.float32)
        return row

    def _padding_row(self):
        row = {k: np.zeros(self.sequence_length, np.int32) for k in ENCDEC_FIELDS}
        row["decoder_loss_weights"] = np.zeros(self.sequence_length, np.float32)
        return row


def t5_config_dict(**overrides) -> dict:
    """``tiny_config_dict`` for the T5 model (one encoder and one decoder layer,
    d_model 32, dropout on) fed by ``FakeEncDecFeeder`` rows of 16 + 16 tokens."""
    model = {"architecture": "t5", "vocab_size": 64, "d_model": 32, "num_layers": 1, "num_decoder_layers": 1,
             "num_heads": 4, "head_dim": 8, "mlp_dim": 64, "mlp_activation": "geglu", "tie_embeddings": False,
             "dropout_rate": 0.1}
    overrides = dict(overrides)
    model.update(overrides.pop("model", {}))
    return tiny_config_dict(model=model, inputs_sequence_length=16, data={"converter": "encdec"}, **overrides)


def tiny_config_dict(**overrides) -> dict:
    """The tests' common TrainConfig dict: a model that compiles in about a second
    on CPU (1 layer, d_model 32), dropout on (so the per-step RNG matters), two
    microbatches. Tests share it where they can, so that identical programs are
    compiled once per session (see conftest.py). Nested keys are merged one level
    deep."""
    base = {
        "model": {"vocab_size": 64, "d_model": 32, "num_layers": 1, "num_heads": 4, "mlp_dim": 64,
                  "dropout_rate": 0.1},
        "optimizer": {"lr": 1e-2, "warmup_steps": 2},
        "mesh": {"data": 1, "fsdp": 1, "model": 1},
        "checkpoint": {"every_steps": 100, "max_to_keep": 3},
        "steps": 6,
        "global_batch_size": 16,
        "sequence_length": 16,
        "num_microbatches": 2,
        "progress": False,
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return base


FEEDER_KWARGS = {"global_batch_size": 16, "sequence_length": 16, "seed": 4, "num_examples": 40}
