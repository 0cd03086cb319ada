"""tools/mutate.py's list (run by hand, not here): the list still names
the tree as it is, so a rename or a rewrite shows up in CI rather than at
the next hand run."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _mutate():
    spec = importlib.util.spec_from_file_location("mutate", ROOT / "tools" / "mutate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["mutate"] = mod         # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_every_mutation_finds_its_original_text_once_and_its_test_files():
    m = _mutate()
    assert {x.name: m.rotted(x) for x in m.MUTATIONS} == {x.name: None for x in m.MUTATIONS}


def test_mutations_have_distinct_names_and_change_their_text():
    m = _mutate()
    names = [x.name for x in m.MUTATIONS]
    assert len(set(names)) == len(names)
    # an original may span lines where one line alone is not unique in its file
    assert all(x.mutant != x.original and x.original.strip() for x in m.MUTATIONS)
