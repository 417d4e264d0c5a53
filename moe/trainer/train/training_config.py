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
attention_backend = "sdpa"  # MLA's core: sdpa, unfused or auto (moe/trainer/models/deepseek_v3/attention.py)
compile = false          # torch.compile (inductor) of every layer's attention
(moe/trainer/models/deepseek_v3/compile.py) # Anomalies and rewind (moe/trainer/train/rewind.py): a step whose loss or
gradient norm is NaN/Inf, or whose loss is a # spike, makes no update; the state is restored from the last in-memory
snapshot, the step's batch is skipped. check_for_nan_in_loss_and_grad = true
check_for_spiky_loss = false
spiky_loss_zscore = 6.0        # a spike: (loss - mean) / std of the last accepted steps' losses above this
spiky_loss_window = 50         # steps in that window
spiky_loss_min_steps = 10      # accepted steps before spikes are looked for
rewind_snapshot_interval = 1   # steps between in-memory snapshots; 0 = none (an anomaly stops the run)
rewind_max_retries = 3         # anomalous steps in a row that are rewound and skipped; the next one stops the run
iterations_to_skip = []        # steps that make no update (their batches are skipped), e.g. known bad batches
# Slow-rank detection (moe/trainer/train/straggler.py): per-rank, per-phase times gathered every straggler_interval
steps. log_straggler = false
straggler_interval = 10
straggler_factor = 1.5         # a rank whose phase time exceeds the median over the ranks by this factor ...
straggler_min_seconds = 0.02   # ... and by this many seconds per step is reported

[training.data]
corpus = "python-stdlib" # a directory, a file or a glob (.py .txt .md .jsonl .jsonl.gz .parquet)
tokenizer = "bpe"        # BPE trained to the model's vocab_size, "bytes", or a tokenizer.json / tokenizer directory
# text_field = "text"    # the JSONL key / parquet column of the documents
# data_path = [0.7, "/data/web_text_document", 0.3, "/data/code_text_document"]  # Megatron's --data-path
# reset_position_ids = false   # Megatron's: positions restart at every document (after each end-of-text token)
# reset_attention_mask = false # Megatron's: attention never crosses an end-of-text token
# eod_mask_loss = false        # Megatron's: no loss on the target that follows an end-of-text token
```

Megatron's names for the same settings: `train_iters`, `global_batch_size`, `seq_length`, `lr`, `min_lr`,
`lr_warmup_iters`, `adam_beta1/2`, `adam_eps`, `weight_decay`, `clip_grad`, `save_interval`, `log_interval`;
`check_for_nan_in_loss_and_grad`, `check_for_spiky_loss`, `iterations_to_skip` and `log_straggler` are Megatron's
own names (its `--iterations-to-skip` steps likewise make no update and consume their batch; here the learning rate
stays a function of the step number, see moe/trainer/train/rewind.py).

Two data paths (moe/trainer/data/source.py picks one): the built-in corpus (python-stdlib or a directory of `*.py`
files, tokenizer "bpe" or "bytes") keeps its token file and its window hold-out (moe/trainer/data/token_file.py); any
other corpus or tokenizer, and Megatron-prepared data (`data_path`), are indexed datasets read as a seeded blend with
whole documents held out (moe/trainer/data/blend.py, moe/trainer/data/blended_batches.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import tomllib

from moe.trainer.data.blend import parse_data_path
from moe.trainer.models.deepseek_v3.attention import ATTENTION_BACKENDS

DTYPES = ("float32", "bfloat16")
TOKENIZERS = ("bpe", "bytes")


@dataclass(kw_only=True)
class DataConfig:
    """Where the tokens come from.

    corpus: "python-stdlib" (this Python's standard library sources: present on every machine, no download), a
        directory (its corpus files, sorted by relative path), a glob pattern or one file. Formats by name: `.py`,
        `.txt`, `.md` (a document per file), `.jsonl`, `.jsonl.gz` (a document per line), `.parquet` (per row).
    text_field: the JSONL key / parquet column holding a document's text.
    tokenizer: "bpe" (byte-level BPE trained with `tokenizers` to the model's vocab_size), "bytes" (one token per
        byte, needs vocab_size >= 257), or a path: a `tokenizer.json` or a Hugging Face tokenizer directory (its
        ids must be below vocab_size). Saved with the run and every checkpoint.
    data_path: Megatron's `--data-path`: `[w1, "prefix1", w2, "prefix2", ...]` or prefixes alone, indexed datasets
        (`prefix.bin` / `prefix.idx`) blended as Megatron does (moe/trainer/data/blend.py). Then `corpus`, `text_field`
        and
        `max_bytes` are unused (setting them as well is refused), and `tokenizer` names the tokenizer that prepared
        the data (a path, or "bytes"): its end-of-text id ends the documents, and it is saved with the run.
    held_out_documents: for indexed data (data_path, or a corpus tokenized into shards), the documents of every
        dataset kept out of training for validation: a count (int), or a fraction (float in [0, 1), at least one
        document when > 0). Whole documents, spread evenly over each dataset, whatever the seed.
    max_bytes: use the sorted files up to this many bytes (None: all of them).
    val_sequences: the built-in corpus: windows held out of training at the end of the token stream; indexed data:
        at most this many of the held-out documents' windows, spread evenly, for evaluate.py. Written as the run's
        `val_tokens.npy`.
    reset_position_ids, reset_attention_mask, eod_mask_loss: Megatron's flags: position ids restart after every
        end-of-text token; attention stays inside each document; the target after an end-of-text token is not
        trained on (its label is -100).
    cache_dir: where the tokenizer and token files are built once and reused (None: $MTDEEPEP_DATA_CACHE, else
        ~/.cache/mtdeepep/data).
    """

    corpus: str = "python-stdlib"
    text_field: str = "text"
    tokenizer: str = "bpe"
    data_path: list | None = None
    held_out_documents: int | float = 0.01
    max_bytes: int | None = None
    val_sequences: int = 32
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ValueError(f"[training.data] tokenizer must be {TOKENIZERS} or a path, got {self.tokenizer!r}")
        if self.tokenizer not in TOKENIZERS and not Path(self.tokenizer).exists():
            raise ValueError(
                f"[training.data] tokenizer {self.tokenizer!r}: not one of {TOKENIZERS}, and no such file or directory "
                "(a tokenizer.json or a tokenizer directory)"
            )
        if not isinstance(self.corpus, str) or not self.corpus:
            raise ValueError(f"[training.data] corpus must be a directory, a file or a glob, got {self.corpus!r}")
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ValueError(f"[training.data] text_field must be a non-empty string, got {self.text_field!r}")
        if self.max_bytes is not None:
            _positive_int("data.max_bytes", self.max_bytes)
        if isinstance(self.val_sequences, bool) or not isinstance(self.val_sequences, int) or self.val_sequences < 0:
            raise ValueError(f"[training.data] val_sequences must be an int >= 0, got {self.val_sequences!r}")
        held = self.held_out_documents
        if (
            isinstance(held, bool)
            or not isinstance(held, (int, float))
            or held < 0
            or (isinstance(held, float) and held >= 1)
        ):
            raise ValueError(
                "[training.data] held_out_documents must be a document count (int >= 0) or a fraction (float in "
                f"[0, 1)), got {held!r}"
            )
        for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"[training.data] {name} must be true or false, got {getattr(self, name)!r}")
        if self.data_path is not None:
            self._check_data_path()

    def _check_data_path(self) -> None:
        if isinstance(self.data_path, str):
            self.data_path = [self.data_path]
        if not isinstance(self.data_path, (list, tuple)):
            raise ValueError(f"[training.data] data_path must be a list [w1, prefix1, ...], got {self.data_path!r}")
        items = list(self.data_path)
        for i, item in enumerate(items):
            if isinstance(item, bool) or not isinstance(item, (str, int, float)):
                raise ValueError(f"[training.data] data_path entry {i} ({item!r}): a weight (number) or a prefix")
        numbers = [i for i, item in enumerate(items) if not isinstance(item, str) or _is_number(item)]
        if numbers and len(items) % 2:
            raise ValueError(
                f"[training.data] data_path {items!r}: weights and prefixes come in pairs [w1, prefix1, w2, "
                f"prefix2, ...]; entry {numbers[-1]} ({items[numbers[-1]]!r}) has no prefix after it"
            )
        try:
            entries = parse_data_path(items)
        except ValueError as exc:
            raise ValueError(f"[training.data] {exc}") from None
        if any(e.weight is not None for e in entries):
            total = sum(e.weight for e in entries)
            if not total > 0:
                raise ValueError(f"[training.data] data_path weights sum to {total}: the sum must be positive")
        # The normalised spelling (weights as numbers) is what the run saves and compares on resume.
        self.data_path = [x for e in entries for x in ((e.weight, e.prefix) if e.weight is not None else (e.prefix,))]
        defaults = DataConfig()
        given = [n for n in ("corpus", "text_field", "max_bytes") if getattr(self, n) != getattr(defaults, n)]
        if given:
            raise ValueError(
                f"[training.data] data_path and {', '.join(given)} are both given: data_path trains on Megatron-"
                f"prepared indexed datasets, {given[0]} describes a text corpus to tokenize; give one of them"
            )
        if self.tokenizer == "bpe":
            raise ValueError(
                "[training.data] data_path needs the tokenizer that prepared the data (its end-of-text id, saved "
                'with the run): tokenizer = a tokenizer.json or tokenizer directory (or "bytes")'
            )

    @property
    def builtin(self) -> bool:
        """True for the built-in path: no data_path, a trained tokenizer ("bpe" / "bytes"), the default text_field
        and a corpus that is python-stdlib or a directory of `*.py` files only (moe/trainer/data/token_file.py,
        bit-identical to the runs before indexed data). Otherwise the data is indexed datasets."""
        return (
            self.data_path is None
            and self.tokenizer in TOKENIZERS
            and self.text_field == "text"
            and (self.corpus == "python-stdlib" or _python_only_directory(self.corpus))
        )


def _is_number(text: str) -> bool:
    """A weight as the command line gives it ("0.3")."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def _python_only_directory(corpus: str) -> bool:
    """A directory (or a missing path, whose error the built-in path reports as before) whose files of the corpus
    formats are all `*.py`."""
    root = Path(corpus)
    if not root.is_dir():
        return not root.exists() and not any(c in corpus for c in "*?[")
    for p in root.rglob("*"):
        corpus_format = p.suffix in (".txt", ".md", ".jsonl", ".parquet") or p.name.endswith(".jsonl.gz")
        if corpus_format and "__pycache__" not in p.parts and p.is_file():
            return False
    return True


@dataclass(kw_only=True)
class TrainingConfig:
    """Optimizer (AdamW), schedule (linear warm-up then cosine to `min_lr`), batch, precision and checkpoints.

    The batch is given in sequences of `seq_len` tokens: `global_batch` per optimizer step, split over the
    data-parallel ranks and then into `micro_batches` per rank, so it must be divisible by `dp * micro_batches`
    (checked against the layout by `moe.trainer.train.parallel_state.Layout.check_batch`).
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
    # MLA's attention core (Megatron's --attention-backend names; moe/trainer/models/deepseek_v3/attention.py): 'sdpa'
    # (default), 'unfused' (explicit GEMMs + softmax over the unpadded values) or 'auto' (unfused where it is the
    # cheaper on CPU: short float32 sequences). Not bit-identical to 'sdpa', so it is opt-in.
    attention_backend: str = "sdpa"
    # torch.compile of the model's static-shape parts (moe/trainer/models/deepseek_v3/compile.py); opt-in: the first
    # step pays the compilation.
    compile: bool = False
    # Megatron's names: ZeRO-1 (optimizer states and FP32 masters sharded over the data-parallel ranks), its
    # gradient bucket size in elements (None: Megatron's default max(40M, 1M * dp)) and the overlap of the bucket
    # reductions with the backward.
    use_distributed_optimizer: bool = False
    ddp_bucket_size: int | None = None
    overlap_grad_reduce: bool = True
    # Anomaly detection and rewind (moe/trainer/train/rewind.py; the semantics are in its docstring). Defaults: NaN/Inf
    # checked (an anomaly without snapshots stops the run, as it always did), spikes not, no snapshots.
    check_for_nan_in_loss_and_grad: bool = True
    check_for_spiky_loss: bool = False
    spiky_loss_zscore: float = 6.0
    spiky_loss_window: int = 50
    spiky_loss_min_steps: int = 10
    rewind_snapshot_interval: int = 0
    rewind_max_retries: int = 3
    iterations_to_skip: tuple[int, ...] = ()
    # Slow-rank detection (moe/trainer/train/straggler.py).
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
