"""Where a benchmark finds its texts: --data, else $LONGCTX_DATA, else a named error that says what to set; no script
reaches for a folder beside the checkout."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.shared import DATA_ENV, DataFolderError, data_dir
from longctx_patch.errors import LongctxError

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_the_argument_wins_over_the_environment(tmp_path, monkeypatch):
    (tmp_path / "a" / "pg_essays").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "b"))
    assert data_dir(str(tmp_path / "a"), need="pg_essays") == tmp_path / "a"
    assert data_dir() == tmp_path / "b"


def test_without_a_folder_the_error_says_what_to_set(monkeypatch):
    monkeypatch.delenv(DATA_ENV, raising=False)
    with pytest.raises(DataFolderError, match=r"--data DIR or set \$LONGCTX_DATA to a folder that holds pg_essays/"):
        data_dir(None, need="pg_essays")
    assert issubclass(DataFolderError, LongctxError)


def test_a_folder_that_is_not_there_or_lacks_the_texts(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "missing"))
    with pytest.raises(DataFolderError, match=r"\$LONGCTX_DATA is .*missing, which is not a folder"):
        data_dir()
    with pytest.raises(DataFolderError, match=r"--data is .* which has no pg_essays/ folder"):
        data_dir(str(tmp_path), need="pg_essays")


def test_no_script_names_a_sibling_of_the_checkout():
    for p in sorted(BENCH.rglob("*")):
        if p.suffix in (".py", ".sh") and "results" not in p.relative_to(BENCH).parts:
            code = "\n".join(line.split("#")[0] for line in p.read_text().splitlines())
            sibling = re.search(r"/ *[\"']shared[\"']|[\"']\.\./shared", code)
            assert not sibling, f"{p}: take the folder from --data or ${DATA_ENV}"
