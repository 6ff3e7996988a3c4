"""A readable trace of what einfold did with a program."""
from __future__ import annotations

from .algebra import Summary
from .ir import Reduce, format_expr, format_program, walk


def describe_summary(s: Summary) -> list[str]:
    fields = ", ".join(f.name for f in s.fields)
    identity = ", ".join(format_expr(c) for c in s.identity)
    lines = [f"summary {s.name}: fields ({fields}), identity ({identity}), "
             f"{'commutative' if s.commutative else 'ordered (non-commutative)'}"]
    args = ", ".join(f"x{k}" for k in range(s.arity))
    lines.append(f"  lift({args}) = ({', '.join(map(format_expr, s.lift))})")
    lines += [f"  combine: {f.name} = {format_expr(c)}" for f, c in zip(s.fields, s.combine)]
    lines.append(f"  finalize = {format_expr(s.finalize)}")
    lines += [f"  {note}" for note in s.notes]
    return lines


def explain(program) -> str:
    out = ["source:", *("  " + line for line in program.text.strip().splitlines()), ""]
    out += ["checked IR (every reduction explicit):",
            *("  " + line for line in format_program(program.checked).splitlines()), ""]
    summaries: dict[str, Summary] = {}
    for st in program.factorised.statements:
        for node in walk(st.expr):
            if isinstance(node, Reduce):
                summaries.setdefault(node.summary.name, node.summary)
    if summaries:
        out.append("summaries:")
        for s in summaries.values():
            out += ["  " + line for line in describe_summary(s)]
        out.append("")
    out.append(f"outputs: {', '.join(program.outputs)}; backend: {program.backend.name}")
    return "\n".join(out) + "\n"
