-- Migration 0002: the privacy policy, the functions that edit it, and the grants that enforce it.
--
-- The policy is data in these tables; the proxy reads it (anonproxy.policy.store)
-- and reloads it when NOTIFY anonproxy_policy announces a new version. Edit it
-- with the functions below (or `anonproxy policy apply FILE`), never with raw
-- DML: the functions validate every argument and keep the grants in step.
--
-- Security model (docs/policy.md): a role in mode suppress, dp or deny holds no
-- privilege on a protected or linked table except REFERENCES (so catalogs and
-- information_schema still list the columns); the proxy's service role holds
-- SELECT and runs the rewritten queries. A statement that reaches PostgreSQL
-- as such a role without going through the rewriter fails with 42501.
--
-- Names of tables are stored as format('%I.%I', schema, table): lower-case
-- `schema.table` for ordinary names, resolved with to_regclass at write time.
-- Every function runs with search_path = pg_catalog, pg_temp and qualifies
-- every name it uses; they run with the caller's rights (SECURITY INVOKER).

grant usage on schema anonproxy to public;

create table anonproxy.protected_tables (
    table_name text primary key,
    unit_column name not null
);
comment on table anonproxy.protected_tables is
    'Tables whose rows belong to people; unit_column identifies the person (the privacy unit).';

create table anonproxy.linked_tables (
    table_name text primary key,
    link_column name not null,
    references_table text not null references anonproxy.protected_tables (table_name)
);
comment on table anonproxy.linked_tables is
    'Tables that reach a protected table''s privacy unit through link_column = references_table.unit_column.';

create table anonproxy.column_policies (
    table_name text not null,
    column_name name not null,
    kind text not null
        constraint column_kind check (kind in ('identifier', 'quasi_identifier', 'sensitive', 'public')),
    lower_bound numeric,
    upper_bound numeric,
    domain text[],
    primary key (table_name, column_name),
    constraint bounds_both_or_neither check ((lower_bound is null) = (upper_bound is null)),
    constraint bounds_ordered check (lower_bound <= upper_bound),
    constraint domain_not_empty check (cardinality(domain) > 0)
);
comment on table anonproxy.column_policies is
    'Per column of a protected or linked table: its kind, declared numeric bounds, public value domain.';

create table anonproxy.role_policies (
    role_name name primary key,
    mode text not null constraint role_mode check (mode in ('direct', 'suppress', 'dp', 'deny')),
    k integer not null default 10 constraint k_at_least_2 check (k >= 2),
    dominance_n integer constraint dominance_n_positive check (dominance_n >= 1),
    dominance_percent numeric
        constraint dominance_percent_range check (dominance_percent > 0 and dominance_percent <= 100),
    p_percent numeric constraint p_percent_positive check (p_percent > 0),
    suppressed_rest boolean not null default false,
    allow_min_max boolean not null default false,
    constraint dominance_both_or_neither check ((dominance_n is null) = (dominance_percent is null))
);
comment on table anonproxy.role_policies is
    'Per database role: how the proxy answers it. Roles not listed are direct (PostgreSQL''s grants decide).';

create table anonproxy.settings (
    singleton boolean primary key default true constraint one_row check (singleton),
    service_role name not null default 'anonproxy_service'
);
insert into anonproxy.settings default values;
comment on table anonproxy.settings is
    'service_role: the role the proxy''s service connection logs in as; it alone may SELECT protected tables.';

create table anonproxy.policy_version (
    singleton boolean primary key default true constraint one_row check (singleton),
    version bigint not null default 0,
    changed_in xid8  -- the transaction that last bumped the version
);
insert into anonproxy.policy_version default values;
comment on table anonproxy.policy_version is
    'Bumped once per transaction that changes the policy; the new value is sent with NOTIFY anonproxy_policy.';

-- The policy is not secret: everyone may read it, only the owner may change it.
grant select on anonproxy.protected_tables, anonproxy.linked_tables, anonproxy.column_policies,
    anonproxy.role_policies, anonproxy.settings, anonproxy.policy_version to public;


-- Version and notification ---------------------------------------------------

-- SECURITY DEFINER so that whoever may edit the policy need not write policy_version.
create function anonproxy.policy_changed() returns trigger
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    new_version bigint;
begin
    update anonproxy.policy_version
       set version = version + 1, changed_in = pg_catalog.pg_current_xact_id()
     where changed_in is distinct from pg_catalog.pg_current_xact_id()
    returning version into new_version;
    if found then
        -- Delivered at commit, and only if the transaction commits.
        perform pg_catalog.pg_notify('anonproxy_policy', new_version::text);
    end if;
    return null;
end
$$;

create trigger policy_changed after insert or update or delete or truncate on anonproxy.protected_tables
    for each statement execute function anonproxy.policy_changed();
create trigger policy_changed after insert or update or delete or truncate on anonproxy.linked_tables
    for each statement execute function anonproxy.policy_changed();
create trigger policy_changed after insert or update or delete or truncate on anonproxy.column_policies
    for each statement execute function anonproxy.policy_changed();
create trigger policy_changed after insert or update or delete or truncate on anonproxy.role_policies
    for each statement execute function anonproxy.policy_changed();
create trigger policy_changed after insert or update or delete or truncate on anonproxy.settings
    for each statement execute function anonproxy.policy_changed();


-- Helpers ----------------------------------------------------------------------

-- The stored name of a table the policy may cover: 'schema.table', quoted where needed.
create function anonproxy.policy_table_name(tbl regclass) returns text
language plpgsql stable set search_path = pg_catalog, pg_temp as $$
declare
    rel record;
begin
    if tbl is null then
        raise exception using errcode = '22004', message = 'table must not be null';
    end if;
    select c.relname, c.relkind, n.nspname into rel
      from pg_catalog.pg_class c join pg_catalog.pg_namespace n on n.oid = c.relnamespace
     where c.oid = tbl;
    if not found then
        raise exception using errcode = '42P01', message = format('relation with OID %s does not exist', tbl::oid);
    end if;
    if rel.relkind not in ('r', 'p', 'v', 'm', 'f') then
        raise exception using errcode = '42809',
            message = format('%I.%I is not a table, view or materialized view', rel.nspname, rel.relname);
    end if;
    if rel.nspname in ('pg_catalog', 'information_schema') or rel.nspname like 'pg\_%' then
        raise exception using errcode = '22023',
            message = format('%I.%I is a system or temporary table; the policy covers ordinary tables only',
                             rel.nspname, rel.relname);
    end if;
    return format('%I.%I', rel.nspname, rel.relname);
end
$$;

-- The type of a column, or an error naming the column and the table.
create function anonproxy.column_type(tbl regclass, column_name name) returns regtype
language plpgsql stable set search_path = pg_catalog, pg_temp as $$
declare
    found_type regtype;
begin
    if column_name is null then
        raise exception using errcode = '22004', message = 'column name must not be null';
    end if;
    select a.atttypid into found_type
      from pg_catalog.pg_attribute a
     where a.attrelid = tbl and a.attname = column_type.column_name and a.attnum > 0 and not a.attisdropped;
    if not found then
        raise exception using errcode = '42703',
            message = format('column "%s" does not exist in table %s', column_name, anonproxy.policy_table_name(tbl)),
            hint = format('columns of %s: %s', anonproxy.policy_table_name(tbl),
                          (select string_agg(a.attname, ', ' order by a.attnum) from pg_catalog.pg_attribute a
                            where a.attrelid = tbl and a.attnum > 0 and not a.attisdropped));
    end if;
    return found_type;
end
$$;

-- Resolve a table named by text to its stored name: the name as stored (even if
-- the table is gone), or else whatever a schema-qualified name resolves to.
create function anonproxy.stored_table_name(tbl text) returns text
language sql stable set search_path = pg_catalog, pg_temp as $$
    select coalesce(
        (select t.table_name from anonproxy.protected_tables t where t.table_name = tbl
          union all
         select l.table_name from anonproxy.linked_tables l where l.table_name = tbl
          limit 1),
        (select format('%I.%I', n.nspname, c.relname)
           from pg_catalog.pg_class c join pg_catalog.pg_namespace n on n.oid = c.relnamespace
          where c.oid = pg_catalog.to_regclass(tbl)),
        tbl)
$$;


-- Tables -----------------------------------------------------------------------

create function anonproxy.protect_table(tbl regclass, unit_column name) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    target text := anonproxy.policy_table_name(tbl);
begin
    perform anonproxy.column_type(tbl, unit_column);
    if exists (select from anonproxy.linked_tables l where l.table_name = target) then
        raise exception using errcode = '22023',
            message = format('table %s is a linked table', target),
            hint = format('unlink it first: select anonproxy.unlink_table(%L)', target);
    end if;
    insert into anonproxy.protected_tables (table_name, unit_column) values (target, unit_column)
        on conflict (table_name) do update set unit_column = excluded.unit_column;
    perform anonproxy.apply_grants();
end
$$;

create function anonproxy.link_table(tbl regclass, link_column name, referenced regclass) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    target text := anonproxy.policy_table_name(tbl);
    referenced_name text := anonproxy.policy_table_name(referenced);
begin
    perform anonproxy.column_type(tbl, link_column);
    if target = referenced_name then
        raise exception using errcode = '22023', message = format('table %s cannot link to itself', target);
    end if;
    if exists (select from anonproxy.protected_tables t where t.table_name = target) then
        raise exception using errcode = '22023',
            message = format('table %s is protected, so it cannot also be a linked table', target),
            hint = format('unprotect it first: select anonproxy.unprotect_table(%L)', target);
    end if;
    if not exists (select from anonproxy.protected_tables t where t.table_name = referenced_name) then
        raise exception using errcode = '22023',
            message = format('table %s, referenced by linked table %s, is not protected', referenced_name, target),
            hint = format('protect it first: select anonproxy.protect_table(%L, <unit column>)', referenced_name);
    end if;
    insert into anonproxy.linked_tables (table_name, link_column, references_table)
        values (target, link_column, referenced_name)
        on conflict (table_name) do update
            set link_column = excluded.link_column, references_table = excluded.references_table;
    perform anonproxy.apply_grants();
end
$$;

-- Takes text, not regclass, so that a table that was dropped or renamed can still be removed.
-- Removing a table from the policy does not give back the privileges apply_grants() revoked.
create function anonproxy.unprotect_table(tbl text) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    target text := anonproxy.stored_table_name(tbl);
    dependent text;
begin
    if not exists (select from anonproxy.protected_tables t where t.table_name = target) then
        raise exception using errcode = '42704', message = format('table %s is not protected', target),
            hint = 'give the schema-qualified name listed in anonproxy.protected_tables';
    end if;
    select l.table_name into dependent from anonproxy.linked_tables l where l.references_table = target limit 1;
    if found then
        raise exception using errcode = '2BP01',
            message = format('table %s is referenced by linked table %s', target, dependent),
            hint = format('unlink it first: select anonproxy.unlink_table(%L)', dependent);
    end if;
    delete from anonproxy.column_policies c where c.table_name = target;
    delete from anonproxy.protected_tables t where t.table_name = target;
end
$$;

create function anonproxy.unlink_table(tbl text) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    target text := anonproxy.stored_table_name(tbl);
begin
    if not exists (select from anonproxy.linked_tables l where l.table_name = target) then
        raise exception using errcode = '42704', message = format('table %s is not a linked table', target),
            hint = 'give the schema-qualified name listed in anonproxy.linked_tables';
    end if;
    delete from anonproxy.column_policies c where c.table_name = target;
    delete from anonproxy.linked_tables l where l.table_name = target;
end
$$;


-- Columns ----------------------------------------------------------------------

create function anonproxy.set_column(
    tbl regclass,
    column_name name,
    kind text,
    lower_bound numeric default null,
    upper_bound numeric default null,
    domain text[] default null
) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    target text := anonproxy.policy_table_name(tbl);
    qualified text := format('%s.%I', target, column_name);
    column_type regtype;
begin
    if not exists (select from anonproxy.protected_tables t where t.table_name = target
                   union all select from anonproxy.linked_tables l where l.table_name = target) then
        raise exception using errcode = '22023', message = format('table %s is not protected or linked', target),
            hint = format('protect it first: select anonproxy.protect_table(%L, <unit column>)', target);
    end if;
    column_type := anonproxy.column_type(tbl, column_name);
    if kind is null or kind not in ('identifier', 'quasi_identifier', 'sensitive', 'public') then
        raise exception using errcode = '22023',
            message = format('unknown column kind %s for column %s', coalesce(quote_literal(kind), 'NULL'), qualified),
            hint = 'kind is one of identifier, quasi_identifier, sensitive, public';
    end if;
    if (lower_bound is null) <> (upper_bound is null) then
        raise exception using errcode = '22023',
            message = format('column %s needs both a lower and an upper bound, or neither', qualified);
    end if;
    if lower_bound > upper_bound then
        raise exception using errcode = '22023',
            message = format('lower bound %s is greater than upper bound %s for column %s',
                             lower_bound, upper_bound, qualified);
    end if;
    if lower_bound is not null and
       (select t.typcategory from pg_catalog.pg_type t where t.oid = column_type) is distinct from 'N' then
        raise exception using errcode = '42804',
            message = format('column %s is of type %s; bounds need a numeric column', qualified, column_type);
    end if;
    if cardinality(domain) = 0 then
        raise exception using errcode = '22023', message = format('the domain of column %s is empty', qualified),
            hint = 'give at least one value, or no domain (null)';
    end if;
    if array_position(domain, null) is not null then
        raise exception using errcode = '22004', message = format('the domain of column %s contains NULL', qualified);
    end if;
    insert into anonproxy.column_policies as c (table_name, column_name, kind, lower_bound, upper_bound, domain)
        values (target, column_name, kind, lower_bound, upper_bound, domain)
        on conflict on constraint column_policies_pkey do update
            set kind = excluded.kind, lower_bound = excluded.lower_bound,
                upper_bound = excluded.upper_bound, domain = excluded.domain;
end
$$;

create function anonproxy.unset_column(tbl regclass, column_name name) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    target text := anonproxy.policy_table_name(tbl);
begin
    delete from anonproxy.column_policies c where c.table_name = target and c.column_name = unset_column.column_name;
    if not found then
        raise exception using errcode = '42704',
            message = format('column %s.%I has no policy', target, column_name);
    end if;
end
$$;


-- Roles ------------------------------------------------------------------------

create function anonproxy.set_role_policy(
    role_name name,
    mode text,
    k integer default 10,
    dominance_n integer default null,
    dominance_percent numeric default null,
    p_percent numeric default null,
    suppressed_rest boolean default false,
    allow_min_max boolean default false
) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
begin
    if role_name is null or not exists (select from pg_catalog.pg_roles r where r.rolname = role_name) then
        raise exception using errcode = '42704',
            message = format('role "%s" does not exist', role_name);
    end if;
    if mode is null or mode not in ('direct', 'suppress', 'dp', 'deny') then
        raise exception using errcode = '22023',
            message = format('unknown mode %s for role "%s"', coalesce(quote_literal(mode), 'NULL'), role_name),
            hint = 'mode is one of direct, suppress, dp, deny';
    end if;
    if k is null or k < 2 then
        raise exception using errcode = '22023',
            message = format('k for role "%s" must be at least 2, got %s', role_name, coalesce(k::text, 'NULL')),
            hint = 'k is the minimum number of distinct privacy units in a released group';
    end if;
    if (dominance_n is null) <> (dominance_percent is null) then
        raise exception using errcode = '22023',
            message = format('dominance rule for role "%s" needs both dominance_n and dominance_percent, or neither',
                             role_name);
    end if;
    if dominance_n < 1 then
        raise exception using errcode = '22023',
            message = format('dominance_n for role "%s" must be at least 1, got %s', role_name, dominance_n);
    end if;
    if not (dominance_percent > 0 and dominance_percent <= 100) then
        raise exception using errcode = '22023',
            message = format('dominance_percent for role "%s" must be in (0, 100], got %s', role_name, dominance_percent);
    end if;
    if p_percent <= 0 then
        raise exception using errcode = '22023',
            message = format('p_percent for role "%s" must be greater than 0, got %s', role_name, p_percent);
    end if;
    if suppressed_rest is null or allow_min_max is null then
        raise exception using errcode = '22004',
            message = format('suppressed_rest and allow_min_max for role "%s" must not be null', role_name);
    end if;
    if mode <> 'direct' and role_name = (select s.service_role from anonproxy.settings s) then
        raise exception using errcode = '22023',
            message = format('role "%s" is the service role; it must stay direct', role_name),
            hint = 'the proxy reads protected tables as the service role';
    end if;
    insert into anonproxy.role_policies as r
        (role_name, mode, k, dominance_n, dominance_percent, p_percent, suppressed_rest, allow_min_max)
        values (role_name, mode, k, dominance_n, dominance_percent, p_percent, suppressed_rest, allow_min_max)
        on conflict on constraint role_policies_pkey do update
            set mode = excluded.mode, k = excluded.k, dominance_n = excluded.dominance_n,
                dominance_percent = excluded.dominance_percent, p_percent = excluded.p_percent,
                suppressed_rest = excluded.suppressed_rest, allow_min_max = excluded.allow_min_max;
    perform anonproxy.apply_grants();
end
$$;

-- The role becomes direct again. Its privileges are not given back.
create function anonproxy.drop_role_policy(role_name name) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
begin
    delete from anonproxy.role_policies r where r.role_name = drop_role_policy.role_name;
    if not found then
        raise exception using errcode = '42704',
            message = format('role "%s" has no policy', role_name);
    end if;
end
$$;

create function anonproxy.set_service_role(role_name name) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
begin
    if role_name is null or not exists (select from pg_catalog.pg_roles r where r.rolname = role_name) then
        raise exception using errcode = '42704',
            message = format('service role "%s" does not exist', role_name),
            hint = 'create it first: create role <name> login password ''...''';
    end if;
    if exists (select from anonproxy.role_policies r where r.role_name = set_service_role.role_name
                                                       and r.mode <> 'direct') then
        raise exception using errcode = '22023',
            message = format('role "%s" cannot be the service role: its mode is not direct', role_name);
    end if;
    update anonproxy.settings set service_role = role_name where service_role <> role_name;
    perform anonproxy.apply_grants();
end
$$;

-- Remove every table, column and role from the policy (the service role stays).
-- Used by `anonproxy policy apply`, which rebuilds the policy in the same transaction.
create function anonproxy.clear_policy() returns void
language sql set search_path = pg_catalog, pg_temp as $$
    delete from anonproxy.column_policies;
    delete from anonproxy.linked_tables;
    delete from anonproxy.protected_tables;
    delete from anonproxy.role_policies;
$$;


-- Grants -----------------------------------------------------------------------

-- Every relation whose rows the policy guards: the protected and linked tables,
-- and their partitions and inheritance children, which can be read directly.
-- relid is null when the table named in the policy no longer exists.
create view anonproxy.guarded_relations as
with recursive guarded (table_name, relid) as (
    select p.table_name, pg_catalog.to_regclass(p.table_name)
      from (select table_name from anonproxy.protected_tables
            union all
            select table_name from anonproxy.linked_tables) p
    union all
    select g.table_name, i.inhrelid::regclass
      from guarded g join pg_catalog.pg_inherits i on i.inhparent = g.relid
)
select table_name, relid from guarded;
grant select on anonproxy.guarded_relations to public;

-- Roles whose answers the proxy must compute: everything but direct.
create view anonproxy.restricted_roles as
select r.role_name, a.oid as role_oid, r.mode
  from anonproxy.role_policies r join pg_catalog.pg_roles a on a.rolname = r.role_name
 where r.mode <> 'direct';
grant select on anonproxy.restricted_roles to public;

-- Every way, known to us, in which a restricted role could still read a guarded
-- relation without the proxy. apply_grants() fails while this returns a row.
create function anonproxy.isolation_problems()
returns table (role_name name, problem text, hint text)
language sql stable
-- The planner cannot know the policy tables are small; JIT compiling this costs seconds.
set search_path = pg_catalog, pg_temp set jit = off as $$
    with recursive reachable as (  -- the roles each restricted role is, or may SET ROLE to
        select r.role_name, r.role_oid, m.oid as via_oid, m.rolname as via
          from anonproxy.restricted_roles r
          join pg_catalog.pg_roles m on pg_catalog.pg_has_role(r.role_oid, m.oid, 'MEMBER')
    ), readers (relid, table_name) as (  -- views and materialized views over guarded relations, transitively
        select g.relid::oid, g.table_name from anonproxy.guarded_relations g where g.relid is not null
        union
        select rw.ev_class, x.table_name
          from readers x
          join pg_catalog.pg_depend d on d.refclassid = 'pg_catalog.pg_class'::regclass and d.refobjid = x.relid
                                     and d.classid = 'pg_catalog.pg_rewrite'::regclass
          join pg_catalog.pg_rewrite rw on rw.oid = d.objid
         where rw.ev_class <> x.relid
    )
    -- A table named in the policy is gone (dropped or renamed).
    select null::name, format('protected or linked table %s does not exist', g.table_name),
           'remove it from the policy (anonproxy.unprotect_table or unlink_table), or protect its new name'
      from anonproxy.guarded_relations g where g.relid is null
    union all
    -- The service role must not be answered by the proxy.
    select r.role_name, format('role "%s" is the service role but its mode is %s', r.role_name, r.mode),
           'the service role must be direct'
      from anonproxy.restricted_roles r join anonproxy.settings s on s.service_role = r.role_name
    union all
    -- Attributes that override or get around privileges.
    select r.role_name, format('role "%s" is in mode %s but has the %s attribute', r.role_name, r.mode, attr.name),
           format('alter role %I no%s', r.role_name, lower(attr.name))
      from anonproxy.restricted_roles r join pg_catalog.pg_roles a on a.oid = r.role_oid
      cross join lateral (values ('SUPERUSER', a.rolsuper), ('CREATEROLE', a.rolcreaterole),
                                 ('REPLICATION', a.rolreplication)) attr (name, has)
     where attr.has
    union all
    -- Built-in roles that read the server's files or run programs.
    select x.role_name, format('role "%s" is in mode %s but is a member of %s, which reads data files directly',
                               x.role_name, r.mode, x.via),
           format('revoke %I from %I', x.via, x.role_name)
      from reachable x join anonproxy.restricted_roles r using (role_name)
     where x.via in ('pg_read_server_files', 'pg_write_server_files', 'pg_execute_server_program')
    union all
    -- Ownership: an owner may grant itself anything.
    select x.role_name, format('role "%s" owns %s (as "%s")', x.role_name, g.relid, x.via),
           format('alter table %s owner to <a role that is not restricted>', g.relid)
      from reachable x join anonproxy.guarded_relations g on true
      join pg_catalog.pg_class c on c.oid = g.relid
     where c.relowner = x.via_oid
    union all
    -- Privileges held through a role it belongs to (named first: that is where to act) ...
    select x.role_name, format('role "%s" can read %s through role "%s"', x.role_name, g.relid, x.via),
           format('revoke %I from %I, or revoke the privileges of %I on %s', x.via, x.role_name, x.via, g.relid)
      from reachable x join anonproxy.guarded_relations g on g.relid is not null
     where x.via_oid <> x.role_oid
       and (pg_catalog.has_any_column_privilege(x.via_oid, g.relid, 'SELECT, INSERT, UPDATE')
            or pg_catalog.has_table_privilege(x.via_oid, g.relid, 'SELECT, INSERT, UPDATE, DELETE, TRUNCATE'))
    union all
    -- ... and by the role itself, directly or through PUBLIC.
    select x.role_name, format('role "%s" still holds privileges on %s', x.role_name, g.relid),
           format('revoke all on %s from %I, public', g.relid, x.role_name)
      from reachable x join anonproxy.guarded_relations g on g.relid is not null
     where x.via_oid = x.role_oid
       and (pg_catalog.has_any_column_privilege(x.via_oid, g.relid, 'SELECT, INSERT, UPDATE')
            or pg_catalog.has_table_privilege(x.via_oid, g.relid, 'SELECT, INSERT, UPDATE, DELETE, TRUNCATE'))
    union all
    -- Views over guarded relations, readable by the role (they run with their owner's rights).
    select x.role_name, format('role "%s" can read view %s, which reads %s', x.role_name, v.relid::regclass, v.table_name),
           format('revoke select on %s from %I, public', v.relid::regclass, x.via)
      from reachable x join readers v on pg_catalog.has_table_privilege(x.via_oid, v.relid, 'SELECT')
     where v.relid not in (select g.relid from anonproxy.guarded_relations g where g.relid is not null)
    union all
    -- REFERENCES lets a foreign key probe which keys exist: no new tables for these roles.
    -- (Temporary tables cannot reference permanent ones, so TEMPORARY is harmless.)
    select x.role_name, format('role "%s" may create tables in schema "%s", so with REFERENCES on protected tables a '
                               'foreign key could reveal which keys exist', x.role_name, n.nspname),
           format('revoke create on schema %I from %I, public', n.nspname, x.via)
      from reachable x join pg_catalog.pg_namespace n on pg_catalog.has_schema_privilege(x.via_oid, n.oid, 'CREATE')
     where n.nspname not like 'pg\_%' and n.nspname <> 'information_schema'
    union all
    select x.role_name, format('role "%s" owns table %s, so with REFERENCES on protected tables a foreign key '
                               'could reveal which keys exist', x.role_name, c.oid::regclass),
           format('alter table %s owner to <a role that is not restricted>', c.oid::regclass)
      from reachable x join pg_catalog.pg_class c on c.relowner = x.via_oid
      join pg_catalog.pg_namespace n on n.oid = c.relnamespace
     where c.relkind in ('r', 'p') and n.nspname not like 'pg\_%' and n.nspname <> 'information_schema'
$$;

-- Make PostgreSQL's privileges match the policy, then check that they do:
--   * restricted roles (suppress, dp, deny) and PUBLIC lose SELECT, INSERT, UPDATE,
--     DELETE, TRUNCATE on every guarded relation (column privileges go with them);
--   * restricted roles get REFERENCES, so information_schema and \d list the columns;
--   * the service role gets SELECT, and USAGE on the schemas of guarded relations.
-- Called by every function that changes tables, roles or the service role.
-- Needs a caller that owns the guarded relations (GRANT by anyone else is a no-op).
create function anonproxy.apply_grants() returns void
language plpgsql set search_path = pg_catalog, pg_temp set jit = off as $$
declare
    service name := (select s.service_role from anonproxy.settings s);
    rel record;
    restricted record;
    problem record;
begin
    if not exists (select from pg_catalog.pg_roles r where r.rolname = service) then
        raise exception using errcode = '42704', message = format('service role "%s" does not exist', service),
            hint = format('create it (create role %I login password ''...''), or choose another with '
                          'anonproxy.set_service_role()', service);
    end if;
    for rel in
        select g.relid, c.relowner::regrole as owner, c.relnamespace::regnamespace as schema
          from anonproxy.guarded_relations g join pg_catalog.pg_class c on c.oid = g.relid
    loop
        if not pg_catalog.pg_has_role(rel.owner::oid, 'USAGE') then
            raise exception using errcode = '42501',
                message = format('must be owner of table %s to set its privileges', rel.relid),
                hint = format('run this as %s, its owner, or as a member of that role', rel.owner);
        end if;
        execute format('revoke select, insert, update, delete, truncate on table %s from public', rel.relid);
        for restricted in select r.role_name from anonproxy.restricted_roles r loop
            execute format('revoke select, insert, update, delete, truncate on table %s from %I',
                           rel.relid, restricted.role_name);
            execute format('grant references on table %s to %I', rel.relid, restricted.role_name);
        end loop;
        execute format('grant select on table %s to %I', rel.relid, service);
        if not pg_catalog.has_schema_privilege(service, rel.schema, 'USAGE') then
            execute format('grant usage on schema %s to %I', rel.schema, service);
        end if;
        if not pg_catalog.has_table_privilege(service, rel.relid, 'SELECT')
           or not pg_catalog.has_schema_privilege(service, rel.schema, 'USAGE') then
            raise exception using errcode = '42501',
                message = format('could not give service role "%s" SELECT on %s', service, rel.relid),
                hint = format('grant usage on schema %s to %I as the schema''s owner', rel.schema, service);
        end if;
    end loop;
    for problem in select * from anonproxy.isolation_problems() loop
        raise exception using errcode = '42501', message = problem.problem, hint = problem.hint,
            detail = 'a restricted role must not be able to read protected rows without the proxy';
    end loop;
end
$$;


-- Who may call what ---------------------------------------------------------------

-- Functions are executable by PUBLIC by default: take that back. The owner (the
-- installer) may call them; a DBA delegates with GRANT EXECUTE plus write access
-- to the policy tables and ownership (membership) of the protected tables.
revoke execute on function
    anonproxy.policy_changed(),
    anonproxy.policy_table_name(regclass),
    anonproxy.column_type(regclass, name),
    anonproxy.stored_table_name(text),
    anonproxy.protect_table(regclass, name),
    anonproxy.link_table(regclass, name, regclass),
    anonproxy.unprotect_table(text),
    anonproxy.unlink_table(text),
    anonproxy.set_column(regclass, name, text, numeric, numeric, text[]),
    anonproxy.unset_column(regclass, name),
    anonproxy.set_role_policy(name, text, integer, integer, numeric, numeric, boolean, boolean),
    anonproxy.drop_role_policy(name),
    anonproxy.set_service_role(name),
    anonproxy.clear_policy(),
    anonproxy.isolation_problems(),
    anonproxy.apply_grants()
from public;
