"""The schedule stage as text: factorised IR -> Schedule IR (kernels, grids,
the folds each kernel projects, streamed loops with their bounds, buffers),
printed by `einfold ir --print-after schedule`, for any sizes.  The Triton
backend runs the Schedule it is given: it neither lowers nor inlines."""
import itertools
import math
import re
from dataclasses import FrozenInstanceError

import pytest
import torch

import compiler
from compiler.nn import FusedLinearCrossEntropy
from compiler.ir import Access, format_expr, nodes
from compiler.random_inputs import random_inputs
from compiler.schedule import Schedule, schedule
from compiler.schedule import form as formation


def scheduled(source: str, split=None) -> Schedule:
    program = compiler.compile(source, backend="reference")
    return schedule(program.factorised, program.outputs, split)


CASES = {
    "a row statistic folded into the kernel that reads it": (
        "mu[i] = mean[k](X[i,k]); Y[i,k] = (X[i,k] - mu[i]) * G[k]; S[i] = sum[k](Y[i,k] * W[k])",
        """\
schedule: 1 kernel(s), outputs S
kernel einfold_S: grid (i)  # one program per (i) tile; folds fold1_s1_s1_p1_s1_p0[k] streamed over their indices
  f0 = fold1_s1_s1_p1_s1_p0[k](X[i, k], -(G[k] * W[k] / len(k)), G[k] * W[k] * X[i, k])  # one per program
  S[i] = f0.s1_p0 + f0.s1_p1 * f0.s1
  tiles: BLOCK_k = np2(n_k) up to 8192 (streamed); BLOCK_i = np2(n_i) up to 1024, the program's tiles within 4096 elements (elementwise grid tile); warps and stages from 4 launch configs
  split (unless split= says): under 2 programs per SM and >= 64 tiles (with their nested steps; >= 8 under a quarter of a program per SM), over min(8 SMs / programs, tiles, steps / 4, max(64, 2 SMs / programs)) programs, merged in order by the combine
  loop k: fold1_s1_s1_p1_s1_p0
intermediate buffers: none"""),
    "a full reduction beside a row reduction is materialised": (
        "A[] = sum[i](X[i]); B[j] = max[k](Z[j,k]); Y[j] = A[] + B[j]",
        """\
schedule: 2 kernel(s), outputs Y
kernel einfold_buf0: one program  # materialises sum[i] over () into buf0 (it shares no output index with the others)
  buf0[] = sum[i](X[i])  # buffer
  tiles: BLOCK_i = np2(n_i) up to 8192 (streamed); warps and stages from 4 launch configs
  split (unless split= says): under 2 programs per SM and >= 64 tiles (with their nested steps; >= 8 under a quarter of a program per SM), over min(8 SMs / programs, tiles, steps / 4, max(64, 2 SMs / programs)) programs, merged in order by the combine
  loop i: sum
kernel einfold_Y: grid (j)  # one program per (j) tile; folds max[k] streamed over their indices
  Y[j] = max[k](Z[j, k]) + buf0
  tiles: BLOCK_k = np2(n_k) up to 8192 (streamed); BLOCK_j = np2(n_j) up to 1024, the program's tiles within 4096 elements (elementwise grid tile); warps and stages from 4 launch configs
  split (unless split= says): under 2 programs per SM and >= 64 tiles (with their nested steps; >= 8 under a quarter of a program per SM), over min(8 SMs / programs, tiles, steps / 4, max(64, 2 SMs / programs)) programs, merged in order by the combine
  loop k: max
intermediate buffers: buf0[]"""),
    "a window bounds its loop on both sides; the output and its logsumexp share one fold": (
        "O[i,j] = softmax[m](where(i - m < 3 and m <= i, Q[i,k]*K[m,k], -inf)) * V[m,j]\n"
        "L[i] = logsumexp[m](where(i - m < 3 and m <= i, Q[i,k]*K[m,k], -inf))",
        """\
schedule: 1 kernel(s), outputs O, L
kernel einfold_O: grid (i, j)  # one program per (i, j) tile; folds fold1_r_l_u[m] streamed over their indices; 2 statements share it
  f0 = fold1_r_l_u[m](where(i - m < 3 and m <= i, sum[k](K[m, k] * Q[i, k]), -inf), V[m, j])  # one per program; base-2 weights
  O[i, j] = f0.u / f0.l
  L[i] = where(abs(f0.r) < inf, f0.r + log(f0.l), f0.r)
  tiles: BLOCK_i in {64, 128} (tl.dot rows, tuned); BLOCK_j = np2(n_j) up to 256 (values held whole), else 64; BLOCK_m in {32, 64, 128} (tl.dot, streamed, tuned); BLOCK_k = np2(n_k) up to 256, 64 for float32 without TF32 (nested tl.dot, whole), else 64
  split (unless split= says): under 2 programs per SM and >= 64 tiles (with their nested steps; >= 8 under a quarter of a program per SM), over min(8 SMs / programs, tiles, steps / 4, max(64, 2 SMs / programs)) programs, merged in order by the combine
  loop m [bounds: m > i - 3, m <= i]: fold1_r_l_u { loop k: sum }
intermediate buffers: none"""),
}


@pytest.mark.parametrize("case", list(CASES))
def test_schedule_text(case):
    source, want = CASES[case]
    assert str(scheduled(source)) == want


def test_a_forced_split_materialises_the_fold_another_program_fold_reads():
    src = "Y[i] = sum[j](tanh(X[i,j] - mean[k](X[i,k])))"
    assert "  not splittable: a program fold reads another\n" in str(scheduled(src))
    assert str(scheduled(src, split=2)) == """\
schedule: 2 kernel(s), outputs Y, split=2
kernel einfold_buf0: grid (i)  # materialises sum[j] over (i) into buf0 (a split fold reads it)
  buf0[i] = sum[j](X[i, j])  # buffer
  tiles: BLOCK_j = np2(n_j) up to 8192 (streamed); BLOCK_i = np2(n_i) up to 1024, the program's tiles within 4096 elements (elementwise grid tile); warps and stages from 4 launch configs
  split (unless split= says): under 2 programs per SM and >= 64 tiles (with their nested steps; >= 8 under a quarter of a program per SM), over min(8 SMs / programs, tiles, steps / 4, max(64, 2 SMs / programs)) programs, merged in order by the combine
  loop j: sum
kernel einfold_Y: grid (i)  # one program per (i) tile; folds sum[j] streamed over their indices
  Y[i] = sum[j](tanh(X[i, j] - buf0[i] / len(j)))
  tiles: BLOCK_j = np2(n_j) up to 8192 (streamed); BLOCK_i = np2(n_i) up to 1024, the program's tiles within 4096 elements (elementwise grid tile); warps and stages from 4 launch configs
  split (unless split= says): under 2 programs per SM and >= 64 tiles (with their nested steps; >= 8 under a quarter of a program per SM), over min(8 SMs / programs, tiles, steps / 4, max(64, 2 SMs / programs)) programs, merged in order by the combine
  loop j: sum
intermediate buffers: buf0[i]"""


def test_the_schedule_is_a_frozen_value():
    s = scheduled("Y[i] = softmax[j](X[i,j])")
    with pytest.raises(FrozenInstanceError):
        s.kernels[0].grid = ()
    assert s == scheduled("Y[i] = softmax[j](X[i,j])") and hash(s) == hash(scheduled("Y[i] = softmax[j](X[i,j])"))


def test_a_program_schedules_once_and_explain_reads_that(monkeypatch):
    runs = []
    real = formation.Former.run
    monkeypatch.setattr(formation.Former, "run", lambda self: runs.append(1) or real(self))
    program = compiler.compile("O[i,j] = softmax[m](Q[i,k]*K[m,k]) * V[m,j]", backend="triton")
    program.explain()
    program.explain()
    assert program.backend.schedule is program.schedule
    assert len(runs) == 1


# ---------------------------------------------------------------- tiles as symbols
TUNED_PROGRAMS = {
    "attention": ("O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale) * V[b,h,m,j]",
                  {"b": 1, "h": 2, "i": 4096, "m": 4096, "k": 64, "j": 64}),
    "causal": ("O[i,j] = softmax[m](where(m <= i, Q[i,k] * K[m,k], -inf)) * V[m,j]",
               {"i": 4096, "m": 4096, "k": 128, "j": 128}),
    "matmul": ("C[i,j] = A[i,k] * B[k,j]", {"i": 4096, "j": 4096, "k": 4096}),
    "key grid": ("O[i,j] = softmax[m,n](Q[i,k] * K[m,n,k]) * V[m,n,j]",     # m one value at a time
                 {"i": 4096, "m": 64, "n": 1024, "k": 64, "j": 64}),
}


@pytest.mark.parametrize("name", sorted(TUNED_PROGRAMS))
def test_every_autotune_candidate_lies_in_the_schedules_candidate_sets(name):
    """The tile symbols the schedule prints with their candidate sets are the ones
    the backend's autotuner tries (a compiled module for large extents, no GPU)."""
    source, extents = TUNED_PROGRAMS[name]
    program = compiler.compile(source, backend="triton")
    printed = {symbol: {int(v) for v in values.split(", ")}
               for symbol, values in re.findall(r"(BLOCK_\w+) in \{([\d, ]+)\}", str(program.schedule))}
    assert printed
    inputs = random_inputs(program.checked, extents)
    module = program.backend.source_for(program.binder(inputs))     # no automatic split: tuned kernels
    configs = [dict(re.findall(r"'(BLOCK_\w+)': (\d+)", c)) for c in re.findall(r"triton\.Config\(\{([^}]*)\}", module)]
    assert configs
    for config in configs:
        for symbol, values in printed.items():
            assert int(config[symbol]) in values, (symbol, config[symbol], values)


def test_the_streamed_tiles_of_a_fold_over_several_indices_share_one_budget():
    # softmax[m, n] at 257 x 131 streamed [512, 256] tiles (131072 elements per program:
    # minutes of compiling on the GPU); the tiles share STREAM_BLOCK, the last index first
    from compiler.schedule.tiles import STREAM_BLOCK
    program = compiler.compile("P[i,m,n] = softmax[m,n](X[i,m,n]); E[i] = sum[m,n](P[i,m,n]*V[m,n])",
                               backend="triton")
    for extents in ({"i": 37, "m": 257, "n": 131}, {"i": 3, "m": 8209, "n": 3}):
        module = program.backend.source_for(program.binder(random_inputs(program.checked, extents)))
        blocks = {name: int(v) for name, v in re.findall(r"'(BLOCK_\w+)': (\d+)", module)}   # every candidate's
        assert set(blocks) == {"BLOCK_i", "BLOCK_m", "BLOCK_n"}
        assert blocks["BLOCK_i"] * blocks["BLOCK_m"] * blocks["BLOCK_n"] <= STREAM_BLOCK, (extents, blocks)
        assert blocks["BLOCK_n"] == min(STREAM_BLOCK, 1 << (extents["n"] - 1).bit_length())


@pytest.mark.parametrize("source, extents", [
    # the Chamfer distance at d = 64 held [1, 8192, 64] (524288 floats a program): its first call
    # built four spilling candidates for more than 9 minutes on the GPU. A squared distance is a
    # contraction now (passes/contract.py); the L1 distance has none and still broadcasts
    ("A[b,i] = min[m](sum[k](abs(X[b,i,k] - Y[b,m,k])))", {"b": 1, "i": 8192, "m": 8192, "k": 64}),
    ("A[b,i] = min[m](sum[k](abs(X[b,i,k] - Y[b,m,k])))", {"b": 2, "i": 5, "m": 8209, "k": 3}),
])
def test_a_streamed_tile_shares_its_budget_with_the_folds_it_holds_whole(source, extents):
    """A fold streamed over m whose argument holds a nested fold over k whole broadcasts
    each tile of m over all of k: the tile of every candidate, k's width included, stays
    within STREAM_BLOCK elements."""
    from compiler.schedule.tiles import STREAM_BLOCK
    program = compiler.compile(source, backend="triton")
    module = program.backend.source_for(program.binder(random_inputs(program.checked, extents)))
    configs = [dict(re.findall(r"'(BLOCK_\w+)': (\d+)", c)) for c in re.findall(r"triton\.Config\(\{([^}]*)\}", module)]
    assert configs
    for config in configs:
        assert math.prod(int(v) for v in config.values()) <= STREAM_BLOCK, (extents, config)


GRID_TILING = {
    "elementwise": ("Y[i,j] = X[i,j] + B[j]", {"i": 300, "j": 1000}),
    "row sum": ("Y[i] = sum[j](X[i,j])", {"i": 300, "j": 1000}),
    "column sum": ("Y[k] = sum[i](X[i,k])", {"i": 300, "k": 1000}),
    "attention": ("O[i,j] = softmax[m](Q[i,k] * K[m,k]) * V[m,j]", {"i": 300, "m": 200, "k": 64, "j": 64}),
    "batch of rows": ("Y[b,i,j] = X[b,i,j] * 2", {"b": 3, "i": 1, "j": 5000}),
}


@pytest.mark.parametrize("name", sorted(GRID_TILING))
def test_the_module_tiles_its_grid_as_the_schedule_decides(name):
    """The grid tiles of a compiled module are the schedule stage's decision
    (tiles.grid_tiling) evaluated at the call's extents: every tiled grid index's
    BLOCK in every autotune config is the schedule's, a tiled index of the schedule
    is tiled in the module, an untiled one is one program each."""
    from compiler.schedule.tiles import grid_tiling
    source, extents = GRID_TILING[name]
    program = compiler.compile(source, backend="triton")
    (kernel,) = program.schedule.kernels
    tiling = grid_tiling(kernel, extents.__getitem__)
    module = program.backend.source_for(program.binder(random_inputs(program.checked, extents)))
    grid = re.search(r"grid = lambda META: \((.*)\)\n", module).group(1)
    for g in kernel.grid:
        if g in tiling.blocks:
            assert f'META["BLOCK_{g}"]' in grid or f"BLOCK_{g}" in module.split("@triton.jit")[-1], (g, grid)
            if g not in kernel.dot_indices:      # a tl.dot tile is tuned among the printed candidates
                fixed = re.findall(rf"'BLOCK_{g}': (\d+)", module)
                assert fixed and all(int(b) == tiling.blocks[g] for b in fixed), (g, fixed)
        else:
            assert f'n["{g}"]' in grid and f"BLOCK_{g}" not in module, (g, grid)


# ---------------------------------------------------------------- folds that share a loop
SIBLINGS = ("A[m,k] = sum[i](exp(sum[c](X[i,c] * W[m,c])) * Y[i,k])\n"
            "B[m,j] = sum[i](exp(sum[c](X[i,c] * W[m,c])) * Z[i,j])")


def test_sibling_folds_that_recompute_the_same_nested_fold_share_one_loop():
    from compiler.algebra.summary import independent_fields
    """Two statements folding over i, each recomputing the same nested fold in every step
    (an attention backward's dK and dV, here written without attention): one kernel over
    the union of their grids, one loop carrying the product of their summaries, and each
    statement its own field; values as the float64 oracle's at ragged sizes."""
    program = compiler.compile(SIBLINGS, backend="triton", outputs=["A", "B"])
    (kernel,) = program.schedule.kernels
    assert [s.name for s in kernel.statements] == ["A", "B"] and set(kernel.grid) == {"m", "k", "j"}
    (fold,) = kernel.program_folds            # exp(s) * Y: a rescaled fold each, one state
    assert fold.summary.field_names == ("r", "u", "r_2", "u2") and len(independent_fields(fold.summary)) == 2
    assert "A, B share one loop over (i)" in kernel.why
    assert [str(loop) for loop in kernel.loops] == [f"loop i: {fold.summary.name} {{ loop c: sum }}"]
    inputs = random_inputs(program.checked, {"i": 37, "m": 19, "c": 5, "k": 3, "j": 7})
    oracle = compiler.compile(SIBLINGS, backend="reference", outputs=["A", "B"])(**inputs)
    weights = torch.exp(inputs["W"] @ inputs["X"].T)                  # the same in torch, float32
    for got, want, same in zip(program(**inputs), oracle, (weights @ inputs["Y"], weights @ inputs["Z"])):
        error = ((got.double() - want.double()).abs() / want.double().abs()).max()
        assert error <= 2 * ((same.double() - want.double()).abs() / want.double().abs()).max() + 1e-6


def test_sibling_folds_that_share_nothing_nested_keep_their_kernels():
    # nothing recomputed twice: one loop would only hold two accumulators at once
    program = compiler.compile("A[m,k] = sum[i](X[i,m] * Y[i,k])\nB[m,j] = sum[i](X[i,m] * Z[i,j])",
                               backend="triton", outputs=["A", "B"])
    assert [[s.name for s in k.statements] for k in program.schedule.kernels] == [["A"], ["B"]]


def test_a_product_of_summaries_keeps_each_part_apart():
    from compiler.algebra import BUILTINS
    from compiler.algebra.laws import require_laws
    from compiler.algebra.summary import independent_fields, product_of
    product, names = product_of((BUILTINS["sum"], BUILTINS["argmax"], BUILTINS["sum"]))
    assert names == ({"acc": "acc"}, {"m": "m", "p": "p"}, {"acc": "acc_2"})
    assert product.arity == 4 and not product.commutative
    assert [str(e) for e in (product.lift[3], product.combine[3])] == [str(compiler.ir.Var("x3")),
                                                                     str(BUILTINS["sum"].combine[0]).replace(
                                                                         "acc", "acc_2")]
    assert independent_fields(product) == (("acc",), ("m", "p"), ("acc_2",))
    assert require_laws(product).laws.ok


@pytest.mark.parametrize("source, wrt, extents, stored", [
    # the SwiGLU block at a real size: silu(X W1) * (X W3) stored once, [i, f] no larger than W1
    ("Y[i,e] = sum[f](silu(sum[d](X[i,d] * W1[f,d])) * sum[d](X[i,d] * W3[f,d]) * W2[e,f])", None,
     {"i": 4096, "d": 4096, "f": 11008, "e": 4096}, True),
    # a fused linear cross-entropy's backward at a wide hidden dimension: storing dZ would be
    # [tokens, vocab], 3x its weight; the tiles recompute it instead
    ("Z[t,v] = sum[d](H[t,d] * W[v,d])\nL[t] = logsumexp[v](Z[t,v]) - sum[v](where(v == Y[t], Z[t,v], 0))\n"
     "S[] = sum[t](L[t])", ("H", "W"), {"t": 8192, "d": 2048, "v": 32000}, False),
    # the same through compiler.nn's mean over the rows not ignored: both schedules store
    # counts, and the fused one's second count was named like the materialised one's dZ
    (FusedLinearCrossEntropy().source(3), ("H", "W"), {"t0": 8, "t1": 1024, "d": 768, "v": 32768}, False),
    # attention's backward at a head dimension of 1024: no score-sized buffer
    ("O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale) * V[b,h,m,j]", ("Q", "K", "V"),
     {"b": 1, "h": 2, "i": 4096, "m": 4096, "k": 1024, "j": 1024}, False),
])
def test_a_store_never_outgrows_the_largest_input(source, wrt, extents, stored):
    program = (compiler.compile(source, backend="triton") if wrt is None
               else compiler.grad(source, backend="triton", saved=True, wrt=wrt))
    schedule = program.schedule
    assert schedule.materialised is not None
    chosen = schedule.for_extents(lambda index: extents[index.split("_")[0]])
    assert (chosen is schedule.materialised) == stored


# ---------------------------------------------------------------- the order of the statements
def _kernel_shapes(schedule: Schedule) -> list[tuple]:
    """Each kernel as the outputs it stores, its grid as a set, how many buffers it stores
    and the tensors it reads, in kernel order (names of buffers aside)."""
    def read(kernel):
        return frozenset("buffer" if n.tensor in buffers else n.tensor for s in kernel.statements
                         for n in nodes(s.expr) if isinstance(n, Access))
    buffers = {name for name, _ in schedule.buffer_indices}
    return [(frozenset(s.name for s in k.statements if s.name not in buffers), frozenset(k.grid), len(k.buffers),
             read(k)) for k in schedule.kernels]


def test_a_statement_comes_after_the_one_whose_programs_fold_once_what_it_refolds():
    # T refolds the row sum sum[j](Y * Z) for every program of (m, k); S folds it once per
    # row: S's kernel comes first and stores it, and T reads it, whichever is written first
    consumer = "T[m,k] = sum[i](X[i,k] * U[m,i] * sum[j](Y[i,j] * Z[i,j]))"
    supplier = "S[i,n] = sum[j](Y[i,j] * Z[i,j]) * W[i,n]"
    for source in (f"{consumer}\n{supplier}", f"{supplier}\n{consumer}"):
        kernels = scheduled(source).kernels
        assert [[s.name for s in k.statements] for k in kernels] == [["S", "buf0"], ["T"]]
        assert format_expr(kernels[1].statements[0].expr) == "sum[i](U[m, i] * X[i, k] * buf0[i])"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_attention_backward_schedule_does_not_depend_on_the_order_of_wrt(causal):
    # whichever gradient is asked first, dQ's kernel folds D = rowsum(dO * O) once per row
    # and stores it, and one kernel streams dK and dV in one loop over the queries, reading
    # D from memory instead of refolding it for every tile of keys
    from compiler.bench import ATTENTION, CAUSAL
    source = CAUSAL if causal else ATTENTION
    rowsum = "sum[j](O[b, h, i, j] * dO[b, h, i, j])"
    shapes = set()
    for wrt in itertools.permutations(("Q", "K", "V")):
        schedule = compiler.grad(source, saved=True, wrt=wrt, backend="triton").schedule
        first, second = schedule.kernels
        (stored,) = first.buffers
        assert {s.name for s in first.statements} == {"dQ", stored}
        assert [format_expr(s.expr) for s in first.statements if s.name == stored] == [rowsum]
        assert {s.name for s in second.statements} == {"dK", "dV"} and len(second.program_folds) == 1
        assert re.search(r"d[KV], d[KV] share one loop over \(i\)", second.why)
        assert f"{stored}[b, h, i]" in format_expr(second.program_folds[0])
        shapes.add(tuple(_kernel_shapes(schedule)))
    (shape,) = shapes
    *_, read = shape[1]
    assert read == {"buffer", "Q", "K", "V", "dO", "lse_O", "scale"}        # not O: D is read from memory


def test_the_attention_backward_asked_in_another_order_matches_torch():
    # dQ first, its kernel storing D, though asked last: the gradients in the order asked,
    # as torch's autograd gives them (float64), on ragged sizes under a causal mask
    from compiler.bench import CAUSAL
    shapes = {"Q": (2, 3, 13, 8), "K": (2, 3, 11, 8), "V": (2, 3, 11, 5)}
    inputs = {n: torch.randn(*s, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
              for k, (n, s) in enumerate(shapes.items())}
    scale, dO = 0.3, torch.randn(2, 3, 13, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    leaves = {n: v.clone().requires_grad_() for n, v in inputs.items()}
    scores = (leaves["Q"] @ leaves["K"].transpose(-1, -2) * scale).masked_fill(
        torch.arange(11)[None, :] > torch.arange(13)[:, None], -math.inf)
    O = torch.softmax(scores, dim=-1) @ leaves["V"]
    wrt = ("V", "K", "Q")
    want = torch.autograd.grad(O, [leaves[n] for n in wrt], dO)
    backward = compiler.grad(CAUSAL, saved=True, wrt=wrt, backend="triton")
    given = {**inputs, "dO": dO, "O": O.detach(), "lse_O": torch.logsumexp(scores, dim=-1).detach()}
    got = backward(**{n: v.float() for n, v in given.items()}, scale=scale)
    for name, g, w in zip(wrt, got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=2e-4, atol=2e-4, msg=name)


@pytest.mark.parametrize("spelling", [
    "L[] = sum[r](logsumexp[c](sum[e](H[r,e] * W[c,e]))) / len(r)",
    "Z[t,v] = sum[d](H[t,d] * W[v,d])\nS[t] = logsumexp[v](Z[t,v])\nL[] = mean[t](S[t])",
])
def test_a_scalars_fold_of_folded_elements_makes_its_elements_whatever_the_spelling(spelling):
    # a mean loss over rows, each a logsumexp over a contraction: the rows' kernel stores
    # them, the scalar's kernel folds the buffer; renamed indices, a mean written as a sum
    # over len(r) and intermediate statements give the same kernels
    plain = "L[] = mean[t](logsumexp[v](sum[d](H[t,d] * W[v,d])))"

    def shapes(source):             # grids by their size: the spellings name the rows apart
        return [(outputs, len(grid), buffers, reads) for outputs, grid, buffers, reads in
                _kernel_shapes(scheduled(source))]
    assert shapes(spelling) == shapes(plain)
    rows, total = scheduled(plain).kernels
    assert len(rows.grid) == 1 and rows.buffers and not total.grid
