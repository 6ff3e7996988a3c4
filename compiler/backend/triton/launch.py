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
A tuned kernel's first launch runs a recorded choice where one matches
(records.py: only that candidate compiled, none timed), and records the
autotuner's choice where none does.

Only for compiled kernels on Triton versions with `triton.knobs` (3.4 and
later, whose `CompiledKernel.run` takes the launch hooks and every bound
argument); the interpreter and older versions keep the ordinary path."""
from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from . import records

# First launches (tuning, compiling, binding) run one at a time: Triton's autotuner keeps
# the launch in progress on itself and AsyncCompileMode is process-wide, so two threads'
# first launches at once fail; bound launches take no lock.
_BINDING = threading.Lock()


def direct_launch_supported() -> bool:
    try:
        import triton.knobs  # noqa: F401
    except ImportError:
        return False
    return True


def guard_function(args: tuple):
    """The guard of a launch site whose arguments are of the kinds of `args`, as a
    function (args, device) -> key: the device, then what Triton's binder
    specialises on for the arguments einfold passes: each tensor's 16-byte alignment
    and each integer (extents and strides) by value, stricter than the binder's
    classes.  Dtypes are fixed per generated module (its cache key holds the input
    dtypes); floats are not specialised on.  Generated once per launch site, like
    Triton's binder: one flat tuple, no loop over the arguments per launch."""
    names = [f"a{i}" for i in range(len(args))]
    aligned = [f"{names[i]}.data_ptr() % 16 == 0" for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    integers = [names[i] for i, a in enumerate(args) if isinstance(a, int)]
    source = (f"def guard(args, device):\n"
              f"    {''.join(name + ', ' for name in names)}= args\n"
              f"    return (device, {''.join(item + ', ' for item in aligned + integers)})\n")
    namespace: dict = {}
    exec(source, namespace)
    return namespace["guard"]


class DirectLaunch:
    """`kernel[grid](*args, **constexprs)` with Triton's per-call binding done once
    per guard (see the module docstring).  `kernel` is a JITFunction or an
    Autotuner over one, of the generated module whose digest is `module`."""

    def __init__(self, kernel, module: str):
        from triton import knobs
        from triton.runtime.driver import driver
        self.kernel = kernel
        self.module = module
        self.tuned = hasattr(kernel, "configs")          # an Autotuner (a JITFunction's fn is its Python function)
        self.jit = kernel.fn if self.tuned else kernel
        self.bound: dict[tuple, tuple] = {}
        self.guard = None       # guard_function of the launch site: it passes arguments of fixed kinds
        # resolved once: `driver.active` is a lazy proxy, each attribute a lookup through it
        self.hooks = knobs.runtime
        # torch's own getter where it has one: torch.cuda.current_device around it only adds a
        # lazy-init check, done by the time a launch is bound
        self.current_device = getattr(torch._C, "_cuda_getDevice", None) or driver.active.get_current_device
        self.current_stream = driver.active.get_current_stream

    def __getitem__(self, grid):
        return lambda *args, **constexprs: self.launch(grid, args, constexprs)

    def launch(self, grid, args: tuple, constexprs: dict) -> None:
        if self.guard is None:
            self.guard = guard_function(args)
        device = self.current_device()
        key = self.guard(args, device)
        found = self.bound.get(key)
        if found is None:
            with _BINDING:
                found = self.bound.get(key)         # bound by another thread meanwhile?
                if found is None:
                    self.bound[key] = self.first_launch(grid, args, constexprs, device)
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

    def first_launch(self, grid, args: tuple, constexprs: dict, device) -> tuple:
        """Launch through Triton, compiling (and tuning) as needed, and bind the kernel
        it ran.  A tuned kernel of several candidates launches a recorded choice of its
        tuning key where there is one, otherwise the autotuner's after it timed every
        candidate, and notes the choice it launched (what save_tuning writes)."""
        if not self.tuned or len(self.kernel.configs) < 2:        # nothing to choose
            self.kernel[grid](*args, **constexprs)
            chosen = self.kernel.best_config.all_kwargs() if self.tuned else {}
            return self.bind(grid, args, {**constexprs, **chosen})
        from triton.runtime.errors import OutOfResources
        key = self.tuning_key(args, device)
        config = records.choice(key, self.kernel.configs)
        if config is not None:
            try:
                self.jit[grid](*args, **constexprs, **config.all_kwargs())
            except OutOfResources:      # a record (an edited file) naming a candidate the chip cannot run
                config = None
        if config is None:
            self.compile_candidates(grid, args, constexprs)
            self.kernel[grid](*args, **constexprs)          # times the candidates
            config = self.kernel.best_config
        records.note(key, config)
        return self.bind(grid, args, {**constexprs, **config.all_kwargs()})

    def tuning_key(self, args: tuple, device) -> records.TuningKey:
        """The key of a tuned launch's choice: this device's GPU model, the module,
        the kernel, its autotune key (the shape classes) and its tensors' dtypes."""
        by_name = dict(zip(self.jit.arg_names, args))
        return records.TuningKey(torch.cuda.get_device_name(device), self.module, self.jit.__name__,
                                 tuple((name, by_name[name]) for name in self.kernel.keys),
                                 tuple(str(a.dtype).removeprefix("torch.") for a in args
                                       if isinstance(a, torch.Tensor)))

    def compile_candidates(self, grid, args: tuple, constexprs: dict) -> None:
        """Compile every autotune candidate for these arguments at once, so that the
        autotuner only times them: Triton's AsyncCompileMode over a thread pool (the
        MLIR passes and ptxas run outside the GIL).  One after another, eight
        candidates were most of an attention variant's first call.  Candidates that
        fail to compile are left to the autotuner, which skips them."""
        import triton
        if not hasattr(triton, "AsyncCompileMode"):
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

    def bind(self, grid, args: tuple, options: dict) -> tuple:
        """(compiled kernel, 3-D grid, the constexprs in parameter order) for this
        launch with `options` (the constexprs and the chosen config's), as the launch
        just made compiled it."""
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


def output_maker(shape: list[int], dtype: torch.dtype, device: torch.device):
    """A function that makes an uninitialised contiguous output of this shape, dtype
    and device: `torch.empty_like` of a zero-dimensional tensor expanded to the shape
    (no storage of its own), which parses no dtype or device per call: about half of
    `torch.empty`'s host time (`torch.empty_like` 1.7-1.9 against 3.2-3.4 us a call
    on the H100's host, scripts/host_probe.py).  Checked once here; where torch made
    anything but a contiguous tensor from it (an empty one, or another version's
    stride rule), `torch.empty` itself."""
    pattern = torch.empty((), dtype=dtype, device=device).expand(shape)
    made = torch.empty_like(pattern)
    if made.numel() and made.is_contiguous():
        return functools.partial(torch.empty_like, pattern)
    return functools.partial(torch.empty, shape, dtype=dtype, device=device)


def bind_directly(module, kernels, digest: str) -> None:
    """Replace the kernels named `kernels` of a loaded generated module, whose digest
    (cache.module_digest) is `digest`, by their DirectLaunch (the module's launcher
    looks its kernels up by name at each call; the helpers that kernels call stay
    JIT functions).  Idempotent: a module is shared by the backends that generate
    its source."""
    for name in kernels:
        kernel = getattr(module, name)
        if not isinstance(kernel, DirectLaunch):
            setattr(module, name, DirectLaunch(kernel, digest))
