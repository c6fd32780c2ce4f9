"""vLLM's `--help=TOPIC` on every verb (`vllm serve --help=listgroup`, `=ModelConfig`, `=max-num-seqs`, `=max`,
`=page`), so the habits of vLLM users work on `worldserve serve`'s hundred-odd flags:

- `listgroup`: the argument groups' titles (ModelConfig, ParallelConfig, SchedulerConfig, ...);
- a group's title, in any case: that group's flags;
- `page`: the whole help through a pager ($PAGER, else less / more; printed when stdout is not a terminal);
- anything else: every flag whose option string contains it, in any case ("Parameters matching ...");
  none matching is exit 1, as in vLLM (one line on stderr here).

Plain `--help` / `-h` keep argparse's whole help.
"""

from __future__ import annotations

import argparse
import pydoc
import sys
from collections.abc import Sequence

PREFIX = "--help="


def help_topic(argv: Sequence[str]) -> str | None:
    """The TOPIC of the first `--help=TOPIC` in `argv` (only that spelling, as vLLM reads it), else None."""
    return next((arg[len(PREFIX) :] for arg in argv if arg.startswith(PREFIX)), None)


def show_help_topic(parser: argparse.ArgumentParser, topic: str) -> int:
    """Print `parser`'s help on `topic` (module docstring); the exit status: 0, or 1 when nothing matches."""
    # (argparse keeps its groups and their actions in private lists; vLLM reads the same ones)
    groups = [g for g in parser._action_groups if g.title and g._group_actions]
    if topic == "page":
        pydoc.pager(parser.format_help())
        return 0
    if topic == "listgroup":
        lines = ["Available argument groups:"]
        for group in groups:
            lines.append(
                f"  - {group.title}" + (f": {group.description.strip()}" if group.description else "")
            )
        print("\n".join(lines))
        return 0
    formatter = parser.formatter_class(prog=parser.prog)
    for group in groups:
        if group.title is not None and group.title.lower() == topic.lower():
            formatter.start_section(group.title)
            formatter.add_text(group.description)
            formatter.add_arguments(group._group_actions)
            formatter.end_section()
            print(formatter.format_help(), end="")
            return 0
    matched = [action for group in groups for action in group._group_actions
               if any(topic.lower() in option.lower() for option in action.option_strings)]  # fmt: skip
    if not matched:
        print(f"{parser.prog}: no group or parameter matching '{topic}' (--help=listgroup lists the groups)",
              file=sys.stderr)  # fmt: skip
        return 1
    formatter.start_section(f"Parameters matching '{topic}'")
    formatter.add_arguments(matched)
    formatter.end_section()
    print(formatter.format_help(), end="")
    return 0
