"""A compiled program recorded as one CUDA graph for inputs of fixed shapes.

A cached call of a program costs tens of microseconds of host time (binding,
output allocation, one Triton launch per kernel); for tiny inputs that is most
of the call.  `Program.capture(**inputs)` runs the program once (compiling and
tuning it), then records its kernels for those shapes, dtypes and numbers as a
CUDA graph (`torch.cuda.CUDAGraph`); a call of the result replays the graph,
which costs a few microseconds whatever the number of kernels.

The graph reads its own input tensors and writes its own output tensors:
`captured.inputs` holds the inputs (copies of the capture's), written in place
by the caller or by a call with tensors, which copies them in; `captured.outputs`
are overwritten by every replay.  Numbers are fixed at capture time (they are
kernel arguments recorded by value).  No autograd: the capture runs the forward
only."""
from __future__ import annotations

import torch

from .errors import BackendError, BindError


class CapturedProgram:
    """A program's kernels recorded once for inputs of fixed shapes (see the module
    docstring).  Call it with any of the inputs (tensors are copied into
    `inputs`; numbers must equal the captured ones) or none (the graph reads
    `inputs` as they are): it replays the graph and returns the outputs, like
    the program, as the same tensors each time."""

    def __init__(self, program, inputs: dict):
        if program.backend.name != "triton":
            raise BackendError(f"capture() records Triton kernels in a CUDA graph; this program runs on the "
                               f"{program.backend.name} backend (compile it with backend='triton')")
        off_gpu = [n for n, v in inputs.items() if isinstance(v, torch.Tensor) and v.device.type != "cuda"]
        if off_gpu:
            raise BackendError(f"capture() needs CUDA tensors (a CUDA graph records GPU launches); "
                               f"{', '.join(off_gpu)} {'is' if len(off_gpu) == 1 else 'are'} on "
                               f"{inputs[off_gpu[0]].device.type}")
        typed, binding = program._typed(inputs)
        runner = typed.backend.runner(binding)
        values = {name: v.detach().clone() if isinstance(v, torch.Tensor) else v
                  for name, v in binding.values.items()}
        self.inputs = {n: v for n, v in values.items() if isinstance(v, torch.Tensor)}
        self.numbers = {n: v for n, v in values.items() if not isinstance(v, torch.Tensor)}
        # compile, tune and bind every launch outside the capture (tuning synchronizes)
        side = torch.cuda.Stream(device=binding.device)
        side.wait_stream(torch.cuda.current_stream(binding.device))
        with torch.cuda.stream(side):
            runner(values)
        torch.cuda.current_stream(binding.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            results = runner(values)
        outputs = tuple(results[name] for name in program.outputs)
        self.outputs = outputs[0] if len(outputs) == 1 else outputs

    def __call__(self, **inputs):
        for name, v in inputs.items():
            self._take(name, v)
        self.graph.replay()
        return self.outputs

    def _take(self, name: str, value) -> None:
        static = self.inputs.get(name)
        if static is None:
            if name not in self.numbers:
                raise BindError(f"the captured program has no input '{name}'; its inputs are: "
                                f"{', '.join([*self.inputs, *self.numbers])}")
            if value != self.numbers[name]:
                raise BindError(f"input '{name}' = {value!r}, but the program was captured with "
                                f"{name} = {self.numbers[name]!r}: a number is recorded in the CUDA graph; "
                                f"capture again for another value")
            return
        if value is static:
            return
        if not isinstance(value, torch.Tensor) or value.shape != static.shape or value.dtype != static.dtype \
                or value.device != static.device:
            got = (f"a tensor of shape {tuple(value.shape)}, {value.dtype} on {value.device}"
                   if isinstance(value, torch.Tensor) else repr(value))
            raise BindError(f"input '{name}': the program was captured for shape {tuple(static.shape)}, "
                            f"{static.dtype} on {static.device}, not {got}; capture again for other inputs")
        static.copy_(value)
