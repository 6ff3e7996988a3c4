"""The direct launch of compiled kernels (compiler/backend/triton/launch.py):
its bookkeeping with stand-ins for Triton's kernel objects on the CPU, and the
real thing on the GPU (results of direct launches, aligned and not)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import compiler
from compiler.backend.triton.launch import DirectLaunch, guard_function


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
    kernel = DirectLaunch(tuner)
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
    kernel = DirectLaunch(FakeAutotuner(FakeJit(compiled)))
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
    program = compiler.compile("O[h,i,j] = softmax[m](Q[h,i,k] * K[h,m,k] * scale) * V[h,m,j]", split=split)
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
