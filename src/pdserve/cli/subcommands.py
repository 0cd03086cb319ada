"""A subcommand whose module is imported only when it is chosen: what
`pdserve CMD` and `pdserve bench NAME` are built from.

Each module named here defines `add_arguments(parser)` (its options) and
`run(args) -> int`. The parent's help lists every subcommand from its
registry entry alone, so `pdserve --help` and `pdserve bench --help` import
no command or benchmark, and `pdserve up` never imports a benchmark."""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType
from typing import NamedTuple


class Subcommand(NamedTuple):
    name: str
    module: str           # defines add_arguments(parser) and run(args) -> int
    help: str


class _Deferred(argparse.ArgumentParser):
    """A subcommand's parser: its options are defined, by importing its
    module, when argparse hands it the rest of the command line. argparse
    calls a subparser's parse_known_args only for the subcommand chosen, so
    the others' modules stay unimported."""

    def __init__(self, *, module: str, **kwargs):
        super().__init__(**kwargs)
        self._module = module
        self._defined = False

    def parse_known_args(self, args=None, namespace=None):
        if not self._defined:
            self._defined = True
            load(self._module).add_arguments(self)
        return super().parse_known_args(args, namespace)


def load(module: str) -> ModuleType:
    return importlib.import_module(module)


def add_subcommands(parser: argparse.ArgumentParser, entries: list[Subcommand], dest: str,
                    metavar: str | None = None, describe: bool = False) -> None:
    """One deferred subparser per entry; `describe` also makes an entry's
    help its own --help's description."""
    sub = parser.add_subparsers(dest=dest, required=True, metavar=metavar,
                                parser_class=_Deferred)
    for e in entries:
        sub.add_parser(e.name, help=e.help, module=e.module,
                       description=e.help if describe else None)


def chosen(entries: list[Subcommand], name: str) -> ModuleType:
    """The module of the subcommand argparse parsed (already imported)."""
    (entry,) = [e for e in entries if e.name == name]
    return load(entry.module)
