"""torch integration: every compiled program is a torch op.

A call under grad mode with an input that requires grad, and every call that
torch.compile traces, goes through a `torch.library.triton_op`: one op per
program content and kind of call (which 0-d inputs are numbers, which
tensors), made on first use, with

- its implementation: the program's backend, as a plain call runs it;
- what torch traces (torch.compile's fake and functional tensors): the same
  kernels launched through `torch.library.wrap_triton`, so that inductor's graph
  holds the program's Triton kernels, compiles them with its own code and
  schedules them with the rest; where torch cannot trace them (the interpreter,
  a Gluon kernel, sizes torch keeps symbolic, the reference backend) an opaque
  `torch.library.custom_op` of the program's kernels, whose fake implementation
  gives the output shapes and dtypes from the binder;
- autograd (`register_autograd`): the backward calls a second op, made with the
  first, that runs the program's gradient program (`compiler.grad`, same
  backend, compiled once per set of inputs that require grad) and gives a
  gradient to exactly the tensor inputs that require grad (numbers get none).

Op names are digests of the program's content, so that a graph torch.compile
cached in one process calls the same programs when another process loads it;
the backward op exists as soon as the forward is traced, which is all a
process that loads a cached graph does.

The op runs the program's saving forward (`Program._saving`): besides the
program's outputs it returns the statistics its gradient programs read, the
row logsumexp of each softmax, written by the softmax's own kernel.  They are
non-differentiable outputs that `call_op` drops: the user sees the program's
outputs only, and the backward reads `exp(x - L)` instead of recomputing each
softmax (`compiler.grad(..., saved=True)`).  A backward that builds a graph
(`create_graph=True`) recomputes instead, through the gradient program's own
op: the statistic is a constant to the gradient program, and the second
derivative has to see that it depends on x.

Under functorch (torch.func.grad, vjp, vmap) a call runs the op through an
autograd.Function with the same setup_context and backward (functorch needs
setup_context apart from forward) and a vmap rule that moves the batch into the
program as a leading index (`Program._batched`): one run, no loop.  torch.jit.trace
records the op.  Forward-mode AD (forward_ad dual tensors, torch.func.jvp) would
pass through the op with no tangent: it is refused with a TransformError.

A plain call (no grad needed, not compiling, no transform) does not go through the op,
and an eager call under autograd runs the op's implementation and backward through an
autograd.Function of their own (`op.eager`), without torch's op dispatch: the op is
what torch.compile and torch.jit.trace record.  Such a call takes the `EagerCall` of
its inputs' runner key, which holds what the call would otherwise find again each
time: the op, the argument order, the forward's runner and, per set of inputs that
need a gradient, the gradient program's runner.
"""
from __future__ import annotations

import hashlib
import inspect
import os
from numbers import Real

import torch

# torch._dynamo (below) imports Triton, whose interpreter must be chosen before that
# (compiler/backend/triton/backend.py): without CUDA it is the only way to run kernels
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .errors import TransformError  # noqa: E402
from .ops import BOOL, FLOAT, INT  # noqa: E402
from .arguments import number_input  # noqa: E402
from .compiled import LIVE  # noqa: E402
from .version import __version__  # noqa: E402

NAMESPACE = "einfold"
_DTYPES = {INT: torch.int64, BOOL: torch.bool}


def call_op(program, inputs: dict, key: tuple | None = None):
    """Run `program` on `inputs` through its custom op: outputs carry a grad_fn
    where an input requires grad, and torch.compile traces the call as one op.
    `key`: the inputs' runner key (CompiledProgram._key_of), where the call is an
    eager one that no transform or tracer sees (Program.__call__ knows): it takes
    its key's EagerCall."""
    if key is not None:
        call = program._eager.get(key)
        if call is None:
            call = program._eager[key] = EagerCall(program, _arguments(program, inputs))
        return call(inputs)
    args = _arguments(program, inputs)
    _refuse_forward_mode(args[0], args[1])
    results, saved = _apply(program, args[1])
    if not saved:
        return results
    shown = results[:-saved]                                         # the saved statistics stay inside
    return shown[0] if len(shown) == 1 else shown


def _arguments(program, inputs: dict) -> tuple[tuple[str, ...], tuple]:
    """(the program's input names in order, the op's arguments: `inputs` in that order,
    numbers as the float64 scalars they run as); a BindError names what is wrong."""
    names = tuple(i.name for i in program.checked.inputs)
    if inputs.keys() != set(names) or not all(_fits(v) for v in inputs.values()):
        program.binder(inputs)           # names what is wrong (a BindError)
    return names, tuple(v if isinstance(v, torch.Tensor) else number_input(program.checked, n, v)
                        for n, v in ((n, inputs[n]) for n in names))


def _apply(program, args: tuple) -> tuple[object, int]:
    """(the results of `program`'s op on `args`: its outputs, then the statistics it
    saves; how many statistics)."""
    kinds = tuple("Tensor" if isinstance(a, torch.Tensor) else "float" for a in args)
    qualified, saved = _op_name(program._key, kinds)
    if torch._C._functorch.maybe_current_level() is not None:
        # functorch (func.grad, vmap) transforms autograd.Functions that set up their
        # context apart from forward; the op's own autograd does not
        return _MADE[qualified].transformable.apply(*args), saved
    if not torch.compiler.is_compiling() and not torch.jit.is_tracing():
        # eager autograd: what torch.compile and torch.jit.trace record is the op
        call = EagerCall(program, (tuple(i.name for i in program.checked.inputs), args))
        return call.function.apply(call, *args), saved
    namespace, _, name = qualified.partition("::")
    return getattr(getattr(torch.ops, namespace), name)(*args), saved   # a tensor, or a tuple for several


class EagerCall:
    """A program's eager calls under autograd whose inputs have one runner key
    (shapes, dtypes, devices, number kinds): what every such call would work out
    again is found once here.  That is the op (`op.eager`, an autograd.Function)
    and the order of its arguments, and the saving forward's runner.  Per set of
    inputs that need a gradient, `gradients` keeps the gradient program, its
    runner and where each of its inputs comes from (filled by the op's
    `eager_gradients`).  A call is then the arguments in order, one apply, one
    runner each way: about a third of an eager RMSNorm's forward + backward host
    time on the CPU went to finding these again."""

    def __init__(self, program, arguments: tuple[tuple[str, ...], tuple]) -> None:
        self.names, args = arguments
        kinds = tuple("Tensor" if isinstance(a, torch.Tensor) else "float" for a in args)
        qualified, self.saved = _op_name(program._key, kinds)
        self.function = _MADE[qualified].eager
        self.forward = program._saving
        self.run = self.forward._runner(dict(zip(self.names, args)))
        # the needs_input_grad of a backward -> (the gradient program, its runner, its inputs' plan)
        self.gradients: dict[tuple[bool, ...], tuple] = {}

    def __call__(self, inputs: dict):
        results = self.function.apply(self, *(inputs[n] for n in self.names))
        if not self.saved:
            return results
        shown = results[:-self.saved]
        return shown[0] if len(shown) == 1 else shown

    def outputs(self, args: tuple):
        """The saving forward's outputs for the op's arguments `args`."""
        return self.forward._in_order(self.run(dict(zip(self.names, args))))


def _refuse_forward_mode(names: tuple[str, ...], args: tuple) -> None:
    """Forward-mode AD (a dual tensor of torch.autograd.forward_ad, torch.func.jvp)
    would pass through the op with no tangent: the output would claim not to depend
    on its inputs.  einfold derives reverse-mode gradients only, so it refuses."""
    from torch.autograd import forward_ad
    if forward_ad._current_level < 0:
        return
    dual = [n for n, a in zip(names, args)
            if isinstance(a, torch.Tensor) and forward_ad.unpack_dual(a).tangent is not None]
    if dual:
        raise TransformError(f"forward-mode AD (torch.autograd.forward_ad, torch.func.jvp) is not supported: "
                             f"{', '.join(dual)} carr{'y' if len(dual) > 1 else 'ies'} a tangent; einfold "
                             f"derives reverse-mode gradients (backward(), torch.func.grad, torch.func.vjp)")


def _fits(value) -> bool:
    return isinstance(value, torch.Tensor) or (isinstance(value, Real) and not isinstance(value, bool))


@torch._dynamo.assume_constant_result
def _op_name(key: str, kinds: tuple[str, ...]) -> tuple[str, int]:
    """The qualified name of the op of the program `key` for arguments of `kinds`
    (made on first use), and how many statistics it returns after the program's
    outputs.  torch.compile runs this at trace time and keeps the result as a
    constant: registering an op, or working out what it saves, is not traceable;
    calling an op by name is.  It takes the program's key, not the program:
    torch.compile passes only constants to such a function (torch 2.11 refuses
    an object)."""
    program = LIVE[key]
    made = program._ops.get(kinds)
    if made is None:
        made = program._ops[kinds] = _make_ops(program, kinds)
    return made._qualname, len(program._saving.outputs) - len(program.outputs)


# qualified name -> forward op.  Names come from the program's content, never from
# a counter: torch.compile's caches key compiled graphs on the names of the ops
# they call, so a name must mean one program in every process.  Equal programs
# share their ops.
_MADE: dict[str, object] = {}


def _content_name(program, kinds: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for part in (program.text, repr(program.outputs), program.backend_name, repr(sorted(program._options.items())),
                 repr(sorted(program.statistic_inputs)), type(program).__name__, repr(kinds), __version__):
        h.update(part.encode("utf-8", "backslashreplace"))
        h.update(b"\0")
    return f"program_{h.hexdigest()[:20]}"


def _traceable_op(qualified: str, run, traced, fake, signature: inspect.Signature):
    """The op `qualified` (a `torch.library.triton_op`) of `signature`: a call runs
    `run(*args)`, as a plain call of the program launches its kernels; where torch
    traces it (torch.compile's fake and functional tensors), `traced(*args)` launches
    the same kernels through `torch.library.wrap_triton`, so that the graph holds the
    Triton kernels and inductor compiles and schedules them with the rest, instead
    of one opaque op.  Where `traced` gives None (kernels torch cannot trace: the
    interpreter, a Gluon kernel, symbolic sizes, the reference backend) the traced
    op calls an opaque op of its own, `<name>_kernels`, whose shapes `fake` gives."""
    from torch._library.infer_schema import infer_schema
    from torch._library.triton import is_wrap_triton_enabled

    def body(*args):
        if not is_wrap_triton_enabled():        # triton_op's own call on real tensors
            return run(*args)
        found = traced(*args)
        return opaque(*args) if found is None else found

    # both ops take their schema from the signature
    body.__signature__ = signature
    opaque = torch.library.custom_op(f"{qualified}_kernels", run, mutates_args=(),
                                     schema=infer_schema(body, mutates_args=()))
    opaque.register_fake(fake)
    return torch.library.triton_op(qualified, body, mutates_args=())


def _signature(kinds: tuple[str, ...], returns, *lists: tuple[str, type]) -> inspect.Signature:
    """The signature of an op of arguments of `kinds` ("Tensor" or "float"), positional
    `x0, x1, ...` (an input may be called anything, a schema's parameter may not), then
    the named lists `lists`, returning `returns`."""
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    parameters = [inspect.Parameter(f"x{k}", positional, annotation=torch.Tensor if kind == "Tensor" else float)
                  for k, kind in enumerate(kinds)]
    parameters += [inspect.Parameter(name, positional, annotation=list[item]) for name, item in lists]
    return inspect.Signature(parameters, return_annotation=returns)


def _make_ops(program, kinds: tuple[str, ...]):
    """The forward op of `program` for arguments of `kinds` and, made with it, its
    backward op (so that a compiled graph loaded from torch.compile's cache in a
    new process finds both once its forward has been traced)."""
    name = _content_name(program, kinds)
    if f"{NAMESPACE}::{name}" in _MADE:
        return _MADE[f"{NAMESPACE}::{name}"]
    names = tuple(i.name for i in program.checked.inputs)
    forward = program._saving               # the program, plus its statistics as outputs
    statements = {s.name: s for s in forward.checked.statements}
    outputs = tuple(statements[o] for o in forward.outputs)
    shown = len(program.outputs)            # outputs[shown:] are the saved statistics
    differentiable = tuple(s for s in outputs[:shown] if s.dtype == FLOAT)

    def implementation(*args):
        # no output aliases an input: each backend returns memory of its own (an op must)
        return forward._run(dict(zip(names, args)))

    def traced(*args):
        return forward._traced(dict(zip(names, args)))

    def shapes(*args):
        typed, binding = forward._typed(dict(zip(names, args)))      # integer inputs may make int results
        wide = forward.schedule_options.get("float32_outputs", ())
        shaped = tuple(torch.empty([binding.extents[i] for i in s.indices],
                                   dtype=_DTYPES.get(s.dtype) or binding.float_dtype(s.name in wide),
                                   device=binding.device)
                       for s in (typed.checked.statement(o) for o in forward.outputs))
        return shaped[0] if len(shaped) == 1 else shaped

    op = _traceable_op(f"{NAMESPACE}::{name}", implementation, traced, shapes,
                       _signature(kinds, torch.Tensor if len(outputs) == 1 else tuple[(torch.Tensor,) * len(outputs)]))

    def gradient_inputs(gradient, inputs: dict, statistics, produced, upstream) -> dict:
        """The gradient program's inputs: the forward's, the statistics and outputs
        it reads, and one upstream gradient per differentiable output."""
        known = {**dict(zip(forward.outputs[shown:], statistics)), **dict(zip(forward.outputs[:shown], produced))}
        inputs = {**inputs, **{k: v for k, v in known.items() if k in gradient.inputs}}
        inputs.update({gradient.upstream[s.name]: g for s, g in zip(differentiable, upstream)})
        return gradient._read(inputs)

    def gradients(*args, traced: bool = False):
        *values, statistics, produced, upstream, needs = args
        wrt = tuple(n for n, needed in zip(names, needs) if needed)
        inputs = dict(zip(names, values))
        gradient = program._gradient(wrt, saved=bool(statistics))
        inputs = gradient_inputs(gradient, inputs, statistics, produced, upstream)
        results = gradient._traced(inputs) if traced else gradient._run(inputs)
        if results is None:
            return None
        results = results if isinstance(results, tuple) else (results,)
        return [r.to(values[names.index(n)].dtype) for n, r in zip(wrt, results)]

    def eager_gradients(call: EagerCall, values: tuple, statistics: list, produced: list, upstream: list,
                        needs: tuple[bool, ...]) -> list:
        """`gradients` of an eager call: the gradient program's runner and the places of
        its inputs found at the call's first backward with these `needs`, then kept."""
        found = call.gradients.get(needs)
        if found is None:
            wrt = tuple(n for n, needed in zip(names, needs) if needed)
            gradient = program._gradient(wrt, saved=bool(statistics))
            # where each input of the gradient program comes from: gradient_inputs of the
            # places (which list, which item) instead of the values
            plan = gradient_inputs(gradient, {n: (0, k) for k, n in enumerate(names)},
                                   [(1, k) for k in range(len(statistics))], [(2, k) for k in range(len(produced))],
                                   [(3, k) for k in range(len(upstream))])
            inputs = {name: (values, statistics, produced, upstream)[place][k] for name, (place, k) in plan.items()}
            dtypes = tuple(v.dtype for v, needed in zip(values, needs) if needed)
            found = call.gradients[needs] = (gradient, gradient._runner(inputs), tuple(plan.items()), dtypes)
        gradient, run, plan, dtypes = found
        sources = (values, statistics, produced, upstream)
        results = gradient._in_order(run({name: sources[place][k] for name, (place, k) in plan}))
        results = results if isinstance(results, tuple) else (results,)
        return [r if r.dtype == dtype else r.to(dtype) for r, dtype in zip(results, dtypes)]

    def gradient_shapes(*args):
        # as `gradients` makes them: the gradient program's outputs, contiguous whatever
        # the inputs' strides (a transposed view's gradient is not a transposed view)
        *values, _, _, _, needs = args
        return [torch.empty(v.shape, dtype=v.dtype, device=v.device) for v, needed in zip(values, needs) if needed]

    # the backward of a call that keeps no graph: the gradient program, reading the saved statistics
    backward_op = _traceable_op(
        f"{NAMESPACE}::{name}_backward", gradients, lambda *args: gradients(*args, traced=True), gradient_shapes,
        _signature(kinds, list[torch.Tensor], ("statistics", torch.Tensor), ("produced", torch.Tensor),
                   ("upstream", torch.Tensor), ("needs", bool)))

    def setup_context(ctx, inputs, output):
        ctx.numbers = {n: v for n, v in zip(names, inputs) if not isinstance(v, torch.Tensor)}
        output = output if isinstance(output, tuple | list) else (output,)
        ctx.mark_non_differentiable(*output[shown:])
        tensors = tuple(v for v in inputs if isinstance(v, torch.Tensor))
        # the outputs too: the saved backward reads them (rowsum(dO * O) for a softmax)
        ctx.save_for_backward(*tensors, *output[shown:], *output[:shown])
        ctx.outputs = tuple((o.shape, o.dtype, o.device) for o in output[:shown])

    def backward(ctx, *upstream, call: EagerCall | None = None):
        saved = iter(ctx.saved_tensors)
        values = tuple(ctx.numbers[n] if n in ctx.numbers else next(saved) for n in names)
        statistics = [next(saved) for _ in forward.outputs[shown:]]
        produced = list(saved)
        # an output backward() did not reach has no upstream gradient: zeros
        upstream = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g.contiguous()
                    for s, g, (shape, dtype, device) in zip(outputs, upstream, ctx.outputs) if s.dtype == FLOAT]
        # an eager call's Function takes its EagerCall first
        needs = ctx.needs_input_grad[1:] if call is not None else ctx.needs_input_grad
        if not any(needs):
            return (None,) * len(names)
        if not torch.is_grad_enabled():
            results = (eager_gradients(call, values, statistics, produced, upstream, needs) if call is not None
                       else backward_op(*values, statistics, produced, upstream, list(needs)))
        else:
            # a backward that builds a graph (create_graph=True) recomputes the
            # statistics, through the gradient program's own op: the second
            # derivative has to see that they depend on the inputs
            wrt = tuple(n for n, needed in zip(names, needs) if needed)
            gradient = program._gradient(wrt)
            inputs = gradient_inputs(gradient, dict(zip(names, values)), (), produced, upstream)
            results = call_op(gradient, inputs)
            results = [r.to(v.dtype) for r, v in zip(results if isinstance(results, tuple) else (results,),
                                                      (v for v, needed in zip(values, needs) if needed))]
        results = iter(results)
        return tuple(next(results) if needed else None for needed in needs)

    op.register_autograd(backward, setup_context=setup_context)

    def batched(info, in_dims, *args):
        """torch.vmap's rule: the batch becomes a leading index of the program
        (Program._batched), run once; an output that reads no batched input has none."""
        wide, index = program._batched(tuple(n for n, d in zip(names, in_dims) if d is not None))
        moved = tuple(a if d is None else a.movedim(d, 0) for a, d in zip(args, in_dims))
        results, _ = _apply(wide, moved)
        statements = {s.name: s for s in wide._saving.checked.statements}
        dims = tuple(0 if index in statements[o].indices else None for o in wide._saving.outputs)
        return (results, dims) if len(dims) > 1 else (results, dims[0])

    # the op with the same autograd as an autograd.Function, for functorch (func.grad,
    # vmap), which needs setup_context apart from forward, and vmap's rule
    op.transformable = type(f"{name}_function", (torch.autograd.Function,), {
        "forward": staticmethod(lambda *args: op(*args)), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward), "vmap": staticmethod(batched)})
    # an eager call's: the same forward and backward, called directly rather than through
    # torch's op dispatch, which cost 0.12-0.25 ms of host time a forward + backward (H200,
    # interleaved in one process: a 64 x 768 RMSNorm 0.946 -> 0.828 ms, causal attention at
    # B8 H12 S1024 d64 1.101 -> 0.852).  Its first argument is the call's EagerCall (the
    # runners of its runner key).
    # forward takes the context itself: an autograd.Function with a setup_context of its own
    # binds its arguments to forward's signature (inspect.signature) on every apply, about
    # 35 us a call of host time (H100 host, cProfile of the GPT's eager steps)
    def eager_forward(ctx, call: EagerCall, *args):
        output = call.outputs(args)
        setup_context(ctx, args, output)
        ctx.call = call
        return output
    op.eager = type(f"{name}_eager", (torch.autograd.Function,), {
        "forward": staticmethod(eager_forward),
        "backward": staticmethod(lambda ctx, *upstream: (None, *backward(ctx, *upstream, call=ctx.call)))})
    _MADE[op._qualname] = op
    return op

