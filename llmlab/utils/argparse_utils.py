"""vLLM's ``FlexibleArgumentParser`` (``vllm.utils.argparse_utils``), standard library only.

A script written for vLLM builds its command line as

    parser = FlexibleArgumentParser()
    parser = EngineArgs.add_cli_args(parser)
    engine_args = EngineArgs.from_cli_args(parser.parse_args())

and its users type either spelling of a flag: ``--max-num-seqs 8`` or ``--max_num_seqs 8``,
``--max-num-seqs=8`` or ``--max_num_seqs=8``. This parser accepts both.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` that also takes a long flag spelt with underscores
    for the one defined with dashes (``--foo_bar`` for ``--foo-bar``, with a value after
    ``=`` or as the next argument). A flag defined with underscores keeps its spelling, and
    nothing after a bare ``--`` is touched. Subcommand parsers are of this class too."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """``argparse``'s, on the arguments with underscored flag names respelt."""
        if args is None:
            args = sys.argv[1:]
        return super().parse_known_args(self._respelt(list(args)), namespace)

    def _respelt(self, args: list[str]) -> list[str]:
        known = self._option_string_actions
        out = []
        for position, arg in enumerate(args):
            if arg == "--":  # positional arguments only from here on
                return out + args[position:]
            name, sep, value = arg.partition("=")
            dashed = name.replace("_", "-")
            # Only a name this parser does not know as written but knows dashed: a value
            # that merely starts with "--" and a subcommand's own flags pass unchanged
            # (the subcommand's parser, of this class, respells those).
            if name.startswith("--") and name not in known and dashed in known:
                arg = dashed + sep + value
            out.append(arg)
        return out
