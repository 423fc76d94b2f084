"""The conductor's modules import each other in no circle, type-only imports included (issue
#31: ``dispatch``/``placement``/``upstream``/``workers`` once did, through a ``Services`` type
imported under ``TYPE_CHECKING``). ``tests/test_layering.py`` checks the imports that run at
import time across the code base; here every import counts, function-local and type-only too."""

from __future__ import annotations

import dataclasses

from tests.test_layering import codebase, import_cycles

PACKAGE = "mooncake_lite.conductor"


def test_no_module_import_circle_in_the_conductor_type_only_imports_included():
    inside = [dataclasses.replace(imp, at_import=True) for imp in codebase()
              if imp.module.startswith(PACKAGE) and imp.target.startswith(PACKAGE)]
    assert import_cycles(inside) == []
