"""How the suite splits over pytest-xdist workers (tests/conftest.py): a module's tests stay
together, so its servers and models start once, and each kernel variant other than this
CPU's is a unit of its own that comes after every other test, by when the background build
has had the rest of the run."""

from __future__ import annotations

import types

import conftest
import pytest


@pytest.fixture
def zen5(monkeypatch):
    """An AVX-512 host's variant list, whatever this host is."""
    monkeypatch.setattr(conftest, "KERNEL_VARIANTS", ["avx512_bf16", "avx512", "avx2", "portable"])
    monkeypatch.setattr(conftest, "NATIVE_VARIANT", "avx512_bf16")


def test_a_test_of_another_variant_is_named_by_its_parameters(zen5):
    assert conftest._other_variant("tests/test_linear.py::test_gemv[avx2-8]") == "avx2"
    assert conftest._other_variant("tests/test_mla.py::test_decode[cpu-portable]") == "portable"
    assert conftest._other_variant("tests/test_linear.py::test_gemv[avx512_bf16-8]") is None  # this CPU's
    assert conftest._other_variant("tests/test_linear.py::test_gemv[avx2x-8]") is None  # not a variant's name
    assert conftest._other_variant("tests/test_scheduler.py::test_fifo") is None


def test_units_are_modules_then_each_other_variant_after_every_other_test(zen5):
    collected = [
        "tests/test_a.py::test_one[avx512_bf16]", "tests/test_a.py::test_one[avx2]",
        "tests/test_a.py::test_two", "tests/test_b.py::test_three[portable]",
        "tests/test_b.py::test_four[avx2]", "tests/test_b.py::test_five",
    ]  # fmt: skip
    items = [types.SimpleNamespace(nodeid=n) for n in collected]
    conftest.pytest_collection_modifyitems(None, None, items)
    units = list(dict.fromkeys(conftest.xdist_unit(item.nodeid) for item in items))
    assert units == [
        "tests/test_a.py", "tests/test_b.py", "tests/test_a.py@avx2", "tests/test_b.py@portable", "tests/test_b.py@avx2",
    ]  # fmt: skip


def test_auto_takes_a_worker_per_core_up_to_four_unless_xdists_variable_says(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setattr(conftest.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert conftest.pytest_xdist_auto_num_workers(None) == 4
    monkeypatch.setattr(conftest.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert conftest.pytest_xdist_auto_num_workers(None) == 2
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "0")
    assert conftest.pytest_xdist_auto_num_workers(None) is None  # xdist's own hook reads it


def test_other_distribution_modes_keep_xdists_own_scheduler(pytestconfig, monkeypatch):
    monkeypatch.setattr(pytestconfig.option, "dist", "load", raising=False)
    assert conftest.pytest_xdist_make_scheduler(pytestconfig, None) is None
