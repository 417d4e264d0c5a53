"""`torch.profiler` over chosen training steps on chosen ranks: a Chrome / Perfetto trace per rank and a table of
the top operators.

The `[profiling]` table, with Megatron's names (the command-line aliases are Megatron's flags) and torchtitan's:

```toml
[profiling]
enable_profiling = true     # Megatron's --profile (torchtitan's enable_profiling)
profile_step_start = 10     # Megatron's window: profiling starts once 10 steps are done and stops once 12 are,
profile_step_end = 12       #   so steps 11 and 12 (metrics.jsonl's numbering) are traced (default 10 and 12)
profile_ranks = [0, 1]      # --profile-ranks 0 1 (default: every rank, as Megatron)
# profile_freq = 10         # torchtitan's alternative to the window: trace step 10, 20, ... (one step each)
save_traces_folder = "profile_traces"  # under RUN_DIR (torchtitan's name)
top_operators = 15          # rows of the table printed at the end
```

A window writes `RUN_DIR/<save_traces_folder>/iteration_<its last step>/rank<r>_trace.json` (torchtitan's layout;
open it in https://ui.perfetto.dev or chrome://tracing) and `rank<r>_top_operators.txt`, the table the rank prints
at the end. The step before a window, when this launch runs it, is the profiler's warm-up (its start-up cost stays
out of the trace), as Megatron and torchtitan do. The MoE layers name their dispatch, expert GEMMs and combine in
the trace (moe/layer/trace_regions.py). Each window is traced once: a rewind (moe/trainer/train/rewind.py) that
runs its steps again does not trace them again. Nothing is profiled, and nothing costs, without `enable_profiling`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

TRACE_FILE = "rank{rank}_trace.json"
TOP_OPERATORS_FILE = "rank{rank}_top_operators.txt"
WINDOW_DIR = "iteration_{step}"
# Each profiled step, by metrics.jsonl's number (the profiler's own ProfilerStep#k counts from its start).
STEP_REGION = "train_step#{step}"
MEGATRON_DEFAULT_WINDOW = (10, 12)


@dataclass(kw_only=True)
class ProfilingConfig:
    """The `[profiling]` table (see the module docstring for each key)."""

    enable_profiling: bool = False
    profile_step_start: int | None = None
    profile_step_end: int | None = None
    profile_ranks: list[int] = field(default_factory=list)
    profile_freq: int | None = None
    save_traces_folder: str = "profile_traces"
    top_operators: int = 15

    def __post_init__(self) -> None:
        if not isinstance(self.enable_profiling, bool):
            raise ValueError(f"[profiling] enable_profiling must be true or false, got {self.enable_profiling!r}")
        for name in ("profile_step_start", "profile_step_end", "profile_freq", "top_operators"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"[profiling] {name} must be an integer, got {value!r}")
        if not isinstance(self.profile_ranks, (list, tuple)) or not all(
            isinstance(r, int) and not isinstance(r, bool) for r in self.profile_ranks
        ):
            raise ValueError(f"[profiling] profile_ranks must be a list of ranks, got {self.profile_ranks!r}")
        self.profile_ranks = list(self.profile_ranks)
        if not isinstance(self.save_traces_folder, str) or not self.save_traces_folder:
            raise ValueError(f"[profiling] save_traces_folder must be a folder name, got {self.save_traces_folder!r}")
        if self.top_operators < 1:
            raise ValueError(f"[profiling] top_operators must be >= 1, got {self.top_operators}")
        window = self.profile_step_start is not None or self.profile_step_end is not None
        if window and self.profile_freq is not None:
            raise ValueError("[profiling] give a window (--profile-step-start / --profile-step-end, Megatron's) or "
                             "profile_freq (torchtitan's), not both")  # fmt: skip
        if self.profile_freq is not None and self.profile_freq < 1:
            raise ValueError(f"[profiling] profile_freq must be >= 1, got {self.profile_freq}")
        start, end = self._window()
        if start < 0:
            raise ValueError(f"--profile-step-start must be >= 0 (steps done before profiling), got {start}")
        if end <= start:
            raise ValueError(f"--profile-step-end {end} must be above --profile-step-start {start}: profiling "
                             f"starts once {start} steps are done and stops once {end} are")  # fmt: skip
        if not self.enable_profiling and (window or self.profile_freq is not None or self.profile_ranks):
            raise ValueError("[profiling] profile_step_start / profile_step_end / profile_freq / profile_ranks "
                             "need --profile ([profiling] enable_profiling = true)")  # fmt: skip

    def _window(self) -> tuple[int, int]:
        start = MEGATRON_DEFAULT_WINDOW[0] if self.profile_step_start is None else self.profile_step_start
        end = MEGATRON_DEFAULT_WINDOW[1] if self.profile_step_end is None else self.profile_step_end
        return start, end

    def check(self, steps: int, world: int) -> None:
        """ValueError for a window past the run's last step or a rank outside the world (before any process group)."""
        if not self.enable_profiling:
            return
        if self.profile_freq is None:
            start, end = self._window()
            if end > steps:
                raise ValueError(f"--profile-step-end {end} is past the run's last step {steps} (profiling starts "
                                 f"once {start} steps are done and stops once {end} are)")  # fmt: skip
        elif self.profile_freq > steps:
            raise ValueError(f"[profiling] profile_freq {self.profile_freq}: the run has {steps} steps, none traced")
        outside = [r for r in self.profile_ranks if not 0 <= r < world]
        if outside:
            raise ValueError(f"--profile-ranks {outside}: outside the world of {world} ranks (0..{world - 1})")

    def windows(self, steps: int) -> list[tuple[int, int]]:
        """The traced steps of a run of `steps` steps, as (first, last) windows, 1-based and inclusive."""
        if not self.enable_profiling:
            return []
        if self.profile_freq is not None:
            return [(s, s) for s in range(self.profile_freq, steps + 1, self.profile_freq)]
        start, end = self._window()
        return [(start + 1, end)]

    def profiles_rank(self, rank: int) -> bool:
        return self.enable_profiling and (not self.profile_ranks or rank in self.profile_ranks)


class StepProfiler:
    """Runs `torch.profiler` over the windows of `config` on this rank: the trainer calls `before_step(step)` and
    `after_step(step)` around every step (run or skipped) and `close()` at the end.

    Args:
        config: the `[profiling]` table.
        run_dir: the run directory (the traces go under `config.save_traces_folder`).
        rank: this rank; a rank `config` does not profile does nothing.
        steps: the run's last step.
    """

    def __init__(self, config: ProfilingConfig, run_dir: str | Path, rank: int, steps: int) -> None:
        self.config, self.rank = config, rank
        self.folder = Path(run_dir) / config.save_traces_folder
        self.windows = config.windows(steps) if config.profiles_rank(rank) else []
        self._pending = list(self.windows)  # not traced yet: a step a rewind runs again is not traced twice
        self.traces: list[Path] = []
        self.tables: list[tuple[tuple[int, int], str]] = []
        self._prof: profile | None = None
        self._window: tuple[int, int] | None = None
        self._step_region: record_function | None = None

    def before_step(self, step: int) -> None:
        if self._prof is None:
            for first, last in self._pending:
                if step in (first - 1, first):
                    self._pending.remove((first, last))
                    warmup = first - step  # 1: this step warms the profiler up, 0: it is traced
                    self._start((first, last), warmup)
                    break
        if self._prof is not None:
            self._step_region = record_function(STEP_REGION.format(step=step))
            self._step_region.__enter__()

    def _start(self, window: tuple[int, int], warmup: int) -> None:
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        active = window[1] - window[0] + 1
        self._window = window
        self._prof = profile(
            activities=activities,
            schedule=schedule(wait=0, warmup=warmup, active=active, repeat=1),
            on_trace_ready=self._write,
            record_shapes=True,
        )
        self._prof.start()

    def after_step(self, step: int) -> None:
        if self._prof is None:
            return
        self._end_step_region()
        self._prof.step()  # the last active step's `step()` hands the trace to `_write`
        if step >= self._window[1]:
            self._stop()

    def _end_step_region(self) -> None:
        region, self._step_region = self._step_region, None
        if region is not None:
            region.__exit__(None, None, None)

    def _stop(self) -> None:
        self._end_step_region()
        prof, self._prof = self._prof, None
        prof.stop()

    def _write(self, prof: profile) -> None:
        first, last = self._window
        folder = self.folder / WINDOW_DIR.format(step=last)
        folder.mkdir(parents=True, exist_ok=True)
        trace = folder / TRACE_FILE.format(rank=self.rank)
        prof.export_chrome_trace(str(trace))
        sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=self.config.top_operators)
        (folder / TOP_OPERATORS_FILE.format(rank=self.rank)).write_text(table + "\n")
        self.traces.append(trace)
        self.tables.append(((first, last), table))

    def close(self) -> None:
        """Stop a profiler still running (a run that ended inside a window: what was recorded is written)."""
        if self._prof is not None:
            self._stop()

    def summary(self) -> str:
        """The top-operator tables of this rank's windows and where the traces are ('' when none was taken)."""
        parts = []
        for ((first, last), table), trace in zip(self.tables, self.traces):
            steps = f"step {first}" if first == last else f"steps {first}-{last}"
            parts.append(f"rank {self.rank}, {steps}: top operators (trace: {trace})\n{table}")
        return "\n".join(parts)
