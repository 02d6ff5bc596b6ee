-- Migration 0010: the composition audit of releases and the guard that runs it
-- when a release is created (issue 6; Ganta et al. 2008 Alg. 1; docs/composition.md).
--
-- The intersection attack: a person known to be in several releases is located
-- in each of them by their true QI values (every equivalence class whose
-- generalized cells cover those values; the nearest centroid for
-- microaggregation), and the sets of sensitive values of the classes found are
-- intersected. Everything is set-based: persons with equal QI values are one
-- "tuple", located once per release by a hash join.
--
-- Temporary tables (pg_temp._ap_comp_*, dropped at commit) carry the work
-- between the steps:
--   _ap_comp_release  the releases audited, from the registry, j = 1..n
--   _ap_comp_t        distinct QI tuples of the overlap, with their persons
--   _ap_comp_ec       one release's equivalence classes (cells, size, sensitive set)
--   _ap_comp_cover    which tuple values each generalized cell covers, per QI
--   _ap_comp_match    (tuple, class) pairs where the class covers the tuple
--   _ap_comp_located  per release and tuple: sensitive set and partition size
--   _ap_comp_result   per tuple located in every release: EA per release, ÊA, the intersection

create table anonproxy.composition_settings (
    singleton boolean primary key default true check (singleton),
    max_pvp_100 numeric not null default 0 check (max_pvp_100 >= 0 and max_pvp_100 <= 100),
    action text not null default 'warn' check (action in ('off', 'warn', 'refuse'))
);
comment on table anonproxy.composition_settings is
    'Guard of anonproxy.create_anonymized_view: a new release whose combination with the other releases of its '
    'source lets more than max_pvp_100 % of the overlap be inferred with certainty is warned about or refused.';
insert into anonproxy.composition_settings default values;
grant select on anonproxy.composition_settings to public;

-- The SQL expression (over alias) that names a person of src: the privacy-unit
-- column, else the primary key; null when src has neither.
create function anonproxy._composition_key(src regclass, unit text, alias text)
returns text
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    cols text[];
begin
    if unit is not null then
        return format('%I.%I::text', alias, unit);
    end if;
    select array_agg(format('%I.%I', alias, a.attname) order by k.ord) into cols
    from pg_index i
    cross join lateral unnest(i.indkey::int2[]) with ordinality k(attnum, ord)
    join pg_attribute a on a.attrelid = i.indrelid and a.attnum = k.attnum
    where i.indrelid = src and i.indisprimary;
    if cols is null then
        return null;
    elsif cardinality(cols) = 1 then
        return cols[1] || '::text';
    end if;
    return format('row(%s)::text', array_to_string(cols, ', '));
end
$$;

-- Fill pg_temp._ap_comp_match for release j of a generalized method: the
-- (tuple, class) pairs where every cell of the class covers the tuple's value.
create function anonproxy._composition_locate_generalized(j integer)
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
-- The join of tuples with classes is written in the order it should run (probe
-- the key table first) and estimated badly (correlated columns): keep the order
-- and hash joins. Which, with enable_nestloop off, inflates the estimated
-- costs: keep JIT from compiling these short queries.
set join_collapse_limit = 1
set enable_nestloop = off
set jit = off
as $$
declare
    r record;
    qis text[];
    i integer;
    col text;
    hierarchy text;
    is_numeric boolean;
    nodes_first boolean;
    tuples bigint := (select count(*) from pg_temp._ap_comp_t);
    n_cols text := '';
    f_cols text := '';
    stat_joins text := '';
    chosen integer[] := '{}';
    best record;
    current_cost float8;
    key_cols text := '';
    key_joins text := '';
    probe text := 'true';
    filters text := '';
begin
    select * into r from pg_temp._ap_comp_release where _ap_comp_release.j = _composition_locate_generalized.j;
    qis := r.quasi_identifiers;
    truncate pg_temp._ap_comp_cover, pg_temp._ap_comp_dom;
    for i in 1 .. cardinality(qis) loop
        col := r.qi_cols[i];
        is_numeric := qis[i] = any (r.numeric_qis);
        hierarchy := anonproxy.release_hierarchy(r.source_table, qis[i], r.parameters -> 'hierarchies');
        -- full_domain publishes hierarchy nodes: a node label that looks like a
        -- range ('25-29' of ARX's age hierarchy covers 26..30) is the node.
        nodes_first := r.method = 'full_domain' and hierarchy is not null;
        execute format(
            'insert into pg_temp._ap_comp_dom (qi, v, tuples)
             select %s, %I::text, count(*) from pg_temp._ap_comp_t where %2$I is not null group by 2',
            i, col);
        -- What a cell stands for (docs/views-internals.md, "Generalized values"),
        -- read in this order as anonproxy.utility reads it: a value of the
        -- column, '*', a numeric range or number (numeric QIs), a set, a node
        -- of the column's hierarchy (nodes before ranges for full_domain). Each
        -- form joins to the values it covers.
        execute format(
            $q$insert into pg_temp._ap_comp_cover (qi, v, cell)
               with dom as (select v, case when %4$L then v::numeric end as x
                            from pg_temp._ap_comp_dom where qi = %1$s),
               forms as (
                   select c.cell,
                          case when exists (select from dom d where d.v = c.cell) then 'value'
                               when c.cell = '*' then 'any'
                               when %5$L and exists (select from anonproxy.hierarchy_nodes h
                                                     where h.hierarchy = %3$L and h.node = c.cell) then 'node'
                               when %4$L and c.cell ~ '^-?[0-9]+(\.[0-9]+)?(--?[0-9]+(\.[0-9]+)?)?$' then 'range'
                               when c.cell like '{%%}' then 'set'
                               else 'node' end as form
                   from (select distinct %2$I::text as cell from pg_temp._ap_comp_ec where %2$I is not null) c),
               cells as materialized (
                   select f.cell, f.form,
                          case when f.form = 'range' then
                              (regexp_match(f.cell, '^(-?[0-9]+(?:\.[0-9]+)?)(?:-(-?[0-9]+(?:\.[0-9]+)?))?$'))::numeric[]
                          end as b
                   from forms f)
               select %1$s, c.cell, c.cell from cells c where c.form = 'value'
               union all
               select %1$s, d.v, c.cell from cells c cross join dom d where c.form = 'any'
               union all
               select distinct %1$s, d.v, c.cell
               from cells c
               cross join lateral unnest(case when c.form = 'set' then c.cell::text[] end) m(v)
               join dom d on d.v = m.v$q$
            || case when hierarchy is null then '' else
            $q$ union all
               select %1$s, d.v, c.cell
               from cells c
               join anonproxy.hierarchy_nodes h on h.hierarchy = %3$L and h.node = c.cell
               join dom d on d.v = h.leaf
               where c.form = 'node'$q$ end
            || case when not is_numeric then '' else
            $q$ union all
               select %1$s, d.v, c.cell
               from cells c join dom d on d.x between c.b[1] and coalesce(c.b[2], c.b[1])
               where c.form = 'range'$q$ end,
            i, col, hierarchy, is_numeric, nodes_first);
        -- Per class and QI: how many tuple values its cell covers (the rows it
        -- adds to the join key) and the share of tuples it covers.
        n_cols := n_cols || format(', coalesce(s%s.n, 0)', i);
        f_cols := f_cols || format(', coalesce(s%s.f, 0)', i);
        stat_joins := stat_joins || format(
            ' left join cell_stats s%1$s on s%1$s.qi = %1$s and s%1$s.cell = e.%2$I::text', i, col);
    end loop;
    analyze pg_temp._ap_comp_cover;
    analyze pg_temp._ap_comp_dom;

    perform anonproxy.drop_scratch_tables(array['_ap_comp_ecstat']);
    execute format(
        'create temp table _ap_comp_ecstat on commit drop as
         with cell_stats as (
             select c.qi, c.cell, count(*)::float8 as n, sum(d.tuples)::float8 / greatest(%s, 1) as f
             from pg_temp._ap_comp_cover c join pg_temp._ap_comp_dom d using (qi, v)
             group by c.qi, c.cell)
         select e.ec, array[%s]::float8[] as n, array[%s]::float8[] as f, 1::float8 as pn, 1::float8 as pf
         from pg_temp._ap_comp_ec e %s',
        tuples, substr(n_cols, 3), substr(f_cols, 3), stat_joins);

    -- Greedy choice of the QIs whose exploded cells form the hash-join key:
    -- cost = rows of the key table + candidate (tuple, class) pairs, the
    -- latter estimated as if the QIs were independent.
    current_cost := tuples::float8 * (select count(*) from pg_temp._ap_comp_ec);
    loop
        select q, sum(s.pn * s.n[q]) + tuples * sum(s.pf * s.f[q]) as cost into best
        from pg_temp._ap_comp_ecstat s cross join generate_series(1, cardinality(qis)) q
        where q <> all (chosen)
        group by q order by 2, 1 limit 1;
        exit when best.q is null or best.cost >= current_cost;
        chosen := chosen || best.q;
        current_cost := best.cost;
        update pg_temp._ap_comp_ecstat set pn = pn * n[best.q], pf = pf * f[best.q];
    end loop;
    update pg_temp._ap_comp_release
    set key_qis = array(select qis[q] from unnest(chosen) q)
    where _ap_comp_release.j = _composition_locate_generalized.j;

    for i in 1 .. cardinality(qis) loop
        col := r.qi_cols[i];
        if i = any (chosen) then
            key_cols := key_cols || format(', k%s.v as k%1$s', i);
            key_joins := key_joins || format(
                ' join pg_temp._ap_comp_cover k%1$s on k%1$s.qi = %1$s and k%1$s.cell = e.%2$I::text', i, col);
            probe := probe || format(' and k.k%s = t.%I::text', i, col);
        else
            filters := filters || format(
                ' join pg_temp._ap_comp_cover f%1$s on f%1$s.qi = %1$s and f%1$s.v = t.%2$I::text
                                                    and f%1$s.cell = e.%2$I::text', i, col);
        end if;
    end loop;
    perform anonproxy.drop_scratch_tables(array['_ap_comp_key']);
    execute format('create temp table _ap_comp_key on commit drop as select e.ec%s from pg_temp._ap_comp_ec e%s',
                   key_cols, key_joins);
    analyze pg_temp._ap_comp_key;
    truncate pg_temp._ap_comp_match;
    execute format(
        'insert into pg_temp._ap_comp_match (t, ec)
         select t.t, e.ec
         from pg_temp._ap_comp_t t
         join pg_temp._ap_comp_key k on %s
         join pg_temp._ap_comp_ec e on e.ec = k.ec%s',
        probe, filters);
end
$$;

-- Fill pg_temp._ap_comp_match for release j of a microaggregation method: each
-- tuple goes to its nearest centroid(s) (ties keep all). Numeric QIs are
-- standardized by their spread over the overlap; a categorical QI adds 1 when
-- the class's value differs. A tuple with a NULL QI is not located.
create function anonproxy._composition_locate_centroid(j integer)
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    r record;
    i integer;
    col text;
    spread float8;
    distance text := '0';
begin
    select * into r from pg_temp._ap_comp_release where _ap_comp_release.j = _composition_locate_centroid.j;
    for i in 1 .. cardinality(r.quasi_identifiers) loop
        col := r.qi_cols[i];
        if r.quasi_identifiers[i] = any (r.centroid_qis) then
            execute format(
                'select coalesce(nullif(sqrt(greatest(sum(w * x * x) / sum(w) - (sum(w * x) / sum(w))^2, 0)), 0), 1)
                 from (select %I::float8 as x, cardinality(persons)::float8 as w from pg_temp._ap_comp_t) s', col)
                into spread;
            distance := distance || format(' + ((t.%1$I::float8 - e.%1$I::float8) / %2$s)^2', col, spread);
        else
            distance := distance || format(' + (t.%1$I::text is distinct from e.%1$I::text)::integer', col);
        end if;
    end loop;
    truncate pg_temp._ap_comp_match;
    execute format(
        'insert into pg_temp._ap_comp_match (t, ec)
         select t.t, nearest.ec
         from pg_temp._ap_comp_t t
         cross join lateral (select e.ec from pg_temp._ap_comp_ec e
                             order by %s fetch first 1 rows with ties) nearest
         where not t.has_null', distance);
end
$$;

-- Run the intersection attack on releases (at least two registered release
-- tables). Persons are those in the source of every release (by privacy unit,
-- else primary key; by row when every release has the same source and it has
-- neither); their true QI values come from source (default: the source of the
-- first release). Leaves the findings in pg_temp._ap_comp_release and
-- pg_temp._ap_comp_result.
create function anonproxy._composition_attack(releases regclass[], source regclass)
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
set jit = off
set work_mem = '128MB'  -- the hash joins of locating stay in memory
as $$
declare
    n integer := cardinality(releases);
    r record;
    problem text;
    person_table regclass;
    person_key text;
    release_key text;
    qis text[];
    filters text := '';
    cells text;
    aliased text;
begin
    if n is null or n < 2 then
        raise exception using errcode = '22023', message = 'a composition needs at least two releases',
            hint = 'pass an array of two or more release tables';
    end if;
    if array_position(releases, null) is not null
       or (select count(distinct x) from unnest(releases) x) < n then
        raise exception using errcode = '22023', message = 'the releases must be distinct and not null';
    end if;

    perform anonproxy.drop_scratch_tables(array['_ap_comp_release', '_ap_comp_t', '_ap_comp_ec', '_ap_comp_dom',
                                                '_ap_comp_cover', '_ap_comp_match', '_ap_comp_located',
                                                '_ap_comp_result']);
    create temp table _ap_comp_release on commit drop as
    select o.j::integer as j, o.rel, g.id, g.source, to_regclass(g.source) as source_table, g.method,
           g.quasi_identifiers, g.sensitive, g.unit, g.parameters,
           null::text[] as qi_cols, null::text[] as numeric_qis, null::text[] as centroid_qis,
           null::text[] as key_qis, null::integer as classes
    from unnest(releases) with ordinality o(rel, j)
    left join anonproxy.releases g on to_regclass(g.target) = o.rel;

    select rel into r from pg_temp._ap_comp_release where id is null order by j limit 1;
    if found then
        raise exception using errcode = '42704', message = format('%s is not a registered release', r.rel),
            hint = 'releases are the tables anonproxy.create_anonymized_view recorded in anonproxy.releases';
    end if;
    select rel into r from pg_temp._ap_comp_release where sensitive is null order by j limit 1;
    if found then
        raise exception using errcode = '22023',
            message = format('release %s has no sensitive attribute: there is nothing to intersect', r.rel);
    end if;
    if (select count(distinct sensitive) from pg_temp._ap_comp_release) > 1 then
        raise exception using errcode = '22023',
            message = format('the releases publish different sensitive attributes (%s)',
                             (select string_agg(distinct sensitive, ', ') from pg_temp._ap_comp_release));
    end if;
    select c.rel, c.source into r from pg_temp._ap_comp_release c where c.source_table is null order by c.j limit 1;
    if found then
        raise exception using errcode = '42P01',
            message = format('source table %s of release %s does not exist', r.source, r.rel);
    end if;
    -- A hierarchy dropped since the release: its cells can no longer be read.
    select c.rel, h.key as col, h.value #>> '{}' as hierarchy into r
    from pg_temp._ap_comp_release c cross join jsonb_each(c.parameters -> 'hierarchies') h
    where h.key = any (c.quasi_identifiers) and jsonb_typeof(h.value) = 'string'
      and not exists (select from anonproxy.hierarchies x where x.name = h.value #>> '{}')
    order by c.j limit 1;
    if found then
        raise exception using errcode = '55000',
            message = format('hierarchy %L, which release %s used for column %s, no longer exists: '
                             'its cells cannot be read', r.hierarchy, r.rel, r.col),
            hint = 'load the hierarchy again, or drop the release';
    end if;

    person_table := coalesce(source, (select source_table from pg_temp._ap_comp_release where j = 1));
    select array_agg(q order by first_j, first_i) into qis
    from (select q, min(j) as first_j, min(i) as first_i
          from pg_temp._ap_comp_release, unnest(quasi_identifiers) with ordinality u(q, i) group by q) s;
    select q into problem from unnest(qis) q
    where not exists (select from pg_attribute a
                      where a.attrelid = person_table and a.attname = q and a.attnum > 0 and not a.attisdropped)
    limit 1;
    if problem is not null then
        raise exception using errcode = '42703',
            message = format('column %I of the releases'' quasi-identifiers is not in %s', problem, person_table);
    end if;

    -- The work tables name the i-th QI of qis q<i>: a QI cannot clash with
    -- their own columns (t, persons, has_null, ec, size, sens).
    update pg_temp._ap_comp_release c
    set qi_cols = array(select 'q' || array_position(qis, q) from unnest(c.quasi_identifiers) with ordinality u(q, o)
                        order by o);
    -- A QI is numeric (ranges, centroids) when the person table stores it as a
    -- number, as the methods staged it (domains included).
    update pg_temp._ap_comp_release c
    set numeric_qis = array(select q from unnest(c.quasi_identifiers) q
                            join pg_attribute a on a.attrelid = person_table and a.attname = q
                            where anonproxy.release_column_kind(a.atttypid) = 'numeric');
    -- Microaggregation publishes centroids in numeric columns of the release.
    update pg_temp._ap_comp_release c
    set centroid_qis = array(select q from unnest(c.quasi_identifiers) q
                             join pg_attribute a on a.attrelid = c.rel and a.attname = q
                             where anonproxy.release_column_kind(a.atttypid) = 'numeric')
    where c.method in ('mdav', 'tclose_first');

    -- The overlap: persons of person_table present in the source of every release.
    person_key := anonproxy._composition_key(person_table,
                                             (select unit from pg_temp._ap_comp_release where j = 1), 'p');
    for r in select distinct source_table, unit from pg_temp._ap_comp_release loop
        release_key := anonproxy._composition_key(r.source_table, r.unit, 's');
        if person_key is null or release_key is null then
            if exists (select from pg_temp._ap_comp_release where source_table <> person_table) then
                raise exception using errcode = '55000',
                    message = format('cannot tell which persons of %s are in the other releases: '
                                     'it has no privacy unit and no primary key',
                                     case when person_key is null then person_table else r.source_table end),
                    hint = 'give the source tables a primary key, or create the releases with a privacy unit';
            end if;
            -- One source without a key: a person is a row, named by its row identity.
            person_key := case (select relkind from pg_class where oid = person_table)
                              when 'r' then 'p.ctid::text' when 'm' then 'p.ctid::text'
                              when 'p' then 'row(p.tableoid, p.ctid)::text' end;  -- ctid is per partition
            if person_key is null then
                raise exception using errcode = '55000',
                    message = format('cannot tell people apart in %s: it has no primary key, no privacy unit '
                                     'and no row identity', person_table),
                    hint = 'give the source a primary key, or create the releases with a privacy unit (unit)';
            end if;
            filters := '';
            exit;
        end if;
        if r.source_table <> person_table or release_key <> replace(person_key, 'p.', 's.') then
            filters := filters || format(' and exists (select from %s s where %s = %s)',
                                         r.source_table, release_key, person_key);
        end if;
    end loop;

    select string_agg(format('p.%I', q), ', ' order by i), string_agg(format('p.%I as q%s', q, i), ', ' order by i)
    into cells, aliased
    from unnest(qis) with ordinality u(q, i);
    execute format(
        'create temp table _ap_comp_t on commit drop as
         select (row_number() over ())::integer as t, %1$s, array_agg(distinct %2$s) as persons,
                num_nulls(%3$s) > 0 as has_null
         from %4$s p where true%5$s group by %3$s',
        aliased, person_key, cells, person_table, filters);
    analyze pg_temp._ap_comp_t;

    create temp table _ap_comp_dom (qi integer, v text, tuples bigint, primary key (qi, v)) on commit drop;
    create temp table _ap_comp_cover (qi integer, v text, cell text, primary key (qi, cell, v)) on commit drop;
    create temp table _ap_comp_match (t integer, ec integer) on commit drop;
    create temp table _ap_comp_located (j integer, t integer, size integer, sens text[]) on commit drop;

    for r in select * from pg_temp._ap_comp_release order by j loop
        select string_agg(format('%I', q), ', ' order by i),
               string_agg(format('%I as %I', q, r.qi_cols[i]), ', ' order by i)
        into cells, aliased
        from unnest(r.quasi_identifiers) with ordinality u(q, i);
        perform anonproxy.drop_scratch_tables(array['_ap_comp_ec']);
        execute format(
            'create temp table _ap_comp_ec on commit drop as
             select (row_number() over ())::integer as ec, %1$s, count(*)::integer as size,
                    array_agg(distinct %2$I::text) filter (where %2$I is not null) as sens
             from %3$s group by %4$s',
            aliased, r.sensitive, r.rel, cells);
        analyze pg_temp._ap_comp_ec;
        update pg_temp._ap_comp_release set classes = (select count(*) from pg_temp._ap_comp_ec)
        where j = r.j;
        if r.method in ('mdav', 'tclose_first') then
            perform anonproxy._composition_locate_centroid(r.j);
        else
            perform anonproxy._composition_locate_generalized(r.j);
        end if;
        -- The person's possible values in this release: every class found (one,
        -- unless cells overlap); size counts each class once (ordinality 1).
        insert into pg_temp._ap_comp_located (j, t, size, sens)
        select r.j, m.t, sum(e.size) filter (where s.o = 1), array_agg(distinct s.v)
        from pg_temp._ap_comp_match m
        join pg_temp._ap_comp_ec e on e.ec = m.ec
        cross join lateral unnest(e.sens) with ordinality s(v, o)
        group by m.t;
    end loop;
    analyze pg_temp._ap_comp_located;

    create temp table _ap_comp_result on commit drop as
    with located as (
        select l.t, array_agg(cardinality(l.sens) order by l.j) as prior_ea, array_agg(l.size order by l.j) as sizes
        from pg_temp._ap_comp_located l group by l.t having count(*) = n),
    common as (
        select t, array_agg(v order by v) as possible
        from (select l.t, v from pg_temp._ap_comp_located l cross join unnest(l.sens) v
              group by l.t, v having count(*) = n) s
        group by t)
    select l.t, t.persons, l.prior_ea, l.sizes, coalesce(c.possible, '{}') as possible,
           coalesce(cardinality(c.possible), 0) as posterior_ea
    from located l join pg_temp._ap_comp_t t on t.t = l.t left join common c on c.t = l.t;
end
$$;

-- One row per person of the overlap located in every release: effective
-- anonymity in each release (EA_ij, in the order given), partition sizes, the
-- posterior ÊA_i = |∩ s_ij|, the drop min_j EA_ij − ÊA_i, the confidence 1/ÊA_i
-- and the values left.
create function anonproxy.composition_persons(releases regclass[], source regclass default null)
returns table (person text, prior_ea integer[], partition_size integer[], posterior_ea integer,
               anonymity_drop integer, confidence numeric, possible_values text[])
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    perform anonproxy._composition_attack(releases, source);
    return query
    select p, r.prior_ea, r.sizes, r.posterior_ea,
           (select min(x) from unnest(r.prior_ea) x) - r.posterior_ea,
           case when r.posterior_ea > 0 then round(1.0 / r.posterior_ea, 4) end,
           r.possible
    from pg_temp._ap_comp_result r cross join unnest(r.persons) p
    order by p;
end
$$;

-- The attack summarized (docs/composition.md): per release k, classes,
-- average partition size and EA over the located overlap, and how many of the
-- overlap it does not locate; the overlap, how many were located in every
-- release (the others: unlocated, of whom null_qi have a NULL QI), average
-- prior and posterior effective
-- anonymity, average drop, the share with a drop (vulnerable), the ÊA
-- distribution and PVP_C for C = 100 %, 50 %, 33 %, 25 %.
create function anonproxy.composition_risk(releases regclass[], source regclass default null)
returns jsonb
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    summary jsonb;
begin
    perform anonproxy._composition_attack(releases, source);
    with weighted as (
        select cardinality(r.persons)::numeric as w, r.prior_ea, r.sizes, r.posterior_ea,
               (select min(x) from unnest(r.prior_ea) x) - r.posterior_ea as drop
        from pg_temp._ap_comp_result r),
    totals as (
        select sum(w) as located, sum(w * posterior_ea) as posterior, sum(w * drop) as drop,
               sum(w) filter (where drop > 0) as vulnerable,
               sum(w) filter (where posterior_ea = 1) as c100, sum(w) filter (where posterior_ea between 1 and 2) as c50,
               sum(w) filter (where posterior_ea between 1 and 3) as c33,
               sum(w) filter (where posterior_ea between 1 and 4) as c25,
               sum(w * (select min(x) from unnest(prior_ea) x)) as min_prior
        from weighted),
    per_release as (
        select jsonb_agg(jsonb_build_object(
                   'release', c.rel::text, 'id', c.id, 'method', c.method, 'k', c.parameters -> 'k',
                   'classes', c.classes, 'key_qis', to_jsonb(c.key_qis),
                   'avg_partition_size', (select round(sum(w * sizes[c.j]) / nullif(sum(w), 0), 3) from weighted),
                   'avg_prior_ea', (select round(sum(w * prior_ea[c.j]) / nullif(sum(w), 0), 3) from weighted),
                   'unlocated', (select coalesce(sum(cardinality(t.persons)), 0) from pg_temp._ap_comp_t t
                                 where not exists (select from pg_temp._ap_comp_located l
                                                   where l.j = c.j and l.t = t.t)))
                   order by c.j) as releases
        from pg_temp._ap_comp_release c),
    distribution as (
        select coalesce(jsonb_object_agg(posterior_ea, persons order by posterior_ea), '{}') as d
        from (select posterior_ea, sum(w) as persons from weighted group by posterior_ea) s)
    select jsonb_build_object(
        'releases', p.releases,
        'overlap', (select coalesce(sum(cardinality(persons)), 0) from pg_temp._ap_comp_t),
        'located', coalesce(t.located, 0),
        'unlocated', (select coalesce(sum(cardinality(persons)), 0) from pg_temp._ap_comp_t)
                     - coalesce(t.located, 0),
        'null_qi', (select coalesce(sum(cardinality(persons)), 0) from pg_temp._ap_comp_t where has_null),
        'avg_min_prior_ea', round(t.min_prior / t.located, 3),
        'avg_posterior_ea', round(t.posterior / t.located, 3),
        'avg_drop', round(t.drop / t.located, 3),
        'vulnerable_pct', round(100 * coalesce(t.vulnerable, 0) / t.located, 2),
        'posterior_ea_distribution', d.d,
        'pvp', jsonb_build_object(
            '100', round(100 * coalesce(t.c100, 0) / t.located, 2),
            '50', round(100 * coalesce(t.c50, 0) / t.located, 2),
            '33', round(100 * coalesce(t.c33, 0) / t.located, 2),
            '25', round(100 * coalesce(t.c25, 0) / t.located, 2)))
    into summary
    from totals t, per_release p, distribution d;
    return summary;
end
$$;

-- The guard create_anonymized_view calls once release_id is recorded: the
-- attack on the new release together with every other release of the same
-- source and sensitive attribute. The finding goes to releases.composition.
-- Above the configured PVP_100 %, or when the risk of some people could not be
-- measured (fail closed: nobody located is not nobody at risk), the guard
-- warns, or refuses (SQLSTATE APC01, which rolls the whole creation back)
-- unless force, which is recorded.
create function anonproxy.check_composition(release_id bigint, force boolean)
returns jsonb
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    settings anonproxy.composition_settings;
    created record;
    others regclass[];
    names text;
    risk jsonb;
    finding jsonb;
    certain numeric;
    exceeded boolean;
    unmeasured bigint;
    problem text;
    problem_hint text;
    objection text;
    message text;
    detail text;
begin
    select * into created from anonproxy.releases where id = release_id;
    if not found then
        raise exception using errcode = '42704', message = format('release %s is not registered', release_id);
    end if;
    select * into settings from anonproxy.composition_settings;
    if not found then
        settings := row(true, 0, 'warn')::anonproxy.composition_settings;
    end if;
    if settings.action = 'off' or created.sensitive is null then
        return null;
    end if;
    -- For throwaway releases in a transaction that is rolled back (the report's risk-utility curve).
    -- Any release creator could pass force => true instead, so this grants nothing; the skip is recorded.
    if current_setting('anonproxy.composition_check', true) = 'off' then
        finding := jsonb_build_object('skipped', 'anonproxy.composition_check = off');
        update anonproxy.releases set composition = finding where id = release_id;
        return finding;
    end if;
    select array_agg(to_regclass(g.target) order by g.id) into others
    from anonproxy.releases g
    where g.source = created.source and g.id <> created.id and g.sensitive = created.sensitive
      and to_regclass(g.target) is not null;
    if others is null then
        finding := jsonb_build_object('releases', jsonb_build_array(created.target), 'risk', null,
                                      'max_pvp_100', settings.max_pvp_100, 'action', settings.action,
                                      'exceeded', false, 'unmeasured', 0, 'problem', null, 'forced', false);
        update anonproxy.releases set composition = finding where id = release_id;
        return finding;
    end if;
    names := format('%s combined with %s', created.target, (select string_agg(o::text, ', ') from unnest(others) o));

    -- The attack refuses (55000) what it cannot measure at all: people it cannot tell apart.
    begin
        risk := anonproxy.composition_risk(to_regclass(created.target) || others, to_regclass(created.source));
    exception when sqlstate '55000' then
        get stacked diagnostics problem = message_text, problem_hint = pg_exception_hint;
    end;
    if risk is null then
        exceeded := false;
        objection := format('composition risk: %s could not be measured: %s', names, problem);
    else
        certain := coalesce((risk -> 'pvp' ->> '100')::numeric, 0);
        exceeded := certain > settings.max_pvp_100;
        unmeasured := (risk ->> 'unlocated')::bigint;
        if unmeasured > 0 then
            problem := format('%s could not be located (%s)', unmeasured,
                              concat_ws('; ',
                                  (select string_agg(format('%s not in any class of %s', x ->> 'unlocated',
                                                            x ->> 'release'), ', ')
                                   from jsonb_array_elements(risk -> 'releases') x
                                   where (x ->> 'unlocated')::bigint > 0),
                                  case when (risk ->> 'null_qi')::bigint > 0
                                       then format('%s with a NULL quasi-identifier', risk ->> 'null_qi') end));
            problem_hint := 'a cell the audit cannot read, a NULL quasi-identifier or a suppressed person; '
                            'see docs/composition.md';
        end if;
        objection := 'composition risk: ' || names
            || case when exceeded then
                   format(' reveals %s exactly for %s %% of the %s people located of the %s they share (limit %s %%)',
                          created.sensitive, certain, risk -> 'located', risk -> 'overlap', settings.max_pvp_100)
               else '' end
            || case when unmeasured > 0 then
                   format('%s the risk could not be measured for %s of the %s people they share: %s',
                          case when exceeded then ';' else ':' end, unmeasured, risk -> 'overlap', problem)
               else '' end;
        detail := format('PVP at 100/50/33/25 %% confidence: %s/%s/%s/%s %% of the %s located; '
                         'average drop in effective anonymity %s',
                         risk -> 'pvp' ->> '100', risk -> 'pvp' ->> '50', risk -> 'pvp' ->> '33',
                         risk -> 'pvp' ->> '25', risk -> 'located', risk ->> 'avg_drop');
    end if;
    finding := jsonb_build_object(
        'releases', to_jsonb((to_regclass(created.target) || others)::text[]),
        'risk', risk, 'max_pvp_100', settings.max_pvp_100, 'action', settings.action,
        'exceeded', exceeded, 'unmeasured', unmeasured, 'problem', problem,
        'forced', (exceeded or problem is not null) and coalesce(force, false));
    if exceeded or problem is not null then
        if settings.action = 'refuse' and not coalesce(force, false) then
            raise exception using errcode = 'APC01', message = objection, detail = coalesce(detail, ''),
                hint = concat_ws('; ', problem_hint,
                                 'generalize further (larger k, l or t), drop an older release, or pass force => true '
                                 'to create it anyway (recorded in anonproxy.releases.forced)');
        end if;
        raise warning using message = objection, detail = coalesce(detail, ''),
            hint = case when force then 'created anyway: force => true is recorded in anonproxy.releases.forced'
                        else concat_ws('; ', problem_hint, 'see anonproxy.composition_risk() and docs/composition.md')
                   end;
    end if;
    update anonproxy.releases
    set composition = finding, forced = forced or (finding ->> 'forced')::boolean
    where id = release_id;
    return finding;
end
$$;
