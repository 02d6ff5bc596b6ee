"""Generalization hierarchies: the ARX loader, the interval and prefix builders, tree validation, the CLI."""

from __future__ import annotations

import csv
import io
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import psycopg
import pytest
from conftest import Endpoint
from psycopg import sql

from anonproxy.views.hierarchies import (
    ADULT_CSV_COLUMNS,
    ADULT_INTERVAL_WIDTHS,
    HierarchyFileError,
    build_interval_hierarchy,
    build_prefix_hierarchy,
    load_hierarchy,
    parse_hierarchy_csv,
)


def nodes(conn: psycopg.Connection, name: str) -> dict[str, list[str]]:
    """leaf -> [level 0 node, level 1 node, …] as stored."""
    found: dict[str, list[str]] = {}
    for leaf, node in conn.execute(
        "select leaf, node from anonproxy.hierarchy_nodes where hierarchy = %s order by leaf, level", (name,)
    ):
        found.setdefault(leaf, []).append(node)
    return found


def hierarchy_names(conn: psycopg.Connection) -> set[str]:
    return {name for (name,) in conn.execute("select name from anonproxy.hierarchies")}


def sqlstate_of(conn: psycopg.Connection, query: str, params: tuple[object, ...] = ()) -> str:
    """The SQLSTATE of a statement that must fail; the failure is rolled back to a savepoint."""
    with pytest.raises(psycopg.Error) as caught, conn.transaction():
        conn.execute(query, params)
    assert caught.value.sqlstate is not None
    return caught.value.sqlstate


# The shipped Adult hierarchies -------------------------------------------------------------------


@pytest.mark.parametrize("column", ADULT_CSV_COLUMNS)
def test_adult_hierarchy_equals_the_arx_file(postgresql: psycopg.Connection, column: str) -> None:
    """The template's adult.<column> holds exactly the rows of the shipped ARX file (read with csv, not our parser)."""
    text = files("anonproxy.data").joinpath("hierarchies", f"{column}.csv").read_text(encoding="utf-8")
    expected = {row[0]: row for row in csv.reader(io.StringIO(text), delimiter=";") if row}
    assert nodes(postgresql, f"adult.{column}") == expected
    levels = postgresql.execute("select levels from anonproxy.hierarchies where name = %s",
                                (f"adult.{column}",)).fetchone()
    assert levels == (len(next(iter(expected.values()))) - 1,)


def test_every_adult_value_is_a_leaf_of_its_hierarchy(postgresql: psycopg.Connection) -> None:
    for column in (*ADULT_CSV_COLUMNS, *ADULT_INTERVAL_WIDTHS):
        missing = postgresql.execute(sql.SQL(
            "select distinct a.{column}::text from public.adult a where not exists (select from "
            "anonproxy.hierarchy_nodes n where n.hierarchy = %s and n.leaf = a.{column}::text and n.level = 0)"
        ).format(column=sql.Identifier(column)), (f"adult.{column}",)).fetchall()
        assert missing == [], column


def test_adult_education_path(postgresql: psycopg.Connection) -> None:
    # adult_hierarchy_education.csv: Masters;Graduate;Higher education;*
    assert nodes(postgresql, "adult.education")["Masters"] == ["Masters", "Graduate", "Higher education", "*"]
    # age widths 5, 10, 20, labelled by what they cover (ARX's own file puts 30 under "25-29")
    assert nodes(postgresql, "adult.age")["30"] == ["30", "30-34", "30-39", "20-39", "*"]
    assert nodes(postgresql, "adult.age")["29"] == ["29", "25-29", "20-29", "20-39", "*"]
    # hours_per_week widths 5, 10, 20, 40: 45 -> 45-49 -> 40-49 -> 40-59 -> 40-79 -> *
    assert nodes(postgresql, "adult.hours_per_week")["45"] == ["45", "45-49", "40-49", "40-59", "40-79", "*"]


# Loading --------------------------------------------------------------------------------------------


def test_parse_and_load_round_trip(postgresql: psycopg.Connection) -> None:
    rows = parse_hierarchy_csv("47677;4767*;*\n\n47602;4760*;*\r\n47905;4790*;*")
    assert rows == [["47677", "4767*", "*"], ["47602", "4760*", "*"], ["47905", "4790*", "*"]]
    assert load_hierarchy(postgresql, "zip", rows) == 3
    assert nodes(postgresql, "zip") == {row[0]: row for row in rows}
    assert postgresql.execute("select levels, kind from anonproxy.hierarchies where name = 'zip'").fetchone() == (
        2, "explicit")


def test_parse_rejects_ragged_rows() -> None:
    with pytest.raises(HierarchyFileError, match=r"f\.csv:3: 2 columns, but the first row has 3"):
        parse_hierarchy_csv("a;A;*\nb;A;*\nc;*\n", "f.csv")


def test_parse_rejects_empty_and_single_column_files() -> None:
    with pytest.raises(HierarchyFileError, match="no rows"):
        parse_hierarchy_csv("\n\n", "f.csv")
    with pytest.raises(HierarchyFileError, match=r"f\.csv:1: one column"):
        parse_hierarchy_csv("a,A,*\n", "f.csv")  # wrong delimiter: one column per row


def test_load_refuses_to_overwrite_unless_asked(postgresql: psycopg.Connection) -> None:
    load_hierarchy(postgresql, "sexes", [["M", "*"], ["F", "*"]])
    postgresql.commit()
    assert sqlstate_of(postgresql, "select anonproxy.load_hierarchy('sexes', array[['X', '*']])") == "42710"
    assert nodes(postgresql, "sexes") == {"M": ["M", "*"], "F": ["F", "*"]}
    assert load_hierarchy(postgresql, "sexes", [["X", "*"]], replace=True) == 1
    assert nodes(postgresql, "sexes") == {"X": ["X", "*"]}


@pytest.mark.parametrize(("rows", "message"), [
    ([["a", "A", "*"], ["b", "B", "**"]], "several nodes at its top level 2"),
    ([["a", "A", "X", "*"], ["b", "A", "Y", "*"]], "node 'A' at level 1 has several parents: X, Y"),
    ([["a", "A", "*"], ["A", "B", "*"]], "label 'A' stands for different sets of values at levels 0, 1"),
    ([["a", "A", "*"], ["a", "B", "*"]], "value 'a' has several rows (1, 2)"),
    ([["a", "", "*"]], "row 1 has no value at level 1"),
    ([["a", None, "*"]], "row 1 has no value at level 1"),
    ([["a"], ["b"]], "at least the value and the top are needed"),
])
def test_inconsistent_hierarchies_are_refused(postgresql: psycopg.Connection, rows: list[list[str | None]],
                                              message: str) -> None:
    with pytest.raises(psycopg.Error) as caught:
        load_hierarchy(postgresql, "bad", rows)  # type: ignore[arg-type]
    assert caught.value.sqlstate == "22023"
    assert message in str(caught.value)
    postgresql.rollback()
    assert "bad" not in hierarchy_names(postgresql)


def test_one_dimensional_rows_are_refused(postgresql: psycopg.Connection) -> None:
    assert sqlstate_of(postgresql, "select anonproxy.load_hierarchy('bad', array['a', '*'])") == "22023"


def test_validate_catches_rows_edited_by_hand(postgresql: psycopg.Connection) -> None:
    load_hierarchy(postgresql, "h", [["a", "A", "*"], ["b", "A", "*"]])
    postgresql.execute("update anonproxy.hierarchy_nodes set node = 'z' where hierarchy = 'h' and leaf = 'a' "
                       "and level = 0")
    with pytest.raises(psycopg.Error, match="level 0 of leaf 'a' is 'z'"):
        postgresql.execute("select anonproxy.validate_hierarchy('h')")
    postgresql.rollback()
    load_hierarchy(postgresql, "h", [["a", "A", "*"], ["b", "A", "*"]])
    postgresql.execute("delete from anonproxy.hierarchy_nodes where hierarchy = 'h' and leaf = 'b' and level = 1")
    with pytest.raises(psycopg.Error, match="leaf 'b' has 2 levels, not the 3 levels 0..2"):
        postgresql.execute("select anonproxy.validate_hierarchy('h')")


def test_drop_hierarchy(postgresql: psycopg.Connection) -> None:
    load_hierarchy(postgresql, "h", [["a", "*"]])
    postgresql.execute("select anonproxy.drop_hierarchy('h')")
    assert "h" not in hierarchy_names(postgresql)
    assert postgresql.execute("select count(*) from anonproxy.hierarchy_nodes where hierarchy = 'h'").fetchone() == (
        0,)
    assert sqlstate_of(postgresql, "select anonproxy.drop_hierarchy('h')") == "42704"


# Builders -------------------------------------------------------------------------------------------


@pytest.fixture
def small(postgresql: psycopg.Connection) -> psycopg.Connection:
    postgresql.execute("create table small (zip text, n integer, x numeric)")
    postgresql.execute("insert into small values ('47677', -3, 1.5), ('47602', 7, 2), ('47905', 12, 3), "
                       "('4710', 0, 4), ('47677', 7, 5), (null, null, null)")
    return postgresql


def test_interval_hierarchy(small: psycopg.Connection) -> None:
    assert build_interval_hierarchy(small, "n", "small", "n", [5, 10]) == 4
    assert nodes(small, "n") == {
        "-3": ["-3", "-5--1", "-10--1", "*"],
        "0": ["0", "0-4", "0-9", "*"],
        "7": ["7", "5-9", "0-9", "*"],
        "12": ["12", "10-14", "10-19", "*"],
    }
    assert small.execute("select levels, kind from anonproxy.hierarchies where name = 'n'").fetchone() == (
        3, "interval")


@pytest.mark.parametrize(("widths", "sqlstate", "message"), [
    ("array[5, 7]", "22023", "each width must be a multiple of the one before"),
    ("array[2.5]", "22023", "whole numbers"),
    ("array[0]", "22023", "whole numbers"),
    ("array[]::numeric[]", "22023", "non-empty"),
])
def test_interval_widths_are_checked(small: psycopg.Connection, widths: str, sqlstate: str, message: str) -> None:
    with pytest.raises(psycopg.Error, match=message) as caught:
        small.execute(f"select anonproxy.build_interval_hierarchy('n', 'small', 'n', {widths})")
    assert caught.value.sqlstate == sqlstate


def test_interval_column_is_checked(small: psycopg.Connection) -> None:
    assert sqlstate_of(small, "select anonproxy.build_interval_hierarchy('n', 'small', 'x', array[5])") == "42804"
    assert sqlstate_of(small, "select anonproxy.build_interval_hierarchy('n', 'small', 'nope', array[5])") == "42703"
    assert "n" not in hierarchy_names(small)


def test_prefix_hierarchy(small: psycopg.Connection) -> None:
    assert build_prefix_hierarchy(small, "zip", "small", "zip", 2) == 4
    assert nodes(small, "zip") == {
        "47677": ["47677", "4767*", "476**", "*"],
        "47602": ["47602", "4760*", "476**", "*"],
        "47905": ["47905", "4790*", "479**", "*"],
        "4710": ["4710", "471*", "47**", "*"],
    }


def test_prefix_levels_are_checked(small: psycopg.Connection) -> None:
    with pytest.raises(psycopg.Error, match="would hide the whole of the shortest value") as caught, \
            small.transaction():
        build_prefix_hierarchy(small, "zip", "small", "zip", 4)
    assert caught.value.sqlstate == "22023"
    assert sqlstate_of(small, "select anonproxy.build_prefix_hierarchy('zip', 'small', 'zip', 0)") == "22023"


# CLI ------------------------------------------------------------------------------------------------


def anonproxy(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "anonproxy", *args], check=False, capture_output=True, text=True, timeout=60)


def test_cli_load_list_drop(postgresql: psycopg.Connection, dbname: str, direct: Endpoint, tmp_path: Path) -> None:
    dsn = direct.dsn(dbname)
    good = tmp_path / "zip.csv"
    good.write_text("47677;4767*;*\n47602;4760*;*\n")
    loaded = anonproxy("hierarchy", "load", "zip", str(good), "--dsn", dsn)
    assert (loaded.returncode, loaded.stderr) == (0, "")
    assert "2 values" in loaded.stdout
    listing = anonproxy("hierarchy", "list", "--dsn", dsn)
    assert listing.returncode == 0
    assert [line.split() for line in listing.stdout.splitlines() if line.startswith("zip")] == [
        ["zip", "explicit", "2", "2"]]
    built = anonproxy("hierarchy", "build-intervals", "ages", "--source", "public.adult", "--column", "age",
                      "--widths", "5,10", "--dsn", dsn)
    assert built.returncode == 0, built.stderr
    assert nodes(postgresql, "ages")["39"] == ["39", "35-39", "30-39", "*"]
    dropped = anonproxy("hierarchy", "drop", "zip", "--dsn", dsn)
    assert dropped.returncode == 0
    assert "zip" not in hierarchy_names(postgresql)


def test_cli_reports_bad_files_without_traceback(dbname: str, direct: Endpoint, tmp_path: Path) -> None:
    dsn = direct.dsn(dbname)
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("a;A;*\nb;*\n")
    result = anonproxy("hierarchy", "load", "h", str(ragged), "--dsn", dsn)
    assert result.returncode == 1
    assert result.stderr == f"anonproxy hierarchy: {ragged}:2: 2 columns, but the first row has 3; " \
                            "every value needs an ancestor at every level\n"
    two_parents = tmp_path / "tree.csv"
    two_parents.write_text("a;A;X;*\nb;A;Y;*\n")
    result = anonproxy("hierarchy", "load", "h", str(two_parents), "--dsn", dsn)
    assert result.returncode == 1
    assert "node 'A' at level 1 has several parents: X, Y (SQLSTATE 22023)" in result.stderr
    assert "hint: a hierarchy is a tree" in result.stderr
    assert "Traceback" not in result.stderr


# Rights -----------------------------------------------------------------------------------------------


def test_anonymized_roles_cannot_read_hierarchies(postgresql: psycopg.Connection) -> None:
    """A built hierarchy lists every value of its column (here the exact ages): no grant to PUBLIC."""
    build_interval_hierarchy(postgresql, "ages", "public.adult", "age", [5, 10])
    postgresql.commit()
    for role in ("reporter", "analyst"):
        for table in ("anonproxy.hierarchies", "anonproxy.hierarchy_nodes"):
            postgresql.execute(sql.SQL("set role {}").format(sql.Identifier(role)))
            assert sqlstate_of(postgresql, f"select * from {table}") == "42501", (role, table)
            postgresql.execute("reset role")


def test_demo_dba_builds_hierarchies(postgresql: psycopg.Connection) -> None:
    """The demo dba (CREATE on public, writes on the hierarchy tables, no superuser) can build both kinds."""
    ages = postgresql.execute("select count(distinct age) from public.adult").fetchone()
    postgresql.execute("set role dba")
    assert postgresql.execute("select anonproxy.build_interval_hierarchy('ages', 'public.adult', 'age', "
                              "array[5, 10])").fetchone() == ages
    assert postgresql.execute("select anonproxy.build_prefix_hierarchy('sexes', 'public.adult', 'sex', 1)"
                              ).fetchone() == (2,)
    assert sqlstate_of(postgresql, "select anonproxy.build_interval_hierarchy('n', 'public.adult', 'nope', "
                                   "array[5])") == "42703"
