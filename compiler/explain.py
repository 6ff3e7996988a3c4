"""explain: the derivation as a readable trace, from the expression as written
to the single-pass form, with every derived summary's merge and law status."""
from __future__ import annotations

from .algebra import Summary
from .arguments import checked_wrt
from .errors import EinfoldError
from .grad import derive
from .ir import Call, Const, Expr, Reduce, Var, format_expr, format_program, format_statement, transform, walk


def _indent(text: str, by: str = "  ") -> list[str]:
    return [by + line for line in text.rstrip("\n").splitlines()]


def _folds(program) -> list[Reduce]:
    seen: dict[Reduce, None] = {}
    for st in program.statements:
        for node in walk(st.expr):
            if isinstance(node, Reduce) and node.result is not None:
                seen.setdefault(node.fold)
    return list(seen)


def _with_field_names(e: Expr) -> Expr:
    """Show projections of a derived fold by their field name alone."""
    return transform(e, lambda n: Var(n.result) if isinstance(n, Reduce) and n.result else n)


def describe_summary(s: Summary, args: tuple[Expr, ...] = (), indices: tuple[str, ...] = ()) -> list[str]:
    over = f" over {', '.join(indices)}" if indices else ""
    kind = "commutative" if s.commutative else "ordered (non-commutative)"
    lines = [f"summary {s.name}{over}: fields ({', '.join(s.field_names)}), identity "
             f"({', '.join(format_expr(c) for c in s.identity)}), {kind}"]
    if s.notes:
        lines.append("  derivation:")
        lines += [f"    {n}" for n in s.notes]
    for k, a in enumerate(args):
        lines.append(f"  x{k} = {format_expr(a)}")
    structured = {}
    for r in s.rescaled:
        lf = r.leader
        structured[lf] = (f"{lf} = {format_expr(r.leader_arg)}", f"{lf} = {r.leader_monoid}(a.{lf}, b.{lf})")
        for name, value in r.values:
            weight = Var(f"w(x, {lf})")          # printed as written, the value bracketed as a factor
            lifted = weight if value == Const(1) else Call("mul", (weight, value))
            shift = r.shift_of(name)
            side = (lambda x: f"{x}.{name} * h({x}.{lf}, {lf})") if shift is None else \
                (lambda x: f"h({x}.{lf}, {lf}) * ({x}.{name} + s({x}.{lf}, {lf}) * {x}.{shift[1]})")
            structured[name] = (f"{name} = {format_expr(lifted)}", f"{name} = {side('a')} + {side('b')}")
        lines.append(f"  w(x, r) = {format_expr(r.weight)};  h(r, r_new) = {format_expr(r.repair)}")
        for name, s_k, total in r.shifts:
            lines.append(f"  {name} centred on {lf}: v = {format_expr(dict(r.values)[name])}, "
                         f"shift s(r, r_new) = {format_expr(s_k)}")
        lines.append(f"  ({lf} = -inf is no reference point: w and h take 0 in its place)")
    lines.append("  lift:")
    lines += [f"    {structured[f][0] if f in structured else f'{f} = {format_expr(e)}'}"
              for f, e in zip(s.field_names, s.lift)]
    lines.append("  merge (a, b):")
    lines += [f"    {structured[f][1] if f in structured else f'{f} = {format_expr(e)}'}"
              for f, e in zip(s.field_names, s.combine)]
    for block in s.blocks:
        lines.append("  a tile's state from sums over its elements (instead of merging them one by one):")
        lines += [f"    {name} = sum of {format_expr(summand)}" for name, summand in block.sums]
        lines += [f"    {f} = {format_expr(e)}" for f, e in block.fields]
    if not s.rescaled and not s.notes:
        lines.append(f"  finalize = {format_expr(s.finalize)}")
    if s.laws is not None:
        lines.append(f"  laws: {s.laws}")
    return lines


def explain(program) -> str:
    out = ["source:", *_indent(program.text.strip()), ""]
    out += ["checked (every reduction explicit):", *_indent(format_program(program.checked)), ""]
    for (_, before), (name, after) in zip(program.trace, program.trace[1:]):
        said = after.notes[len(before.notes):]      # what the pass says of what it did (or left)
        if name not in ("factorise", "base2") and format_program(after) != format_program(before):
            out += [f"after {name}:", *_indent(format_program(after)), *_indent("\n".join(said)), ""]
        elif said:
            out += [f"{name}:", *_indent("\n".join(said)), ""]
    folds = _folds(program.factorised)
    if folds:
        out.append("after factorise: each group of reductions over one index is one pass")
        for fold in folds:
            out += _indent("\n".join(describe_summary(fold.summary, fold.args, fold.indices)))
        out.append("")
        out.append("results from the final states:")
        for st in program.factorised.statements:
            out.append(f"  {st.name}[{', '.join(st.indices)}] = {format_expr(_with_field_names(st.expr))}")
        out.append("")
    from .backend import check_name, outline_of
    plan = outline_of(program)
    out.append(f"outputs: {', '.join(program.outputs)}")
    out.append("plan (for any sizes; the sizes of a call choose tiles and splits: Program.plan(**inputs)):")
    out += _indent(str(plan))
    # the triton backend's second schedule, which a call's sizes may take (Schedule.for_extents)
    materialised = program.schedule.materialised if check_name(program.backend_name) == "triton" else None
    if materialised is not None:
        out.append("plan where recomputing the nested folds costs more than storing them (sizes decide; a buffer "
                   "that would outgrow the largest input is made a chunk at a time):")
        out += _indent(str(materialised.outline("triton")))
    out += _backward(program.checked)
    return "\n".join(out) + "\n"


def _backward(checked) -> list[str]:
    """The gradient program a call under torch autograd runs (with respect to
    every tensor input), and what the forward saves for it; nothing for a
    program without one (no tensor input, no float output, a summary without
    a derivative on every path)."""
    try:
        wrt = checked_wrt(None, checked)
        backward, found = derive(checked, wrt, None, True)
    except EinfoldError:
        return []
    out = ["", f"backward (einfold grad --saved: the gradients of {', '.join(wrt)}):",
           *_indent(format_program(backward))]
    if found.saved:
        out.append("saved by the forward (extra outputs that share the folds it makes anyway):")
        out += [f"  {format_statement(s)}" for s in found.saved]
    if found.unsaved:
        out.append("recomputed by the backward:")
        out += [f"  {why}" for why in found.unsaved]
    return out
