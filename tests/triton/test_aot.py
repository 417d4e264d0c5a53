"""The ahead-of-time compile check (`mtdeepep/kernels/aot.py`): every kernel of `mtdeepep.kernels` compiles for H100 /
H200 (`cuda:90`) and MI300X (`hip:gfx942`) at the production block sizes, and the kernels that synchronise ranks
through flags carry release / acquire at system scope in the machine code.

- `test_every_kernel_compiles_for_h100_and_mi300x` (slow: about a minute cold, seconds with Triton's cache in
  `build/triton-aot-cache`): the whole table, in a subprocess without `TRITON_INTERPRET`.
- `test_ordering_check_on_real_compiles` (slow, ~12 s): two fixture kernels compiled for both targets: one with a
  system-scope release signal and acquire wait passes; one that synchronises at `gpu` scope only, marked `flags`, is
  caught.
- The parsers on the instruction forms Triton 3.9 emits, and the refusal to compile under the interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported (aot compiles in a subprocess)

from mtdeepep.kernels import aot  # noqa: E402

ROOT = aot.ROOT


def _env_without_interpreter(extra_path: str = "") -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), extra_path, env.get("PYTHONPATH", "")]))
    env.setdefault("TRITON_CACHE_DIR", str(aot.DEFAULT_CACHE))
    return env


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_kernel_compiles_for_h100_and_mi300x():
    report = aot.run_in_subprocess(timeout_s=1100, jobs=2)
    results = report["results"]
    table = aot.format_table([aot.AotResult(**row) for row in results])
    print(f"\n{table}\n{len(results)} compiles in {report['seconds']:.1f} s")
    assert not report["problems"], report["problems"]
    assert results and all(row["ok"] for row in results), table
    names = {row["name"] for row in results}
    assert {(name, target) for name in names for target in aot.TARGET_NAMES} == {
        (row["name"], row["target"]) for row in results
    }
    # The casts are bit-exact only with correctly rounded arithmetic: no approximate division on either target.
    assert all(row["approx_float_ops"] == 0 for row in results if row["name"].startswith("fp8.")), table
    assert all(row["spill_bytes"] == 0 for row in results), table


FIXTURE = textwrap.dedent(
    """
    import triton
    import triton.language as tl


    @triton.jit
    def signal_then_wait_kernel(flags, data, out, rank, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        tl.store(data + offsets, offsets)
        tl.atomic_xchg(flags + rank, 1, sem="release", scope="sys")
        seen = tl.atomic_add(flags + 1 - rank, 0, sem="acquire", scope="sys")
        tl.store(out, seen)


    @triton.jit
    def device_scope_only_kernel(flags, data, out, rank, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        tl.store(data + offsets, offsets)
        tl.atomic_xchg(flags + rank, 1, sem="release", scope="gpu")
        seen = tl.atomic_add(flags + 1 - rank, 0, sem="acquire", scope="gpu")
        tl.store(out, seen)


    SIGNATURE = {"flags": "*i32", "data": "*i32", "out": "*i32", "rank": "i32", "BLOCK": "constexpr"}
    AOT_SPECS = [
        {"name": name, "fn": fn, "signature": SIGNATURE, "constexprs": {"BLOCK": 256}, "flags": True}
        for name, fn in (("good", signal_then_wait_kernel), ("gpu_scope", device_scope_only_kernel))
    ]
    # A register budget no kernel meets: the check fails it (what keeps the low-latency FP8 cast's tile small).
    AOT_SPECS.append({"name": "over_budget", "fn": signal_then_wait_kernel, "signature": SIGNATURE,
                      "constexprs": {"BLOCK": 256}, "flags": True, "max_registers": 1})
    """
)

RUN_FIXTURE = """
import dataclasses, json, sys
import aot_fixture
from mtdeepep.kernels import aot
print(json.dumps([dataclasses.asdict(aot.compile_spec(spec, target)) for spec in aot_fixture.AOT_SPECS
                  for target in aot.TARGET_NAMES]))
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ordering_check_on_real_compiles(tmp_path):
    (tmp_path / "aot_fixture.py").write_text(FIXTURE)
    done = subprocess.run(
        [sys.executable, "-c", RUN_FIXTURE], capture_output=True, text=True, cwd=tmp_path, timeout=280,
        env=_env_without_interpreter(str(tmp_path)),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(row["name"], row["target"]): row for row in json.loads(done.stdout.strip().splitlines()[-1])}
    for target in aot.TARGET_NAMES:
        good, bad = rows[("good", target)], rows[("gpu_scope", target)]
        assert good["ok"] and good["orderings"].startswith("rel 1->") and " acq 1->" in good["orderings"], good
        assert not good["orderings"].endswith("->0") and "rel 1->0" not in good["orderings"], good
        assert not bad["ok"] and "no atomic asks for release or acquire at system scope" in bad["problems"][0], bad
        over = rows[("over_budget", target)]
        assert not over["ok"] and over["problems"][-1].endswith("registers per thread, over its budget of 1"), over


def test_ptx_forms_triton_emits():
    ptx = """
        @%p1 red.global.sys.release.add.u32 [ %rd1 + 0 ], %r1;
        @%p1 ld.global.sys.acquire.b32 %r3, [ %rd2 + 0 ];
        ld.volatile.global.b32 { %r4 }, [ %rd3 + 0 ];
        @%p1 atom.global.acq_rel.sys.cas.b32 %r6, [ %rd4 + 0 ], %r5, %r1;
        @%p1 atom.global.gpu.release.exch.b32 %r8, [ %rd5 + 0 ], %r7;
    """
    # red release + the CAS's acq_rel; the acquire load + the CAS. Neither the volatile load (relaxed) nor the
    # gpu-scope exchange counts.
    assert aot.ptx_orderings(ptx) == {"release": 2, "acquire": 2}
    assert aot.ptx_orderings(
        "ld.volatile.global.b32 %r1, [%rd1];\natom.global.gpu.acquire.add.u32 %r2, [%rd2], 0;"
    ) == {
        "release": 0,
        "acquire": 0,
    }
    assert aot.ptx_orderings("fence.acq_rel.sys;") == {"release": 1, "acquire": 1}
    # Approximate arithmetic (the FP8 casts must have none).
    assert len(aot._PTX_APPROX.findall("div.full.f32 %f1, %f2, %f3;\ndiv.rn.f32 %f4, %f5, %f6;")) == 1
    assert len(aot._LLIR_APPROX.findall("%3 = fdiv afn float %1, %2\n%4 = fdiv float %1, %2")) == 1


def test_amdgcn_and_ir_forms():
    amdgcn = "\tbuffer_wbl2 sc0 sc1\n\tglobal_atomic_add v0, v1, s[2:3] sc1\n\tbuffer_inv sc0 sc1\n\tbuffer_wbl2 sc1\n"
    assert aot.amdgcn_orderings(amdgcn) == {"release": 1, "acquire": 1}  # `buffer_wbl2 sc1` is agent scope
    ttir = """
        %0 = tt.atomic_rmw add, release, sys, %flag, %c1_i32, %true : (!tt.ptr<i32>, i32, i1) -> i32
        %1 = tt.atomic_rmw add, acquire, sys, %v, %c0_i32, %true : (!tt.ptr<i32>, i32, i1) -> i32
        %2 = tt.atomic_cas acq_rel, sys, %x_4, %c0_i32, %c1_i32 : (!tt.ptr<i32>, i32, i32) -> i32
        %3 = tt.atomic_rmw exch, release, gpu, %y_6, %y, %true : (!tt.ptr<i32>, i32, i1) -> i32
    """
    assert aot.requested_orderings(ttir) == {"release": 2, "acquire": 2}
    missing = aot.ordering_problems({"release": 2, "acquire": 1}, {"release": 1, "acquire": 0}, flags=True)
    assert len(missing) == 1 and "acquire" in missing[0]


def test_refuses_to_compile_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        aot.compile_all()
