"""Chunked runs (compiler/schedule/chunks.py): a materialised buffer that would
outgrow the inputs is made one chunk of an index at a time, by the kernels from the
one that stores it to the last that reads it, on views of the tensors; an output
that sums over the index adds up the chunks' sums.  Checked against the float64
oracle under the interpreter at sizes where a run has a ragged last chunk."""
from __future__ import annotations

import pytest
import torch

import compiler
from compiler.ir import Access, nodes
from compiler.nn import FusedLinearCrossEntropy
from compiler.schedule.chunks import CHUNK_ALIGN, chunk_candidates, chunked


def _backward(rank: int, **options) -> tuple[compiler.Program, compiler.Program]:
    """The gradient program (dH, dW) of a fused linear cross-entropy's mean loss over
    hidden states of this rank, reading the saved row logsumexp; and its oracle."""
    source = FusedLinearCrossEntropy(**options).source(rank)
    made = [compiler.grad(source, wrt=("H", "W"), outputs=("loss",), saved=True, backend=backend)
            for backend in ("triton", "reference")]
    return made[0], made[1]


def _inputs(rows: tuple[int, ...], vocab: int, hidden: int) -> dict:
    g = torch.Generator().manual_seed(0)
    h = 0.1 * torch.randn(*rows, hidden, generator=g)
    w = 0.1 * torch.randn(vocab, hidden, generator=g)
    y = torch.randint(0, vocab, rows, generator=g)
    y.view(-1)[3] = -100                                     # an ignored row
    logits = torch.einsum("...d,vd->...v", h.double(), w.double())
    return {"H": h, "W": w, "Y": y, "lse_lse": torch.logsumexp(logits, -1).float(), "dloss": 1.0,
            "smoothing": 0.1}


# 640 hidden: recomputing the logits for each of 3 tiles of the hidden dimension costs
# more than storing dZ once; with 660+ rows and a vocabulary of 660+, dZ outgrows H and W,
# so it is made in two chunks (the second ragged) of the index whose chunks' sums are the
# smaller output to add up: the rows (dW sums over them) where the vocabulary is the
# smaller extent, else the vocabulary (dH sums over it)
@pytest.mark.parametrize("rows, vocab, options, index, summed", [
    ((680,), 660, {}, "t0", "dW"),
    ((2, 340), 660, {}, "t1", "dW"),
    ((660,), 680, {"label_smoothing": 0.1}, "v", "dH")], ids=["rows", "batch and rows", "vocabulary"])
def test_a_chunked_run_matches_the_float64_oracle(rows, vocab, options, index, summed):
    program, oracle = _backward(len(rows) + 1, **options)
    inputs = _inputs(rows, vocab, 640)
    read = {i.name for i in program.checked.inputs}
    inputs = {k: v for k, v in inputs.items() if k in read}
    got = program(**inputs)
    plan = str(program.plan(**inputs))
    assert f"run in 2 chunks of {index}, " in plan and f"{summed}: the chunks' sums, added in float32" in plan
    want = oracle(**{k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                     for k, v in inputs.items()})
    for a, b in zip(got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape
        assert ((a.double() - b).norm() / b.norm()).item() < 1e-5
    # label smoothing's smoothing / len(v) reads the whole vocabulary's extent, not a chunk's;
    # the label's one-hot `v == Y[t0]` reads v's value from the chunk's start
    if index == "v":
        assert "n_v_whole" in program.source and "+ start)" in program.source


def test_the_materialised_backward_stores_what_two_products_read_once():
    # dH reads dZ[t0, v] and dW reads it as dZ[v, t0]: one buffer, one kernel making it
    # (and one count of the rows not ignored, which both divide by)
    program, _ = _backward(2)
    materialised = program.schedule.materialised
    assert [k.name for k in materialised.kernels] == ["einfold_buf0", "einfold_buf1", "einfold_dH", "einfold_dW"]
    (count, _), (gradient, indices) = materialised.buffer_indices
    assert indices == ("t0", "v")
    for k in materialised.kernels[2:]:
        assert gradient in {n.tensor for n in nodes(k.statements[0].expr) if isinstance(n, Access)}


def test_no_chunked_run_where_a_chunk_of_whole_tiles_would_not_fit():
    # a chunk holds at least CHUNK_ALIGN values of its index (whole tiles of every size);
    # where even that outgrows the budget, there is no chunked run (the schedule keeps
    # recomputing), and the budget decides the chunk where one fits
    program, _ = _backward(2)
    materialised = program.schedule.materialised
    extents = {"t0": 8192, "v": 32768, "d": 768}
    extent = extents.__getitem__
    added = {"buf1"}
    assert chunked(materialised, added, extent, budget=8192 * CHUNK_ALIGN - 1) is None
    run = chunked(materialised, added, extent, budget=8192 * 4 * CHUNK_ALIGN)
    assert (run.index, run.size, run.accumulated) == ("v", 4 * CHUNK_ALIGN, ("dH",))


@pytest.mark.gpu
def test_gpu_a_chunked_linear_cross_entropy_backward_is_as_accurate_as_torch():
    # 4 x 512 rows of 768 (bf16) over a vocabulary of 16000: dZ would hold 32M elements
    # against W's 12M, so the backward runs in chunks of the vocabulary (the last ragged)
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(4, 512, 768, device="cuda", generator=g).bfloat16().double()
    weight = (0.05 * torch.randn(16000, 768, device="cuda", generator=g)).bfloat16().double()
    labels = torch.randint(0, 16000, (4, 512), device="cuda", generator=g)
    labels[0, :7] = -100
    module = FusedLinearCrossEntropy()

    def gradients(loss, dtype):
        h, w = (t.detach().to(dtype, copy=True).requires_grad_() for t in (hidden, weight))
        value = loss(h, w, labels)
        value.backward()
        return value.detach().double(), h.grad.double(), w.grad.double()

    def torch_loss(h, w, y):
        return torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w).flatten(0, 1).float(), y.flatten())
    oracle = gradients(torch_loss, torch.float64)
    theirs = gradients(torch_loss, torch.bfloat16)
    ours = gradients(module, torch.bfloat16)
    source = module.source(2)
    backward = compiler.grad(source, wrt=("H", "W"), outputs=("loss",), saved=True)
    plan = str(backward.plan(H=hidden.flatten(0, 1).bfloat16(), W=weight.bfloat16(), Y=labels.flatten(),
                             lse_lse=torch.zeros(2048, device="cuda"), dloss=torch.ones((), device="cuda")))
    assert "chunks of v" in plan
    for a, b, want in zip(ours, theirs, oracle):
        error = float((a - want).norm() / want.norm())
        assert error <= max(1.5 * float((b - want).norm() / want.norm()), 2.0 ** -8), error


def test_a_chunks_sum_accumulates_in_its_kernel_and_is_restored_after_each_timing():
    """dH sums over the chunks of v: each chunk's store adds to one float32 sum (no partial
    buffer, no add in torch), which the bfloat16 output takes once, after the last chunk
    (rounding the running sum to the output's dtype at every chunk made dH 2.9x less
    accurate on the GPU: 4.8e-3 against float64, torch 1.7e-3); the store is not idempotent, so the
    autotuner restores dH after timing each candidate (the first chunk's timing runs
    would otherwise add themselves up: a relative error of 224 on the GPU)."""
    program, _ = _backward(2)
    inputs = {"H": torch.zeros(8192, 768, dtype=torch.bfloat16), "W": torch.zeros(32768, 768, dtype=torch.bfloat16),
              "Y": torch.zeros(8192, dtype=torch.int64), "dloss": torch.ones(()), "lse_lse": torch.zeros(8192)}
    typed, binding = program._typed(inputs)
    source = typed.backend.source_for(binding, sm_count=132, arch=90)
    launcher = source[source.index("def launch("):]
    assert 'sums["dH"] = torch.zeros((n["t0"], n["d"],), dtype=torch.float32' in launcher
    assert '"dH": sums["dH"]' in launcher and 't["dH"].copy_(sums["dH"])' in launcher and "+=" not in launcher
    head = source[:source.index("def einfold_dH(")].rsplit("@triton.autotune", 1)[1]
    assert "restore_value=['dH_ptr']" in head
    dh = source[source.index("def einfold_dH("):source.index("def einfold_dW(")]
    assert "+ tl.load(dH_ptr" in dh
    dw = source[source.index("def einfold_dW("):]
    assert "restore_value" not in source[:source.index("def einfold_dW(")].rsplit("@triton.autotune", 1)[1] \
        and "+ tl.load(dW_ptr" not in dw


GATED = "silu(sum[d](X[i, d] * W1[f, d]))"
BLOCK_EXTENTS = {"i": 16384, "d": 1024, "f": 4096, "j": 1024}


def _candidates(source: str, **extents) -> dict:
    """Each index of a SwiGLU-like block's stored buffer buf0[i, f] -> its chunked run or
    why it allows none, within W1's 4M elements."""
    materialised = compiler.compile(source, backend="triton").schedule.materialised
    sizes = {**BLOCK_EXTENTS, **extents}
    return chunk_candidates(materialised, {"buf0"}, sizes.__getitem__, 4096 * 1024)


def test_a_block_runs_in_chunks_of_its_rows_or_of_its_hidden_index():
    # Y[i, j] sums over f: over chunks of f it adds the chunks' sums; over chunks of i it
    # adds nothing, so that is the run taken
    runs = _candidates(f"Y[i, j] = sum[f]({GATED} * W2[j, f])")
    assert (runs["i"].size, runs["i"].accumulated, dict(runs["i"].narrowed)) == (1024, (), {"X": 0, "Y": 0})
    assert runs["f"].accumulated == ("Y",) and dict(runs["f"].narrowed) == {"W1": 0, "W2": 1}
    materialised = compiler.compile(f"Y[i, j] = sum[f]({GATED} * W2[j, f])", backend="triton").schedule.materialised
    assert chunked(materialised, {"buf0"}, BLOCK_EXTENTS.__getitem__, 4096 * 1024).index == "i"


def test_an_index_a_loop_bound_reads_is_not_chunked():
    # Y's fold over f stops at j (f <= j): over a chunk of f the bound would be shifted
    runs = _candidates(f"Y[i, j] = sum[f]({GATED} * where(f <= j, W2[j, f], 0))")
    assert runs["f"] == "a loop bound or tile test of Y's fold reads f: a chunk's view would shift it"
    assert runs["i"].index == "i"


def test_a_fold_inside_a_value_or_a_tensor_read_two_ways_rules_an_index_out():
    # Y adds a fold over f to a fold over d: a chunk of f is not all of f; and X is read
    # along i (X[i, d]) and along j (X[j, d]), so a chunk's view of X along i would also
    # cut the rows Y reads as j
    runs = _candidates(f"Y[i, j] = sum[f]({GATED} * W2[j, f]) + sum[d](X[i, d] * X[j, d])", j=16384)
    assert runs["f"] == "Y folds over f inside a value: one chunk is not all of f"
    assert runs["i"] == "X is read along i at other dimensions, or beside reads that do not vary over it"
    materialised = compiler.compile(f"Y[i, j] = sum[f]({GATED} * W2[j, f]) + sum[d](X[i, d] * X[j, d])",
                                    backend="triton").schedule.materialised
    assert chunked(materialised, {"buf0"}, {**BLOCK_EXTENTS, "j": 16384}.__getitem__, 4096 * 1024) is None


def test_where_no_index_allows_chunks_the_schedule_says_why_it_recomputes():
    # Y's fold over f stops at i (f <= i): chunks of i or of f would shift that bound, so the
    # block keeps recomputing buf0 in Y's kernel, and the specialised schedule says why
    program = compiler.compile(f"Y[i, j] = sum[f]({GATED} * where(f <= i, W2[j, f], 0))", backend="triton")
    chosen = program.schedule.for_extents(BLOCK_EXTENTS.__getitem__)
    assert chosen.chunking is None and [k.name for k in chosen.kernels] == ["einfold_Y"]
    assert chosen.recomputes == (
        "stores no buffer larger than the largest input (16777216), and no index allows chunks of one "
        "(i: a loop bound or tile test of Y's fold reads i: a chunk's view would shift it; "
        "f: a loop bound or tile test of Y's fold reads f: a chunk's view would shift it)")
    assert f"recomputes the nested folds: it {chosen.recomputes}" in str(chosen)


def test_token_counts_whose_chunks_differ_in_length_share_one_module():
    # the chunk's length depends on the exact token count (the budget over the rows); the
    # launcher reads it from the call's extents, so every count of one shape class with a
    # ragged last tile runs one module (one compile, one tuning), whatever its chunk length
    program, _ = _backward(2)
    sources, lengths = set(), set()
    for tokens in (4100, 5000, 7000, 8191):
        inputs = {"H": torch.zeros(1, 1, dtype=torch.bfloat16).expand(tokens, 768),
                  "W": torch.zeros(1, 1, dtype=torch.bfloat16).expand(32768, 768),
                  "Y": torch.zeros(tokens, dtype=torch.int64), "dloss": torch.ones(()),
                  "lse_lse": torch.zeros(1).expand(tokens)}
        typed, binding = program._typed(inputs)
        built = typed.backend.build(typed.backend.gpu_signature(binding, sm_count=132, arch=90))
        sources.add(built.source)
        lengths.add(built.chunk_length)
    assert len(sources) == 1 and lengths == {5632, 2816}
    assert 'for start in range(0, whole["v"], whole["chunk length"]):' in sources.pop()


def test_explain_shows_the_plan_that_stores_the_nested_folds():
    # a block whose sizes decide between recomputing silu(X W1) in Y's kernel and storing it
    # (in chunks where it would outgrow the inputs): explain prints both plans
    text = compiler.compile(f"Y[i, j] = sum[f]({GATED} * W2[j, f])").explain()
    fused, stored = text.split("plan where recomputing the nested folds costs more than storing them")
    assert "einfold_buf0" not in fused.split("plan (for any sizes")[1]
    assert "einfold_buf0: writes buf0" in stored and "einfold_Y: writes Y" in stored
    assert "plan where" not in compiler.compile(f"Y[i, j] = sum[f]({GATED} * W2[j, f])",
                                                backend="reference").explain()
