"""tests/mutations.py stays current: every mutation names a file that exists and a snippet found
exactly once in it (else `python -m tests.mutations` reports it "stale" and tests nothing), and
every test file it runs exists."""
import pytest

from tests.mutations import MUTATIONS, ROOT


@pytest.mark.parametrize("m", MUTATIONS, ids=lambda m: m.name)
def test_mutation_is_current(m):
    path = ROOT / m.path
    assert path.is_file(), f"{m.path} does not exist"
    assert path.read_text().count(m.old) == 1, f"the snippet of {m.name!r} is not exactly once in {m.path}"
    for t in m.tests:
        assert (ROOT / t).is_file(), f"{t} does not exist"
