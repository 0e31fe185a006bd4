"""Planning runs with one intra-op thread.

A placement is computed by a long chain of small tensor ops. Splitting each op over
several threads only adds synchronisation, and when the cores are busy (a serving
process, other jobs) the waiting dominates: on the 2-core development machine under
load, flashlb took 16 ms with one thread and 0.3-3 s with two. ``one_thread`` therefore
narrows torch's intra-op pool to one thread for the duration of a call and restores it
afterwards. Under torch's OpenMP backend the setting belongs to the calling thread, so
model execution in other threads keeps its own.

vLLM's CPU worker replaces ``torch.set_num_threads`` with a function that only logs a
warning (threads are bound to cores there); planning then keeps the caller's threads
rather than logging that warning on every replan.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def one_thread(function: F) -> F:
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        threads = torch.get_num_threads()
        if threads == 1 or not isinstance(torch.set_num_threads, types.BuiltinFunctionType):
            return function(*args, **kwargs)
        torch.set_num_threads(1)
        try:
            return function(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    return wrapper  # type: ignore[return-value]
