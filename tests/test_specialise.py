"""The specialisation stage: every tile, loop and split decided for one call's
signature, printed as text, and built as decided by the backend."""
import re

import pytest
import torch

import compiler
from compiler.backend.triton.module import ModuleBuilder
from compiler.cli import main
from compiler.ir import Access, nodes
from compiler.specialise import ConcreteSchedule, specialise
from compiler.schedule.tiles import STREAM_BLOCK
from compiler.specialise.ir import DOT_PRECISIONS, ONE_AT_A_TIME, RANGED, TILED, WHOLE
from test_triton_backend import LAYERNORM

H100_SMS = 132
CAUSAL = "O[b,h,i,j] = softmax[m](where(m <= i, Q[b,h,i,k] * K[b,h,m,k] * scale, -inf)) * V[b,h,m,j]"
DECODE = "O[h,j] = softmax[m](Q[h,k] * K[h,m,k] * scale) * V[h,m,j]"
MATMUL = "C[i,j] = A[i,k] * B[k,j]"
SIZES = {
    "causal": (CAUSAL, {"Q": (2, 4, 1024, 64), "K": (2, 4, 1024, 64), "V": (2, 4, 1024, 64), "scale": 0.125}),
    "decode": (DECODE, {"Q": (8, 128), "K": (8, 32768, 128), "V": (8, 32768, 128), "scale": 0.125}),
    "matmul": (MATMUL, {"A": (1024, 512), "B": (512, 2048)}),
    "layernorm": (LAYERNORM, {"X": (4096, 4096)}),
}


def _input(value, dtype):
    # any shape without the memory: one zero broadcast (the signature reads shapes and dtypes only)
    return torch.zeros((1,) * len(value), dtype=dtype).expand(*value) if isinstance(value, tuple) else value


def concrete(name, dtype=torch.bfloat16, sm_count=H100_SMS, arch=90):
    source, inputs = SIZES[name]
    program = compiler.compile(source, backend="triton")
    binding = program.binder({k: _input(v, dtype) for k, v in inputs.items()})
    return program.backend.specialised_for(binding, sm_count=sm_count, arch=arch)


def test_causal_attention_as_text():
    assert str(concrete("causal")) == """\
specialised to b=2, h=4, i=1024, j=64, k=64, m=1024; bfloat16; 132 SMs, sm_90: 1 kernel(s)
kernel einfold_O: grid (b: one at a time, h: one at a time, i/64 tuned (tl.dot), j/64 whole (a field does not \
vary over it)); programs: longest first along i
  fold[m] of r, l, u: m/64 tuned (tl.dot) [bounds: m <= i] [interior tiles without m <= i]
    nested fold[k] of acc: k/64 whole
  form: tl (not in the Hopper form: contraction depth 64 / value width 64 outside (128,) / (64, 128))
  autotuned over streamed tilings of i x m:
    i/128 x m/128, 8 warps, 3 stages
    i/64 x m/64, 4 warps, 3 stages
    i/128 x m/64, 8 warps, 3 stages
    i/128 x m/64, 8 warps, 4 stages
    i/64 x m/32, 4 warps, 4 stages"""


def test_a_document_mask_skips_tiles_and_scans_its_live_span():
    source = "O[i,j] = softmax[m](where(D[i] == D[m] and m <= i, Q[i,k] * K[m,k], -inf)) * V[m,j]"
    program = compiler.compile(source, backend="triton")
    inputs = {"Q": (4096, 64), "K": (4096, 64), "V": (4096, 64)}
    binding = program.binder({**{k: _input(v, torch.bfloat16) for k, v in inputs.items()},
                              "D": torch.zeros(4096, dtype=torch.int64)})
    (kernel,) = program.backend.specialised_for(binding, sm_count=None).kernels
    (loop,) = [f for f in kernel.folds if not f.nested]
    assert str(loop) == ("fold[i_2] of r, l, u: i_2/64 tuned (tl.dot) [bounds: i_2 <= i] "
                         "[interior tiles without i_2 <= i] [skips tiles where D[i] == D[i_2] fails] "
                         "[live span of D[i] == D[i_2] scanned first]")


def test_a_gathered_reads_scatter_visits_the_positions_sorted_by_their_values():
    # the embedding's gradient dE[s, d] = sum[i](where(T[i] == s, dY[i, d], 0)): each program runs over
    # the range of T's sorted order whose values are its tile's rows, not over every position
    backward = compiler.grad("Y[i, d] = E[T[i], d]", backend="triton")
    binding = backward.binder({"E": _input((50257, 1024), torch.bfloat16), "dY": _input((8192, 1024), torch.bfloat16),
                               "T": torch.zeros(8192, dtype=torch.int64)})
    (kernel,) = backward.backend.specialised_for(binding, sm_count=H100_SMS, arch=90).kernels
    (loop,) = kernel.folds
    assert loop.sorted is not None and loop.sorted.tensor == "T" and (loop.bounds, loop.span) == ((), ())
    assert "[visits i sorted by T, only the positions where T[i] == s_1 can hold]" in str(loop), str(loop)
    # ids over two indices: each row of b, one at a time, sorted
    rows = compiler.grad("X[b, t, d] = E[T[b, t], d]", backend="triton")
    binding = rows.binder({"E": _input((50257, 1024), torch.bfloat16), "dX": _input((8, 2048, 1024), torch.bfloat16),
                           "T": torch.zeros(8, 2048, dtype=torch.int64)})
    (kernel,) = rows.backend.specialised_for(binding, sm_count=H100_SMS, arch=90).kernels
    assert str(kernel.folds[0]).startswith("fold[b, t] of acc: b: one at a time (a row of the sorted values); t/16 "
                                           "(sorted: the positions a value has) [visits t sorted by T in each row "
                                           "of b, only the positions where T[b, t] == s_1 can hold]"), str(kernel)
    # a float tensor of ids has no sorted order to run over: the loop scans, skipping dead tiles
    floats = backward.binder({"E": _input((512, 64), torch.float32), "dY": _input((256, 64), torch.float32),
                              "T": _input((256,), torch.float32)})
    (kernel,) = backward.backend.specialised_for(floats, sm_count=H100_SMS, arch=90).kernels
    assert kernel.folds[0].sorted is None and kernel.folds[0].skips


@pytest.mark.parametrize("spelling", ["dE[s, d] = sum[i](where(T[i] == s, dY[i, d], 0.0))",
                                      "dE[s, d] = sum[i](where(s == T[i], dY[i, d], 0.0))",
                                      "G[v, e] = sum[j](where(T[j] == v, dY[j, e], 0.0))",
                                      "dE[s, d] = sum[i](where(T[i] + 0 == s, dY[i, d], 0.0))"])
def test_every_spelling_of_a_scatter_takes_one_sorted_schedule(spelling):
    # the equality either way round, renamed indices, a zero offset: the same sorted loop and tiles
    program = compiler.compile(spelling, backend="triton")
    binding = program.binder({"dY": _input((8192, 1024), torch.bfloat16), "T": torch.zeros(8192, dtype=torch.int64),
                              program.checked.statements[0].indices[0]: 50257})
    typed, binding = program._typed(binding.values)
    (kernel,) = typed.backend.specialised_for(binding, sm_count=H100_SMS, arch=90).kernels
    (loop,) = kernel.folds
    assert loop.sorted is not None and loop.sorted.tensor == "T" and loop.sorted.offset == 0
    assert [(t.how, t.size) for t in (*kernel.grid, *loop.tiles)] == [(ONE_AT_A_TIME, 0), (TILED, 256), (TILED, 16)]


def test_hopper_takes_the_warp_specialised_form_at_depth_128():
    source, inputs = SIZES["causal"]
    program = compiler.compile(source, backend="triton")
    wide = {k: (v[:-1] + (128,) if isinstance(v, tuple) else v) for k, v in inputs.items()}
    binding = program.binder({k: _input(v, torch.bfloat16) for k, v in wide.items()})
    (kernel,) = program.backend.specialised_for(binding, sm_count=H100_SMS, arch=90).kernels
    assert (kernel.form.rows, kernel.form.keys, kernel.form.depth, kernel.form.width) == ("i", "m", "k", "j")
    assert "  form: Hopper (sm_90, warp-specialised): rows i in blocks of 2 consumer warpgroups x 64" in str(kernel)
    assert "autotuned (the tl kernel, where TMA cannot read the operands) over" in str(kernel)
    (elsewhere,) = program.backend.specialised_for(binding, sm_count=H100_SMS, arch=80).kernels
    assert elsewhere.form is None and elsewhere.form_why == "" and "form:" not in str(elsewhere)


def test_the_costly_operators_are_those_whose_triton_code_costs_a_special_function_or_a_division():
    """ops.COSTLY (what a form weighs a score's cost by) agrees with the Triton templates."""
    from compiler.backend.triton.ops import TEMPLATES
    from compiler.ops import COSTLY
    special = ("exp", "exp2", "log", "log2", "erf", "sigmoid", "sqrt", "rsqrt")
    costly = {op for op, (template, helper) in TEMPLATES.items()
              if helper or op == "div" or any(f"tl.{fn}(" in template for fn in special)}
    assert costly == COSTLY


def test_decode_splits_over_the_keys():
    c = concrete("decode")
    (kernel,) = c.kernels
    assert kernel.split > 1 and not kernel.tuned and kernel.tuning == ""
    assert "8 programs for 132 SMs" in kernel.split_why
    (loop,) = [f for f in kernel.folds if not f.nested]
    (m,) = loop.tiles
    assert m.how == TILED and not m.tuned and m.size * kernel.split >= 32768 // 64
    assert f"split {kernel.split} ways: 8 programs for 132 SMs" in str(c)


def test_two_programs_an_sm_only_where_every_program_does_the_same_work():
    """PAIRED (a register cap, two programs an SM) is a candidate of uniform work only:
    causal attention's programs loop over different lengths."""
    source, inputs = SIZES["causal"]
    program = compiler.compile(source.replace("where(m <= i, ", "(").replace(", -inf)", ")"), backend="triton")
    binding = program.binder({k: _input(v, torch.bfloat16) for k, v in inputs.items()})
    (plain,) = program.backend.specialised_for(binding, sm_count=H100_SMS).kernels
    (causal,) = concrete("causal").kernels
    assert [c.registers for c in plain.candidates] == [None] * 5 + [128]
    assert all(c.registers is None for c in causal.candidates)


def test_every_length_of_a_shape_class_decides_alike_and_shares_one_module():
    """Decode one key longer, or a prompt a few tokens shorter, runs the module built for
    its shape class: the split is decided at the power of two at or below each extent,
    tiles are powers of two, and the kernels read extents as arguments.  In [4096, 8192)
    the text differs only where the keys fill whole tiles of 256 (no masks)."""
    program = compiler.compile(DECODE, backend="triton")

    def built(keys: int):
        binding = program.binder({"Q": _input((8, 128), torch.bfloat16), "K": _input((8, keys, 128), torch.bfloat16),
                                  "V": _input((8, keys, 128), torch.bfloat16), "scale": 0.125})
        (kernel,) = program.backend.specialised_for(binding, sm_count=H100_SMS).kernels
        return kernel.split, program.backend.source_for(binding, sm_count=H100_SMS)
    splits, sources = zip(*(built(keys) for keys in range(4097, 8192, 211)))
    assert set(splits) == {built(4096)[0]} and splits[0] > 1          # 4097 + 211 k: none a multiple of 256
    assert len(set(sources)) == 1
    assert built(4096 + 256)[1] == built(4096)[1] != built(4097)[1]
    assert built(8192)[0] > splits[0]               # the next class splits further


def test_the_autotuner_keys_on_shape_classes():
    """A tuned kernel takes each extent's bit length beside it, and the autotuner keys on those."""
    source = ModuleBuilder(concrete("matmul"), ()).build().source
    assert "key=['class_i', 'class_j', 'class_k']" in source
    assert 'n["i"].bit_length(), n["j"].bit_length(), n["k"].bit_length())' in source


def test_without_sms_nothing_splits():
    (kernel,) = concrete("decode", sm_count=None).kernels
    assert kernel.split == 1 and kernel.split_why == ""


def test_matmul_groups_its_two_tuned_tiles():
    (kernel,) = concrete("matmul").kernels
    assert [(t.index, t.how, t.tuned) for t in kernel.grid] == [("i", TILED, True), ("j", TILED, True)]
    assert kernel.grouped and kernel.longest_first is None
    assert kernel.tuning == "matrix-product tilings of i x j x k" and len(kernel.candidates) == 8
    assert kernel.candidates[0].tiles == (("i", 128), ("j", 128), ("k", 64))
    assert "programs: in groups of tile rows" in str(kernel)


def test_layernorm_rows_stream_untuned():
    kernels = concrete("layernorm", dtype=torch.float32).kernels
    assert kernels and all(not t.tuned for k in kernels for t in k.grid)
    assert all(k.tuning == "launch configurations, tiles as decided" for k in kernels)
    assert all(c.tiles == () for k in kernels for c in k.candidates)


def test_a_memory_bound_row_streams_past_the_cache_and_keeps_rows_larger_than_l2():
    """A reduction without tl.dot whose rows no other program reads marks them past the
    cache; where they outgrow L2, an earlier read keeps them for the second one."""
    program = compiler.compile(LAYERNORM, backend="triton")
    binding = program.binder({"X": _input((8192, 8192), torch.bfloat16)})
    for l2, big in ((50 * 2 ** 20, True), (2 ** 30, False)):
        (kernel,) = program.backend.specialised_for(binding, sm_count=H100_SMS, l2_bytes=l2).kernels
        assert kernel.past_cache == (("X", ("i", "j"), big),)
    (attention,) = concrete("causal").kernels      # K and V: every program of a head reads them
    assert attention.past_cache == ()


def test_float32_contraction_without_tf32_is_not_held_whole_past_64():
    """A float32 tl.dot without TF32 sums its products in order: a nested contraction
    over more than 64 values streams (compensated) instead of one whole tile."""
    source = "O[i,j] = softmax[m](Q[i,k] * K[m,k]) * V[m,j]"
    program = compiler.compile(source, backend="triton")
    inputs = {"Q": (256, 128), "K": (512, 128), "V": (512, 32)}
    narrow = {"Q": (256, 64), "K": (512, 64), "V": (512, 32)}
    for shapes, how in ((inputs, TILED), (narrow, WHOLE)):
        binding = program.binder({k: _input(v, torch.float32) for k, v in shapes.items()})
        (kernel,) = program.backend.specialised_for(binding, sm_count=H100_SMS).kernels
        (nested,) = [f for f in kernel.folds if f.nested]
        assert nested.tile("k").how == how


def test_a_nested_fold_shares_the_whole_tile_the_grid_or_the_epilogue_holds():
    """The saved attention backward at d = 128: dK's grid holds k and j whole, and the
    scores' sum over k and dO V^T's sum over j inside its loop hold them whole in the
    same tiles, so they are one axis each (Q and dO loaded once a step); dQ's epilogue
    holds k whole, which the scores' sum shares (K loaded once a step)."""
    backward = compiler.grad(CAUSAL, saved=True)
    program = compiler.compile(backward.text, backend="triton")
    shapes = {n: (2, 4, 1024, 128) for n in ("Q", "K", "V", "O", "dO")} | {"lse_O": (2, 4, 1024)}
    binding = program.binder({n: _input(shapes[n], torch.float32 if n == "lse_O" else torch.bfloat16)
                              if n in shapes else 0.088 for n in backward.inputs})
    dq, dk = program.backend.specialised_for(binding, sm_count=H100_SMS, arch=90).kernels
    assert [str(f) for f in dk.folds] == [
        "fold[i] of acc, acc_2: i/64 tuned (tl.dot) [bounds: i >= m] [interior tiles without i >= m]",
        "nested fold[k] of acc: k/128 whole [k shares the grid's tile]",
        "nested fold[j] of acc: j/128 whole [j shares the grid's tile]"]
    assert [str(t) for t in dk.grid[-2:]] == ["k/128 whole (a field does not vary over it)",
                                              "j/128 whole (a field does not vary over it)"]
    assert [str(f) for f in dq.folds if f.nested] == [
        "nested fold[k] of acc: k/128 whole [k shares the epilogue's tile]",
        "nested fold[j] of acc: j/128 whole"]
    assert str(dq.epilogue[0]).startswith("k/128 whole")


@pytest.mark.parametrize("name", sorted(SIZES))
def test_the_backend_builds_what_was_decided(name):
    """Every grid tile, tuned tile and split of the built kernels is the concrete
    schedule's: the emitter sizes nothing itself."""
    c = concrete(name)
    builder = ModuleBuilder(c, ())
    builder.build()
    for kernel, (code, n_split) in zip(c.kernels, builder.kernels):
        assert n_split == kernel.split
        blocks = dict(code.grid_blocks)
        for t in kernel.grid:
            if t.how == ONE_AT_A_TIME:
                assert blocks[t.index] is None
            else:
                assert code.constexprs[blocks[t.index]] == t.size
        tuned_grid = {t.index for t in kernel.grid if t.tuned}
        assert {index for role, index in code.tunable.values() if role == "grid"} == tuned_grid
        tuned_loops = {t.index for f in kernel.folds for t in f.tiles if t.tuned}
        assert {index for role, index in code.tunable.values() if role == "loop"} == tuned_loops
        loop_sizes = {t.size for f in kernel.folds for t in f.tiles if t.how != ONE_AT_A_TIME}
        assert loop_sizes <= set(code.constexprs.values())


def test_every_ranged_comparison_has_a_dead_tile_test():
    from compiler.backend.triton.emit import DEAD_WHEN
    assert DEAD_WHEN.keys() == RANGED


def test_specialise_is_a_pure_function_of_schedule_and_signature():
    c = concrete("causal")
    assert specialise(c.schedule, c.signature) == specialise(c.schedule, c.signature) == c


def test_cli_prints_the_specialised_schedule(capsys):
    code = main(["ir", "--print-after", "specialise", "-e", DECODE, "--size", "h=8", "--size", "m=32768",
                 "--size", "k=64", "--size", "j=64", "--dtype", "bfloat16", "--sms", "132"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert out.startswith("# after specialise\nspecialised to h=8, j=64, k=64, m=32768; bfloat16; 132 SMs")
    assert "ways: 8 programs for 132 SMs" in out and "fold[m] of r, l, u" in out


def _linear_cross_entropy_backward(hidden: int) -> ConcreteSchedule:
    """The concrete schedule of a fused linear cross-entropy's gradient program (H, W) at
    8 x 1024 tokens, a vocabulary of 32768 and this hidden width, on an H100."""
    from compiler.nn import FusedLinearCrossEntropy
    program = compiler.compile(FusedLinearCrossEntropy().source(3), backend="triton")
    gradient = program._gradient(("H", "W"), saved=True)
    inputs = {"H": _input((8, 1024, hidden), torch.bfloat16), "W": _input((32768, hidden), torch.bfloat16),
              "Y": torch.zeros(8, 1024, dtype=torch.int64), "dloss": torch.ones((), dtype=torch.bfloat16),
              "lse_lse": _input((8, 1024), torch.float32)}
    typed, binding = gradient._typed(inputs)
    return typed.backend.specialised_for(binding, sm_count=H100_SMS, arch=90)


def test_a_grid_index_whose_tiles_each_recompute_the_nested_folds_takes_the_widest_tile():
    # at d = 512 the fused kernels' dW[v, d] and dH[t0, t1, d] fold the logits
    # sum[d](H[t0, t1, d] * W[v, d]) afresh for every tile of d (storing them once costs
    # more): two tiles of 256 recompute them twice, not 8 times
    concrete = _linear_cross_entropy_backward(512)
    assert concrete.schedule.chunking is None
    grids = {k.schedule.statements[0].name: {t.index: t.size for t in k.grid} for k in concrete.kernels}
    assert grids["dW"] == {"v": 64, "d": 256} and grids["dH"] == {"t0": 0, "t1": 64, "d": 256}


def test_a_buffer_larger_than_the_inputs_is_made_a_chunk_at_a_time():
    # at d = 768 recomputing the logits for each tile of d costs more than storing dZ once,
    # but dZ[t0, t1, v] would be 8192 x 32768: the kernels from the one that stores it to
    # the last that reads it run over chunks of v, each dZ[t0, t1, chunk] no larger than W
    # (32768 x 768); dH sums over v, so it adds up the chunks' sums
    concrete = _linear_cross_entropy_backward(768)
    run = concrete.schedule.chunking
    # the budget allows 3072 values of v; 2816 makes dW[v, d] 22 x 6 tiles of 128, one wave
    # of 132 programs where 3072 made 144 (two waves, the second of 12)
    assert (run.index, run.longest, run.size, run.lengths, run.accumulated) == \
        ("v", 3072, 2816, (2816, 1792), ("dH",))
    assert "2816 fills 132 SMs best (4608 waves of tile steps against 5760 at 3072)" in str(concrete)
    assert dict(run.narrowed) == {"W": 0, "dW": 0}
    kernels = {k.schedule.statements[0].name: k for k in concrete.kernels}
    stored, = run.buffers
    assert 8192 * run.size <= 32768 * 768
    # both products read dZ as a bfloat16 operand (H and W are bfloat16), so it is stored in
    # bfloat16, though the program also reads the float32 row statistics and upstream gradient
    assert concrete.dtype(stored) == torch.bfloat16 and concrete.dtype("lse_lse") == torch.float32
    # both products read the one stored dZ, on tensor cores, over every token
    for name in ("dH", "dW"):
        assert stored in {n.tensor for n in nodes(kernels[name].schedule.statements[0].expr)
                          if isinstance(n, Access)}
        assert all("tl.dot" in t.why for t in kernels[name].grid if t.how != ONE_AT_A_TIME)
    assert "run in 12 chunks of v, 2816 at a time" in str(concrete)


LOGSUMEXP_OF_LOGITS = "lse[t] = logsumexp[v](sum[d](H[t, d] * W[v, d]))"


def _logsumexp_of_logits(tokens: int, vocabulary: int) -> ConcreteSchedule:
    program = compiler.compile(LOGSUMEXP_OF_LOGITS, backend="triton")
    binding = program.binder({"H": _input((tokens, 768), torch.bfloat16),
                              "W": _input((vocabulary, 768), torch.bfloat16)})
    return program.backend.specialised_for(binding, sm_count=H100_SMS, arch=90)


def test_a_split_fold_over_a_streamed_matrix_product_is_tuned():
    """A linear cross-entropy's logsumexp over the vocabulary (8192 rows: 128 programs of
    64 rows, fewer than two an SM) splits over v, and its tiles are still tuned: rows x
    vocabulary over the product's depth, the matrix product's tiles beside the running
    state (the split fixed them at 64 x 64 x 64 before: 290 TFLOP/s on the H200)."""
    c = _logsumexp_of_logits(8192, 32768)
    (kernel,) = c.kernels
    assert kernel.split > 1 and kernel.tuned and kernel.longest_first is None
    assert kernel.tuning == "streamed tilings of t x v over a depth d"
    assert [dict(k.tiles) for k in kernel.candidates][0] == {"t": 128, "v": 128, "d": 64}
    assert {(k.warps, k.stages) for k in kernel.candidates} >= {(8, 3), (4, 3)}
    (outer,) = [f for f in kernel.folds if not f.nested]
    assert outer.chunked == "v" and not outer.interior
    # the tiling it had untuned is one of the candidates
    assert {"t": 64, "v": 64, "d": 64} in [dict(k.tiles) for k in kernel.candidates]


def test_a_split_loop_tile_is_capped_at_its_share_of_the_split(monkeypatch):
    """No candidate's tile of the split index leaves a split without a tile: at 128 rows
    (one program) the vocabulary of 2048 splits into chunks of at most 64 (tuned here
    whatever its work, to see the cap)."""
    import compiler.specialise.stage as stage
    monkeypatch.setattr(stage, "TUNE_SPLIT_WORK", 0)
    c = _logsumexp_of_logits(128, 2048)
    (kernel,) = c.kernels
    assert kernel.split > 1 and kernel.tuned
    share = -(-2048 // kernel.split)
    assert all(dict(k.tiles)["v"] <= max(16, 1 << (share - 1).bit_length()) for k in kernel.candidates)


def test_a_tuned_split_kernel_passes_its_tiles_to_the_merge_and_counts_the_most_programs(monkeypatch):
    """The autotuner binds the partial kernel's tiles; the merge it calls takes them by
    name, and the arrival counters are sized for the candidate of the most programs: with
    a candidate of 32-row tiles beside the table's (the split decided at 64), one counter
    per 32 rows."""
    import compiler.specialise.stage as stage
    monkeypatch.setattr(stage, "STREAMED_DEPTH", [*stage.STREAMED_DEPTH, (32, 64, 64, 4, 3)])
    c = _logsumexp_of_logits(8192, 32768)
    builder = ModuleBuilder(c, ())
    built = builder.build()
    (code, _), = builder.kernels
    assert code.name in builder.tuned and "@triton.autotune(" in built.source
    assert "BLOCK_t=BLOCK_t)" in code.source
    assert '"einfold_lse_arrivals": torch.zeros((((n["t"] + 31) // 32),)' in built.source


def test_without_an_sm_count_a_chunk_is_the_longest_of_near_equal_chunks():
    from compiler.nn import FusedLinearCrossEntropy
    program = compiler.compile(FusedLinearCrossEntropy().source(2), backend="triton")
    gradient = program._gradient(("H", "W"), saved=True)
    inputs = {"H": _input((8192, 768), torch.bfloat16), "W": _input((32768, 768), torch.bfloat16),
              "Y": torch.zeros(8192, dtype=torch.int64), "dloss": torch.ones((), dtype=torch.bfloat16),
              "lse_lse": _input((8192,), torch.float32)}
    typed, binding = gradient._typed(inputs)
    run = typed.backend.specialised_for(binding, sm_count=None, arch=90).schedule.chunking
    assert (run.size, run.lengths, run.sized) == (3072, (3072, 2048), "")
    on_h100 = typed.backend.specialised_for(binding, sm_count=H100_SMS, arch=90).schedule.chunking
    assert on_h100.size == 2816 and on_h100.sized


def test_a_split_kernel_of_little_work_launches_at_the_splits_tiles():
    """Decode over grouped queries (4 query heads a key head, one row each) splits 16 ways:
    its work (4 programs x 64 tiles) is far below TUNE_SPLIT_WORK, so a first call of each
    length class compiles one kernel, not six, and times none."""
    program = compiler.compile("O[b,g,r,i,j] = softmax[m](Q[b,g,r,i,k] * K[b,g,m,k] * scale) * V[b,g,m,j]",
                               backend="triton")
    binding = program.binder({"Q": _input((1, 4, 4, 1, 128), torch.bfloat16),
                              "K": _input((1, 4, 4096, 128), torch.bfloat16),
                              "V": _input((1, 4, 4096, 128), torch.bfloat16), "scale": 0.088})
    (kernel,) = program.backend.specialised_for(binding, sm_count=H100_SMS, arch=90).kernels
    assert kernel.split > 1 and not kernel.tuned and kernel.tuning == ""
    (heavy,) = _logsumexp_of_logits(8192, 32768).kernels
    assert heavy.split > 1 and heavy.tuned


def test_a_fold_inside_the_epilogue_loop_shares_the_streamed_budget_with_the_epilogues_tile():
    # the Chamfer distance's gradient: dX[b,i,k] sums over m a body that spans the epilogue's
    # k tile; its m tile counts k's, as a nested fold's whole tile counts (m/4096 beside k/128
    # was a tile of 512k elements)
    source = ("C_1[b,i,m,k] = where(m == argmin[m](sum[k]((X[b,i,k] - Y[b,m,k]) ** 2), m), dC[b,i], 0.0) "
              "* 2 * (X[b,i,k] - Y[b,m,k])\ndX[b,i,k] = sum[m](C_1[b,i,m,k])")
    program = compiler.compile(source, backend="triton", outputs=("dX",))
    shapes = {"X": (1, 4096, 128), "Y": (1, 4096, 128), "dC": (1, 4096)}
    binding = program.binder({k: _input(v, torch.float32) for k, v in shapes.items()})
    (kernel,) = program.backend.specialised_for(binding, sm_count=H100_SMS, arch=90).kernels
    (epilogue,) = kernel.epilogue
    assert epilogue.index == "k" and epilogue.size >= 64
    tiles = [t.size for f in kernel.folds if not f.nested for t in f.tiles if t.index == "m"]
    assert tiles and all(size * epilogue.size <= STREAM_BLOCK for size in tiles), str(kernel)


@pytest.mark.parametrize("window_first", [False, True])
def test_a_convolutions_product_is_as_deep_as_its_channels_whichever_order_they_are_written_in(window_first):
    # sum[c, r] over 256 channels and a window of 3: c is the tl.dot's depth and r one tap at a
    # time (a depth of 3, padded to 16, ran at 0.14x cuDNN against 0.21x; H200)
    reduced = "r, c" if window_first else "c, r"
    program = compiler.compile(f"Y[b, o, t] = sum[{reduced}](W[o, c, r] * X[b, c, t + r])", backend="triton")
    shapes = {"X": (16, 256, 4096), "W": (256, 256, 3)}
    binding = program.binder({k: _input(v, torch.bfloat16) for k, v in shapes.items()})
    (kernel,) = program.backend.specialised_for(binding, sm_count=H100_SMS, arch=90).kernels
    (fold,) = kernel.folds
    how = {t.index: (t.how, t.size) for t in fold.tiles}
    assert how["r"][0] == ONE_AT_A_TIME and how["c"][0] == TILED and how["c"][1] >= 32, str(kernel)


def test_of_two_sides_of_one_operand_the_shorter_runs_one_value_at_a_time():
    # a pooled convolution: max[q] over X[b, c, 2*u + q + r] beside the grid's u tiles the
    # positions and takes the window one value at a time; a strided layer's weight gradient,
    # sum[b, u] over H[b, o, u + q] recomputed, tiles u and takes the grid's q one at a time
    # (before: 4-D operand tiles, past Triton's limit or the chip's shared memory)
    pooled = compiler.compile("Y[b, o, t] = sum[c, r](W[o, c, r] * X[b, c, t + r])\n"
                              "P[b, o, u] = max[q](Y[b, o, 2*u + q])", backend="triton", outputs=("P",))
    binding = pooled.binder({"X": _input((2, 5, 61), torch.float32), "W": _input((7, 5, 4), torch.float32), "q": 2})
    (kernel,) = pooled.backend.specialised_for(binding, sm_count=H100_SMS, arch=90).kernels
    outer = next(f for f in kernel.folds if not f.nested)
    assert [(t.index, t.how) for t in outer.tiles] == [("q", ONE_AT_A_TIME)], str(kernel)
    assert any(t.index == "u" and t.how == TILED for t in kernel.grid), str(kernel)
    weights = compiler.compile("H[b, o, t] = relu(sum[c, r](W[o, c, r] * X[b, c, t + r]))\n"
                               "dV[p, o, q] = sum[b, u](dY[b, p, u] * H[b, o, u + q])", backend="triton",
                               outputs=("dV",))
    shapes = {"X": (2, 3, 13), "W": (4, 3, 3), "dY": (2, 5, 10)}
    binding = weights.binder({k: _input(v, torch.float32) for k, v in shapes.items()})
    (kernel,) = weights.backend.specialised_for(binding, sm_count=H100_SMS, arch=90).kernels
    assert any(t.index == "q" and t.how == ONE_AT_A_TIME for t in kernel.grid), str(kernel)
    outer = next(f for f in kernel.folds if not f.nested)
    assert any(t.index == "u" and t.how == TILED for t in outer.tiles), str(kernel)


def test_a_convolutions_spellings_get_one_specialised_schedule():
    # renamed indices, swapped operands, the window written first in the sum and in the
    # subscript: each index in the same role gets the same tile, and one autotune table
    spellings = {"Y[b, o, t] = sum[c, r](W[o, c, r] * X[b, c, t + r])": "botcr",
                 "Y[b, o, t] = sum[r, c](X[b, c, r + t] * W[o, c, r])": "botcr",
                 "Y[n, p, s] = sum[q, k](X[n, q, k + s] * W[p, q, k])": "npsqk"}
    shapes = {"X": (16, 256, 4096), "W": (256, 256, 3)}

    def roles(source, names):
        program = compiler.compile(source, backend="triton")
        binding = program.binder({k: _input(v, torch.bfloat16) for k, v in shapes.items()})
        (kernel,) = program.backend.specialised_for(binding, sm_count=H100_SMS, arch=90).kernels
        role = dict(zip(names, "botcr"))
        tiles = {role[t.index]: (t.how, t.size, t.tuned) for t in kernel.grid}
        tiles |= {role[t.index]: (t.how, t.size, t.tuned) for f in kernel.folds for t in f.tiles}
        candidates = str(kernel).split("autotuned over")[1].splitlines()[1:]
        return tiles, [re.sub(r"\b(\w)/", lambda m: f"{role[m.group(1)]}/", line) for line in candidates]

    (first, *rest) = [roles(source, names) for source, names in spellings.items()]
    assert all(r == first for r in rest), (first, rest)


@pytest.mark.parametrize("depth, dtype, precision", [
    (16, torch.float32, "ieee"), (64, torch.float32, "tf32x3"), (1024, torch.float32, "tf32x3"),
    (4096, torch.float32, "ieee"), (64, torch.bfloat16, ""),
])
def test_a_float32_contractions_precision_follows_its_depth(depth, dtype, precision):
    """Without TF32, a float32 tl.dot of contractions 64 to 1024 deep multiplies as
    three TF32 products (float32's accuracy there, and the faster), a shallower or a
    deeper one in IEEE float32; a bfloat16 kernel has nothing to decide. The decision
    is printed and the kernel is built as printed."""
    program = compiler.compile("C[i,m] = sum[k](X[i,k] * Y[m,k])", backend="triton")
    binding = program.binder({"X": _input((512, depth), dtype), "Y": (_input((256, depth), dtype))})
    (kernel,) = program.backend.specialised_for(binding, sm_count=H100_SMS, arch=90).kernels
    assert kernel.dot_precision == precision
    assert ("float32 tl.dot: " in str(kernel)) == bool(precision)
    assert not precision or "float32 tl.dot: " + DOT_PRECISIONS[precision] in str(kernel)
    if precision:
        source = program.backend.source_for(program.binder({"X": torch.zeros(2, depth), "Y": torch.zeros(3, depth)}))
        assert f'input_precision="{precision}"' in source
