"""One named layout, in the notation the planner prints (`Candidate.name`), parsed back into a `Candidate` and
checked against the trainer's rules: `plan.py --layout "tp1 pp2 ep4 dp4 1f1b zero1"` prices it instead of searching.

Notation (space-separated, any order): `tpN ppN epN dpN` (dp required; tp, pp, ep default to 1), `etpN`, a pipeline
schedule when pp > 1 (`1f1b` (the default), `zbh1`, `dualpipev`, `interleaved-vN`), a recompute setting (`sel`,
`sel+`, `full`; none by default), an FP8 recipe (`fp8b` block-wise, `fp8d` delayed) and `zero1`.
"""

from __future__ import annotations

import re

from moe.trainer.models.deepseek_v3.model_config import DeepseekV3Config
from moe.trainer.plan.devices import DeviceSpec
from moe.trainer.plan.space import REASONS, Candidate, Workload, rejection_reason

_SIZES = ("tp", "pp", "ep", "dp", "etp")
_SCHEDULES = {"1f1b": ("1f1b", 1), "zbh1": ("zbh1", 1), "dualpipev": ("dualpipev", 2)}
_RECOMPUTE = {"sel": "selective", "sel+": "selective+", "full": "full"}
_FP8 = {"fp8b": "blockwise", "fp8d": "delayed"}


def parse_layout(text: str) -> Candidate:
    """The `Candidate` named by `text` (see the module docstring). ValueError naming the bad word or conflict."""
    sizes: dict[str, int] = {}
    schedule: tuple[str, int] | None = None
    recompute, fp8, zero1 = "none", "none", False
    words = text.replace(",", " ").split()
    if not words:
        raise ValueError("empty layout: expected e.g. 'tp1 pp2 ep4 dp4 1f1b'")

    def once(kind: str, current, value):
        if current not in (None, "none", False):
            raise ValueError(f"layout {text!r}: more than one {kind}")
        return value

    for word in words:
        w = word.lower()
        size = re.fullmatch(r"(etp|tp|pp|ep|dp)(\d+)", w)
        interleaved = re.fullmatch(r"interleaved-v(\d+)", w)
        if size:
            key, value = size.group(1), int(size.group(2))
            if key in sizes:
                raise ValueError(f"layout {text!r}: {key} given twice")
            if value < 1:
                raise ValueError(f"layout {text!r}: {key} must be >= 1, got {value}")
            sizes[key] = value
        elif w in _SCHEDULES:
            schedule = once("pipeline schedule", schedule, _SCHEDULES[w])
        elif interleaved:
            vpp = int(interleaved.group(1))
            if vpp < 2:
                raise ValueError(f"layout {text!r}: interleaved needs >= 2 virtual stages per rank, got {vpp}")
            schedule = once("pipeline schedule", schedule, ("interleaved", vpp))
        elif w in _RECOMPUTE:
            recompute = once("recompute setting", recompute, _RECOMPUTE[w])
        elif w in _FP8:
            fp8 = once("FP8 recipe", fp8, _FP8[w])
        elif w == "zero1":
            zero1 = once("zero1", zero1, True)
        else:
            raise ValueError(
                f"layout {text!r}: unknown word {word!r} (expected tpN ppN epN dpN etpN, 1f1b / zbh1 / dualpipev / "
                "interleaved-vN, sel / sel+ / full, fp8b / fp8d, zero1)"
            )
    if "dp" not in sizes:
        raise ValueError(f"layout {text!r}: dpN is required (the world size is tp x pp x dp)")
    tp, pp, ep, dp, etp = (sizes.get(k, 1) for k in _SIZES)
    if pp == 1 and schedule is not None:
        raise ValueError(f"layout {text!r}: a pipeline schedule needs pp > 1")
    name, vpp = ("none", 1) if pp == 1 else (schedule or ("1f1b", 1))
    return Candidate(tp * pp * dp, tp, pp, ep, etp, name, vpp, recompute, fp8, zero1)


def check_layout(cand: Candidate, config: DeepseekV3Config, work: Workload, spec: DeviceSpec) -> None:
    """ValueError with the rule's text when train.py (or the device) would refuse `cand`; memory is not checked
    (the estimate reports it against the device's capacity)."""
    reason = rejection_reason(cand, config, work, spec)
    if reason is not None:
        raise ValueError(f"layout {cand.name()!r} is rejected: {REASONS[reason]}")
