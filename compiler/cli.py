"""The `einfold` command line.

`parse`, `ir`, `grad` and `explain` import neither torch nor Triton's runtime, so
they start quickly; `run`, `dump`, `tune` and `bench` import torch when they need tensors.
Every mistake of the user (a bad option, a bad program, unreadable input)
exits with status 2 and a message on stderr, never a traceback."""
from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path

from . import __version__
from .errors import EinfoldError, ImplicitSumWarning
from .ir import format_program

DTYPES = ("float16", "bfloat16", "float32", "float64")
RUN_POINTS = 1 << 16      # einfold run: the index space its default extents fill, about
BACKEND_CHOICES = ("auto", "triton", "reference")
BENCH_GROUPS = ("attention", "decode", "memory", "matmul", "backward", "training", "flex", "general", "host",
                "distributed")
MAX_EXTENT = 2 ** 31 - 1            # one index's extent on the command line
MAX_SEED = 2 ** 63 - 1
ATTENTION = "O[i,j] = softmax[m](Q[i,k] * K[m,k] * scale) * V[m,j]"


class _UsageError(Exception):
    """A bad command line or unreadable input: reported in one line, exit status 2."""


def _read_program(args) -> str:
    if args.expr is not None:
        if args.file is not None:
            raise _UsageError("give a program with -e EXPR or a FILE, not both")
        return args.expr
    if args.file is None:
        raise _UsageError("give a program with -e EXPR or a FILE")
    try:
        data = Path(args.file).read_bytes()
    except IsADirectoryError:
        raise _UsageError(f"cannot read {args.file}: it is a folder") from None
    except OSError as e:
        raise _UsageError(f"cannot read {args.file}: {e.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _UsageError(f"cannot read {args.file}: not UTF-8 text (byte {e.start})") from None


def _parse_sizes(items: list[str], option: str = "--size") -> dict[str, int]:
    sizes = {}
    for item in items:
        name, _, value = item.partition("=")
        if not value.isdigit() or not name.isidentifier():
            raise _UsageError(f"{option} takes INDEX=N, got '{item}'")
        if int(value) > MAX_EXTENT:
            raise _UsageError(f"{option} {name}={value}: an extent is at most {MAX_EXTENT}")
        if name in sizes and sizes[name] != int(value):
            raise _UsageError(f"{option} gives {name} twice: {sizes[name]} and {value}")
        sizes[name] = int(value)
    return sizes


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: '{text}'") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"a seed is between 0 and {MAX_SEED}, not {text}")
    return value


def _count(text: str) -> int:
    """A count of something a GPU has (its SMs): a positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"at least 1, not {text}")
    return value


def _random_inputs(program, args, points: int | None = None):
    """Random inputs for --size/--dtype/--seed, or a usage error naming what is wrong.
    `points`: the indices without a --size share one extent (at most DEFAULT_EXTENT,
    at least 2) such that the program's index space holds about this many points."""
    import torch

    from .random_inputs import DEFAULT_EXTENT, random_inputs
    sizes = _parse_sizes(args.size)
    unknown = sorted(set(sizes) - {ix for ix, _ in program.checked.extents})
    if unknown:
        raise _UsageError(f"--size names no index of the program: {', '.join(unknown)}")
    if points is not None:
        by_symbol = dict(program.checked.extents)
        given = {by_symbol[ix]: n for ix, n in sizes.items()}
        free = {symbol for _, symbol in program.checked.extents} - set(given)
        room = points / max(1, math.prod(given.values()))
        extent = max(2, min(DEFAULT_EXTENT, int(room ** (1 / len(free)) + 1e-9))) if free else DEFAULT_EXTENT
        sizes |= {ix: extent for ix, symbol in program.checked.extents if symbol in free}
    try:
        return random_inputs(program.checked, sizes, dtype=getattr(torch, args.dtype),
                             seed=getattr(args, "seed", 0))
    except (RuntimeError, MemoryError) as e:       # allocation of inputs too large for this machine
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise _UsageError(f"cannot make random inputs of these sizes: {first}") from None


# ---------------------------------------------------------------- commands
def cmd_parse(args) -> int:
    from .check import check
    from .parse import parse
    print(format_program(check(parse(_read_program(args)))), end="")
    return 0


def cmd_ir(args) -> int:
    from .check import check
    from .parse import parse
    from .passes import run_pipeline
    program = check(parse(_read_program(args)))
    wanted = args.print_after
    if wanted == "all":
        print("# after check")
        print(format_program(program), end="")

    def observe(name, ir):
        if wanted in ("all", name):
            print(f"# after {name}")
            print(format_program(ir), end="")

    if args.rows and not args.shard:
        raise _UsageError("--rows shards the outputs' rows beside a reduction: it needs --shard INDEX")
    final = run_pipeline(program, observe=observe)
    if args.shard:
        from .passes.shard import shard
        print(shard(final, args.shard, args.rows), end="")     # the local and merge programs of a sharded reduction
        return 0
    if wanted is None:
        print(format_program(final), end="")
    if wanted in ("all", "schedule"):
        from .schedule import schedule
        print("# after schedule")            # kernels, grids, loops and buffers, for any sizes
        print(schedule(final, program.outputs))
    if wanted == "specialise":         # not in "all": it needs sizes, dtypes and a GPU
        from . import compile
        compiled = compile(_read_program(args), backend="triton")
        inputs = _random_inputs(compiled, args)
        unknown = sorted(set(args.int) - {i.name for i in compiled.checked.inputs if i.rank})
        if unknown:
            raise _UsageError(f"--int names no tensor input of the program: {', '.join(unknown)}")
        inputs |= {name: inputs[name].round().long() for name in args.int}
        typed, binding = compiled._typed(inputs)        # the program typed for integer inputs
        print("# after specialise")          # every tile, loop and split, for these sizes and this GPU
        print(typed.backend.specialised_for(binding, **_gpu(args)))
    return 0


def cmd_grad(args) -> int:
    from .check import check
    from .arguments import checked_wrt
    from .grad import derive
    from .parse import parse
    program = check(parse(_read_program(args)), outputs=tuple(args.output) if args.output else None)
    backward, _ = derive(program, checked_wrt(args.wrt, program), None, args.saved)
    print(format_program(backward), end="")
    return 0


def cmd_run(args) -> int:
    from . import compile, reference
    from .bind import bind
    from .random_inputs import relative_error
    program = compile(_read_program(args), backend=args.backend)
    inputs = _random_inputs(program, args, points=RUN_POINTS)
    outputs = program(**inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    # The oracle evaluates the checked (unfactorised) program, so that the passes are checked too.
    binding = bind(program.checked, inputs)
    expected = reference.run(program.checked, binding.values, binding.extents, program.outputs)
    print(f"backend {program.backend.name}, dtype {args.dtype}")
    for name, got in zip(program.outputs, outputs):
        want = expected[name]
        print(f"{name}: shape {tuple(got.shape)}, relative error vs float64 oracle "
              f"{relative_error(got, want):.3e}")
    return 0


def cmd_explain(args) -> int:
    from . import compile
    print(compile(_read_program(args), backend=args.backend).explain(), end="")
    return 0


def _gpu(args) -> dict:
    """The GPU a module is specialised to: this machine's (SM count, L2 cache, compute
    capability), with --sms and --arch in place of what they give; no GPU, none."""
    import torch
    gpu = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
    sms = getattr(args, "sms", None)
    return {"sm_count": sms if sms is not None else gpu and gpu.multi_processor_count,
            "l2_bytes": gpu and getattr(gpu, "L2_cache_size", None),
            "arch": args.arch if args.arch is not None else gpu and 10 * gpu.major + gpu.minor}


def cmd_dump(args) -> int:
    import torch

    from . import compile
    program = compile(_read_program(args), backend="triton")
    inputs = _random_inputs(program, args)
    gpu = _gpu(args)
    source = program.backend.source_for(program.binder(inputs), **gpu)
    if args.output:
        try:
            Path(args.output).write_text(source)
        except IsADirectoryError:
            raise _UsageError(f"cannot write {args.output}: it is a folder") from None
        except OSError as e:
            raise _UsageError(f"cannot write {args.output}: {e.strerror}") from None
        print(f"einfold dump: wrote {args.output}", file=sys.stderr)
    else:
        print(source, end="")
    if gpu["sm_count"] is None:
        print("einfold dump: no GPU here, so the module is shown without an automatic split and "
              "without evict_last hints (the GPU's SM count and L2 cache decide them)", file=sys.stderr)
    return 0


def cmd_cache(args) -> int:
    import os

    from .backend.triton import cache
    folder = cache.cache_dir()
    modules = sorted(folder.glob("einfold_*.py"))
    if args.clear:
        for path in modules:
            path.unlink(missing_ok=True)
        print(f"removed {len(modules)} generated module(s) from {folder}")
        return 0
    size = sum(path.stat().st_size for path in modules)
    print(f"generated modules: {folder} ({len(modules)} module(s), {size / 1e6:.1f} MB; "
          f"{cache.CACHE_ENV} chooses the folder)")
    import triton
    knobs = getattr(triton, "knobs", None)
    triton_cache = getattr(getattr(knobs, "cache", None), "dir", None) or \
        os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    print(f"compiled kernels and autotuning results: {triton_cache} (Triton's cache)")
    _print_tuning_records()
    return 0


def _print_tuning_records() -> None:
    """The tuning records this process loads at its first tuned launch: each file of
    EINFOLD_TUNING with its records' count by GPU model."""
    from collections import Counter

    from .backend.triton import records
    paths = records.environment_paths()
    if not paths:
        print(f"tuning records: none ({records.TUNING_ENV} names files of them, which compiler.save_tuning "
              f"and einfold tune write)")
    for path in paths:
        by_gpu = Counter(key.gpu for key in records.read_records(path))
        models = "".join(f", {count} of {gpu}" for gpu, count in sorted(by_gpu.items()))
        print(f"tuning records: {path} ({sum(by_gpu.values())} record(s){models}; from {records.TUNING_ENV})")


def cmd_tune(args) -> int:
    import torch

    from . import compile
    from .backend.triton.records import save_tuning
    from .tuning import shape_sizes, tune
    program = compile(_read_program(args), backend="triton")
    shapes = [shape_sizes(program, _parse_sizes(text.split(","), "--shape")) for text in args.shape]
    if not torch.cuda.is_available():
        raise _UsageError("tune needs a CUDA GPU: tuning times each kernel's candidates on one")
    try:
        tune(program, shapes, dtype=getattr(torch, args.dtype))
    except torch.cuda.OutOfMemoryError as e:
        raise _UsageError(f"cannot tune at these shapes: {str(e).splitlines()[0]}") from None
    written = save_tuning(args.output)
    print(f"wrote {written} tuning record(s) of {torch.cuda.get_device_name()} ({len(shapes)} shape(s)) "
          f"to {args.output}")
    return 0


def cmd_bench(args) -> int:
    import torch

    from . import bench, bench_general, bench_gpt
    if not torch.cuda.is_available():
        raise _UsageError("bench needs a CUDA GPU (the benchmarks compare kernels on one)")
    cases_of = {**bench.GROUPS, **bench_general.GROUPS}
    rows_of = {**bench.ROW_GROUPS, "training": bench_gpt.gpt_rows}
    groups = args.group or list(dict.fromkeys([*cases_of, *rows_of]))      # the default: every group of one GPU
    if "distributed" in groups:
        from . import bench_distributed
        bench_distributed.main(Path(args.out), quick=args.quick, only=args.case)
        groups = [g for g in groups if g != "distributed"]
    if groups:
        bench.main(Path(args.out), groups, quick=args.quick, only=args.case, cases_of=cases_of, rows_of=rows_of)
    return 0


# ---------------------------------------------------------------- the parser
class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line, no usage dump: the mistake and where the help is."""
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _examples(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def _command(sub, name: str, help: str, *examples: str, program: bool = True) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".",
                       epilog=_examples(*examples), formatter_class=argparse.RawDescriptionHelpFormatter)
    if program:
        p.add_argument("file", nargs="?", help="a file holding the program (UTF-8 text)")
        p.add_argument("-e", "--expr", metavar="EXPR", help="the program text itself, instead of a FILE")
    return p


def _add_inputs(p: argparse.ArgumentParser, default: str = "16 for every index") -> None:
    p.add_argument("--size", action="append", default=[], metavar="INDEX=N",
                   help=f"extent of an index; repeat for several (default {default})")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="dtype of the random float inputs (default: %(default)s)")


def _add_gpu(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", type=int, metavar="CC",
                   help="the GPU's compute capability as 10 * major + minor (90: Hopper, whose streamed "
                        "rescaled folds take the Hopper form in Gluon); default: this machine's GPU, or none")
    p.add_argument("--sms", type=_count, metavar="N",
                   help="the GPU's SM count, which decides automatic splits (132: H100 SXM); "
                        "default: this machine's GPU, or none (no automatic split)")


def build_parser() -> argparse.ArgumentParser:
    from .passes import PIPELINE
    parser = _Parser(
        prog="einfold", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="einfold: tensor expressions in index notation, compiled into fused Triton kernels.",
        epilog=_examples(f'einfold explain -e "{ATTENTION}"',
                         f'einfold run -e "{ATTENTION}" --size i=128 --size m=256',
                         "einfold COMMAND --help     (options and examples of one command)"))
    parser.add_argument("--version", action="version", version=f"einfold {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = _command(sub, "parse", "print the canonical form of a program (every reduction explicit)",
                 'einfold parse -e "C[i,j] = A[i,k] * B[k,j]"', "einfold parse layernorm.ein")
    p.set_defaults(run=cmd_parse)

    p = _command(sub, "ir", "print the IR after the passes, or after a given pass",
                 f'einfold ir -e "{ATTENTION}"',
                 f'einfold ir --print-after all -e "{ATTENTION}"')
    p.add_argument("--print-after", metavar="PASS",
                   choices=["all", *(name for name, _ in PIPELINE), "schedule", "specialise"],
                   help="print the IR after this pass, or the schedule (kernels and their loops, for any sizes), "
                        "or after every stage up to the schedule with 'all', or the specialised schedule (every "
                        "tile, loop and split for --size, --dtype, --sms and --arch) with 'specialise' "
                        f"(passes: {', '.join(name for name, _ in PIPELINE)})")
    _add_inputs(p)
    p.add_argument("--int", action="append", default=[], metavar="NAME",
                   help="with --print-after specialise: input NAME is an int64 tensor (ids, labels: a program "
                        "typed for it, where a fold equal to its values may run over them sorted); repeat for "
                        "several")
    _add_gpu(p)
    p.add_argument("--shard", metavar="INDEX",
                   help="print the two programs a reduction over INDEX sharded across processes runs "
                        "(Program.shard): each rank's local program and the merge of every rank's states")
    p.add_argument("--rows", metavar="INDEX",
                   help="with --shard: the outputs' rows sharded too (context parallelism; the inputs over "
                        "the --shard index go around a ring)")
    p.set_defaults(run=cmd_ir)

    p = _command(sub, "grad", "print the gradient program: the forward inputs and an upstream gradient "
                 "dO per output in, dX per input out", 'einfold grad -e "C[i,j] = A[i,k] * B[k,j]"',
                 f'einfold grad -e "{ATTENTION}" --wrt Q --wrt scale')
    p.add_argument("--wrt", action="append", metavar="NAME",
                   help="an input to differentiate with respect to; repeat for several, in the order the "
                        "gradients come (default: every input read with indices)")
    p.add_argument("--output", action="append", metavar="NAME",
                   help="a statement the gradients flow from; repeat for several (default: the program's "
                        "outputs)")
    p.add_argument("--saved", action="store_true",
                   help="read each softmax as exp(x - lse_<Statement>[...]) from the row logsumexp the forward "
                        "saves (an extra input), as the backward under torch autograd does, instead of "
                        "recomputing it")
    p.set_defaults(run=cmd_grad)

    p = _command(sub, "run", "run on random inputs and report the error against the float64 oracle",
                 f'einfold run -e "{ATTENTION}" --size i=128 --size m=256 --dtype bfloat16',
                 'einfold run -e "Y[i] = logsumexp[j](X[i,j])" --backend reference')
    _add_inputs(p, default=f"for the indices without one: one extent, at most 16, such that the program's "
                           f"index space holds about {RUN_POINTS} points")
    p.add_argument("--backend", default="auto", choices=BACKEND_CHOICES,
                   help="where to run: 'triton' kernels (on CPU under Triton's interpreter), the "
                        "float64 'reference' oracle, or 'auto' (= triton) (default: %(default)s)")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the random inputs (default: %(default)s)")
    p.set_defaults(run=cmd_run)

    p = _command(sub, "explain", "print the derivation, pass by pass, and the plan of the backend that "
                 "would run", f'einfold explain -e "{ATTENTION}"',
                 'einfold explain -e "Y[i] = logsumexp[j](X[i,j])" --backend reference')
    p.add_argument("--backend", default="auto", choices=BACKEND_CHOICES,
                   help="whose plan to show (default: %(default)s, i.e. triton)")
    p.set_defaults(run=cmd_explain)

    p = _command(sub, "dump", "print the generated Triton module (kernels and launcher) for given sizes",
                 f'einfold dump -e "{ATTENTION}" --size i=4096 --size m=4096 --dtype bfloat16',
                 f'einfold dump -e "{ATTENTION}" -o attention_kernels.py',
                 f'einfold dump -e "{ATTENTION}" --size i=4096 --size m=4096 --size k=128 --size j=128 '
                 f'--dtype bfloat16 --arch 90')
    _add_inputs(p)
    p.add_argument("-o", "--output", metavar="PATH", help="write the module to this file instead of stdout")
    _add_gpu(p)
    p.set_defaults(run=cmd_dump)

    p = _command(sub, "cache", "print where generated modules, compiled kernels and tuning records are kept, "
                 "or clear the modules",
                 "einfold cache", "einfold cache --clear", program=False)
    p.add_argument("--clear", action="store_true",
                   help="remove einfold's generated modules (they are written again on the next call)")
    p.set_defaults(run=cmd_cache)

    p = _command(sub, "tune", "tune the program's kernels at given shapes on this CUDA GPU and write the "
                 "choices to a tuning file (load it with EINFOLD_TUNING or compiler.load_tuning)",
                 f'einfold tune -e "{ATTENTION}" --shape i=4096,m=4096,k=128,j=128 --dtype bfloat16',
                 'einfold tune -e "C[i,j] = A[i,k] * B[k,j]" --shape i=4096,k=4096,j=4096 '
                 '--shape i=512,k=4096,j=4096 -o tuning.json')
    p.add_argument("--shape", action="append", required=True, metavar="INDEX=N,...",
                   help="the extents of every index of one shape to tune, separated by commas; repeat for "
                        "several shapes")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="dtype of the random float inputs (default: %(default)s)")
    p.add_argument("-o", "--output", default="tuning.json", metavar="PATH",
                   help="the tuning file to write; the records it holds already are kept unless retuned "
                        "(default: %(default)s)")
    p.set_defaults(run=cmd_tune)

    p = _command(sub, "bench", "benchmark the generated kernels against torch baselines (needs a CUDA GPU)",
                 "einfold bench --group attention --quick", "einfold bench --out results/", program=False)
    p.add_argument("--group", action="append", choices=BENCH_GROUPS,
                   help="a group of cases to run; repeat for several (default: every group of one GPU)")
    p.add_argument("--quick", action="store_true", help="a few small shapes per group")
    p.add_argument("--case", action="append", metavar="TEXT",
                   help="only the cases whose name contains TEXT; repeat for several (default: every case)")
    p.add_argument("--out", default="bench-results", metavar="DIR",
                   help="folder for bench.csv, bench.json and bench.png (default: %(default)s)")
    p.set_defaults(run=cmd_bench)
    return parser


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> str:
    """A warning as one line without a source frame (one that points into the program
    keeps its source line and caret); others' warnings keep their category."""
    if issubclass(category, ImplicitSumWarning):
        return f"einfold: warning: {str(message).removeprefix('einfold: ')}\n"
    text = " ".join(str(message).split())
    if text.startswith("einfold: "):
        return f"einfold: warning: {text.removeprefix('einfold: ')}\n"
    return f"{category.__name__}: {text}\n"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    formatwarning, warnings.formatwarning = warnings.formatwarning, _one_line_warning
    try:
        return args.run(args)
    except EinfoldError as e:
        print(f"einfold: {e}", file=sys.stderr)
        return 2
    except _UsageError as e:
        print(f"einfold: {e}", file=sys.stderr)
        return 2
    finally:
        warnings.formatwarning = formatwarning


if __name__ == "__main__":
    sys.exit(main())
