"""The suite's file order (tests/conftest.py): the longest files first."""

from tests.conftest import LONGEST_FIRST, TESTS


def test_every_file_named_longest_first_exists():
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    assert [name for name in LONGEST_FIRST if not (TESTS / name).is_file()] == []


def test_the_session_runs_them_first(request):
    files = []
    for item in request.session.items:
        name = item.path.relative_to(TESTS).as_posix()
        if not files or files[-1] != name:
            files.append(name)
    listed = [name for name in files if name in LONGEST_FIRST]
    # Whatever subset was collected: those of the list, in its order, ahead of the rest.
    assert files[: len(listed)] == listed
    assert listed == sorted(listed, key=LONGEST_FIRST.index)
