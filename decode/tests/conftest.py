"""Fixtures of the decode service's test modules: one Stack (decode/tests/stack.py) a module,
checked empty after each test."""

from __future__ import annotations

import pytest

from decode.tests.stack import Stack


@pytest.fixture(scope="module")
def shared():
    """One Stack for a test module."""
    stack = Stack()
    yield stack
    stack.close()


@pytest.fixture()
def stack(shared):
    """The module's Stack, found empty again after each test (no reservation, no sequence, no
    block held)."""
    yield shared
    shared.engine.release()
    shared.assert_empty()
