"""The core reaches plugins only through entry points, so each plugin package can ship alone."""

import ast
import subprocess
import sys
from pathlib import Path

import atom_core

PLUGIN_PACKAGES = {"atom_models", "atom_attention", "atom_spec"}


def test_no_core_module_imports_a_plugin_package():
    core = Path(atom_core.__file__).parent
    offenders = []
    for path in core.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in PLUGIN_PACKAGES]
    assert offenders == []
    assert len(list(core.rglob("*.py"))) >= 8  # the scan really saw the core


def test_importing_the_core_loads_no_plugin_and_no_torch():
    code = (
        "import sys, atom_core\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'atom_models', 'atom_attention', 'atom_spec', 'torch', 'transformers'}))\n"
        "from atom_core import Config, Scheduler\n"
        "Scheduler(Config(num_kvcache_blocks=4))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'atom_models', 'atom_attention', 'atom_spec', 'torch', 'transformers'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    after_import, after_scheduler = out.stdout.strip().splitlines()
    assert after_import == "[]"
    # A Scheduler looks its policy up in the registry, which reads the plugins' hook
    # modules; the plugins' models and kernels, and torch, stay unloaded.
    loaded = eval(after_scheduler)
    assert all(m.endswith(".plugin") or m in PLUGIN_PACKAGES for m in loaded), loaded
