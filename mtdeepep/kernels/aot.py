"""Ahead-of-time compile of every Triton kernel of `mtdeepep.kernels` for the GPUs we ship for, without a GPU.

Each kernel module lists its kernels in `AOT_SPECS`: dicts `{"name", "fn", "signature", "constexprs", "flags"}`
(optional: `"options"`, e.g. `{"num_warps": 8}`; `"backend_constexprs"`, `{"cuda": {...}, "hip": {...}}` merged over
`constexprs` for that backend, e.g. a clock selector; `"max_registers"`: a budget of registers per thread, over which
the compile fails the check), with the production block sizes. Every spec is compiled for
`TARGETS` (H100/H200: `cuda` sm_90; MI300X: `hip` gfx942) by `triton.compile`, which needs no driver; this must run
in a process without `TRITON_INTERPRET=1` (the kernels are then JIT functions, not interpreted ones).

Memory ordering of the kernels that synchronise ranks through flags (`"flags": True`): the Triton IR says which
orderings the source asked for (`tt.atomic_rmw` / `tt.atomic_cas` with `release` / `acquire` / `acq_rel` at `sys`
scope); the machine code must carry each at system scope:

- PTX (what Triton 3.9 emits, measured): a release atomic whose result is unused becomes
  `red.global.sys.release.add`, one whose result is used `atom.global.sys.release...` (`acq_rel` for a CAS); an
  acquire `atomic_add(p, 0)` becomes the load `ld.global.sys.acquire`; `fence.{acq_rel,sc}.sys` would also do. A
  `volatile=True` load is `ld.volatile.global`: relaxed (PTX gives it `.relaxed.sys` semantics), no acquire, so a
  flag's final read must be an acquire atomic, not a volatile load.
- AMDGCN gfx942 (LLVM's memory model for GFX942): system-scope release is a `buffer_wbl2 sc0 sc1` (write back L2)
  before the atomic, system-scope acquire a `buffer_inv sc0 sc1` after it; agent (`gpu`) scope drops `sc0`.

For `cuda`, each spec is also compiled with every integer argument a constexpr 1, as Triton's JIT specializes an
argument equal to 1: a tensor method on a scalar argument (`arg.to(...)`) compiles with the declared signature but
not at such a call (`tl.cast(arg, ...)` works in both).

Results are cached by Triton's own cache (keyed by the kernel's source and its callees, the target, the options and
the Triton version) in `build/triton-aot-cache` unless `TRITON_CACHE_DIR` is set.

`python -m mtdeepep.kernels.aot [--json] [--jobs N]` prints the table (kernel, target, registers, spills, shared
memory, orderings, ok) and exits non-zero when any compile or ordering check fails.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from mtdeepep import kernels as package

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CACHE = ROOT / "build" / "triton-aot-cache"
TARGET_NAMES = ("cuda:90", "hip:gfx942")
SPEC_KEYS = {"name", "fn", "signature", "constexprs", "flags"}
OPTIONAL_SPEC_KEYS = {"options", "backend_constexprs", "max_registers"}


def _target(name: str):
    backend, arch = name.split(":")
    return GPUTarget(backend, int(arch) if backend == "cuda" else arch, 32 if backend == "cuda" else 64)


# ---- memory-ordering checks ----

_TTIR_ATOMIC = re.compile(r"tt\.atomic_(?:rmw\s+\w+\s*,|cas)\s*(\w+)\s*,\s*(\w+)")


def requested_orderings(ttir: str) -> dict[str, int]:
    """How many atomics of the Triton IR ask for a release (`release`, `acq_rel`) and an acquire (`acquire`,
    `acq_rel`) at system scope."""
    counts = {"release": 0, "acquire": 0}
    for sem, scope in _TTIR_ATOMIC.findall(ttir):
        if scope != "sys":
            continue
        if sem in ("release", "acq_rel"):
            counts["release"] += 1
        if sem in ("acquire", "acq_rel"):
            counts["acquire"] += 1
    return counts


def ptx_orderings(ptx: str) -> dict[str, int]:
    """System-scope release and acquire instructions of a PTX text (see the module docstring)."""
    counts = {"release": 0, "acquire": 0}
    for line in ptx.splitlines():
        words = line.strip().split()
        if not words:
            continue
        opcode = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        parts = opcode.rstrip(";").split(".")
        if "sys" not in parts:
            continue
        kind, qualifiers = parts[0], set(parts[1:])
        if kind in ("atom", "red", "st", "fence") and qualifiers & {"release", "acq_rel", "sc"}:
            counts["release"] += 1
        if kind in ("atom", "ld", "fence") and qualifiers & {"acquire", "acq_rel", "sc"}:
            counts["acquire"] += 1
    return counts


def amdgcn_orderings(amdgcn: str) -> dict[str, int]:
    """System-scope release (`buffer_wbl2 sc0 sc1`) and acquire (`buffer_inv sc0 sc1`) of a gfx942 listing."""
    return {
        "release": len(re.findall(r"^\s*buffer_wbl2\s+sc0\s+sc1\b", amdgcn, re.M)),
        "acquire": len(re.findall(r"^\s*buffer_inv\s+sc0\s+sc1\b", amdgcn, re.M)),
    }


def ordering_problems(requested: dict[str, int], emitted: dict[str, int], flags: bool) -> list[str]:
    """What the machine code lacks of what the IR asked for; a flags kernel must ask for some system-scope order."""
    problems = [
        f"the source asks for {requested[kind]} system-scope {kind} atomics; the machine code has no such {kind}"
        for kind in ("release", "acquire")
        if requested[kind] and not emitted[kind]
    ]
    if flags and not (requested["release"] or requested["acquire"]):
        problems.append("marked flags=True but no atomic asks for release or acquire at system scope")
    return problems


# ---- resources ----

# LLVM IR (the AMD path): a division or transcendental allowed to be approximate (fast-math flags).
_LLIR_APPROX = re.compile(r"= (?:fdiv|call) (?:nnan |ninf |nsz |contract |reassoc )*(?:fast|afn|arcp)\b")
_PTX_APPROX = re.compile(
    r"\b(?:div\.full\.f32|div\.approx\.\w+|rcp\.approx\.\w+|(?:ex2|lg2|sin|cos|sqrt|rsqrt)\.approx)"
)


def _cuda_resources(cubin: bytes) -> dict[str, int]:
    """Registers, spill (local) bytes and static shared memory of a cubin, by cuobjdump (shipped with Triton)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", file.name], capture_output=True, text=True).stdout
    found = dict(re.findall(r"\b(REG|LOCAL|SHARED):(\d+)", text))
    return {"registers": int(found.get("REG", -1)), "spill_bytes": int(found.get("LOCAL", -1))}


def _hip_resources(amdgcn: str) -> dict[str, int]:
    def number(key: str) -> int:
        match = re.search(rf"^\s*\.{key}:\s*(\d+)", amdgcn, re.M)
        return int(match.group(1)) if match else -1

    return {"registers": number("vgpr_count"), "sgprs": number("sgpr_count"), "spill_bytes": number("vgpr_spill_count")}


# ---- compile ----


@dataclass
class AotResult:
    """One kernel compiled for one target. `registers`: per thread (VGPRs on AMD); `shared`: bytes of shared memory
    (LDS) the launch needs; `orderings`: system-scope release / acquire, asked by the IR -> found in the code."""

    name: str
    target: str
    ok: bool
    seconds: float
    registers: int = -1
    spill_bytes: int = -1
    shared: int = -1
    orderings: str = ""
    approx_float_ops: int = (
        0  # approximate divisions / reciprocals / transcendentals (PTX; fast-math flags in AMD's IR)
    )
    problems: list[str] = field(default_factory=list)


def spec_modules() -> list[str]:
    """The kernel modules of this package (every module but this one)."""
    return [
        f"{package.__name__}.{info.name}"
        for info in pkgutil.iter_modules(package.__path__)
        if info.name != "aot" and not info.ispkg
    ]


def load_specs() -> tuple[list[dict], list[str]]:
    """Every module's `AOT_SPECS` (checked), and the problems: a module without specs, a malformed spec, a module
    kernel (a JIT function named `*_kernel`) that no spec compiles."""
    specs: list[dict] = []
    problems: list[str] = []
    for module_name in spec_modules():
        module = importlib.import_module(module_name)
        kernels = {
            name: value
            for name, value in vars(module).items()
            if isinstance(value, JITFunction) and name.endswith("_kernel") and value.__module__ == module_name
        }
        module_specs = getattr(module, "AOT_SPECS", None)
        if module_specs is None:
            if kernels:
                problems.append(f"{module_name}: no AOT_SPECS for its kernels {sorted(kernels)}")
            continue
        for spec in module_specs:
            missing, unknown = SPEC_KEYS - spec.keys(), spec.keys() - SPEC_KEYS - OPTIONAL_SPEC_KEYS
            if missing or unknown or not isinstance(spec["fn"], JITFunction):
                problems.append(
                    f"{module_name}: malformed spec {spec.get('name')!r} (missing {missing}, unknown {unknown})"
                )
                continue
            specs.append(spec)
        compiled = {id(spec["fn"]) for spec in module_specs}
        uncovered = sorted(name for name, fn in kernels.items() if id(fn) not in compiled)
        if uncovered:
            problems.append(f"{module_name}: kernels without an AOT spec: {uncovered}")
    names = [spec["name"] for spec in specs]
    problems += [f"spec name {name!r} used twice" for name in sorted({n for n in names if names.count(n) > 1})]
    return specs, problems


def compile_spec(spec: dict, target_name: str) -> AotResult:
    """Compiles one spec for one target and checks its memory ordering (never raises: a failure is a result)."""
    backend = target_name.split(":")[0]
    constexprs = {**spec["constexprs"], **spec.get("backend_constexprs", {}).get(backend, {})}
    begin = time.perf_counter()
    try:
        source = ASTSource(fn=spec["fn"], signature=spec["signature"], constexprs=constexprs)
        kernel = triton.compile(source, target=_target(target_name), options=spec.get("options", {}))
    except Exception as error:  # a compile error is this row's result
        message = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
        return AotResult(spec["name"], target_name, False, time.perf_counter() - begin, problems=[message])
    seconds = time.perf_counter() - begin
    requested = requested_orderings(kernel.asm["ttir"])
    if backend == "cuda":
        resources = _cuda_resources(kernel.asm["cubin"])
        emitted = ptx_orderings(kernel.asm["ptx"])
        approx = len(_PTX_APPROX.findall(kernel.asm["ptx"]))
    else:
        resources = _hip_resources(kernel.asm["amdgcn"])
        emitted = amdgcn_orderings(kernel.asm["amdgcn"])
        approx = len(_LLIR_APPROX.findall(kernel.asm["llir"]))
    problems = ordering_problems(requested, emitted, spec["flags"])
    if backend == "cuda":
        problems += _specialization_problems(spec, constexprs, target_name)
    budget = spec.get("max_registers")
    if budget is not None and resources["registers"] > budget:
        problems.append(f"{resources['registers']} registers per thread, over its budget of {budget}")
    orderings = (
        f"rel {requested['release']}->{emitted['release']} acq {requested['acquire']}->{emitted['acquire']}"
        if spec["flags"] or requested["release"] or requested["acquire"]
        else "-"
    )
    return AotResult(
        spec["name"], target_name, not problems, seconds, resources["registers"], resources["spill_bytes"],
        int(kernel.metadata.shared), orderings, approx, problems,
    )  # fmt: skip


_INTEGER_TYPES = {"i1", "i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64"}


def _specialization_problems(spec: dict, constexprs: dict, target_name: str) -> list[str]:
    """Triton's JIT turns an integer argument equal to 1 into a constexpr (a Python int), so `arg.to(...)` or any
    other tensor method on a scalar argument compiles here and fails on the GPU at the first call with a 1 (seen on
    the H200, 2026-11-28: `signal_flag(..., value)` with `value.to(tl.int64)`). The spec compiled again with every
    integer argument a constexpr 1 finds such code without a GPU."""
    integers = [name for name, kind in spec["signature"].items() if kind in _INTEGER_TYPES]
    if not integers:
        return []
    signature = {name: "constexpr" if name in integers else kind for name, kind in spec["signature"].items()}
    source = ASTSource(fn=spec["fn"], signature=signature, constexprs={**constexprs, **dict.fromkeys(integers, 1)})
    try:
        triton.compile(source, target=_target(target_name), options=spec.get("options", {}))
    except Exception as error:  # a compile error is this row's problem
        lines = str(error).strip().splitlines()
        return [f"with its integer arguments equal to 1 (as the JIT specializes them): {type(error).__name__}: "
                f"{' | '.join(lines[-3:]) if lines else ''}"]  # fmt: skip
    return []


def _compile_by_index(job: tuple[int, str]) -> AotResult:
    specs, _ = load_specs()
    return compile_spec(specs[job[0]], job[1])


def compile_all(targets: tuple[str, ...] = TARGET_NAMES, jobs: int = 1) -> tuple[list[AotResult], list[str]]:
    """Every spec for every target (`jobs` processes), and the spec problems of `load_specs`."""
    _require_compiled_mode()
    specs, problems = load_specs()
    work = [(index, target) for index in range(len(specs)) for target in targets]
    if jobs > 1 and len(work) > 1:
        with ProcessPoolExecutor(jobs) as pool:
            results = list(pool.map(_compile_by_index, work))
    else:
        results = [compile_spec(specs[index], target) for index, target in work]
    return results, problems


def _require_compiled_mode() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError(
            "mtdeepep.kernels.aot: TRITON_INTERPRET is set; the ahead-of-time compile needs the kernels as JIT "
            "functions: run it in a process without TRITON_INTERPRET (run_in_subprocess does)"
        )


def run_in_subprocess(timeout_s: float = 600.0, jobs: int = 1) -> dict:
    """`compile_all` in a fresh process without `TRITON_INTERPRET` (from a test session that has it set): the parsed
    `--json` output, `{"results": [...], "problems": [...], "seconds": float}`."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "mtdeepep.kernels.aot", "--json", "--jobs", str(jobs)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout_s, cwd=ROOT)
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise RuntimeError(f"mtdeepep.kernels.aot failed (exit {done.returncode}):\n{done.stderr[-4000:]}") from None


def format_table(results: list[AotResult]) -> str:
    header = ("kernel", "target", "regs", "spill", "shared", "orderings", "compile s", "ok")
    rows = [
        (r.name, r.target, str(r.registers), str(r.spill_bytes), str(r.shared), r.orderings, f"{r.seconds:.2f}",
         "ok" if r.ok else "FAIL: " + "; ".join(r.problems))
        for r in results
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths)) + "  " + row[-1]
        for row in [header, *rows]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtdeepep.kernels.aot", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    parser.add_argument("--jobs", type=int, default=1, help="compile processes (default 1)")
    parser.add_argument("--target", action="append", choices=TARGET_NAMES, help="only this target (repeatable)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_CACHE_DIR", str(DEFAULT_CACHE))
    begin = time.perf_counter()
    results, problems = compile_all(tuple(args.target or TARGET_NAMES), args.jobs)
    seconds = time.perf_counter() - begin
    ok = not problems and all(result.ok for result in results)
    if args.json:
        print(json.dumps({"results": [asdict(r) for r in results], "problems": problems, "seconds": seconds}))
    else:
        print(format_table(results))
        for problem in problems:
            print(f"PROBLEM: {problem}")
        print(f"{len(results)} compiles in {seconds:.1f} s: {'all ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
