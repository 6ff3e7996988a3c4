"""Known numerically stable merges for separable summaries.

Centred moments of any degree p: the state (count, mean, M2, ..., Mp), where
Mk = sum (x - mean)^k, with Pébay's pairwise merge (2008, eq. 3.1; Chan et
al.'s for p = 2, Welford's update when one side is a single element):

    Mk = Mk_a + Mk_b + sum_{j=1}^{k-2} C(k, j) d^j ((-n_b/n)^j M(k-j)_a + (n_a/n)^j M(k-j)_b)
         + d^k n_a n_b (n_a^(k-1) - (-n_b)^(k-1)) / n^k,        d = mean_b - mean_a.

The last term is Pébay's (n_a n_b d / n)^k (1/n_b^(k-1) - (-1/n_a)^(k-1)) with
the divisions by n_a and n_b cleared, so one empty side needs no guard; two
empty sides (n = 0) merge to the empty state.  Written with the same tracing
as user summaries, so the formulas read as the paper does.

The mean is compensated: the state carries it as an unevaluated sum mean + err,
err holding the rounding error the merges left in mean (Kahan's compensation;
Fast2Sum's error term; 0 where a side's mean is not finite, whose merge is then
the weighted average, inf as torch's mean).  Each merge rounds the updated mean to the precision of
the mean itself, so with rows far from zero (mean 1e3, spread 3, float32) the
uncompensated mean drifts by about sqrt(n) ulp over a sequential fold, and every
later d = mean_b - mean_a carries that drift into the moments.  With err:

    mean = mean_a + r,   r = (mean_b - mean_a) (n_b / n)
    err  = ((mean_a - mean) + r) + (err_a (n_a / n) + err_b (n_b / n))
    d    = (mean_b - mean_a) + (err_b - err_a)

(mean_a - mean) + r is exactly the rounding error of mean_a + r where |r| <=
|mean_a| (Fast2Sum), and mean_b - mean_a is exact for means within a factor
two (Sterbenz); what stays uncompensated, the rounding of r itself, is
relative to r, i.e. to the spread.  So d and mean + err stay accurate to the
spread of the data, not to its offset.  In exact arithmetic err is 0 in every reachable state and
the merge is the one above, unchanged: the laws hold field by field (the
rounding term is 0 symbolically; mean and err are weighted averages).

A whole tile's state comes from sums (`tile_sums`), the corrected two-pass
algorithm (Chan, Golub and LeVeque 1983), instead of a tree of merges with a
division each:

    n = sum 1,  mean = sum x / n,  d = x - mean,  err = sum d / n
    Mk = sum (d - err)^k = sum_j C(k, j) (-err)^(k-j) sum d^j

err is the rounding the first pass left in mean (0 in exact arithmetic), so the
tile's state is the one its fold would reach."""
from __future__ import annotations

from math import comb

from ..ir import Const, Expr, Var
from .summary import Block, Field
from .user import Sym, fn, lift_value, state


def centred_moments(prefix: str, element: Expr, degree: int = 2):
    """Fields `{prefix}_n`, `{prefix}_mean`, `{prefix}_err`, `{prefix}_m2` ...
    `{prefix}_m{degree}` for the element `element` (the mean is mean + err);
    returns (fields, identity, lift, combine) formula lists."""
    n, mean, err = f"{prefix}_n", f"{prefix}_mean", f"{prefix}_err"
    moments = [f"{prefix}_m{k}" for k in range(2, degree + 1)]
    names = (n, mean, err, *moments)
    a, b = state("a.", names), state("b.", names)
    count = a[n] + b[n]
    step = b[mean] - a[mean]
    delta = step + (b[err] - a[err])        # the difference of the compensated means
    empty = count == 0.0
    # the tail is 0 beside an empty side, exactly: written as a product with n_a = 0 it
    # would be inf * 0 = NaN once d^k overflows (a float32 row holding 1e30: d^2 = 6e57)
    one_empty = (a[n] == 0.0) | (b[n] == 0.0)

    def moment(side, k: int):
        return side[n] if k == 0 else 0.0 if k == 1 else side[f"{prefix}_m{k}"]

    def power(x, j: int):
        return x if j == 1 else x ** j

    # the sides' weights n_a / n and n_b / n: 1 and 0 exactly beside an empty side, so
    # merging into the empty state copies the other state exactly.  One division per
    # merge (n_a / n = 1 - n_b / n up to rounding, which only the small err sees):
    # the combine runs once per element inside a tile's tl.reduce
    weight_b = fn.where(empty, 0.0, b[n] / count)
    weight_a = fn.where(empty, 0.0, 1.0 - weight_b)

    # an infinite (or NaN) mean on either side: mean_a + (mean_b - mean_a) n_b / n would be
    # inf - inf; the weighted average is the sum's mean, as torch's (inf beside finite values,
    # NaN beside -inf), and err, the rounding of finite means, is 0
    finite = (abs(a[mean]) < fn.inf) & (abs(b[mean]) < fn.inf)

    def merged(k: int):
        if k == 2:      # the general tail, d^2 n_a n_b (n_a + n_b) / n^2, with n cancelled
            tail = delta * delta * a[n] * weight_b
        else:
            tail = power(delta, k) * a[n] * b[n] * (power(a[n], k - 1) - power(-b[n], k - 1)) / power(count, k)
        for j in range(1, k - 1):
            tail = tail + comb(k, j) * power(delta, j) * (power(-b[n] / count, j) * moment(a, k - j)
                                                          + power(a[n] / count, j) * moment(b, k - j))
        # beside a side whose mean is not finite the deviations are inf - inf: NaN, as torch's
        # variance, which mean - mean is there (and 0 for a finite mean)
        undefined = (a[mean] - a[mean]) + (b[mean] - b[mean])
        return moment(a, k) + moment(b, k) + fn.where(finite, fn.where(one_empty, 0.0, tail), undefined)

    rise = step * weight_b
    new_mean = fn.where(finite, a[mean] + rise, a[mean] * weight_a + b[mean] * weight_b)
    new_err = fn.where(finite, ((a[mean] - new_mean) + rise) + (a[err] * weight_a + b[err] * weight_b), 0.0)
    combine = (count, new_mean, new_err, *(merged(k) for k in range(2, degree + 1)))
    lift = (Const(1.0), element, Const(0.0), *(Const(0.0) for _ in moments))
    return ([Field(f) for f in names], [Const(0.0)] * len(names), list(lift), [lift_value(c) for c in combine])


def tile_sums(prefix: str, element: Expr, degree: int = 2) -> Block:
    """The fields of `centred_moments(prefix, element, degree)` for a whole tile, from
    sums over it (see the module's text)."""
    s = {name: Sym(Var(name)) for name in ("count", "total", *(f"dev{j}" for j in range(1, degree + 1)))}
    x = Sym(element)
    empty = s["count"] == 0.0
    mean = fn.where(empty, 0.0, s["total"] / s["count"])
    d = x - mean
    # an infinite mean (the tile's sum overflows or holds inf) has no rounding to correct:
    # sum (x - mean) would be inf - inf
    err = fn.where(empty | (abs(mean) >= fn.inf), 0.0, s["dev1"] / s["count"])
    powers = {0: s["count"], 1: s["dev1"], **{j: s[f"dev{j}"] for j in range(2, degree + 1)}}

    def moment(k: int):
        out = powers[k]
        for j in reversed(range(k)):        # (-err)^(k-j): subtract the odd powers
            term = (err if k - j == 1 else err ** (k - j)) * powers[j]
            term = term if comb(k, j) == 1 else comb(k, j) * term
            out = out - term if (k - j) % 2 else out + term
        # the terms in err correct the rounding of a finite sum; where the sum itself
        # overflows (a float32 row holding 1e30: sum d^2 = inf) they overflow too, and
        # inf - inf would make the moment NaN: the sum is the moment there
        return fn.where(abs(powers[k]) < fn.inf, out, powers[k])

    sums = [("count", Const(1.0)), ("total", element),
            *((f"dev{j}", lift_value(d if j == 1 else d ** j)) for j in range(1, degree + 1))]
    fields = [(f"{prefix}_n", s["count"]), (f"{prefix}_mean", mean), (f"{prefix}_err", err),
              *((f"{prefix}_m{k}", moment(k)) for k in range(2, degree + 1))]
    return Block(tuple(sums), tuple((f, lift_value(e)) for f, e in fields))


__all__ = ["centred_moments", "tile_sums"]
