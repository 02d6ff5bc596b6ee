-- Migration 0008: microaggregation (issue 5): MDAV and t-closeness-first.
--
-- Both follow the method contract of docs/views-internals.md. Records are
-- clustered on their numeric quasi-identifiers, standardized (z-scores);
-- every record of a cluster is then released with the cluster's centroid for
-- the numeric quasi-identifiers (numeric) and its most frequent value (mode)
-- for the categorical ones.
--
-- MDAV (Domingo-Ferrer et al. 2016 §3.2) is sequential: each step is a few set-based
-- statements over the temp table of unclustered records. t-closeness-first
-- (Domingo-Ferrer et al. 2016 Alg. 6) builds every cluster from one record per stratum of
-- the sensitive value. When ℓ or t is asked, clusters that miss it are merged
-- with their nearest cluster (Alg. 4) until none does; the ℓ / t test is
-- anonproxy.sensitive_failures of 0007.

-- The scratch tables of the microaggregation methods.
create or replace function anonproxy.microaggregation_scratch() returns text[]
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select array['anonproxy_ma_z', 'anonproxy_ma_open', 'anonproxy_ma_cluster', 'anonproxy_ma_dist',
                 'anonproxy_ma_centroid', 'anonproxy_ma_failing', 'anonproxy_sens_dist', 'anonproxy_sens_global']
$$;

-- Stage the numeric quasi-identifiers as z-scores in pg_temp.anonproxy_ma_z
-- (_row, _unit, z1 … zd, stratum), copy them to pg_temp.anonproxy_ma_open (the
-- records not yet clustered) and create pg_temp.anonproxy_ma_cluster (_row,
-- _cluster). Returns d.
create or replace function anonproxy.microaggregation_stage(input regclass, spec jsonb, method text)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $fn$
declare
    numeric_qis text[];
    d integer;
begin
    select array_agg(q->>'name' order by i) into numeric_qis
    from jsonb_array_elements(spec->'qi') with ordinality as a(q, i) where q->>'kind' = 'numeric';
    d := coalesce(array_length(numeric_qis, 1), 0);
    if d = 0 then
        raise exception '% microaggregates numeric quasi-identifiers, and none of the quasi-identifiers is numeric',
            method
            using errcode = '22023', hint = 'use method => ''mondrian'' or ''full_domain'' for categorical ones';
    end if;
    perform anonproxy.drop_scratch_tables(anonproxy.microaggregation_scratch());   -- left by an earlier call
    execute format(
        'create temp table anonproxy_ma_z as
         select i._row, i._unit, %s, 0 as stratum
         from %s i cross join (select %s from %s) s',
        (select string_agg(format('coalesce((i.%I - s.mean%s) / nullif(s.sd%s, 0), 0)::float8 as z%s',
                                  numeric_qis[j], j, j, j), ', ' order by j)
         from generate_series(1, d) j),
        input,
        (select string_agg(format('avg(%I) as mean%s, stddev_pop(%I) as sd%s', numeric_qis[j], j, numeric_qis[j], j),
                           ', ' order by j)
         from generate_series(1, d) j),
        input);
    create temp table anonproxy_ma_open as select * from pg_temp.anonproxy_ma_z;
    perform anonproxy.microaggregation_index(d);
    create temp table anonproxy_ma_cluster (_row bigint primary key, _cluster integer not null);
    return d;
end
$fn$;

-- Index the open records by _row and by each coordinate (for the range queries of
-- microaggregation_farthest and microaggregation_nearest).
create or replace function anonproxy.microaggregation_index(d integer) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $fn$
begin
    alter table pg_temp.anonproxy_ma_open add primary key (_row);
    create index on pg_temp.anonproxy_ma_open (stratum);
    for j in 1 .. d loop
        execute format('create index on pg_temp.anonproxy_ma_open (z%s)', j);
    end loop;
    analyze pg_temp.anonproxy_ma_open;
end
$fn$;

-- Squared Euclidean distance of a staged record to point p, as an expression with
-- p's coordinates as literals (cheaper per row than subscripting a parameter).
create or replace function anonproxy.microaggregation_distance(p float8[]) returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select string_agg(format('(z%1$s - %2$L::float8) * (z%1$s - %2$L::float8)', j, p[j]), ' + ' order by j)
    from generate_series(1, cardinality(p)) j
$$;

-- Rewrite the open records without the rows deleted or updated in this transaction,
-- which scans would otherwise still visit until it ends.
create or replace function anonproxy.microaggregation_compact(d integer) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $fn$
begin
    create temp table anonproxy_ma_compact as select * from pg_temp.anonproxy_ma_open;
    drop table pg_temp.anonproxy_ma_open;
    alter table pg_temp.anonproxy_ma_compact rename to anonproxy_ma_open;
    perform anonproxy.microaggregation_index(d);
end
$fn$;

-- Move the records chosen by `pick` (a query of _row values over
-- pg_temp.anonproxy_ma_open) into cluster `cluster`; return the sum of their z
-- vectors followed by their count (to keep the mean of what remains). Every
-- `compact` clusters, the open table is rewritten without the moved rows, which
-- the scans would otherwise still visit until the transaction ends.
create or replace function anonproxy.microaggregation_take(d integer, pick text, cluster integer)
returns float8[]
language plpgsql
set search_path = pg_catalog, pg_temp
as $fn$
declare
    taken float8[];
begin
    execute format(
        'with moved as (delete from pg_temp.anonproxy_ma_open o where o._row in (%s) returning o.*),
              kept as (insert into pg_temp.anonproxy_ma_cluster select _row, %s from moved)
         select array[%s, count(*)] from moved',
        pick, cluster, (select string_agg(format('sum(z%s)', j), ', ' order by j) from generate_series(1, d) j))
    into taken;
    if cluster % 64 = 0 then
        perform anonproxy.microaggregation_compact(d);
    end if;
    return taken;
end
$fn$;

-- The remaining record farthest from point p, as (row, z vector). The farthest of the
-- records at the ends of each coordinate gives a distance the answer reaches; a record
-- nearer p than reach = √(that / d) on every coordinate cannot, so only the index
-- ranges beyond reach are read.
create or replace function anonproxy.microaggregation_farthest(p float8[], out far_row bigint, out far float8[])
language plpgsql
set search_path = pg_catalog, pg_temp
as $fn$
declare
    d integer := cardinality(p);
    z text := (select string_agg(format('z%s', j), ', ' order by j) from generate_series(1, d) j);
    distance text := anonproxy.microaggregation_distance(p);
    reached float8;
    reach float8;
begin
    execute format('select max(%s) from (%s) e', distance,
                   (select string_agg(format('(select %1$s from pg_temp.anonproxy_ma_open order by z%2$s limit 1)
                                              union all
                                              (select %1$s from pg_temp.anonproxy_ma_open order by z%2$s desc limit 1)',
                                             z, j), ' union all ')
                    from generate_series(1, d) j))
    into reached;
    if reached is null then
        return;   -- nothing left
    end if;
    reach := sqrt(reached / d) * (1 - 1e-9);   -- margin for the rounding of the bounds
    execute format('select _row, array[%s] from pg_temp.anonproxy_ma_open where %s order by %s desc limit 1',
                   z,
                   (select string_agg(format('z%s <= %L::float8 or z%s >= %L::float8', j, p[j] - reach, j, p[j] + reach), ' or ')
                    from generate_series(1, d) j),
                   distance)
    into far_row, far;
end
$fn$;

-- The k open records nearest point p, each of its own unit (one row per unit). Reads
-- the box of half-width radius around p, doubling it until the k-th nearest found lies
-- within radius (then no record outside the box is nearer). radius comes back as the
-- one that sufficed.
create or replace function anonproxy.microaggregation_nearest(p float8[], k integer, inout radius float8,
                                                              out nearest bigint[])
language plpgsql
set search_path = pg_catalog, pg_temp
as $fn$
declare
    distance text := anonproxy.microaggregation_distance(p);
    kth float8;
    found integer;
begin
    loop
        execute format('select array_agg(_row), max(dist), count(*)
                        from (select _row, %s as dist from pg_temp.anonproxy_ma_open where %s order by 2 limit %s) x',
                       distance,
                       (select string_agg(format('z%s between %L::float8 and %L::float8', j, p[j] - radius * (1 + 1e-9),
                                                 p[j] + radius * (1 + 1e-9)), ' and ')
                        from generate_series(1, cardinality(p)) j),
                       k)
        into nearest, kth, found;
        exit when found = k and kth <= radius * radius;
        if found < k and not exists (select from pg_temp.anonproxy_ma_open offset k - 1) then
            raise exception 'microaggregation_nearest: fewer than % open records', k using errcode = 'XX000';
        end if;
        radius := radius * 2;
    end loop;
end
$fn$;

-- Alg. 4 of Domingo-Ferrer et al. 2016, for ℓ and t: while a cluster fails, merge the worst one with
-- the cluster whose centroid is nearest. Returns the number of merges.
create or replace function anonproxy.microaggregation_merge(input regclass, spec jsonb, d integer)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $fn$
declare
    sensitive text := spec->'sensitive'->>'name';
    worst integer;
    nearest integer;
    merges integer := 0;
    centroid_cols text := (select string_agg(format('z%s', j), ', ' order by j) from generate_series(1, d) j);
begin
    if spec->>'l' is null and spec->>'t' is null then
        return 0;
    end if;
    execute format(
        'create temp table anonproxy_ma_dist as
         select c._cluster, i.%I::text as s, count(distinct i._unit) as units
         from pg_temp.anonproxy_ma_cluster c join %s i using (_row) group by 1, 2', sensitive, input);
    create index on pg_temp.anonproxy_ma_dist (_cluster);
    create temp table anonproxy_sens_global (s text, units bigint);
    execute format('insert into pg_temp.anonproxy_sens_global select %I::text, count(distinct _unit) from %s group by 1',
                   sensitive, input);
    create temp table anonproxy_sens_dist (key integer[], s text, units bigint);
    insert into pg_temp.anonproxy_sens_dist select array[x._cluster], x.s, x.units from pg_temp.anonproxy_ma_dist x;
    create temp table anonproxy_ma_failing as select f.key[1] as _cluster, f.badness from anonproxy.sensitive_failures(spec) f;
    if not exists (select from pg_temp.anonproxy_ma_failing) then
        return 0;
    end if;
    -- Centroids in z space, to find the nearest cluster.
    execute format(
        'create temp table anonproxy_ma_centroid as
         select c._cluster, count(*) as n, %s
         from pg_temp.anonproxy_ma_cluster c join pg_temp.anonproxy_ma_z z using (_row) group by c._cluster',
        (select string_agg(format('avg(z%s) as z%s', j, j), ', ' order by j) from generate_series(1, d) j));
    loop
        select f._cluster into worst from pg_temp.anonproxy_ma_failing f order by f.badness desc, f._cluster limit 1;
        exit when not found;
        execute format(
            'select o._cluster from pg_temp.anonproxy_ma_centroid o, pg_temp.anonproxy_ma_centroid w
             where w._cluster = $1 and o._cluster <> $1 order by %s, o._cluster limit 1',
            (select string_agg(format('(o.z%1$s - w.z%1$s) * (o.z%1$s - w.z%1$s)', j), ' + ' order by j)
             from generate_series(1, d) j))
        into nearest using worst;
        if nearest is null then
            raise exception 'no release of % satisfies the ℓ-diversity asked, even as a single class', input
                using errcode = '22023', hint = 'lower l, or choose another sensitive column';
        end if;
        -- Merge `nearest` into `worst`.
        update pg_temp.anonproxy_ma_cluster c set _cluster = worst where c._cluster = nearest;
        execute format(
            'update pg_temp.anonproxy_ma_centroid w set n = w.n + o.n, %s
             from pg_temp.anonproxy_ma_centroid o where w._cluster = $1 and o._cluster = $2',
            (select string_agg(format('z%1$s = (w.z%1$s * w.n + o.z%1$s * o.n) / (w.n + o.n)', j), ', ' order by j)
             from generate_series(1, d) j))
        using worst, nearest;
        delete from pg_temp.anonproxy_ma_centroid o where o._cluster = nearest;
        delete from pg_temp.anonproxy_ma_dist x where x._cluster in (worst, nearest);
        execute format(
            'insert into pg_temp.anonproxy_ma_dist
             select c._cluster, i.%I::text, count(distinct i._unit)
             from pg_temp.anonproxy_ma_cluster c join %s i using (_row) where c._cluster = $1 group by 1, 2',
            sensitive, input)
        using worst;
        delete from pg_temp.anonproxy_ma_failing f where f._cluster in (worst, nearest);
        truncate pg_temp.anonproxy_sens_dist;
        insert into pg_temp.anonproxy_sens_dist
        select array[x._cluster], x.s, x.units from pg_temp.anonproxy_ma_dist x where x._cluster = worst;
        insert into pg_temp.anonproxy_ma_failing select f.key[1], f.badness from anonproxy.sensitive_failures(spec) f;
        merges := merges + 1;
        if merges % 50 = 0 then
            perform anonproxy.release_progress(merges, merges + (select count(*) from pg_temp.anonproxy_ma_failing)::integer,
                                               'merging clusters for ℓ / t');
        end if;
    end loop;
    return merges;
end
$fn$;

-- Create the output table: centroid (numeric) of each numeric quasi-identifier and
-- mode of each categorical one, per cluster. Drops the scratch tables.
create or replace function anonproxy.microaggregation_output(input regclass, spec jsonb)
returns jsonb
language plpgsql
set search_path = pg_catalog, pg_temp
as $fn$
declare
    facts jsonb;
begin
    execute format('create temp table %I (_row bigint, %s)', spec->>'output',
                   (select string_agg(format('%I %s', q->>'name', case q->>'kind' when 'numeric' then 'numeric' else 'text' end),
                                      ', ' order by i)
                    from jsonb_array_elements(spec->'qi') with ordinality as a(q, i)));
    execute format(
        'insert into pg_temp.%I
         select c._row, %s
         from pg_temp.anonproxy_ma_cluster c
         join (select c._cluster, %s from pg_temp.anonproxy_ma_cluster c join %s i using (_row) group by c._cluster) m
           using (_cluster)',
        spec->>'output',
        (select string_agg(format('m.%I', q->>'name'), ', ' order by i)
         from jsonb_array_elements(spec->'qi') with ordinality as a(q, i)),
        (select string_agg(case q->>'kind' when 'numeric' then format('avg(i.%1$I) as %1$I', q->>'name')
                                else format('mode() within group (order by i.%1$I) as %1$I', q->>'name') end,
                           ', ' order by i)
         from jsonb_array_elements(spec->'qi') with ordinality as a(q, i)),
        input);
    select jsonb_build_object('clusters', count(*), 'smallest_cluster', min(n), 'largest_cluster', max(n))
    into facts from (select count(*) as n from pg_temp.anonproxy_ma_cluster group by _cluster) x;
    perform anonproxy.drop_scratch_tables(anonproxy.microaggregation_scratch());
    return facts;
end
$fn$;

-- The query of the records of the k distinct units nearest to seed record seed_row
-- at point p, for a table where a unit may have several rows: nearest first, a unit
-- counting at its first record in that order.
create or replace function anonproxy.mdav_nearest_units(p float8[], seed_row bigint, k integer)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format('select _row from (select _row, first, sum(first) over (order by seed desc, dist, _row) as units
                                     from (select _row, _row = %1$s as seed, %2$s as dist,
                                                  (row_number() over (partition by _unit
                                                                      order by _row = %1$s desc, %2$s, _row) = 1)::integer as first
                                           from pg_temp.anonproxy_ma_open) x) y
                   where units - first < %3$s', seed_row, anonproxy.microaggregation_distance(p), k)
$$;

-- The query of an MDAV group around seed record seed_row at point p: its k nearest
-- records (of k distinct units). radius is the box size to start from (see
-- microaggregation_nearest) and comes back as the one that sufficed, halved.
create or replace function anonproxy.mdav_pick(p float8[], seed_row bigint, k integer, units_are_rows boolean,
                                               inout radius float8, out pick text)
language plpgsql
set search_path = pg_catalog, pg_temp
as $fn$
declare
    near bigint[];
begin
    if not units_are_rows then
        pick := anonproxy.mdav_nearest_units(p, seed_row, k);
        return;
    end if;
    select x.radius, x.nearest into radius, near from anonproxy.microaggregation_nearest(p, k, radius) x;
    radius := radius / 2;
    pick := format('select unnest(%L::bigint[])', near);
end
$fn$;

create or replace function anonproxy.anonymize_mdav(input regclass, spec jsonb)
returns jsonb
language plpgsql
set search_path = pg_catalog, pg_temp
set work_mem = '64MB'
as $fn$
declare
    k integer := (spec->>'k')::integer;
    d integer := anonproxy.microaggregation_stage(input, spec, 'mdav');
    total bigint;
    remaining bigint;     -- distinct units not yet clustered
    units_are_rows boolean;
    sums float8[];        -- sum of the z vectors not yet clustered, then their count
    taken float8[];
    mean float8[];
    r_row bigint;
    r float8[];
    s_row bigint;
    s float8[];
    cluster integer := 0;
    merges integer;
    radius float8 := 0.1;  -- box size for the next nearest-records query
    pick text;
begin
    select count(*), count(distinct _unit) = count(*) into total, units_are_rows from pg_temp.anonproxy_ma_open;
    remaining := (select count(distinct _unit) from pg_temp.anonproxy_ma_open);
    execute format('select array[%s, count(*)] from pg_temp.anonproxy_ma_open',
                   (select string_agg(format('sum(z%s)', j), ', ' order by j) from generate_series(1, d) j))
    into sums;
    while remaining >= 3 * k loop
        mean := (select array_agg(x / sums[d + 1]) from unnest(sums[1:d]) x);
        select f.far_row, f.far into r_row, r from anonproxy.microaggregation_farthest(mean) f;
        select f.far_row, f.far into s_row, s from anonproxy.microaggregation_farthest(r) f;
        cluster := cluster + 1;
        select x.pick, x.radius into pick, radius from anonproxy.mdav_pick(r, r_row, k, units_are_rows, radius) x;
        taken := anonproxy.microaggregation_take(d, pick, cluster);
        sums := (select array_agg(a - b order by i) from unnest(sums, taken) with ordinality as u(a, b, i));
        cluster := cluster + 1;
        select x.pick, x.radius into pick, radius from anonproxy.mdav_pick(s, s_row, k, units_are_rows, radius) x;
        taken := anonproxy.microaggregation_take(d, pick, cluster);
        sums := (select array_agg(a - b order by i) from unnest(sums, taken) with ordinality as u(a, b, i));
        remaining := case when units_are_rows then remaining - 2 * k
                          else (select count(distinct _unit) from pg_temp.anonproxy_ma_open) end;
        if cluster % 100 = 0 then
            perform anonproxy.release_progress((total - sums[d + 1])::integer, total::integer, 'mdav clustering');
        end if;
    end loop;
    if remaining >= 2 * k then
        mean := (select array_agg(x / sums[d + 1]) from unnest(sums[1:d]) x);
        select f.far_row, f.far into r_row, r from anonproxy.microaggregation_farthest(mean) f;
        cluster := cluster + 1;
        select x.pick, x.radius into pick, radius from anonproxy.mdav_pick(r, r_row, k, units_are_rows, radius) x;
        perform anonproxy.microaggregation_take(d, pick, cluster);
    end if;
    if exists (select from pg_temp.anonproxy_ma_open) then   -- the rest: fewer than 2k units
        cluster := cluster + 1;
        perform anonproxy.microaggregation_take(d, 'select _row from pg_temp.anonproxy_ma_open', cluster);
    end if;
    perform anonproxy.release_progress(total::integer, total::integer, 'mdav clustering');

    merges := anonproxy.microaggregation_merge(input, spec, d);
    return jsonb_build_object('method', 'mdav', 'merges', merges, 'suppressed_rows', 0)
           || anonproxy.microaggregation_output(input, spec);
end
$fn$;

-- The query of one t-closeness-first cluster around point p: from every stratum the
-- record nearest p, and a second one from stratum `extra` (null: none).
create or replace function anonproxy.tclose_first_pick(p float8[], k integer, extra integer) returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format('select x._row from generate_series(1, %s) s(stratum)
                   cross join lateral (select _row from pg_temp.anonproxy_ma_open o where o.stratum = s.stratum
                                       order by %s limit case s.stratum when %s then 2 else 1 end) x',
                  k, anonproxy.microaggregation_distance(p), coalesce(extra, 0))
$$;

create or replace function anonproxy.anonymize_tclose_first(input regclass, spec jsonb)
returns jsonb
language plpgsql
set search_path = pg_catalog, pg_temp
set work_mem = '64MB'
as $fn$
declare
    t float8 := (spec->>'t')::float8;
    sensitive text := spec->'sensitive'->>'name';
    numeric_sensitive boolean := spec->'sensitive'->>'kind' = 'numeric';
    k integer := (spec->>'k')::integer;
    d integer;
    n bigint;
    base bigint;          -- ⌊n/k⌋: records per stratum, and the number of clusters
    extras bigint;        -- n mod k, placed in the central strata
    counts bigint[];      -- records left per stratum
    starts bigint[];      -- first rank of strata 2 … k
    sums float8[];
    taken float8[];
    x0 float8[];
    extra integer;
    half integer;
    cluster integer := 0;
    merges integer;
begin
    if t is null or sensitive is null then
        raise exception 'tclose_first needs t and a sensitive column' using errcode = '22023';
    end if;
    d := anonproxy.microaggregation_stage(input, spec, 'tclose_first');
    select count(*) into n from pg_temp.anonproxy_ma_open;
    if (select count(distinct _unit) from pg_temp.anonproxy_ma_open) <> n then
        raise exception 'tclose_first needs one row per privacy unit: its strata and bound count records'
            using errcode = '0A000', hint = 'use method => ''mdav'', which merges clusters until t holds';
    end if;

    -- Cluster size (Domingo-Ferrer et al. 2016 Eq. 7.3, then 7.4 with the floor: the ceiling variant
    -- leaves records without a cluster, e.g. n = 11, k = 4).
    k := greatest(k, ceil(n / (2 * (n - 1) * t + 1))::integer);
    k := least(k + ((n % k) / (n / k))::integer, n);
    base := n / k;
    extras := n % k;
    -- Strata of base records in ascending order of the sensitive value, the extras in the
    -- middle one (k odd) or split between the middle two (k even).
    counts := array_fill(base, array[k]);
    if k % 2 = 1 then
        counts[(k + 1) / 2] := base + extras;
    else
        counts[k / 2] := base + (extras + 1) / 2;
        counts[k / 2 + 1] := base + extras / 2;
    end if;
    starts := (select array_agg(1 + (select coalesce(sum(c), 0) from unnest(counts[1:i - 1]) c) order by i)
               from generate_series(2, k) i);
    execute format(
        'update pg_temp.anonproxy_ma_open o set stratum = width_bucket(x.rank, $1) + 1
         from (select _row, row_number() over (order by %s, _row) as rank from %s) x where o._row = x._row',
        case when numeric_sensitive then format('%I::numeric', sensitive) else format('%I::text collate "C"', sensitive) end,
        input)
    using starts;
    perform anonproxy.microaggregation_compact(d);

    execute format('select array[%s, count(*)] from pg_temp.anonproxy_ma_open',
                   (select string_agg(format('sum(z%s)', j), ', ' order by j) from generate_series(1, d) j))
    into sums;
    while sums[d + 1] > 0 loop
        x0 := (select f.far from anonproxy.microaggregation_farthest((select array_agg(x / sums[d + 1]) from unnest(sums[1:d]) x)) f);
        for half in 1 .. 2 loop
            -- A second record from the first stratum holding more than the first one does.
            extra := (select min(i) from generate_series(2, k) i where counts[i] > counts[1]);
            cluster := cluster + 1;
            taken := anonproxy.microaggregation_take(d, anonproxy.tclose_first_pick(x0, k, extra), cluster);
            sums := (select array_agg(a - b order by i) from unnest(sums, taken) with ordinality as u(a, b, i));
            counts := (select array_agg(greatest(c - 1, 0) - case when i = extra then 1 else 0 end order by i)
                       from unnest(counts) with ordinality as u(c, i));
            exit when sums[d + 1] = 0 or half = 2;
            x0 := (select f.far from anonproxy.microaggregation_farthest(x0) f);   -- x1 of Alg. 6
        end loop;
        if cluster % 100 = 0 then
            perform anonproxy.release_progress((n - sums[d + 1])::integer, n::integer, 'tclose_first clustering');
        end if;
    end loop;
    perform anonproxy.release_progress(n::integer, n::integer, 'tclose_first clustering');

    merges := anonproxy.microaggregation_merge(input, spec, d);
    return jsonb_build_object('method', 'tclose_first', 'effective_k', k, 'merges', merges, 'suppressed_rows', 0,
                              'emd_bound', (n - k)::float8 / (2 * (n - 1) * k))
           || anonproxy.microaggregation_output(input, spec);
end
$fn$;
