"""This tree's einfold against an earlier revision, side by side in one process on the GPU.

    rm -rf .before && mkdir .before && git archive REV compiler | tar -x -C .before
    mv .before/compiler .before/einfold_before
    grep -rl compiler .before/einfold_before --include='*.py' | xargs sed -i -E \
        's/\\bimport compiler\\b/import einfold_before as compiler/; s/\\bfrom compiler\\b/from einfold_before/g; s/"compiler\\./"einfold_before./g'
    python3 scripts/compare_revisions.py .before GROUP...      (on the GPU machine; carry .before)

Both revisions build their cases from their own `bench.GROUPS` with the same
inputs; each pair is timed alternately (median of do_bench, three rounds) so
clock and thermal drift hit both alike. Prints new/old time ratios (< 1: the
new revision is faster) and writes the rows to $OUT/compare.json.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import triton.testing

import compiler
import compiler.bench as new_bench


def main(before: str, groups: list[str]) -> None:
    sys.path.insert(0, before)
    import einfold_before
    import einfold_before.bench as old_bench
    compile_new = lambda src: compiler.compile(src, backend="triton")         # noqa: E731
    compile_old = lambda src: einfold_before.compile(src, backend="triton")   # noqa: E731
    rows = []
    for group in groups:
        for new, old in zip(new_bench.GROUPS[group](compile_new, False), old_bench.GROUPS[group](compile_old, False)):
            assert new.name == old.name, (new.name, old.name)
            x = new.make()
            ref = next(iter(new.baselines.values()))(x)
            errors = {tag: new_bench._error(case.ours(x), ref) for tag, case in (("new", new), ("old", old))}
            times = {"new": [], "old": []}
            for _ in range(3):
                for tag, case in (("new", new), ("old", old)):
                    times[tag].append(triton.testing.do_bench(lambda: case.ours(x), warmup=25, rep=100,
                                                              return_mode="median"))
            ms = {tag: sorted(t)[1] for tag, t in times.items()}
            rows.append({"group": group, "case": new.name, "new_ms": ms["new"], "old_ms": ms["old"],
                         "new_over_old": ms["new"] / ms["old"], "errors": errors})
            print(f"  done {group}: {new.name}", flush=True)
    out = Path(os.environ.get("OUT", "."))
    (out / "compare.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    print(f"{'case':42} {'new ms':>9} {'old ms':>9} {'new/old':>8}  rel err new / old")
    for r in rows:
        print(f"{r['group'] + ' ' + r['case']:42} {r['new_ms']:9.3f} {r['old_ms']:9.3f} {r['new_over_old']:8.3f}  "
              f"{r['errors']['new']:.1e} / {r['errors']['old']:.1e}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
