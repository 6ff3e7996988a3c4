"""Build a program's generated kernels for a GPU on a machine without one.

    TRITON_INTERPRET=0 python3 tests/gpu_compile.py [--dtypes bfloat16,float32] NAME...

NAME: a program of test_differential.CORPUS, grad-NAME: the backward program that
autograd runs (compiler.grad(..., saved=True)) of test_grad.CORPUS's NAME, or
recomputed-NAME: its backward that recomputes the forward's statistics (saved=False).  For each
program, in each dtype (bfloat16 and float32 unless --dtypes says) at test_differential's
large GPU sizes: the
module the backend would run on a Hopper GPU (132 SMs: splits as there), its kernels'
launches recorded from the generated launcher (nothing runs), then every launch and
every autotuning candidate compiled by Triton's own compiler for sm_90 (the frontend,
the GPU passes, ptxas) with the specialisation Triton's launcher would give those
arguments.  One JSON line per compiled candidate: program, dtype, launch (its place in
the launcher), kernel, candidate, shared memory bytes, or the error.  Triton's interpreter must be off in this process
(library functions such as tl.cdiv are compiled, not interpreted): the backend turns
it on for a machine without CUDA unless TRITON_INTERPRET is already set."""
from __future__ import annotations

import json
import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction, create_function_from_signature

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import compiler  # noqa: E402
from compiler.backend.triton.cache import load  # noqa: E402
from compiler.random_inputs import random_inputs  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
H100_SMS = 132
H100_L2 = 50 << 20


def recorded(module, t: dict, extents: dict) -> list[tuple[object, tuple, dict]]:
    """(kernel, positional arguments, keyword arguments) of every launch a loaded
    generated module's launcher makes for the tensors `t`, in order, without running any."""
    calls = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((self.kernel, args, kwargs))

    kernels = {name: v for name, v in vars(module).items() if isinstance(v, (Autotuner, JITFunction))}
    for name, kernel in kernels.items():
        setattr(module, name, Recorder(kernel))
    try:
        module.launch(t, extents, torch.device("cpu"))
    finally:             # the kernels' globals must be the kernels again (a module is shared by its loads)
        for name, kernel in kernels.items():
            setattr(module, name, kernel)
    return calls


def launches(program: compiler.Program, inputs: dict) -> list[tuple[object, tuple, dict]]:
    """`recorded` launches of the module a Hopper GPU would run for `inputs` (CPU tensors);
    a kernel in the Hopper form (compiler/backend/triton/hopper.py) is followed by its `tl`
    fallback, the launch the launcher makes where TMA cannot read the operands."""
    backend = program.backend
    binding = program.binder(inputs)
    source = backend.source_for(binding, sm_count=H100_SMS, l2_bytes=H100_L2, arch=HOPPER.arch)
    module = load(source, "gpu compile check", interpret=False)
    extents = backend._extents(binding)
    t = dict(binding.values)
    for name, shape, dtype in backend._output_specs(binding):
        t[name] = torch.empty(shape, dtype=dtype)
    if hasattr(module, "scratch"):
        t.update(module.scratch(extents, torch.device("cpu")))
    calls = recorded(module, t, extents)
    if hasattr(module, "_tma_ready"):
        ready = module._tma_ready
        module._tma_ready = lambda *views: False
        try:
            fallback = recorded(module, t, extents)
        finally:
            module._tma_ready = ready
        seen = {id(kernel) for kernel, _, _ in calls}
        calls += [call for call in fallback if id(call[0]) not in seen]
    return calls


def build(fn: JITFunction, args: tuple, kwargs: dict, target=HOPPER):
    """Triton's compiled kernel of one launch of `fn` for `target`, as its launcher
    would specialise these arguments."""
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    source = (GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource)(fn, signature, constexprs, attrs)
    return triton.compile(source, target=target, options=options.__dict__)


def check(name: str, program: compiler.Program, dtype: torch.dtype, sizes: dict,
          suffix: str = "") -> list[dict]:
    """Rows for every launch (of a kernel whose name ends in `suffix`) and candidate."""
    raw = random_inputs(program.checked, sizes, dtype=torch.float64)
    # a backward's saved statistics are float32 beside 16-bit inputs, as the saving forward stores them
    inputs = {k: v.to(torch.float32 if k in program.statistic_inputs else dtype)
              if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in raw.items()}
    rows = []
    for launch, (kernel, args, kwargs) in enumerate(launches(program, inputs)):
        candidates = kernel.configs if isinstance(kernel, Autotuner) else [None]
        fn = kernel.fn if isinstance(kernel, Autotuner) else kernel
        if not fn.__name__.endswith(suffix):
            continue
        for config in candidates:
            row = {"program": name, "dtype": str(dtype), "launch": launch, "kernel": fn.__name__,
                   "candidate": None if config is None else str(config)}
            try:
                compiled = build(fn, args, {**kwargs, **(config.all_kwargs() if config else {})})
                row["shared"] = compiled.metadata.shared
            except Exception as e:  # noqa: BLE001 -- reported per candidate, judged by the test
                row["error"] = f"{type(e).__name__}: {str(e)[-1200:]}"
            rows.append(row)
    return rows


def program_of(name: str) -> compiler.Program:
    from test_differential import CORPUS
    from test_grad import CORPUS as GRADIENTS
    for prefix, saved in (("grad-", True), ("recomputed-", False)):
        if name.startswith(prefix):
            source, _, _, wrt = GRADIENTS[name.removeprefix(prefix)]
            return compiler.grad(source, wrt=wrt, backend="triton", saved=saved)
    return compiler.compile(CORPUS[name], backend="triton")


def main(argv: list[str]) -> None:
    from test_differential import case_of, gpu_size_sets
    dtypes = ["bfloat16", "float32"]
    if argv[:1] == ["--dtypes"]:
        dtypes, argv = argv[1].split(","), argv[2:]
    for name in argv:
        program = program_of(name)
        case = case_of(program.text)
        sizes = case.extents(gpu_size_sets(case)["large"])
        for dtype in (getattr(torch, d) for d in dtypes):
            for row in check(name, program, dtype, sizes):
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
