"""Prefix results (issue 42, item 4): a fold whose one index s is masked by a single
relation to an output index t (`s <= t`, `s < t`; a suffix: `s >= t`, `s > t`),
and that reads t nowhere else, is the fold of every prefix of its elements.  The
Triton backend runs t in order through each program, tile by tile: the elements
scanned within a tile by the summary's combine, the state of the tiles before
carried in (schedule.bounds.Prefix).  cumsum, an exclusive and a reversed cumsum,
cummax, cummin, cumprod, logcumsumexp, an ordered user summary's recurrence forward
and backward, and a selective scan (Mamba's, its state held whole beside the tile)
match float64 torch or a sequential loop, with gradients; extents 0, 1, primes and
several tiles; NaN and infinities as torch has them."""
import warnings

import pytest
import torch

import compiler

pytestmark = pytest.mark.usefixtures("private_cache")
warnings.filterwarnings("ignore", message="einfold: no CUDA tensors", category=RuntimeWarning)

AFFINE = compiler.summary("affine", fields=("A", "B"), identity=(1.0, 0.0), lift=lambda a, b: (a, b),
                          combine=lambda l, r: (r.A * l.A, r.A * l.B + r.B), finalize=lambda s: s.B)
SELECTIVE_SCAN = """
H[b, d, n, t] = affine[s](where(s <= t, exp(D[b, d, s] * A[d, n]), 1.0),
                          where(s <= t, D[b, d, s] * Bm[b, n, s] * X[b, d, s], 0.0))
Y[b, d, t] = sum[n](C[b, n, t] * H[b, d, n, t])
"""


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def recurrence(a, b, steps):
    """H[:, t] = h after the steps `steps(t)` of h <- a[:, s] * h + b[:, s] from h = 0."""
    out = torch.zeros_like(a)
    for t in range(a.shape[1]):
        h = torch.zeros(a.shape[0], dtype=a.dtype)
        for s in steps(t, a.shape[1]):
            h = a[:, s] * h + b[:, s]
        out[:, t] = h
    return out


def selective_scan(D, A, Bm, C, X):
    """Mamba's selective scan, step by step: h <- exp(D A) h + D B x, y = C . h."""
    h = torch.zeros(D.shape[0], D.shape[1], A.shape[1], dtype=D.dtype)
    ys = []
    for t in range(D.shape[2]):
        h = torch.exp(D[:, :, t, None] * A) * h + D[:, :, t, None] * Bm[:, None, :, t] * X[:, :, t, None]
        ys.append((h * C[:, None, :, t]).sum(-1))
    return torch.stack(ys, -1)


def rows(n):
    return {"X": randn(3, n) * 3, "t": n}


CASES = [
    # (name, source, reference on the inputs, inputs of a length, the inputs the gradient is of)
    ("cumsum", "C[b, t] = sum[s](where(s <= t, X[b, s], 0.0))", lambda X, t: X.cumsum(1), rows, ("X",)),
    ("exclusive cumsum", "C[b, t] = sum[s](where(s < t, X[b, s], 0.0))", lambda X, t: X.cumsum(1) - X, rows, ("X",)),
    ("reversed cumsum", "C[b, t] = sum[s](where(t <= s, X[b, s], 0.0))",
     lambda X, t: X.flip(1).cumsum(1).flip(1), rows, ("X",)),
    ("strict suffix", "C[b, t] = sum[s](where(s > t, X[b, s], 0.0))",
     lambda X, t: X.flip(1).cumsum(1).flip(1) - X, rows, ("X",)),
    ("cummax", "C[b, t] = max[s](where(s <= t, X[b, s], -inf))", lambda X, t: X.cummax(1).values, rows, ("X",)),
    ("cummin", "C[b, t] = min[s](where(s <= t, X[b, s], inf))", lambda X, t: X.cummin(1).values, rows, ("X",)),
    ("cumprod", "C[b, t] = prod[s](where(s <= t, X[b, s], 1.0))", lambda X, t: X.cumprod(1),
     lambda n: {"X": torch.exp(0.05 * randn(3, n)), "t": n}, ("X",)),     # near 1: 3001 of them stay in range
    ("logcumsumexp", "C[b, t] = logsumexp[s](where(s <= t, X[b, s], -inf))", lambda X, t: X.logcumsumexp(1), rows,
     ("X",)),
    ("recurrence", "H[i, t] = affine[s](where(s <= t, A[i, s], 1.0), where(s <= t, Bv[i, s], 0.0))",
     lambda A, Bv, t: recurrence(A, Bv, lambda t, n: range(t + 1)),
     lambda n: {"A": randn(4, n).abs() * 1.2, "Bv": randn(4, n, seed=1), "t": n}, ()),
    ("recurrence from each step on", "H[i, t] = affine[s](where(s >= t, A[i, s], 1.0), where(s >= t, Bv[i, s], 0.0))",
     lambda A, Bv, t: recurrence(A, Bv, lambda t, n: range(t, n)),
     lambda n: {"A": randn(4, n).abs() * 1.2, "Bv": randn(4, n, seed=1), "t": n}, ()),
    ("selective scan", SELECTIVE_SCAN, selective_scan,
     lambda n: {"D": randn(2, 3, n).abs() * 0.5, "A": -randn(3, 4, seed=1).abs(), "Bm": randn(2, 4, n, seed=2),
                "C": randn(2, 4, n, seed=3), "X": randn(2, 3, n, seed=4)}, ()),
]


def run(source, inputs, wrt, backend, seed=5):
    program = compiler.compile(source, backend=backend, summaries=[AFFINE])
    leaves = {k: v.clone().requires_grad_(k in wrt) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    out = program(**leaves)
    if wrt:
        out.backward(randn(*out.shape, seed=seed))
    return out, [leaves[k].grad for k in wrt]


def torch_run(fn_, inputs, wrt, seed=5):
    leaves = {k: v.clone().requires_grad_(k in wrt) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    out = fn_(**leaves)
    if wrt:
        out.backward(randn(*out.shape, seed=seed))
    return out, [leaves[k].grad for k in wrt]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("name, source, reference, make, wrt", CASES, ids=[c[0] for c in CASES])
def test_matches_torch_forward_and_backward(name, source, reference, make, wrt, backend):
    inputs = make(37)
    got, grads = run(source, inputs, wrt, backend)
    want, wanted = torch_run(reference, inputs, wrt)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for k, g, w in zip(wrt, grads, wanted):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=lambda m, k=k: f"d{k}: {m}")


@pytest.mark.parametrize("n", [0, 1, 2, 13, 1100])
@pytest.mark.parametrize("name", ["cumsum", "reversed cumsum", "logcumsumexp", "recurrence from each step on"])
def test_lengths_of_no_one_a_prime_and_several_tiles(name, n):
    # 1100 positions: two tiles of 1024, carried from the first to the second (the last first, backward)
    _, source, reference, make, _ = next(c for c in CASES if c[0] == name)
    inputs = make(n)
    got, _ = run(source, inputs, (), "triton")
    torch.testing.assert_close(got, reference(**inputs), rtol=1e-10, atol=1e-10)


def test_nan_and_infinities_as_torch():
    X = torch.tensor([[0.0, float("-inf"), 1.0, float("inf"), 2.0],
                      [float("-inf"), float("-inf"), 3.0, float("nan"), 1.0],
                      [1.0, float("inf"), float("-inf"), 0.5, -2.0]], dtype=torch.float64)
    for source, reference in [("C[b, t] = logsumexp[s](where(s <= t, X[b, s], -inf))", X.logcumsumexp(1)),
                              ("C[b, t] = max[s](where(s <= t, X[b, s], -inf))", X.cummax(1).values),
                              ("C[b, t] = sum[s](where(s <= t, X[b, s], 0.0))", X.cumsum(1))]:
        got = compiler.compile(source, backend="triton")(X=X, t=5)
        torch.testing.assert_close(got, reference, equal_nan=True, msg=lambda m, s=source: f"{s}: {m}")


def specialised(source, sms=None, **sizes):
    from compiler.cli import main
    import contextlib
    import io
    out = io.StringIO()
    args = ["ir", "-e", source, "--print-after", "specialise"] + (["--sms", str(sms)] if sms else [])
    for k, v in sizes.items():
        args += ["--size", f"{k}={v}"]
    with contextlib.redirect_stdout(out):
        assert main(args) == 0
    return out.getvalue()


def test_the_specialised_schedule_runs_the_index_in_order():
    text = specialised("C[b, t] = sum[s](where(s < t, X[b, s], 0.0))", b=4, s=3000, t=3000)
    assert "grid (b: one at a time, t/1024 (in order: the scan's tile))" in text
    assert "t runs in order through each program, the scans' state carried from tile to tile" in text
    assert "fold[s] of acc: no loop [prefix scan along t (s < t): the element of t is s = t - 1]" in text
    # the gradient of a cumsum is the reversed cumsum: a suffix scan, the last tile first
    text = specialised("dX[b, s] = sum[t](where(s <= t, dC[b, t], 0.0))", b=4, s=100, t=100)
    assert "s runs in order through each program, last tile first" in text
    assert "[suffix scan along s (s <= t): the element of s is t = s]" in text
    # short rows: several a program, within the tile's budget
    assert "grid (b/4 (elementwise), s/128 (in order: the scan's tile))" in text


def test_every_spelling_of_a_prefix_takes_one_schedule():
    spellings = ["C[b, t] = sum[s](where(s <= t, X[b, s], 0.0))",
                 "C[b, t] = sum[s](where(t >= s, X[b, s], 0.0))",
                 "C[b, t] = sum[u](where(u - t <= 0, X[b, u], 0.0))",
                 "C[b, t] = sum[s](where(s < t + 1, X[b, s], 0.0))"]
    kernels = {specialised(s, b=4, t=50, **{"u" if "[u]" in s else "s": 50}).split("kernel ", 1)[1]
               .split("  fold")[0] for s in spellings}
    assert len(kernels) == 1, kernels
    assert "t runs in order through each program" in next(iter(kernels))


def test_a_relation_that_is_no_prefix_runs_the_masked_loop():
    # s <= t + 1 starts past the scan's first element, a window bounds s on both sides, and a body
    # reading t is no prefix of one sequence of elements: each keeps its bounded loop, and its meaning
    for source, reference in [
            ("C[b, t] = sum[s](where(s <= t + 1, X[b, s], 0.0))", lambda X: (X.cumsum(1) + torch.nn.functional.pad(
                X[:, 1:], (0, 1)))),
            ("C[b, t] = sum[s](where(s <= t and t - s < 3, X[b, s], 0.0))",
             lambda X: sum(torch.nn.functional.pad(X, (k, 0))[:, :X.shape[1]] for k in range(3))),
            ("C[b, t] = sum[s](where(s <= t, X[b, s] * (t - s), 0.0))",
             lambda X: torch.stack([(X[:, :t + 1] * torch.arange(t, -1, -1)).sum(1) for t in range(X.shape[1])], 1))]:
        assert "scan" not in specialised(source, b=3, s=20, t=20)
        X = randn(3, 20)
        got = compiler.compile(source, backend="triton")(X=X, t=20)
        torch.testing.assert_close(got, reference(X), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("source", ["C[b, t] = sum[s](where(s <= t, X[b, s], 0.0))",
                                    "C[b, t] = sum[s](where(s >= t, X[b, s], 0.0))"])
def test_more_positions_than_elements_keep_the_masked_loop_and_read_nothing_outside(source):
    # t's 9 positions past s's 5: a scan's element at s = t would read X past its last column (the
    # differential corpus's sizes crashed the interpreter so); the masked loop reads within X
    assert "scan" not in specialised(source, b=3, s=5, t=9)
    X = randn(3, 5)
    got = compiler.compile(source, backend="triton")(X=X, t=9)
    t, s = torch.arange(9)[:, None], torch.arange(5)[None, :]
    mask = (s <= t) if "<=" in source else (s >= t)
    torch.testing.assert_close(got, (X[:, None, :] * mask).sum(-1), rtol=1e-12, atol=1e-12)


def test_a_suffix_at_fewer_positions_than_it_sums_evaluates_its_mask_on_every_tile():
    # t's 5 positions cannot reach the last of s's 300 from the last t: no scan, the masked loop.
    # Without the mask the element reads b alone where the state is per (b, t): no interior band
    # (its running max and sum were combined with the state's tiles in the wrong shape)
    source = "L[b, t] = logsumexp[s](where(s >= t, X[b, s], -inf))"
    text = specialised(source, b=4, s=300, t=5)
    assert "scan" not in text and "interior" not in text and "[bounds: s >= t]" in text
    X = randn(4, 300)
    got = compiler.compile(source, backend="triton")(X=X, t=5)
    want = torch.stack([X[:, t:].logsumexp(1) for t in range(5)], 1)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_a_selective_scan_holds_its_state_whole_in_one_kernel():
    program = compiler.compile(SELECTIVE_SCAN, summaries=[AFFINE], backend="triton")
    inputs = CASES[-1][3](37)
    typed, binding = program._typed(inputs)
    text = str(typed.backend.specialised_for(binding))
    assert text.count("kernel ") == 1
    assert "fold[n] of acc: n/4 whole (the scan inside carries a state per value)" in text
    assert "fold[s] of A, B: no loop [prefix scan along t (s <= t): the element of t is s = t]" in text


def test_the_scan_kernel_reads_as_written():
    from compiler.cli import main
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["dump", "-e", "C[b, t] = logsumexp[s](where(s < t, X[b, s], -inf))", "--size", "b=4", "--size",
              "s=100", "--size", "t=100"])
    source = out.getvalue()
    assert "for start_t in range(0, n_t, BLOCK_t):" in source
    # the stabilised logsumexp's running max r and rescaled sum l, scanned together, each position's
    # state combined with the carried one
    assert "scan_r, scan_l = tl.associative_scan((lift_r, lift_l,), 1, combine_fold1_r_l)" in source
    assert "as a prefix scan along t: the element at t is the fold's at s = t - 1" in source
    assert "carry_r = tl.sum(tl.where(((tl.arange(0, BLOCK_t) == BLOCK_t - 1))[None, :], prefix_r, 0.0), 1)" in source
    compile(source, "<dump>", "exec")


def test_the_gradient_program_of_a_prefix_is_a_suffix():
    text = compiler.grad("C[b, t] = sum[s](where(s <= t, X[b, s], 0.0))", wrt=["X"]).source
    assert "sum[t](where(s <= t, dC[b, t], 0.0))" in text


@pytest.mark.gpu
@pytest.mark.parametrize("name, source, reference, make, wrt", CASES, ids=[c[0] for c in CASES])
def test_matches_torch_on_the_gpu(name, source, reference, make, wrt):
    inputs = make(3001)
    cuda = {k: v.cuda().float() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    got = compiler.compile(source, summaries=[AFFINE])(**cuda)
    want = reference(**inputs)
    scale = want.abs().max().clamp_min(1).item()
    torch.testing.assert_close(got.double().cpu() / scale, want / scale, rtol=1e-4, atol=1e-4)



@pytest.mark.parametrize("name", ["cumsum", "exclusive cumsum", "reversed cumsum", "logcumsumexp", "recurrence",
                                  "recurrence from each step on", "selective scan"])
def test_chunks_across_programs_start_from_the_totals_before_them(name):
    # split=3: t cut into chunks of whole tiles, each reduced by a kernel of its own, then scanned from
    # the totals of the chunks before it (after it, backward), combined in order (the recurrence's
    # combine is not commutative); 2100 positions: three chunks of one tile, the last one ragged
    _, source, reference, make, _ = next(c for c in CASES if c[0] == name)
    inputs = make(2100)
    program = compiler.compile(source, backend="triton", summaries=[AFFINE], split=3)
    torch.testing.assert_close(program(**inputs), reference(**inputs), rtol=1e-10, atol=1e-10)
    plan = str(program.plan(**inputs))
    assert plan.startswith("backend triton: 2 kernel(s)") and "_totals: writes" in plan


def test_few_long_rows_are_cut_into_chunks_for_the_gpus_sms():
    text = specialised("C[b, t] = sum[s](where(s >= t, X[b, s], 0.0))", sms=132, b=16, s=262144, t=262144)
    assert ("t in 17 chunks across programs (16 programs of rows for 132 SMs and 256 tiles): a kernel reduces "
            "each chunk first, then each program scans its chunk from the chunks after it") in text
    # as many rows as SMs: no chunks
    assert "chunks" not in specialised("C[b, t] = sum[s](where(s >= t, X[b, s], 0.0))", sms=132,
                                       b=4096, s=4096, t=4096)



@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cumsum", "reversed cumsum", "logcumsumexp", "recurrence from each step on"])
def test_few_long_rows_on_the_gpu_run_in_chunks(name):
    # 3 rows of 100003 positions: chunks across programs, chosen for the GPU's SMs
    _, source, reference, make, _ = next(c for c in CASES if c[0] == name)
    inputs = make(100003)
    cuda = {k: v.cuda().float() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    program = compiler.compile(source, summaries=[AFFINE])
    got = program(**cuda)
    assert "_totals: writes" in str(program.plan(**cuda))
    want = reference(**inputs)
    scale = want.abs().max().clamp_min(1).item()
    torch.testing.assert_close(got.double().cpu() / scale, want / scale, rtol=1e-4, atol=1e-4)


CDF = "F[b, t] = sum[s](where(s <= t, P[b, s], 0.0)) / sum[s](P[b, s])"


@pytest.mark.parametrize("source, reference", [
    (CDF, lambda P: P.cumsum(1) / P.sum(1, keepdim=True)),
    ("F[b, t] = sum[s](where(s >= t, P[b, s], 0.0)) / sum[s](P[b, s])",
     lambda P: P.flip(1).cumsum(1).flip(1) / P.sum(1, keepdim=True)),
    ("F[b, t] = logsumexp[s](where(s <= t, P[b, s], -inf)) - logsumexp[s](P[b, s])",
     lambda P: P.logcumsumexp(1) - P.logsumexp(1, keepdim=True))], ids=["cdf", "survival", "log cdf"])
@pytest.mark.parametrize("n", [1, 13, 2100])
def test_a_prefix_after_the_rows_folds_scans_in_the_epilogue(source, reference, n):
    P = randn(3, n).abs() + 0.1
    program = compiler.compile(source, backend="triton")
    torch.testing.assert_close(program(P=P, t=n), reference(P), rtol=1e-10, atol=1e-10)
    lines = str(program.plan(P=P, t=n)).splitlines()
    # the row's folds first (their loop without the prefix's bounds), then the epilogue's scan
    assert lines[2].strip().startswith("loop s: ") and "bounds" not in lines[2]
    assert lines[3].strip().startswith("loop t in order")


def test_the_epilogue_scan_is_specialised_and_the_cdf_has_its_gradient():
    text = specialised(CDF, b=4, s=1000, t=1000)
    assert "the epilogue's loop runs t in order through each program" in text
    assert "fold[s] of acc: no loop [prefix scan along t (s <= t): the element of t is s = t]" in text
    inputs = {"P": randn(3, 40).abs() + 0.1, "t": 40}
    got, (dP,) = run(CDF, inputs, ("P",), "triton")
    want, (wanted,) = torch_run(lambda P, t: P.cumsum(1) / P.sum(1, keepdim=True), inputs, ("P",))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dP, wanted, rtol=1e-10, atol=1e-10)
