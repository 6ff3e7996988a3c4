"""Launching generated kernels: the direct launch of compiled kernels
(compiler/backend/triton/launch.py), its bookkeeping with stand-ins for Triton's
kernel objects on the CPU and the real thing on the GPU (results of direct
launches, aligned and not); the launch grid's program count; programs called and
compiled from several threads; a backend pickled after a call."""
from __future__ import annotations

import itertools
import math
import pickle
import re
import sys
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
import torch

import compiler
from compiler.backend.triton.launch import DirectLaunch, guard_function

pytestmark = pytest.mark.filterwarnings("ignore:einfold. no CUDA tensors")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"     # the GPU machine runs compiled kernels
MODULE = "0123456789abcdef01234567"                         # the digest of a generated module


class FakeCompiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.runs = []

    def _init_handles(self):
        pass

    def launch_metadata(self, grid, stream, *args):
        return ("metadata of", grid, stream)

    def run(self, *args):
        self.runs.append(args)


class FakeJit:
    arg_names = ["X_ptr", "n_i", "scale", "BLOCK_i", "BLOCK_k"]

    def __init__(self, compiled):
        self.compiled, self.warmups = compiled, []

    def warmup(self, *args, grid, **options):
        self.warmups.append((args, grid, options))
        return self.compiled


class FakeAutotuner:
    configs = ()

    def __init__(self, jit):
        self.fn, self.slow = jit, []
        self.best_config = SimpleNamespace(all_kwargs=lambda: {"BLOCK_i": 64, "num_warps": 4})

    def __getitem__(self, grid):
        return lambda *args, **constexprs: self.slow.append((grid, args, constexprs))


@pytest.fixture
def fake_driver(monkeypatch):
    from triton.runtime.driver import driver
    monkeypatch.setattr(driver, "_active", SimpleNamespace(get_current_device=lambda: 0,
                                                          get_current_stream=lambda device: 7))


def test_a_kernel_binds_once_per_guard_then_launches_directly(fake_driver):
    compiled = FakeCompiled()
    tuner = FakeAutotuner(FakeJit(compiled))
    kernel = DirectLaunch(tuner, MODULE)
    grid = lambda META: (-(-META["n_i"] // META["BLOCK_i"]),)  # noqa: E731
    x = torch.zeros(64)
    kernel[grid](x, 130, 0.5, BLOCK_k=16)
    # the first launch of a guard takes Triton's path (which tunes and launches) ...
    assert len(tuner.slow) == 1 and compiled.runs == []
    args, grid3, options = tuner.fn.warmups[0]
    assert grid3 == (3, 1, 1) and options == {"BLOCK_k": 16, "BLOCK_i": 64, "num_warps": 4}
    # ... a second launch calls the compiled kernel with every bound argument in
    # parameter order (the tuned constexprs last), the 3-D grid and the stream
    kernel[grid](x, 130, 0.25, BLOCK_k=16)
    assert len(tuner.slow) == 1
    (run,) = compiled.runs
    # no profiler's launch hooks: no launch metadata, no hooks to call
    assert run[:9] == (3, 1, 1, 7, "function", "metadata", None, None, None)
    assert run[-5:] == (x, 130, 0.25, 64, 16)
    # a misaligned tensor or another extent is another specialisation: Triton's path again
    kernel[grid](torch.zeros(65)[1:], 130, 0.25, BLOCK_k=16)
    kernel[grid](x, 131, 0.25, BLOCK_k=16)
    assert len(tuner.slow) == 3 and len(compiled.runs) == 1


def test_a_launch_hook_gets_the_launch_metadata(fake_driver, monkeypatch):
    from triton import knobs
    from compiler.backend.triton.launch import hooked
    assert not hooked(None) and hooked(print)
    enter = print
    if hasattr(knobs.runtime.launch_enter_hook, "calls"):        # Triton >= 3.5: a chain of hooks
        assert not hooked(type(knobs.runtime.launch_enter_hook)())
        enter = type(knobs.runtime.launch_enter_hook)()
        enter.add(print)
        assert hooked(enter)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", enter)
    compiled = FakeCompiled()
    kernel = DirectLaunch(FakeAutotuner(FakeJit(compiled)), MODULE)
    grid = lambda META: (-(-META["n_i"] // META["BLOCK_i"]),)  # noqa: E731
    for _ in range(2):
        kernel[grid](torch.zeros(64), 130, 0.5, BLOCK_k=16)
    (run,) = compiled.runs
    assert run[5:8] == ("metadata", ("metadata of", (3, 1, 1), 7), enter)


def test_the_guard_holds_what_the_binder_specialises_on():
    x = torch.zeros(8, dtype=torch.float16)
    guard = guard_function((x, 3, 0.5, x, 4))
    assert guard((x, 3, 0.5, x, 4), 0) == (0, True, True, 3, 4)
    assert guard((x[1:], 3, 2.0, x, 4), 1) == (1, False, True, 3, 4)
    one = guard_function((x, 3, 0.5))
    assert one((x, 16, 0.5), 0) == (0, True, 16) != one((x, 17, 0.5), 0)
    assert guard_function((0.5,))((0.25,), 0) == (0,)


@pytest.mark.parametrize("shape", [[3, 1, 5, 7], [4], [], [2, 0, 3]])
def test_outputs_are_fresh_contiguous_tensors_of_their_spec(shape):
    """A runner's output maker makes a new contiguous tensor of the output's shape,
    dtype and device at each call (torch.empty where the shape is empty)."""
    from compiler.backend.triton.launch import output_maker
    make = output_maker(shape, torch.bfloat16, torch.device("cpu"))
    a, b = make(), make()
    assert a.shape == b.shape == torch.Size(shape) and a.dtype == torch.bfloat16 and a.is_contiguous()
    assert a.numel() == 0 or a.data_ptr() != b.data_ptr()
    assert a.stride() == torch.empty(shape).stride()


@pytest.mark.gpu
@pytest.mark.parametrize("split", [None, 4])
def test_direct_launches_match_torch_aligned_or_not(split):
    # a text of its own: programs of one text share their modules, and with them the
    # bindings other tests' inputs made (test_capture's attention, run before in a shard)
    program = compiler.compile("Launched[h,i,j] = softmax[m](Q[h,i,k] * K[h,m,k] * scale) * V[h,m,j]",
                               split=split)
    g = torch.Generator(device="cuda").manual_seed(0)
    flat = torch.randn(3 * 2 * 40 * 64 + 1, device="cuda", generator=g, dtype=torch.float16)
    aligned = [t.view(2, 40, 64) for t in flat[:-1].split(2 * 40 * 64)]
    shifted = [t.view(2, 40, 64) for t in flat[1:].split(2 * 40 * 64)]    # 2 bytes past 16
    for inputs in (aligned, aligned, shifted, shifted, aligned):
        q, k, v = inputs
        got = program(Q=q, K=k, V=v, scale=0.125)
        want = torch.softmax((q.float() @ k.float().transpose(1, 2)) * 0.125, -1) @ v.float()
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    kernels = [getattr(m, name) for m in _modules_of(program) for name in vars(m)
               if isinstance(getattr(m, name), DirectLaunch)]
    # one binding per alignment of the inputs it reads (a merge reads only its buffers)
    assert kernels and all(len(k.bound) in (1, 2) for k in kernels) and any(len(k.bound) == 2 for k in kernels)


def _modules_of(program):
    """The generated modules `program` has loaded (one per input signature), not every
    einfold module of the process: other tests' share it under pytest-xdist."""
    import sys
    return [sys.modules[launch.__module__] for _, launch, _ in program.backend._built.values()]


# ---------------------------------------------------------------- the launch grid
def test_the_program_count_is_exact_whatever_the_order_of_its_factors():
    """Each tile count is one parenthesised factor: `(n + 31) // 32 * h * (i + 15) // 16`
    evaluated left to right counted too many programs, which stored past the output."""
    from compiler.backend.triton.module import program_count
    code = SimpleNamespace(grid_blocks=[("j", "BLOCK_j"), ("h", None), ("i", "BLOCK_i"), ("b", None)],
                           optional=frozenset({"j"}))
    blocks = {"BLOCK_j": 32, "BLOCK_i": 16}
    untuned = program_count(code, blocks.__getitem__)
    tuned = program_count(code, lambda block: f'META["{block}"]')
    assert "triton" not in untuned + tuned          # plain integer arithmetic on the host
    for j, h, i, b in itertools.product((0, 1, 31, 33, 70), (1, 3), (1, 15, 17, 40), (1, 2)):
        n = {"j": j, "h": h, "i": i, "b": b}
        want = max(math.ceil(j / 32), 1) * h * math.ceil(i / 16) * b
        assert eval(untuned, {"n": n}) == eval(tuned, {"n": n, "META": blocks}) == want, n


class Recorder:
    """Stands for a kernel of a generated module: records each launch's grid, runs nothing."""

    def __init__(self):
        self.grids = []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return lambda *args, **constexprs: None


def _tiles(tiling: str, n: dict) -> int:
    """Programs of a kernel's grid as its launcher's comment states it: `b, i/16, h, j/32`."""
    count = 1
    for part in tiling.split(", "):
        index, _, block = part.partition("/")
        count *= math.ceil(n[index] / int(block)) if block else n[index]
    return count


@pytest.mark.usefixtures("private_cache")
@pytest.mark.parametrize("source, shapes, split", [
    ("O[b,i,h,j] = softmax[m](Q[b,i,h,k] * K[b,m,h,k]) * V[b,m,h,j]",
     {"Q": (2, 13, 3, 5), "K": (2, 11, 3, 5), "V": (2, 11, 3, 7)}, None),
    ("C[b,i,j] = A[b,i,k] * B[b,k,j]", {"A": (3, 19, 5), "B": (3, 5, 67)}, None),
    ("O[b,i,h,j] = softmax[m](Q[b,i,h,k] * K[b,m,h,k]) * V[b,m,h,j]",
     {"Q": (2, 13, 3, 5), "K": (2, 131, 3, 5), "V": (2, 131, 3, 7)}, 3)],
    ids=["heads between tiles", "batched product", "split"])
def test_a_launch_runs_one_program_per_tile_of_its_grid(monkeypatch, source, shapes, split):
    """The untuned launcher's grid (the interpreter's, for these CPU tensors; a split
    kernel's on the GPU) is the product of the ceil-divisions of its kernel's grid,
    and the split's n_split programs beside it.  Nothing runs: the kernels only
    record their launches."""
    from compiler.backend.triton.cache import load
    program = compiler.compile(source, split=split)
    inputs = {name: torch.randn(shape) for name, shape in shapes.items()}
    binding = program.binder(inputs)
    backend = program.backend
    n = backend._extents(binding)
    built = backend.build(backend.signature(binding, n))
    module = load(built.source, "grid count", interpret=True)
    tilings = dict(re.findall(r"    # (\w+): .*\[grid \((.*)\)\]\n", built.source))
    recorders = {name: Recorder() for name in tilings}
    for name, recorder in recorders.items():
        monkeypatch.setattr(module, name, recorder)
    outputs = {name: torch.empty(shape, dtype=dtype) for name, shape, dtype in backend._output_specs(binding)}
    t = {**inputs, **outputs}
    module.launch(t, n, torch.device("cpu"))
    assert recorders and all(recorder.grids for recorder in recorders.values())
    for name, recorder in recorders.items():
        (grid,) = recorder.grids
        assert grid == (_tiles(tilings[name], n),) + ((split,) if split else ()), (name, tilings[name])


# ---------------------------------------------------------------- threads
def _in_threads(function, arguments: list) -> list:
    """`function` of each argument, each in a thread of its own, all started together."""
    results, errors = [None] * len(arguments), []
    start = threading.Barrier(len(arguments))

    def work(k):
        start.wait()
        try:
            results[k] = function(arguments[k])
        except BaseException as e:  # noqa: BLE001 -- raised below, in the test's thread
            errors.append(e)
    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(arguments))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


THREADED = ["Y[i,j] = softmax[j](X[i,j] * 2.0)", "Y[i] = logsumexp[j](X[i,j])",
            "Y[i,j] = X[i,j] - max[k](X[i,k])", "Y[i] = sum[j](X[i,j] * X[i,j])"]


def _x(seed: int) -> torch.Tensor:
    return torch.randn(5, 7, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.usefixtures("private_cache")
def test_four_threads_call_one_program():
    """Triton's interpreter runs one launch at a time: launches from threads wait their
    turn (on the GPU, compiled kernels launch as they come)."""
    program = compiler.compile(THREADED[0])
    together = _in_threads(lambda seed: program(X=_x(seed)), list(range(4)))
    for seed, got in enumerate(together):
        assert torch.equal(got, program(X=_x(seed)))


def _compile_and_call(source: str) -> list[torch.Tensor]:
    program = compiler.compile(source)
    return [program(X=_x(seed)) for seed in range(3)]


@pytest.mark.usefixtures("private_cache")
def test_four_threads_compile_and_call_different_programs():
    """Generating, loading (cache.load) and launching modules from threads at once."""
    together = _in_threads(_compile_and_call, THREADED)
    for source, got in zip(THREADED, together):
        for a, b in zip(got, _compile_and_call(source), strict=True):
            assert torch.equal(a, b)


class OneAtATime(FakeAutotuner):
    """Triton's autotuner: its launch in progress is state of its own (`nargs`)."""
    running = False

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            assert not self.running, "two first launches at once"
            self.running = True
            time.sleep(0.05)
            self.slow.append((grid, args, constexprs))
            self.running = False
        return launch


def test_first_launches_from_threads_bind_one_at_a_time(fake_driver):
    """A compiled kernel's first launches from threads at once: one tunes and binds, the
    others wait for it and launch the kernel it bound."""
    compiled = FakeCompiled()
    tuner = OneAtATime(FakeJit(compiled))
    kernel = DirectLaunch(tuner, MODULE)
    grid = lambda META: (-(-META["n_i"] // META["BLOCK_i"]),)  # noqa: E731
    x = torch.zeros(64)
    _in_threads(lambda _: kernel[grid](x, 130, 0.5, BLOCK_k=16), list(range(4)))
    assert len(tuner.slow) == 1 and len(compiled.runs) == 3


@pytest.mark.usefixtures("private_cache")
def test_threads_loading_one_module_each_get_it_complete():
    """A module is in sys.modules from before it runs (Triton reads its source from
    there): a second load must wait for the first to finish, not take it half-run."""
    from compiler.backend.triton.cache import load
    source = f"# {uuid.uuid4()}: a module no load ran before\nimport time\ntime.sleep(0.2)\nCOMPLETE = True\n"

    def complete_when_loaded(_):
        module = load(source, "threads", interpret=True)
        return module, hasattr(module, "COMPLETE")
    loaded = _in_threads(complete_when_loaded, list(range(4)))
    assert all(module is loaded[0][0] and complete for module, complete in loaded)


# ---------------------------------------------------------------- pickling
@pytest.mark.usefixtures("private_cache")
def test_a_backend_pickles_after_a_call_and_runs_again():
    """Pickled without its loaded modules (functions of this process), which it makes
    again on its next call."""
    program = compiler.compile("Y[i,j] = softmax[j](X[i,j] * 2.0)")
    x = _x(0)
    want = program(X=x)
    backend = pickle.loads(pickle.dumps(program.backend))
    assert torch.equal(backend.run(program.binder({"X": x}))["Y"], want)
    assert backend.source == program.backend.source         # the last call's module
