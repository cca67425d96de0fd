"""aps/_core.pyi against the compiled aps._core: names, signatures, parameter and return types."""

from __future__ import annotations

import ast
import inspect
import os
import re
import shutil
import subprocess
import sys
from inspect import Parameter
from pathlib import Path

import numpy as np
import pytest

from aps import _core

STUB = Path(__file__).resolve().parents[2] / "aps" / "_core.pyi"

P = Parameter


def vec(*values):
    return np.array(values, np.float32)


# One call with small valid arguments for every function of the module: its result
# is checked against the stub's return type. A function without one fails the test.
FUNCTION_SAMPLES = {
    "fused_multiply_add": lambda: ((), {}),
    "kernel_isa": lambda: ((), {}),
    "kernel_isas": lambda: ((), {}),
    "set_kernel_isa": lambda: ((_core.kernel_isa(),), {}),  # (the one running: nothing changes)
    "all_finite": lambda: ((vec(1, 2),), {}),
    "accumulate": lambda: ((vec(0, 0), vec(1, 2), vec(3, 4)), {"scale": 0.5}),
    "sgd_step": lambda: (
        (vec(0, 0), vec(1, 2), vec(0.5, -0.5), vec(0, 0), vec(0, 0), 0.1),
        {"momentum": 0.9, "first": True},
    ),
    "adam_step": lambda: (
        (vec(0, 0), vec(1, 2), vec(0.5, -0.5), vec(0, 0), vec(0, 0), vec(0, 0), vec(0, 0), 1, 1e-3),
        {},
    ),
    "delayed_nesterov_step": lambda: (
        (vec(0, 0), vec(1, 2), vec(0.5, -0.5), vec(0, 0), vec(0, 0), vec(0, 0), vec(0, 0), 2, 0.7, 0.9, 2),
        {"c": 0.25},
    ),
    "compensate": lambda: (
        (vec(0, 0), vec(1, 2), vec(1, 1), vec(0, 1), vec(0, 0), vec(1, 1), _core.COMPENSATE_DC_ADAPTIVE),
        {"lam": 0.5, "decay": 0.95, "eps": 1e-7},
    ),
    "step_scale": lambda: ((vec(0, 0), vec(1, 1), vec(1, 2), vec(0, 0), 0.99), {}),
    "dssp_controller": lambda: ((2.0, 1.0, 2.0, 0.5, 3), {}),
    "use_f16c": lambda: ((), {"allowed": True}),
    "narrow": lambda: ((np.zeros(2, np.uint16), vec(1, 2), _core.BFLOAT16), {}),
    "widen": lambda: ((vec(0, 0), np.array([0x3F80, 0x4000], np.uint16), _core.BFLOAT16), {}),
    "ids_range": lambda: ((ids(3, -1, 7),), {}),
    "mix64": lambda: ((ids(1, 2), np.zeros(2, np.uint64)), {}),
    "rows_init": lambda: ((rows(2, 3), ids(1, 2), 7, _core.INIT_NORMAL, 0.1), {}),
    "rows_gather": lambda: ((rows(2, 2), rows(3, 2), ids(2, 0)), {}),
    "rows_distinct": lambda: ((ids(2, 0, 2), np.empty(3, np.int64), np.zeros(3, np.int32)), {}),
    "rows_scatter": lambda: ((rows(3, 2), rows(2, 2), ids(2, 0)), {}),
    "rows_coalesce": lambda: ((rows(1, 2), ids(0, 0), rows(2, 2) + 1), {}),
    "rows_sgd": lambda: ((rows(1, 2), ids(0, 0), rows(2, 2) + 1, 0.1), {}),
    "rows_adagrad": lambda: ((rows(1, 2), vec(0, 0), rows(1, 2) + 1, 0.1), {"eps": 1e-10, "rowwise": False}),
    "rows_adam": lambda: ((rows(1, 2), rows(1, 2), rows(1, 2), rows(1, 2) + 1, 1, 1e-3), {"beta1": 0.9}),
}


def ids(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


def rows(count: int, dim: int) -> np.ndarray:
    return np.zeros((count, dim), np.float32)


def row_index():
    index = _core.RowIndex(4)
    index.lookup(ids(5, 9), np.empty(2, np.int64))
    return index


def ssp_window():
    """SSP with threshold 0: ranks 0 and 1 live, rank 0 one push ahead and held, rank 2 not joined."""
    window = _core.StalenessWindow(3, 0, 0)
    window.join(0)
    window.join(1)
    window.push(0, 1.0)
    return window


# Per class: every constructor parameter by name (distinct values, so a swap shows), a
# factory for a sample instance (read for the properties), and one call per method.
CLASS_SAMPLES = {
    "StalenessWindow": (
        {"num_workers": 3, "lower": 0, "upper": 1},
        ssp_window,
        {
            "clock": (0,),
            "gap": (0,),
            "is_live": (0,),
            "is_held": (0,),
            "credit": (0,),
            "arrivals": (0,),
            "state": (),
            "admits": (0, 0),
            "join": (2,),
            "leave": (1,),
            "push": (1, 2.0),
            "restore": (5, 1, 2, 6),
        },
    ),
    "RowIndex": ({"capacity": 8}, row_index, {"lookup": (ids(5, 7), np.empty(2, np.int64)), "ids": (), "__len__": ()}),
}
# Sample calls that need an instance of their own (restore wants nobody live).
SAMPLE_MAKERS = {("StalenessWindow", "restore"): lambda: _core.StalenessWindow(3, 0, 0)}

# Names Cython adds to every extension module and type, which the stub leaves out.
CYTHON_DUNDERS = {
    "__new__", "__init__", "__doc__", "__module__", "__reduce__", "__setstate__",
    "__reduce_cython__", "__setstate_cython__", "__pyx_vtable__",
}

# C types in the embedded signatures, and the stub annotation each one is.
C_TYPES = {
    "double": "float", "float": "float", "int": "int", "long": "int", "Py_ssize_t": "int",
    "bool": "bool", "bint": "bool", "str": "str", "bytes": "bytes", "list": "list", "tuple": "tuple",
    "dict": "dict", "uint64_t": "int",
}
C_NUMBERS = {"double", "float", "int", "long", "Py_ssize_t", "uint64_t"}  # these refuse None
MEMORYVIEW = re.compile(r"\w+\s*\[[^\]]*\]")


class StubParseError(Exception):
    pass


# ---------------------------------------------------------------------------
# The stub


def stub_params(fn):
    """[(name, kind, has_default)] of a stub function, its annotations by name, and defaults other than `...`."""
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    params = [(arg.arg, P.POSITIONAL_ONLY if i < len(a.posonlyargs) else P.POSITIONAL_OR_KEYWORD, d is not None)
              for i, (arg, d) in enumerate(zip(positional, defaults))]
    if a.vararg:
        params.append((a.vararg.arg, P.VAR_POSITIONAL, False))
    params += [(arg.arg, P.KEYWORD_ONLY, d is not None) for arg, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        params.append((a.kwarg.arg, P.VAR_KEYWORD, False))
    args = [*positional, *([a.vararg] if a.vararg else []), *a.kwonlyargs, *([a.kwarg] if a.kwarg else [])]
    annotations = {arg.arg: arg.annotation for arg in args}
    bad_defaults = [d for d in [*a.defaults, *a.kw_defaults] if d is not None
                    and not (isinstance(d, ast.Constant) and d.value is Ellipsis)]
    return params, annotations, bad_defaults


def decorators(node):
    return [ast.unparse(d) for d in node.decorator_list]


def parse_stub(path):
    """The stub's functions, classes (constructor, methods, properties) and variables."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    functions, classes, variables = {}, {}, {}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) or (
            isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        ):
            continue
        if isinstance(node, ast.FunctionDef) and not node.decorator_list:
            functions[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            variables[node.target.id] = node.annotation
        elif isinstance(node, ast.ClassDef):
            classes[node.name] = parse_class(node)
        else:
            raise StubParseError(f"line {node.lineno}: {ast.unparse(node)[:60]!r} is not handled; extend parse_stub")
    return functions, classes, variables


def parse_class(node):
    members = {"constructor": None, "methods": {}, "properties": {}, "attributes": {}}
    for item in node.body:
        if isinstance(item, ast.Expr) and isinstance(item.value, ast.Constant):
            continue
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members["attributes"][item.target.id] = item.annotation
            continue
        if not isinstance(item, ast.FunctionDef):
            raise StubParseError(f"line {item.lineno}: {ast.unparse(item)[:60]!r} is not handled; extend parse_class")
        marks = decorators(item)
        if item.name in ("__init__", "__new__") and not marks:
            if members["constructor"] is not None:
                raise StubParseError(f"{node.name}: both __init__ and __new__; keep the one the runtime uses")
            members["constructor"] = item
        elif marks == ["property"]:
            members["properties"][item.name] = [item, False]
        elif marks == [f"{item.name}.setter"] and item.name in members["properties"]:
            members["properties"][item.name][1] = True
        elif not marks:
            members["methods"][item.name] = item
        else:
            raise StubParseError(f"line {item.lineno}: decorators {marks} are not handled; extend parse_class")
    return members


# ---------------------------------------------------------------------------
# The runtime


def runtime_signature(obj, name):
    """[(name, kind, has_default)], {name: C type or None}, return annotation or None.

    From inspect.signature when the function binds; else from the signature line
    Cython embeds at the top of the docstring (``embedsignature=True``). The C types
    come from that line in any case."""
    doc_params, doc_types, doc_return = parse_embedded_signature(obj, name)
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        if doc_params is None:
            raise StubParseError(f"{name}: no inspect.signature and no embedded signature line") from None
        return doc_params, doc_types, doc_return
    params = [(p.name, p.kind, p.default is not p.empty) for p in sig.parameters.values()]
    ret = None if sig.return_annotation is sig.empty else str(sig.return_annotation)
    return params, doc_types, ret


def parse_embedded_signature(obj, name):
    first = (getattr(obj, "__doc__", None) or "").split("\n", 1)[0]
    match = re.fullmatch(rf"(?:\w+\.)*{re.escape(name)}\((.*)\)(?:\s*->\s*(.+))?", first.strip())
    if not match:
        return None, {}, None
    params, types, kind = [], {}, P.POSITIONAL_OR_KEYWORD
    for piece in filter(None, (p.strip() for p in split_top_level(match.group(1)))):
        if piece == "*":
            kind = P.KEYWORD_ONLY
            continue
        if piece == "/":
            params = [(n, P.POSITIONAL_ONLY, d) for n, _, d in params]
            continue
        decl, _, default = piece.partition("=")
        decl = decl.strip()
        if decl.startswith("**"):
            params.append((decl[2:].split()[-1], P.VAR_KEYWORD, False))
            continue
        if decl.startswith("*"):
            params.append((decl[1:].split()[-1], P.VAR_POSITIONAL, False))
            kind = P.KEYWORD_ONLY
            continue
        head, _, pname = decl.rpartition(" ")
        head = re.sub(r"^const\s+", "", head.strip()).replace(" not None", "")
        params.append((pname, kind, bool(default.strip())))
        types[pname] = head or None
    return params, types, match.group(2)


def split_top_level(text):
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        elif ch == "," and depth == 0:
            yield text[start:i]
            start = i + 1
    yield text[start:]


# ---------------------------------------------------------------------------
# Annotations against values


def strip_none(annotation):
    """(annotation without a ``| None``, whether it had one)."""
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        for keep, other in ((annotation.left, annotation.right), (annotation.right, annotation.left)):
            if isinstance(other, ast.Constant) and other.value is None:
                return keep, True
    return annotation, False


def matches(value, annotation):
    """Whether ``value`` is of the stub type ``annotation`` (bool is not an int here)."""
    text = ast.unparse(annotation)
    if isinstance(annotation, ast.Constant) and annotation.value is None:
        return value is None
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return matches(value, annotation.left) or matches(value, annotation.right)
    simple = {
        "Any": lambda v: True,
        "bool": lambda v: type(v) is bool,
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, float),
        "str": lambda v: isinstance(v, str),
        "bytes": lambda v: isinstance(v, bytes),
        "np.ndarray": lambda v: isinstance(v, np.ndarray),
    }
    if text in simple:
        return simple[text](value)
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) in ("tuple", "list"):
        container = ast.unparse(annotation.value)
        if type(value) is not {"tuple": tuple, "list": list}[container]:
            return False
        items = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
        if container == "tuple" and not (len(items) == 2 and ast.unparse(items[1]) == "..."):
            return len(value) == len(items) and all(matches(v, t) for v, t in zip(value, items))
        return all(matches(v, items[0]) for v in value)
    raise StubParseError(f"cannot check values against {text!r}; extend matches()")


def same(a, b):
    return repr(a) == repr(b)  # NaN-safe equality of property values


# ---------------------------------------------------------------------------
# The comparison


def stub_problems(stub_path, module=_core):
    """Every disagreement between the stub at ``stub_path`` and ``module``, as text."""
    try:
        functions, classes, variables = parse_stub(stub_path)
    except StubParseError as e:
        return [str(e)]
    problems = []
    public = {n for n in dir(module) if not n.startswith("_") and not inspect.ismodule(getattr(module, n))}
    for name in sorted(public - set(functions) - set(classes) - set(variables)):
        problems.append(f"{name}: in the module, not in the stub")
    for name in sorted(set(functions) | set(classes) | set(variables)):
        if not hasattr(module, name):
            problems.append(f"{name}: in the stub, not in the module")
    for name, annotation in variables.items():
        if hasattr(module, name):
            problems += check_value(name, getattr(module, name), annotation)
    for name, fn in functions.items():
        obj = getattr(module, name, None)
        if obj is None:
            continue
        if not callable(obj) or inspect.isclass(obj):
            problems.append(f"{name}: a function in the stub, {type(obj).__name__} in the module")
            continue
        sample = FUNCTION_SAMPLES.get(name)
        if sample is None:
            problems.append(f"{name}: no sample call in FUNCTION_SAMPLES")
        problems += check_function(name, obj, fn, sample and (lambda obj=obj, sample=sample: (obj, *sample())))
    for name, members in classes.items():
        cls = getattr(module, name, None)
        if cls is None:
            continue
        if not inspect.isclass(cls):
            problems.append(f"{name}: a class in the stub, {type(cls).__name__} in the module")
            continue
        problems += check_class(name, cls, members)
    for name in sorted(set(FUNCTION_SAMPLES) - set(functions)):
        problems.append(f"{name}: a sample call in FUNCTION_SAMPLES, no such function in the stub")
    return problems


def check_value(name, value, annotation):
    try:
        ok = matches(value, annotation)
    except StubParseError as e:
        return [f"{name}: {e}"]
    return [] if ok else [f"{name}: {type(value).__name__} {value!r} is not {ast.unparse(annotation)}"]


def check_function(name, obj, fn, sample, skip_first=False):
    """Signature, parameter types, return annotation and (with ``sample``) the returned value.

    ``sample()`` gives (bound callable, args, kwargs)."""
    problems = []
    params, annotations, bad_defaults = stub_params(fn)
    if bad_defaults:
        problems.append(f"{name}: defaults in the stub should be written `...`")
    try:
        runtime, c_types, runtime_return = runtime_signature(obj, name.rsplit(".", 1)[-1])
    except StubParseError as e:
        return problems + [str(e)]
    if params != runtime:
        problems.append(f"{name}: parameters differ:\n  stub:    {show(params)}\n  runtime: {show(runtime)}")
    returns = ast.unparse(fn.returns) if fn.returns else None
    if returns is None:
        problems.append(f"{name}: no return annotation in the stub")
    elif runtime_return is not None and runtime_return != returns:
        problems.append(f"{name}: returns {returns} in the stub, {runtime_return} in the module's signature")
    for pname, c_type in c_types.items():
        annotation = annotations.get(pname)
        if c_type is None or annotation is None:
            continue
        base, optional = strip_none(annotation)
        if MEMORYVIEW.fullmatch(c_type):
            expected, none_ok = "np.ndarray", True  # None-ness is probed below
        elif c_type in C_TYPES:
            expected, none_ok = C_TYPES[c_type], c_type not in C_NUMBERS
        else:
            problems.append(f"{name}: C type {c_type!r} of {pname!r} is not in C_TYPES")
            continue
        if ast.unparse(base) != expected or (optional and not none_ok):
            problems.append(f"{name}: {pname} is {c_type} in the module, {ast.unparse(annotation)} in the stub")
    if sample is None or returns is None:
        return problems
    call, args, kwargs = sample()
    try:
        result = call(*args, **kwargs)
    except Exception as e:
        return problems + [f"{name}: the sample call raised {type(e).__name__}: {e}"]
    try:
        if not matches(result, fn.returns):
            problems.append(f"{name}: returned {type(result).__name__} {result!r}, the stub says {returns}")
    except StubParseError as e:
        problems.append(f"{name}: {e}")
    # A parameter the stub lets be None must get past the module's argument checks with None.
    names = [n for n, kind, _ in params if kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)][skip_first:]
    for pname, annotation in annotations.items():
        if strip_none(annotation)[1] and pname in names:
            call, args, kwargs = sample()
            args = list(args)
            position = names.index(pname)
            if position < len(args):
                args[position] = None
            else:
                kwargs[pname] = None
            try:
                call(*args, **kwargs)
            except TypeError as e:
                problems.append(f"{name}: {pname} may be None in the stub, the module refuses it: {e}")
            except Exception:
                pass  # past the argument checks
    return problems


def check_class(name, cls, members):
    problems = []
    runtime = {n: v for n, v in vars(cls).items() if n not in CYTHON_DUNDERS}
    stub_names = {*members["methods"], *members["properties"], *members["attributes"]}
    for member in sorted(set(runtime) - stub_names):
        if not member.startswith("_") or (member.startswith("__") and callable(runtime[member])):
            problems.append(f"{name}.{member}: in the module, not in the stub")
    for member in sorted(stub_names):
        if not hasattr(cls, member):
            problems.append(f"{name}.{member}: in the stub, not in the module")
    if name not in CLASS_SAMPLES:
        return problems + [f"{name}: no entry in CLASS_SAMPLES"]
    ctor_values, make, calls = CLASS_SAMPLES[name]
    for member in sorted(set(calls) - set(members["methods"])):
        problems.append(f"{name}.{member}: a sample call in CLASS_SAMPLES, no such method in the stub")
    problems += check_constructor(name, cls, members, ctor_values)
    instance = make()
    for member, (fn, has_setter) in members["properties"].items():
        attr = inspect.getattr_static(cls, member, None)
        if attr is None:
            continue
        if not inspect.isdatadescriptor(attr):
            problems.append(f"{name}.{member}: a property in the stub, {type(attr).__name__} in the module")
            continue
        problems += check_value(f"{name}.{member}", getattr(instance, member), fn.returns)
        try:
            setattr(instance, member, getattr(instance, member))
            writable = True
        except AttributeError:
            writable = False
        if writable != has_setter:
            problems.append(f"{name}.{member}: {'writable' if writable else 'read-only'} in the module, "
                            f"{'writable' if has_setter else 'read-only'} in the stub")
    for member, annotation in members["attributes"].items():
        if hasattr(instance, member):
            problems += check_value(f"{name}.{member}", getattr(instance, member), annotation)
    for member, fn in members["methods"].items():
        attr = inspect.getattr_static(cls, member, None)
        if attr is None:
            continue
        if inspect.isdatadescriptor(attr) or not callable(attr):
            problems.append(f"{name}.{member}: a method in the stub, {type(attr).__name__} in the module")
            continue
        if member not in calls:
            problems.append(f"{name}.{member}: no sample call in CLASS_SAMPLES")
            sample = None
        else:
            maker = SAMPLE_MAKERS.get((name, member), make)
            sample = lambda member=member, maker=maker: (getattr(maker(), member), calls[member], {})
        problems += check_function(f"{name}.{member}", getattr(cls, member), fn, sample, skip_first=True)
    return problems


def check_constructor(name, cls, members, values):
    """The stub's __new__/__init__ against the class, by calling it.

    A Cython extension type takes its arguments in __cinit__, which neither binds
    a signature nor embeds one, so the parameters are probed with calls."""
    fn = members["constructor"]
    if fn is None:
        return [f"{name}: no __new__ or __init__ in the stub"]
    params, annotations, bad_defaults = stub_params(fn)
    params = params[1:]  # cls / self
    problems = [f"{name}: defaults in the stub should be written `...`"] if bad_defaults else []
    try:
        runtime = [(p.name, p.kind, p.default is not p.empty) for p in inspect.signature(cls).parameters.values()]
    except (TypeError, ValueError):
        runtime = None
    if runtime is not None:
        if params != runtime:
            problems.append(f"{name}(): parameters differ:\n  stub:    {show(params)}\n  runtime: {show(runtime)}")
        return problems
    if any(kind != P.POSITIONAL_OR_KEYWORD for _, kind, _ in params):
        return problems + [f"{name}(): only positional-or-keyword parameters can be probed; extend check_constructor"]
    names = [n for n, _, _ in params]
    if sorted(values) != sorted(names):
        return problems + [f"{name}(): the stub's parameters are {names}, CLASS_SAMPLES gives {sorted(values)}"]

    def attempt(*args, **kwargs):
        try:
            return cls(*args, **kwargs), None
        except Exception as e:
            return None, e

    def state(obj):
        return [getattr(obj, p) for p in members["properties"]]

    by_name, error = attempt(**values)
    if error is not None:
        return problems + [f"{name}(**{values}) raised {type(error).__name__}: {error}"]
    by_position, error = attempt(*[values[n] for n in names])
    if error is not None or not same(state(by_position), state(by_name)):
        problems.append(f"{name}(): the order of the parameters is not {names} in the module")
    _, error = attempt(*[values[n] for n in names], values[names[-1]])
    if not isinstance(error, TypeError):
        problems.append(f"{name}(): the module takes more than the stub's {len(names)} parameters")
    _, error = attempt(**values, not_a_parameter=1)
    if not isinstance(error, TypeError):
        problems.append(f"{name}(): the module takes keyword arguments the stub does not have")
    for pname, _, has_default in params:
        _, error = attempt(**{n: v for n, v in values.items() if n != pname})
        if has_default and error is not None:
            problems.append(f"{name}(): {pname} has a default in the stub, the module requires it ({error})")
        if not has_default and not isinstance(error, TypeError):
            problems.append(f"{name}(): {pname} is required in the stub, the module has a default for it")
        if strip_none(annotations[pname])[1]:
            _, error = attempt(**{**values, pname: None})
            if isinstance(error, TypeError):
                problems.append(f"{name}(): {pname} may be None in the stub, the module refuses it: {error}")
    return problems


def show(params):
    marks = {P.VAR_POSITIONAL: "*", P.VAR_KEYWORD: "**"}
    out = [f"{marks.get(kind, '')}{n}{'=...' if d else ''}{' (kw-only)' if kind == P.KEYWORD_ONLY else ''}"
           f"{' (pos-only)' if kind == P.POSITIONAL_ONLY else ''}" for n, kind, d in params]
    return "(" + ", ".join(out) + ")"


# ---------------------------------------------------------------------------
# Tests


def test_stub_matches_module():
    problems = stub_problems(STUB)
    assert not problems, "aps/_core.pyi disagrees with aps._core:\n" + "\n".join(problems)


def mutated(tmp_path, edit):
    """A copy of the stub with ``edit`` applied to its syntax tree."""
    tree = ast.parse(STUB.read_text(encoding="utf-8"))
    edit(tree)
    path = tmp_path / "_core.pyi"
    path.write_text(ast.unparse(tree), encoding="utf-8")
    return path


def defs(tree):
    return {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def test_the_check_finds_drift(tmp_path):
    def rename_parameter(tree):
        defs(tree)["accumulate"].args.args[1].arg = "acc"

    def return_none(tree):
        defs(tree)["sgd_step"].returns = ast.Constant(None)

    def drop_default(tree):
        defs(tree)["adam_step"].args.defaults.pop(0)

    def narrow_type(tree):
        defs(tree)["adam_step"].args.args[7].annotation = ast.Name("float")

    def drop_function(tree):
        tree.body.remove(defs(tree)["all_finite"])

    def add_function(tree):
        tree.body.append(ast.parse("def gone(x: int) -> int: ...").body[0])

    def drop_method(tree):
        cls = defs(tree)["StalenessWindow"]
        cls.body = [n for n in cls.body if getattr(n, "name", None) != "is_held"]

    def property_type(tree):
        cls = defs(tree)["StalenessWindow"]
        next(n for n in cls.body if getattr(n, "name", None) == "bounded").returns = ast.Name("int")

    def swap_constructor(tree):
        cls = defs(tree)["StalenessWindow"]
        new = next(n for n in cls.body if getattr(n, "name", None) in ("__new__", "__init__"))
        new.args.args[2], new.args.args[3] = new.args.args[3], new.args.args[2]

    for edit, where in [
        (rename_parameter, "accumulate"),
        (return_none, "sgd_step"),
        (drop_default, "adam_step"),
        (narrow_type, "adam_step"),
        (drop_function, "all_finite"),
        (add_function, "gone"),
        (drop_method, "StalenessWindow.is_held"),
        (property_type, "StalenessWindow.bounded"),
        (swap_constructor, "StalenessWindow()"),
    ]:
        problems = stub_problems(mutated(tmp_path, edit))
        assert any(p.startswith(where) for p in problems), (edit.__name__, problems)


def test_stubtest(tmp_path):
    """mypy's stubtest, as a second opinion (skipped without mypy)."""
    pytest.importorskip("mypy.stubtest")
    stubs = tmp_path / "stubs" / "aps"
    stubs.mkdir(parents=True)
    shutil.copy(STUB, stubs / "_core.pyi")
    (stubs / "__init__.pyi").write_text("")
    (stubs / "wire").mkdir()  # (the one type of the package the stub names, for itself)
    (stubs / "wire" / "__init__.pyi").write_text("")
    (stubs / "wire" / "quantized.pyi").write_text("class Quantized: ...\n")
    (tmp_path / "mypy.ini").write_text("[mypy]\n")
    # What Cython adds to every module it compiles.
    cython = ["__reduce_cython__", "__setstate_cython__", "__test__"]
    (tmp_path / "allowlist.txt").write_text("".join(f"aps._core.{name}\n" for name in cython))
    proc = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "aps._core", "--concise",
         "--mypy-config-file", "mypy.ini", "--allowlist", "allowlist.txt"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "MYPYPATH": str(tmp_path / "stubs")},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
