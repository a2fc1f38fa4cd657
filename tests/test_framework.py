"""The pass framework and the public API: config, registry, composite pass, optimize(), report()."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from helpers import FAST, optimize_fresh, row, tokens

import nsa_compile
from nsa_compile.config import OptimizeConfig
from nsa_compile.models import build_model
from nsa_compile.pass_manager import NSAGraphPass, OptimizeState


# the built-in passes in the order they run
ALL_PASSES = ("canonicalize", "projection_rope", "window_attention", "compressed_attention", "select_blocks",
              "selected_attention", "gated_combine", "gqa_grouped_matmul", "compress_pooling",
              "query_chunks")


def test_public_surface():
    assert sorted(nsa_compile.__all__) == sorted(
        ["optimize", "report", "OptimizeConfig", "pass_names", "register_pass", "unregister_pass",
         "RewritePass", "PassContext", "PassLog"]
    )
    assert nsa_compile.pass_names() == ALL_PASSES


def test_config_is_frozen_and_validates_names():
    config = OptimizeConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.compiler = "eager"
    valid = "valid: " + ", ".join(ALL_PASSES)
    with pytest.raises(ValueError, match=f"unknown pass name.*'nope'.*{valid}"):
        OptimizeConfig(disabled_passes=("nope",))
    with pytest.raises(ValueError, match="unknown compiler 'tvm'; valid: inductor, aot_eager, eager"):
        OptimizeConfig(compiler="tvm")
    with pytest.raises(TypeError, match="tuple of pass names"):
        OptimizeConfig(disabled_passes="gqa_grouped_matmul")
    assert OptimizeConfig(disabled_passes=["gqa_grouped_matmul"]).disabled_passes == ("gqa_grouped_matmul",)
    with pytest.raises(ValueError, match="unknown window_attention_backend 'fa3'; valid: auto, triton, flash, reference"):
        OptimizeConfig(window_attention_backend="fa3")
    with pytest.raises(ValueError, match="unknown selected_attention_backend 'fa3'; valid: auto, triton, reference, varlen, "
                                         "varlen_flash_attn"):
        OptimizeConfig(selected_attention_backend="fa3")
    # the backends change the rewritten graph: they are part of the cache key
    assert OptimizeConfig(window_attention_backend="reference").cache_key() != OptimizeConfig().cache_key()


def test_optimize_rejects_bad_arguments():
    with pytest.raises(TypeError, match="nn.Module"):
        nsa_compile.optimize(lambda x: x)
    with pytest.raises(TypeError, match="OptimizeConfig"):
        nsa_compile.optimize(torch.nn.Linear(2, 2), {"compiler": "eager"})
    with pytest.raises(ValueError, match="not passed through nsa_compile.optimize"):
        nsa_compile.report(torch.nn.Linear(2, 2))


def test_state_dict_and_parameters_are_the_originals():
    model = build_model("tiny")
    keys = list(model.state_dict())
    params = list(model.parameters())
    optimized = optimize_fresh(model)
    assert optimized is model
    assert list(optimized.state_dict()) == keys
    assert all(a is b for a, b in zip(optimized.parameters(), params))
    # an optimizer built on the original parameters trains the optimized model
    opt = torch.optim.SGD(params, lr=0.5)
    batch = tokens(1, 40)
    before = optimized.loss(batch)
    before.backward()
    opt.step()
    after = optimized.loss(batch)
    assert after.item() < before.item()


def test_report_before_and_after_the_first_forward():
    model = optimize_fresh(build_model("tiny"))
    rows = nsa_compile.report(model)
    assert [(r["name"], r["matches"], r["graphs"]) for r in rows] == [(name, 0, 0) for name in ALL_PASSES]
    model.loss(tokens(1, 40)).backward()
    r = row(model, "window_attention")
    assert set(r) >= {"name", "matches", "where", "time_ms"}
    assert r["time_ms"] > 0
    # the reference model is in the normal form (nothing to canonicalize); every NSA structure of
    # both layers is rewritten, so no K/V copy is left for the GQA pass
    assert [row(model, name)["matches"] for name in ALL_PASSES] == [0, 2, 2, 2, 2, 2, 2, 0, 0, 0]


def test_reoptimize_replaces_the_record():
    model = optimize_fresh(build_model("tiny"))
    model(tokens(1, 20)[:, :-1])
    nsa_compile.optimize(model, FAST.replace(disabled_passes=ALL_PASSES))
    assert nsa_compile.report(model) == []


def _tiny_graph() -> fx.Graph:
    return fx.symbolic_trace(lambda x: x + 1).graph


def test_composite_pass_chains_the_installed_pass_and_keys_the_cache():
    calls = []

    class Installed:
        def __call__(self, graph):
            calls.append(graph)

        def uuid(self):
            return "installed-v1"

    state = OptimizeState.for_config(FAST)
    composite = NSAGraphPass(state, chained=Installed())
    graph = _tiny_graph()
    composite(graph)
    assert calls == [graph]
    assert len(state.graphs) == 1 and tuple(log.pass_name for log in state.graphs[0].logs) == ALL_PASSES

    uuid = composite.uuid()
    assert "installed-v1" in uuid
    assert NSAGraphPass(state, chained=Installed()).uuid() == uuid  # stable
    other = OptimizeState.for_config(FAST.replace(compiler="inductor"))
    assert NSAGraphPass(other, chained=Installed()).uuid() != uuid  # options enter the key
    fewer = OptimizeState.for_config(FAST.replace(disabled_passes=("gqa_grouped_matmul",)))
    assert NSAGraphPass(fewer).uuid() != NSAGraphPass(state).uuid()  # enabled passes enter the key
    # a plain function installed before us cannot be keyed: no caching rather than stale code
    assert NSAGraphPass(state, chained=lambda g: None).uuid() is None


def test_uuid_covers_pass_sources(tmp_path, monkeypatch):
    gqa_alone = tuple(name for name in ALL_PASSES if name != "gqa_grouped_matmul")
    state = OptimizeState.for_config(FAST.replace(disabled_passes=gqa_alone))
    before = NSAGraphPass(state).uuid()
    (p,) = state.passes
    copy = tmp_path / "gqa_copy.py"
    copy.write_text(open(p.source_files()[0]).read() + "\n# changed\n")
    monkeypatch.setattr(type(p), "source_files", lambda self: (str(copy),))
    assert NSAGraphPass(state).uuid() != before


def test_inductor_hook_is_set_per_compile_not_globally():
    from torch._inductor import config as inductor_config

    assert inductor_config.pre_grad_custom_pass is None
    model = optimize_fresh(build_model("tiny"), OptimizeConfig(compiler="eager"))
    model(tokens(1, 20)[:, :-1])
    assert inductor_config.pre_grad_custom_pass is None


class AddOne(torch.nn.Module):
    def forward(self, x):
        return x + 1


def test_user_pass_registration_round_trip():
    class CountAdds(nsa_compile.RewritePass):
        name = "user_count_adds"
        summary = "counts additions, rewrites nothing"

        def apply(self, graph, ctx):
            for node in graph.nodes:
                if node.op == "call_function" and getattr(node.target, "__name__", "") == "add":
                    ctx.refused(node, "an add is not attention")

    p = nsa_compile.register_pass(CountAdds())
    try:
        assert nsa_compile.pass_names()[-1] == "user_count_adds"
        with pytest.raises(ValueError, match="already registered"):
            nsa_compile.register_pass(CountAdds())
        model = optimize_fresh(AddOne())
        assert torch.equal(model(torch.ones(2)), torch.full((2,), 2.0))
        r = row(model, "user_count_adds")
        assert (r["matches"], r["refused"], r["reasons"]) == (0, 1, ["an add is not attention"])
    finally:
        nsa_compile.unregister_pass(p.name)
    assert "user_count_adds" not in nsa_compile.pass_names()
    with pytest.raises(ValueError, match="family word"):
        bad = CountAdds()
        bad.name = "count_adds"
        nsa_compile.register_pass(bad)


def test_wheel_installs_namespaced_packages_only(tmp_path):
    """pip install . (non-editable) ships nsa_compile.passes / nsa_compile.models, no bare ones."""
    repo = __import__("pathlib").Path(__file__).resolve().parents[1]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(repo)],
        check=True,
    )
    (wheel,) = tmp_path.glob("nsa_compile-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.startswith("nsa_compile-")}
    assert tops == {"nsa_compile"}
    assert "nsa_compile/passes/gqa_grouped_matmul.py" in names
    assert "nsa_compile/models/nsa.py" in names
    assert "nsa_compile/cli.py" in names
    assert "nsa_compile/ops/window.py" in names


def test_readme_setup_block_holds_the_two_commands_ci_runs():
    """.ci/run reads the install and test commands from this block: keep it whole."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("```sh setup\n", 1)[1].split("```", 1)[0].splitlines()
    assert block == ["pip install torch==2.13.0 -e '.[test]' && nsa-compile demo", "pytest"]
    for heading in ("## Set-up", "## Command line", "## Passes", "## Configuration", "## Layout"):
        assert readme.count(heading + "\n") == 1, heading


def test_uuid_covers_the_shared_matchers_and_the_ops(tmp_path, monkeypatch):
    """The passes read nsa_compile/attention_match.py, fx.py and the ops' backend checks: an edit
    there changes the rewritten graph, so it must change the cache key."""
    from nsa_compile import pass_manager

    state = OptimizeState.for_config(FAST)
    before = NSAGraphPass(state).uuid()
    names = {Path(f).name for f in pass_manager.SUPPORT_FILES}
    assert {"attention_match.py", "fx.py", "window.py", "selection.py", "flash.py"} <= names
    copy = tmp_path / "attention_match.py"
    copy.write_text(Path(pass_manager.SUPPORT_FILES[0]).read_text() + "\n# changed\n")
    monkeypatch.setattr(pass_manager, "SUPPORT_FILES", (str(copy), *pass_manager.SUPPORT_FILES[1:]))
    assert NSAGraphPass(state).uuid() != before


# --- the package's import graph ------------------------------------------------------------------


def package_imports() -> "nx.DiGraph":
    """Module -> module edges of every import in nsa_compile (passes/ and models/ as the
    nsa_compile.passes / nsa_compile.models they install as), imports inside functions included,
    those under `if TYPE_CHECKING:` left out (they never run). `from pkg import sub` of a
    submodule is an edge to the submodule."""
    import ast
    from pathlib import Path

    import networkx as nx

    root = Path(__file__).resolve().parents[1]
    files = {}
    for folder, package in (("nsa_compile", "nsa_compile"), ("passes", "nsa_compile.passes"),
                            ("models", "nsa_compile.models")):
        for f in (root / folder).rglob("*.py"):
            parts = [package, *f.relative_to(root / folder).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            files[".".join(parts[:-1] if is_package else parts)] = (f, is_package)
    graph = nx.DiGraph()
    for name, (f, is_package) in files.items():
        tree = ast.parse(f.read_text())
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for b in node.body for n in ast.walk(b)}
        here = name if is_package else name.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = here.split(".")[: len(here.split(".")) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                subs = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in files]
                targets = subs if len(subs) == len(node.names) else [module, *subs]
            else:
                continue
            graph.add_edges_from((name, t) for t in targets if t in files and t != name)
    return graph


def test_the_package_has_no_import_cycle():
    import networkx as nx

    graph = package_imports()
    assert graph.number_of_edges() > 50  # the walk found the package's imports
    assert ("nsa_compile.pass_manager", "nsa_compile.rewrite") in graph.edges
    assert list(nx.simple_cycles(graph)) == []


def test_tests_import_the_installed_package_only():
    """passes/ and models/ install as nsa_compile.passes and nsa_compile.models: a test that
    imports them as top-level `passes` or `models` works only where the repository root is on
    sys.path (`python -m pytest`), not under the README's `pytest`, and loads a second copy."""
    import ast
    from pathlib import Path

    wrong = []
    for f in sorted(Path(__file__).resolve().parent.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            wrong += [f"{f.name}:{node.lineno} {n}" for n in names if n.split(".")[0] in ("passes", "models")]
    assert wrong == []


def test_the_earlier_field_and_pass_names_still_work_with_a_deprecation_warning():
    """One name per concept (issue 21.4): backend fields and pass names are the op's now; the earlier
    names map to them for one release, with a DeprecationWarning, and naming both differently fails."""
    from nsa_compile.config import RENAMED_FIELDS, RENAMED_PASSES

    for old, new in RENAMED_FIELDS.items():
        with pytest.warns(DeprecationWarning, match=f"{old}=.*deprecated.*{new}"):
            config = nsa_compile.OptimizeConfig(**{old: "reference"})
        assert getattr(config, new) == "reference"
        assert config.replace(compiler="aot_eager") == config.replace(compiler="aot_eager")
        with pytest.raises(ValueError, match="name one field twice"), pytest.warns(DeprecationWarning):
            nsa_compile.OptimizeConfig(**{old: "reference", new: "triton"})
    for old, new in RENAMED_PASSES.items():
        assert new in nsa_compile.pass_names() and old not in nsa_compile.pass_names()
        with pytest.warns(DeprecationWarning, match=f"{old!r} is {new!r} now"):
            assert nsa_compile.OptimizeConfig(disabled_passes=(old,)).disabled_passes == (new,)
    fields = {f.name for f in dataclasses.fields(nsa_compile.OptimizeConfig)}
    assert {f"{op}_backend" for op in ("window_attention", "selected_attention", "compressed_attention",
                                       "select_blocks", "gated_combine", "projection_rope")} <= fields
    assert not set(RENAMED_FIELDS) & fields  # the old names are no fields (asdict, cache_key skip them)
