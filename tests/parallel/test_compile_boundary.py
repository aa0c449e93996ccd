"""Functions marked to run eagerly under `torch.compile`, without importing the compiler in
processes that never compile (every launch's workers import the trainer: the compiler's
import alone is over a second of CPU each)."""

from __future__ import annotations

import subprocess
import sys

import torch

from nanotron_parallel.compile_boundary import eager_under_compile, prepare_compile

WORKER_IMPORTS = (
    "import nanotron_train.__main__, nanotron_train.trainer, nanotron_train.launch, "
    "nanotron_models.moe, nanotron_parallel.context_parallel"
)


def test_a_worker_never_imports_the_compiler():
    code = f"import sys; {WORKER_IMPORTS}; print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout[:500]


@eager_under_compile
def _host_side(x: torch.Tensor, seen: list) -> torch.Tensor:
    seen.append(x.shape[0])  # a Python side effect the compiler must not trace into a graph
    return x * 2


class _Holder:
    @eager_under_compile
    def scale(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def test_marked_functions_break_the_graph_once_prepared():
    seen: list = []
    x = torch.arange(4.0)
    assert torch.equal(_host_side(x, seen), x * 2) and seen == [4]  # eager: plain call
    assert torch.equal(_Holder().scale(x), x + 1)  # a method binds as before

    def f(t: torch.Tensor) -> torch.Tensor:
        return _host_side(t.sin(), seen).cos()

    holder = _Holder()

    def g(t: torch.Tensor) -> torch.Tensor:
        return holder.scale(t.sin()).cos()

    prepare_compile()
    prepare_compile()  # idempotent
    for fn, name in ((f, "_host_side"), (g, "scale")):
        torch._dynamo.reset()
        explained = torch._dynamo.explain(fn)(x)
        reasons = [r.reason for r in explained.break_reasons]
        assert explained.graph_count == 2, reasons  # the compiled parts before and after it
        assert any("disable()`d function" in r and name in r for r in reasons), reasons
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="eager")
    seen.clear()
    assert torch.allclose(compiled(x), f(x))
    assert seen == [4, 4]  # the marked function ran for real, compiled and eager
