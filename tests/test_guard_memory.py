"""Guard memory: a program's kernels write inside the tensors they are given, and
nowhere else.

While a program runs under `Guarded` (a torch function mode), every tensor torch's
factory functions make -- its outputs (launch.output_maker), the intermediate
buffers the generated launcher allocates, a split kernel's scratch -- is placed
inside a larger allocation whose guard regions, before and after it, hold a
sentinel bit pattern; the inputs are placed the same way.  After the call every
guard must hold its pattern and every input its bytes.  A kernel that stores past a
tensor (a launch grid of too many programs, a missing mask on a ragged tile, a
wrong stride) changes a guard, where otherwise it corrupts the heap silently.  The
mode intercepts torch's factories, so no allocation site escapes it and the
runtime needs no hook.

Programs, in float32: the differential corpus (test_differential.CORPUS) at its CPU
size sets (every extent 1, distinct primes, a streamed loop of two ragged tiles,
each extent 0 in turn); launch grids of several factors with one program per value
of an index after tiled ones (where a product of unparenthesised ceil-divisions
counted too many programs); forced splits (scratch states, arrival counters); scans, in chunks (their
totals in scratch) and in an epilogue;
intermediate buffers; and programs drawn by test_fuzz's generator at small ragged
sizes (EINFOLD_GUARD_EXAMPLES, default 40, derandomized).  On the CPU the kernels
run under Triton's interpreter, whose stores are raw writes to the tensors' memory
as on a GPU.  About 50 seconds on two cores, the corpus most of it."""
from __future__ import annotations

import os
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

import compiler
from compiler.random_inputs import random_inputs
from test_differential import CORPUS, DEVICE, NAMES, SETTINGS, _capped, case_of, cpu_size_sets
from test_fuzz import valid_program

warnings.filterwarnings("ignore", message="einfold: no CUDA tensors")
pytestmark = [pytest.mark.filterwarnings("ignore:einfold. no CUDA tensors"),
              pytest.mark.usefixtures("private_cache")]

EXAMPLES = int(os.environ.get("EINFOLD_GUARD_EXAMPLES", "40"))
SIZES = (1, 2, 3, 5, 7, 13, 67)        # of a generated program's indices

# torch's functions that make a tensor: each result is placed between guards
FACTORIES = frozenset({torch.empty, torch.zeros, torch.ones, torch.full, torch.empty_strided,
                       torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like})
ALIGN = 256             # bytes: a placed tensor starts as aligned as torch's allocator places one
MIN_GUARD = 4096        # bytes each side, and twice the tensor's own size up to MAX_GUARD
MAX_GUARD = 1 << 20     # (an autotuner's 256 MB cache-flushing buffer gets this much)


def sentinel(size: int, device) -> torch.Tensor:
    """`size` guard bytes, (89 + 167 k) mod 251: period 251 is prime to every element
    size, so no value a kernel stores, repeated, matches a run of them by chance."""
    return ((torch.arange(size, device=device) * 167 + 89) % 251).to(torch.uint8)


class Guarded(TorchFunctionMode):
    """Place every tensor made while active (and each `place`d one) between guards;
    `damage()` says which guards changed."""

    def __init__(self):
        super().__init__()
        self.placed: list[tuple[torch.Tensor, int, int, str]] = []   # (slab, guard bytes, body bytes, what)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        made = func(*args, **(kwargs or {}))
        if func in FACTORIES and isinstance(made, torch.Tensor):
            return self.place(made, func.__name__)
        return made

    def place(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """A tensor equal to `tensor` (values, shape, strides) inside a guarded slab."""
        body = tensor.untyped_storage().nbytes()
        guard = -(-max(MIN_GUARD, min(2 * body, MAX_GUARD)) // ALIGN) * ALIGN
        slab = torch.empty(2 * guard + body, dtype=torch.uint8, device=tensor.device)
        slab[:guard] = sentinel(guard, tensor.device)
        slab[guard + body:] = sentinel(guard, tensor.device)
        placed = slab[guard:guard + body].view(tensor.dtype).as_strided(tensor.size(), tensor.stride())
        placed.copy_(tensor)
        self.placed.append((slab, guard, body, f"{what} {str(tensor.dtype).removeprefix('torch.')}"
                                                f"{list(tensor.shape)}"))
        return placed

    def damage(self) -> list[str]:
        """Each changed guard: the tensor it surrounds and how far from it the writes reach."""
        found = []
        for slab, guard, body, what in self.placed:
            expected = sentinel(guard, slab.device)
            before = (slab[:guard] != expected).nonzero()
            after = (slab[guard + body:] != expected).nonzero()
            if before.numel():
                found.append(f"{what}: written up to {guard - int(before[0])} bytes before its start")
            if after.numel():
                found.append(f"{what}: written up to {int(after[-1]) + 1} bytes past its end")
        return found


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def run_guarded(program: compiler.Program, inputs: dict) -> list[str]:
    """Run `program` with its inputs and everything it allocates between guards;
    the guards that changed and the inputs it wrote to."""
    guarded = Guarded()
    placed = {k: guarded.place(v, f"input {k}") if isinstance(v, torch.Tensor) else v
              for k, v in inputs.items()}
    with guarded:
        program(**placed)
    written = [f"input {k}: its values changed" for k, v in inputs.items()
               if isinstance(v, torch.Tensor) and not torch.equal(_bytes(placed[k]), _bytes(v))]
    return guarded.damage() + written


def check(program: compiler.Program, extents: dict, seed: int = 0) -> None:
    inputs = random_inputs(program.checked, extents, dtype=torch.float32, seed=seed, device=DEVICE)
    problems = run_guarded(program, inputs)
    assert not problems, f"at {extents}:\n" + "\n".join(problems) + f"\n{program.text}"


# ---------------------------------------------------------------- the harness itself
def test_a_store_past_a_tensor_is_found():
    """The harness sees a write one element before an input and one past an output."""
    guarded = Guarded()
    x = guarded.place(torch.ones(3), "input X")
    with guarded:
        y = torch.empty(2, 3)
    x.as_strided((1,), (1,), x.storage_offset() - 1).fill_(2.0)
    y.as_strided((1,), (1,), y.storage_offset() + 6).fill_(1.0)
    assert guarded.damage() == ["input X float32[3]: written up to 4 bytes before its start",
                                "empty float32[2, 3]: written up to 4 bytes past its end"]


# ---------------------------------------------------------------- the corpus
@pytest.mark.parametrize("name", NAMES)
def test_the_corpus_writes_only_its_outputs(name):
    """float32 at the differential test's CPU sizes: every extent 1, distinct primes
    (ragged tiles everywhere), a streamed loop of two tiles, each extent 0 in turn."""
    case = case_of(CORPUS[name])
    for by_symbol in cpu_size_sets(case, NAMES.index(name), 0).values():
        check(case.triton, case.extents(by_symbol))


# ---------------------------------------------------------------- grids and splits
# one program per value of an index after tiled ones (b after i/16 with h or two column tiles
# before it; a row statistic's optional j among them): the launch grid's product of tile
# counts must be exact in any order of its factors, or extra programs store at b >= len(b)
GRIDS = {
    "heads between tiles": ("O[b,i,h,j] = softmax[m](Q[b,i,h,k] * K[b,m,h,k]) * V[b,m,h,j]",
                            {"b": 2, "i": 13, "h": 3, "j": 7, "m": 11, "k": 5}),
    "batched product": ("C[b,i,j] = A[b,i,k] * B[b,k,j]", {"b": 3, "i": 19, "j": 67, "k": 5}),
    "batched distance as a contraction": ("C[b,i] = min[m](sum[k]((X[b,i,k] - Y[b,m,k]) ** 2))",
                                          {"b": 3, "i": 37, "m": 41, "k": 5}),
    "row statistic beside the output": ("S[b,i,h,m] = Q[b,i,h,k] * K[b,m,h,k]\n"
                                        "O[b,i,h,j] = softmax[m](S[b,i,h,m]) * V[b,m,h,j]\n"
                                        "L[b,h,i] = logsumexp[m](S[b,i,h,m])",
                                        {"b": 2, "i": 17, "h": 3, "m": 7, "k": 5, "j": 5}),
}
SPLITS = {
    "split attention": ("O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k]) * V[b,h,m,j]", 3,
                        {"b": 2, "h": 3, "i": 1, "j": 5, "m": 131, "k": 7}),
    "split logsumexp": ("L[i] = logsumexp[j](X[i,j])", 2, {"i": 3, "j": 67}),
    # a scalar whose split fold streams a nested one over two ragged tiles of 8192 a row
    "split scalar loss": ("L[] = mean[t](logsumexp[v](Z[t,v]))", 3, {"t": 5, "v": 8200}),
    # a column sum over two row indices: the split divides the longer, the second
    "split column sum": ("dG[k] = sum[b, n](dY[b, n, k] * X[b, n, k])", 3, {"b": 2, "n": 37, "k": 5}),
}


@pytest.mark.parametrize("name", sorted(GRIDS))
def test_grids_of_several_factors_launch_no_extra_program(name):
    source, extents = GRIDS[name]
    check(compiler.compile(source, backend="triton"), extents)


@pytest.mark.parametrize("name", sorted(SPLITS))
def test_split_kernels_write_only_their_outputs_and_scratch(name):
    source, split, extents = SPLITS[name]
    program = compiler.compile(source, backend="triton", split=split)
    check(program, extents)
    assert "_partial" in program.backend.source       # the split ran: scratch was placed too


# scans (schedule.bounds.Prefix): t run in order through each program, a ragged last tile; across
# chunks (split=): the chunks' totals in scratch, read back by the scan; in the epilogue after a row's total
SCANS = {
    "a cumsum in chunks": ("C[b,t] = sum[s](where(s <= t, X[b,s], 0.0))", 3, {"b": 3, "s": 2100, "t": 2100}),
    "a suffix logcumsumexp in chunks": ("L[b,t] = logsumexp[s](where(s >= t, X[b,s], -inf))", 3,
                                        {"b": 2, "s": 2100, "t": 2100}),
    "a CDF in the epilogue": ("F[b,t] = sum[s](where(s <= t, P[b,s], 0.0)) / sum[s](P[b,s])", None,
                              {"b": 5, "s": 1037, "t": 1037}),
}


@pytest.mark.parametrize("name", sorted(SCANS))
def test_scans_write_only_their_outputs_and_scratch(name):
    source, split, extents = SCANS[name]
    program = compiler.compile(source, backend="triton", split=split)
    check(program, extents)
    assert "tl.associative_scan" in program.backend.source           # it ran as a scan
    assert ("_totals" in program.backend.source) == bool(split)       # in chunks where asked


BUFFERS = {
    "a materialised sum": ("Y[i] = X[i] / sum[j](X[j])", {"i": 37}),
    "two materialised folds": ("Y[i,j] = max[k](A[i,k]) * sum[k](B[j,k]) + C[i,j]",
                               {"i": 13, "j": 11, "k": 7}),
    # Schedule.materialised: a chained contraction stored over (i, f), a row statistic over i
    "a stored chained contraction": ("Y[i,e] = sum[f](silu(sum[d](X[i,d] * W1[f,d])) * sum[d](X[i,d] * W3[f,d])"
                                     " * W2[e,f])", {"i": 3, "f": 5, "d": 700, "e": 300}),
    "a stored row statistic": ("dG[k] = sum[i](dY[i,k] * X[i,k] * rsqrt(mean[n](X[i,n] ** 2) + eps))",
                               {"i": 5, "k": 700, "n": 700}),
    # sibling folds in one loop over the union of their grids (dK beside dV: each stored by
    # the programs of the first tile of the index it lacks) and a partial sum stored from
    # that loop (ALiBi's slope gradient over (b, h, m)), then summed
    "a backward's shared loop and partial sum": (
        compiler.grad("O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale - A[h] * abs(i - m)) * V[b,h,m,j]",
                      saved=True, wrt=("Q", "K", "V", "A"), backend="reference").text,
        {"b": 2, "h": 3, "i": 19, "m": 23, "k": 5, "j": 3}),
}
# a distance as norms and a contraction (passes/contract.py): its gradient stores the argmin
# and the first side's norms, then contracts the one-hot rows with the other side
BUFFERS["a distance's gradient"] = (
    compiler.grad("C[b,i] = min[m](sum[k]((X[b,i,k] - Y[b,m,k]) ** 2))", saved=True, wrt=("X", "Y"),
                  backend="reference").text, {"b": 2, "i": 37, "m": 41, "k": 5})
# ... and past WHOLE_MAX, where tiles of j recompute dK's field and only the first stores it
BUFFERS["a backward's shared loop over tiles of j"] = (BUFFERS["a backward's shared loop and partial sum"][0],
                                                      {"b": 1, "h": 1, "i": 9, "m": 7, "k": 5, "j": 300})


# a chunked run (schedule/chunks.py): a linear cross-entropy's backward whose dZ[t0, v] would
# outgrow H and W, made 512 of v at a time then a ragged 168, on views of W and dW, dH the sum
# of float32 chunk sums
BUFFERS["a chunked run"] = (compiler.grad(
    "Z[t0, v] = sum[d](H[t0, d] * W[v, d])\nlse[t0] = logsumexp[v](Z[t0, v])\n"
    "L[t0] = where(Y[t0] == -100, 0, lse[t0] - sum[v](where(v == Y[t0], Z[t0, v], 0)))\n"
    "loss = sum[t0](L[t0]) / sum[t0](where(Y[t0] == -100, 0, 1))",
    wrt=("H", "W"), outputs=("loss",), saved=True, backend="reference").text,
    {"t0": 660, "v": 680, "d": 640})


@pytest.mark.parametrize("name", sorted(BUFFERS))
def test_kernels_write_only_inside_their_intermediate_buffers(name):
    source, extents = BUFFERS[name]
    program = compiler.compile(source, backend="triton")
    check(program, extents)
    plan = program.plan(**random_inputs(program.checked, extents, dtype=torch.float32, device=DEVICE))
    assert plan.buffers and (name != "a chunked run" or "run in 2 chunks of v" in plan.chunks)


# ---------------------------------------------------------------- generated programs
@settings(max_examples=EXAMPLES, derandomize=True, **SETTINGS)
@given(data=st.data())
def test_generated_programs_write_only_their_outputs(data):
    source = data.draw(valid_program(), label="program")
    case = case_of(source)
    drawn = {s: data.draw(st.sampled_from(SIZES), label=f"len({str(s).removeprefix('len_')})")
             for s in case.symbols}
    check(case.triton, case.extents(_capped(case, drawn, 1 << 12)), data.draw(st.integers(0, 2 ** 16)))
