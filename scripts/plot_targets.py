"""Issue 13's targets against one set of `einfold bench` results, as one figure.

    python3 scripts/plot_targets.py OUT.png BENCH.json [BENCH.json ...]

The JSON files are `einfold bench --out` results (one per group invocation, from
one machine); where two hold the same row, the later file's wins.  Each panel is
one target: a bar per case, the target as a line, green where the case meets it.
Prints the same numbers as a table, one line per bar."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Bar:
    label: str
    value: float
    target: float
    higher_is_better: bool = True

    @property
    def met(self) -> bool:
        return self.value >= self.target if self.higher_is_better else self.value <= self.target


def rows_of(paths: list[str]) -> tuple[dict, dict]:
    """((group, name, contender) -> row, the first file's meta)."""
    rows, meta = {}, None
    for path in paths:
        data = json.load(open(path))
        meta = meta or data["meta"]
        for r in data["rows"]:
            rows[r["group"], r["name"], r["contender"]] = r
    return rows, meta


def ms(rows, group, name, contender) -> float | None:
    r = rows.get((group, name, contender))
    return r["ms"] if r and r["ms"] == r["ms"] else None


def ratio(rows, group, name, baseline) -> float | None:
    """Baseline time over einfold's (> 1: einfold faster)."""
    ours, theirs = ms(rows, group, name, "einfold"), ms(rows, group, name, baseline)
    return theirs / ours if ours and theirs else None


# long sizes in case names, as the figure prints them
SHORTER = {"S1024": "S1k", "S4096": "S4k", "S16384": "S16k", "L8192": "L8k", "L65536": "L64k", "L262144": "L256k"}


def short(name: str) -> str:
    """A case name without the batch and head counts of a full sequence (B16 H16 S1024 d128
    -> S1k d128; a decode's heads stay)."""
    full = any(w[0] == "S" and w[1:].isdigit() for w in name.split())
    words = [w for w in name.split() if not (w[0] in ("BH" if full else "B") and w[1:2].isdigit())]
    return " ".join(SHORTER.get(w, w) for w in words)


def panels(rows: dict, meta: dict) -> list[tuple[str, list[Bar]]]:
    names = lambda group: list(dict.fromkeys(n for g, n, _ in rows if g == group))  # noqa: E731
    attention = []
    for name in names("attention"):
        value = ratio(rows, "attention", name, "sdpa_cudnn")
        if value is not None:
            d64, s1k = "d64" in name, "S1024" in name
            attention.append(Bar(short(name), value, 0.9 if d64 else 0.78 if s1k else 0.85))
    flex, first = [], []
    for name in names("flex"):
        value = ratio(rows, "flex", name, "flex_attention")
        if value is not None:
            flex.append(Bar(short(name), value, 1.1))
        ours = ms(rows, "compile", f"flex {name} first call", "einfold")
        theirs = ms(rows, "compile", f"flex {name} first call", "flex_attention")
        if ours and theirs:
            first.append(Bar(f"{short(name)} ({ours / 1e3:.1f} s)", ours / theirs, 2.0,
                             higher_is_better=False))
    decode = [Bar(short(n), v, 0.9) for n in names("decode")
              if (v := ratio(rows, "decode", n, "sdpa_cudnn_attention")) is not None]
    matmul = [Bar(short(n), v, 0.9) for n in names("matmul")
              if (v := ratio(rows, "matmul", n, "torch.matmul"))]
    memory = [Bar(short(n), v, 1.0) for n in names("memory")
              if (v := ratio(rows, "memory", n, "torch.compile"))]
    copy = meta["copy_bandwidth_GBps"]
    bandwidth = [Bar(short(n), 100 * rows["memory", n, "einfold"]["rate"] / copy, 90.0)
                 for n in names("memory") if ("memory", n, "einfold") in rows]
    host_us, host_ratio = [], []
    for name in names("host"):
        ours = ms(rows, "host", name, "einfold")
        baseline = next((c for g, n, c in rows if g == "host" and n == name and not c.startswith("einfold")),
                        None)
        if ours and baseline:
            theirs = ms(rows, "host", name, baseline)
            host_us.append(Bar(name, ours, 20.0, higher_is_better=False))
            host_ratio.append(Bar(f"{name} / {baseline}", ours / theirs, 1.5, higher_is_better=False))
    return [("attention forward: cuDNN time / einfold's", attention),
            ("FlexAttention variants: Flex time / einfold's", flex),
            ("first call: einfold's / FlexAttention's", first),
            ("decode: cuDNN time / einfold's", decode),
            ("matmul: cuBLAS time / einfold's", matmul),
            ("memory-bound: torch.compile time / einfold's", memory),
            ("memory-bound: % of copy bandwidth", bandwidth),
            ("cached call: host time, µs", host_us),
            ("cached call: host time over the baseline's", host_ratio)]


def plot(figure: list[tuple[str, list[Bar]]], meta: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shown = [(title, bars) for title, bars in figure if bars]
    fig, axes = plt.subplots(len(shown), 1, figsize=(9, sum(0.75 + 0.22 * len(b) for _, b in shown)),
                             gridspec_kw={"height_ratios": [len(b) + 2 for _, b in shown]})
    for ax, (title, bars) in zip(axes, shown):
        ys = range(len(bars))
        ax.barh(ys, [b.value for b in bars], color=["tab:green" if b.met else "tab:red" for b in bars])
        for y, b in zip(ys, bars):      # each bar's own target: a black tick across it
            ax.plot([b.target, b.target], [y - 0.45, y + 0.45], color="black", linewidth=1.5)
            ax.text(b.value, y, f" {b.value:.3g}", va="center", fontsize=7)
        ax.set_yticks(list(ys), [b.label for b in bars], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{title}  (black: target; green: met)", fontsize=9, loc="left")
        ax.set_xlim(0, max(max(b.value for b in bars), max(b.target for b in bars)) * 1.15)
    fig.suptitle(f"Issue 13 targets, {meta['device']}, torch {meta['torch']}, Triton {meta['triton']}, "
                 f"{meta['date']}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.99))
    fig.savefig(path, dpi=120)


def main(out: str, paths: list[str]) -> None:
    rows, meta = rows_of(paths)
    figure = panels(rows, meta)
    for title, bars in figure:
        print(title)
        for b in bars:
            relation = ">=" if b.higher_is_better else "<="
            print(f"  {b.label:40} {b.value:8.3f}  target {relation} {b.target:<5} {'met' if b.met else 'MISSED'}")
    plot(figure, meta, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
