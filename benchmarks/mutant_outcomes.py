"""A pytest plugin for ``benchmarks/mutants.py``: why each test failed, not only that it did.

Appends one JSON line per failure (test id, phase, exception type, whether it is an assertion) to
the file named by ``$DSNORM_MUTANT_OUTCOMES``, and at the end the path ``dsnorm`` was imported from.
A mutant counts as killed only by an assertion (``AssertionError`` or pytest's ``Failed``, which
``pytest.fail`` and a ``pytest.raises`` that saw nothing raise): a numba typing error or a
``NameError`` shows the mutant broke the code, not that a test checked its semantics.
"""

import json
import os
import sys

import pytest

_ASSERTIONS = (AssertionError, pytest.fail.Exception)


def _write(record: dict) -> None:
    with open(os.environ["DSNORM_MUTANT_OUTCOMES"], "a") as f:
        f.write(json.dumps(record) + "\n")


def _is_assertion(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):  # hypothesis reports several distinct failures so
        return all(_is_assertion(e) for e in exc.exceptions)
    return isinstance(exc, _ASSERTIONS)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        if call.excinfo is None:  # a strict xfail that passed
            _write({"test": item.nodeid, "when": call.when, "type": "XPASS(strict)", "assertion": False})
        else:
            exc = call.excinfo.value
            _write({"test": item.nodeid, "when": call.when, "type": type(exc).__qualname__,
                    "assertion": _is_assertion(exc)})
    return report


def pytest_collectreport(report):
    if report.failed:
        _write({"test": report.nodeid, "when": "collect", "type": "collection error", "assertion": False})


def pytest_sessionfinish(session):
    module = sys.modules.get("dsnorm")
    _write({"dsnorm": getattr(module, "__file__", None)})
