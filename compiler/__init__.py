"""einfold: a reduction-factorising compiler from index notation to Triton.

    import compiler
    attention = compiler.compile(
        "O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale) * V[b,h,m,j]")
    out = attention(Q=q, K=k, V=v, scale=0.125)
    backward = compiler.grad(attention.text)       # dQ, dK, dV from Q, K, V, scale and dO
"""
from .algebra import Field, Summary
from .algebra.user import summary
from .backend.triton.records import load_tuning, save_tuning
from .einsum import einsum
from .errors import (BackendError, BindError, CheckError, EinfoldError, ImplicitSumWarning, LawError,
                     LimitError, ParseError, ShardError, TransformError, TuningError)
from .program import GradientProgram, Program, compile, grad
from .tuning import tune
from .version import __version__

__all__ = ["compile", "Program", "grad", "GradientProgram", "einsum", "summary", "Summary", "Field",
           "tune", "save_tuning", "load_tuning",
           "EinfoldError", "ParseError", "CheckError", "BindError", "LawError", "LimitError", "BackendError", "ShardError",
           "TransformError", "TuningError", "ImplicitSumWarning", "__version__"]
