"""The `einfold` command line."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import EinfoldError
from .ir import format_program


class _UsageError(Exception):
    """A bad command line (not a bad program): reported like argparse's errors, exit status 2."""


def _read_program(args) -> str:
    if args.expr is not None:
        if args.file is not None:
            raise _UsageError("give a program with -e EXPR or a FILE, not both")
        return args.expr
    if args.file is None:
        raise _UsageError("give a program with -e EXPR or a FILE")
    try:
        return Path(args.file).read_text()
    except OSError as e:
        raise _UsageError(f"cannot read {args.file}: {e.strerror}") from None


def _add_program_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", nargs="?", help="file holding the program")
    p.add_argument("-e", "--expr", help="the program text itself")


def cmd_parse(args) -> int:
    from .check import check
    from .parse import parse
    print(format_program(check(parse(_read_program(args)))), end="")
    return 0


def cmd_ir(args) -> int:
    from .check import check
    from .parse import parse
    from .passes import PIPELINE, run_pipeline
    program = check(parse(_read_program(args)))
    wanted = args.print_after
    names = [name for name, _ in PIPELINE]
    if wanted not in (None, "all") and wanted not in names:
        raise _UsageError(f"unknown pass '{wanted}'; the passes are: {', '.join(names) or 'none'}")
    if wanted == "all":
        print("# after check")
        print(format_program(program), end="")

    def observe(name, ir):
        if wanted in ("all", name):
            print(f"# after {name}")
            print(format_program(ir), end="")

    final = run_pipeline(program, observe=observe)
    if wanted is None:
        print(format_program(final), end="")
    return 0


def _parse_sizes(items: list[str]) -> dict[str, int]:
    sizes = {}
    for item in items:
        name, _, value = item.partition("=")
        if not value.isdigit() or not name.isidentifier():
            raise _UsageError(f"--size takes INDEX=N, got '{item}'")
        sizes[name] = int(value)
    return sizes


def cmd_run(args) -> int:
    import torch

    from . import compile, reference
    from .bind import bind
    from .random_inputs import random_inputs, relative_error
    program = compile(_read_program(args), backend=args.backend)
    dtype = getattr(torch, args.dtype)
    sizes = _parse_sizes(args.size)
    unknown = sorted(set(sizes) - {ix for ix, _ in program.checked.extents})
    if unknown:
        raise _UsageError(f"--size names no index of the program: {', '.join(unknown)}")
    inputs = random_inputs(program.checked, sizes, dtype=dtype, seed=args.seed)
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
    print(compile(_read_program(args), backend="reference").explain(), end="")
    return 0


def cmd_dump(args) -> int:
    import torch

    from . import compile
    from .random_inputs import random_inputs
    program = compile(_read_program(args), backend="triton")
    dtype = getattr(torch, args.dtype)
    inputs = random_inputs(program.checked, _parse_sizes(args.size), dtype=dtype)
    sm_count = (torch.cuda.get_device_properties(0).multi_processor_count
                if torch.cuda.is_available() else None)
    source = program.backend.source_for(program.binder(inputs), sm_count=sm_count)
    if sm_count is None:
        print("einfold dump: no GPU here, so the module is shown without an automatic split "
              "(its SM count decides it)", file=sys.stderr)
    if args.output:
        Path(args.output).write_text(source)
        print(f"einfold dump: wrote {args.output}", file=sys.stderr)
    else:
        print(source, end="")
    return 0


def cmd_bench(args) -> int:
    from pathlib import Path

    import torch

    from . import bench
    if not torch.cuda.is_available():
        print("einfold bench: needs a CUDA GPU (the benchmarks compare kernels on one)", file=sys.stderr)
        return 2
    bench.main(Path(args.out), args.group or list(bench.GROUPS), quick=args.quick)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="einfold", description=__doc__.strip().split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("parse", help="print the canonical form of a program")
    _add_program_args(p)
    p.set_defaults(run=cmd_parse)

    p = sub.add_parser("ir", help="print the IR, after the passes or after a given one")
    _add_program_args(p)
    p.add_argument("--print-after", metavar="PASS|all", help="print after this pass (or every pass)")
    p.set_defaults(run=cmd_ir)

    p = sub.add_parser("run", help="run on random inputs and report the error against the oracle")
    _add_program_args(p)
    p.add_argument("--size", action="append", default=[], metavar="INDEX=N",
                   help="extent of an index (default 16)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--dtype", default="float32", choices=["float16", "bfloat16", "float32", "float64"])
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=cmd_run)

    p = sub.add_parser("explain", help="print the derivation: from the expression to one pass per reduction")
    _add_program_args(p)
    p.set_defaults(run=cmd_explain)

    p = sub.add_parser("dump", help="print the generated Triton module (kernels and launcher)")
    _add_program_args(p)
    p.add_argument("--size", action="append", default=[], metavar="INDEX=N",
                   help="extent of an index (default 16)")
    p.add_argument("--dtype", default="float32", choices=["float16", "bfloat16", "float32", "float64"])
    p.add_argument("-o", "--output", help="write the module to this file instead of stdout")
    p.set_defaults(run=cmd_dump)

    p = sub.add_parser("bench", help="benchmark the generated kernels against torch baselines (GPU)")
    p.add_argument("--group", action="append", choices=["attention", "decode", "memory", "matmul"],
                   help="case groups to run (default: all)")
    p.add_argument("--quick", action="store_true", help="a few small shapes per group")
    p.add_argument("--out", default="bench-results", help="folder for bench.csv, bench.json, bench.png")
    p.set_defaults(run=cmd_bench)

    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except EinfoldError as e:
        print(e, file=sys.stderr)
        return 2
    except _UsageError as e:
        parser.exit(2, f"einfold: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
