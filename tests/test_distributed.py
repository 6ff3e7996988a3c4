"""A reduction sharded across the ranks of a process group (`Program.shard`).

Two processes with the gloo backend (CPU: the Triton backend's kernels under the
interpreter, and the oracle), each given its contiguous part of the sharded
index, uneven and empty parts included; every case must equal the program run
whole in one process.  One spawn runs every case (a process costs seconds to
start); the GPU-marked test runs the same cases with NCCL on two and on four
GPUs."""
import os
import signal
import sys
import tempfile
import time
from queue import Empty

import pytest
import torch
import torch.multiprocessing as mp

import compiler
from compiler.errors import ShardError

pytestmark = pytest.mark.filterwarnings("ignore:einfold. no CUDA tensors")

AFFINE = compiler.summary(           # r after l: the order of the parts matters
    "affine", fields=("A", "B"), identity=(1.0, 0.0), lift=lambda a, b: (a, b),
    combine=lambda l, r: (r.A * l.A, r.A * l.B + r.B), finalize=lambda s: s.B)


def _attention(mask: str) -> str:
    return f"O[i,j] = softmax[m](where({mask}, Q[i,k] * K[m,k] * scale, -inf)) * V[m,j]"


# name -> (source, sharded index, inputs(generator, n) with the sharded extent n, options)
CASES = {
    "attention": ("O[i,j] = softmax[m](Q[i,k] * K[m,k] * scale) * V[m,j]", "m",
                  lambda g, n: {"Q": torch.randn(6, 4, generator=g), "K": torch.randn(n, 4, generator=g),
                                "V": torch.randn(n, 3, generator=g), "scale": 0.5}, {}),
    "causal": (_attention("m <= i"), "m",
               lambda g, n: {"Q": torch.randn(n, 4, generator=g), "K": torch.randn(n, 4, generator=g),
                             "V": torch.randn(n, 3, generator=g), "scale": 0.5}, {}),
    "bottom_right_causal": (_attention("m <= i + len(m) - len(i)"), "m",
                            lambda g, n: {"Q": torch.randn(5, 4, generator=g), "K": torch.randn(n, 4, generator=g),
                                          "V": torch.randn(n, 3, generator=g), "scale": 0.5}, {}),
    "logsumexp": ("L[i] = logsumexp[m](X[i,m])", "m",
                  lambda g, n: {"X": torch.randn(4, n, generator=g) * 30 + 1000}, {}),
    "layernorm": ("mu[i] = mean[k](X[i,k]); var[i] = mean[k]((X[i,k] - mu[i]) ** 2)\n"
                  "Y[i,k] = (X[i,k] - mu[i]) * rsqrt(var[i] + 1e-5) * G[k] + B[k]", "k",
                  lambda g, n: {"X": torch.randn(5, n, generator=g) + 3, "G": torch.randn(n, generator=g),
                                "B": torch.randn(n, generator=g)}, {}),
    # the backward of causal attention (reading the forward's row logsumexp): dQ merges
    # partial sums over the ranks, dK and dV come out sharded like K and V
    "causal_backward": (compiler.grad(_attention("m <= i"), saved=True, backend="reference").text, "m",
                        lambda g, n: {"Q": torch.randn(n, 4, generator=g), "K": torch.randn(n, 4, generator=g),
                                      "V": torch.randn(n, 3, generator=g), "scale": 0.5,
                                      "dO": torch.randn(n, 3, generator=g), "O": torch.randn(n, 3, generator=g),
                                      "lse_O": torch.randn(n, generator=g) + 2}, {}),
    # tensor parallelism: a cross-entropy whose classifier (so its logits) is split over the
    # vocabulary; each rank folds its classes' logits into (r, l) and the label's logit, and
    # only those per-row states are exchanged, never the [tokens, vocab] logits
    "tensor_parallel_cross_entropy": (
        "Z[t,v] = sum[d](H[t,d] * W[v,d])\n"
        "L[t] = where(Y[t] == -100, 0, logsumexp[v](Z[t,v]) - sum[v](where(v == Y[t], Z[t,v], 0)))", "v",
        lambda g, n: {"H": torch.randn(5, 4, generator=g), "W": torch.randn(n, 4, generator=g),
                      "Y": torch.tensor([n - 1, 0, -100, n // 2, 1])}, {}),
    "affine_scan": ("Y[i] = affine[m](A[i,m], B[i,m])", "m",
                    lambda g, n: {"A": torch.rand(3, n, generator=g) + 0.5, "B": torch.randn(3, n, generator=g)},
                    {"summaries": [AFFINE]}),
}
# the ranks' part lengths, rank 0 first (per number of ranks), and the layout
SPLITS = {"uneven": ({2: (5, 8), 4: (5, 8, 3, 6)}, "contiguous"),
          "empty_first": ({2: (0, 9), 4: (0, 9, 2, 0)}, "contiguous"),
          "zigzag": ({2: (6, 8), 4: (6, 8, 4, 2)}, "zigzag")}
# context parallelism (`shard(index, rows=...)`): the rows sharded too, the inputs over the
# index passed around the ring.  name -> (source, index, rows, inputs(generator, n rows,
# n index), options); the rows' part lengths per split below
RING_CASES = {
    "ring_causal": (_attention("m <= i"), "m", "i",
                    lambda g, r, n: {"Q": torch.randn(r, 4, generator=g), "K": torch.randn(n, 4, generator=g),
                                     "V": torch.randn(n, 3, generator=g), "scale": 0.5}, {}),
    "ring_bottom_right_causal": (_attention("m <= i + len(m) - len(i)"), "m", "i",
                                 lambda g, r, n: {"Q": torch.randn(r, 4, generator=g) * 20,
                                                  "K": torch.randn(n, 4, generator=g),
                                                  "V": torch.randn(n, 3, generator=g), "scale": 0.5}, {}),
    "ring_affine_scan": ("Y[i] = affine[m](A[m] * X[i], B[m])", "m", "i",
                         lambda g, r, n: {"X": torch.rand(r, generator=g) + 0.5,
                                          "A": torch.rand(n, generator=g) + 0.5, "B": torch.randn(n, generator=g)},
                         {"summaries": [AFFINE]}),
}
RING_ROWS = {"uneven": {2: (3, 4), 4: (3, 4, 1, 2)}, "empty_first": {2: (0, 5), 4: (0, 5, 0, 3)},
             "zigzag": {2: (4, 6), 4: (4, 6, 2, 2)}}
RING_AUTOGRAD = ("ring_causal", "ring_bottom_right_causal")     # under autograd, contiguous and zigzag
BACKENDS = ("triton", "reference")
WORLD = 2


def _part(value, index_axes, a, b):
    for axis in index_axes:
        value = value.narrow(axis, a, b - a)
    return value


def _split(name):
    """The part lengths (one per rank of this process group) and the layout of a split."""
    lengths, layout = SPLITS[name]
    return lengths[torch.distributed.get_world_size()], layout


def _sharded_axes(program, index):
    """input name -> the axes where it is indexed by the sharded index"""
    from compiler.ir import Access, walk
    axes = {}
    for s in program.checked.statements:
        for n in walk(s.expr):
            if isinstance(n, Access):
                axes.setdefault(n.tensor, set()).update(d for d, ix in enumerate(n.indices) if ix == index)
    return {k: sorted(v) for k, v in axes.items() if v}


def _pieces(lengths, layout, rank):
    """This rank's parts of an axis cut into `lengths` (rank 0 first) in `layout`, as (start, stop)."""
    if layout == "contiguous":
        a = sum(lengths[:rank])
        return [(a, a + lengths[rank])]
    halves = [n // 2 for n in lengths] + [n // 2 for n in reversed(lengths)]
    world = len(lengths)
    starts = [sum(halves[:g]) for g in range(2 * world)]
    return [(starts[g], starts[g] + halves[g]) for g in (rank, 2 * world - 1 - rank)]


def run_case(name, split, backend, rank, device):
    source, index, make, options = CASES[name]
    lengths, layout = _split(split)
    program = compiler.compile(source, backend=backend, **options)
    dtype = torch.float64 if backend == "reference" else torch.float32
    inputs = {k: v.to(device, dtype if v.is_floating_point() else v.dtype) if isinstance(v, torch.Tensor) else v
              for k, v in make(torch.Generator().manual_seed(1), sum(lengths)).items()}
    whole = program(**inputs)
    whole = whole if isinstance(whole, tuple) else (whole,)
    pieces = _pieces(lengths, layout, rank)

    def cut(value, axes):
        return torch.cat([_part(value, axes, a, b) for a, b in pieces], axes[0]) if axes else value

    axes = _sharded_axes(program, index)
    part = {k: cut(v, axes.get(k, ())) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    sharded = program.shard(index, layout=layout)
    got = sharded(**part)
    got = got if isinstance(got, tuple) else (got,)
    # an output over the sharded index comes out sharded: compare with this rank's parts
    statements = {s.name: s for s in program.checked.statements}
    want = tuple(cut(w, [d for d, ix in enumerate(statements[o].indices) if ix == index])
                 for o, w in zip(program.outputs, whole))
    plan = str(sharded.plan(**part))
    return [(g.cpu(), w.cpu()) for g, w in zip(got, want)], plan


def _ring_case(name, split, backend, device):
    """(program, index, rows, the lengths of the index's and the rows' parts, layout, the
    whole inputs) of a RING_CASES case under a split."""
    source, index, rows, make, options = RING_CASES[name]
    lengths, layout = _split(split)
    row_lengths = RING_ROWS[split][len(lengths)]
    program = compiler.compile(source, backend=backend, **options)
    dtype = torch.float64 if backend == "reference" else torch.float32
    inputs = {k: v.to(device, dtype) if isinstance(v, torch.Tensor) else v
              for k, v in make(torch.Generator().manual_seed(1), sum(row_lengths), sum(lengths)).items()}
    return program, index, rows, lengths, row_lengths, layout, inputs


def run_ring_case(name, split, backend, rank, device):
    program, index, rows, lengths, row_lengths, layout, inputs = _ring_case(name, split, backend, device)
    whole = program(**inputs)
    whole = whole if isinstance(whole, tuple) else (whole,)

    def cut(value, axes, pieces):
        return torch.cat([_part(value, axes, a, b) for a, b in pieces], axes[0]) if axes else value

    by_index, by_rows = _sharded_axes(program, index), _sharded_axes(program, rows)
    mine, my_rows = _pieces(lengths, layout, rank), _pieces(row_lengths, layout, rank)
    part = {k: cut(cut(v, by_index.get(k, ()), mine), by_rows.get(k, ()), my_rows) if isinstance(v, torch.Tensor)
            else v for k, v in inputs.items()}
    sharded = program.shard(index, layout=layout, rows=rows)
    calls, run = [], sharded.local._run
    sharded.local._run = lambda local, **out: calls.append(local) or run(local, **out)     # counts the local calls
    got = sharded(**part)
    got = got if isinstance(got, tuple) else (got,)
    want = tuple(cut(w, [0], my_rows) for w in whole)       # every output here is over the rows first
    return [(g.cpu(), w.cpu()) for g, w in zip(got, want)], f"{sharded.plan(**part)}\nlocal calls: {len(calls)}"


def run_autograd_case(layout, backend, rank, device):
    """Causal attention under autograd, K and V sharded: Q's gradient is whole on
    every rank, K's and V's are this rank's parts of the whole program's."""
    source, index, make, _ = CASES["causal"]
    lengths = _split("uneven" if layout == "contiguous" else "zigzag")[0]
    program = compiler.compile(source, backend=backend)
    dtype = torch.float64 if backend == "reference" else torch.float32
    inputs = {k: v.to(device, dtype) if isinstance(v, torch.Tensor) else v
              for k, v in make(torch.Generator().manual_seed(1), sum(lengths)).items()}
    weight = torch.randn(sum(lengths), 3, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    whole = {k: v.clone().requires_grad_() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    (program(**whole) * weight).sum().backward()
    pieces = _pieces(lengths, layout, rank)
    def cut(t):
        return torch.cat([t[a:b] for a, b in pieces])
    ours = {"Q": inputs["Q"].clone().requires_grad_(), "K": cut(inputs["K"]).requires_grad_(),
            "V": cut(inputs["V"]).requires_grad_(), "scale": inputs["scale"]}
    out = program.shard(index, layout=layout)(**ours)
    (out * weight).sum().backward()
    return [(ours["Q"].grad.cpu(), whole["Q"].grad.cpu()), (ours["K"].grad.cpu(), cut(whole["K"].grad).cpu()),
            (ours["V"].grad.cpu(), cut(whole["V"].grad).cpu())], ""


def run_ring_autograd_case(name, layout, backend, rank, device):
    """Attention with the rows sharded too (the ring), under autograd: each rank's
    gradients of its parts of Q, K and V equal those parts of the whole program's.
    dQ runs on the forward's ring (K and V travel), dK and dV on the ring with the
    roles swapped (Q, dO, the row statistics and rowsum(dO O) travel)."""
    program, index, rows, lengths, row_lengths, layout, inputs = _ring_case(
        name, "uneven" if layout == "contiguous" else "zigzag", backend, device)
    dtype = inputs["Q"].dtype
    weight = torch.randn(sum(row_lengths), 3, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    whole = {k: v.clone().requires_grad_() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    (program(**whole) * weight).sum().backward()
    by_index, by_rows = _sharded_axes(program, index), _sharded_axes(program, rows)
    mine, my_rows = _pieces(lengths, layout, rank), _pieces(row_lengths, layout, rank)

    def cut(t, name):
        pieces = mine if name in by_index else my_rows
        return torch.cat([t[a:b] for a, b in pieces])
    ours = {k: cut(v, k).detach().requires_grad_() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    out = program.shard(index, layout=layout, rows=rows)(**ours)
    (out * cut(weight, "O")).sum().backward()
    return [(ours[k].grad.cpu(), cut(whole[k].grad, k).cpu()) for k in ("Q", "K", "V")], ""


def run_tensor_parallel_autograd_case(backend, rank, device):
    """The cross-entropy with its classifier split over the vocabulary, under autograd:
    the hidden states' gradient is whole on every rank, the classifier's is this rank's
    rows of the whole program's."""
    source, index, make, _ = CASES["tensor_parallel_cross_entropy"]
    lengths = _split("uneven")[0]
    program = compiler.compile(source, backend=backend)
    dtype = torch.float64 if backend == "reference" else torch.float32
    inputs = make(torch.Generator().manual_seed(1), sum(lengths))
    h, w, y = inputs["H"].to(device, dtype), inputs["W"].to(device, dtype), inputs["Y"].to(device)
    (a, b), = _pieces(lengths, "contiguous", rank)
    whole_h, whole_w = h.clone().requires_grad_(), w.clone().requires_grad_()
    program(H=whole_h, W=whole_w, Y=y).sum().backward()
    ours_h, ours_w = h.clone().requires_grad_(), w[a:b].clone().requires_grad_()
    program.shard(index)(H=ours_h, W=ours_w, Y=y).sum().backward()
    return [(ours_h.grad.cpu(), whole_h.grad.cpu()), (ours_w.grad.cpu(), whole_w.grad[a:b].cpu())], ""


def _by_value(outcome):
    """An outcome whose tensors are nested lists: a tensor put on a queue is shared
    through a descriptor that dies with the process that made it."""
    if isinstance(outcome, str):
        return outcome
    pairs, plan = outcome
    return [(g.tolist(), w.tolist(), str(g.dtype)) for g, w in pairs], plan


def _tensors(outcome):
    if isinstance(outcome, str):
        return outcome
    pairs, plan = outcome
    dtype = {str(t): t for t in (torch.float32, torch.float64)}
    return [(torch.tensor(g, dtype=dtype[d]), torch.tensor(w, dtype=dtype[d])) for g, w, d in pairs], plan


def _worker(rank, world, store, device_kind, queue):
    import faulthandler

    import torch.distributed as dist
    faulthandler.register(signal.SIGUSR1, all_threads=True)     # `timeout -s USR1`: where each rank waits
    backend = "nccl" if device_kind == "cuda" else "gloo"
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    device = torch.device(device_kind, rank) if device_kind == "cuda" else torch.device("cpu")
    backends = [be for be in BACKENDS if not (device_kind == "cuda" and be == "reference")]
    # (name, split or layout, backend, the function that runs it)
    runs = [(name, split, be, run) for cases, run in ((CASES, run_case), (RING_CASES, run_ring_case))
            for name in cases for split in SPLITS for be in backends]
    runs += [("autograd", layout, be, lambda _, *rest: run_autograd_case(*rest))
             for layout in ("contiguous", "zigzag") for be in backends]
    runs += [(f"{name}_autograd", layout, be, lambda full, *rest: run_ring_autograd_case(full[:-9], *rest))
             for name in RING_AUTOGRAD for layout in ("contiguous", "zigzag") for be in backends]
    runs += [("tensor_parallel_autograd", "contiguous", be, lambda _, __, *rest: run_tensor_parallel_autograd_case(*rest))
             for be in backends]
    try:
        for name, split, be, run in runs:
            try:
                if device_kind == "cuda":           # seen with pytest -s: which case a slow run is in
                    print(f"rank {rank}: {name} {split} {be}", file=sys.stderr, flush=True)
                queue.put((rank, name, split, be, _by_value(run(name, split, be, rank, device))))
            except Exception as e:           # reported, and the test fails naming it
                queue.put((rank, name, split, be, repr(e)))
    finally:
        dist.destroy_process_group()


def run_everywhere(device_kind, world=WORLD):
    context = mp.get_context("spawn")
    queue = context.Queue()
    store = tempfile.mktemp(prefix="einfold-store-")
    processes = [context.Process(target=_worker, args=(r, world, store, device_kind, queue))
                 for r in range(world)]
    for p in processes:
        p.start()
    expected = world * ((len(CASES) + len(RING_CASES)) * len(SPLITS) + 3 + 2 * len(RING_AUTOGRAD)) * (1 if device_kind == "cuda" else
                                                                              len(BACKENDS))
    results = {}
    for _ in range(expected):
        try:
            rank, name, split, be, outcome = queue.get(timeout=900 if device_kind == "cpu" else 240)
        except Empty:           # a rank hangs or died: each live rank prints where it is, then the test fails
            for p in processes:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGUSR1)
            time.sleep(5)
            for p in processes:
                p.kill()
            done = sorted({(r, n, sp, b) for r, n, sp, b in results})
            raise AssertionError(f"no result for {device_kind} case {len(results) + 1} of {expected} "
                                 f"(ranks alive: {[p.pid for p in processes if p.is_alive()]}, exit codes "
                                 f"{[p.exitcode for p in processes]}); the last received: {done[-world:]}")
        results[rank, name, split, be] = _tensors(outcome)
    for p in processes:
        p.join(timeout=60)
    if os.path.exists(store):
        os.remove(store)
    return results


@pytest.fixture(scope="module")
def gloo_results():
    return run_everywhere("cpu")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("name", [*CASES, *RING_CASES])
def test_two_gloo_ranks_equal_the_whole_program(gloo_results, name, split, backend):
    # the ring cases (rows sharded too) exchange K/V around the ring, the others states
    exchange = "ring: 1 step(s)" if name in RING_CASES else "all-gather of"
    for rank in range(WORLD):
        outcome = gloo_results[rank, name, split, backend]
        assert not isinstance(outcome, str), f"rank {rank}: {outcome}"
        pairs, plan = outcome
        tol = {"rtol": 1e-9, "atol": 1e-9} if backend == "reference" else {"rtol": 2e-5, "atol": 2e-5}
        for got, want in pairs:
            torch.testing.assert_close(got, want, **tol)
        assert exchange in plan and plan.count("all-gather") == (exchange == "all-gather of")


def test_four_gloo_ranks_equal_the_whole_program():
    # every case, the ring's gradients included, on four ranks (three ring steps, zigzag
    # parts of one key, empty parts on two ranks), both backends
    results = run_everywhere("cpu", 4)
    failures = {k: v for k, v in results.items() if isinstance(v, str)}
    assert not failures
    assert {rank for rank, *_ in results} == {0, 1, 2, 3}
    for (rank, name, split, backend), (pairs, plan) in results.items():
        tol = {"rtol": 1e-9, "atol": 1e-9} if backend == "reference" else {"rtol": 1e-4, "atol": 1e-5}
        for got, want in pairs:
            torch.testing.assert_close(got, want, **tol, msg=f"{name} {split} {backend} rank {rank}")
        assert name not in RING_CASES or "ring: 3 step(s)" in plan


def test_a_ring_part_bounds_its_loop_by_both_global_starts(gloo_results):
    _, plan = gloo_results[0, "ring_causal", "uneven", "triton"]
    assert "loop m [bounds: m <= i + (-m_start + i_start)]" in plan


def test_a_ring_skips_the_parts_a_mask_hides(gloo_results):
    # uneven: rank 0 holds rows 0-2 and keys 0-4, rank 1 rows 3-6 and keys 5-12. Under a
    # causal mask rank 0's rows see none of rank 1's keys: one call (its own); rank 1 two.
    # zigzag: rank 0 holds rows 0-1 and 8-9, rank 1 rows 2-4 and 5-7; the key parts are
    # 0-2, 3-6, 7-10, 11-13. Of the 8 pairs of row and key parts a rank meets, rank 0's
    # rows see 1 + 3 key parts, rank 1's 2 + 3
    def calls(rank, name, split):
        return int(gloo_results[rank, name, split, "triton"][1].rsplit("local calls: ", 1)[1])
    assert (calls(0, "ring_causal", "uneven"), calls(1, "ring_causal", "uneven")) == (1, 2)
    assert (calls(0, "ring_causal", "zigzag"), calls(1, "ring_causal", "zigzag")) == (4, 5)
    # no mask: every pair runs; rows that see no key at all still get the identity state
    assert calls(0, "ring_affine_scan", "uneven") == calls(1, "ring_affine_scan", "uneven") == 2
    assert calls(0, "ring_causal", "empty_first") == 1


def test_the_balanced_layout_is_zigzag_under_a_causal_mask():
    causal = compiler.compile(_attention("m <= i"), backend="reference")
    assert causal.shard("m", rows="i", layout="balanced").layout == "zigzag"
    assert causal.shard("m", layout="balanced").layout == "zigzag"
    full = compiler.compile("O[i,j] = softmax[m](Q[i,k] * K[m,k]) * V[m,j]", backend="reference")
    assert full.shard("m", rows="i", layout="balanced").layout == "contiguous"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_gradients_flow_through_a_sharded_call(gloo_results, layout, backend):
    for rank in range(WORLD):
        outcome = gloo_results[rank, "autograd", layout, backend]
        assert not isinstance(outcome, str), f"rank {rank}: {outcome}"
        tol = {"rtol": 1e-9, "atol": 1e-9} if backend == "reference" else {"rtol": 1e-4, "atol": 1e-5}
        for got, want in outcome[0]:
            torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("name", RING_AUTOGRAD)
def test_gradients_flow_through_the_ring(gloo_results, name, layout, backend):
    for rank in range(WORLD):
        outcome = gloo_results[rank, f"{name}_autograd", layout, backend]
        assert not isinstance(outcome, str), f"rank {rank}: {outcome}"
        tol = {"rtol": 1e-9, "atol": 1e-9} if backend == "reference" else {"rtol": 1e-4, "atol": 1e-5}
        for got, want in outcome[0]:
            assert got.abs().max() > 0
            torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tensor_parallel_cross_entropy_has_its_gradients(gloo_results, backend):
    for rank in range(WORLD):
        outcome = gloo_results[rank, "tensor_parallel_autograd", "contiguous", backend]
        assert not isinstance(outcome, str), f"rank {rank}: {outcome}"
        tol = {"rtol": 1e-9, "atol": 1e-9} if backend == "reference" else {"rtol": 1e-4, "atol": 1e-5}
        for got, want in outcome[0]:
            torch.testing.assert_close(got, want, **tol)


def test_a_causal_part_bounds_its_loop_by_its_global_start(gloo_results):
    _, plan = gloo_results[0, "causal", "uneven", "triton"]
    assert "loop m [bounds: m <= i - m_start]" in plan
    _, plan = gloo_results[1, "causal", "zigzag", "triton"]
    assert "zigzag layout, 2 part(s) per rank" in plan


def test_a_zigzag_part_of_odd_length_is_an_error():
    # in a process group of one, in this process: 9 keys do not cut into two halves
    import torch.distributed as dist
    store = tempfile.mktemp(prefix="einfold-store-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        program = compiler.compile("L[i] = logsumexp[m](X[i,m])", backend="reference").shard("m", layout="zigzag")
        with pytest.raises(ShardError, match="odd length"):
            program(X=torch.randn(2, 9, dtype=torch.float64))
        with pytest.raises(ShardError, match="layout must be one of contiguous, zigzag, balanced"):
            compiler.compile("L[i] = logsumexp[m](X[i,m])", backend="reference").shard("m", layout="ring")
        # one rank holding the whole index: the program itself
        x = torch.randn(2, 8, dtype=torch.float64)
        torch.testing.assert_close(program(X=x), torch.logsumexp(x, 1))
    finally:
        dist.destroy_process_group()


def test_a_ring_is_decided_once_per_lengths_and_writes_its_states_in_place():
    # in a process group of one, zigzag: rows and keys in parts 0 and 1 (the halves); under a
    # causal mask rows of part 0 see no key of part 1, so 3 of the 4 pairs run
    import torch.distributed as dist
    store = tempfile.mktemp(prefix="einfold-store-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        for backend in BACKENDS:
            program = compiler.compile(_attention("m <= i"), backend=backend)
            ring = program.shard("m", rows="i", layout="zigzag")
            merged = []
            merge = ring.merge._run
            ring.merge._run = lambda inputs, **out: merged.append(inputs) or merge(inputs, **out)
            for n in (6, 6, 8):
                g = torch.Generator().manual_seed(n)
                q, k, v = (torch.randn(n, 4, generator=g) for _ in range(3))
                torch.testing.assert_close(ring(Q=q, K=k, V=v, scale=0.5), program(Q=q, K=k, V=v, scale=0.5),
                                           rtol=1e-5, atol=1e-6)
            assert len(ring._rings) == 2            # the second call of 6 rows reused the first's ring
            decided, _ = ring._rings[next(iter(ring._rings))]
            assert decided.slots == (1, 2) and [len(pairs) for pairs in decided.steps] == [3]
            # each merge reads one buffer per state, every part's states in their slot
            states = merged[-1]
            assert [states[name].shape[0] for name in ring.sharded.states] == [2, 2, 2]
            assert len({states[name].untyped_storage().data_ptr() for name in ring.sharded.states}) == 3
    finally:
        dist.destroy_process_group()


def test_a_ring_over_a_group_without_cpu_tensors_exchanges_lengths_over_a_gloo_group_beside_it(monkeypatch):
    # the ring reads its lengths on the host, over a group that moves CPU tensors: a gloo
    # group is that group itself; for another backend (NCCL, here pretended) a gloo group of
    # the same ranks is made once beside it
    import torch.distributed as dist

    from compiler import distributed
    store = tempfile.mktemp(prefix="einfold-store-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        assert distributed._host_group(None) is None
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
        program = compiler.compile(_attention("m <= i"), backend="reference")
        ring = program.shard("m", rows="i")
        groups, gather = [], ring._gather
        ring._gather = lambda flat, world, group=None: groups.append(group) or gather(flat, world, group)
        for n in (5, 7):
            q, k, v = (torch.randn(n, 4, dtype=torch.float64) for _ in range(3))
            torch.testing.assert_close(ring(Q=q, K=k, V=v, scale=0.5), program(Q=q, K=k, V=v, scale=0.5))
        assert list(distributed._HOST_GROUPS) == [dist.group.WORLD]        # one, made at the first call
        made = distributed._HOST_GROUPS[dist.group.WORLD]
        assert made is not dist.group.WORLD and dist.get_process_group_ranks(made) == [0]
        assert made.name() == "gloo"
        assert groups == [made, made]                   # both calls exchanged their lengths over it
        assert distributed._host_group(None) is made
    finally:
        distributed._HOST_GROUPS.clear()
        dist.destroy_process_group()


def _refusing_worker(rank, store, queue):
    """Rank 1 of two gloo ranks passes a Q that does not bind, then a zigzag part of odd
    length, then both pass good inputs; then, K and V sharded alone, a K that does not
    bind, then good inputs: what each call gives each rank."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    program = compiler.compile(_attention("m <= i"), backend="reference")
    ring = program.shard("m", rows="i", layout="zigzag")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, 4, generator=g, dtype=torch.float64) for _ in range(3))
    # zigzag: rank 0 holds parts 0 and 3 of 2 rows each, rank 1 parts 1 and 2
    halves = [slice(2 * p, 2 * p + 2) for p in ((0, 3) if rank == 0 else (1, 2))]
    part = {n: torch.cat([t[h] for h in halves]) for n, t in (("Q", q), ("K", k), ("V", v))}
    calls = [{**part, "Q": torch.randn(4, 5, dtype=torch.float64)} if rank == 1 else part,
             {**part, "Q": part["Q"][:3]} if rank == 1 else part,
             part]
    # K and V sharded alone (every rank holds every row): a K that does not bind on rank 1
    keys = program.shard("m", layout="zigzag")
    kv_calls = [{"Q": q, "K": part["K"][:, :3] if rank == 1 else part["K"], "V": part["V"]},
                {"Q": q, "K": part["K"], "V": part["V"]}]
    outcomes = []
    try:
        for sharded, inputs in [(ring, c) for c in calls] + [(keys, c) for c in kv_calls]:
            try:
                outcomes.append(sharded(**inputs, scale=0.5))
            except Exception as e:
                outcomes.append(f"{type(e).__name__}: {e}")
        whole = program(Q=q, K=k, V=v, scale=0.5)
        want = torch.cat([whole[h] for h in halves])
        queue.put((rank, outcomes[:2] + outcomes[3:4],
                   bool(torch.allclose(outcomes[2], want) and torch.allclose(outcomes[4], whole))))
    finally:
        dist.destroy_process_group()


def test_a_rank_whose_inputs_fail_stops_every_rank():
    # a rank that cannot bind its inputs, or whose part no layout takes, raises; the others
    # raise too instead of waiting for it, and the next call runs on all of them (the ring,
    # and K/V sharded alone)
    context = mp.get_context("spawn")
    queue, store = context.Queue(), tempfile.mktemp(prefix="einfold-store-")
    processes = [context.Process(target=_refusing_worker, args=(r, store, queue)) for r in range(2)]
    for p in processes:
        p.start()
    results = {}
    for _ in processes:
        rank, outcomes, good = queue.get(timeout=300)
        results[rank] = outcomes, good
    for p in processes:
        p.join(timeout=60)
    refused = ("ShardError: shard error: rank 1 could not bind its inputs (the error is raised there): "
               "the call runs on no rank")
    (bad_bind, odd, bad_key), good = results[1]
    assert bad_bind.startswith("BindError") and "index 'k' has extent" in bad_bind
    assert odd.startswith("ShardError") and "rank 1's part has an odd length (3)" in odd and good
    assert bad_key.startswith("BindError") and "index 'k' has extent" in bad_key
    (bad_bind, odd, bad_key), good = results[0]
    assert bad_bind == refused and bad_key == refused
    assert odd.startswith("ShardError") and "rank 1's part has an odd length (3)" in odd and good


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_nccl_ranks_equal_the_whole_program(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    results = run_everywhere("cuda", world)
    failures = {k: v for k, v in results.items() if isinstance(v, str)}
    assert not failures
    for (rank, name, split, _), (pairs, _) in results.items():
        for got, want in pairs:
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, msg=f"{name} {split} rank {rank}")


# ---------------------------------------------------------------- errors (no process group needed)
def test_sharding_an_index_no_reduction_runs_over_is_an_error():
    program = compiler.compile("Y[i,k] = X[i,k] * 2", backend="reference")
    with pytest.raises(ShardError, match="no reduction runs over the sharded index 'k'"):
        program.shard("k")
    with pytest.raises(ShardError, match="index 'q': the program has no such index"):
        program.shard("q")


def test_a_reduction_over_a_part_inside_another_is_an_error():
    program = compiler.compile("Y[i] = sum[m](exp(X[i,m] - max[n](X[i,n] * X[i,m])))", backend="reference")
    with pytest.raises(ShardError, match="sits inside another one") as caught:
        program.shard("m")
    assert "max[n]" in str(caught.value)


def test_a_call_without_a_process_group_is_an_error():
    program = compiler.compile("L[i] = logsumexp[m](X[i,m])", backend="reference").shard("m")
    x = torch.randn(2, 3, dtype=torch.float64)
    with pytest.raises(ShardError, match="init_process_group"):
        program(X=x)
    with pytest.raises(ShardError, match="init_process_group"):
        program(X=x.requires_grad_())


def test_the_cli_prints_the_local_and_merge_programs(capsys):
    from compiler.cli import main
    assert main(["ir", "--shard", "m", "-e", "L[i] = logsumexp[m](X[i,m])"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# sharded over m: each rank runs\nS0_r[i] = fold1_r_l[m](X[i, m]).r\n")
    assert "fold1_r_l_states[rank](S0_r[rank, i], S0_l[rank, i])" in out
    assert main(["ir", "--shard", "q", "-e", "L[i] = logsumexp[m](X[i,m])"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot shard index 'q'" in err


def test_renamed_indices_shard_into_the_same_programs():
    from compiler.passes.shard import shard
    spellings = [_attention("m <= i"),
                 "O[qp,j] = softmax[kp](where(kp <= qp, Q[qp,k] * K[kp,k] * scale, -inf)) * V[kp,j]"]
    texts = [str(shard(compiler.compile(src, backend="reference").factorised, index, rows))
             for src, index, rows in zip(spellings, ("m", "kp"), ("i", "qp"))]
    assert texts[1].replace("qp", "i").replace("kp", "m") == texts[0]
    # the gradient of K and V on the ring with the roles swapped, its row-local fold computed ahead
    texts = [str(shard(compiler.compile(src, backend="reference")._gradient(("K", "V"), saved=True).factorised,
                       rows, index)) for src, index, rows in zip(spellings, ("m", "kp"), ("i", "qp"))]
    assert texts[0].startswith("# each rank first computes")
    # a state keeps the order of the statement that reads it: the merge reads dK[m, k] along its rows
    assert "S0_acc[m, k] = sum[i](" in texts[0] and "sum_states[rank](S0_acc[rank, m, k])" in texts[0]
    assert texts[1].replace("qp", "i").replace("kp", "m") == texts[0]


def test_what_sharding_the_rows_too_refuses():
    attention = compiler.compile(_attention("m <= i"), backend="reference")
    with pytest.raises(ShardError, match="rows index 'm' is the sharded index 'm'"):
        attention.shard("m", rows="m")
    with pytest.raises(ShardError, match="index 'r': the program has no such index"):
        attention.shard("m", rows="r")
    with pytest.raises(ShardError, match="'B' is indexed by the rows index 'i' and by the sharded index 'm'"):
        compiler.compile("O[i,j] = softmax[m](Q[i,k] * K[m,k] + B[i,m]) * V[m,j]",
                         backend="reference").shard("m", rows="i")
    with pytest.raises(ShardError, match="a reduction over the rows index 'i'"):
        compiler.compile("Y[j] = sum[m](X[m] * W[m, j]) + sum[i](Z[i, j])", backend="reference").shard("m", rows="i")
    with pytest.raises(ShardError, match="output 'P' varies over the sharded index 'm'"):
        compiler.compile("P[i,m] = softmax[m](X[i] * Y[m])", backend="reference").shard("m", rows="i")
    q, k, v = (torch.randn(4, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    weighted = compiler.compile("O[i,j] = softmax[m](Q[i,k] * K[m,k] * W[k]) * V[m,j]", backend="reference")
    with pytest.raises(ShardError, match="the gradient of 'W' is not derived with the rows 'i' sharded: 'W' is "
                                         "read at neither the rows nor the sharded index 'm'"):
        weighted.shard("m", rows="i")(Q=q, K=k, V=v, W=torch.ones(3, dtype=torch.float64, requires_grad=True))


def test_the_cli_prints_the_ring_programs_with_rows(capsys):
    from compiler.cli import main
    assert main(["ir", "--shard", "m", "--rows", "i", "-e", _attention("m <= i")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# sharded over m; rows i sharded too, the inputs over the index passed around a ring")
    assert "where(m + m_start <= i + i_start" in out
    assert "# states of every part stacked along rank (global order)" in out
    assert main(["ir", "--rows", "i", "-e", _attention("m <= i")]) == 2
    assert "needs --shard INDEX" in capsys.readouterr().err


@pytest.mark.parametrize("rows", [None, "i"])
def test_a_sharded_gradient_keeps_its_statistics_out_of_its_dtype(rows):
    # the saved row logsumexp is float32 beside bf16 tensors: as in the unsharded gradient
    # program, it must not make the parts' kernels (and their tl.dots) float32
    program = compiler.compile(_attention("m <= i"), backend="triton")
    sharded = program.shard("m", rows=rows)
    gradient = sharded._gradient(("K", "V") if rows else ("Q", "K", "V"))
    x = torch.empty(256, 64, dtype=torch.bfloat16)
    inputs = {"Q": x, "K": x, "V": x, "scale": 0.5, "dO": x, "O": x, "lse_O": torch.empty(256),
              "T0": torch.empty(256),         # D = rowsum(dO O), computed ahead on the ring of dK, dV
              **{name: torch.zeros((), dtype=torch.int64) for name in (
                  gradient.sharded.start, gradient.sharded.total, gradient.sharded.rows_start,
                  gradient.sharded.rows_total) if name}}
    local = gradient.local
    binding = local.binder({k: v for k, v in inputs.items() if k in gradient._local_inputs})
    assert "; bfloat16;" in str(local.backend.specialised_for(binding, sm_count=132, arch=90))


def test_a_fold_over_the_travelling_inputs_travels_computed():
    # on the ring of dK and dV (the inputs over the rows travel), D[i] = sum[j](O dO)
    # reads only travelling inputs: each rank computes it once on its own rows, and it travels
    # in O's place (the whole gradient program stores it once too)
    ring = compiler.compile(_attention("m <= i"), backend="reference").shard("m", rows="i")
    keys = ring._gradient(("K", "V"))
    assert str(keys.sharded).startswith("# each rank first computes, on its own part (travelling with it)\n"
                                        "T0[i] = sum[j](O[i, j] * dO[i, j])\n# sharded over i;")
    reads = {i.name for i in keys.sharded.local.inputs}
    assert "T0" in reads and "O" not in reads and keys._cut["T0"] == (0,)
    # the forward's folds and dQ's read the rows' side in every fold: nothing to compute ahead
    assert ring.sharded.precomputed is None and ring._gradient(("Q",)).sharded.precomputed is None
