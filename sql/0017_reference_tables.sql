-- Migration 0017: reference tables -- public dimension tables that queries over protected data may join.
--
-- A reference table holds no personal data (regions, calendars, product lists).
-- A gated statement may join it to a protected or linked table when the join is
-- many-to-one: the ON condition equates every column of one of the reference
-- table's unique keys with a column of a table before it (docs/policy.md). Then
-- each protected row meets at most one reference row, and no person's
-- contribution is multiplied.
--
-- Which keys are unique is read from the catalog (the view reference_keys), not
-- stored: the proxy reads it with the policy, every time it loads the policy, so
-- a unique index dropped since the declaration leaves the table declared but with
-- no key, and every join to it is refused. A key counts when its index is
-- unique, immediate (not deferrable), valid and live, has no predicate (partial)
-- and no expression, uses each column's default operator class and the column's
-- own collation (else "equal" in the join is not "equal" in the index), and the
-- table has no inheritance children (their rows are read with the parent's but
-- are not covered by its index; partitions of a partitioned table are).
--
-- Declaring a table gives the service role SELECT on it (the proxy runs the
-- joined query as the service role), as apply_grants() does for protected
-- tables; restricted roles get nothing: what they read of a reference table they
-- read through the proxy's aggregates, or under their own grants alone.
--
-- A reference table must not be, include or read guarded rows: a protected or
-- linked table, a partition, inheritance child or parent of one, a view or
-- materialized view over one. declare_reference_table() checks it, and a
-- trigger on the protected and linked tables keeps it true when they change.

create table anonproxy.reference_tables (
    table_name text primary key
);
comment on table anonproxy.reference_tables is
    'Public tables (no personal data) that queries over protected tables may join many-to-one on a unique key.';
grant select on anonproxy.reference_tables to public;

create trigger policy_changed after insert or update or delete or truncate on anonproxy.reference_tables
    for each statement execute function anonproxy.policy_changed();
-- Answers are cached per data version of every table a question reads: reference tables too (0003).
create trigger track_data_version after insert or update of table_name on anonproxy.reference_tables
    for each row execute function anonproxy.track_policy_table();


-- Keys -----------------------------------------------------------------------------

-- The usable unique keys of every declared reference table, each as its columns in index order.
-- A declared table that is missing, or has no usable key, has no row here.
create view anonproxy.reference_keys as
select r.table_name, k.columns
  from anonproxy.reference_tables r
  join pg_catalog.pg_class c on true
  join pg_catalog.pg_namespace n on n.oid = c.relnamespace
       and pg_catalog.format('%I.%I', n.nspname, c.relname) = r.table_name
  cross join lateral (
      select pg_catalog.array_agg(a.attname order by u.k)::name[] as columns
        from pg_catalog.pg_index i
       cross join lateral pg_catalog.generate_series(0, i.indnkeyatts - 1) u (k)
        join pg_catalog.pg_attribute a on a.attrelid = i.indrelid and a.attnum = i.indkey[u.k]
        join pg_catalog.pg_opclass o on o.oid = i.indclass[u.k]
       where i.indrelid = c.oid and i.indisunique and i.indimmediate and i.indisvalid and i.indislive
         and i.indpred is null and i.indexprs is null
       group by i.indexrelid
      having pg_catalog.bool_and(o.opcdefault and i.indcollation[u.k] = a.attcollation)
  ) k
 where c.relkind in ('r', 'p', 'm')
   and (c.relkind = 'p' or not exists (select from pg_catalog.pg_inherits h where h.inhparent = c.oid));
grant select on anonproxy.reference_keys to public;


-- Keeping reference tables apart from guarded ones ----------------------------------------

-- Why rel cannot be a reference table, or null. Used when declaring, and after every change of the
-- protected and linked tables.
create function anonproxy.reference_problem(rel regclass) returns text
language sql stable set search_path = pg_catalog, pg_temp set jit = off as $$
    select case when e.relid = g.relid
                then format('%s is protected data (a protected or linked table, or part of one)', rel)
                when e.via_parent
                then format('%s includes the rows of protected table %s (a partition or inheritance child)',
                            rel, e.table_name)
                else format('%s reads protected table %s', rel, e.table_name) end
      from anonproxy.exposing_relations e
      left join anonproxy.guarded_relations g on g.relid = e.relid
     where e.relid = rel
    limit 1
$$;

create function anonproxy.refuse_guarded_reference() returns trigger
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    problem text;
    declared text;
begin
    select r.table_name, anonproxy.reference_problem(pg_catalog.to_regclass(r.table_name))
      into declared, problem
      from anonproxy.reference_tables r
     where anonproxy.reference_problem(pg_catalog.to_regclass(r.table_name)) is not null
     limit 1;
    if found then
        raise exception using errcode = '22023',
            message = format('reference table %s cannot hold protected data: %s', declared, problem),
            hint = format('undeclare it first: select anonproxy.undeclare_reference_table(%L)', declared);
    end if;
    return null;
end
$$;

create trigger refuse_guarded_reference after insert or update on anonproxy.protected_tables
    for each statement execute function anonproxy.refuse_guarded_reference();
create trigger refuse_guarded_reference after insert or update on anonproxy.linked_tables
    for each statement execute function anonproxy.refuse_guarded_reference();


-- Grants ---------------------------------------------------------------------------------

alter function anonproxy.apply_grants() rename to apply_published_grants;

-- As in migration 0011 (published and guarded relations), then: the service role may read every declared
-- reference table (and its schema).
create function anonproxy.apply_grants() returns void
language plpgsql set search_path = pg_catalog, pg_temp set jit = off as $$
declare
    service name := (select s.service_role from anonproxy.settings s);
    rel record;
begin
    perform anonproxy.apply_published_grants();
    for rel in
        select c.oid::regclass as relid, c.relnamespace::regnamespace as schema
          from anonproxy.reference_tables r
          join pg_catalog.pg_class c on c.oid = pg_catalog.to_regclass(r.table_name)
    loop
        if not pg_catalog.has_table_privilege(service, rel.relid, 'SELECT') then
            perform anonproxy.check_grantor(rel.relid);
            execute format('grant select on table %s to %I', rel.relid, service);
        end if;
        if not pg_catalog.has_schema_privilege(service, rel.schema, 'USAGE') then
            execute format('grant usage on schema %s to %I', rel.schema, service);
        end if;
        if not pg_catalog.has_schema_privilege(service, rel.schema, 'USAGE') then
            raise exception using errcode = '42501',
                message = format('could not give service role "%s" USAGE on schema %s, where reference table %s '
                                 'lives', service, rel.schema, rel.relid),
                hint = format('grant usage on schema %s to %I as the schema''s owner', rel.schema, service);
        end if;
    end loop;
end
$$;


-- Editing ---------------------------------------------------------------------------------

-- Declare rel a reference table: public data that queries over protected tables may join many-to-one.
create function anonproxy.declare_reference_table(rel regclass) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    target text := anonproxy.policy_table_name(rel);
    problem text := anonproxy.reference_problem(rel);
begin
    if (select c.relkind from pg_catalog.pg_class c where c.oid = rel) not in ('r', 'p', 'm') then
        raise exception using errcode = '42809',
            message = format('%s is not a table or materialized view; a reference table needs a unique index',
                             target),
            hint = 'declare the table the view reads, or a materialized view with a unique index';
    end if;
    if problem is not null then
        raise exception using errcode = '22023',
            message = format('%s cannot be a reference table: %s', target, problem),
            hint = 'a reference table holds public data only (regions, calendars, product lists); join linked '
                   'tables on their declared key instead';
    end if;
    if exists (select from anonproxy.published_relations p where pg_catalog.to_regclass(p.relation_name) = rel) then
        raise exception using errcode = '22023',
            message = format('%s is a published relation; it cannot also be a reference table', target),
            hint = format('unpublish it first: select anonproxy.unpublish_relation(%L)', target);
    end if;
    insert into anonproxy.reference_tables (table_name) values (target) on conflict do nothing;
    if not exists (select from anonproxy.reference_keys k where k.table_name = target) then
        raise exception using errcode = '42830',
            message = format('table %s has no unique key anonproxy can use, so a join to it could match a row '
                             'more than once', target),
            detail = 'a usable key is a primary key or unique index that is immediate (not deferrable), valid, '
                     'not partial, on plain columns with their default operator class and own collation, of a '
                     'table without inheritance children',
            hint = format('add one: alter table %s add primary key (<columns>)', target);
    end if;
    perform anonproxy.apply_grants();
end
$$;

-- Takes text, like unprotect_table, so that a table since dropped can still be removed. The service role keeps
-- the SELECT it was given.
create function anonproxy.undeclare_reference_table(rel text) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    target text := coalesce(
        (select r.table_name from anonproxy.reference_tables r where r.table_name = rel),
        (select format('%I.%I', n.nspname, c.relname)
           from pg_catalog.pg_class c join pg_catalog.pg_namespace n on n.oid = c.relnamespace
          where c.oid = pg_catalog.to_regclass(rel)),
        rel);
begin
    delete from anonproxy.reference_tables r where r.table_name = target;
    if not found then
        raise exception using errcode = '42704', message = format('table %s is not a reference table', target),
            hint = 'give the schema-qualified name listed in anonproxy.reference_tables';
    end if;
end
$$;

-- As in 0011, and the reference tables too.
create or replace function anonproxy.clear_policy() returns void
language sql set search_path = pg_catalog, pg_temp as $$
    delete from anonproxy.reference_tables;
    delete from anonproxy.published_relations;
    delete from anonproxy.column_policies;
    delete from anonproxy.linked_tables;
    delete from anonproxy.protected_tables;
    delete from anonproxy.role_policies;
$$;


-- Who may call what ---------------------------------------------------------------------------

revoke execute on function
    anonproxy.reference_problem(regclass),
    anonproxy.refuse_guarded_reference(),
    anonproxy.apply_published_grants(),
    anonproxy.apply_grants(),
    anonproxy.declare_reference_table(regclass),
    anonproxy.undeclare_reference_table(text)
from public;
