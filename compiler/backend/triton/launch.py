"""The hot path of a compiled kernel launch.

`kernel[grid](*args, **constexprs)` goes through Triton's autotuner and JIT
binder on every call: they re-derive the specialisation of every argument
(pointer alignment, integers equal to 1 or divisible by 16), look the config
and the compiled kernel up and evaluate the grid, about 40 us of host time per
launch on an H100 host, several times what the kernel itself takes for small
inputs.  `DirectLaunch` wraps a kernel of a loaded module: the first launch of
a kind takes that path (tuning and compiling as needed), then keeps the
compiled kernel, its full argument tail (the tuned constexprs) and its grid
under a guard that determines everything the binder would derive: each
tensor's dtype and 16-byte alignment, each integer's value, the current device.
A later launch with the same guard calls the compiled kernel directly.

Only for compiled kernels on Triton versions with `triton.knobs` (3.4 and
later, whose `CompiledKernel.run` takes the launch hooks and every bound
argument); the interpreter and older versions keep the ordinary path."""
from __future__ import annotations

import operator
import os
from concurrent.futures import ThreadPoolExecutor

import torch


def direct_launch_supported() -> bool:
    try:
        import triton.knobs  # noqa: F401
    except ImportError:
        return False
    return True


def guard_of(args: tuple, tensors: tuple[int, ...], integers) -> tuple:
    """What Triton's binder specialises on, for the arguments einfold passes: the
    16-byte alignment of the tensors at positions `tensors`, and the integers
    (extents and strides; `integers` picks them out) by value, stricter than the
    binder's classes.  Dtypes are fixed per generated module (its cache key holds
    the input dtypes), floats are not specialised on."""
    return tuple(args[i].data_ptr() % 16 == 0 for i in tensors), integers(args)


class DirectLaunch:
    """`kernel[grid](*args, **constexprs)` with Triton's per-call binding done once
    per guard (see the module docstring).  `kernel` is a JITFunction or an
    Autotuner over one."""

    def __init__(self, kernel):
        from triton import knobs
        from triton.runtime.driver import driver
        self.kernel = kernel
        self.tuned = hasattr(kernel, "configs")          # an Autotuner (a JITFunction's fn is its Python function)
        self.jit = kernel.fn if self.tuned else kernel
        self.bound: dict[tuple, tuple] = {}
        self.positions = None   # (tensor positions, integer picker): a launch site passes fixed kinds
        # resolved once: `driver.active` is a lazy proxy, each attribute a lookup through it
        self.hooks = knobs.runtime
        self.current_device = driver.active.get_current_device
        self.current_stream = driver.active.get_current_stream

    def __getitem__(self, grid):
        return lambda *args, **constexprs: self.launch(grid, args, constexprs)

    def launch(self, grid, args: tuple, constexprs: dict) -> None:
        if self.positions is None:
            self.positions = positions_of(args)
        device = self.current_device()
        key = (device, guard_of(args, *self.positions))
        found = self.bound.get(key)
        if found is None:
            if self.tuned:
                self.compile_candidates(grid, args, constexprs)
            self.kernel[grid](*args, **constexprs)        # tunes and compiles where needed
            self.bound[key] = self.bind(grid, args, constexprs)
            return
        compiled, grid3, tail = found
        stream = self.current_stream(device)
        full = (*args, *tail)
        enter, leave = self.hooks.launch_enter_hook, self.hooks.launch_exit_hook
        if hooked(enter) or hooked(leave):
            compiled.run(*grid3, stream, compiled.function, compiled.packed_metadata,
                         compiled.launch_metadata(grid3, stream, *full), enter, leave, *full)
        else:       # no profiler's hooks: no launch metadata to build (a dict per launch), none to call
            compiled.run(*grid3, stream, compiled.function, compiled.packed_metadata, None, None, None, *full)

    def compile_candidates(self, grid, args: tuple, constexprs: dict) -> None:
        """Compile every autotune candidate for these arguments at once, so that the
        autotuner only times them: Triton's AsyncCompileMode over a thread pool (the
        MLIR passes and ptxas run outside the GIL).  One after another, eight
        candidates were most of an attention variant's first call.  Candidates that
        fail to compile are left to the autotuner, which skips them."""
        import triton
        if not hasattr(triton, "AsyncCompileMode") or len(self.kernel.configs) < 2:
            return
        workers = min(len(self.kernel.configs), os.cpu_count() or 1)
        with ThreadPoolExecutor(workers) as pool, triton.AsyncCompileMode(pool, ignore_errors=True):
            for config in self.kernel.configs:
                options = {**constexprs, **config.all_kwargs()}
                self.jit.warmup(*args, grid=self.grid3(grid, args, options)[0], **options)

    def grid3(self, grid, args: tuple, options: dict) -> tuple[tuple, tuple]:
        """(the 3-D grid, the constexprs in parameter order) of a launch with `options`."""
        names = self.jit.arg_names
        tail = tuple(options[name] for name in names[len(args):])
        if callable(grid):
            grid = grid(dict(zip(names, (*args, *tail))))
        return (*grid, *(1,) * (3 - len(grid))), tail

    def bind(self, grid, args: tuple, constexprs: dict) -> tuple:
        """(compiled kernel, 3-D grid, the constexprs in parameter order) for this
        launch, as the launch just made chose them."""
        options = dict(constexprs)
        if self.tuned:
            options.update(self.kernel.best_config.all_kwargs())
        grid3, tail = self.grid3(grid, args, options)
        compiled = self.jit.warmup(*args, grid=grid3, **options)
        if hasattr(compiled, "result"):             # an asynchronous compile's future
            compiled = compiled.result()
        compiled._init_handles()
        return compiled, grid3, tail


def hooked(hook) -> bool:
    """Whether a launch hook is installed: Triton 3.5 and later hold a HookChain,
    never None and empty unless a profiler added to it; earlier versions a
    function or None."""
    return hook is not None and bool(getattr(hook, "calls", True))


def positions_of(args: tuple) -> tuple:
    """(positions of the tensors, a picker of the integers) of a launch's arguments."""
    tensors = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    integers = tuple(i for i, a in enumerate(args) if isinstance(a, int))
    if not integers:
        return tensors, lambda args: ()
    pick = operator.itemgetter(*integers)
    return tensors, (pick if len(integers) > 1 else lambda args: (pick(args),))


def bind_directly(module, kernels) -> None:
    """Replace the kernels named `kernels` of a loaded generated module by their
    DirectLaunch (the module's launcher looks its kernels up by name at each call;
    the helpers that kernels call stay JIT functions).  Idempotent: a module is
    shared by the backends that generate its source."""
    for name in kernels:
        kernel = getattr(module, name)
        if not isinstance(kernel, DirectLaunch):
            setattr(module, name, DirectLaunch(kernel))
