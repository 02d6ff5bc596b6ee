-- Migration 0007: optimal full-domain generalization (issue 5).
--
-- anonproxy.anonymize_full_domain(input, spec) follows the method contract of
-- docs/views-internals.md. One hierarchy level per quasi-identifier; the
-- lattice of level vectors is searched for the node of least information loss
-- (NCP, suppressed rows counting as fully generalized) that satisfies k, and
-- ℓ / t when asked, with at most spec.suppression_limit of the rows suppressed.
--
-- Counts are rolled up: the distinct-unit counts per combination of leaves are
-- computed once (anonproxy_fd_cells, each cell carrying its ancestors' ids per
-- level), and a node is one GROUP BY over that table. Search order is by a
-- lower bound of the loss (the loss without suppression, which is separable
-- per attribute); a failing node prunes every specialization of itself.
--
-- anonproxy.sensitive_failures(spec) is the ℓ / t test on class distributions,
-- shared with the microaggregation methods of 0008 (not with verification).

-- The classes of pg_temp.anonproxy_sens_dist(key, s, units) that fail the ℓ or
-- t asked for in spec, t measured against pg_temp.anonproxy_sens_global(s, units).
-- badness orders the failures: EMD minus t, or the ℓ shortfall.
create or replace function anonproxy.sensitive_failures(spec jsonb)
returns table (key integer[], badness float8)
language plpgsql
set search_path = pg_catalog, pg_temp
as $fn$
declare
    l float8 := (spec->>'l')::float8;
    l_kind text := coalesce(spec->>'l_kind', 'entropy');
    c float8 := (spec->>'c')::float8;
    t float8 := (spec->>'t')::float8;
    distance text := coalesce(spec->>'t_distance', 'ordered');
    numeric_sensitive boolean := spec->'sensitive'->>'kind' = 'numeric';
    sensitive_hierarchy text := spec->'sensitive'->>'hierarchy';
    height integer;
    missing text;
begin
    if t is not null and distance = 'hierarchical' then
        select h.levels into height from anonproxy.hierarchies h where h.name = sensitive_hierarchy;
        if height is null then
            raise exception 'hierarchical t-closeness needs a hierarchy for the sensitive column %',
                spec->'sensitive'->>'name'
                using errcode = '22023', hint = 'register one and name it in the hierarchies argument';
        end if;
        select g.s into missing from pg_temp.anonproxy_sens_global g
        where (select count(*) from anonproxy.hierarchy_nodes n
               where n.hierarchy = sensitive_hierarchy and n.leaf = g.s and n.level between 1 and height)
              <> height
        limit 1;
        if found then
            raise exception 'value % of the sensitive column is not a leaf of hierarchy %', missing, sensitive_hierarchy
                using errcode = '22023';
        end if;
    end if;
    return query
    with glob as (
        select g.s, g.units::float8 / sum(g.units) over () as q,
               row_number() over (order by case when numeric_sensitive then g.s::numeric end, g.s collate "C") as ord
        from pg_temp.anonproxy_sens_global g),
    tot as (
        select d.key, sum(d.units)::float8 as n from pg_temp.anonproxy_sens_dist d group by d.key),
    grid as (
        select tot.key, glob.s, glob.ord, glob.q, coalesce(d.units, 0) / tot.n as p
        from tot cross join glob
        left join pg_temp.anonproxy_sens_dist d on d.key = tot.key and d.s = glob.s),
    ordered_emd as (
        select x.key, sum(abs(x.running)) / greatest((select count(*) from glob) - 1, 1) as emd
        from (select grid.key, sum(grid.p - grid.q) over (partition by grid.key order by grid.ord) as running
              from grid) x
        group by x.key),
    equal_emd as (
        select grid.key, sum(abs(grid.p - grid.q)) / 2 as emd from grid group by grid.key),
    ancestors as (
        select glob.s, 0 as level, glob.s as node from glob
        union all
        select n.leaf, n.level, n.node from anonproxy.hierarchy_nodes n
        where distance = 'hierarchical' and n.hierarchy = sensitive_hierarchy
          and n.level between 1 and height and n.leaf in (select glob.s from glob)),
    extra as (   -- extra(child) for every (child at level j, parent at level j+1)
        select grid.key, a.level + 1 as level, b.node as parent, a.node as child, sum(grid.p - grid.q) as extra
        from grid join ancestors a on a.s = grid.s
        join ancestors b on b.s = grid.s and b.level = a.level + 1
        group by grid.key, a.level, b.node, a.node),
    hierarchical_emd as (
        select y.key, sum(y.level::float8 / height * least(y.pos, y.neg)) as emd
        from (select e.key, e.level, e.parent,
                     sum(greatest(e.extra, 0)) as pos, sum(greatest(-e.extra, 0)) as neg
              from extra e group by e.key, e.level, e.parent) y
        group by y.key),
    emd as (
        select * from ordered_emd where t is not null and distance = 'ordered'
        union all select * from equal_emd where t is not null and distance = 'equal'
        union all select * from hierarchical_emd where t is not null and distance = 'hierarchical'),
    diversity as (
        select r.key,
               count(*) filter (where r.units > 0) as distinct_values,
               -sum(r.p * ln(r.p)) filter (where r.units > 0) as entropy,
               max(r.units) as r1,
               coalesce(sum(r.units) filter (where r.rank >= l), 0) as tail
        from (select d.key, d.units, d.units / tot.n as p,
                     row_number() over (partition by d.key order by d.units desc) as rank
              from pg_temp.anonproxy_sens_dist d join tot on tot.key = d.key) r
        group by r.key),
    shortfall as (
        select dv.key,
               case when l is null then null
                    when l_kind = 'distinct' then l - dv.distinct_values
                    when l_kind = 'entropy' then ln(l) - dv.entropy
                    else dv.r1 - c * dv.tail end as short
        from diversity dv)
    select tot.key, greatest(emd.emd - t, sf.short)
    from tot left join emd on emd.key = tot.key left join shortfall sf on sf.key = tot.key
    where emd.emd > t + 1e-12
       or (l_kind = 'recursive' and sf.short >= 0)
       or (l_kind <> 'recursive' and sf.short > 1e-12);
end
$fn$;

-- Evaluate one lattice node over pg_temp.anonproxy_fd_cells. The verdict is 'pass',
-- 'fail_k' when k alone needs too much suppression, or 'fail'; loss is the NCP
-- with suppressed rows counting as fully generalized (bound is the node's NCP
-- with nothing suppressed). With materialize, or when ℓ / t are asked,
-- pg_temp.anonproxy_fd_class is left holding the node's classes. A level of -1
-- leaves the attribute out (a projection of the lattice, for pruning).
create or replace function anonproxy.full_domain_node(
    node integer[], spec jsonb, total_rows bigint, max_suppressed bigint, bound float8,
    units_are_rows boolean, materialize boolean,
    out verdict text, out suppressed_rows bigint, out loss float8)
language plpgsql
set search_path = pg_catalog, pg_temp
set work_mem = '64MB'
as $fn$
declare
    k integer := (spec->>'k')::integer;
    m integer := jsonb_array_length(spec->'qi');
    columns text;      -- the cells' node ids at this node's levels
    cell_loss text;    -- a cell's summed NCP at this node
    classes text;      -- (units, nrows, loss) per class; with key when materialized
    suppressed_loss float8;
    failed integer;
begin
    select string_agg(format('g%s_%s', i, node[i]), ', ' order by i),
           string_agg(format('n%s_%s', i, node[i]), ' + ' order by i)
    into columns, cell_loss from generate_series(1, m) i where node[i] >= 0;   -- -1: left out
    classes := format(
        'select array[%1$s] as key, %3$s as units, sum(nrows) as nrows, sum(nrows * (%2$s)) as loss
         from pg_temp.anonproxy_fd_cells c group by %1$s',
        columns, cell_loss,
        case when units_are_rows then 'sum(units)'
             -- a unit with rows in several cells counts once per class
             else '(select count(distinct cu.unit) from pg_temp.anonproxy_fd_cell_units cu
                    where cu.cell = any(array_agg(c.cell)))' end);
    if not materialize and spec->>'l' is null and spec->>'t' is null then
        execute format('select coalesce(sum(nrows) filter (where units < $1), 0),
                               coalesce(sum(loss) filter (where units < $1), 0) from (%s) x', classes)
        into suppressed_rows, suppressed_loss using k;
        verdict := case when suppressed_rows > max_suppressed then 'fail_k' else 'pass' end;
        loss := bound + (suppressed_rows * m - suppressed_loss) / (total_rows * m);
        return;
    end if;

    truncate pg_temp.anonproxy_fd_class;
    execute format('insert into pg_temp.anonproxy_fd_class (key, units, nrows, loss) %s', classes);
    update pg_temp.anonproxy_fd_class c set suppressed = true where c.units < k;
    select coalesce(sum(c.nrows) filter (where c.suppressed), 0) into suppressed_rows from pg_temp.anonproxy_fd_class c;
    if suppressed_rows > max_suppressed then
        verdict := 'fail_k';
        return;
    end if;
    if spec->>'l' is not null or spec->>'t' is not null then
        truncate pg_temp.anonproxy_sens_dist;
        execute format(
            'insert into pg_temp.anonproxy_sens_dist
             select x.key, x.s, x.units
             from (select array[%1$s] as key, s, %2$s as units from pg_temp.anonproxy_fd_cells c group by %1$s, s) x
             join pg_temp.anonproxy_fd_class c on c.key = x.key and not c.suppressed',
            columns,
            case when units_are_rows then 'sum(units)'
                 else '(select count(distinct cu.unit) from pg_temp.anonproxy_fd_cell_units cu
                        where cu.cell = any(array_agg(c.cell)))' end);
        loop
            truncate pg_temp.anonproxy_sens_global;
            insert into pg_temp.anonproxy_sens_global
            select d.s, sum(d.units) from pg_temp.anonproxy_sens_dist d group by d.s;
            -- t is measured against the released rows, so suppressing a class can move
            -- the others: repeat until nothing more fails.
            update pg_temp.anonproxy_fd_class c set suppressed = true
            from anonproxy.sensitive_failures(spec) f where f.key = c.key;
            get diagnostics failed = row_count;
            exit when failed = 0;
            delete from pg_temp.anonproxy_sens_dist d using pg_temp.anonproxy_fd_class c
            where c.key = d.key and c.suppressed;
            select coalesce(sum(c.nrows) filter (where c.suppressed), 0) into suppressed_rows
            from pg_temp.anonproxy_fd_class c;
            if suppressed_rows > max_suppressed or suppressed_rows = total_rows then
                verdict := 'fail';
                return;
            end if;
            exit when spec->>'t' is null;   -- ℓ of a class does not depend on the others
        end loop;
    end if;
    select (coalesce(sum(c.loss) filter (where not c.suppressed), 0) + suppressed_rows * m) / (total_rows * m)
    into loss from pg_temp.anonproxy_fd_class c;
    verdict := 'pass';
end
$fn$;

create or replace function anonproxy.anonymize_full_domain(input regclass, spec jsonb)
returns jsonb
language plpgsql
set search_path = pg_catalog, pg_temp
as $fn$
declare
    m integer := jsonb_array_length(spec->'qi');
    suppression_limit float8 := coalesce((spec->>'suppression_limit')::float8, 0);
    wants_sensitive boolean := spec->>'l' is not null or spec->>'t' is not null;
    sensitive text := spec->'sensitive'->>'name';
    output text := spec->>'output';
    names text[];
    heights integer[] := '{}';
    i_q integer;
    n bigint;
    h text;
    h_levels integer;
    kind text;
    missing text;
    total_rows bigint;
    max_suppressed bigint;
    units_are_rows boolean;
    lattice_size bigint;
    evaluated integer := 0;
    cand_node integer[];
    j_q integer;
    a_level integer;
    lowest_pass integer;
    projection integer[];
    evaluated_projections integer := 0;
    cand_bound float8;
    cand_lb float8;
    floor_node integer[];
    columns text;
    below text;         -- node[i] <= $1[i] for every i
    descent integer[];  -- the node whose children the descent visits
    result record;
    best integer[];
    best_loss float8 := 'infinity';
    best_suppressed bigint;
    classes bigint;
    scratch_tables text[] := array['anonproxy_fd_map', 'anonproxy_fd_leaf', 'anonproxy_fd_cells',
        'anonproxy_fd_cell_units', 'anonproxy_fd_class', 'anonproxy_fd_level', 'anonproxy_fd_lattice', 'anonproxy_fd_rolled', 'anonproxy_sens_dist',
        'anonproxy_sens_global'];
begin
    if wants_sensitive and sensitive is null then
        raise exception 'ℓ-diversity and t-closeness need a sensitive column' using errcode = '22023';
    end if;
    select array_agg(x->>'name' order by i) into names from jsonb_array_elements(spec->'qi') with ordinality as a(x, i);
    execute format('select count(*) from %s', input) into total_rows;
    max_suppressed := floor(suppression_limit * total_rows);

    perform anonproxy.drop_scratch_tables(scratch_tables);   -- left by an earlier call in this session
    create temp table anonproxy_fd_map (q integer, leaf text, level integer, node text);
    create temp table anonproxy_fd_leaf (q integer, leaf text, ids integer[], ncp float8[], nodes text[],
                                         primary key (q, leaf));

    -- Each QI's leaves (the values present) with their node, node id and NCP per level.
    for i_q in 1 .. m loop
        h := spec->'qi'->(i_q - 1)->>'hierarchy';
        kind := spec->'qi'->(i_q - 1)->>'kind';
        select hs.levels into h_levels from anonproxy.hierarchies hs where hs.name = h;
        if h is null or h_levels is null then
            raise exception 'full-domain generalization needs a hierarchy for quasi-identifier %', names[i_q]
                using errcode = '22023',
                      hint = 'register one (an interval hierarchy for a numeric column) and name it in the hierarchies argument';
        end if;
        execute format('select count(*) from %s where %I is null', input, names[i_q]) into n;
        if n > 0 then
            raise exception 'quasi-identifier % has NULL values, which no hierarchy level covers', names[i_q]
                using errcode = '22023';
        end if;
        execute format(
            'insert into pg_temp.anonproxy_fd_map
             select $1, v.leaf, l.level, case when l.level = 0 then v.leaf else n.node end
             from (select distinct %I::text as leaf from %s) v
             cross join generate_series(0, $3) l(level)
             left join anonproxy.hierarchy_nodes n on n.hierarchy = $2 and n.leaf = v.leaf and n.level = l.level',
            names[i_q], input) using i_q, h, h_levels;
        select mp.leaf into missing from pg_temp.anonproxy_fd_map mp where mp.q = i_q and mp.node is null limit 1;
        if found then
            raise exception 'value % of quasi-identifier % is not a leaf of hierarchy %', missing, names[i_q], h
                using errcode = '22023', hint = 'every value of the column needs a node at every level';
        end if;
        insert into pg_temp.anonproxy_fd_leaf
        select i_q, x.leaf, array_agg(x.id order by x.level), array_agg(x.ncp order by x.level),
               array_agg(x.node order by x.level)
        from (select mp.leaf, mp.level, mp.node,
                     dense_rank() over (partition by mp.level order by mp.node)::integer as id,
                     -- NCP of a node: share of the column's range (numeric) or of its
                     -- distinct values (categorical) that the node covers
                     coalesce(case when kind = 'numeric'
                         then ((max(mp.number) over node) - (min(mp.number) over node))
                              / nullif((max(mp.number) over col) - (min(mp.number) over col), 0)
                         else ((count(*) over node) - 1)::numeric / nullif((count(*) over col) - 1, 0)
                     end, 0)::float8 as ncp
              from (select m.*, case when kind = 'numeric' then m.leaf::numeric end as number
                    from pg_temp.anonproxy_fd_map m) mp
              where mp.q = i_q
              window node as (partition by mp.level, mp.node), col as (partition by mp.level)) x
        group by x.leaf;
        heights := heights || h_levels;
    end loop;

    -- Distinct-unit counts per leaf combination (and sensitive value): the only scan of
    -- the input. Each cell carries its node id (g<qi>_<level>) and NCP (n<qi>_<level>)
    -- at every level, so a node's classes are one GROUP BY over the cells (rollup).
    execute format(
        'create temp table anonproxy_fd_cells as
         select row_number() over () as cell, c.*, %s
         from (select %s, %s as s, count(distinct _unit) as units, count(*) as nrows
               from %s group by %s) c
         %s',
        (select string_agg(format('l%s.ids[%s] as g%s_%s, l%s.ncp[%s] as n%s_%s', i, j + 1, i, j, i, j + 1, i, j),
                           ', ' order by i, j)
         from generate_series(1, m) i, generate_series(0, heights[i]) j),
        (select string_agg(format('%I::text as v%s', names[i], i), ', ' order by i) from generate_series(1, m) i),
        case when wants_sensitive then format('%I::text', sensitive) else 'null::text' end,
        input, (select string_agg(i::text, ', ') from generate_series(1, m + 1) i),
        (select string_agg(format('join pg_temp.anonproxy_fd_leaf l%s on l%s.q = %s and l%s.leaf = c.v%s',
                                  i, i, i, i, i), ' ' order by i)
         from generate_series(1, m) i));
    if wants_sensitive and exists (select from pg_temp.anonproxy_fd_cells where s is null) then
        raise exception 'the sensitive column % has NULL values', sensitive using errcode = '22023';
    end if;

    -- A unit with rows in several cells would be counted twice by summing: then count
    -- distinct units per class through the (cell, unit) pairs instead.
    execute format('select count(distinct _unit) from %s', input) into n;
    units_are_rows := n = (select sum(units) from pg_temp.anonproxy_fd_cells);
    if not units_are_rows then
        execute format(
            'create temp table anonproxy_fd_cell_units as
             select distinct c.cell, i._unit as unit from %s i join pg_temp.anonproxy_fd_cells c on %s',
            input,
            (select string_agg(format('c.v%s = i.%I::text', i, names[i]), ' and ' order by i)
             from generate_series(1, m) i)
            || case when wants_sensitive then format(' and c.s = i.%I::text', sensitive) else '' end);
        create index on pg_temp.anonproxy_fd_cell_units (cell);
    end if;
    create temp table anonproxy_fd_class (key integer[] primary key, units bigint, nrows bigint, loss float8,
                                          suppressed boolean not null default false);
    create temp table anonproxy_sens_dist (key integer[], s text, units bigint);
    create temp table anonproxy_sens_global (s text, units bigint);

    -- The lattice, each node with the lower bound of its loss: the NCP it would have
    -- with nothing suppressed, a sum of per-attribute averages.
    execute 'create temp table anonproxy_fd_level as '
        || (select string_agg(format('select %s as q, %s as level, sum(nrows * n%s_%s) / %s as loss
                                      from pg_temp.anonproxy_fd_cells', i, j, i, j, total_rows),
                              ' union all ' order by i, j)
            from generate_series(1, m) i, generate_series(0, heights[i]) j);
    execute format(
        'create temp table anonproxy_fd_lattice as
         select array[%1$s] as node, (%2$s) / %3$s as lb, (%2$s) / %3$s as bound, %4$s as height,
                null::text as state, null::float8 as loss
         from %5$s where %6$s',
        (select string_agg(format('a%s.level', i), ', ' order by i) from generate_series(1, m) i),
        (select string_agg(format('a%s.loss', i), ' + ' order by i) from generate_series(1, m) i),
        m,
        (select string_agg(format('a%s.level', i), ' + ' order by i) from generate_series(1, m) i),
        (select string_agg(format('pg_temp.anonproxy_fd_level a%s', i), ', ' order by i) from generate_series(1, m) i),
        (select string_agg(format('a%s.q = %s', i, i), ' and ' order by i) from generate_series(1, m) i));
    create index on pg_temp.anonproxy_fd_lattice (bound, height) where state is null;
    analyze pg_temp.anonproxy_fd_lattice;
    lattice_size := (select count(*) from pg_temp.anonproxy_fd_lattice);

    -- Subset property (Incognito): if the projection of a node onto two attributes already
    -- needs more than the allowed suppression for k, so does the node. For each pair, the
    -- passing levels form a staircase: for each level a of the first attribute, the least
    -- passing level of the second; everything under the staircase is pruned.
    for i_q in 1 .. m loop
        for j_q in i_q + 1 .. m loop
            lowest_pass := heights[j_q] + 1;
            for a_level in 0 .. heights[i_q] loop
                while lowest_pass > 0 loop
                    projection := array_fill(-1, array[m]);
                    projection[i_q] := a_level;
                    projection[j_q] := lowest_pass - 1;
                    result := anonproxy.full_domain_node(projection, spec - 'l' - 't', total_rows, max_suppressed,
                                                         0, units_are_rows, false);
                    evaluated_projections := evaluated_projections + 1;
                    exit when result.verdict <> 'pass';
                    lowest_pass := lowest_pass - 1;
                end loop;
                update pg_temp.anonproxy_fd_lattice l set state = 'pruned'
                where l.state is null and l.node[i_q] = a_level and l.node[j_q] < lowest_pass;
            end loop;
        end loop;
    end loop;

    -- Rollup: every open node is at or above the meet of the open nodes, so the cells
    -- can be summed up to that node once (when counting units by summing is exact).
    select array_agg((select min(l.node[i]) from pg_temp.anonproxy_fd_lattice l where l.state is null) order by i)
    into floor_node from generate_series(1, m) i;
    if units_are_rows and floor_node[1] is not null then
        columns := (select string_agg(format('g%s_%s, n%s_%s', i, j, i, j), ', ' order by i, j)
                    from generate_series(1, m) i, generate_series(floor_node[i], heights[i]) j);
        execute format('create temp table anonproxy_fd_rolled as
                        select %s, s, sum(units) as units, sum(nrows) as nrows
                        from pg_temp.anonproxy_fd_cells group by %s, s', columns, columns);
        drop table pg_temp.anonproxy_fd_cells;
        alter table pg_temp.anonproxy_fd_rolled rename to anonproxy_fd_cells;
    end if;

    -- Search. First a greedy descent from the top node (to the cheapest satisfying
    -- child, while one satisfies): the nodes failing just under the frontier prune large
    -- parts of the lattice. Then best-first by bound, until no open node can beat the
    -- best found (without suppression a node's loss is its bound).
    below := (select string_agg(format('node[%s] <= $1[%s]', i, i), ' and ' order by i) from generate_series(1, m) i);
    descent := heights;
    cand_node := heights;
    loop
        if cand_node is null and descent is not null then
            execute format('select l.node, l.bound from pg_temp.anonproxy_fd_lattice l
                            where l.state is null and l.height = $2 - 1 and %s order by l.bound limit 1', below)
            into cand_node, cand_bound using descent, (select sum(x) from unnest(descent) x);
            if cand_node is null then   -- every child decided: go down to the cheapest satisfying one
                execute format('select l.node from pg_temp.anonproxy_fd_lattice l
                                where l.state = ''pass'' and l.height = $2 - 1 and %s order by l.loss limit 1', below)
                into descent using descent, (select sum(x) from unnest(descent) x);
                continue;
            end if;
        elsif cand_node is null then
            select l.node, l.bound into cand_node, cand_bound from pg_temp.anonproxy_fd_lattice l
            where l.state is null order by l.bound, l.height, l.node limit 1;
            exit when not found or cand_bound >= best_loss;
        end if;
        cand_lb := (select l.lb from pg_temp.anonproxy_fd_lattice l where l.node = cand_node);
        result := anonproxy.full_domain_node(cand_node, spec, total_rows, max_suppressed, cand_lb,
                                             units_are_rows, false);
        evaluated := evaluated + 1;
        update pg_temp.anonproxy_fd_lattice l set state = result.verdict, loss = result.loss where l.node = cand_node;
        -- A specialization suppresses at least the rows this node suppresses (for k), so
        -- its loss exceeds its bound by at least this node's excess.
        if result.loss is not null and not wants_sensitive then
            execute format('update pg_temp.anonproxy_fd_lattice set bound = greatest(bound, lb + $2)
                            where state is null and %s', below)
            using cand_node, result.loss - cand_lb;
        end if;
        -- k with suppression is monotone; ℓ and t are when nothing may be suppressed.
        if result.verdict = 'fail_k' or (result.verdict = 'fail' and max_suppressed = 0) then
            execute format('update pg_temp.anonproxy_fd_lattice set state = ''pruned'' where state is null and %s', below)
            using cand_node;
        elsif result.verdict = 'pass' and result.loss < best_loss then
            best := cand_node;
            best_loss := result.loss;
            best_suppressed := result.suppressed_rows;
        end if;
        if cand_node = heights and result.verdict <> 'pass' then
            descent := null;   -- ℓ / t with suppression: the top node may fail where others pass
        end if;
        cand_node := null;
        if evaluated % 20 = 0 then
            perform anonproxy.release_progress(
                (select count(*) from pg_temp.anonproxy_fd_lattice where state is not null)::integer,
                lattice_size::integer, 'full_domain lattice search');
        end if;
    end loop;
    if best is null then
        raise exception 'no full-domain generalization satisfies the privacy model with at most % suppressed rows',
            max_suppressed
            using errcode = '22023', hint = 'raise suppression_limit, or ask for a smaller k, ℓ or a larger t';
    end if;

    -- Release the best node: every row of a class that is not suppressed.
    result := anonproxy.full_domain_node(best, spec, total_rows, max_suppressed, 0, units_are_rows, true);
    select count(*) into classes from pg_temp.anonproxy_fd_class where not suppressed;
    execute format('create temp table %I (_row bigint, %s)', output,
                   (select string_agg(format('%I text', names[i]), ', ' order by i) from generate_series(1, m) i));
    execute format(
        'insert into pg_temp.%I
         select i._row, %s from %s i %s
         where not exists (select from pg_temp.anonproxy_fd_class c
                           where c.suppressed and c.key = array[%s])',
        output,
        (select string_agg(format('l%s.nodes[$1[%s] + 1]', i, i), ', ' order by i) from generate_series(1, m) i),
        input,
        (select string_agg(format('join pg_temp.anonproxy_fd_leaf l%s on l%s.q = %s and l%s.leaf = i.%I::text',
                                  i, i, i, i, names[i]), ' ' order by i)
         from generate_series(1, m) i),
        (select string_agg(format('l%s.ids[$1[%s] + 1]', i, i), ', ' order by i) from generate_series(1, m) i))
    using best;

    perform anonproxy.drop_scratch_tables(scratch_tables);
    return jsonb_build_object(
        'method', 'full_domain',
        'metric', 'ncp',
        'levels', (select jsonb_object_agg(names[i], best[i]) from generate_series(1, m) i),
        'level_vector', to_jsonb(best),
        'loss', best_loss,
        'nodes_evaluated', evaluated,
        'projections_evaluated', evaluated_projections,
        'lattice_size', lattice_size,
        'suppressed_rows', best_suppressed,
        'equivalence_classes', classes);
end
$fn$;
