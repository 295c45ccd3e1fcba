"""Runs the examples of README.md, so that what it shows keeps working.

Which blocks run (docs/testing.md says the same):
  ```python      every block, with this test's interpreter; a block whose imports are not installed
                 FAILS, naming the module: the README's install step (`pip install ".[torch,numpy]"`)
                 must install what its examples import, and a skip would hide that it does not.
  ```sh          only a block marked `<!-- test: run -->` on the line before its fence, with bash
                 (-e, -u, pipefail); it needs the `hbmio` command on PATH or beside this
                 interpreter (where `pip install .` puts it), and is skipped otherwise.
  `<!-- test: gpu -->`          runs the block (python or sh) only where hbmio sees a CUDA device.
  `<!-- test: skip REASON -->`  skips the block, with REASON.
Each block runs in a new temporary directory holding `model.safetensors`, a small checkpoint written
by safetensors' own save_file (so it has no hbmio checksums).
"""
from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent.parent / "README.md"

_FENCE = re.compile(r"^```([A-Za-z0-9_+-]*)\s*$")
_MARK = re.compile(r"^<!--\s*test:\s*(run|gpu|skip)\b\s*(.*?)\s*-->\s*$")
_SHELLS = ("sh", "bash", "shell")
_TIMEOUT_S = 900  # the GPU block runs `hbmio bench --size 1GiB`


@dataclass
class Snippet:
    lang: str
    line: int      # of the opening fence, 1-based
    mark: str      # "run", "gpu", "skip" or "" (no marker)
    reason: str    # the text after "skip"
    code: str

    @property
    def id(self) -> str:
        return f"{self.lang}-line{self.line}"


def _snippets() -> list[Snippet]:
    lines = README.read_text(encoding="utf-8").splitlines()
    out = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        if end == len(lines):
            raise AssertionError(f"README.md:{i + 1}: a code block that is never closed")
        mark = _MARK.match(lines[i - 1]) if i > 0 else None
        out.append(Snippet(lang=fence.group(1).lower(), line=i + 1, mark=mark.group(1) if mark else "",
                           reason=mark.group(2) if mark else "", code="\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    return out


def _runnable(s: Snippet) -> bool:
    if s.lang == "python":
        return True
    return s.lang in _SHELLS and s.mark in ("run", "gpu", "skip")


SNIPPETS = [s for s in _snippets() if _runnable(s)]


def _has_gpu() -> bool:
    import hbmio
    return hbmio.cuda_device_count() > 0


def _hbmio_command() -> str | None:
    """The `hbmio` command: on PATH, else where this interpreter's packages install scripts."""
    found = shutil.which("hbmio")
    if found:
        return found
    for folder in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        candidate = Path(folder or "") / "hbmio"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def _missing_imports(code: str) -> list[str]:
    missing = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top not in missing and importlib.util.find_spec(top) is None:
                missing.append(top)
    return missing


def _sample_checkpoint(folder: Path) -> None:
    """model.safetensors as another tool writes it: safetensors' own writer, no hbmio checksums."""
    np = pytest.importorskip("numpy", reason="the sample checkpoint needs numpy")
    st = pytest.importorskip("safetensors.numpy", reason="the sample checkpoint needs safetensors")
    st.save_file({"embed.weight": np.arange(256 * 64, dtype=np.float32).reshape(256, 64),
                  "w": np.ones((1024, 1024), dtype=np.float32),
                  "bias": np.zeros(1024, dtype=np.float16)},
                 str(folder / "model.safetensors"), metadata={"format": "np"})


def _check(result: subprocess.CompletedProcess, s: Snippet) -> None:
    if result.returncode != 0:
        pytest.fail(f"README.md:{s.line}: the {s.lang} block exited with status {result.returncode}\n"
                    f"--- block ---\n{s.code}--- stdout ---\n{result.stdout}--- stderr ---\n{result.stderr}",
                    pytrace=False)


def test_readme_has_examples_to_run():
    # A broken fence or marker convention would otherwise leave nothing to test, silently.
    assert any(s.lang == "python" for s in SNIPPETS), "no ```python block found in README.md"
    assert any(s.lang in _SHELLS and s.mark == "run" for s in SNIPPETS), \
        "no ```sh block marked <!-- test: run --> found in README.md"


def test_setup_commands_come_first():
    # The README says what hbmio is and when not to use it, then gives exactly the two set-up
    # commands, before any other code and before any section.
    first = _snippets()[0]
    assert first.lang == "sh", first
    assert first.code.splitlines() == [
        "bash scripts/quickstart.sh     # install, build, run `hbmio bench` on a generated 1 GiB sample file",
        "bash scripts/test.sh           # install, build (with CUDA; without it under ASan+UBSan; under TSan) and run every test",
    ]
    before = README.read_text(encoding="utf-8").splitlines()[:first.line - 1]
    assert before[0] == "# hbmio", before[0]
    assert not any(line.startswith("## ") for line in before[1:]), "a section comes before the set-up commands"
    assert any("not" in line.lower() for line in before), "no 'when not to use it' before the set-up commands"


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.id for s in SNIPPETS])
def test_readme_snippet(snippet: Snippet, tmp_path: Path):
    if snippet.mark == "skip":
        pytest.skip(f"README.md:{snippet.line}: marked skip: {snippet.reason or 'no reason given'}")
    if snippet.mark == "gpu" and not _has_gpu():
        import hbmio
        pytest.skip(f"README.md:{snippet.line}: needs a GPU ({hbmio.cuda_unavailable_reason()})")
    env = dict(os.environ)
    if snippet.lang == "python":
        missing = _missing_imports(snippet.code)
        if missing:
            pytest.fail(f"README.md:{snippet.line}: the block imports {', '.join(missing)}, which is not installed "
                        f"in {sys.executable}; the README's install step (pip install \".[torch,numpy]\") should have "
                        "installed it: add it to that step (or to pyproject.toml's extra), or drop the import",
                        pytrace=False)
        _sample_checkpoint(tmp_path)
        script = tmp_path / "readme_snippet.py"
        script.write_text(snippet.code, encoding="utf-8")
        result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                                text=True, timeout=_TIMEOUT_S)
    else:
        command = _hbmio_command()
        if command is None:
            pytest.skip(f"README.md:{snippet.line}: needs the `hbmio` command, which is neither on PATH nor "
                        f"beside {sys.executable} (`pip install .` installs it; or put build/ on PATH)")
        env["PATH"] = os.path.dirname(command) + os.pathsep + env.get("PATH", "")
        _sample_checkpoint(tmp_path)
        script = tmp_path / "readme_snippet.sh"
        script.write_text(snippet.code, encoding="utf-8")
        result = subprocess.run(["bash", "-euo", "pipefail", str(script)], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=_TIMEOUT_S)
    _check(result, snippet)


def _install_step_distributions() -> set[str]:
    """The distributions the README's own install step puts into a fresh environment: hbmio and
    the extras its `pip install ".[extra,...]"` line names (pyproject.toml), nothing else."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        tomllib = pytest.importorskip("tomli")
    steps = [m for s in _snippets() if s.lang in _SHELLS
             for m in re.finditer(r'pip install\b[^\n#]*?["\']?\.\[([A-Za-z0-9_,-]+)\]', s.code)]
    assert steps, "README.md: no `pip install \".[...]\"` step found (the examples' install step)"
    extras = {e.strip() for m in steps for e in m.group(1).split(",")}
    project = tomllib.loads((README.parent / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    optional = project.get("optional-dependencies", {})
    unknown = extras - set(optional)
    assert not unknown, f"README.md installs extras {sorted(unknown)} that pyproject.toml does not define"
    names = {"hbmio"} | {re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0]
                          for e in extras for req in optional[e]}
    names |= {re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0] for req in project.get("dependencies", [])}
    return {n.lower().replace("_", "-") for n in names}


def test_readme_imports_come_from_its_install_step():
    # The examples run in the tests' venv, which holds more than a user's (safetensors, numpy,
    # transformers...). What a user has after the README's steps is hbmio, the standard library and
    # the distributions of the extras the install line names: every import must come from those.
    import importlib.metadata as md
    allowed = _install_step_distributions()
    owners = md.packages_distributions()
    stdlib = getattr(sys, "stdlib_module_names", frozenset())
    missing = []
    for s in SNIPPETS:
        if s.lang != "python":
            continue
        for node in ast.walk(ast.parse(s.code)):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops = [node.module.split(".")[0]]
            else:
                continue
            for top in tops:
                if top in stdlib or top == "hbmio":
                    continue
                dists = {d.lower().replace("_", "-") for d in owners.get(top, [])}
                if not dists & allowed:
                    missing.append(f"README.md:{s.line}: `{top}` (from {sorted(dists) or 'no installed distribution'})")
    assert not missing, ("imports that the README's install step does not install (installed: "
                         f"{sorted(allowed)}):\n  " + "\n  ".join(missing))
