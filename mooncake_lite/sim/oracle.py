"""The error a read of a request's true output length before it ended raises (sim/request.py).

A module of its own, left out of the compiled build (sim/compiled.py): mypyc cannot compile a
class derived from a builtin exception other than ``Exception`` itself, and this one is an
``AssertionError`` so that it fails a test run like any broken assertion."""


class OracleError(AssertionError):
    """Something read a request's true output length before the request ended."""
