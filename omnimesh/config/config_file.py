"""`--config FILE`: a command's flags from a YAML file, as vLLM's `vllm serve --config config.yaml`.

Role: what a Kubernetes ConfigMap or a checked-in deployment file holds instead of a long command line. The
file is a mapping of flag names (`max-model-len` or `max_model_len`, without the dashes in front; `model`
for the model folder; the global `log-level` too) to values; a flag given on the command line as well wins
over the file.

Data flow: `omnimesh.cli.main` -> `apply_config(parser, argv)` before parsing: it finds `--config FILE` in
argv, reads the mapping, and makes each value the default of its flag in that subcommand's parser (so argparse
converts and checks it as it would the same text typed on the command line, and anything typed there wins).
Values: scalars as they would be typed; `true` / `false` for switches (`false` also turns an on-by-default
flag off, as `--no-...`); a list for a flag that takes several values; a mapping or a list of mappings (e.g.
`stage-overrides`) becomes its JSON text. Every mistake (no such file, not YAML, not a mapping, a key that is
not a flag of the command, a value the flag cannot take) exits 2 naming the file and the key.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

FLAG = "--config"
_HELP = ("a YAML file of this command's flags, as vLLM's --config: a mapping of flag names (without the leading "
         "dashes) to values, e.g. 'max-model-len: 8192' or 'stage-overrides: {thinker: {tp: 2}}'; a flag given on "
         "the command line wins")


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    """`--config FILE` in a subcommand's help (apply_config reads it before argparse runs)."""
    parser.add_argument(FLAG, metavar="FILE", default=None, help=_HELP)


def apply_config(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Make the values of the `--config FILE` in `argv` (if any) the defaults of their subcommand's flags."""
    command, path = _find(parser, argv)
    if command is None or path is None:
        return
    sub = _subparsers(parser).choices[command]
    where = f"{FLAG} {path}"
    values = _read(sub, path, where)
    # the command's flags, and the global ones before it (`log-level`), each with the parser that owns it
    by_flag = {s: (p, a) for p in (parser, sub) for a in p._actions for s in a.option_strings}
    by_dest = {a.dest: (sub, a) for a in sub._actions if not a.option_strings}  # positionals: model, stage name
    fixed = {d for d, (_, a) in by_dest.items() if a.nargs != "?"}  # argparse wants these on the command line
    defaults: dict[argparse.ArgumentParser, dict[str, Any]] = {parser: {}, sub: {}}
    for key, value in values.items():
        name = str(key).replace("_", "-")
        owner, action = by_flag.get(f"--{name}") or by_dest.get(str(key).replace("-", "_")) or (sub, None)
        if action is None or name in ("config", "help") or isinstance(action, argparse._VersionAction):
            sub.error(f"{where}: {key!r} is not a flag of `omnimesh {command}` (see omnimesh {command} --help)")
        assert action is not None
        if action.dest in fixed:
            sub.error(f"{where}: {key!r} goes on the command line (omnimesh {command} {action.dest.upper()} ...)")
        if value is None:
            continue
        defaults[owner][action.dest] = _value(sub, action, value, f"{where}: {key}")
        action.required = False  # given by the file (argparse counts only the command line for `required`)
    for owner, given in defaults.items():
        owner.set_defaults(**given)


def _find(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[str | None, str | None]:
    """(the subcommand, the FILE of its `--config FILE`) in argv; None where absent."""
    commands = _subparsers(parser).choices
    command, path = None, None
    for i, arg in enumerate(argv):
        if command is None:
            if arg in commands and (i == 0 or argv[i - 1] != "--log-level"):
                command = arg
            continue
        if arg == "--":
            break
        if arg == FLAG:
            if i + 1 >= len(argv):
                commands[command].error(f"{FLAG} needs a file")
            path = argv[i + 1]
        elif arg.startswith(FLAG + "="):
            path = arg[len(FLAG) + 1:]
    return command, path


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _read(sub: argparse.ArgumentParser, path: str, where: str) -> dict[Any, Any]:
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        sub.error(f"{where}: cannot read it ({exc})")
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        sub.error(f"{where}: not YAML: {' '.join(str(exc).split())}")
    if values is None:
        return {}
    if not isinstance(values, dict):
        sub.error(f"{where}: must be a mapping of flag names to values, got {type(values).__name__}")
    return values


def _value(sub: argparse.ArgumentParser, action: argparse.Action, value: Any, where: str) -> Any:
    """`value` as the flag's default: switches take booleans; other flags the text they would be typed as
    (argparse converts and checks a string default as command-line text); mappings become JSON text."""
    if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
        if not isinstance(value, bool):
            sub.error(f"{where}: a switch: give true or false, got {value!r}")
        if isinstance(action, argparse._StoreTrueAction) and not value:
            return False
        return value
    if isinstance(value, bool):
        sub.error(f"{where}: takes a value (as {action.option_strings[0] if action.option_strings else action.dest} "
                  f"VALUE), got {value}")
    many = action.nargs in ("+", "*") or isinstance(action.nargs, int)
    if isinstance(value, list) and not all(isinstance(v, dict) for v in value):
        if not many:
            sub.error(f"{where}: takes one value, got a list")
        return [_one(sub, action, v, where) for v in value]
    one = _one(sub, action, value, where)
    return [one] if many else one


def _one(sub: argparse.ArgumentParser, action: argparse.Action, value: Any, where: str) -> Any:
    text = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    if action.choices is not None and text not in action.choices:
        sub.error(f"{where}: {text!r} is not one of {', '.join(map(str, action.choices))}")
    if action.nargs in ("+", "*") and action.type is not None:  # a list default is not converted by argparse
        try:
            return action.type(text)  # type: ignore[operator]
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            sub.error(f"{where}: {text!r}: {exc}")
    return text
