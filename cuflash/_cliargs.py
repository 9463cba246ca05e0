"""Argument checking shared by the command-line tools (``demo``, ``bench``, ``bench --gpu``).

A bad option must end in one line naming it and exit status 2, the way
argparse reports a bad choice, never in a traceback or a table of NaN: the
value types here reject what the tools cannot use, and :class:`Parser` prints
argparse's error without the usage block.
"""
import argparse
import sys

__all__ = ["Parser", "positive_int", "nonneg_int", "int_list", "choice_list"]


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr and exit status 2.

    argparse prints the usage (several lines) before the error; the usage is
    one ``--help`` away, so only the error is printed.  Sub-parsers made by
    ``add_subparsers`` are of the parent's class, so they behave the same.
    """

    def error(self, message):
        message = " ".join(str(message).split())  # one line, whatever the message held
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


def _int(text, what, lowest=None):
    try:
        n = int(str(text).strip())
    except ValueError:
        n = None
    if n is None or (lowest is not None and n < lowest):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    return n


def positive_int(text):
    """An int >= 1 (argparse type)."""
    return _int(text, "a positive integer", 1)


def nonneg_int(text):
    """An int >= 0 (argparse type)."""
    return _int(text, "a non-negative integer", 0)


def int_list(text, allow_empty=False):
    """Comma-separated positive ints (argparse type); '' is [] only when allow_empty."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        if allow_empty:
            return []
        raise argparse.ArgumentTypeError(f"{text!r} holds no value (comma-separated "
                                         "positive integers expected)")
    out = []
    for p in parts:
        n = _int(p, "a positive integer")
        if n < 1:
            where = "" if len(parts) == 1 else f" in {text!r}"
            raise argparse.ArgumentTypeError(f"{p!r}{where} is not a positive integer")
        out.append(n)
    return out


def choice_list(choices):
    """An argparse type: comma-separated names, each one of ``choices``, no repeats."""
    def parse(text):
        names = [p.strip() for p in str(text).split(",") if p.strip()]
        if not names:
            raise argparse.ArgumentTypeError(f"{text!r} names nothing; choose from "
                                             f"{', '.join(choices)}")
        for n in names:
            if n not in choices:
                raise argparse.ArgumentTypeError(f"{n!r} is not one of {', '.join(choices)}")
        return list(dict.fromkeys(names))
    return parse
