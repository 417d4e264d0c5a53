"""Every wait in a Triton kernel is bounded and, when it runs out, names who did not arrive.

- `test_every_spin_loop_is_a_bounded_helper_of_sync`: an AST scan of every `@triton.jit` function of
  `mtdeepep/kernels/*.py`. A `while` loop (the only way a Triton kernel can spin: `for` loops have static trip
  counts) may appear only in `sync.py`, inside a helper that takes a bound (`bound` / `max_spins`), and the loop must
  end on it: its condition, or an `if` in its body that then assigns a variable of the condition, compares a
  quantity the loop advances (spins, elapsed clock) with the bound.
- The scan catches what it should: fixture kernels with an unbounded spin (outside sync.py, and in sync.py without a
  bound or with a bound that does not end the loop) are flagged.
- `test_a_wait_that_runs_out_reports_kind_phase_peer_rank`: sync.py's `wait_all_kernel` on flags that never arrive
  (the interpreter, one process standing in for three ranks' regions) records (timeout, phase, peer, rank) in the
  status word, poisons the third rank, and `StatusWord.check` raises `CommTimeoutError` naming both ranks.
"""

from __future__ import annotations

import ast
import os
import textwrap
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported: the kernels run on CPU tensors

from mtdeepep import _C  # noqa: E402

KERNELS = Path(__file__).resolve().parents[2] / "mtdeepep" / "kernels"
WAIT_MODULE = "sync.py"  # the one home of spin loops


def _is_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (isinstance(target, ast.Attribute) and target.attr == "jit") or (
        isinstance(target, ast.Name) and target.id == "jit"
    )


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _assigned(nodes: list[ast.stmt]) -> set[str]:
    """Names assigned (plainly or augmented) anywhere in `nodes`."""
    names: set[str] = set()
    for statement in nodes:
        for node in ast.walk(statement):
            if isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return names


BOUND_NAMES = {"bound", "max_spins"}  # the parameter that carries a wait's limit (spins or clock ticks)


def _compares_advanced_with_bound(test: ast.expr, advanced: set[str]) -> bool:
    """`test` holds a comparison of a quantity the loop advances (spins, elapsed clock) with a bound parameter."""
    for node in ast.walk(test):
        if isinstance(node, ast.Compare):
            names = [o.id for o in (node.left, *node.comparators) if isinstance(o, ast.Name)]
            if any(n in BOUND_NAMES for n in names) and any(n not in BOUND_NAMES and n in advanced for n in names):
                return True
    return False


def _ends_on_bound(function: ast.FunctionDef, loop: ast.While) -> bool:
    """The loop ends on a bound parameter of its function: either its condition compares a quantity the loop advances
    with the bound, or an `if` in its body does and then assigns a name of the loop's condition (`stopped = 1`)."""
    if not BOUND_NAMES & {a.arg for a in function.args.args}:
        return False
    condition, advanced = _names(loop.test), _assigned(loop.body)
    if _compares_advanced_with_bound(loop.test, advanced):
        return True
    return any(
        isinstance(node, ast.If)
        and _compares_advanced_with_bound(node.test, advanced)
        and bool(_assigned(node.body) & condition)
        for node in ast.walk(loop)
    )


def unbounded_spins(source: str, filename: str) -> list[str]:
    """`file:line function` of every `while` loop of a `@triton.jit` function that is not a bounded helper of
    sync.py, with the reason."""
    problems = []
    for function in ast.walk(ast.parse(source)):
        if not (isinstance(function, ast.FunctionDef) and any(_is_jit(d) for d in function.decorator_list)):
            continue
        for loop in (n for n in ast.walk(function) if isinstance(n, ast.While)):
            where = f"{filename}:{loop.lineno} {function.name}"
            if Path(filename).name != WAIT_MODULE:
                problems.append(f"{where}: spins outside {WAIT_MODULE} (wait through its bounded helpers)")
            elif not _ends_on_bound(function, loop):
                problems.append(f"{where}: no exit on a `bound` the loop advances towards")
    return problems


def test_every_spin_loop_is_a_bounded_helper_of_sync():
    files = sorted(KERNELS.glob("*.py"))
    assert (KERNELS / WAIT_MODULE).exists(), "sync.py, the home of the bounded waits, is missing"
    problems = [p for path in files for p in unbounded_spins(path.read_text(), str(path.relative_to(KERNELS)))]
    assert not problems, "\n".join(problems)
    # The scan sees the waits it vouches for (a scan that finds no loop would pass anything).
    loops = [
        n for n in ast.walk(ast.parse((KERNELS / WAIT_MODULE).read_text())) if isinstance(n, ast.While)
    ]  # fmt: skip
    assert loops, "sync.py has no wait loop: the scan would check nothing"


UNBOUNDED = textwrap.dedent(
    """
    import triton
    import triton.language as tl


    @triton.jit
    def receive_kernel(flag, out):
        while tl.load(flag, volatile=True) == 0:
            pass
        tl.store(out, 1)
    """
)

BOUND_NEVER_ENDS_THE_LOOP = textwrap.dedent(
    """
    import triton
    import triton.language as tl


    @triton.jit
    def wait_flag(flag, target, bound, status):
        value = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
        spins = 0
        while value < target:
            spins += 1
            if spins > bound:
                tl.store(status, 1)  # records the timeout, but keeps spinning
            value = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    """
)

BOUNDED = BOUND_NEVER_ENDS_THE_LOOP.replace(
    "while value < target:", "while (value < target) & (stopped == 0):"
).replace("tl.store(status, 1)  # records the timeout, but keeps spinning", "stopped = 1")


BOUND_IN_CONDITION = textwrap.dedent(
    """
    import triton
    import triton.language as tl


    @triton.jit
    def poll_flag(flag, target, max_spins):
        value = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
        spins = 0
        while (value < target) & (spins < max_spins):
            value = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            spins += 1
    """
)


def test_the_scan_flags_unbounded_spins():
    assert "spins outside sync.py" in unbounded_spins(UNBOUNDED, "mtdeepep/kernels/intranode.py")[0]
    assert "no exit on a `bound`" in unbounded_spins(UNBOUNDED, "mtdeepep/kernels/sync.py")[0]
    assert "no exit on a `bound`" in unbounded_spins(BOUND_NEVER_ENDS_THE_LOOP, "mtdeepep/kernels/sync.py")[0]
    assert unbounded_spins(BOUNDED, "mtdeepep/kernels/sync.py") == []
    assert unbounded_spins(BOUNDED, "mtdeepep/kernels/low_latency.py")  # bounded, but outside sync.py
    assert unbounded_spins(BOUND_IN_CONDITION, "mtdeepep/kernels/sync.py") == []
    # A limit that never moves is no bound: the loop advances `value`, not `spins`, towards `max_spins`.
    frozen = BOUND_IN_CONDITION.replace("        spins += 1\n", "")
    assert frozen != BOUND_IN_CONDITION
    assert "no exit on a `bound`" in unbounded_spins(frozen, "mtdeepep/kernels/sync.py")[0]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the ranks' regions are CPU tensors")
def test_a_wait_that_runs_out_reports_kind_phase_peer_rank():
    from mtdeepep.kernels import sync

    num_ranks, rank, value = 3, 1, 1
    # Each rank's region: its flags (one int64 per source rank), all zero: nobody ever signals.
    regions = [torch.zeros(num_ranks, dtype=torch.int64) for _ in range(num_ranks)]
    poison = [torch.zeros(1, dtype=torch.int64) for _ in range(num_ranks)]
    region_table = torch.tensor([r.data_ptr() for r in regions], dtype=torch.int64)
    poison_table = torch.tensor([p.data_ptr() for p in poison], dtype=torch.int64)
    status = sync.StatusWord(torch.device("cpu"))
    phase = sync.PHASE_DISPATCH_RECEIVE
    sync.wait_all_kernel[(1,)](
        region_table, poison_table, status.words, 0, value, 20, phase, rank, num_ranks, CLOCK=sync.CLOCK_SPINS
    )
    code = int(status.words[0])
    # The first flag waited for is rank 0's: it never comes.
    assert sync.decode_error(code) == (sync.KIND_TIMEOUT, phase, 0, rank)
    # Rank 2 (neither this rank nor the one that did not arrive) is told, with this rank's word.
    assert int(poison[2]) == code and int(poison[0]) == 0 and int(poison[1]) == 0
    with pytest.raises(_C.CommTimeoutError, match=r"rank 1 timed out waiting for rank 0 .*dispatch: rows received"):
        status.check()
