"""The old module paths of the flat ``strategy/`` keep working for one release, as the same module objects."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from unicron_elastic.strategy._old_paths import MOVED, PREFIX


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_module_of_its_new_path(old: str) -> None:
    assert importlib.import_module(PREFIX + old) is importlib.import_module(PREFIX + MOVED[old])


def test_importing_an_old_path_warns_and_names_the_new_one() -> None:
    old = PREFIX + sorted(MOVED)[0]
    code = (f"import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            f"try:\n    import {old}\nexcept DeprecationWarning as w:\n    print(w)\nelse:\n    print('no warning')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{old} moved to {PREFIX + MOVED[sorted(MOVED)[0]]}" in done.stdout
