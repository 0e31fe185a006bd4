"""Reads the schema snapshot (``schema/op_plugin_functions.txt``) and states, per schema
line, the Python signature the real torch_npu binding generated from it has.

A schema line is op-plugin's ``func:`` entry, PyTorch's native-function syntax::

    func: npu_xxx.overload(Tensor x, Tensor? y=None, *, int[]? z=None, Tensor(a!) out) -> ...

How it becomes the Python binding's signature (torchgen's Python codegen, which torch_npu's
bindings are generated with):

- arguments before ``*`` are positional-or-keyword, those after it keyword-only;
- an argument named ``self`` of type ``Tensor`` (or ``Scalar``) is called ``input``
  (torchgen's ``PythonArgument.argument_str``: "s/self/input/ outside method bindings");
- the mutable keyword-only arguments of an ``.out`` overload (``Tensor(a!) attention_out,
  Tensor(b!) softmax_lse``) are one keyword-only ``out`` argument, without a default in the
  reference's ``.out`` form (its callers always pass it);
- an argument without a default is required, even an optional type (``Tensor?``: it may be
  None but must be given);
- defaults: ``None``; ``True`` / ``False``; integers; floats (``1e-6``, ``1.``, ``1.0``);
  strings in single or double quotes; lists (``[]``, ``[1,1]``, compared by their
  elements, so the reference may spell them as a tuple); a ``ScalarType`` default names a
  torch dtype (``long`` -> ``torch.long``); ``int reduction=Mean`` / ``Sum`` / ``None``
  are at::Reduction's values 1 / 2 / 0; ``MemoryFormat`` defaults name torch's memory
  formats (``contiguous_format`` -> ``torch.contiguous_format``).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

SNAPSHOT = Path(__file__).resolve().parents[1] / "schema" / "op_plugin_functions.txt"

REQUIRED = object()  # the default of an argument that has none

_REDUCTIONS = {"None": 0, "Mean": 1, "Sum": 2}
_HEADER = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:\.(?P<overload>[A-Za-z0-9_]+))?\(")
_MUTABLE = re.compile(r"\([a-z]!\)")


@dataclasses.dataclass(frozen=True)
class SchemaArgument:
    type: str          # as written, annotations included: "Tensor(a!)", "int[]?"
    name: str          # the schema's name
    default: str | None  # the default as written, None when there is none
    keyword_only: bool

    @property
    def optional_type(self) -> bool:
        return self.type.endswith("?")

    @property
    def mutable(self) -> bool:
        return bool(_MUTABLE.search(self.type))


@dataclasses.dataclass(frozen=True)
class Schema:
    name: str
    overload: str      # "" for the default overload
    arguments: tuple[SchemaArgument, ...]
    returns: str
    line: str

    @property
    def qualified_name(self) -> str:
        return f"{self.name}.{self.overload}" if self.overload else self.name


@dataclasses.dataclass(frozen=True)
class PythonParameter:
    """One parameter of the Python binding: what ``inspect.Parameter`` must show."""
    name: str
    keyword_only: bool
    default: object    # REQUIRED, or the Python value


def split_top_level(text: str, separator: str = ",") -> list[str]:
    """``text`` split at ``separator`` outside brackets, parentheses and quotes."""
    parts, depth, quote, start = [], 0, None, 0
    for index, char in enumerate(text):
        if quote:
            if char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
        elif char == separator and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return [part.strip() for part in parts if part.strip()]


def parse_schema(line: str) -> Schema:
    """One schema line (with or without the leading ``func:``)."""
    text = line.strip()
    if text.startswith("func:"):
        text = text[len("func:"):].strip()
    header = _HEADER.match(text)
    if header is None:
        raise ValueError(f"not a schema line: {line!r}")
    depth, close = 0, None
    for index in range(header.end() - 1, len(text)):
        if text[index] == "(":
            depth += 1
        elif text[index] == ")":
            depth -= 1
            if depth == 0:
                close = index
                break
    if close is None or not text[close + 1:].strip().startswith("->"):
        raise ValueError(f"unbalanced argument list or no '->' in {line!r}")
    arguments, keyword_only = [], False
    for item in split_top_level(text[header.end():close]):
        if item == "*":
            keyword_only = True
            continue
        declaration, _, default = item.partition("=")
        type_, _, name = declaration.strip().rpartition(" ")
        if not type_ or not name.isidentifier():
            raise ValueError(f"cannot read argument {item!r} in {line!r}")
        arguments.append(SchemaArgument(type_.strip(), name, default.strip() or None,
                                        keyword_only))
    return Schema(header.group("name"), header.group("overload") or "", tuple(arguments),
                  text[close + 1:].strip()[2:].strip(), line.strip())


def read_snapshot(path: Path = SNAPSHOT) -> list[Schema]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [parse_schema(line) for line in lines if line.startswith("func:")]


def python_default(argument: SchemaArgument):
    """The Python value of ``argument``'s default (``REQUIRED`` without one)."""
    text, base = argument.default, argument.type.rstrip("?")
    if text is None:
        return REQUIRED
    if text == "None":
        # "int? x=None" is None; a non-optional "int reduction=None" is Reduction::None.
        return _REDUCTIONS["None"] if base == "int" and not argument.optional_type else None
    if text in ("True", "False"):
        return text == "True"
    if text[0] in "'\"" and text[-1] == text[0]:
        return text[1:-1]
    if text.startswith("["):
        return [python_literal(item, base) for item in split_top_level(text[1:-1])]
    if base.startswith("ScalarType"):
        return getattr(torch, text)
    if base.startswith("MemoryFormat"):
        return getattr(torch, text)
    if text in _REDUCTIONS:
        return _REDUCTIONS[text]
    return python_literal(text, base)


def python_literal(text: str, base_type: str):
    if text in ("True", "False"):
        return text == "True"
    if re.fullmatch(r"-?\d+", text) and not base_type.startswith("float"):
        return int(text)
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"no Python mapping for the default {text!r} ({base_type})") from None


def python_parameters(schema: Schema) -> list[PythonParameter]:
    """The Python binding's parameters for ``schema``, by the rules in this module's doc."""
    parameters, outs = [], []
    for argument in schema.arguments:
        if schema.overload.startswith("out") and argument.keyword_only and argument.mutable:
            outs.append(argument)
            continue
        name = argument.name
        if name == "self" and argument.type.rstrip("?") in ("Tensor", "Scalar"):
            name = "input"
        parameters.append(PythonParameter(name, argument.keyword_only,
                                          python_default(argument)))
    if outs:
        parameters.append(PythonParameter("out", True, REQUIRED))
    return parameters
