"""Red team: the names a time function reads (a time zone, a date_trunc unit, an extract field), spelled so that the
proxy's check and PostgreSQL read them differently.

PostgreSQL matches these names case-insensitively in ASCII only, and does not strip spaces around a zone name; it
fails on a name it does not know only when a row reaches the call, so the error tells whether any row did (one
person's row, under a WHERE that isolates it). The proof used to strip the zone (' UTC') and lower names with
Python's Unicode lower(), which maps the Kelvin sign (U+212A) to 'k' ('WEE\u212a', 'Asia/\u212aolkata'), and read
to_timestamp's constant text with Python's strptime, which takes any Unicode digits ('\u0662\u0660\u0662\u0665' is
2025 to it, not to PostgreSQL): each such statement was admitted and PostgreSQL raised its error for exactly the rows
the attacker aimed at. Each is now refused (0A000) before any row is read, in both modes, bound as a parameter too,
and charges nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role
from psycopg import pq
from test_time_functions import BOUNDED, admitted, refused

KELVIN = "\u212a"  # KELVIN SIGN: Python's "\u212a".lower() == "k"; PostgreSQL leaves it as it is
ARABIC_2025 = "\u0662\u0660\u0662\u0665"  # ARABIC-INDIC DIGITs: Python's int() and strptime read them as 2025
FULLWIDTH_2025 = "\uff12\uff10\uff12\uff15"  # FULLWIDTH DIGITs, the same

# (the attack over the test policy's ``events``, the same statement spelled as PostgreSQL knows it)
NAMES = [
    ("select count(*) from events where person_id = 17 and (at at time zone ' UTC') > now()", "' UTC'", "'UTC'"),
    ("select count(*) from events where person_id = 17 and (at at time zone 'Europe/Paris\t') > now()",
     "'Europe/Paris\t'", "'Europe/Paris'"),
    (f"select count(*) from events where person_id = 17 and (at at time zone 'Asia/{KELVIN}olkata') > now()",
     KELVIN, "K"),
    ("select date_trunc('day', at, 'UTC '), count(*) from events group by 1", "'UTC '", "'UTC'"),
    ("select timezone(' Asia/Tokyo', at), count(*) from events group by 1", "' Asia", "'Asia"),
    (f"select count(*) from events where person_id = 17 and date_trunc('wee{KELVIN}', at) > now()", KELVIN, "k"),
    (f"select count(*) from events where person_id = 17 and date_part('wee{KELVIN}', at) > 1", KELVIN, "k"),
    (f"select count(*) from events where person_id = 17 and extract('wee{KELVIN}' from at) > 1", KELVIN, "k"),
    (f"select count(*) from events where person_id = 17 and extract(wee{KELVIN} from at) > 1", KELVIN, "k"),
    # Python's strptime reads any Unicode digits; PostgreSQL's to_timestamp only ASCII ones
    (f"select count(*) from events where person_id = 17 and at > to_timestamp('{ARABIC_2025}-01-01', 'YYYY-MM-DD')",
     ARABIC_2025, "2025"),
    (f"select count(*) from events where person_id = 17 and at > to_timestamp('{FULLWIDTH_2025}-01', 'YYYY-MM')",
     FULLWIDTH_2025, "2025"),
]


@pytest.mark.parametrize(("sql", "spelled", "known"), NAMES)
def test_names_postgresql_does_not_know_are_refused_in_both_modes(sql: str, spelled: str, known: str) -> None:
    refused(sql)
    refused(sql, policy=BOUNDED)
    # the name as PostgreSQL knows it is answered: the refusal is the spelling (with declared bounds: dp assumes
    # nothing of a time column without them in WHERE, where a time zone or a truncation may leave the range)
    admitted(sql.replace(spelled, known), BOUNDED)


# --- through the proxy, over the demo's visits -------------------------------------------------------------------

# {person}: a person with visits, or nobody; {name}: the spelling. PostgreSQL fails only when a row reaches the call.
THROUGH = [
    ("select count(*) from visits where person_id = {person} and (visited_at at time zone '{name}') > now()",
     (" UTC", "Europe/Paris ", f"Asia/{KELVIN}olkata")),
    ("select count(*) from visits where person_id = {person} and date_trunc('{name}', visited_at) > now()",
     (f"WEE{KELVIN}",)),
    ("select count(*) from visits where person_id = {person} and extract('{name}' from visited_at) > 60",
     (f"wee{KELVIN}",)),
    # (a difference: a bare comparison with it is evaluated when PostgreSQL plans, to estimate it, whatever the rows)
    (("select count(*) from visits where person_id = {person} "
      "and (visited_at - to_timestamp('{name}', 'YYYY-MM-DD')) > interval '0'"),
     (f"{ARABIC_2025}-01-01", f"{FULLWIDTH_2025}-01-01")),
]
CASES = [(template, name) for template, names in THROUGH for name in names]


@pytest.fixture(scope="module")
def person(truth: psycopg.Connection[Any]) -> int:
    return int(truth.execute("select min(person_id) from public.visits").fetchone()[0])


@pytest.fixture(params=["suppress", "dp"])
def attacker(request: pytest.FixtureRequest, gated_proxy: Endpoint, gated_database: str,
             truth: psycopg.Connection[Any]) -> Iterator[psycopg.Connection[Any]]:
    """The demo's reporter, or an analyst of a dp role with a budget of its own (the demo's may be spent)."""
    if request.param == "suppress":
        with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
            yield conn
        return
    with fresh_dp_role(truth, gated_proxy, gated_database, "rt_time_names") as role, \
            psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as conn:
        yield conn


def budget(conn: psycopg.Connection[Any]) -> Any:
    return conn.execute("show anonproxy.budget").fetchone() if conn.info.user != "reporter" else None


@pytest.mark.parametrize(("template", "name"), CASES)
def test_postgresql_reveals_the_row_through_the_name(truth: psycopg.Connection[Any], person: int,
                                                     template: str, name: str) -> None:
    """The leak the refusal keeps closed: PostgreSQL answers when no row reaches the call, fails when one does."""
    truth.execute(template.format(person=-1, name=name))
    with pytest.raises(psycopg.Error), truth.transaction():
        truth.execute(template.format(person=person, name=name))


@pytest.mark.parametrize(("template", "name"), CASES)
def test_the_proxy_refuses_whether_or_not_a_row_reaches_the_call(attacker: psycopg.Connection[Any], person: int,
                                                                  template: str, name: str) -> None:
    before = budget(attacker)
    for who in (-1, person):
        with pytest.raises(psycopg.Error) as caught:
            attacker.execute(template.format(person=who, name=name))
        assert caught.value.sqlstate == "0A000", caught.value
    assert budget(attacker) == before  # refused before anything is charged


@pytest.mark.parametrize("zone", [" UTC", "UTC\t", f"Asia/{KELVIN}olkata"])
def test_a_zone_bound_at_bind_is_checked_as_the_constant(attacker: psycopg.Connection[Any], person: int,
                                                         zone: str) -> None:
    """``AT TIME ZONE $1`` is decided at Bind with the value written as a constant: the same refusal, for a named
    statement bound first with a zone PostgreSQL knows."""
    sql = (b"select count(*) from visits where person_id = $1::integer "
           b"and (visited_at at time zone $2) > timestamp '2000-01-01'")
    pgconn = attacker.pgconn
    assert pgconn.prepare(b"zoned", sql).status == pq.ExecStatus.COMMAND_OK
    answered = pgconn.exec_prepared(b"zoned", [str(person).encode(), b"UTC"])
    assert answered.status == pq.ExecStatus.TUPLES_OK, answered.error_message
    before = budget(attacker)
    result = pgconn.exec_prepared(b"zoned", [str(person).encode(), zone.encode()])
    assert result.status == pq.ExecStatus.FATAL_ERROR
    assert result.error_field(pq.DiagnosticField.SQLSTATE) == b"0A000", result.error_message
    assert budget(attacker) == before
    pgconn.exec_(b"deallocate zoned")
