-- Migration 0015: privilege probes answered as the proxy answers queries.
--
-- A role in mode suppress or dp holds no SELECT on protected and linked tables:
-- a statement that reaches PostgreSQL as that role without the proxy's rewrite
-- must fail. But BI tools ask PostgreSQL what they may read before they list a
-- table (has_table_privilege, information_schema.table_privileges…), and hide
-- what it denies. The proxy rewrites such probes, in statements that read no
-- protected table, to the functions and views below (anonproxy.rewrite.probes)
-- and runs them on the client's own connection.
--
-- Each function has the name and the argument types of PostgreSQL's own, so an
-- overload resolves the same way. It asks PostgreSQL first: its errors stay
-- (42P01 unknown table, 42703 unknown column, 42704 unknown role, 22023 unknown
-- privilege type), and so does its answer, except where it is false, the role
-- is one the proxy answers (mode suppress or dp), the table is protected or
-- linked by the policy, and the privileges asked for include plain SELECT: the
-- proxy answers aggregate queries over that table, so it says true. Every
-- other privilege (INSERT, UPDATE, SELECT WITH GRANT OPTION…) keeps
-- PostgreSQL's answer. The views add, to PostgreSQL's rows, a SELECT grant by
-- the table's owner to each such role, and so do the access lists that tools
-- parse themselves (pgjdbc's getTablePrivileges reads pg_class.relacl).
--
-- The functions run with the caller's rights (SECURITY INVOKER) and, unlike the
-- policy functions, set no search_path: a table named by text must resolve
-- under the caller's search_path exactly as in PostgreSQL's function. Every
-- name inside is schema-qualified. The views read only what every role may
-- read (the policy tables, granted to PUBLIC, and the catalogs).

-- Whether the proxy answers queries of role ``role_oid`` over relation ``rel`` and ``privileges`` (a list
-- as PostgreSQL's privilege functions take it, already checked by them) asks for plain SELECT.
create function anonproxy.proxy_answers(role_oid oid, rel oid, privileges text) returns boolean
language sql stable as $$
    select exists (select from anonproxy.role_policies p join pg_catalog.pg_roles r on r.rolname = p.role_name
                    where r.oid = role_oid and p.mode in ('suppress', 'dp'))
       and exists (select from anonproxy.protected_tables t where pg_catalog.to_regclass(t.table_name) = rel
                   union all
                   select from anonproxy.linked_tables l where pg_catalog.to_regclass(l.table_name) = rel)
       and exists (select from pg_catalog.unnest(pg_catalog.string_to_array(privileges, ',')) asked (word)
                    where pg_catalog.lower(pg_catalog.btrim(asked.word, E' \t\n\r\f')) = 'select')
$$;

-- The oid of a role named as PostgreSQL's privilege functions take it (NULL for PUBLIC, which is no role).
create function anonproxy.probed_role(role_name name) returns oid
language sql stable as $$
    select r.oid from pg_catalog.pg_roles r where r.rolname = role_name
$$;


-- has_table_privilege ----------------------------------------------------------------------------

create function anonproxy.has_table_privilege(role_name name, tbl text, privileges text) returns boolean
language sql stable as $$
    select case pg_catalog.has_table_privilege(role_name, tbl, privileges)
           when true then true
           when false then anonproxy.proxy_answers(anonproxy.probed_role(role_name), tbl::regclass, privileges) end
$$;

create function anonproxy.has_table_privilege(role_name name, tbl oid, privileges text) returns boolean
language sql stable as $$
    select case pg_catalog.has_table_privilege(role_name, tbl, privileges)
           when true then true
           when false then anonproxy.proxy_answers(anonproxy.probed_role(role_name), tbl, privileges) end
$$;

create function anonproxy.has_table_privilege(role_oid oid, tbl text, privileges text) returns boolean
language sql stable as $$
    select case pg_catalog.has_table_privilege(role_oid, tbl, privileges)
           when true then true
           when false then anonproxy.proxy_answers(role_oid, tbl::regclass, privileges) end
$$;

create function anonproxy.has_table_privilege(role_oid oid, tbl oid, privileges text) returns boolean
language sql stable as $$
    select case pg_catalog.has_table_privilege(role_oid, tbl, privileges)
           when true then true
           when false then anonproxy.proxy_answers(role_oid, tbl, privileges) end
$$;

create function anonproxy.has_table_privilege(tbl text, privileges text) returns boolean
language sql stable as $$
    select case pg_catalog.has_table_privilege(tbl, privileges)
           when true then true
           when false then anonproxy.proxy_answers(anonproxy.probed_role(current_user), tbl::regclass, privileges) end
$$;

create function anonproxy.has_table_privilege(tbl oid, privileges text) returns boolean
language sql stable as $$
    select case pg_catalog.has_table_privilege(tbl, privileges)
           when true then true
           when false then anonproxy.proxy_answers(anonproxy.probed_role(current_user), tbl, privileges) end
$$;


-- has_any_column_privilege -----------------------------------------------------------------------

create function anonproxy.has_any_column_privilege(role_name name, tbl text, privileges text) returns boolean
language sql stable as $$
    select case pg_catalog.has_any_column_privilege(role_name, tbl, privileges)
           when true then true
           when false then anonproxy.proxy_answers(anonproxy.probed_role(role_name), tbl::regclass, privileges) end
$$;

create function anonproxy.has_any_column_privilege(role_name name, tbl oid, privileges text) returns boolean
language sql stable as $$
    select case pg_catalog.has_any_column_privilege(role_name, tbl, privileges)
           when true then true
           when false then anonproxy.proxy_answers(anonproxy.probed_role(role_name), tbl, privileges) end
$$;

create function anonproxy.has_any_column_privilege(role_oid oid, tbl text, privileges text) returns boolean
language sql stable as $$
    select case pg_catalog.has_any_column_privilege(role_oid, tbl, privileges)
           when true then true
           when false then anonproxy.proxy_answers(role_oid, tbl::regclass, privileges) end
$$;

create function anonproxy.has_any_column_privilege(role_oid oid, tbl oid, privileges text) returns boolean
language sql stable as $$
    select case pg_catalog.has_any_column_privilege(role_oid, tbl, privileges)
           when true then true
           when false then anonproxy.proxy_answers(role_oid, tbl, privileges) end
$$;

create function anonproxy.has_any_column_privilege(tbl text, privileges text) returns boolean
language sql stable as $$
    select case pg_catalog.has_any_column_privilege(tbl, privileges)
           when true then true
           when false then anonproxy.proxy_answers(anonproxy.probed_role(current_user), tbl::regclass, privileges) end
$$;

create function anonproxy.has_any_column_privilege(tbl oid, privileges text) returns boolean
language sql stable as $$
    select case pg_catalog.has_any_column_privilege(tbl, privileges)
           when true then true
           when false then anonproxy.proxy_answers(anonproxy.probed_role(current_user), tbl, privileges) end
$$;


-- has_column_privilege: a column named or numbered (smallint) ----------------------------------------

create function anonproxy.has_column_privilege(role_name name, tbl text, col text, privileges text)
returns boolean language sql stable as $$
    select case pg_catalog.has_column_privilege(role_name, tbl, col, privileges)
           when true then true
           when false then anonproxy.proxy_answers(anonproxy.probed_role(role_name), tbl::regclass, privileges) end
$$;

create function anonproxy.has_column_privilege(role_name name, tbl text, col smallint, privileges text)
returns boolean language sql stable as $$
    select case pg_catalog.has_column_privilege(role_name, tbl, col, privileges)
           when true then true
           when false then anonproxy.proxy_answers(anonproxy.probed_role(role_name), tbl::regclass, privileges) end
$$;

create function anonproxy.has_column_privilege(role_name name, tbl oid, col text, privileges text)
returns boolean language sql stable as $$
    select case pg_catalog.has_column_privilege(role_name, tbl, col, privileges)
           when true then true
           when false then anonproxy.proxy_answers(anonproxy.probed_role(role_name), tbl, privileges) end
$$;

create function anonproxy.has_column_privilege(role_name name, tbl oid, col smallint, privileges text)
returns boolean language sql stable as $$
    select case pg_catalog.has_column_privilege(role_name, tbl, col, privileges)
           when true then true
           when false then anonproxy.proxy_answers(anonproxy.probed_role(role_name), tbl, privileges) end
$$;

create function anonproxy.has_column_privilege(role_oid oid, tbl text, col text, privileges text)
returns boolean language sql stable as $$
    select case pg_catalog.has_column_privilege(role_oid, tbl, col, privileges)
           when true then true
           when false then anonproxy.proxy_answers(role_oid, tbl::regclass, privileges) end
$$;

create function anonproxy.has_column_privilege(role_oid oid, tbl text, col smallint, privileges text)
returns boolean language sql stable as $$
    select case pg_catalog.has_column_privilege(role_oid, tbl, col, privileges)
           when true then true
           when false then anonproxy.proxy_answers(role_oid, tbl::regclass, privileges) end
$$;

create function anonproxy.has_column_privilege(role_oid oid, tbl oid, col text, privileges text)
returns boolean language sql stable as $$
    select case pg_catalog.has_column_privilege(role_oid, tbl, col, privileges)
           when true then true
           when false then anonproxy.proxy_answers(role_oid, tbl, privileges) end
$$;

create function anonproxy.has_column_privilege(role_oid oid, tbl oid, col smallint, privileges text)
returns boolean language sql stable as $$
    select case pg_catalog.has_column_privilege(role_oid, tbl, col, privileges)
           when true then true
           when false then anonproxy.proxy_answers(role_oid, tbl, privileges) end
$$;

create function anonproxy.has_column_privilege(tbl text, col text, privileges text) returns boolean
language sql stable as $$
    select case pg_catalog.has_column_privilege(tbl, col, privileges)
           when true then true
           when false then anonproxy.proxy_answers(anonproxy.probed_role(current_user), tbl::regclass, privileges) end
$$;

create function anonproxy.has_column_privilege(tbl text, col smallint, privileges text) returns boolean
language sql stable as $$
    select case pg_catalog.has_column_privilege(tbl, col, privileges)
           when true then true
           when false then anonproxy.proxy_answers(anonproxy.probed_role(current_user), tbl::regclass, privileges) end
$$;

create function anonproxy.has_column_privilege(tbl oid, col text, privileges text) returns boolean
language sql stable as $$
    select case pg_catalog.has_column_privilege(tbl, col, privileges)
           when true then true
           when false then anonproxy.proxy_answers(anonproxy.probed_role(current_user), tbl, privileges) end
$$;

create function anonproxy.has_column_privilege(tbl oid, col smallint, privileges text) returns boolean
language sql stable as $$
    select case pg_catalog.has_column_privilege(tbl, col, privileges)
           when true then true
           when false then anonproxy.proxy_answers(anonproxy.probed_role(current_user), tbl, privileges) end
$$;


-- Access lists, for tools that parse them (pg_class.relacl, pg_attribute.attacl) ---------------------

-- One SELECT grant, by the table's owner, to each role the proxy answers, when ``rel`` is protected or linked;
-- NULL otherwise.
create function anonproxy.proxy_grants(rel oid) returns aclitem[]
language sql stable as $$
    select pg_catalog.array_agg(pg_catalog.makeaclitem(r.oid, c.relowner, 'SELECT', false) order by r.rolname)
      from pg_catalog.pg_class c
      cross join anonproxy.role_policies p
      join pg_catalog.pg_roles r on r.rolname = p.role_name
     where c.oid = rel and p.mode in ('suppress', 'dp')
       and exists (select from anonproxy.protected_tables t where pg_catalog.to_regclass(t.table_name) = c.oid
                   union all
                   select from anonproxy.linked_tables l where pg_catalog.to_regclass(l.table_name) = c.oid)
$$;

-- pg_class.relacl of ``rel`` with those grants added (NULL, the owner's default rights, is spelt out first).
create function anonproxy.relacl(rel oid, acl aclitem[]) returns aclitem[]
language sql stable as $$
    select case when g.grants is null then acl
                else pg_catalog.array_cat(coalesce(acl, pg_catalog.acldefault('r', c.relowner)), g.grants) end
      from (select anonproxy.proxy_grants(rel) as grants) g
      left join pg_catalog.pg_class c on c.oid = rel
$$;

-- pg_attribute.attacl of a column of ``rel`` with those grants added (NULL: no column grants of its own).
create function anonproxy.attacl(rel oid, acl aclitem[]) returns aclitem[]
language sql stable as $$
    select case when g.grants is null then acl
                else pg_catalog.array_cat(coalesce(acl, '{}'::aclitem[]), g.grants) end
      from (select anonproxy.proxy_grants(rel) as grants) g
$$;


-- The information_schema privilege views -------------------------------------------------------------

-- The SELECT the proxy stands for: granted by the table's owner to each role it answers, shown (as in
-- information_schema) to the roles that are, or inherit, the grantee or the grantor.
create view anonproxy.proxy_table_grants as
select o.rolname as grantor, r.rolname as grantee, r.oid as grantee_oid, n.nspname as table_schema,
       c.relname as table_name, c.oid as relid
  from (select t.table_name from anonproxy.protected_tables t
        union all
        select l.table_name from anonproxy.linked_tables l) guarded
  join pg_catalog.pg_class c on c.oid = pg_catalog.to_regclass(guarded.table_name)
  join pg_catalog.pg_namespace n on n.oid = c.relnamespace
  join pg_catalog.pg_roles o on o.oid = c.relowner
  cross join anonproxy.role_policies p
  join pg_catalog.pg_roles r on r.rolname = p.role_name
 where p.mode in ('suppress', 'dp')
   and (pg_catalog.pg_has_role(r.oid, 'USAGE') or pg_catalog.pg_has_role(o.oid, 'USAGE'));

create view anonproxy.table_privileges as
select * from information_schema.table_privileges
union all
select g.grantor::information_schema.sql_identifier, g.grantee::information_schema.sql_identifier,
       pg_catalog.current_database()::information_schema.sql_identifier,
       g.table_schema::information_schema.sql_identifier, g.table_name::information_schema.sql_identifier,
       'SELECT'::information_schema.character_data, 'NO'::information_schema.yes_or_no,
       'YES'::information_schema.yes_or_no
  from anonproxy.proxy_table_grants g;

create view anonproxy.role_table_grants as
select * from information_schema.role_table_grants
union all
select g.grantor::information_schema.sql_identifier, g.grantee::information_schema.sql_identifier,
       pg_catalog.current_database()::information_schema.sql_identifier,
       g.table_schema::information_schema.sql_identifier, g.table_name::information_schema.sql_identifier,
       'SELECT'::information_schema.character_data, 'NO'::information_schema.yes_or_no,
       'YES'::information_schema.yes_or_no
  from anonproxy.proxy_table_grants g
 where g.grantee in (select e.role_name from information_schema.enabled_roles e)
    or g.grantor in (select e.role_name from information_schema.enabled_roles e);

create view anonproxy.column_privileges as
select * from information_schema.column_privileges
union all
select g.grantor::information_schema.sql_identifier, g.grantee::information_schema.sql_identifier,
       pg_catalog.current_database()::information_schema.sql_identifier,
       g.table_schema::information_schema.sql_identifier, g.table_name::information_schema.sql_identifier,
       a.attname::information_schema.sql_identifier, 'SELECT'::information_schema.character_data,
       'NO'::information_schema.yes_or_no
  from anonproxy.proxy_table_grants g
  join pg_catalog.pg_attribute a on a.attrelid = g.relid and a.attnum > 0 and not a.attisdropped;

create view anonproxy.role_column_grants as
select * from information_schema.role_column_grants
union all
select g.grantor::information_schema.sql_identifier, g.grantee::information_schema.sql_identifier,
       pg_catalog.current_database()::information_schema.sql_identifier,
       g.table_schema::information_schema.sql_identifier, g.table_name::information_schema.sql_identifier,
       a.attname::information_schema.sql_identifier, 'SELECT'::information_schema.character_data,
       'NO'::information_schema.yes_or_no
  from anonproxy.proxy_table_grants g
  join pg_catalog.pg_attribute a on a.attrelid = g.relid and a.attnum > 0 and not a.attisdropped
 where g.grantee in (select e.role_name from information_schema.enabled_roles e)
    or g.grantor in (select e.role_name from information_schema.enabled_roles e);

grant select on anonproxy.proxy_table_grants, anonproxy.table_privileges, anonproxy.role_table_grants,
    anonproxy.column_privileges, anonproxy.role_column_grants to public;
