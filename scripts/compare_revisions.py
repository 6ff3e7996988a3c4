"""This tree's einfold against earlier revisions, side by side in one process on the GPU.

Make each earlier revision an importable package under .before/ (NAME: any
identifier, e.g. einfold_before), then run on the GPU machine, carrying .before:

    rm -rf .before/NAME && mkdir -p .before && git archive REV compiler | tar -x -C .before
    mv .before/compiler .before/NAME
    grep -rl compiler .before/NAME --include='*.py' | xargs sed -i -E \\
        's/\\bimport compiler\\b/import NAME as compiler/; s/\\bfrom compiler\\b/from NAME/g; s/"compiler\\./"NAME./g'
    python3 scripts/compare_revisions.py NAME[,NAME...] GROUP...

Every revision builds its cases from its own `bench.GROUPS` on the same inputs;
the contenders of a case are timed in turn, three rounds (median of do_bench
each, then the median round), so clock and thermal drift hit them alike.
Prints each earlier revision's time over this tree's (> 1: this tree is
faster) and writes the rows to $OUT/compare.json.  COMPARE_CASES=TEXT[,TEXT]
keeps the cases whose name contains one of the texts (compiling and
autotuning every case twice takes minutes); COMPARE_QUICK=1 takes the groups'
--quick cases; COMPARE_BASELINES=1 times the case's baselines (cuDNN, torch.compile)
in the same rounds, and prints their time over this tree's too.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import torch
import triton.testing

import compiler
import compiler.bench as new_bench


def revisions(names: list[str]) -> dict:
    """This tree's package ("new") and each named earlier revision's from .before/, each
    loading its own modules and registering its own torch ops."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / ".before"))
    packages = {"new": compiler, **{n: importlib.import_module(n) for n in names}}
    for tag, package in packages.items():
        # each revision loads its own modules: one module shared by two revisions (equal
        # sources, as where a change leaves a kernel alone) would get the first
        # revision's launch wrappers, which the second does not recognise
        backend = importlib.import_module(f"{package.__name__}.backend.triton.backend")
        backend.load = lambda source, key, interpret, load=backend.load, tag=tag: load(source, f"{key} {tag}",
                                                                                     interpret)
        # and its own torch ops: op names are digests of the program, so under one namespace
        # the revisions' forward and backward ops would be one op, registered once
        importlib.import_module(f"{package.__name__}.autograd").NAMESPACE = f"einfold_{tag}"
    return packages


def main(names: list[str], groups: list[str]) -> None:
    packages = revisions(names)
    benches = {"new": new_bench, **{n: importlib.import_module(f"{n}.bench") for n in names}}
    rows = []
    baselines = bool(os.environ.get("COMPARE_BASELINES"))
    for group in groups:
        quick = bool(os.environ.get("COMPARE_QUICK"))
        per_revision = {tag: bench.GROUPS[group](lambda src, p=packages[tag]: p.compile(src, backend="triton"), quick)
                        for tag, bench in benches.items()}
        wanted = [w for w in os.environ.get("COMPARE_CASES", "").split(",") if w]
        for cases in zip(*per_revision.values()):
            cases = dict(zip(per_revision, cases))
            name = cases["new"].name
            if wanted and not any(w in f"{group} {name}" for w in wanted):
                continue
            assert all(c.name == name for c in cases.values()), [c.name for c in cases.values()]
            x = cases["new"].make()
            ref = next(iter(cases["new"].baselines.values()))(x)
            errors = {tag: new_bench._error(c.ours(x), ref) for tag, c in cases.items()}
            runs = {tag: c.ours for tag, c in cases.items()}
            if baselines:
                runs |= cases["new"].baselines
            times = {tag: [] for tag in runs}
            for _ in range(3):
                for tag, run in runs.items():
                    times[tag].append(triton.testing.do_bench(lambda run=run: run(x), warmup=25, rep=100,
                                                              return_mode="median"))
            ms = {tag: sorted(t)[1] for tag, t in times.items()}
            rows.append({"group": group, "case": name, "ms": ms, "errors": errors})
            print(f"  done {group}: {name}", flush=True)
    out = Path(os.environ.get("OUT", "."))
    (out / "compare.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    others = [n for n in rows[0]["ms"] if n != "new"] if rows else names
    print(f"{'case':40} {'new ms':>8} " + " ".join(f"{n + '/new':>18}" for n in others) + "  rel err (new)")
    for r in rows:
        print(f"{r['group'] + ' ' + r['case']:40} {r['ms']['new']:8.3f} "
              + " ".join(f"{r['ms'][n] / r['ms']['new']:18.3f}" for n in others) + f"  {r['errors']['new']:.1e}")


if __name__ == "__main__":
    main(sys.argv[1].split(","), sys.argv[2:])
