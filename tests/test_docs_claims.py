"""The docs' claims checked against the code, one test per kind of drift (issue 38, items 6-9).

test_docs.py checks that links resolve and that modules named ``gradientflow.x.y`` exist; these read what
the pages *say* the code does and check it:

- error types: every exception or warning class a page names exists, and is raised by the package;
  docs/compatibility.md's argument table (and its rows on ``register_comm_hook``), run: what it says
  raises ``ValueError`` does, what it says is accepted or supported is;
- exit codes: every "exits N" / "exit status N" of a command is that command's;
- names: every function or class docs/architecture.md names is defined in the package;
- tests named as evidence (``test_x.py::test_y``) exist;
- messages: a path or section a message of the package cites (``docs/x.md#y``, ``README 'Section'``)
  exists.
"""

from __future__ import annotations

import ast
import builtins
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from test_docs import DOCS, PACKAGE, PAGES, README, ROOT, _anchors, _definitions, _prose

from _dist import run_distributed

# Exception types a page may name although the package raises none itself, and why.
RAISED_ELSEWHERE = {
    "AttributeError": "torch-ddp-suite.md says a case raises none (a claim about its absence)",
    "ModuleNotFoundError": "Python's, when an extra is not installed",
}


def _raised_by_package() -> set[str]:
    """Every exception class the package raises (``raise X(...)``, ``raise X``) or warns with."""
    out: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            target: Any = None
            if isinstance(node, ast.Raise) and node.exc is not None:
                target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "warn" and len(node.args) > 1:
                target = node.args[1]
            elif isinstance(node, ast.keyword) and node.arg == "category":
                target = node.value
            if isinstance(target, ast.Name):
                out.add(target.id)
            elif isinstance(target, ast.Attribute):
                out.add(target.attr)
    return out


def test_every_error_type_a_page_names_exists_and_is_raised() -> None:
    defined = _definitions()
    raised = _raised_by_package()
    wrong = []
    for page in PAGES:
        for name in sorted(set(re.findall(r"`(\w+(?:Error|Warning|Exception))`", page.read_text()))):
            if not hasattr(builtins, name) and name not in defined:
                wrong.append(f"{page.name}: `{name}` is not a class of the package or of Python")
            elif (
                name not in raised
                and name not in RAISED_ELSEWHERE
                and not (defined.get(name) and _subclass_raised(name))
            ):
                wrong.append(f"{page.name}: `{name}` is named, but the package never raises it")
    assert not wrong, "\n".join(wrong)


def _subclass_raised(name: str) -> bool:
    """A class of the package that the package raises, or whose subclass it raises."""
    raised = _raised_by_package()
    if name in raised:
        return True
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name in raised:
                if any(getattr(b, "id", getattr(b, "attr", "")) == name for b in node.bases):
                    return True
    return False


# ---- docs/compatibility.md's argument table, run --------------------------------------------
# A value of each torch DDP argument that is not its default (the row says what that value does).
NON_DEFAULT = {
    "mixed_precision": object(),
    "delay_all_reduce_named_params": [],
    "param_to_hook_all_reduce": object(),
    "check_reduction": True,
    "skip_all_reduce_unused_params": True,
    "batched_grad_copy": True,
    "gradient_as_bucket_view": True,
    "dim": 1,
    "bucket_cap_mb_list": [1, 2],
    "bucket_cap_mb": -1,
}


def _argument_claims() -> list[tuple[str, str]]:
    """(argument, "raises" or "accepted") for each row of compatibility.md's argument table that says so."""
    text = (DOCS / "compatibility.md").read_text()
    table = text[text.index("| argument | here |") :].split("\n\n")[0].splitlines()[2:]
    claims = []
    for row in table:
        args, here = (c.strip() for c in row.strip().strip("|").split("|", 1))
        verdict = "raises" if here.startswith("`ValueError`") else "accepted" if here.startswith("accepted") else ""
        if not verdict and "recorded" in here.split(";")[0]:
            verdict = "accepted"
        claims += [(a, verdict) for a in re.findall(r"`(\w+)`", args) if verdict]
    # a cell that says how a bad value is refused: "a bad value raises `ValueError` naming `bucket_cap_mb`"
    for arg in re.findall(r"a bad value raises `ValueError` naming `(\w+)`", text):
        claims.append((arg, "raises"))
    return claims


def _method_claims() -> list[tuple[str, str]]:
    """(method, "accepted" or "raises") for the rows of compatibility.md's behaviour table about a method
    of :data:`METHOD_CALLS`: "supported ..." or a status cell that starts with an error type."""
    text = (DOCS / "compatibility.md").read_text()
    lines = text[text.index("| behaviour | status |") :].splitlines()[2:]
    claims = []
    for row in lines[: next((i for i, line in enumerate(lines) if not line.startswith("|")), len(lines))]:
        what, status, _ = (c.strip() for c in row.strip().strip("|").split("|", 2))
        verdict = "accepted" if status.startswith("supported") else "raises" if re.match(r"`\w+Error`", status) else ""
        claims += [(m, verdict) for m in re.findall(r"`(\w+)`", what) if m in METHOD_CALLS and verdict]
    return claims


METHOD_CALLS = {"register_comm_hook": "register_comm_hook"}
"""Methods whose documented status the worker checks: each is called as a user would (torch's allreduce hook)."""


def _arguments_worker(rank: int, world: int, claims: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    import torch
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    import gradientflow as gf

    out = []
    for arg, _ in claims:
        net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        try:
            if arg in METHOD_CALLS:
                model = gf.DistributedDataParallel(net)
                getattr(model, METHOD_CALLS[arg])(None, allreduce_hook)
                model(torch.randn(2, 4)).sum().backward()
            else:
                gf.DistributedDataParallel(net, **{arg: NON_DEFAULT[arg]})
            out.append((arg, "accepted", ""))
        except (ValueError, NotImplementedError) as exc:
            out.append((arg, "raises", str(exc)))
    return out


def test_compatibility_argument_table_is_what_the_constructor_does() -> None:
    claims = _argument_claims() + _method_claims()
    assert "register_comm_hook" in {a for a, _ in claims}
    assert {"mixed_precision", "check_reduction", "bucket_cap_mb_list"} <= {a for a, _ in claims}  # the table was read
    missing = sorted({a for a, _ in claims} - set(NON_DEFAULT) - set(METHOD_CALLS))
    assert not missing, f"compatibility.md makes a claim about {missing}: give each a value in NON_DEFAULT"
    (results,) = run_distributed(_arguments_worker, 1, claims, timeout=120)
    wrong = [
        f"`{arg}`: compatibility.md says {said}, the constructor {did}" + (f" ({msg})" if msg else "")
        for (arg, said), (_, did, msg) in zip(claims, results)
        if said != did
    ]
    assert not wrong, "\n".join(wrong)
    for arg, did, msg in results:
        if did == "raises" and arg not in METHOD_CALLS:  # the message names the argument the user passed
            assert arg in msg, (arg, msg)


# ---- exit codes --------------------------------------------------------------------------------
EXIT_CLAIM = re.compile(r"`gradientflow ([\w-]+)[^`]*`[^\n]*?exit(?:s| status| code) (\d+)")


def _bad_trace(tmp: Path) -> list[str]:
    bad = tmp / "not-a-trace.json"
    bad.write_text("this is not JSON {")
    return ["trace-summary", str(bad)]


def _without_expecttest(tmp: Path) -> list[str]:
    """torch-suite where expecttest cannot be imported (``sys.modules[name] = None`` makes every import of it
    raise ImportError; undone by the test's monkeypatch)."""
    sys.modules["expecttest"] = None  # type: ignore[assignment]
    return ["torch-suite", "--out", str(tmp / "suite")]


# The failing case each command's claim is about, as argv; a claim about another command needs one here.
EXIT_CASES = {"trace-summary": _bad_trace, "torch-suite": _without_expecttest}


def _exit_claims() -> list[tuple[str, str, int]]:
    found = []
    for page in PAGES:
        for line in page.read_text().splitlines():
            found += [(page.name, m[1], int(m[2])) for m in EXIT_CLAIM.finditer(line)]
    return sorted(set(found))


def test_every_documented_exit_code_is_the_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gradientflow.cli import main

    monkeypatch.setitem(sys.modules, "expecttest", sys.modules.get("expecttest"))  # restored after the test

    claims = _exit_claims()
    assert {(p, c) for p, c, _ in claims} >= {("diagnostics.md", "trace-summary"), ("architecture.md", "trace-summary")}
    for page, command, code in claims:
        assert command in EXIT_CASES, f"{page} claims `gradientflow {command}` exits {code}: add its case to EXIT_CASES"
        got = main(EXIT_CASES[command](tmp_path))
        assert got == code, f"{page} says `gradientflow {command}` exits {code} there; it exits {got}"


# ---- names in docs/architecture.md ----------------------------------------------------------
def test_every_function_and_class_architecture_md_names_is_defined() -> None:
    """A backticked name that reads as code (``snake_case_with_underscores`` or ``CamelCase``) in the layer
    table or the strategy section is defined somewhere in the package (a renamed function leaves it stale)."""
    text = (DOCS / "architecture.md").read_text()
    defined = _definitions()
    import dataclasses

    from gradientflow import GradientFlowConfig

    vocabulary = {f.name for f in dataclasses.fields(GradientFlowConfig)} | _parameters() | set(dir(builtins))
    vocabulary |= set(CLIENTS_NAMES)
    names = set(re.findall(r"`([A-Za-z_]\w*)(?:\(\))?`", text))
    code_like = {n for n in names if re.fullmatch(r"_?[a-z]+(?:_[a-z0-9]+)+|[A-Z][a-z]+(?:[A-Z][a-z0-9]*)+", n)}
    torch_names = {n for n in code_like if _is_torchs(n)}
    stale = sorted(code_like - set(defined) - vocabulary - torch_names)
    assert not stale, f"docs/architecture.md names {stale}, defined nowhere in the package"


CLIENTS_NAMES = {
    "save_state": "accelerate's Accelerator method",
    "load_state": "accelerate's Accelerator method",
    "pytorch_lightning": "Lightning's package (not installed here)",
    "ModelParallelStrategy": "Lightning's FSDP2 strategy",
    "configure_model": "Lightning's LightningModule hook",
}
"""Names of the libraries gradientflow integrates with, named as theirs by the page."""


def _parameters() -> set[str]:
    """The parameter names of the package's functions (the page names some: the reducer's ``make_sync``)."""
    out: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out |= {a.arg for a in [*node.args.args, *node.args.kwonlyargs]}
    return out


def _is_torchs(name: str) -> bool:
    """torch DDP's own arguments, methods and attributes, and torch's classes (the page names them as such)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    init = DistributedDataParallel.__init__.__code__.co_varnames
    return (
        hasattr(DistributedDataParallel, name)
        or name in init
        or any(hasattr(m, name) for m in (torch, torch.nn, dist, torch.optim, torch.amp))
    )


# ---- tests named as evidence ---------------------------------------------------------------
def test_every_test_a_page_cites_exists() -> None:
    tests = {p.name: p for p in (ROOT / "tests").rglob("test_*.py")}
    missing = []
    for page in PAGES:
        for file, name in re.findall(r"`(?:[\w/]*/)?(test_\w+\.py)::(test_\w+)", page.read_text()):
            path = tests.get(file)
            if path is None or not re.search(rf"^def {name}\(", path.read_text(), re.M):
                missing.append(f"{page.name}: {file}::{name}")
    assert not missing, f"tests the docs cite that do not exist: {missing}"


# ---- what messages of the package cite -------------------------------------------------------
def _message_strings(path: Path) -> list[str]:
    """The string constants of a module that are not docstrings (messages, help texts, f-string parts)."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            docstrings.add(id(node.value))  # an attribute's docstring
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            out.append(node.value)
    return out


def _message_citations() -> list[tuple[str, str]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(ROOT))
        for text in _message_strings(path):
            out += [(where, m) for m in re.findall(r"docs/[\w.-]+\.md(?:#[\w-]+)?", text)]
            out += [(where, m) for m in re.findall(r"README(?!\.md)\b[^.\n]{0,40}", text)]  # README.md: a path
    return out


def test_every_page_and_section_a_message_cites_exists() -> None:
    wrong = []
    readme_sections = {h.strip() for h in re.findall(r"^## (.+)$", _prose(README), re.M)}
    for where, cited in _message_citations():
        if cited.startswith("docs/"):
            file, _, anchor = cited.partition("#")
            if not (ROOT / file).exists():
                wrong.append(f"{where}: {cited}: no such page")
            elif anchor and anchor not in _anchors(ROOT / file):
                wrong.append(f"{where}: {cited}: no such section")
            continue
        section = re.match(r"README,? ['\"]([^'\"]+)['\"]", cited)
        if section is None or section[1] not in readme_sections:
            wrong.append(f"{where}: cites {cited!r}: cite a docs/ page (and its #section) or a README section by name")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("sample", ["See README 'Cost model'.", "(README, Quality: x)", "docs/nowhere.md"])
def test_the_message_check_catches_a_stale_citation(sample: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above, on the kinds of citation issue 38 found stale."""
    monkeypatch.setattr(__import__(__name__), "_message_strings", lambda path: [sample])
    with pytest.raises(AssertionError):
        test_every_page_and_section_a_message_cites_exists()


# ---- examples/train_ddp.py: what the README says about it -------------------------------------
# Lines of the example that are not the DDP tutorial's own, each with the words the README must use for it.
EXAMPLE_WORKAROUNDS = {"dist.PrefixStore(": "PrefixStore", "import torch.distributed.nn": "import torch.distributed.nn"}


def test_the_examples_extra_lines_are_explained_and_no_option_is_hidden() -> None:
    """README: "the only line that changes is the import". gradientflow's options come only from the
    flags that name them (no ``chunk_size`` of its own: ``"auto"`` serves), and each workaround line the
    script keeps is one the README explains."""
    script = (ROOT / "examples" / "train_ddp.py").read_text()
    readme = README.read_text()
    assert "the only line that changes is the import" in readme
    assert "chunk_size" not in script, "the example passes chunk_size: the README says only the import changes"
    flags = r'flags = \{"compression": args\.compression, "density": args\.density, "comm_dtype": args\.comm_dtype\}'
    flags += r'\n    flags\["sync_every"\] = args\.sync_every\n'
    assert re.search(flags, script), script
    for line, words in EXAMPLE_WORKAROUNDS.items():
        if line in script:
            assert words in readme, f"examples/train_ddp.py has {line!r}; the README does not say why"
