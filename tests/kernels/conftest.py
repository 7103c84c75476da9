"""Kernel-test settings. The Triton interpreter checks every int32 add/mul for overflow by
redoing it in int64 (its `sanitize_overflow` option, on by default and not settable per launch),
which more than doubles the interpreted kernels' time; our tests use small shapes where int32
index math cannot overflow, so it is turned off here to keep the suite fast."""
import dataclasses

from triton.runtime import interpreter

interpreter.interpreter_builder.options = dataclasses.replace(
    interpreter.interpreter_builder.options, sanitize_overflow=False
)
