"""The README stays true: its API example runs, and CI runs exactly its test command."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_api_examples_run(tmp_path, monkeypatch, capsys):
  """Every python block, in order, as a reader would run them."""
  blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
  assert len(blocks) >= 2
  monkeypatch.chdir(tmp_path)
  namespace = {}
  for code in blocks:
    exec(compile(code, "README.md", "exec"), namespace)
  assert "zjax schedule v2: 8 device(s)" in capsys.readouterr().out
  assert int(namespace["state"].step) == 3


def test_ci_runs_the_readme_test_command():
  ci = (ROOT / ".ci/run").read_text()
  test_command = re.search(r"The tests .*?\n\n```\n(.*?)\n```", README, flags=re.S).group(1)
  assert test_command.strip() in ci.splitlines()
