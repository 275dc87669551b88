"""The README and the guides in docs/ stay true: every fenced block says what it holds,
every python block runs (in order, one namespace per file), every console block runs or
says why not, and every relative link resolves (file and heading)."""

import contextlib
import dataclasses
import io
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KINDS = {"python", "console", "text"}  # run, run, output / syntax / data (never run)
NOT_RUN = re.compile(r"^\s*<!-- not run: (?P<why>.*\S) -->\s*$")
CONTINUES = re.compile(r"<!-- continues: (?P<page>\S+) -->")
FENCE = re.compile(r"^(?P<indent> *)```(?P<info>.*)$")


@dataclasses.dataclass(frozen=True)
class Block:
  page: pathlib.Path
  line: int  # 1-based, of the opening fence
  kind: str
  code: str
  not_run: str | None  # the reason given, if marked

  def __str__(self):
    return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: pathlib.Path) -> list[Block]:
  lines, out, k = page.read_text().splitlines(), [], 0
  while k < len(lines):
    m = FENCE.match(lines[k])
    if not m:
      k += 1
      continue
    indent, start = m.group("indent"), k
    end = next((j for j in range(k + 1, len(lines)) if lines[j].strip() == "```"), None)
    if end is None:
      raise AssertionError(f"{page.relative_to(ROOT)}:{k + 1}: a fence that never closes")
    body = "\n".join(line[len(indent) :] for line in lines[k + 1 : end]) + "\n"
    before = next((lines[j] for j in range(k - 1, -1, -1) if lines[j].strip()), "")
    marked = NOT_RUN.match(before)
    out.append(
      Block(page, start + 1, m.group("info").strip(), body, marked.group("why") if marked else None)
    )
    k = end + 1
  return out


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]


def test_every_fence_says_what_it_holds():
  bad = [
    f"{b}: ```{b.kind} (say python, console or text)" for b in ALL_BLOCKS if b.kind not in KINDS
  ]
  assert not bad, "\n".join(bad)


def test_the_pages_hold_blocks_of_every_kind():
  assert {b.kind for b in ALL_BLOCKS} == KINDS
  assert sum(b.kind == "python" and not b.not_run for b in ALL_BLOCKS) >= 4


# ---- python: each page's blocks in order, as a reader runs them ---------------------------
def _python_pages():
  return sorted({b.page for b in ALL_BLOCKS if b.kind == "python" and not b.not_run})


def run_page(page: pathlib.Path, namespace: dict) -> dict:
  for b in blocks(page):
    if b.kind == "python" and not b.not_run:
      exec(compile(b.code, str(b), "exec"), namespace)
  return namespace


@pytest.fixture(scope="module")
def readme_namespace(tmp_path_factory):
  """The README's example, run once (the guides that continue it start from it)."""
  cwd, printed = os.getcwd(), io.StringIO()
  os.chdir(tmp_path_factory.mktemp("readme"))
  try:
    with contextlib.redirect_stdout(printed):
      namespace = run_page(ROOT / "README.md", {})
  finally:
    os.chdir(cwd)
  namespace["_printed"] = printed.getvalue()
  return namespace


@pytest.mark.slow
def test_readme_example_runs(readme_namespace):
  assert "zjax schedule v3: 8 device(s)" in readme_namespace["_printed"]
  assert int(readme_namespace["state"].step) == 3
  assert int(readme_namespace["state_half"].step) == 3
  assert readme_namespace["exported"]["params"]


@pytest.mark.slow
@pytest.mark.parametrize(
  "page",
  [p for p in _python_pages() if p.name != "README.md"],
  ids=lambda p: str(p.relative_to(ROOT)),
)
def test_guide_python_blocks_run(page, readme_namespace, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  continues = CONTINUES.search(page.read_text())
  if continues:
    assert continues.group("page") == "README.md", f"{page}: continues only README.md"
    namespace = dict(readme_namespace)
  else:
    namespace = {}
  run_page(page, namespace)


# ---- console: every command line runs (a "$ " line, or every line of a block without one) --
CONSOLE = [b for b in ALL_BLOCKS if b.kind == "console" and not b.not_run]


def commands(block: Block) -> list[str]:
  lines = [line for line in block.code.splitlines() if line.strip()]
  prompted = [line[2:] for line in lines if line.startswith("$ ")]
  return prompted or lines


@pytest.mark.slow
@pytest.mark.parametrize("block", CONSOLE, ids=str)
def test_console_blocks_run(block):
  env = dict(
    os.environ,
    PATH=f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
  )
  for command in commands(block):
    done = subprocess.run(
      command, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{block}: {command}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"


# ---- links ------------------------------------------------------------------------------
LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def slug(heading: str) -> str:
  """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
  text = re.sub(r"[`*_]", "", heading.strip().lower())
  return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", text))


def anchors(page: pathlib.Path) -> set[str]:
  inside, out = False, set()
  for line in page.read_text().splitlines():
    if line.strip().startswith("```"):
      inside = not inside
    elif not inside and line.startswith("#"):
      out.add(slug(line.lstrip("#")))
  return out


def test_relative_links_resolve():
  bad = []
  for page in PAGES:
    for n, line in enumerate(page.read_text().splitlines(), 1):
      for m in LINK.finditer(line):
        target = m.group("target")
        if re.match(r"[a-z]+:", target):
          continue  # a web address: not checked here
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT)}:{n}: {target}"
        if not file.exists():
          bad.append(f"{where}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
          bad.append(f"{where}: no heading '{anchor}' in {file.name}")
  assert not bad, "\n".join(bad)


def test_every_guide_is_linked_from_the_readme():
  readme = (ROOT / "README.md").read_text()
  missing = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in readme]
  assert not missing, f"README.md links no guide {missing}"


def test_ci_runs_the_readme_test_command():
  ci = (ROOT / ".ci/run").read_text()
  (block,) = [b for b in blocks(ROOT / "README.md") if "pytest" in b.code]
  assert block.code.strip() in ci.splitlines()


def test_public_names_have_docstrings():
  """What the API reference (docs/reference, Sphinx autodoc) is built from."""
  import zjax
  import zjax.distributed
  import zjax.hlo

  missing = [
    f"{m.__name__}.{n}"
    for m in (zjax, zjax.hlo, zjax.distributed)
    for n in m.__all__
    if not (getattr(m, n).__doc__ or "").strip()
  ]
  assert not missing, f"public names without a docstring: {missing}"


def test_the_architecture_page_names_every_source_file():
  """The file map is the tree of zjax/_src: every module under its folder, none stale."""
  page = (ROOT / "docs/architecture.md").read_text()
  tree = page[page.index("zjax/_src/\n") :].split("```")[0]
  named, folder = set(), ""
  for line in tree.splitlines()[1:]:
    if not line.startswith(" "):  # the next top-level entry: the tree has ended
      break
    if re.fullmatch(r"  (\w+)/", line):
      folder = line.strip()
    elif m := re.match(r"( +)(\w+\.py) ", line):
      named.add((folder if len(m.group(1)) == 4 else "") + m.group(2))
  src = ROOT / "zjax/_src"
  files = {p.relative_to(src).as_posix() for p in src.rglob("*.py") if p.name != "__init__.py"}
  assert files == named, (
    f"docs/architecture.md's file map lacks {sorted(files - named)}, "
    f"names files that are gone: {sorted(named - files)}"
  )
