"""The suite's own order (tests/conftest.py): files with an engine or a real SmolLM2 run come first, so
the two workers of scripts/test.sh do not end on a long file while the other core idles."""

from __future__ import annotations

import pytest


def _weight(item: pytest.Item) -> int:
    return 0 if item.get_closest_marker("vllm") else 1 if item.get_closest_marker("slow") else 2


def test_files_with_long_tests_run_first(request: pytest.FixtureRequest) -> None:
    items = request.session.items
    assert request.node in items
    files: dict[object, int] = {}
    for item in items:  # each file's heaviest test, in the order the files come
        files[item.path] = min(files.get(item.path, 2), _weight(item))
    order = list(files.values())
    assert order == sorted(order), [str(p) for p, w in files.items()][:5]
    # and each file's tests stay together, as --dist loadfile hands them out
    seen, last = set(), None
    for item in items:
        if item.path != last:
            assert item.path not in seen, item.path
            seen.add(item.path)
            last = item.path
