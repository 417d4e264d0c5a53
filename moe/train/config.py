"""The `[training]` table of a run's TOML config: optimizer, schedule, batch, precision, checkpoints, and data.

```toml
[training]
steps = 200
global_batch = 16        # sequences per optimizer step, whatever the layout
micro_batches = 4        # per data-parallel rank (gradient accumulation; pipeline schedules need several)
seq_len = 128
lr = 3e-3
min_lr = 3e-4            # end of the cosine decay
warmup_steps = 20        # linear warm-up from lr / warmup_steps to lr
betas = [0.9, 0.95]
eps = 1e-8
weight_decay = 0.1
clip_grad = 1.0          # global gradient-norm clip; 0 = off
dtype = "float32"        # parameters and activations: float32 or bfloat16 (FP32 master weights and Adam states)
checkpoint_every = 100   # steps; the last step is always saved; 0 = only the last
log_every = 10           # steps between console log lines (metrics.jsonl gets every step)
attention_backend = "sdpa"  # MLA's core: sdpa, unfused or auto (moe/models/deepseek_v3/attention.py)
compile = false          # torch.compile (inductor) of every layer's attention (moe/models/deepseek_v3/compile.py)
# Anomalies and rewind (moe/train/rewind.py): a step whose loss or gradient norm is NaN/Inf, or whose loss is a
# spike, makes no update; the state is restored from the last in-memory snapshot, the step's batch is skipped.
check_for_nan_in_loss_and_grad = true
check_for_spiky_loss = false
spiky_loss_zscore = 6.0        # a spike: (loss - mean) / std of the last accepted steps' losses above this
spiky_loss_window = 50         # steps in that window
spiky_loss_min_steps = 10      # accepted steps before spikes are looked for
rewind_snapshot_interval = 1   # steps between in-memory snapshots; 0 = none (an anomaly stops the run)
rewind_max_retries = 3         # anomalous steps in a row that are rewound and skipped; the next one stops the run
iterations_to_skip = []        # steps that make no update (their batches are skipped), e.g. known bad batches
# Slow-rank detection (moe/train/straggler.py): per-rank, per-phase times gathered every straggler_interval steps.
log_straggler = false
straggler_interval = 10
straggler_factor = 1.5         # a rank whose phase time exceeds the median over the ranks by this factor ...
straggler_min_seconds = 0.02   # ... and by this many seconds per step is reported

[training.data]
corpus = "python-stdlib" # or a directory: its *.py files, sorted by path
tokenizer = "bpe"        # byte-level BPE trained to the model's vocab_size, or "bytes"
```

Megatron's names for the same settings: `train_iters`, `global_batch_size`, `seq_length`, `lr`, `min_lr`,
`lr_warmup_iters`, `adam_beta1/2`, `adam_eps`, `weight_decay`, `clip_grad`, `save_interval`, `log_interval`;
`check_for_nan_in_loss_and_grad`, `check_for_spiky_loss`, `iterations_to_skip` and `log_straggler` are Megatron's
own names (its `--iterations-to-skip` steps likewise make no update and consume their batch; here the learning rate
stays a function of the step number, see moe/train/rewind.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import tomllib

from moe.models.deepseek_v3.attention import ATTENTION_BACKENDS

DTYPES = ("float32", "bfloat16")
TOKENIZERS = ("bpe", "bytes")


@dataclass(kw_only=True)
class DataConfig:
    """Where the tokens come from.

    corpus: "python-stdlib" (this Python's standard library sources: present on every machine, no download) or a
        directory whose `*.py` files, sorted by relative path, form the corpus.
    tokenizer: "bpe" (byte-level BPE trained with `tokenizers` to the model's vocab_size) or "bytes" (one token per
        byte, needs vocab_size >= 257).
    max_bytes: use the sorted files up to this many bytes (None: all of them).
    val_sequences: windows held out of training at the end of the token stream (written as the run's
        `val_tokens.npy` for evaluate.py).
    cache_dir: where the tokenizer and token file are built once and reused (None: $MTDEEPEP_DATA_CACHE, else
        ~/.cache/mtdeepep/data).
    """

    corpus: str = "python-stdlib"
    tokenizer: str = "bpe"
    max_bytes: int | None = None
    val_sequences: int = 32
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"[training.data] tokenizer must be one of {TOKENIZERS}, got {self.tokenizer!r}")
        if self.max_bytes is not None:
            _positive_int("data.max_bytes", self.max_bytes)
        if isinstance(self.val_sequences, bool) or not isinstance(self.val_sequences, int) or self.val_sequences < 0:
            raise ValueError(f"[training.data] val_sequences must be an int >= 0, got {self.val_sequences!r}")


@dataclass(kw_only=True)
class TrainingConfig:
    """Optimizer (AdamW), schedule (linear warm-up then cosine to `min_lr`), batch, precision and checkpoints.

    The batch is given in sequences of `seq_len` tokens: `global_batch` per optimizer step, split over the
    data-parallel ranks and then into `micro_batches` per rank, so it must be divisible by `dp * micro_batches`
    (checked against the layout by `moe.train.parallel.Layout.check_batch`).
    """

    steps: int
    global_batch: int
    seq_len: int
    lr: float
    micro_batches: int = 1
    min_lr: float = 0.0
    warmup_steps: int = 0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    dtype: str = "float32"
    checkpoint_every: int = 0
    log_every: int = 10
    # MLA's attention core (Megatron's --attention-backend names; moe/models/deepseek_v3/attention.py): 'sdpa'
    # (default), 'unfused' (explicit GEMMs + softmax over the unpadded values) or 'auto' (unfused where it is the
    # cheaper on CPU: short float32 sequences). Not bit-identical to 'sdpa', so it is opt-in.
    attention_backend: str = "sdpa"
    # torch.compile of the model's static-shape parts (moe/models/deepseek_v3/compile.py); opt-in: the first step
    # pays the compilation.
    compile: bool = False
    # Megatron's names: ZeRO-1 (optimizer states and FP32 masters sharded over the data-parallel ranks), its
    # gradient bucket size in elements (None: Megatron's default max(40M, 1M * dp)) and the overlap of the bucket
    # reductions with the backward.
    use_distributed_optimizer: bool = False
    ddp_bucket_size: int | None = None
    overlap_grad_reduce: bool = True
    # Anomaly detection and rewind (moe/train/rewind.py; the semantics are in its docstring). Defaults: NaN/Inf
    # checked (an anomaly without snapshots stops the run, as it always did), spikes not, no snapshots.
    check_for_nan_in_loss_and_grad: bool = True
    check_for_spiky_loss: bool = False
    spiky_loss_zscore: float = 6.0
    spiky_loss_window: int = 50
    spiky_loss_min_steps: int = 10
    rewind_snapshot_interval: int = 0
    rewind_max_retries: int = 3
    iterations_to_skip: tuple[int, ...] = ()
    # Slow-rank detection (moe/train/straggler.py).
    log_straggler: bool = False
    straggler_interval: int = 10
    straggler_factor: float = 1.5
    straggler_min_seconds: float = 0.02
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch", "seq_len", "micro_batches", "log_every"):
            _positive_int(name, getattr(self, name))
        for name in ("warmup_steps", "checkpoint_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"[training] {name} must be an int >= 0, got {value!r}")
        if self.seq_len < 2:
            raise ValueError(f"[training] seq_len must be >= 2 (next-token targets), got {self.seq_len}")
        if self.global_batch % self.micro_batches:
            raise ValueError(
                f"[training] global_batch={self.global_batch} is not divisible by micro_batches={self.micro_batches}"
            )
        if not self.lr > 0:
            raise ValueError(f"[training] lr must be > 0, got {self.lr!r}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"[training] min_lr must be in [0, lr={self.lr}], got {self.min_lr!r}")
        betas = tuple(self.betas)
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
            raise ValueError(f"[training] betas must be two numbers in [0, 1), got {self.betas!r}")
        self.betas = (float(betas[0]), float(betas[1]))
        if not self.eps > 0:
            raise ValueError(f"[training] eps must be > 0, got {self.eps!r}")
        if not self.weight_decay >= 0:
            raise ValueError(f"[training] weight_decay must be >= 0, got {self.weight_decay!r}")
        if not self.clip_grad >= 0:
            raise ValueError(f"[training] clip_grad must be >= 0 (0 = off), got {self.clip_grad!r}")
        for name in ("use_distributed_optimizer", "overlap_grad_reduce", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"[training] {name} must be true or false, got {getattr(self, name)!r}")
        if self.ddp_bucket_size is not None:
            _positive_int("ddp_bucket_size", self.ddp_bucket_size)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"[training] attention_backend must be one of {ATTENTION_BACKENDS}, got "
                             f"{self.attention_backend!r}")  # fmt: skip
        if self.dtype not in DTYPES:
            raise ValueError(f"[training] dtype must be one of {DTYPES}, got {self.dtype!r}")
        self._check_anomaly_settings()
        if isinstance(self.data, dict):
            self.data = data_config_from_dict(self.data)

    def _check_anomaly_settings(self) -> None:
        for name in ("check_for_nan_in_loss_and_grad", "check_for_spiky_loss", "log_straggler"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"[training] {name} must be true or false, got {getattr(self, name)!r}")
        for name in ("spiky_loss_window", "straggler_interval"):
            _positive_int(name, getattr(self, name))
        for name in ("spiky_loss_min_steps", "rewind_snapshot_interval", "rewind_max_retries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"[training] {name} must be an int >= 0, got {value!r}")
        if self.spiky_loss_min_steps < 2:
            raise ValueError(f"[training] spiky_loss_min_steps must be >= 2 (a spread needs two losses), got "
                             f"{self.spiky_loss_min_steps}")  # fmt: skip
        if self.spiky_loss_min_steps > self.spiky_loss_window:
            raise ValueError(
                f"[training] spiky_loss_min_steps={self.spiky_loss_min_steps} exceeds spiky_loss_window="
                f"{self.spiky_loss_window}: the window never holds that many losses"
            )
        for name in ("spiky_loss_zscore", "straggler_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"[training] {name} must be a number > 0, got {value!r}")
        if self.straggler_factor <= 1:
            raise ValueError(f"[training] straggler_factor must be > 1 (times the median), got {self.straggler_factor}")
        value = self.straggler_min_seconds
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"[training] straggler_min_seconds must be a number >= 0, got {value!r}")
        skip = self.iterations_to_skip
        if not isinstance(skip, (list, tuple)) or any(isinstance(s, bool) or not isinstance(s, int) or s < 1
                                                      for s in skip):  # fmt: skip
            raise ValueError(f"[training] iterations_to_skip must be a list of steps >= 1, got {skip!r}")
        self.iterations_to_skip = tuple(sorted(set(skip)))

    @classmethod
    def from_dict(cls, table: dict[str, Any]) -> TrainingConfig:
        """From the `[training]` table (a `[training.data]` sub-table included); unknown keys raise ValueError."""
        table = dict(table)
        data = data_config_from_dict(table.pop("data", {}))
        _check_keys("[training]", table, cls, exclude={"data"})
        missing = [name for name in ("steps", "global_batch", "seq_len", "lr") if name not in table]
        if missing:
            raise ValueError(f"[training] is missing {missing}")
        return cls(**table, data=data)

    @classmethod
    def from_toml(cls, path: str | Path) -> TrainingConfig:
        """From the `[training]` table of the TOML file at `path`."""
        return cls.from_dict(training_table(path))

    def to_dict(self) -> dict[str, Any]:
        """The resolved settings as plain JSON-able values (for run.json)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "data"}
        out["betas"] = list(self.betas)
        out["iterations_to_skip"] = list(self.iterations_to_skip)
        out["data"] = {f.name: getattr(self.data, f.name) for f in fields(self.data)}
        return out


def data_config_from_dict(table: dict[str, Any]) -> DataConfig:
    _check_keys("[training.data]", table, DataConfig)
    return DataConfig(**table)


def training_table(path: str | Path) -> dict[str, Any]:
    """The `[training]` table of a TOML file; ValueError if the file or the table is missing."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    with path.open("rb") as f:
        doc = tomllib.load(f)
    if "training" not in doc:
        raise ValueError(f"{path} has no [training] table")
    return doc["training"]


def _check_keys(where: str, table: dict[str, Any], cls: type, exclude: set[str] = frozenset()) -> None:
    known = {f.name for f in fields(cls)} - set(exclude)
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} (known: {sorted(known)})")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"[training] {name} must be a positive int, got {value!r}")
