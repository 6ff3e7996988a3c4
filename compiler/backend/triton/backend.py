"""The Triton backend object: specialisation per input signature, the module
cache, runners and plans.  See the package docstring for the other modules."""
from __future__ import annotations

import os
import sys
import threading
import types
import warnings

import torch

# Triton's interpreter only runs library functions (tl.sum, tl.cdiv, ...) that were
# created while TRITON_INTERPRET=1 was set, i.e. it must be set before triton.language
# is first imported.  Without CUDA it is the only way to run kernels: set it now.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ...arguments import positive_number
from ...bind import Binding
from ...errors import BackendError
from ...schedule import Plan, Schedule
from .cache import load, module_digest
from ...specialise import POSITIVE, ConcreteSchedule, Signature, specialise
from .launch import DirectLaunch, bind_directly, direct_launch_supported, output_maker
from .module import CHUNK_LENGTH, Built, ModuleBuilder

_warned_interpreter = False


def _note_interpreter() -> None:
    global _warned_interpreter
    if not _warned_interpreter:
        _warned_interpreter = True
        warnings.warn("einfold: no CUDA tensors, so the triton backend runs its kernels under Triton's "
                      "interpreter (TRITON_INTERPRET=1): correct but slow", RuntimeWarning,
                      stacklevel=_caller_level())


def _caller_level() -> int:
    """The warning's stack level of the first frame outside this package: the
    user's call, not einfold's internals."""
    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def _interpreter_ready() -> bool:
    """Whether triton.language was imported in interpreter mode."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(tl.standard.cdiv, InterpretedFunction)


# Triton's interpreter runs one launch at a time in a process: it patches triton.language's
# functions for the kernel it runs (restoring them after) and keeps the grid in one global
# builder, so launches from two threads at once fail ("Did you forget to add @triton.jit").
_INTERPRETER = threading.Lock()

# Generating and loading a module (once per signature, not per call) happen under one lock:
# threads at a first call of one signature load it once; codegen holds the GIL anyway.
_BUILDING = threading.RLock()


def _interpreted(launch):
    """`launch` run under Triton's interpreter: one launch at a time (_INTERPRETER), with
    numpy's floating-point warnings silenced.  Under the interpreter tiles are numpy
    arrays, and identity padding computes 0/0, exp(-inf - -inf) and the like by design
    (masked away afterwards): numpy would print a RuntimeWarning for each.  Only
    interpreted launches are wrapped; compiled kernels are untouched."""
    import functools

    import numpy

    @functools.wraps(launch)        # still names its module: a program's modules are found from it
    def run(t, n, device):
        with _INTERPRETER, numpy.errstate(all="ignore"):
            return launch(t, n, device)
    return run


def _pass_names() -> tuple[str, ...]:
    from ...passes import PIPELINE
    return tuple(name for name, _ in PIPELINE)


_GPU_FACTS: dict[int, tuple[int, int | None, int]] = {}


def _tf32_allowed() -> bool:
    """Whether torch's float32 matmuls on CUDA may use TF32 (`torch.backends.cuda.matmul.
    fp32_precision`, which the older `allow_tf32` and `torch.set_float32_matmul_precision`
    also set); einfold's float32 tl.dot follows it."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if precision in ("tf32", "ieee"):
        return precision == "tf32"
    return torch.get_float32_matmul_precision() != "highest"


def _gpu_facts(device: torch.device) -> tuple[int | None, int | None, int | None]:
    """(SM count, L2 cache bytes, compute capability as 10 * major + minor) of a CUDA
    device; (None, None, None) off the GPU."""
    if device.type != "cuda":
        return None, None, None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _GPU_FACTS:
        properties = torch.cuda.get_device_properties(index)
        l2_bytes = getattr(properties, "L2_cache_size", None) or None
        _GPU_FACTS[index] = (properties.multi_processor_count, l2_bytes, 10 * properties.major + properties.minor)
    return _GPU_FACTS[index]


class TritonBackend:
    name = "triton"

    def __init__(self, schedule: Schedule, *, float32_outputs: tuple[str, ...] = ()):
        """Runs a Schedule (compiler.schedule: the schedule stage's result) as Triton
        kernels; it neither lowers nor inlines: kernels, grids, loops and buffers
        are the schedule's, tiles and splits are chosen per signature here."""
        split = schedule.split
        if split is not None and (isinstance(split, bool) or not isinstance(split, int) or split < 1):
            raise BackendError(f"split must be a positive integer (or None for the default), not {split!r}")
        self.schedule = schedule
        self.program = schedule.program
        self.outputs = schedule.outputs
        self.split = split
        self.float32_outputs = tuple(float32_outputs)
        self._last: Built | None = None
        self._forget_modules()

    def _forget_modules(self) -> None:
        """Empty the per-process caches: generated sources and loaded launchers, made
        again on the next call."""
        self._sources: dict[Signature, Built] = {}                  # generated once per signature
        self._built: dict[Signature, tuple[Built, object]] = {}     # ... and its loaded launcher

    def __getstate__(self) -> dict:
        """Pickled without the loaded modules (their functions live in this process
        only) nor the sources (made again from the schedule where needed)."""
        state = dict(self.__dict__)
        del state["_sources"], state["_built"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._forget_modules()

    @classmethod
    def for_program(cls, program) -> TritonBackend:
        """The backend of a compiled Program: it runs the program's schedule stage."""
        return cls(program.schedule, float32_outputs=program.schedule_options.get("float32_outputs", ()))

    # ------------------------------------------------------------ specialisation
    @staticmethod
    def interpreted(binding: Binding) -> bool:
        return binding.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1"

    def signature(self, binding: Binding, extents: dict[str, int]) -> Signature:
        inputs = []
        for decl in self.program.inputs:
            value = binding.values[decl.name]
            if isinstance(value, torch.Tensor):
                inputs.append((decl.name, "tensor", value.dim(), value.dtype))
            else:
                inputs.append((decl.name, "number", 0, POSITIVE if positive_number(value) else None))
        interpret = self.interpreted(binding)
        sm_count, l2_bytes, arch = (None, None, None) if interpret else _gpu_facts(binding.device)
        return Signature(tuple(sorted(extents.items())), tuple(inputs), binding.dtype, sm_count, interpret,
                         tf32=not interpret and _tf32_allowed(), l2_bytes=l2_bytes, arch=arch)

    def gpu_signature(self, binding: Binding, *, sm_count: int | None = None,
                      l2_bytes: int | None = None, arch: int | None = None) -> Signature:
        """The signature of these inputs on a GPU with `sm_count` SMs (None: no automatic
        split), an L2 cache of `l2_bytes` (None: no eviction hint that depends on it) and
        compute capability `arch` (90: Hopper, whose kernels of streamed rescaled folds
        take the Hopper form), wherever the inputs are."""
        from dataclasses import replace
        sig = self.signature(binding, self._extents(binding))
        return replace(sig, interpret=False, sm_count=sm_count, tf32=_tf32_allowed(), l2_bytes=l2_bytes, arch=arch)

    def source_for(self, binding: Binding, **gpu) -> str:
        """The module these inputs would run as compiled kernels on a GPU (`gpu`: as
        gpu_signature takes it), without running anything."""
        return self.build(self.gpu_signature(binding, **gpu)).source

    def specialised_for(self, binding: Binding, **gpu) -> ConcreteSchedule:
        """The concrete schedule (every tile, loop and split) of these inputs on a GPU
        (`gpu`: as gpu_signature takes it)."""
        return specialise(self.schedule, self.gpu_signature(binding, **gpu))

    def build(self, signature: Signature) -> Built:
        with _BUILDING:
            built = self._sources.get(signature)
            if built is None:
                built = ModuleBuilder(specialise(self.schedule, signature), _pass_names()).build()
                self._sources[signature] = built
        self._last = built
        return built

    def _entry(self, binding: Binding, extents: dict[str, int]):
        sig = self.signature(binding, extents)
        interpret = sig.interpret
        if interpret and not _interpreter_ready():
            raise BackendError(
                f"the inputs are on {binding.device.type}: the triton backend runs CUDA tensors, or CPU tensors "
                f"under Triton's interpreter, which needs TRITON_INTERPRET=1 set before triton is first "
                f"imported; move the inputs to the GPU, set that variable, or use backend='reference'")
        with _BUILDING:
            entry = self._built.get(sig)
            if entry is None:
                entry = self._built[sig] = self._load(sig)
        if interpret:
            _note_interpreter()
        return entry

    def _load(self, sig: Signature):
        """(the built module, its launcher, its scratch maker or None) for `sig`."""
        built = self.build(sig)
        options = repr((self.split, [(name, str(dtype)) for name, _, _, dtype in sig.inputs], str(sig.dtype)))
        module = load(built.source, options, sig.interpret)
        if not sig.interpret and direct_launch_supported():
            bind_directly(module, built.launched, module_digest(built.source, options))
        launch = _interpreted(module.launch) if sig.interpret else module.launch
        return built, launch, getattr(module, "scratch", None)

    def _launching(self, binding: Binding):
        """(the built module, its launcher, its split scratch maker, the extents the launcher
        reads: every index's, and a chunked run's length under CHUNK_LENGTH)."""
        extents = self._extents(binding)
        built, launch, scratch = self._entry(binding, extents)
        if built.chunked:
            extents[CHUNK_LENGTH] = built.chunk_length
        return built, launch, scratch, extents

    def _extents(self, binding: Binding) -> dict[str, int]:
        """Every index name's extent: the passes and the schedule introduce names
        (renamed bound indices) that share an extent symbol with a bound one."""
        by_symbol = {}
        for name, symbol in self.program.extents:
            if name in binding.extents:
                by_symbol[symbol] = binding.extents[name]
        n = dict(binding.extents)
        for name, symbol in self.program.extents:
            if name not in n and symbol in by_symbol:
                n[name] = by_symbol[symbol]
        alternative = self.schedule.materialised
        for fresh, original in self.schedule.fresh_names + (alternative.fresh_names if alternative else ()):
            n[fresh] = n[original]
        return n

    # ------------------------------------------------------------ interface
    def run(self, binding: Binding) -> dict[str, torch.Tensor]:
        return self.runner(binding)(binding.values)

    def runner(self, binding: Binding):
        """Run the kernels on inputs of this binding's shapes, dtypes and device (the
        values may differ): the launcher, extents and output shapes are fixed here.
        The runner's `out` (optional) gives tensors of the outputs' shapes and dtypes
        that the kernels write (strided views, such as one part of a stacked buffer)."""
        if binding.device.type not in ("cuda", "cpu"):
            raise BackendError(f"the triton backend runs on CUDA tensors (or on CPU under the interpreter), "
                               f"not on {binding.device.type}")
        _, launch, scratch, extents = self._launching(binding)
        device = binding.device
        outputs = self._output_specs(binding)
        # a split kernel's partial states and arrival counters, made once per stream (launches
        # on one stream are ordered, and each leaves its counters at 0): no allocations and
        # no zero-fill per call
        kept: dict[int, dict] = {}
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            stream_of = lambda: torch._C._cuda_getCurrentRawStream(index)   # noqa: E731 -- the raw handle, cheap
        else:
            stream_of = int         # the interpreter: one stream

        made = [(name, output_maker(shape, dtype, device)) for name, shape, dtype in outputs]

        def run(values, out=None):
            t = dict(values)
            for name, make in made:
                t[name] = make() if out is None or name not in out else out[name]
            if scratch is not None:
                stream = stream_of()
                if stream not in kept:
                    kept[stream] = scratch(extents, device)
                t.update(kept[stream])
            launch(t, extents, device)
            return {name: t[name] for name, _ in made}
        return run

    def traced_runner(self, binding: Binding):
        """Run the kernels as torch traces a call (torch.compile's fake and functional
        tensors inside the program's `torch.library.triton_op`, compiler/autograd.py):
        every launch through `torch.library.wrap_triton`, so that the graph holds the
        Triton kernels themselves and inductor compiles and schedules them with the
        rest; outputs, buffers and split scratch made per call (a graph keeps no
        tensor of an earlier call).  None where torch cannot trace the kernels: under
        the interpreter, where one is in Gluon (the Hopper form), and at sizes torch
        keeps symbolic (tiles and splits are chosen for whole numbers)."""
        if self.interpreted(binding) or not all(type(e) is int for e in binding.extents.values()):
            return None
        from torch.library import wrap_triton
        extents = self._extents(binding)
        built, launch, _ = self._entry(binding, extents)
        if built.gluon or built.chunked:
            return None
        # the launcher finds its kernels among its module's globals: a copy of it whose
        # globals hold them wrapped (the module's own are DirectLaunches, shared by calls)
        namespace = dict(launch.__globals__)
        for name in built.launched:
            kernel = namespace[name]
            namespace[name] = wrap_triton(kernel.kernel if isinstance(kernel, DirectLaunch) else kernel)
        traced = types.FunctionType(launch.__code__, namespace, launch.__name__)
        outputs = self._output_specs(binding)
        device = binding.device

        def run(values):
            t = dict(values)
            for name, shape, dtype in outputs:
                t[name] = torch.empty(shape, dtype=dtype, device=device)
            traced(t, extents, device)
            return {name: t[name] for name, _, _ in outputs}
        return run

    def _output_specs(self, binding: Binding) -> list[tuple[str, list[int], torch.dtype]]:
        return [(name, [binding.extents[i] for i in self.program.statement(name).indices],
                 binding.result_dtype(self.program.statement(name).dtype, name in self.float32_outputs))
                for name in self.outputs]

    def launch_overhead_probe(self, inputs: dict, calls: int = 200) -> float:
        """Microseconds of host time per call of the generated launcher alone (the
        kernels' launches; binding, specialisation lookup and output allocation
        excluded), for the benchmark's host-overhead row."""
        import time

        from ...bind import bind
        binding = bind(self.program, inputs)
        _, launch, _, extents = self._launching(binding)
        t = dict(binding.values)
        for name, shape, dtype in self._output_specs(binding):
            t[name] = torch.empty(shape, dtype=dtype, device=binding.device)
        launch(t, extents, binding.device)
        if binding.device.type == "cuda":
            torch.cuda.synchronize(binding.device)
        start = time.perf_counter()
        for _ in range(calls):
            launch(t, extents, binding.device)
        elapsed = time.perf_counter() - start
        if binding.device.type == "cuda":
            torch.cuda.synchronize(binding.device)
        return elapsed / calls * 1e6

    def plan(self, binding: Binding) -> Plan:
        return self.build(self.signature(binding, self._extents(binding))).plan

    @property
    def source(self) -> str:
        """The generated module of the last call, or (before any call) the module for
        float32 tensors with every extent 128."""
        if self._last is None:
            inputs = tuple((i.name, "tensor" if i.rank else "number", i.rank,
                            torch.float32 if i.rank else None) for i in self.program.inputs)
            sig = Signature(tuple((name, 128) for name, _ in self.program.extents), inputs, torch.float32, None)
            self.build(sig)
        return self._last.source


__all__ = ["TritonBackend"]
