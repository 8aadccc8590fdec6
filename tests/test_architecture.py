"""The library's structure: one folder per subsystem with the imports its layer allows, one door to the
compiled ops, no import cycle, applications apart, small classes, formats named once, quiet defaults."""
import ast
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import gapmon
from gapmon.dump.format import FORMAT_VERSION, DumpError, check_version
from gapmon.monitor.metric_names import metric_name, parse_metric_name

PACKAGE = Path(gapmon.__file__).parent


def _modules() -> dict[str, ast.Module]:
    return {str(p.relative_to(PACKAGE)): ast.parse(p.read_text()) for p in PACKAGE.rglob("*.py")}


def _imports(path: str, tree: ast.Module) -> set[str]:
    """Package-relative modules that a file imports (any depth, including function-local imports)."""
    here = Path(path).parent.parts
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = list(here[:len(here) - (node.level - 1)])
            target = base + (node.module.split(".") if node.module else [])
            names = [target + [alias.name] for alias in node.names] if not node.module else [target]
            out.update(".".join(n) for n in names)
    return out


def test_only_the_backend_calls_torch_ops_gapmon():
    callers = [path for path, tree in _modules().items()
               if any(isinstance(n, ast.Attribute) and n.attr == "gapmon" and isinstance(n.value, ast.Attribute)
                      and n.value.attr == "ops" for n in ast.walk(tree))]
    assert callers == ["stats/_backend.py"], callers


def test_import_graph_has_no_cycle_and_the_library_never_imports_apps():
    graph = {}
    for path, tree in _modules().items():
        name = path[:-3].replace("/", ".").removesuffix(".__init__")
        graph[name] = {m for m in _imports(path, tree) if m and m != name}
    library = [n for n in graph if not n.startswith("apps") and n != "__main__"]  # __main__ runs the CLI
    for name in library:
        assert not any(m.startswith("apps") for m in graph[name]), f"{name} imports the applications"
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(stack + [nxt])}")
            if nxt in graph and not state.get(nxt):
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in graph:
        if name != "" and not state.get(name):
            visit(name, [name])


# What each part of the package may import (besides itself): the layers from the op layer up. The
# top-level helpers (utils, _torch_compat) serve everyone; config holds every subsystem's options.
SUBSYSTEMS = ("stats", "monitor", "per_sample", "dump", "integrations", "apps")
HELPERS = {"utils", "_torch_compat"}
MAY_IMPORT = {
    "_torch_compat": set(),
    "utils": {"_torch_compat"},
    "stats": HELPERS | {"_C"},
    "config": HELPERS | {"stats", "monitor"},  # monitor: its sinks, to validate MonitorConfig.sinks
    "per_sample": HELPERS | {"stats", "config", "dump"},  # dump: the files of collected per-sample gradients
    "dump": HELPERS | {"stats", "config"},
    "monitor": HELPERS | {"stats", "config", "per_sample"},
    "integrations": HELPERS | {"config", "monitor", "per_sample", "dump"},
    "apps": HELPERS | {"config", "stats", "monitor", "per_sample", "dump"},
    "__init__": HELPERS | {"config", "stats", "monitor", "per_sample", "dump"},  # gapmon/__init__.py: the public names
    "__main__": {"apps"},
}


def _part(module: str) -> str:
    return module.split(".")[0]


def _boundary_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{name} imports {target}" for name, targets in graph.items() for target in targets
                  if _part(target) != _part(name) and _part(target) not in MAY_IMPORT.get(_part(name), set()))


def _import_graph() -> dict[str, set[str]]:
    graph = {}
    for path, tree in _modules().items():
        name = path[:-3].replace("/", ".").removesuffix(".__init__")
        graph[name] = {m for m in _imports(path, tree) if m != name}
    return graph


def test_the_package_is_one_folder_per_subsystem_and_the_tests_mirror_it():
    top = sorted(p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file())
    assert top == sorted(["__init__.py", "__main__.py", "_torch_compat.py", "config.py", "utils.py", *SUBSYSTEMS]), top
    tests = Path(__file__).parent
    assert all((tests / part).is_dir() and list((tests / part).glob("test_*.py")) for part in SUBSYSTEMS)
    unknown = {_part(n) for n in _import_graph()} - set(MAY_IMPORT)
    assert not unknown, f"parts of gapmon without a line in MAY_IMPORT: {unknown}"


def test_each_subsystem_imports_only_the_layers_below_it():
    assert _boundary_violations(_import_graph()) == []
    # The check finds a violation: the op layer reaching up into the monitor, or dumps into per-sample norms.
    bad = {"stats.ops": {"monitor.gap_monitor"}, "dump.dumper": {"per_sample.grad_norms", "stats.ops"}}
    assert _boundary_violations(bad) == ["dump.dumper imports per_sample.grad_norms", "stats.ops imports monitor.gap_monitor"]


def _code_lines(node: ast.ClassDef) -> int:
    """Lines of a class without its docstrings (the class's and its methods')."""
    docs = 0
    for item in [node, *[n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]]:
        first = item.body[0] if item.body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            docs += first.end_lineno - first.lineno + 1
    return node.end_lineno - node.lineno + 1 - docs


def test_no_class_does_too_many_jobs():
    """A class over 250 lines of code (docstrings aside) does several jobs: split it."""
    big = {f"{path}:{n.name}": _code_lines(n) for path, tree in _modules().items() for n in ast.walk(tree)
           if isinstance(n, ast.ClassDef) and _code_lines(n) > 250}
    assert not big, big


def test_moved_modules_are_the_same_modules_under_their_old_paths():
    import importlib

    for old, new in gapmon.MOVED_MODULES.items():
        assert importlib.import_module(f"gapmon.{old}") is importlib.import_module(f"gapmon.{new}"), old
        assert getattr(gapmon, old) is importlib.import_module(f"gapmon.{new}")
    from gapmon.reconstruct import reconstruct_gradients  # the old path of a documented function

    from gapmon.monitor import GAPMonitor
    assert GAPMonitor is gapmon.GAPMonitor and reconstruct_gradients is gapmon.reconstruct_gradients


def test_no_module_reads_another_modules_private_names():
    bad = []
    for path, tree in _modules().items():
        for node in ast.walk(tree):
            # `from ..stats import _backend` imports the private door module itself: allowed.
            if isinstance(node, ast.ImportFrom) and node.level > 0 and node.module:
                bad += [f"{path}: {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and a.name not in ("_backend", "_torch_compat")]
    assert not bad, bad


def test_no_module_reaches_private_attributes_of_others():
    """`x._y` only on self/cls; torch's private APIs only through _torch_compat.py (one place, with the
    versions they were tested on); gapmon's own private ops only in _backend.py."""
    allowed = {("stats/_backend.py", "torch.ops.gapmon._layout"), ("stats/_backend.py", "torch.ops.gapmon._cpu_isa"),
               ("apps/demo.py", "os._exit")}
    bad = []
    for path, tree in _modules().items():
        if path == "_torch_compat.py":
            continue
        own = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}  # a module's own classes: its business
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.endswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", *own):
                continue
            if (path, ast.unparse(node)) not in allowed:
                bad.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
        for node in ast.walk(tree):  # from torch.x._y import z: a private torch module
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            bad += [f"{path}:{node.lineno}: import {n}" for n in names
                    if n.startswith("torch") and any(part.startswith("_") for part in n.split("."))]
    assert not bad, bad


def test_layouts_come_from_the_extension():
    if gapmon.backend() == "torch":
        pytest.skip("needs the compiled extension")
    built = [names.split(",") for names in torch.ops.gapmon._layout()]
    assert built == [list(gapmon.STAT_NAMES), list(gapmon.stats.STATE_NAMES), list(gapmon.stats.ACC_NAMES),
                     list(gapmon.stats.NUMERICS_COLUMNS)]


def test_dump_format_versions_are_checked(tmp_path):
    check_version({"format_version": FORMAT_VERSION}, "x")
    check_version({}, "x")  # before versioning: version 1
    with pytest.raises(DumpError, match="format_version 99"):
        check_version({"format_version": 99}, "x")
    model = nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    with gapmon.GradientDumper(model, tmp_path, async_write=False) as d:
        d.maybe_dump(0)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "format_version": FORMAT_VERSION + 1}))
    with pytest.raises(DumpError, match="upgrade gapmon"):
        gapmon.reconstruct_gradients(tmp_path, 0)


def test_metric_names_round_trip():
    key = metric_name("activation_grads", "blocks.0.attn", "var")
    assert key == "gap/activation_grads/blocks.0.attn/var"
    assert parse_metric_name(key) == ("activation_grads", "blocks.0.attn", "var")
    assert parse_metric_name("gap/global_batch_size") is None
    assert parse_metric_name("gap/weights/x/var") is None


def test_monitor_writes_no_file_without_a_sink(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    with gapmon.GAPMonitor(model) as mon:
        mon.begin_step(0, batch_size=2)
        model(torch.randn(2, 3)).sum().backward()
        assert mon.end_step()
    assert os.listdir(tmp_path) == []


def test_report_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    from gapmon.apps.report import make_report

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"gapmon\[report\]"):
        make_report(tmp_path)


def test_per_sample_rules_are_one_family_per_file_and_registered():
    """Each module of gapmon/per_sample/rules/ (but base) registers the rules of one layer family, and
    every registered rule lives in one of them; the hooks (grad_norms.py, layer_hooks.py) know no layer type: a family's
    decisions (ghost vs direct, book-keeping) belong to its rule."""
    from gapmon.per_sample import rules
    from gapmon.per_sample.rules import base

    files = {p.stem for p in (PACKAGE / "per_sample" / "rules").glob("*.py")} - {"__init__", "base"}
    assert files == {m.__name__.rsplit(".", 1)[1] for m in rules.RULE_MODULES} == {
        "linear", "conv", "conv_transpose", "embedding", "normalization", "attention", "recurrent", "activation",
        "mixture_of_experts", "reparametrized"}
    registered = {m.__name__: set() for m in rules.RULE_MODULES}
    for layer, rule in base.registered_rules().items():
        module = type(rule).__module__
        assert module in registered, f"{layer.__name__}'s rule {type(rule).__name__} lives outside the rules package"
        registered[module].add(type(rule).__name__)
    # (reparametrized registers no type: it takes Linear's and the convolutions' rules back through the normalisation)
    assert all(found for module, found in registered.items() if not module.endswith(".reparametrized")), registered
    for hooks in ("grad_norms.py", "layer_hooks.py"):
        text = (PACKAGE / "per_sample" / hooks).read_text()
        for word in ("nn.Linear", "bookkeeping.", "use_ghost", "nn.Embedding", "nn.LayerNorm"):
            assert word not in text, f"per_sample/{hooks} decides for a layer family ({word}); move it to its rule"


def test_each_file_format_has_one_home_used_by_its_writer_and_reader():
    """File names, record fields, placements and dtype spellings of the dump live in dump/format.py, the
    reconstruction output's in dump/export.py, the run directory's in apps/run_format.py; writer and reader both
    go through them (no module spells a format's names itself)."""
    homes = {"dump/format.py": {"full_index.json", "COMPLETE", "config.json", "sampled.safetensors", "S(", "R", "P",
                                "torch."},
             "apps/run_format.py": {"metrics.jsonl", "train.jsonl", "per_sample_norms.jsonl", "summary.json"},
             "dump/export.py": {"_all_gradients", "_metadata.json"}}
    bad = []
    for path, tree in _modules().items():
        for home, spelled in homes.items():
            if path == home:
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in spelled:
                    bad.append(f"{path}:{node.lineno}: {node.value!r} belongs to {home}")
    assert not bad, bad
    trees = _modules()
    uses = {path: {n.id for n in ast.walk(trees[path]) if isinstance(n, ast.Name)} for path in trees}
    writer = uses["dump/dumper.py"] | uses["dump/placement.py"] | uses["dump/full_checkpoint.py"]
    for name in ("ShardRecord", "dtype_name"):
        assert name in writer and name in uses["dump/reconstruct.py"], name
    assert "full_index" in writer and "read_full_index" in uses["dump/reconstruct.py"]
    assert {"TrainRecord", "PerSampleRecord", "read_run_file"} <= uses["apps/demo.py"]
    assert "read_run_file" in uses["apps/report.py"]
    assert "write_reconstruction" not in uses["dump/reconstruct.py"]  # the export lives apart from the reader
