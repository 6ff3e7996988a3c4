"""base2: mark the rescaled weights that a backend may evaluate in base 2.

A rescaled fold (factorise's running max with repaired fields) whose weight is
exp(x - r) and repair exp(r - r_new), x the leader's own argument and r its
running max, computes every weight as exp2(x * log2(e) - r * log2(e)): one
fused multiply-add and a native exp2 per element, where exp(x - r) costs a
subtraction, a multiply and the exp2 inside exp.  The product x * log2(e) is
not rounded in the fma, so the weights of one row share one rounding factor,
exp2(r * log2(e) - round(r * log2(e))), which the final fields divide out;
the leader stays the max of x itself, exact (where x = c * y with a positive
factor c, the backend keeps the max of y and takes c into the factor).  The rewrite states only the
algebraic form (the weight is the exponential of the distance to the leader);
it sets `Rescaled.base2` and leaves the formulas (the math) as they are.

A fold that holds a field centred on its leader (Rescaled.shifts) stays in the
natural base: its results read the weight sum without the leader beside it
(entropy: log(l) - u_c / l, where r cancelled), so the rounding factor, 1 ulp
of l, is no longer small against the result; exp(x - r) is exactly 1 at the
max, and log(l) exactly 0 when one logit dominates."""
from __future__ import annotations

from dataclasses import replace

from ..algebra.summary import Rescaled
from ..ir import Call, Program, Reduce, Var, transform


def _in_base2(rs: Rescaled) -> bool:
    x = rs.leader_arg
    return (isinstance(x, Var) and rs.leader_monoid == "max" and not rs.shifts
            and rs.weight == Call("exp", (Call("sub", (x, Var("r"))),))
            and rs.repair == Call("exp", (Call("sub", (Var("r"), Var("r_new"))),)))


def _marked(e):
    if isinstance(e, Reduce) and any(_in_base2(rs) and not rs.base2 for rs in e.summary.rescaled):
        rescaled = tuple(replace(rs, base2=True) if _in_base2(rs) else rs for rs in e.summary.rescaled)
        notes = tuple(f"base 2: weight exp({rs.leader_arg.name} - {rs.leader}) evaluated as "
                      f"exp2({rs.leader_arg.name} * log2(e) - {rs.leader} * log2(e)), one fma per element"
                      for rs in rescaled if rs.base2)
        return replace(e, summary=replace(e.summary, rescaled=rescaled, notes=e.summary.notes + notes))
    return e


def use_base2(program: Program) -> Program:
    return replace(program, statements=tuple(replace(s, expr=transform(s.expr, _marked))
                                             for s in program.statements))
