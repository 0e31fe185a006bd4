"""Schema contract: every torch_npu function the reference models takes exactly the
arguments of the real binding, as op-plugin's schema line in ``schema/op_plugin_functions.txt``
states them (names, order, positional / keyword-only split, required or not, defaults; the
mapping from schema to Python is in ``reference_schema``).

Deviations the reference keeps on purpose are listed, each with its reason, in
``KNOWN_DEVIATIONS`` (and in the README); any other deviation fails, and so does a listed
one that is gone (the list must not go stale).
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from reference_schema import (
    REQUIRED,
    PythonParameter,
    Schema,
    parse_schema,
    python_parameters,
    read_snapshot,
)

SNAPSHOT = read_snapshot()
SNAPSHOT_PATH = "schema/op_plugin_functions.txt"
SCHEMAS = {schema.qualified_name: schema for schema in SNAPSHOT}

_NEWER_PAGE = ("documented by the op's page (Ascend/op-plugin docs/context/torch_npu-{op}.md, "
               "newer than the snapshot's yaml, which lacks it)")

# (op, argument) -> why the reference takes an argument the snapshot's schema does not have.
# Each is keyword-capable, defaults to what the page says, and raises the unmodelled error
# for a value the reference does not model.
KNOWN_DEVIATIONS: dict[tuple[str, str], str] = {
    ("npu_scatter_pa_kv_cache", "cache_mode"):
        _NEWER_PAGE.format(op="npu_scatter_pa_kv_cache")
        + "; the plugin's KV-cache writes pass cache_mode='Norm'",
    ("npu_add_rms_norm_dynamic_quant", "y_dtype"):
        _NEWER_PAGE.format(op="npu_add_rms_norm_dynamic_quant"),
    ("npu_rotary_mul", "rotate"): _NEWER_PAGE.format(op="npu_rotary_mul"),
    **{("npu_quant_matmul", argument): _NEWER_PAGE.format(op="npu_quant_matmul")
       for argument in ("x1_dtype", "x2_dtype", "pertoken_scale_dtype", "scale_dtype",
                        "y_scale")},
    **{("npu_grouped_matmul", argument): _NEWER_PAGE.format(op="npu_grouped_matmul")
       for argument in ("x_dtype", "weight_dtype", "scale_dtype", "per_token_scale_dtype")},
}

# torch_npu functions the reference has that are not op-plugin ops, so have no line here.
NOT_OP_PLUGIN = {
    "npu_format_cast": "registered by torch_npu itself (Ascend/pytorch), not by op-plugin",
}

_MODELLED_NAME = re.compile(r"^_?npu_[a-z0-9_]+$")


def modelled_functions(torch_npu) -> dict[str, object]:
    """``{qualified name: function}`` of every torch_npu function the reference models:
    the ``npu_*`` / ``_npu_*`` names it exposes (not the unmodelled stand-ins of
    ``torch_npu._unmodelled``) and their ``.out`` forms."""
    found = {}
    for name in dir(torch_npu):
        function = getattr(torch_npu, name)
        if not _MODELLED_NAME.match(name) or not callable(function):
            continue
        if getattr(function, "__module__", "") == "torch_npu._unmodelled":
            continue
        found[name] = function
        out_form = getattr(function, "out", None)
        if callable(out_form):
            found[f"{name}.out"] = out_form
    return found


def _default_matches(expected, actual) -> bool:
    if expected is REQUIRED:
        return actual is inspect.Parameter.empty
    if actual is inspect.Parameter.empty:
        return False
    if expected is None or isinstance(expected, bool):
        return actual is expected
    if isinstance(expected, list):
        return isinstance(actual, (list, tuple)) and list(actual) == expected
    if isinstance(expected, (int, float)):
        return (isinstance(actual, (int, float)) and not isinstance(actual, bool)
                and actual == expected and (isinstance(expected, float)
                                            or isinstance(actual, int)))
    return type(actual) is type(expected) and actual == expected


def _show(default) -> str:
    if default is REQUIRED or default is inspect.Parameter.empty:
        return "required"
    return f"default {default!r}"


def deviations(schema: Schema, function, known: dict[tuple[str, str], str]) -> list[str]:
    """How ``function``'s signature differs from what ``schema`` gives the real binding
    (arguments named in ``known`` for this op set aside); empty when it does not."""
    op = schema.qualified_name
    expected = python_parameters(schema)
    problems = []
    actual = []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            problems.append(f"takes {parameter}: the binding takes named arguments only")
        elif parameter.kind is parameter.POSITIONAL_ONLY:
            problems.append(f"{parameter.name} is positional-only; the binding takes it by "
                            "keyword too")
            actual.append(parameter)
        elif (op, parameter.name) not in known:
            actual.append(parameter)
    for (known_op, argument) in known:
        if known_op == op and argument not in inspect.signature(function).parameters:
            problems.append(f"known deviation {argument!r} is gone: take it off the list")
    expected_names = [p.name for p in expected]
    actual_names = [p.name for p in actual]
    missing = [name for name in expected_names if name not in actual_names]
    extra = [name for name in actual_names if name not in expected_names]
    if missing:
        problems.append(f"missing arguments {missing}")
    if extra:
        problems.append(f"arguments the schema does not have {extra}")
    common_expected = [name for name in expected_names if name in actual_names]
    common_actual = [name for name in actual_names if name in expected_names]
    if common_expected != common_actual:
        problems.append(f"order {common_actual}, schema order {common_expected}")
    by_name = {p.name: p for p in actual}
    for parameter in expected:
        given = by_name.get(parameter.name)
        if given is None:
            continue
        keyword_only = given.kind is given.KEYWORD_ONLY
        if keyword_only != parameter.keyword_only:
            want = "keyword-only" if parameter.keyword_only else "positional-or-keyword"
            problems.append(f"{parameter.name} is {given.kind.description}; schema: {want}")
        if not _default_matches(parameter.default, given.default):
            problems.append(f"{parameter.name} has {_show(given.default)}; schema: "
                            f"{_show(parameter.default)}")
    return problems


def _function(torch_npu, qualified_name: str):
    name, _, overload = qualified_name.partition(".")
    function = getattr(torch_npu, name)
    # The Python binding merges a name's overloads other than .out into one function.
    return getattr(function, overload) if overload == "out" else function


def _merged_overloads(modelled) -> set[str]:
    """Snapshot lines of overloads (other than .out) of modelled functions: the binding
    merges them into the base name's function, so that function models them."""
    return {name for name in SCHEMAS
            if "." in name and name.split(".")[1] != "out" and name.split(".")[0] in modelled}


def _known_for(qualified_name: str) -> dict[tuple[str, str], str]:
    """The deviations set aside for ``qualified_name``: the listed ones and, for a merged
    overload, the arguments of its base schema it lacks (the one Python function takes the
    union; each must keep a default so that every call of the overload binds)."""
    known = dict(KNOWN_DEVIATIONS)
    base, _, overload = qualified_name.partition(".")
    if overload and overload != "out":
        for (op, argument), reason in KNOWN_DEVIATIONS.items():
            if op == base:
                known[(qualified_name, argument)] = reason
        overload_names = {a.name for a in SCHEMAS[qualified_name].arguments}
        for argument in SCHEMAS[base].arguments:
            if argument.name not in overload_names:
                known[(qualified_name, argument.name)] = f"of the base overload {base}"
    return known


# --- the contract -----------------------------------------------------------------------------


def test_every_modelled_function_has_a_schema_line(torch_npu):
    modelled = set(modelled_functions(torch_npu)) - set(NOT_OP_PLUGIN)
    modelled |= _merged_overloads(modelled)
    without = sorted(modelled - set(SCHEMAS))
    assert not without, (f"modelled torch_npu functions without a line in {SNAPSHOT_PATH}: "
                         f"{without}; add op-plugin's schema line for each")
    stale = sorted(set(SCHEMAS) - modelled)
    assert not stale, f"schema lines for functions the reference does not model: {stale}"


def test_not_op_plugin_list_names_modelled_functions(torch_npu):
    assert set(NOT_OP_PLUGIN) <= set(modelled_functions(torch_npu))


@pytest.mark.parametrize("qualified_name", sorted(SCHEMAS))
def test_signature_follows_the_schema(torch_npu, qualified_name):
    schema = SCHEMAS[qualified_name]
    known = _known_for(qualified_name)
    problems = deviations(schema, _function(torch_npu, qualified_name), known)
    function = _function(torch_npu, qualified_name)
    for (op, argument) in known:
        parameter = inspect.signature(function).parameters.get(argument)
        if op == qualified_name and parameter is not None and (
                parameter.default is inspect.Parameter.empty):
            problems.append(f"{argument} is outside this overload's schema but has no default")
    assert not problems, (f"torch_npu.{qualified_name} deviates from its schema\n  "
                          f"{schema.line}\n" + "\n".join(f"  - {p}" for p in problems))


def test_known_deviations_are_reported(torch_npu, capsys):
    # The kept deviations, printed with -s / on failure, and each one real.
    with capsys.disabled():
        print("\nknown schema deviations of the reference torch_npu:")
        for (op, argument), reason in sorted(KNOWN_DEVIATIONS.items()):
            print(f"  torch_npu.{op}: {argument} ({reason})")
    for op, argument in KNOWN_DEVIATIONS:
        assert op in SCHEMAS, f"{op} has no schema line"
        assert argument not in {a.name for a in SCHEMAS[op].arguments}, (
            f"{op}'s schema has {argument}: it is no deviation")
        assert argument in inspect.signature(_function(torch_npu, op)).parameters


@pytest.mark.parametrize("op, argument", sorted(KNOWN_DEVIATIONS))
def test_known_deviations_have_defaults(torch_npu, op, argument):
    # So every call the snapshot's schema allows still binds without them.
    parameter = inspect.signature(_function(torch_npu, op)).parameters[argument]
    assert parameter.default is not inspect.Parameter.empty


# --- calls in the schema's form -----------------------------------------------------------------


def test_schema_self_is_input_by_keyword(torch_npu):
    # npu_rms_norm(Tensor self, ...) and npu_dynamic_quant(Tensor input, ...): the Python
    # binding's first argument is "input" in both.
    x = torch.randn(2, 8, dtype=torch.float16)
    y, _ = torch_npu.npu_rms_norm(input=x, gamma=torch.ones(8, dtype=torch.float16))
    assert torch.equal(y, torch_npu.npu_rms_norm(x, torch.ones(8, dtype=torch.float16))[0])
    quantized, scale = torch_npu.npu_dynamic_quant(input=x)
    assert quantized.dtype == torch.int8 and scale.shape == (2,)
    with pytest.raises(TypeError):
        torch_npu.npu_rms_norm(self=x, gamma=torch.ones(8, dtype=torch.float16))
    with pytest.raises(TypeError):
        torch_npu.npu_dynamic_quant(x=x)


def test_attention_workspace_and_out_form_bind_like_the_binding(torch_npu):
    query = torch.randn(1, 1, 2, 16, dtype=torch.float16)
    cache = torch.randn(2, 16, 32, dtype=torch.float16)
    kwargs = dict(num_heads=2, num_key_value_heads=2, input_layout="BSND", scale=0.25,
                  block_table=torch.tensor([[0, 1]], dtype=torch.int32), block_size=16,
                  actual_seq_lengths_kv=[20])
    workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(
        query, cache, cache, **kwargs)
    expected, _ = torch_npu.npu_fused_infer_attention_score(query, cache, cache, **kwargs)
    out = [torch.empty_like(expected), torch.empty(1)]
    torch_npu.npu_fused_infer_attention_score.out(query, key=cache, value=cache,
                                                  workspace=workspace, out=out, **kwargs)
    assert torch.equal(out[0], expected)
    with pytest.raises(TypeError, match="unexpected keyword argument 'heads'"):
        torch_npu._npu_fused_infer_attention_score_get_max_workspace(query, cache, cache,
                                                                     heads=2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'heads'"):
        torch_npu.npu_fused_infer_attention_score.out(query, cache, cache, heads=2, out=out)
    with pytest.raises(TypeError, match="'out'"):
        torch_npu.npu_fused_infer_attention_score.out(query, cache, cache, **kwargs)
    with pytest.raises(TypeError, match="positional"):
        torch_npu.npu_fused_infer_attention_score.out(query, cache, cache, None, out=out)


# --- the checker itself -----------------------------------------------------------------------


def test_parser_reads_types_defaults_and_the_keyword_only_split():
    schema = parse_schema("func: npu_x.out(Tensor self, int[2] dims=[1,1], *, str mode='a', "
                          "ScalarType? dtype=None, float eps=1e-6, bool flag=True, "
                          "Tensor(a!) out) -> Tensor(a!)")
    assert (schema.name, schema.overload, schema.returns) == ("npu_x", "out", "Tensor(a!)")
    assert [(a.type, a.name, a.default, a.keyword_only) for a in schema.arguments] == [
        ("Tensor", "self", None, False), ("int[2]", "dims", "[1,1]", False),
        ("str", "mode", "'a'", True), ("ScalarType?", "dtype", "None", True),
        ("float", "eps", "1e-6", True), ("bool", "flag", "True", True),
        ("Tensor(a!)", "out", None, True)]
    assert python_parameters(schema) == [
        PythonParameter("input", False, REQUIRED), PythonParameter("dims", False, [1, 1]),
        PythonParameter("mode", True, "a"), PythonParameter("dtype", True, None),
        PythonParameter("eps", True, 1e-6), PythonParameter("flag", True, True),
        PythonParameter("out", True, REQUIRED)]


def test_parser_maps_dtype_and_enum_defaults():
    schema = parse_schema("func: f(Tensor x, ScalarType dtype=long, int reduction=Mean, "
                          "MemoryFormat? memory_format=contiguous_format) -> Tensor")
    assert [p.default for p in python_parameters(schema)] == [
        REQUIRED, torch.long, 1, torch.contiguous_format]


def test_checker_lists_each_kind_of_deviation():
    schema = parse_schema("func: npu_f(Tensor x, int k=1, *, Tensor? bias=None, "
                          "float eps=1e-6) -> Tensor")

    def renamed_and_reordered(x, *, eps=1e-5, k=1, extra=None, **kwargs):
        pass

    problems = deviations(schema, renamed_and_reordered, {})
    text = "\n".join(problems)
    assert "takes **kwargs" in text
    assert "missing arguments ['bias']" in text
    assert "arguments the schema does not have ['extra']" in text
    assert "k is keyword-only; schema: positional-or-keyword" in text
    assert "eps has default 1e-05; schema: default 1e-06" in text
    assert "order ['x', 'eps', 'k'], schema order ['x', 'k', 'eps']" in text

    def matching(x, k=1, *, bias=None, eps=1e-6):
        pass

    assert deviations(schema, matching, {}) == []
    assert deviations(schema, matching, {("npu_f", "bias"): "kept"}) == [
        "missing arguments ['bias']"]


def test_checker_requires_a_list_default_by_its_elements():
    schema = parse_schema("func: npu_g(Tensor x, *, bool[2] mask=[]) -> Tensor")

    def with_tuple(x, *, mask=()):
        pass

    def with_none(x, *, mask=None):
        pass

    assert deviations(schema, with_tuple, {}) == []
    assert deviations(schema, with_none, {}) == ["mask has default None; schema: default []"]


def test_a_merged_overload_is_checked_against_its_own_line(torch_npu):
    """npu_grouped_matmul.List has int[]? group_list and no tuning_config: the one Python
    function must take every List call (tuning_config keyword-only with a default)."""
    assert "npu_grouped_matmul.List" in SCHEMAS
    known = _known_for("npu_grouped_matmul.List")
    assert ("npu_grouped_matmul.List", "tuning_config") in known
    assert deviations(SCHEMAS["npu_grouped_matmul.List"],
                      _function(torch_npu, "npu_grouped_matmul.List"), known) == []

    def without_group_list(x, weight, *, bias=None, tuning_config=None):
        pass

    assert "missing arguments" in "\n".join(
        deviations(SCHEMAS["npu_grouped_matmul.List"], without_group_list, known))
