"""Round 18: schema introspection through the gated proxy, as the tools send it.

GUI clients, drivers and BI tools learn the schema from the catalogs before they send anything else; a role the
proxy gates (``reporter``: suppress, a dp role) must get PostgreSQL's own answer to those reads, as PostgreSQL gives
it to that role, or the tool cannot list tables and columns. Each statement here is one a real tool sends, taken from
its source (the comment names the repository and file, and whether it was read or written from memory); the
reference is PostgreSQL's answer to the same statement under ``SET ROLE`` to the same role on a direct connection.
psql itself (the installed binary) and SQLAlchemy's reflection (the installed package) run as they are, through the
proxy and directly as the same role, and their outputs must be equal.

Reads that would show protected data stay refused: row previews of a protected table and a table sample;
``pg_statistic`` (the raw statistics, values of protected columns); ``pg_stats`` is answered as PostgreSQL answers
the role itself, which holds no SELECT on protected tables, so it shows none of their rows.
"""

from __future__ import annotations

import os
import pty
import select
import subprocess
import time
from typing import Any

import psycopg
import pytest
import sqlalchemy
from conftest import Endpoint, corpus_roles
from psycopg import sql

from anonproxy.embedded import EmbeddedPostgres

reporter, analyst = corpus_roles("dp_round18i")

PGJDBC = "pgjdbc/pgjdbc pgjdbc/src/main/java/org/postgresql/jdbc/PgDatabaseMetaData.java (read)"
ASYNCPG = "MagicStack/asyncpg asyncpg/introspection.py (read)"
NPGSQL = "npgsql/npgsql src/Npgsql/PostgresDatabaseInfo.cs (read)"
TAB_COMPLETE = "postgres/postgres src/bin/psql/tab-complete.c, PostgreSQL 15 (from memory: its SchemaQuery's shape)"

# _TYPEINFO (servers 14 and later), the relation INTRO_LOOKUP_TYPES reads twice
ASYNCPG_TYPEINFO = """(
        SELECT
            t.oid                           AS oid,
            ns.nspname                      AS ns,
            t.typname                       AS name,
            t.typtype                       AS kind,
            (CASE WHEN t.typtype = 'd' THEN
                (WITH RECURSIVE typebases(oid, depth) AS (
                    SELECT
                        t2.typbasetype      AS oid,
                        0                   AS depth
                    FROM
                        pg_type t2
                    WHERE
                        t2.oid = t.oid

                    UNION ALL

                    SELECT
                        t2.typbasetype      AS oid,
                        tb.depth + 1        AS depth
                    FROM
                        pg_type t2,
                        typebases tb
                    WHERE
                       tb.oid = t2.oid
                       AND t2.typbasetype != 0
               ) SELECT oid FROM typebases ORDER BY depth DESC LIMIT 1)

               ELSE NULL
            END)                            AS basetype,
            t.typelem                       AS elemtype,
            elem_t.typdelim                 AS elemdelim,
            COALESCE(
                range_t.rngsubtype,
                multirange_t.rngsubtype)    AS range_subtype,
            (CASE WHEN t.typtype = 'c' THEN
                (SELECT
                    array_agg(ia.atttypid ORDER BY ia.attnum)
                FROM
                    pg_attribute ia
                    INNER JOIN pg_class c
                        ON (ia.attrelid = c.oid)
                WHERE
                    ia.attnum > 0 AND NOT ia.attisdropped
                    AND c.reltype = t.oid)

                ELSE NULL
            END)                            AS attrtypoids,
            (CASE WHEN t.typtype = 'c' THEN
                (SELECT
                    array_agg(ia.attname::text ORDER BY ia.attnum)
                FROM
                    pg_attribute ia
                    INNER JOIN pg_class c
                        ON (ia.attrelid = c.oid)
                WHERE
                    ia.attnum > 0 AND NOT ia.attisdropped
                    AND c.reltype = t.oid)

                ELSE NULL
            END)                            AS attrnames
        FROM
            pg_catalog.pg_type AS t
            INNER JOIN pg_catalog.pg_namespace ns ON (
                ns.oid = t.typnamespace)
            LEFT JOIN pg_type elem_t ON (
                t.typlen = -1 AND
                t.typelem != 0 AND
                t.typelem = elem_t.oid
            )
            LEFT JOIN pg_range range_t ON (
                t.oid = range_t.rngtypid
            )
            LEFT JOIN pg_range multirange_t ON (
                t.oid = multirange_t.rngmultitypid
            )
    )"""

# What the driver's method sends, its ? placeholders as $n (pgjdbc binds them server-side), and the values bound.
CATALOG_READS: dict[str, tuple[str, str, list[Any]]] = {
    # getTables(null, "public", "%", {"TABLE", "VIEW"}): the table-type clauses of tableTypeClauses (SCHEMAS)
    "pgjdbc getTables": (PGJDBC, """SELECT current_database() AS "TABLE_CAT", n.nspname AS "TABLE_SCHEM",
 c.relname AS "TABLE_NAME",  CASE n.nspname ~ '^pg_' OR n.nspname = 'information_schema'  WHEN true THEN CASE
 WHEN n.nspname = 'pg_catalog' OR n.nspname = 'information_schema' THEN CASE c.relkind   WHEN 'r' THEN 'SYSTEM TABLE'
   WHEN 'v' THEN 'SYSTEM VIEW'   WHEN 'i' THEN 'SYSTEM INDEX'   ELSE NULL   END  WHEN n.nspname = 'pg_toast' THEN
 CASE c.relkind   WHEN 'r' THEN 'SYSTEM TOAST TABLE'   WHEN 'i' THEN 'SYSTEM TOAST INDEX'   ELSE NULL   END  ELSE
 CASE c.relkind   WHEN 'r' THEN 'TEMPORARY TABLE'   WHEN 'p' THEN 'TEMPORARY TABLE'   WHEN 'i' THEN 'TEMPORARY INDEX'
   WHEN 'S' THEN 'TEMPORARY SEQUENCE'   WHEN 'v' THEN 'TEMPORARY VIEW'   ELSE NULL   END  END  WHEN false THEN
 CASE c.relkind  WHEN 'r' THEN 'TABLE'  WHEN 'p' THEN 'PARTITIONED TABLE'  WHEN 'i' THEN 'INDEX'
 WHEN 'P' then 'PARTITIONED INDEX'  WHEN 'S' THEN 'SEQUENCE'  WHEN 'v' THEN 'VIEW'  WHEN 'c' THEN 'TYPE'
 WHEN 'f' THEN 'FOREIGN TABLE'  WHEN 'm' THEN 'MATERIALIZED VIEW'  ELSE NULL  END  ELSE NULL  END  AS "TABLE_TYPE",
 d.description AS "REMARKS",  '' as "TYPE_CAT", '' as "TYPE_SCHEM", '' as "TYPE_NAME",
 '' AS "SELF_REFERENCING_COL_NAME", '' AS "REF_GENERATION"  FROM pg_catalog.pg_namespace n, pg_catalog.pg_class c
 LEFT JOIN pg_catalog.pg_description d ON (c.oid = d.objoid AND d.objsubid = 0  and d.classoid = 'pg_class'::regclass)
 WHERE c.relnamespace = n.oid  AND n.nspname LIKE $1 AND c.relname LIKE $2 AND (false
 OR ( c.relkind = 'r' AND n.nspname !~ '^pg_' AND n.nspname <> 'information_schema' )
 OR ( c.relkind = 'v' AND n.nspname <> 'pg_catalog' AND n.nspname <> 'information_schema' ) )
 ORDER BY "TABLE_TYPE","TABLE_SCHEM","TABLE_NAME" """, ["public", "%"]),
    # getColumns(null, "public", "adult", "%") on a server of version 12 or later
    "pgjdbc getColumns": (PGJDBC, """SELECT * FROM (SELECT current_database() AS current_database,
 n.nspname,c.relname,a.attname,a.atttypid,a.attnotnull  OR (t.typtype = 'd' AND t.typnotnull) AS attnotnull,
 a.atttypmod,a.attlen,t.typtypmod,row_number() OVER (PARTITION BY a.attrelid ORDER BY a.attnum) AS attnum,
 nullif(a.attidentity, '') as attidentity,nullif(a.attgenerated, '') as attgenerated,
 pg_catalog.pg_get_expr(def.adbin, def.adrelid) AS adsrc,dsc.description,t.typbasetype,t.typtype
 FROM pg_catalog.pg_namespace n  JOIN pg_catalog.pg_class c ON (c.relnamespace = n.oid)
 JOIN pg_catalog.pg_attribute a ON (a.attrelid=c.oid)  JOIN pg_catalog.pg_type t ON (a.atttypid = t.oid)
 LEFT JOIN pg_catalog.pg_attrdef def ON (a.attrelid=def.adrelid AND a.attnum = def.adnum)
 LEFT JOIN pg_catalog.pg_description dsc ON (c.oid=dsc.objoid AND a.attnum = dsc.objsubid)
 LEFT JOIN pg_catalog.pg_class dc ON (dc.oid=dsc.classoid AND dc.relname='pg_class')
 LEFT JOIN pg_catalog.pg_namespace dn ON (dc.relnamespace=dn.oid AND dn.nspname='pg_catalog')
 WHERE c.relkind in ('r','p','v','f','m') and a.attnum > 0 AND NOT a.attisdropped  AND n.nspname LIKE $1
 AND c.relname LIKE $2) c WHERE true  AND attname LIKE $3 ORDER BY nspname,c.relname,attnum """,
                          ["public", "adult", "%"]),
    # getPrimaryKeys(null, "public", "adult")
    "pgjdbc getPrimaryKeys": (PGJDBC, """SELECT        result.TABLE_CAT AS "TABLE_CAT",
 result.TABLE_SCHEM AS "TABLE_SCHEM",        result.TABLE_NAME AS "TABLE_NAME",
 result.COLUMN_NAME AS "COLUMN_NAME",        result.KEY_SEQ AS "KEY_SEQ",        result.PK_NAME AS "PK_NAME"FROM
 (SELECT current_database() AS TABLE_CAT, n.nspname AS TABLE_SCHEM,   ct.relname AS TABLE_NAME,
 a.attname AS COLUMN_NAME,   (information_schema._pg_expandarray(con.conkey)).n AS KEY_SEQ, con.conname AS PK_NAME,
 information_schema._pg_expandarray(con.conkey) AS KEYS, a.attnum AS A_ATTNUM FROM pg_catalog.pg_constraint con
 JOIN pg_catalog.pg_class ct ON (con.conrelid = ct.oid)   JOIN pg_catalog.pg_namespace n ON (ct.relnamespace = n.oid)
 JOIN pg_catalog.pg_attribute a ON (a.attrelid = ct.oid) WHERE con.contype = 'p'  AND n.nspname = $1
 AND ct.relname = $2 ) result where  result.A_ATTNUM = (result.KEYS).x
 ORDER BY result.table_name, result.pk_name, result.key_seq""", ["public", "adult"]),
    # getIndexInfo(null, "public", "adult", false, true) on a server of version 9.6 or later
    "pgjdbc getIndexInfo": (PGJDBC, """SELECT     tmp.TABLE_CAT AS "TABLE_CAT",     tmp.TABLE_SCHEM AS "TABLE_SCHEM",
 tmp.TABLE_NAME AS "TABLE_NAME",     tmp.NON_UNIQUE AS "NON_UNIQUE",     tmp.INDEX_QUALIFIER AS "INDEX_QUALIFIER",
 tmp.INDEX_NAME AS "INDEX_NAME",     tmp.TYPE AS "TYPE",     tmp.ORDINAL_POSITION AS "ORDINAL_POSITION",
 trim(both '"' from pg_catalog.pg_get_indexdef(tmp.CI_OID, tmp.ORDINAL_POSITION, false)) AS "COLUMN_NAME",
 CASE tmp.AM_NAME     WHEN 'btree' THEN CASE tmp.I_INDOPTION[tmp.ORDINAL_POSITION - 1] & 1::smallint
 WHEN 1 THEN 'D'       ELSE 'A'     END     ELSE NULL   END AS "ASC_OR_DESC",     tmp.CARDINALITY AS "CARDINALITY",
 tmp.PAGES AS "PAGES",     tmp.FILTER_CONDITION AS "FILTER_CONDITION",     tmp.REMARKS AS "REMARKS"FROM
 (SELECT current_database() AS TABLE_CAT,  n.nspname AS TABLE_SCHEM,   ct.relname AS TABLE_NAME,
 NOT i.indisunique AS NON_UNIQUE,   NULL AS INDEX_QUALIFIER, ci.relname AS INDEX_NAME,   CASE i.indisclustered
 WHEN true THEN 1    ELSE CASE am.amname       WHEN 'hash' THEN 2      ELSE 3    END   END AS TYPE,
 (information_schema._pg_expandarray(i.indkey)).n AS ORDINAL_POSITION,   ci.reltuples AS CARDINALITY,
 ci.relpages AS PAGES,   pg_catalog.pg_get_expr(i.indpred, i.indrelid) AS FILTER_CONDITION,   ci.oid AS CI_OID,
 i.indoption AS I_INDOPTION,   am.amname AS AM_NAME,   d.description AS REMARKS FROM pg_catalog.pg_class ct
 JOIN pg_catalog.pg_namespace n ON (ct.relnamespace = n.oid)   JOIN pg_catalog.pg_index i ON (ct.oid = i.indrelid)
 JOIN pg_catalog.pg_class ci ON (ci.oid = i.indexrelid)   JOIN pg_catalog.pg_am am ON (ci.relam = am.oid)
 LEFT JOIN pg_catalog.pg_description d ON (ci.oid = d.objoid) WHERE true  AND n.nspname = $1 AND ct.relname = $2)
 AS tmp ORDER BY "NON_UNIQUE", "TYPE", "INDEX_NAME", "ORDINAL_POSITION" """, ["public", "adult"]),
    # getSchemas(null, "%")
    "pgjdbc getSchemas": (PGJDBC, """SELECT nspname AS "TABLE_SCHEM", current_database() AS "TABLE_CATALOG"
 FROM pg_catalog.pg_namespace  WHERE nspname <> 'pg_toast' AND (nspname !~ '^pg_temp_'
 OR nspname = (pg_catalog.current_schemas(true))[1]) AND (nspname !~ '^pg_toast_temp_'
 OR nspname = replace((pg_catalog.current_schemas(true))[1], 'pg_temp_', 'pg_toast_temp_'))  AND nspname LIKE $1
 ORDER BY "TABLE_SCHEM" """, ["%"]),
    # getCatalogs()
    "pgjdbc getCatalogs": (PGJDBC, """SELECT datname AS "TABLE_CAT" FROM pg_catalog.pg_database
 WHERE datallowconn = true ORDER BY datname""", []),
    # getMaxIndexKeys(), read before getImportedKeys builds its generate_series
    "pgjdbc getMaxIndexKeys": (PGJDBC, "SELECT setting FROM pg_catalog.pg_settings WHERE name='max_index_keys'", []),
    # getImportedKeys(null, "public", "visits") on a server of version 11 or later, max_index_keys 32
    "pgjdbc getImportedKeys": (PGJDBC, """SELECT current_database() AS "PKTABLE_CAT", pkn.nspname AS "PKTABLE_SCHEM",
 pkc.relname AS "PKTABLE_NAME", pka.attname AS "PKCOLUMN_NAME", current_database() AS "FKTABLE_CAT",
 fkn.nspname AS "FKTABLE_SCHEM", fkc.relname AS "FKTABLE_NAME", fka.attname AS "FKCOLUMN_NAME", pos.n AS "KEY_SEQ",
 CASE con.confupdtype  WHEN 'c' THEN 0 WHEN 'n' THEN 2 WHEN 'd' THEN 4 WHEN 'r' THEN 1 WHEN 'p' THEN 1
 WHEN 'a' THEN 3 ELSE NULL END AS "UPDATE_RULE", CASE con.confdeltype  WHEN 'c' THEN 0 WHEN 'n' THEN 2
 WHEN 'd' THEN 4 WHEN 'r' THEN 1 WHEN 'p' THEN 1 WHEN 'a' THEN 3 ELSE NULL END AS "DELETE_RULE",
 con.conname AS "FK_NAME", pkic.relname AS "PK_NAME", CASE  WHEN con.condeferrable AND con.condeferred THEN 5
 WHEN con.condeferrable THEN 6 ELSE 7 END AS "DEFERRABILITY"  FROM  pg_catalog.pg_namespace pkn,
 pg_catalog.pg_class pkc, pg_catalog.pg_attribute pka,  pg_catalog.pg_namespace fkn, pg_catalog.pg_class fkc,
 pg_catalog.pg_attribute fka,  pg_catalog.pg_constraint con,  pg_catalog.generate_series(1, 32) pos(n),
 pg_catalog.pg_class pkic WHERE pkn.oid = pkc.relnamespace AND pkc.oid = pka.attrelid
 AND pka.attnum = con.confkey[pos.n] AND con.confrelid = pkc.oid  AND fkn.oid = fkc.relnamespace
 AND fkc.oid = fka.attrelid AND fka.attnum = con.conkey[pos.n] AND con.conrelid = fkc.oid  AND con.contype = 'f'
 AND (pkic.relkind = 'i' OR pkic.relkind = 'I') AND pkic.oid = con.conindid  AND fkn.nspname = $1
 AND fkc.relname = $2 ORDER BY pkn.nspname,pkc.relname, con.conname,pos.n""", ["public", "visits"]),
    # getTypeInfo(): the type list it then maps to JDBC types
    "pgjdbc getTypeInfo": (PGJDBC, """SELECT t.typname,t.oid FROM pg_catalog.pg_type t
 JOIN pg_catalog.pg_namespace n ON (t.typnamespace = n.oid)  WHERE n.nspname  != 'pg_toast' AND
 (t.typrelid = 0 OR (SELECT c.relkind = 'c' FROM pg_catalog.pg_class c WHERE c.oid = t.typrelid))""", []),
    # INTRO_LOOKUP_TYPES (servers 14 and later) with _TYPEINFO, for the types of adult's columns and an array
    "asyncpg type introspection": (ASYNCPG, """WITH RECURSIVE typeinfo_tree(
    oid, ns, name, kind, basetype, elemtype, elemdelim,
    range_subtype, attrtypoids, attrnames, depth)
AS (
    SELECT
        ti.oid, ti.ns, ti.name, ti.kind, ti.basetype,
        ti.elemtype, ti.elemdelim, ti.range_subtype,
        ti.attrtypoids, ti.attrnames, 0
    FROM
        {typeinfo} AS ti
    WHERE
        ti.oid = any($1::oid[])

    UNION ALL

    SELECT
        ti.oid, ti.ns, ti.name, ti.kind, ti.basetype,
        ti.elemtype, ti.elemdelim, ti.range_subtype,
        ti.attrtypoids, ti.attrnames, tt.depth + 1
    FROM
        {typeinfo} ti,
        typeinfo_tree tt
    WHERE
        (tt.elemtype IS NOT NULL AND ti.oid = tt.elemtype)
        OR (tt.attrtypoids IS NOT NULL AND ti.oid = any(tt.attrtypoids))
        OR (tt.range_subtype IS NOT NULL AND ti.oid = tt.range_subtype)
        OR (tt.basetype IS NOT NULL AND ti.oid = tt.basetype)
)

SELECT DISTINCT
    *,
    basetype::regtype::text AS basetype_name,
    elemtype::regtype::text AS elemtype_name,
    range_subtype::regtype::text AS range_subtype_name
FROM
    typeinfo_tree
ORDER BY
    depth DESC
""".format(typeinfo=ASYNCPG_TYPEINFO), ["{1009,3904,16}"]),
    # TYPE_BY_NAME, what set_type_codec() looks up first
    "asyncpg type by name": (ASYNCPG, """SELECT
    t.oid,
    t.typelem     AS elemtype,
    t.typtype     AS kind
FROM
    pg_catalog.pg_type AS t
    INNER JOIN pg_catalog.pg_namespace ns ON (ns.oid = t.typnamespace)
WHERE
    t.typname = $1 AND ns.nspname = $2
""", ["int4", "pg_catalog"]),
    # GenerateLoadTypesQuery(withRange: true, withMultirange: true, loadTableComposites: false,
    # schemaListSqlFragment: null, hasTypeCategory: true), with its -- comments
    "Npgsql type loading": (NPGSQL, """
SELECT ns.nspname, t.oid, t.typname, t.typtype, t.typnotnull, t.elemtypoid
FROM (
    -- Arrays have typtype=b - this subquery identifies them by their typreceive and converts their typtype to a
    -- We first do this for the type (innerest-most subquery), and then for its element type
    -- This also returns the array element, range subtype and domain base type as elemtypoid
    SELECT
        typ.oid, typ.typnamespace, typ.typname, typ.typtype, typ.typrelid, typ.typnotnull, typ.relkind,
        elemtyp.oid AS elemtypoid, elemtyp.typname AS elemtypname, elemcls.relkind AS elemrelkind,
        CASE WHEN elemproc.proname='array_recv' THEN 'a' ELSE elemtyp.typtype END AS elemtyptype
        , typ.typcategory
    FROM (
        SELECT typ.oid, typnamespace, typname, typrelid, typnotnull, relkind, typelem AS elemoid,
            CASE WHEN proc.proname='array_recv' THEN 'a' ELSE typ.typtype END AS typtype,
            CASE
                WHEN proc.proname='array_recv' THEN typ.typelem
                WHEN typ.typtype='r' THEN rngsubtype
                WHEN typ.typtype='m' THEN (SELECT rngtypid FROM pg_range WHERE rngmultitypid = typ.oid)
                WHEN typ.typtype='d' THEN typ.typbasetype
            END AS elemtypoid
            , typ.typcategory
        FROM pg_type AS typ
        LEFT JOIN pg_class AS cls ON (cls.oid = typ.typrelid)
        LEFT JOIN pg_proc AS proc ON proc.oid = typ.typreceive
        LEFT JOIN pg_range ON (pg_range.rngtypid = typ.oid)
    ) AS typ
    LEFT JOIN pg_type AS elemtyp ON elemtyp.oid = elemtypoid
    LEFT JOIN pg_class AS elemcls ON (elemcls.oid = elemtyp.typrelid)
    LEFT JOIN pg_proc AS elemproc ON elemproc.oid = elemtyp.typreceive
) AS t
JOIN pg_namespace AS ns ON (ns.oid = typnamespace)
WHERE
    (typtype IN ('b', 'r', 'm', 'e', 'd') OR -- Base, range, multirange, enum, domain
    (typtype = 'c' AND relkind='c') OR -- User-defined free-standing composites (not table composites) by default
    (typtype = 'p' AND typname IN ('record', 'void', 'unknown')) OR -- Some special supported pseudo-types
    (typtype = 'a' AND (  -- Array of...
        elemtyptype IN ('b', 'r', 'm', 'e', 'd') OR -- Array of base, range, multirange, enum, domain
        (elemtyptype = 'p' AND elemtypname IN ('record', 'void')) OR -- Arrays of special supported pseudo-types
        (elemtyptype = 'c' AND elemrelkind='c') -- Array of user-defined free-standing composites (not table composites) by default
    )))
ORDER BY CASE
       WHEN typtype IN ('b', 'e', 'p') THEN 0           -- First base types, enums, pseudo-types
       WHEN typtype = 'c' THEN 1                        -- Composites after (fields loaded later in 2nd pass)
       WHEN typtype = 'r' THEN 2                        -- Ranges after
       WHEN typtype = 'm' THEN 3                        -- Multiranges after
       WHEN typtype = 'd' AND elemtyptype <> 'a' THEN 4 -- Domains over non-arrays after
       WHEN typtype = 'a' THEN 5                        -- Arrays after
       WHEN typtype = 'd' AND elemtyptype = 'a' THEN 6  -- Domains over arrays last
END;""", []),
    # GenerateLoadEnumFieldsQuery(withEnumSortOrder: true, schemaListSqlFragment: null)
    "Npgsql enum labels": (NPGSQL, """
-- Load enum fields
SELECT typ.oid, enumlabel
FROM pg_enum
JOIN pg_type AS typ ON typ.oid = enumtypid
JOIN pg_namespace AS ns ON ns.oid = typ.typnamespace

ORDER BY oid, enumsortorder;""", []),
    # "SELECT * FROM ad<TAB>": tables, views and schemas whose names start with what was typed
    "psql tab completion of a table": (TAB_COMPLETE, """SELECT c.relname, NULL::pg_catalog.text
 FROM pg_catalog.pg_class c WHERE c.relkind IN ('r', 'p', 'f', 'v', 'm') AND (c.relname) LIKE 'ad%'
 AND pg_catalog.pg_table_is_visible(c.oid)
 AND c.relnamespace <> (SELECT oid FROM pg_catalog.pg_namespace WHERE nspname = 'pg_catalog')
UNION ALL
SELECT NULL::pg_catalog.text, n.nspname FROM pg_catalog.pg_namespace n WHERE n.nspname LIKE 'ad%'
 AND n.nspname NOT LIKE E'pg\\\\_%'
LIMIT 1000""", []),
    # "SELECT a<TAB>" after "FROM adult" is read: the columns of the tables named in the statement
    "psql tab completion of a column": (TAB_COMPLETE, """SELECT a.attname FROM pg_catalog.pg_attribute a,
 pg_catalog.pg_class c WHERE c.oid = a.attrelid AND a.attnum > 0 AND NOT a.attisdropped AND (a.attname) LIKE 'a%'
 AND c.relname='adult' AND pg_catalog.pg_table_is_visible(c.oid)
LIMIT 1000""", []),
}

EMPTY_ON_DEMO = {"Npgsql enum labels", "pgjdbc getImportedKeys"}  # the demo has no enum types, no foreign key


def as_role(truth: psycopg.Connection[Any], role: str, statement: str, values: list[Any]
            ) -> tuple[list[str], list[tuple[Any, ...]]]:
    """PostgreSQL's own answer to ``statement`` for ``role``: run directly under SET ROLE."""
    truth.execute(sql.SQL("set role {}").format(sql.Identifier(role)))
    try:
        return _answer(truth, statement, values)
    finally:
        truth.execute("reset role")


def _answer(conn: psycopg.Connection[Any], statement: str, values: list[Any]
            ) -> tuple[list[str], list[tuple[Any, ...]]]:
    """``statement`` with ``values`` bound server-side to its $1, $2 (a raw cursor sends the text as it is)."""
    cursor = psycopg.RawCursor(conn)
    cursor.execute(statement, values or None)
    return [column.name for column in cursor.description or []], cursor.fetchall()


@pytest.mark.parametrize("name", CATALOG_READS)
def test_catalog_reads_answered_as_postgresql(name: str, reporter: psycopg.Connection[Any],
                                              analyst: psycopg.Connection[Any],
                                              truth: psycopg.Connection[Any]) -> None:
    _, statement, values = CATALOG_READS[name]
    for conn in (reporter, analyst):
        got = _answer(conn, statement, values)
        expected = as_role(truth, conn.info.user, statement, values)
        assert got == expected, (conn.info.user, name)
        assert got[1] or name in EMPTY_ON_DEMO, "the read has rows on the demo database"


# psql meta-commands: postgres/postgres src/bin/psql/describe.c of PostgreSQL 15 (run by the installed psql 15
# binary, not read), each with a text its output on the demo database holds (None: may be empty)
PSQL_COMMANDS = {r"\dt": "adult", r"\d public.adult": 'Table "public.adult"', r"\d+ public.adult": "Access method",
                 r"\dn": "public", r"\df": None, r"\l": "anonproxy_gated", r"\du": "reporter", r"\dv": None,
                 r"\di": "adult", r"\dT": None, r"\dd": None}


def psql(conninfo: str, *commands: str, role: str | None = None) -> subprocess.CompletedProcess[str]:
    """The psql binary, each of ``commands`` as one -c, without psqlrc; ``role`` as a startup ``role`` setting."""
    environment = dict(os.environ, PGOPTIONS=f"-c role={role}") if role else dict(os.environ)
    arguments = ["psql", conninfo, "-X", "-v", "ON_ERROR_STOP=1"]
    for command in commands:
        arguments += ["-c", command]
    return subprocess.run(arguments, capture_output=True, text=True, timeout=60, env=environment)


@pytest.mark.parametrize("command", PSQL_COMMANDS)
def test_psql_describes_as_postgresql(command: str, reporter: psycopg.Connection[Any],
                                      analyst: psycopg.Connection[Any], gated_proxy: Endpoint,
                                      gated_database: str, pg_server: EmbeddedPostgres) -> None:
    for role in (reporter.info.user, analyst.info.user):
        through = psql(gated_proxy.url(gated_database, user=role), command)
        direct = psql(pg_server.conninfo(dbname=gated_database), command, role=role)
        assert through.returncode == 0, through.stderr
        assert direct.returncode == 0, direct.stderr
        assert through.stdout == direct.stdout, (role, command)
        shown = PSQL_COMMANDS[command]
        assert shown is None or shown in through.stdout, through.stdout


def test_psql_expanded_display_of_a_catalog_read(reporter: psycopg.Connection[Any], gated_proxy: Endpoint,
                                                 gated_database: str, pg_server: EmbeddedPostgres) -> None:
    """``\\x`` then a catalog query: the same expanded record as PostgreSQL's."""
    query = "select relname, relkind, relnatts from pg_class where relname = 'adult'"
    through = psql(gated_proxy.url(gated_database, user="reporter"), r"\x", query)
    direct = psql(pg_server.conninfo(dbname=gated_database), r"\x", query, role="reporter")
    assert through.returncode == 0, through.stderr
    assert through.stdout == direct.stdout
    assert "-[ RECORD 1 ]" in through.stdout and "relname  | adult" in through.stdout


def completed(conninfo: str, typed: bytes, expected: bytes, role: str | None = None) -> bytes:
    """What interactive psql (readline, in a terminal) shows after ``typed``, its last key a TAB: read until
    ``expected`` appears, psql ends, or a bound on a hang passes."""
    pid, terminal = pty.fork()
    if pid == 0:  # the child: psql on the terminal
        try:
            os.environ.update({"TERM": "dumb", **({"PGOPTIONS": f"-c role={role}"} if role else {})})
            os.execvp("psql", ["psql", conninfo, "-X"])
        finally:
            os._exit(127)  # reached only when psql could not start: the child must not go on as pytest
    shown = _read(terminal, b"=> ")
    os.write(terminal, typed)
    shown += _read(terminal, expected)
    os.write(terminal, b"\x15\\q\n")  # clear the line, quit
    os.waitpid(pid, 0)
    os.close(terminal)
    return shown


def _read(terminal: int, until: bytes) -> bytes:
    shown = b""
    deadline = time.monotonic() + 60  # a bound on a hang, not a timing
    while until not in shown and time.monotonic() < deadline:
        if select.select([terminal], [], [], 0.5)[0]:
            try:
                chunk = os.read(terminal, 4096)
            except OSError:  # psql has ended
                break
            shown += chunk
    return shown


# psql's tab completion (postgres/postgres src/bin/psql/tab-complete.c of PostgreSQL 15, run by the installed psql
# 15 with readline, not read): a table name after FROM, a column of the table the statement names
COMPLETIONS = {"table": (b"select age from ad\t", b"select age from adult "),
               "column": (b"select * from adult where ag\t", b"select * from adult where age ")}


@pytest.mark.parametrize("what", COMPLETIONS)
def test_psql_tab_completion_as_postgresql(what: str, reporter: psycopg.Connection[Any],
                                           analyst: psycopg.Connection[Any], gated_proxy: Endpoint,
                                           gated_database: str, pg_server: EmbeddedPostgres) -> None:
    typed, expected = COMPLETIONS[what]
    for role in (reporter.info.user, analyst.info.user):
        assert expected in completed(pg_server.conninfo(dbname=gated_database), typed, expected, role=role)
        assert expected in completed(gated_proxy.url(gated_database, user=role), typed, expected), role


def test_psql_preview_of_a_protected_table_is_refused(gated_proxy: Endpoint, gated_database: str) -> None:
    """What a GUI's "view data" sends, typed in psql: refused with a SQLSTATE and a message, no rows."""
    refused = psql(gated_proxy.url(gated_database, user="reporter"), "SELECT * FROM public.adult LIMIT 100")
    assert refused.returncode != 0
    assert "ERROR:" in refused.stderr and "Traceback" not in refused.stderr
    assert refused.stdout == ""


# SQLAlchemy's PostgreSQL reflection: sqlalchemy/sqlalchemy lib/sqlalchemy/dialects/postgresql/base.py (run by the
# installed package, not read: Inspector.get_columns and the rest build their queries from pg_catalog tables there)
def _inspected(dsn: str, options: str | None = None) -> dict[str, Any]:
    """What SQLAlchemy's Inspector reports about the demo schema over a connection to ``dsn``."""
    engine = sqlalchemy.create_engine(
        "postgresql+psycopg://", creator=lambda: psycopg.connect(dsn, options=options) if options
        else psycopg.connect(dsn), poolclass=sqlalchemy.pool.NullPool)
    try:
        inspector = sqlalchemy.inspect(engine)
        return {
            "schemas": inspector.get_schema_names(),
            "tables": inspector.get_table_names(schema="public"),
            "views": inspector.get_view_names(schema="public"),
            "has adult": inspector.has_table("adult", schema="public"),
            "has nothing": inspector.has_table("no_such_table", schema="public"),
            "columns": [{**column, "type": str(column["type"])} for column in inspector.get_columns("adult", "public")],
            "primary key": inspector.get_pk_constraint("adult", schema="public"),
            "foreign keys": inspector.get_foreign_keys("visits", schema="public"),
            "indexes": inspector.get_indexes("adult", schema="public"),
            "unique": inspector.get_unique_constraints("adult", schema="public"),
            "checks": inspector.get_check_constraints("adult", schema="public"),
            "comment": inspector.get_table_comment("adult", schema="public"),
        }
    finally:
        engine.dispose()


def test_sqlalchemy_reflection_as_postgresql(reporter: psycopg.Connection[Any], analyst: psycopg.Connection[Any],
                                             gated_proxy: Endpoint, gated_database: str,
                                             pg_server: EmbeddedPostgres) -> None:
    for role in (reporter.info.user, analyst.info.user):
        through = _inspected(gated_proxy.dsn(gated_database, user=role))
        direct = _inspected(pg_server.conninfo(dbname=gated_database), options=f"-c role={role}")
        assert through == direct, role
        assert through["has adult"] and [column["name"] for column in through["columns"]][0] == "id"


@pytest.fixture(name="adult_analyzed")
def fixture_adult_analyzed(truth: psycopg.Connection[Any]) -> None:
    """adult with statistics, so that pg_stats has rows for it for whoever may read them."""
    truth.execute("analyze public.adult")


def test_pg_stats_of_a_protected_table_are_postgresql_s_answer_for_the_role(
        adult_analyzed: None, reporter: psycopg.Connection[Any], analyst: psycopg.Connection[Any],
        truth: psycopg.Connection[Any]) -> None:
    """pg_stats hides the statistics of columns the role may not SELECT: none of adult's, as on PostgreSQL."""
    query = ("select attname, most_common_vals::text, histogram_bounds::text from pg_stats "
             "where schemaname = 'public' and tablename = 'adult'")
    assert truth.execute(query).fetchall(), "the owner sees adult's statistics"
    for conn in (reporter, analyst):
        assert _answer(conn, query, []) == as_role(truth, conn.info.user, query, []) == (
            ["attname", "most_common_vals", "histogram_bounds"], [])


# Statement, the error, a text of its message. The previews are written from memory of the tools, not read.
REFUSED_READS: dict[str, tuple[str, type[psycopg.Error], str]] = {
    # DBeaver's and DataGrip's data editor: the first page of rows (from memory)
    "row preview": ("SELECT * FROM public.adult LIMIT 200", psycopg.errors.InsufficientPrivilege,
                    "SELECT * is not allowed over protected tables"),
    # pgAdmin's "View/Edit Data > First 100 Rows" (from memory)
    "first rows": ("SELECT * FROM public.adult ORDER BY id ASC LIMIT 100", psycopg.errors.InsufficientPrivilege,
                   "SELECT * is not allowed over protected tables"),
    "table sample": ("SELECT count(*) FROM public.adult TABLESAMPLE SYSTEM (10)", psycopg.errors.InsufficientPrivilege,
                     "TABLESAMPLE is not allowed over protected tables"),
    "raw statistics": ("SELECT stanullfrac, stavalues1::text FROM pg_catalog.pg_statistic "
                       "WHERE starelid = 'public.adult'::regclass", psycopg.errors.InsufficientPrivilege,
                       "pg_statistic is not available"),
    # an object identifier array parses since round 18; over protected rows its cast stays refused
    "oid array over protected rows": ("SELECT count(*) FROM public.adult WHERE id::oid = any('{1,2}'::oid[])",
                                      psycopg.errors.FeatureNotSupported, "cast to OID is not allowed"),
}


@pytest.mark.parametrize("name", REFUSED_READS)
def test_reads_of_protected_data_are_refused(name: str, reporter: psycopg.Connection[Any],
                                            analyst: psycopg.Connection[Any]) -> None:
    statement, error, message = REFUSED_READS[name]
    for conn in (reporter, analyst):
        with pytest.raises(error) as refused:
            conn.execute(statement)
        assert message in (refused.value.diag.message_primary or ""), refused.value
