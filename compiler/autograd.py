"""torch integration: every compiled program is a torch custom op.

A call under grad mode with an input that requires grad, and every call that
torch.compile traces, goes through `torch.library.custom_op`: one op per
program and kind of call (which 0-d inputs are numbers, which tensors), made on
first use, with

- its implementation: the program's backend, as a plain call runs it;
- a fake implementation: the output shapes and dtypes from the binder, so that
  torch.compile traces the op without running it;
- autograd (`register_autograd`): the backward runs the program's gradient
  program (`compiler.grad`, same backend, compiled once per set of inputs that
  require grad), itself through its own op, and gives a gradient to exactly the
  tensor inputs that require grad (numbers get none).

The op runs the program's saving forward (`Program._saving`): besides the
program's outputs it returns the statistics its gradient programs read, the
row logsumexp of each softmax, written by the softmax's own kernel.  They are
non-differentiable outputs that `call_op` drops: the user sees the program's
outputs only, and the backward reads `exp(x - L)` instead of recomputing each
softmax (`compiler.grad(..., saved=True)`).  A backward that builds a graph
(`create_graph=True`) recomputes instead: the statistic is a constant to the
gradient program, and the second derivative has to see that it depends on x.

A plain call (no grad needed, not compiling) does not go through the op.
"""
from __future__ import annotations

import itertools
import os
from numbers import Real

import torch

# torch._dynamo (below) imports Triton, whose interpreter must be chosen before that
# (compiler/backend/triton/backend.py): without CUDA it is the only way to run kernels
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .ops import BOOL, FLOAT, INT  # noqa: E402
from .program import _number  # noqa: E402

NAMESPACE = "einfold"
_DTYPES = {INT: torch.int64, BOOL: torch.bool}
_numbers = itertools.count()


def call_op(program, inputs: dict):
    """Run `program` on `inputs` through its custom op: outputs carry a grad_fn
    where an input requires grad, and torch.compile traces the call as one op."""
    names = tuple(i.name for i in program.checked.inputs)
    if inputs.keys() != set(names) or not all(_fits(v) for v in inputs.values()):
        program.binder(inputs)           # names what is wrong (a BindError)
    args = tuple(v if isinstance(v, torch.Tensor) else _number(program.checked, n, v)
                 for n, v in ((n, inputs[n]) for n in names))
    kinds = tuple("Tensor" if isinstance(a, torch.Tensor) else "float" for a in args)
    namespace, _, name = _op_name(program, kinds).partition("::")
    results = getattr(getattr(torch.ops, namespace), name)(*args)   # a tensor, or a tuple for several
    if len(program._saving.outputs) == len(program.outputs):
        return results
    shown = results[:len(program.outputs)]                          # the saved statistics stay inside
    return shown[0] if len(shown) == 1 else shown


def _fits(value) -> bool:
    return isinstance(value, torch.Tensor) or (isinstance(value, Real) and not isinstance(value, bool))


@torch._dynamo.assume_constant_result
def _op_name(program, kinds: tuple[str, ...]) -> str:
    """The qualified name of the op of `program` for arguments of `kinds`, made
    on first use.  torch.compile runs this at trace time and keeps the name
    (registering an op is not traceable; looking it up by name is)."""
    made = program._ops.get(kinds)
    if made is None:
        made = program._ops[kinds] = _make_op(program, kinds)
    return made._qualname


def _make_op(program, kinds: tuple[str, ...]):
    names = tuple(i.name for i in program.checked.inputs)
    forward = program._saving               # the program, plus its statistics as outputs
    statements = {s.name: s for s in forward.checked.statements}
    outputs = tuple(statements[o] for o in forward.outputs)
    shown = len(program.outputs)            # outputs[shown:] are the saved statistics
    # positional parameter names: an input may be called anything, a schema's may not
    params = ", ".join(f"{kind} x{k}" for k, kind in enumerate(kinds))
    results = "Tensor" if len(outputs) == 1 else f"({', '.join('Tensor' for _ in outputs)})"

    def implementation(*args):
        results = forward._run(dict(zip(names, args)))
        results = results if isinstance(results, tuple) else (results,)
        # an op's outputs may not alias its inputs (an output that is an input, unchanged)
        stored = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor) and a.numel()}
        results = tuple(r.clone() if r.numel() and r.untyped_storage().data_ptr() in stored else r
                        for r in results)
        return results[0] if len(results) == 1 else results

    op = torch.library.custom_op(f"{NAMESPACE}::program_{next(_numbers)}", implementation, mutates_args=(),
                                 schema=f"({params}) -> {results}")

    @op.register_fake
    def _(*args):
        binding = forward.binder(dict(zip(names, args)))
        wide = forward.schedule_options.get("float32_outputs", ())
        shaped = tuple(torch.empty([binding.extents[i] for i in s.indices],
                                   dtype=_DTYPES.get(s.dtype) or binding.float_dtype(s.name in wide),
                                   device=binding.device)
                       for s in outputs)
        return shaped[0] if len(shaped) == 1 else shaped

    def setup_context(ctx, inputs, output):
        ctx.numbers = {n: v for n, v in zip(names, inputs) if not isinstance(v, torch.Tensor)}
        output = output if isinstance(output, tuple | list) else (output,)
        ctx.mark_non_differentiable(*output[shown:])
        tensors = tuple(v for v in inputs if isinstance(v, torch.Tensor))
        # the outputs too: the saved backward reads them (rowsum(dO * O) for a softmax)
        ctx.save_for_backward(*tensors, *output[shown:], *output[:shown])
        ctx.outputs = tuple((o.shape, o.dtype, o.device) for o in output[:shown])

    def backward(ctx, *upstream):
        saved = iter(ctx.saved_tensors)
        inputs = {n: ctx.numbers[n] if n in ctx.numbers else next(saved) for n in names}
        statistics = dict(zip(forward.outputs[shown:], saved))
        produced = dict(zip(forward.outputs[:shown], saved))
        wrt = tuple(n for n, needed in zip(names, ctx.needs_input_grad) if needed)
        if not wrt:
            return (None,) * len(names)
        # with create_graph the gradient must stay differentiable through the
        # statistics: recompute them (see the module's docstring)
        gradient = program._gradient(wrt, saved=bool(statistics) and not torch.is_grad_enabled())
        inputs.update({k: v for k, v in {**produced, **statistics}.items() if k in gradient.inputs})
        for s, g, (shape, dtype, device) in zip(outputs, upstream, ctx.outputs):
            if s.dtype == FLOAT:    # an output backward() did not reach has no upstream gradient: zeros
                g = torch.zeros(shape, dtype=dtype, device=device) if g is None else g.contiguous()
                inputs[gradient.upstream[s.name]] = g
        results = call_op(gradient, gradient._read(inputs))
        results = dict(zip(wrt, results if isinstance(results, tuple) else (results,)))
        return tuple(results[n].to(inputs[n].dtype) if n in results else None for n in names)

    op.register_autograd(backward, setup_context=setup_context)
    return op
