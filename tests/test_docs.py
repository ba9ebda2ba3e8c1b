"""The documentation a reader of the repository walks through: README.md (a landing page) and docs/.

Every relative link resolves (file, and heading anchor where one is given), the README stays short and
reaches every page, every ``gradientflow.x.y`` name the pages mention exists, and the layering that
docs/architecture.md states is the one the code's imports follow.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import itertools
import re
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
RESULTS = DOCS / "results"
"""The lab record: the dated measurements with their commands, linked from the user pages (docs/*.md)."""
PACKAGE = ROOT / "src" / "gradientflow"

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _prose(path: Path) -> str:
    """The page without its fenced code blocks (a ``[x](y)`` in code is not a link)."""
    return FENCE.sub("", path.read_text())


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters of any script, digits,
    ``_`` and ``-`` stay), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#+ (.+)$", _prose(path), re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")  # GitHub numbers repeated headings
    return out


def _relative_links(path: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(path)) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in _relative_links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_readme_reaches_every_user_page_and_the_record_reaches_every_result() -> None:
    """README links every page of docs/ and the record's index; the index links every page of the record."""
    linked = {Path(t.partition("#")[0]).as_posix() for t in _relative_links(README) if t.startswith("docs/")}
    pages = {p.relative_to(ROOT).as_posix() for p in DOCS.glob("*.md")} | {"docs/results/README.md"}
    assert pages <= linked, f"docs/ pages the README does not link: {sorted(pages - linked)}"
    index = RESULTS / "README.md"
    in_index = {Path(t.partition("#")[0]).name for t in _relative_links(index)}
    results = {p.name for p in RESULTS.glob("*.md")} - {"README.md"}
    assert results <= in_index, f"docs/results/ pages its README does not link: {sorted(results - in_index)}"


def _decision_table(text: str | None = None) -> list[dict[str, str]]:
    """The README's decision table (the table under "## Which recipe"): one dict per row, by the header's names
    (``text``: another copy of the README, for the checker's own tests)."""
    text = README.read_text() if text is None else text
    start = text.index("## Which recipe")
    lines = text[start:].splitlines()[1:]
    first = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    table = [ln for ln in itertools.takewhile(lambda ln: ln.startswith("|"), lines[first:])]
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in table]
    header = [h.split(" (")[0] for h in rows[0]]  # "measured (2 ranks unless said)" -> "measured"
    return [dict(zip(header, r, strict=True)) for r in rows[2:]]  # after the header and its rule


# ---- the decision table's situation columns: a controlled vocabulary, every cell parsed ----------------------------
# A newcomer's situation is (optimizer, link between machines, machines, parallelism, run length); each of those five
# columns of the README's table says, in the phrases below only, which situations its row is for. A phrase outside
# them is an error (UnknownPhrase), never a silent non-match.

OPTIMIZERS = ("SGD", "Adam", "AdamW")
MACHINES = ("one machine", "one rank per machine", "nodes of several GPUs")
SEVERAL_MACHINES = "several machines"
"""One rank per machine, or nodes of several GPUs."""
PARALLELISMS = ("DDP", "FSDP2 sharded inside each node (HSDP)")
ANY = "any"
SITUATION_COLUMNS = ("optimizer", "link between machines", "machines", "parallelism", "run")


class UnknownPhrase(ValueError):
    """A cell of the decision table's situation columns outside the vocabulary."""


@dataclasses.dataclass(frozen=True)
class Situation:
    optimizer: str
    link_mbit: float | None
    """The slowest link between machines, Mbit/s; None on one machine."""
    machines: str
    parallelism: str
    steps: int


def _names(cell: str, known: tuple[str, ...], column: str, union: dict[str, tuple[str, ...]] | None = None) -> set:
    """``"any"``, or a comma-separated list of known names (and named unions of them)."""
    if cell == ANY:
        return set(known)
    out: set[str] = set()
    for name in cell.split(", "):
        if name in known:
            out.add(name)
        elif union and name in union:
            out |= set(union[name])
        else:
            raise UnknownPhrase(
                f"{column}: {name!r} (known: {ANY!r}, {', '.join(map(repr, [*known, *(union or {})]))})"
            )
    return out


def _mbit(speed: str) -> float:
    """``"100 Mbit/s"`` -> 100, ``"10 Gbit/s"`` -> 10000."""
    match = re.fullmatch(r"([\d,.]+) ([MG])bit/s", speed)
    if match is None:
        raise UnknownPhrase(f"link between machines: {speed!r} is no speed (e.g. '100 Mbit/s', '10 Gbit/s')")
    return float(match[1].replace(",", "")) * (1000 if match[2] == "G" else 1)


def _link(cell: str) -> Any:
    """``"none"`` (one machine), ``"up to X"``, ``"over X, up to Y"``: a predicate on the link's Mbit/s."""
    if cell == "none":
        return lambda mbit: mbit is None
    match = re.fullmatch(r"(?:over (.+), )?up to (.+)", cell)
    if match is None:
        raise UnknownPhrase(f"link between machines: {cell!r} (known: 'none', 'up to X', 'over X, up to Y')")
    low, high = _mbit(match[1]) if match[1] else 0.0, _mbit(match[2])
    return lambda mbit: mbit is not None and low < mbit <= high


def _run(cell: str) -> Any:
    """``"any"``, ``"up to N steps"``, ``"over N steps"``: a predicate on the run's optimizer steps."""
    if cell == ANY:
        return lambda steps: True
    match = re.fullmatch(r"(up to|over) ([\d,]+) steps", cell)
    if match is None:
        raise UnknownPhrase(f"run: {cell!r} (known: 'any', 'up to N steps', 'over N steps')")
    n = int(match[2].replace(",", ""))
    return (lambda steps: steps <= n) if match[1] == "up to" else (lambda steps: steps > n)


def _row_holds(row: dict[str, str]) -> Any:
    """The predicate on situations of one row, every situation cell parsed (UnknownPhrase otherwise)."""
    optimizers = _names(row["optimizer"], OPTIMIZERS, "optimizer")
    link = _link(row["link between machines"])
    several = {SEVERAL_MACHINES: MACHINES[1:]}
    machines = _names(row["machines"], MACHINES, "machines", several)
    parallelisms = _names(row["parallelism"], PARALLELISMS, "parallelism")
    run = _run(row["run"])
    return lambda s: (
        s.optimizer in optimizers
        and link(s.link_mbit)
        and s.machines in machines
        and s.parallelism in parallelisms
        and run(s.steps)
    )


def _situations() -> list[Situation]:
    """The grid of newcomers' situations: every optimizer x link x machines x parallelism x run length. FSDP2 here
    is HSDP, sharded inside a node: with one rank per machine there is nothing to shard inside it (FSDP2 across
    machines is a 1-D mesh, which ``gradientflow.fsdp`` refuses: nothing between replicas to compress)."""
    links = (10, 50, 100, 101, 200, 1000, 2500, 10_000)  # Mbit/s: a slow link, the 100 Mbit/s edge, Ethernet
    layouts = [("one machine", None, p) for p in PARALLELISMS]
    layouts += [("one rank per machine", mbit, "DDP") for mbit in links]
    layouts += [("nodes of several GPUs", mbit, p) for mbit in links for p in PARALLELISMS]
    return [
        Situation(optimizer, mbit, machines, parallelism, steps)
        for optimizer in OPTIMIZERS
        for machines, mbit, parallelism in layouts
        for steps in (200, 1000, 1001, 4000, 100_000)
    ]


def _decision_problems(rows: list[dict[str, str]]) -> list[str]:
    """What is wrong with a decision table: a cell outside the vocabulary, a situation of the grid that no row or
    two rows take, a row that no situation takes. Empty: every situation maps to exactly one row."""
    problems, holds = [], []
    for i, row in enumerate(rows):
        try:
            holds.append((i, _row_holds(row)))
        except UnknownPhrase as e:
            problems.append(f"row {i + 1}: unknown phrase, {e}")
        except KeyError as e:
            problems.append(f"row {i + 1}: no column {e} (the situation columns: {', '.join(SITUATION_COLUMNS)})")
    if problems:
        return problems
    hit: set[int] = set()
    for s in _situations():
        rows_of = [i for i, h in holds if h(s)]
        hit |= set(rows_of)
        if len(rows_of) != 1:
            which = "no row" if not rows_of else "rows " + ", ".join(str(i + 1) for i in rows_of)
            problems.append(f"{which} for {s}")
    problems += [f"row {i + 1}: no situation of the grid maps to it" for i, _ in holds if i not in hit]
    return problems


def test_every_newcomers_situation_maps_to_exactly_one_row() -> None:
    """Every situation of the grid (optimizer x link x machines x parallelism x run length) falls in exactly one
    row of the README's decision table, and every row is some situation's; every situation cell is parsed."""
    problems = _decision_problems(_decision_table())
    assert not problems, f"{len(problems)} problems, the first: " + "\n".join(problems[:12])


def _pass_of(optimizer: str, link_mbit: float | None, machines: str, parallelism: str, steps: int) -> str:
    rows = _decision_table()
    (row,) = [r for r in rows if _row_holds(r)(Situation(optimizer, link_mbit, machines, parallelism, steps))]
    return row["pass"]


FSDP, NODES, FLAT = PARALLELISMS[1], MACHINES[2], MACHINES[1]


@pytest.mark.parametrize(
    ("situation", "passes"),
    [
        (("SGD", 1000, FLAT, "DDP", 400), '"topk-3bit"'),  # an SGD CNN on two machines at 1 Gbit/s
        (("AdamW", 1000, NODES, "DDP", 400), '"3bit"` between 2 nodes'),  # an AdamW transformer, 2 nodes of 2 GPUs
        (("AdamW", 1000, FLAT, "DDP", 400), '"2bit-precond"'),
        (("SGD", 100, FLAT, "DDP", 4000), "sync_every=100"),  # a slow link, a long run
        (("AdamW", 100, NODES, "DDP", 300), 'compression="auto"'),  # a slow link, a short run: per-step recipes
        (("AdamW", 1000, NODES, FSDP, 4000), '"3bit"'),
        (("AdamW", 100, NODES, FSDP, 300), '"auto"'),  # a slow link, a short run: the per-step recipe
        (("AdamW", 100, NODES, FSDP, 4000), "sync_every=100"),  # a slow link, a long run: fewer syncs behind FSDP2
        (("SGD", 10, NODES, FSDP, 4000), '"4bit"'),  # SGD's fewer syncs behind FSDP2 not measured: per step
        (("Adam", None, "one machine", "DDP", 400), 'compression="none"'),
    ],
)
def test_a_newcomers_situation_gets_its_rows_pass(situation: tuple, passes: str) -> None:
    assert passes in _pass_of(*situation)


# Mutations of the README's table, in memory: the checker must report each.
def _mutated(mutate: Any) -> list[str]:
    rows = [dict(r) for r in _decision_table()]
    mutate(rows)
    return _decision_problems(rows)


@pytest.mark.parametrize("dropped", range(len(_decision_table())))
def test_the_checker_reports_a_dropped_row(dropped: int) -> None:
    problems = _mutated(lambda rows: rows.pop(dropped))
    assert any(p.startswith("no row for") for p in problems), problems[:3]


@pytest.mark.parametrize("copied", range(len(_decision_table())))
def test_the_checker_reports_a_row_duplicated_with_another_recipe(copied: int) -> None:
    def duplicate(rows: list[dict[str, str]]) -> None:
        rows.append({**rows[copied], "pass": '`compression="fp16"`'})

    problems = _mutated(duplicate)
    assert any(re.match(rf"rows {copied + 1}, {len(_decision_table()) + 1} for", p) for p in problems), problems[:3]


@pytest.mark.parametrize(
    ("column", "cell"),
    [
        ("optimizer", "Adagrad"),
        ("optimizer", "SGD and AdamW"),
        ("link between machines", "a slow link between nodes"),
        ("link between machines", "up to 10 Gbps"),
        ("machines", "FSDP2 (HSDP), sharded inside each node"),
        ("parallelism", "HSDP"),
        ("run", "runs of thousands of steps"),
    ],
)
def test_the_checker_reports_a_phrase_outside_the_vocabulary(column: str, cell: str) -> None:
    problems = _mutated(lambda rows: rows[0].update({column: cell}))
    assert problems and all("unknown phrase" in p for p in problems), problems


def test_the_checker_reports_a_widened_row() -> None:
    """The earlier table's SGD row ("up to 10 Gbit/s") overlapped the slow-link rows: widening the SGD row back to
    it is reported, naming the rows both take."""
    problems = _mutated(lambda rows: rows[0].update({"link between machines": "up to 10 Gbit/s"}))
    assert any(p.startswith("rows 1, 4 for") for p in problems) and any(p.startswith("rows 1, 5 for") for p in problems)


def test_the_decision_tables_auto_rows_name_what_the_policy_runs() -> None:
    """A row that passes ``compression="auto"`` and says what it runs names only what the policy gives its
    optimizers through its door (:mod:`gradientflow.policy.auto_choice`): SGD under FSDP is not "topk-3bit"."""
    from gradientflow.policy import auto_choice, width

    adam = {auto_choice.ADAM_RECIPE, auto_choice.MANY_PARTIES_ADAM, width.FEWER_BITS}
    gives = {
        ("DDP", "SGD"): {auto_choice.SGD_RECIPE},
        ("DDP", "Adam"): adam,
        ("DDP", "AdamW"): adam,
        (FSDP, "SGD"): {auto_choice.FSDP_SGD_RECIPE},
        (FSDP, "Adam"): {auto_choice.adam_recipe(n) for n in (2, 3)},
        (FSDP, "AdamW"): {auto_choice.adam_recipe(n) for n in (2, 3)},
    }
    for row in _decision_table():
        runs = re.search(r"\(runs (.*)\)", row["pass"])
        if 'compression="auto"' not in row["pass"] or runs is None or "`" not in runs[1]:
            continue
        named = set(re.findall(r'`"([^"]+)"`', runs[1]))
        doors = _names(row["parallelism"], PARALLELISMS, "parallelism")
        possible = set().union(*(gives[d, o] for d in doors for o in _names(row["optimizer"], OPTIMIZERS, "optimizer")))
        assert named and named <= possible, (row["pass"], possible)


def _auto_table(text: str | None = None) -> list[dict[str, str]]:
    """docs/recipes.md's table under "## auto": one dict per row (door, optimizer, layout, runs)."""
    text = (DOCS / "recipes.md").read_text() if text is None else text
    lines = text[text.index("\n## auto\n") :].splitlines()
    table = list(
        itertools.takewhile(
            lambda ln: ln.startswith("|"), lines[next(i for i, ln in enumerate(lines) if ln.startswith("|")) :]
        )
    )
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in table]
    return [dict(zip(rows[0], r, strict=True)) for r in rows[2:]]


def _auto_problems(rows: list[dict[str, str]]) -> list[str]:
    """Where docs/recipes.md's ``"auto"`` table says other than the policy (:mod:`gradientflow.policy`) runs: for
    each row, the recipes its "runs" cell names against what the code gives that door, optimizer and layout; and a
    (door, optimizer) the table leaves out."""
    from gradientflow.policy import auto_choice, width

    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    adam = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    # (door, optimizer, layout) as the table words them -> the recipes the code runs there, and density="auto" sets
    ddp_sgd = auto_choice.recipe_for_optimizer(sgd)
    code = {
        ("`DistributedDataParallel`", "SGD (with or without momentum)", "2 ranks"): (
            {ddp_sgd},
            auto_choice.recipe_options(ddp_sgd, 2),
        ),
        ("`DistributedDataParallel`", "SGD", "more than 2 ranks, or nodes of several ranks"): (
            {ddp_sgd},
            auto_choice.recipe_options(ddp_sgd, 3),
        ),
        ("`DistributedDataParallel`", "Adam, AdamW, any other", "2 flat ranks"): (
            {width.FEWER_BITS, auto_choice.adam_recipe(2)},
            {},
        ),
        ("`DistributedDataParallel`", "Adam, AdamW, any other", "2 nodes"): ({auto_choice.adam_recipe(2)}, {}),
        ("`DistributedDataParallel`", "Adam, AdamW, any other", "more than 2 flat ranks or nodes"): (
            {auto_choice.adam_recipe(3)},
            {},
        ),
        ("`gradientflow.fsdp.fully_shard`", "SGD", "any number of nodes"): (
            {auto_choice.fsdp_recipe_for_optimizer(sgd, n) for n in (2, 3, 8)},
            {},
        ),
        ("`gradientflow.fsdp.fully_shard`", "Adam, AdamW, any other", "2 nodes"): (
            {auto_choice.fsdp_recipe_for_optimizer(adam, 2)},
            {},
        ),
        ("`gradientflow.fsdp.fully_shard`", "Adam, AdamW, any other", "more than 2 nodes"): (
            {auto_choice.fsdp_recipe_for_optimizer(adam, n) for n in (3, 8)},
            {},
        ),
    }
    problems, seen = [], set()
    for row in rows:
        key = (row["door"], row["optimizer"], row["layout"])
        if key not in code:
            problems.append(f"a row the checker does not know (door, optimizer, layout): {key}")
            continue
        seen.add(key)
        runs, options = code[key]
        named = set(re.findall(r'`"([^"]+)"`', row["runs"]))
        if named != runs:
            problems.append(f"{key}: the table says {sorted(named)}, the code runs {sorted(runs)}")
        said = dict(re.findall(r"`(\w+)=([\d.]+)`", row["runs"]))
        if {k: float(v) for k, v in said.items()} != options:
            problems.append(f"{key}: the table sets {said}, the code {options}")
    problems += [f"no row for {key}" for key in code if key not in seen]
    return problems


def test_the_recipes_page_says_what_auto_runs_through_each_door() -> None:
    """docs/recipes.md's ``"auto"`` table, every row, is what :mod:`gradientflow.policy` gives that door, optimizer
    and layout (the issue's complaint: README, recipes and results pages disagreed on FSDP's SGD pick), and no
    (door, optimizer, layout) the policy tells apart is left out; docs/fsdp.md's ``"auto"`` row names the FSDP
    picks too."""
    from gradientflow.policy import auto_choice

    problems = _auto_problems(_auto_table())
    assert not problems, "\n".join(problems)
    fsdp = next(ln for ln in (DOCS / "fsdp.md").read_text().splitlines() if ln.startswith('| `"auto"`'))
    assert f'Adam-type `"{auto_choice.adam_recipe(2)}"` on two nodes' in fsdp, fsdp
    assert f'`"{auto_choice.adam_recipe(3)}"` beyond' in fsdp and f'SGD `"{auto_choice.FSDP_SGD_RECIPE}"`' in fsdp


@pytest.mark.parametrize(
    ("row", "cell", "wrong"),
    [(5, "runs", '`"3bit"` between nodes'), (0, "runs", '`"topk-fp16"`'), (1, "runs", '`"topk-3bit"`')],
)
def test_the_auto_checker_reports_a_wrong_pick(row: int, cell: str, wrong: str) -> None:
    """The FSDP SGD row as docs/results/fsdp.md once had it ("3bit"), DDP's SGD pick before 2026-11-27, and the
    denser top-k beyond two ranks left unsaid: each reported."""
    rows = _auto_table()
    rows[row] = {**rows[row], cell: wrong}
    assert _auto_problems(rows), rows[row]


def test_the_auto_checker_reports_a_dropped_door() -> None:
    rows = [r for r in _auto_table() if "fsdp" not in r["door"]]
    assert sum(p.startswith("no row for ('`gradientflow.fsdp.fully_shard`'") for p in _auto_problems(rows)) == 3


def test_readme_decision_table_is_one_short_line_per_situation() -> None:
    """A newcomer decides in 30 seconds: no cell over 25 words, and every recipe a row passes is a row of the
    recipe table."""
    from gradientflow.recipes import NAMES

    rows = _decision_table()
    assert 4 <= len(rows) <= 10, rows
    for row in rows:
        for cell in row.values():
            assert len(cell.split()) <= 25, f"a cell of {len(cell.split())} words: {cell}"
        named = re.findall(r'compression="([^"]+)"', row["pass"]) + re.findall(r'`"([^"]+)"`', row["pass"])
        assert named and all(n in NAMES for n in named), row


def test_no_page_points_outside_the_repository() -> None:
    for page in PAGES:
        text = page.read_text()
        assert "../shared/" not in text and "DESIGN.md" not in text, f"{page.name} points outside the repository"


def test_every_named_module_and_object_exists() -> None:
    """``gradientflow.a.b`` in prose or commands: a module, or a name in one (catches paths a move left stale)."""
    missing = []
    for page in PAGES:
        for dotted in sorted(set(re.findall(r"(?<![\w/.])gradientflow(?:\.\w+)+", page.read_text()))):
            parts = dotted.split(".")
            for cut in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:cut]))
                    break
                except ModuleNotFoundError:
                    continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                missing.append(f"{page.name}: {dotted}")
    assert not missing, missing


def _layers() -> list[str]:
    """The layer order as docs/architecture.md states it (``config < diagnostics < ... < cli``)."""
    match = re.search(r"^(\w+(?: < \w+)+)$", (DOCS / "architecture.md").read_text(), re.M)
    assert match, "docs/architecture.md states no layer order"
    return match.group(1).split(" < ")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import of the package in ``path``."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            # `from . import x` / `from ..engine import comm_state`: x may be a module
            out += [(node.lineno, f"{name}.{a.name}") for a in node.names]
    return [(n, m) for n, m in out if m == "gradientflow" or m.startswith("gradientflow.")]


def test_no_module_imports_a_higher_layer() -> None:
    layers = _layers()
    assert set(layers) == {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" or p.is_dir()} - {
        "__init__",
        "__pycache__",
    }, "docs/architecture.md's layers are not the package's top-level modules"

    def layer(module: str) -> int:
        parts = module.split(".")
        # the package root re-exports the wrapper: importing it is importing the wrapper's layer
        return layers.index(parts[1]) if len(parts) > 1 and parts[1] in layers else layers.index("wrapper")

    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "__init__.py":
            continue
        here = layer(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        for line, target in _imports(path):
            if layer(target) > here:
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not upward, "imports against the layer order of docs/architecture.md:\n" + "\n".join(upward)


class _Parsed(Exception):
    """Raised in place of running a command, once its arguments parsed."""


COMMAND = re.compile(r"`((?:gradientflow|python -m gradientflow\.[\w.]+|python|torchrun) [^`]*--[^`]*)`")


def _documented_commands() -> list[str]:
    """Commands with options, as written in the pages (``mypkg``: the reader's own model, a placeholder)."""
    found = {c for page in PAGES for c in COMMAND.findall(page.read_text())}
    runnable = [c for c in found if "mypkg" not in c and "..." not in c]
    # a command, not an option named in prose (`gradientflow --help`, `torchrun --max-restarts 1`)
    return sorted(c for c in runnable if (".py" in c or " -m " in c) or not c.split()[1].startswith("-"))


def _declared_options(script: Path) -> set[str]:
    """The options a script's argparse declares: every string literal starting with ``--`` given to an
    ``add_argument`` call (read from its syntax tree, not by running it: the script imports torch)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            out |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return out


@pytest.mark.parametrize("command", _documented_commands())
def test_every_documented_command_parses(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each command's arguments are accepted by its own parser, as written (nothing is run)."""
    import argparse
    import shlex

    argv = shlex.split(command)
    if argv[0] in ("python", "torchrun") and argv[1] != "-m":  # a script: it exists and knows every option
        script = ROOT / next(a for a in argv if a.endswith(".py"))
        assert script.exists(), f"{command}: no script {script.relative_to(ROOT)}"
        options = [a for a in argv[argv.index(next(a for a in argv if a.endswith(".py"))) :] if a.startswith("--")]
        declared = _declared_options(script)
        missing = [o for o in options if o.partition("=")[0] not in declared]
        assert not missing, f"{command}: {script.name} declares no {missing} (add_argument)"
        return
    original = argparse.ArgumentParser.parse_args

    def parse_only(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    with pytest.raises(_Parsed):
        if argv[0] == "gradientflow":
            from gradientflow.cli import build_parser

            build_parser().parse_args(argv[1:])
        else:
            importlib.import_module(argv[2]).main(argv[3:])


def _architecture_rows() -> list[tuple[str, str, str]]:
    """(layer, file, description) of docs/architecture.md's layer table; a blank layer cell continues the last."""
    text = (DOCS / "architecture.md").read_text()
    lines = text[text.index("| layer | files | what lives there |") :].splitlines()[2:]
    rows, layer = [], ""
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        layer = cells[0].strip("`") or layer
        rows.append((layer, cells[1].strip("`"), cells[2]))
    return rows


def _definitions() -> dict[str, set[Path]]:
    """Every class, function, method and module-level name the package defines, with the files defining it."""
    out: dict[str, set[Path]] = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.setdefault(node.name, set()).add(path)
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for t in targets:
                if isinstance(t, ast.Name):
                    out.setdefault(t.id, set()).add(path)
    return out


def _defines_code(path: Path) -> bool:
    """Whether a module defines a function or class (a package's ``__init__.py`` that only marks the
    folder, or re-exports, needs no row of its own)."""
    return any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) for n in ast.parse(path.read_text()).body)


def test_architecture_table_is_the_package_as_it_is() -> None:
    """Every module of the per-file layers has its row, every file named exists, and every name a row
    gives to a file is defined in that file (a name that moved leaves a stale row, which fails here)."""
    rows = _architecture_rows()
    defined = _definitions()
    problems = []
    described = set()
    for layer, file, what in rows:
        folder = PACKAGE / layer.rstrip("/") if layer.endswith("/") else PACKAGE
        if file.endswith(".py"):
            path = folder / file
        elif layer.endswith(".py"):
            path = PACKAGE / layer
        else:  # a folder described in one row (bench/, sim/): the files it names exist
            for name in re.findall(r"`(\w+\.py)`", what):
                if not (folder / name).exists():
                    problems.append(f"{layer} row names {name}, which {folder.relative_to(ROOT)} does not hold")
            continue
        described.add(path)
        if not path.exists():
            problems.append(f"row {layer} {file}: no such file")
            continue
        for name in re.findall(r"`([A-Za-z_]\w*)`", what):
            if name in defined and path not in defined[name]:
                where = ", ".join(str(p.relative_to(PACKAGE)) for p in sorted(defined[name]))
                problems.append(f"row {path.relative_to(PACKAGE)} names `{name}`, defined in {where}")
    per_file = {layer for layer, file, _ in rows if file.endswith(".py") or layer.endswith(".py")}
    for layer in per_file:
        folder = PACKAGE / layer.rstrip("/")
        for path in sorted(folder.glob("*.py")) if folder.is_dir() else [PACKAGE / layer]:
            if path not in described and not (path.name == "__init__.py" and not _defines_code(path)):
                problems.append(f"{path.relative_to(ROOT)} has no row in docs/architecture.md's layer table: add one")
    assert not problems, "\n".join(problems)
