"""The generated kernels build for the GPU, checked on a machine without one.

Every program of the differential corpus (test_differential.CORPUS: the pass library,
the equivalent spellings, the discovery table, the first round's GPU-only crashes, the
empty and launch cases), in bfloat16 and float32, the backward that autograd runs
for each program of the gradient corpus (test_grad.CORPUS), in bfloat16, and the
recomputing backward of two of them, is specialised to large sizes. Each kernel
launch, with every autotuning candidate, is then built by Triton's compiler for
Hopper (sm_90): the frontend, the GPU passes and ptxas, with the argument
specialisation Triton's launcher would give.

The interpreter never runs that compiler. A kernel that would fail only on the GPU
(a layout the GPU passes reject, a type the PTX backend cannot lower, a launch none of
whose candidates fits the shared memory of an H100 block) fails here instead.

What this cannot find:
- wrong numbers (test_differential runs the corpus, on CPU and on the GPU);
- a failure that only the device's Triton version has. CI builds with the Triton pip
  resolves; the H100 ran 3.6 this round.

The work runs in subprocesses (tests/gpu_compile.py), one per CPU at a time, with the
interpreter off."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_differential import CORPUS
from test_grad import CORPUS as GRADIENTS

pytestmark = pytest.mark.build      # minutes of ptxas: its own CI step (pyproject.toml)

HERE = os.path.dirname(os.path.abspath(__file__))
H100_BLOCK_SHARED = 232448      # bytes of shared memory one block may use on an H100 (227 KiB)


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> dict[str, str]:
    """Generated modules and Triton's builds go to temporary folders shared by the
    module's tests, not the user's caches."""
    base = tmp_path_factory.mktemp("gpu-compile")
    return {"EINFOLD_CACHE_DIR": str(base / "einfold"), "TRITON_CACHE_DIR": str(base / "triton")}


def compiled_off_the_interpreter(args: list[str], caches: dict[str, str],
                                 timeout: int = 2400) -> subprocess.CompletedProcess:
    env = {**os.environ, **caches, "TRITON_INTERPRET": "0"}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=os.path.dirname(HERE))


def built(names: list[str], dtypes: str, caches: dict[str, str]) -> list[dict]:
    """gpu_compile.py's rows for `names`, in as many processes at once as there are CPUs
    (a build is one process's work)."""
    workers = os.cpu_count() or 1
    chunks = [names[k::2 * workers] for k in range(min(len(names), 2 * workers))]
    with ThreadPoolExecutor(workers) as pool:
        runs = list(pool.map(lambda chunk: compiled_off_the_interpreter(
            [os.path.join(HERE, "gpu_compile.py"), "--dtypes", dtypes, *chunk], caches), chunks))
    for done in runs:
        assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for done in runs for line in done.stdout.splitlines() if line.startswith("{")]


def assert_every_launch_builds(rows: list[dict], names: list[str]) -> None:
    assert {r["program"] for r in rows} == set(names), "a program launched no kernel at the large sizes"
    failed = [f"{r['program']} ({r['dtype']}) {r['kernel']} [{r['candidate']}]: {r['error']}"
              for r in rows if "error" in r]
    assert not failed, "\n".join(failed)
    # a candidate too big for a block fails its launch, which the autotuner skips; a launch
    # with none that fits fails on the GPU
    smallest: dict[tuple, int] = {}
    for r in rows:
        launch = (r["program"], r["dtype"], r["launch"], r["kernel"])
        smallest[launch] = min(smallest.get(launch, r["shared"]), r["shared"])
    too_big = [f"{' '.join(map(str, launch))}: {shared} bytes" for launch, shared in smallest.items()
               if shared > H100_BLOCK_SHARED]
    assert not too_big, "launches whose every candidate needs more shared memory than an H100 block has:\n" + \
        "\n".join(too_big)


def test_every_kernel_of_the_differential_corpus_builds_for_hopper(caches):
    names = list(CORPUS)
    assert_every_launch_builds(built(names, "bfloat16,float32", caches), names)


def test_every_kernel_of_the_gradient_corpus_builds_for_hopper(caches):
    # the backward that autograd runs, in bfloat16 (training's dtype; float32 doubles the time)
    names = [f"grad-{name}" for name in GRADIENTS]
    assert_every_launch_builds(built(names, "bfloat16", caches), names)


def test_the_recomputing_backward_builds_for_hopper(caches):
    # compiler.grad's default: its dQ streams the softmax's (r, l) beside the weighted sums of
    # K[m,k] * dP[i,m], which until the twenty-third session were 3-D broadcast products (the
    # attention dQ took 400-500 s to build, the sink backward over ten minutes)
    names = ["recomputed-attention", "recomputed-sink"]
    assert_every_launch_builds(built(names, "bfloat16", caches), names)


def test_the_check_reports_a_kernel_that_does_not_build_and_one_too_big_for_a_block(tmp_path, caches):
    script = tmp_path / "kernels.py"      # Triton reads a kernel's source from its file
    script.write_text(textwrap.dedent(f"""
        import sys, torch, triton, triton.language as tl
        sys.path.insert(0, {HERE!r})
        from gpu_compile import build

        @triton.jit
        def product(a_ptr, b_ptr, c_ptr, n, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                    KB: tl.constexpr):
            rows, cols, inner, inner_b = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K), tl.arange(0, KB)
            acc = tl.zeros([M, N], tl.float32)
            for start in range(0, n, K):
                a = tl.load(a_ptr + rows[:, None] * n + start + inner[None, :])
                b = tl.load(b_ptr + (start + inner_b[:, None]) * N + cols[None, :])
                acc = tl.dot(a, b, acc)
            tl.store(c_ptr + rows[:, None] * N + cols[None, :], acc)

        x = torch.ones(256, 256)
        try:
            build(product, (x, x, x, 256), {{"M": 64, "K": 32, "N": 64, "KB": 16}})
        except Exception as e:
            print("mismatched:", type(e).__name__)
        big = build(product, (x, x, x, 256), {{"M": 256, "K": 64, "N": 256, "KB": 64, "num_stages": 4}})
        print("big:", big.metadata.shared)
    """))
    done = compiled_off_the_interpreter([str(script)], caches)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "mismatched: CompilationError" in done.stdout, done.stdout
    shared = int(done.stdout.split("big:")[1])
    assert shared > H100_BLOCK_SHARED      # 3 buffered stages of two float32 256 x 64 tiles: 384 KiB


def test_a_bound_over_one_key_and_a_ring_part_in_the_hopper_form_build(caches):
    # Triton passes an extent of 1 as the constant 1: a bound with a float offset (a number
    # input) clamped by `n_m.to(tl.float32)` did not build (a zigzag part of one key on four
    # ranks failed on the GPU and left the others waiting). The ring's local program, whose
    # bound is shifted by the parts' starts (0-d int64 tensors), takes the Hopper form
    script = textwrap.dedent("""
        import json, sys, torch
        sys.path.insert(0, "tests")
        from triton.runtime.autotuner import Autotuner
        import compiler
        from gpu_compile import build, launches
        window = compiler.compile("O[i,j] = softmax[m](where(m <= i + w, Q[i,k] * K[m,k], -inf)) * V[m,j]",
                                  backend="triton")
        causal = compiler.compile("O[i,j] = softmax[m](where(m <= i, Q[i,k] * K[m,k] * scale, -inf)) * V[m,j]",
                                  backend="triton").shard("m", layout="zigzag")
        ring = compiler.compile("O[b,h,i,j] = softmax[m](where(m <= i, Q[b,h,i,k] * K[b,h,m,k] * scale, -inf)) "
                                "* V[b,h,m,j]", backend="triton").shard("m", layout="zigzag", rows="i")
        x = torch.randn(1, 16, 4096, 128, dtype=torch.bfloat16)
        position = torch.tensor(4096)
        cases = [(window, {"Q": torch.randn(20, 4), "K": torch.randn(1, 4), "V": torch.randn(1, 3), "w": 0.5}),
                 (causal.local, {"Q": torch.randn(20, 4), "K": torch.randn(1, 4), "V": torch.randn(1, 3),
                                 "scale": 0.5, causal.sharded.start: torch.zeros((), dtype=torch.int64),
                                 causal.sharded.total: torch.zeros((), dtype=torch.int64)}),
                 (ring.local, {"Q": x, "K": x, "V": x, "scale": 0.1,
                               **{name: position for name in (ring.sharded.start, ring.sharded.total,
                                                              ring.sharded.rows_start, ring.sharded.rows_total)
                                  if name in ring._local_inputs}})]
        for program, inputs in cases:
            for kernel, args, kwargs in launches(program, inputs):
                fn = kernel.fn if isinstance(kernel, Autotuner) else kernel
                config = kernel.configs[0] if isinstance(kernel, Autotuner) else None
                try:
                    build(fn, args, {**kwargs, **(config.all_kwargs() if config else {})})
                    print(json.dumps({"kernel": fn.__name__}))
                except Exception as e:
                    print(json.dumps({"kernel": fn.__name__, "error": str(e)[-600:]}))
    """)
    done = compiled_off_the_interpreter(["-c", script], caches, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(rows) >= 4 and not [r for r in rows if "error" in r], rows
    assert any(r["kernel"] == "einfold_S0_u_hopper" for r in rows)
