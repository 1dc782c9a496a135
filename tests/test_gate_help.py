"""`--help` documents every option of every subcommand and explains the suites."""

from __future__ import annotations

import argparse

from flamia_verify.cli import build_parser


def _subparsers(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    raise AssertionError("no subcommands")


def test_every_option_of_every_subcommand_has_help_text():
    missing = []
    for name, sub in _subparsers(build_parser()).items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if not action.help or action.help == argparse.SUPPRESS or len(action.help.split()) < 3:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"options without help text: {missing}"


def test_check_help_explains_the_suites_forward_only_and_exit_codes():
    sub = _subparsers(build_parser())["check"]
    text = " ".join(sub.format_help().split())
    for suite in ("quick:", "standard:", "full:"):
        assert suite in text, suite
    assert "--forward-only" in text and "gradients" in text
    assert "exit" in text.lower() and "incomplete" in text.lower()
