-- Migration 0045: Mondrian makes each summary cell once, and its rounds rename no table (issue 23).
--
-- anonproxy.anonymize_mondrian is sql/0044's but for two things; every
-- release (strict and relaxed) is the same as 0036's, cell for cell, with the
-- same facts (tests/test_mondrian_same_release.py):
--   * the summary makes the text of a cell once per distinct (QI, lower
--     bound, upper bound) and each final partition looks its cells up by its
--     bounds (on adult k = 10: 1,317 cells made for 16,736 (partition, QI)
--     pairs), instead of making it for every pair and gathering the pairs
--     back into rows by partition;
--   * the open atoms and the histogram each live in a pair of tables, one
--     read and one written by a round, whose roles swap by name in
--     variables; 0044 renamed the tables (six ALTER TABLE RENAMEs per round,
--     each a catalog update of the table and its row types), and the
--     truncation of the table to be written joins the round's one TRUNCATE.
--     code_c is written with mod() so that it holds no %, and the halves'
--     statement can be a format() template filled each round.
-- Measured in benchmarks/views/README.md ("2026-11-29, sql/0045").

create or replace function anonproxy.anonymize_mondrian(input regclass, spec jsonb)
returns jsonb
language plpgsql
set search_path = pg_catalog, pg_temp
-- Every statement is a bulk operation over many partitions; temp tables have
-- no statistics between rounds, and a misestimated nested loop costs minutes;
-- a merge join sorts both sides (the output's: every row of the input).
set enable_nestloop = off
set enable_mergejoin = off
set work_mem = '128MB'
set jit = off
set default_statistics_target = 10
as $fn$
declare
    started timestamptz := clock_timestamp();
    variant text := coalesce(spec->>'variant', 'strict');
    k integer := (spec->>'k')::integer;
    l numeric := (spec->>'l')::numeric;
    l_kind text := coalesce(spec->>'l_kind', 'entropy');
    c numeric := (spec->>'c')::numeric;
    t numeric := (spec->>'t')::numeric;
    t_distance text := coalesce(spec->>'t_distance', 'ordered');
    sens jsonb := nullif(spec->'sensitive', 'null'::jsonb);
    output text := coalesce(spec->>'output', 'anonproxy_output');
    qi jsonb := spec->'qi';
    dims integer := jsonb_array_length(spec->'qi');
    q jsonb;
    j integer;
    bad text;
    pure boolean;            -- no unit has two (codes, sensitive) combinations
    unique_units boolean;    -- every row is its own unit
    merged boolean;          -- atoms merge units (strict over pure units)
    code_sql text[];         -- code of QI 1, ... of a key
    code_c text;             -- code of atom a on the QI of candidate (or split) c (no %: see halves_sql)
    places numeric[];        -- where each QI's code is in a key
    key_sql text;            -- the key of a row of input i
    key_type text;
    s_sql text;              -- the sensitive value's code of a key
    sizes bigint[];          -- codes per QI
    size bigint;
    radix numeric;
    n_sensitive integer := 0;  -- codes of the sensitive column (none unless a model reads it)
    joins_sql text := '';
    side_sql text;
    halves_sql text;         -- a format() template: %1$I the open atoms, %2$I the histogram
    codes_hist text;         -- units per (part, dim, code), the sensitive values summed (%I: the histogram)
    -- Each round reads the open atoms and the histogram from one table of a
    -- pair and writes the next round's into the other; the pairs swap roles.
    atoms text := '_mondrian_atoms';
    atoms_next text := '_mondrian_next';
    hist text := '_mondrian_hist';
    hist_next text := '_mondrian_hist_next';
    failing_sql text;
    rounds integer := 0;
    estimate integer;
    n_rows bigint;
    n_atoms bigint;
    open_parts bigint := 1;
    next_part integer := 1;  -- the highest partition id given so far
    levels integer;
begin
    if variant not in ('strict', 'relaxed') then
        raise exception using errcode = '22023',
            message = format('unknown Mondrian variant %L', variant), hint = 'use strict or relaxed';
    end if;
    if k is null or k < 1 then
        raise exception using errcode = '22023', message = 'spec.k must be a positive integer';
    end if;
    if dims is null or dims < 1 then
        raise exception using errcode = '22023', message = 'spec.qi must name at least one quasi-identifier';
    end if;
    if (l is not null or t is not null) and sens is null then
        raise exception using errcode = '22023',
            message = 'ℓ-diversity and t-closeness need spec.sensitive';
    end if;
    if l is not null and l_kind not in ('distinct', 'entropy', 'recursive') then
        raise exception using errcode = '22023', message = format('unknown ℓ-diversity kind %L', l_kind),
            hint = 'use distinct, entropy or recursive';
    end if;
    if l is not null and l_kind = 'recursive' and c is null then
        raise exception using errcode = '22023', message = 'recursive (c,ℓ)-diversity needs spec.c';
    end if;
    if t is not null and t_distance not in ('ordered', 'equal', 'hierarchical') then
        raise exception using errcode = '22023', message = format('unknown t-closeness distance %L', t_distance),
            hint = 'use ordered, equal or hierarchical';
    end if;
    if t is not null and t_distance = 'hierarchical' and sens->>'hierarchy' is null then
        raise exception using errcode = '22023',
            message = 'hierarchical t-closeness needs a hierarchy on the sensitive column';
    end if;

    perform anonproxy.drop_scratch_tables(array['_mondrian_dims', '_mondrian_dom', '_mondrian_anc',
        '_mondrian_sdom', '_mondrian_snodes', '_mondrian_rows', '_mondrian_atoms', '_mondrian_done',
        '_mondrian_next', '_mondrian_kids', '_mondrian_cand', '_mondrian_hist',
        '_mondrian_hist_next', '_mondrian_halves', '_mondrian_chosen', '_mondrian_summary']);   -- left by an earlier call

    -- QIs, their codes, and for tree QIs every leaf's ancestor at every level.
    create temp table _mondrian_dims (
        dim integer primary key, name text not null, kind text not null, hierarchy text, span numeric,
        vals text[], nums numeric[],  -- the value of each code
        place numeric, n_codes integer);  -- the QI's code in a key: key / place % n_codes + 1
    create temp table _mondrian_dom (dim integer, code integer, txt text, num numeric, primary key (dim, code));
    create temp table _mondrian_anc (
        dim integer, code integer, level integer, lo integer, hi integer, node text, starts integer[],
        primary key (dim, code, level));
    for j in 1 .. dims loop
        q := qi->(j - 1);
        if q->>'kind' = 'numeric' then
            insert into _mondrian_dims values (j, q->>'name', 'numeric', null, null);
            execute format(
                'insert into _mondrian_dom (dim, code, txt, num)
                 select %s, dense_rank() over (order by v), v::text, v
                   from (select distinct %I::numeric as v from %s) s where v is not null',
                j, q->>'name', input);
            update _mondrian_dims set span = (select max(num) - min(num) from _mondrian_dom where dim = j)
             where dim = j;
        elsif q->>'hierarchy' is null then
            insert into _mondrian_dims values (j, q->>'name', 'set', null, null);
            execute format(
                'insert into _mondrian_dom (dim, code, txt)
                 select %s, dense_rank() over (order by v), v
                   from (select distinct %I::text as v from %s) s where v is not null',
                j, q->>'name', input);
            update _mondrian_dims set span = (select count(*) - 1 from _mondrian_dom where dim = j) where dim = j;
        else
            insert into _mondrian_dims values (j, q->>'name', 'tree', q->>'hierarchy', null);
            select h.levels into levels from anonproxy.hierarchies h where h.name = q->>'hierarchy';
            if not found then
                raise exception using errcode = '42704',
                    message = format('hierarchy %L of column %I does not exist', q->>'hierarchy', q->>'name');
            end if;
            -- Sorting leaves by their path from the top is a depth-first walk.
            insert into _mondrian_dom (dim, code, txt)
            select j, row_number() over (order by path), leaf
              from (select n.leaf, array_agg(n.node order by n.level desc) as path
                      from anonproxy.hierarchy_nodes n where n.hierarchy = q->>'hierarchy'
                     group by n.leaf) p;
            insert into _mondrian_anc (dim, code, level, lo, hi, node)
            select j, d.code, n.level,
                   min(d.code) over (partition by n.level, n.node),
                   max(d.code) over (partition by n.level, n.node), n.node
              from _mondrian_dom d
              join anonproxy.hierarchy_nodes n on n.hierarchy = q->>'hierarchy' and n.leaf = d.txt
             where d.dim = j;
            -- A node's children start at these codes: width_bucket(code, starts) picks the child.
            update _mondrian_anc x set starts = c.starts
              from (select p.level, p.lo, array_agg(distinct ch.lo order by ch.lo) as starts
                      from _mondrian_anc p
                      join _mondrian_anc ch on (ch.dim, ch.code, ch.level) = (p.dim, p.code, p.level - 1)
                     where p.dim = j group by p.level, p.lo) c
             where x.dim = j and (x.level, x.lo) = (c.level, c.lo);
            update _mondrian_dims set span = (select count(*) - 1 from _mondrian_dom where dim = j) where dim = j;
        end if;
        joins_sql := joins_sql || format(' join _mondrian_dom d%1$s on d%1$s.dim = %1$s and d%1$s.%2$s = i.%3$I%4$s',
            j, case when q->>'kind' = 'numeric' then 'num' else 'txt' end, q->>'name',
            case when q->>'kind' = 'numeric' then '::numeric' else '::text' end);
    end loop;
    update _mondrian_dims d set vals = v.vals, nums = v.nums
      from (select dim, array_agg(txt order by code) as vals, array_agg(num order by code) as nums
              from _mondrian_dom group by dim) v
     where v.dim = d.dim;
    analyze _mondrian_dom;
    analyze _mondrian_anc;

    -- The sensitive column, when a model reads it: codes in value order, and
    -- (below) the table's distribution q.
    if l is not null or t is not null then
        create temp table _mondrian_sdom (s integer primary key, txt text, num numeric, q double precision);
        if sens->>'kind' = 'numeric' then
            execute format('insert into _mondrian_sdom (s, txt, num)
                            select dense_rank() over (order by v), v::text, v
                              from (select distinct %I::numeric as v from %s) x', sens->>'name', input);
            joins_sql := joins_sql || format(' join _mondrian_sdom sd on sd.num = i.%I::numeric', sens->>'name');
        else
            execute format('insert into _mondrian_sdom (s, txt)
                            select dense_rank() over (order by v), v
                              from (select distinct %I::text as v from %s) x', sens->>'name', input);
            joins_sql := joins_sql || format(' join _mondrian_sdom sd on sd.txt = i.%I::text', sens->>'name');
        end if;
        select count(*) into n_sensitive from _mondrian_sdom;
    end if;

    -- Each row's codes and sensitive value as one number in mixed radix (the
    -- key): rows, atoms and the output then match on one integer; bigint
    -- when every combination fits, else numeric.
    select array_agg(n order by dim) into sizes from (select dim, count(*) as n from _mondrian_dom group by dim) x;
    radix := 1;
    foreach size in array sizes loop
        radix := radix * size;
    end loop;
    key_type := case when radix * (1 + n_sensitive) < 2::numeric ^ 62
                     then 'bigint' else 'numeric' end;
    key_sql := case when l is null and t is null then '0' else format('sd.s::%s * %s', key_type, radix) end;
    s_sql := format(case key_type when 'bigint' then '(key / %s)::integer' else 'div(key, %s)::integer' end, radix);
    radix := 1;
    for j in 1 .. dims loop
        key_sql := key_sql || format(' + (d%s.code - 1)::%s * %s', j, key_type, radix);
        code_sql[j] := format(case key_type when 'bigint' then '(key / %s %% %s + 1)::integer'
                                            else '(div(key, %s) %% %s + 1)::integer' end, radix, sizes[j]);
        places[j] := radix;
        radix := radix * sizes[j];
    end loop;
    update _mondrian_dims d set place = places[d.dim], n_codes = sizes[d.dim];
    code_c := case key_type when 'bigint' then '(mod(a.key / c.place, c.n_codes) + 1)::integer'
                            else '(mod(div(a.key, c.place), c.n_codes) + 1)::integer' end;
    execute format(
        'create temp table _mondrian_rows as select i._row, i._unit::text as unit, %s as key from %s i %s',
        key_sql, input, joins_sql);
    execute format('select count(*) from %s', input) into n_rows;
    if n_rows <> (select count(*) from _mondrian_rows) then
        -- A row without a code: say which cell is to blame.
        for j in 1 .. dims loop
            q := qi->(j - 1);
            execute format('select count(*) from %s where %I is null', input, q->>'name') into n_rows;
            if n_rows > 0 then
                raise exception using errcode = '22004',
                    message = format('quasi-identifier %I has %s NULL values', q->>'name', n_rows),
                    hint = 'Mondrian needs a value in every quasi-identifier cell; filter or replace the NULLs';
            end if;
            if q->>'kind' <> 'numeric' and q->>'hierarchy' is not null then
                execute format('select v from (select distinct %1$I::text as v from %2$s) s
                                 where not exists (select from _mondrian_dom d where d.dim = %3$s and d.txt = s.v)
                                 limit 1', q->>'name', input, j)
                   into bad;
            end if;
            if bad is not null then
                raise exception using errcode = '22023',
                    message = format('value %L of column %I is not a leaf of hierarchy %L',
                                     bad, q->>'name', q->>'hierarchy');
            end if;
        end loop;
        raise exception using errcode = '22004',
            message = format('sensitive column %I has NULL values', sens->>'name'),
            hint = 'ℓ-diversity and t-closeness need a value in every sensitive cell';
    end if;
    -- Pure: no unit has two different (codes, sensitive) combinations; true
    -- at once when every row is its own unit.
    select not exists (select from _mondrian_rows group by unit having count(*) > 1) into unique_units;
    pure := unique_units or not exists (select from (select distinct unit, key from _mondrian_rows) x
                                         group by unit having count(*) > 1);

    if l is not null or t is not null then
        execute format(
            'update _mondrian_sdom sd set q = x.n::double precision / x.total
               from (select %s as s, count(distinct unit) as n, sum(count(distinct unit)) over () as total
                       from _mondrian_rows group by 1) x
              where x.s = sd.s', s_sql);
        if t is not null and t_distance = 'hierarchical' then
            select h.levels into levels from anonproxy.hierarchies h where h.name = sens->>'hierarchy';
            create temp table _mondrian_snodes as
            select sd.s, n.level, n.node, p.node as parent
              from _mondrian_sdom sd
              join anonproxy.hierarchy_nodes n on n.hierarchy = sens->>'hierarchy' and n.leaf = sd.txt
              join anonproxy.hierarchy_nodes p on p.hierarchy = n.hierarchy and p.leaf = n.leaf
                                              and p.level = n.level + 1;
            if (select count(distinct s) from _mondrian_snodes) < (select count(*) from _mondrian_sdom) then
                raise exception using errcode = '22023',
                    message = format('a value of column %I is not a leaf of hierarchy %L',
                                     sens->>'name', sens->>'hierarchy');
            end if;
        end if;
    end if;

    -- Atoms: strict over pure units merges units (weight: how many);
    -- otherwise one atom per unit. Only the relaxed variant reads an atom's
    -- number (median atoms go low in that order) and only unmerged atoms a
    -- unit; merged atoms have no text column, hence (unless the key is
    -- numeric) no TOAST table, nor do _mondrian_done and _mondrian_next,
    -- made like them: creating files is not free.
    merged := pure and variant = 'strict';
    execute format('create temp table _mondrian_atoms as
                    select %s as atom, unit, %s as s, w, 1 as part, key
                      from (select key, %s as unit, %s::integer as w from _mondrian_rows group by 1, 2) g',
                   case variant when 'relaxed' then 'row_number() over ()::integer' else '0' end,
                   s_sql,
                   case when merged then 'null::integer' else 'unit' end,
                   case when not merged then '1' when unique_units then 'count(*)' else 'count(distinct unit)' end);
    analyze _mondrian_atoms;
    -- Atoms of final partitions leave _mondrian_atoms for this table.
    create temp table _mondrian_done as select * from _mondrian_atoms limit 0;
    -- Each round moves the open atoms into this twin; then the two swap names.
    create temp table _mondrian_next as select * from _mondrian_atoms limit 0;
    -- Units per open partition, QI that may vary in it (every QI in the
    -- first partition; then those that varied in its parent) and code (and
    -- sensitive value): the histogram every step of a round reads. The
    -- first one in one pass over the atoms, a grouping set per QI (the
    -- other QIs' codes are null in its rows).
    execute format('create temp table _mondrian_hist as
                    select a.part, case %s end as dim, coalesce(%s) as code, a.s, sum(a.w)::integer as n
                      from _mondrian_atoms a group by a.part, a.s, grouping sets (%s)',
                   (select string_agg(format('when grouping(%s) = 0 then %s', code_sql[g], g), ' ' order by g)
                      from generate_series(1, dims) g),
                   array_to_string(code_sql, ', '),
                   (select string_agg(format('(%s)', code_sql[g]), ', ' order by g) from generate_series(1, dims) g));
    -- Each round's new histogram goes into this twin; then the two swap names.
    create temp table _mondrian_hist_next as select * from _mondrian_hist limit 0;
    -- The parts of this round's splits: their parent, whether each is the
    -- largest of its siblings (its histogram is counted by difference), and
    -- whether it is final already: when every unit is in one atom, a part
    -- of fewer than 2k units has no split whose sides all reach k; counted:
    -- whether its histogram is needed (it is open, or its largest sibling is
    -- and is counted by difference).
    create temp table _mondrian_kids (part integer, parent integer, largest boolean, final boolean, counted boolean);

    execute format('create temp table _mondrian_cand (
        part integer, dim integer, kind text, lo integer, hi integer, level integer,
        width double precision, rank integer,
        starts integer[], cut integer, mid_atom integer, place %s, n_codes integer)', key_type);
    create temp table _mondrian_halves (
        part integer, dim integer, side integer, s integer, n bigint, lo integer, hi integer);
    -- The split each partition takes; its parts are numbered base + side.
    execute format('create temp table _mondrian_chosen (
        part integer, dim integer, starts integer[], cut integer, mid_atom integer, base integer,
        place %s, n_codes integer)', key_type);

    codes_hist := case when l is null and t is null then '%I'   -- s is 0 there
                       else '(select part, dim, code, sum(n)::integer as n from %I group by 1, 2, 3)' end;
    -- (2) the side of atom a in the split of candidate c: the child of a tree
    -- node, or below/above an ordered cut; in a relaxed split, the atoms equal
    -- to the median go low up to atom number mid_atom and high after it.
    side_sql := format('case when %1$s = c.cut then (a.atom > c.mid_atom)::integer
                             else width_bucket(%1$s, c.starts) end', code_c);

    -- (2) counts per half: sums over the histogram when atoms merge units;
    -- otherwise over the atoms, as sums of weights when units are pure, else
    -- as distinct units.
    halves_sql := format(
        'insert into _mondrian_halves (part, dim, side, s, n, lo, hi)
         select a.part, a.dim, a.side, %1$s, %2$s, min(a.code), max(a.code)
           from (%3$s) a
          group by %4$s',
        case when l is null and t is null then 'null::integer' else 'a.s' end,
        case when merged then 'sum(a.n)' when pure then 'sum(a.w)' else 'count(distinct a.unit)' end,
        case when merged
             then 'select h.part, h.dim, h.code, h.s, h.n, width_bucket(h.code, c.starts) as side
                     from %2$I h join _mondrian_cand c on (c.part, c.dim) = (h.part, h.dim)'
             else format('select c.part, c.dim, %s as code, a.s, a.w, a.unit, %s as side
                            from %%1$I a join _mondrian_cand c on c.part = a.part', code_c, side_sql) end,
        case when l is null and t is null then 'a.part, a.dim, a.side'
             else 'grouping sets ((a.part, a.dim, a.side), (a.part, a.dim, a.side, a.s))' end);

    -- (3) the (part, dim) pairs whose split leaves a half violating a model.
    -- A split must have two non-empty sides (by construction it has; this
    -- guards the loop against ever re-splitting a partition into itself).
    failing_sql := format(
        'select part, dim from _mondrian_halves where s is null and n < %s
         union select part, dim from _mondrian_halves where s is null group by part, dim having count(*) < 2', k);
    if l is not null and l_kind = 'distinct' then
        failing_sql := failing_sql || format(
            ' union select part, dim from _mondrian_halves where s is not null
               group by part, dim, side having count(*) < %L::numeric', l);
    elsif l is not null and l_kind = 'entropy' then
        failing_sql := failing_sql || format(
            ' union select part, dim from (select part, dim, side,
                                                  n::double precision / sum(n) over (partition by part, dim, side) as p
                                             from _mondrian_halves where s is not null) h
               group by part, dim, side having -sum(p * ln(p)) < ln(%L::numeric) - 1e-9', l);
    elsif l is not null then
        failing_sql := failing_sql || format(
            ' union select part, dim from (select part, dim, side, n,
                                                  row_number() over (partition by part, dim, side order by n desc) as r
                                             from _mondrian_halves where s is not null) h
               group by part, dim, side
              having max(n) filter (where r = 1) >= %L::numeric * coalesce(sum(n) filter (where r >= %L::numeric), 0)', c, l);
    end if;
    if t is not null then
        failing_sql := failing_sql || ' union select part, dim from ('
            || case t_distance
            when 'equal' then
                'select h.part, h.dim, h.side,
                        0.5 * (sum(abs(h.n::double precision / h.total - sd.q) - sd.q) + 1) as emd
                   from (select *, sum(n) over (partition by part, dim, side) as total
                           from _mondrian_halves where s is not null) h
                   join _mondrian_sdom sd on sd.s = h.s
                  group by h.part, h.dim, h.side'
            when 'ordered' then
                'select part, dim, side, sum(abs(cum)) / greatest((select count(*) from _mondrian_sdom) - 1, 1) as emd
                   from (select g.part, g.dim, g.side,
                                sum(coalesce(h.n::double precision / g.n, 0) - sd.q)
                                    over (partition by g.part, g.dim, g.side order by sd.s) as cum
                           from (select part, dim, side, sum(n) as n from _mondrian_halves
                                  where s is not null group by part, dim, side) g
                          cross join _mondrian_sdom sd
                           left join _mondrian_halves h on (h.part, h.dim, h.side, h.s) = (g.part, g.dim, g.side, sd.s)) x
                  group by part, dim, side'
            else format(
                'select part, dim, side, sum(least(coalesce(pos, 0), coalesce(neg, 0)) * (level + 1)) / %s as emd
                   from (select part, dim, side, parent, level,
                                sum(extra) filter (where extra > 0) as pos, -sum(extra) filter (where extra < 0) as neg
                           from (select e.part, e.dim, e.side, sn.level, sn.node, sn.parent, sum(e.extra) as extra
                                   from (select g.part, g.dim, g.side, sd.s,
                                                coalesce(h.n::double precision / g.n, 0) - sd.q as extra
                                           from (select part, dim, side, sum(n) as n from _mondrian_halves
                                                  where s is not null group by part, dim, side) g
                                          cross join _mondrian_sdom sd
                                           left join _mondrian_halves h
                                                  on (h.part, h.dim, h.side, h.s) = (g.part, g.dim, g.side, sd.s)) e
                                   join _mondrian_snodes sn on sn.s = e.s
                                  group by e.part, e.dim, e.side, sn.level, sn.node, sn.parent) children
                          group by part, dim, side, parent, level) nodes
                  group by part, dim, side', levels)
            end
            || format(') d where emd > %L::numeric + 1e-9', t);
    end if;

    estimate := greatest(1, ceil(ln(greatest(n_rows, 1)::numeric / k) / ln(2)))::integer;
    while open_parts > 0 loop
        rounds := rounds + 1;
        raise notice 'anonproxy progress % of %: %', rounds - 1, greatest(estimate, rounds),
            format('mondrian round %s, %s open partitions', rounds, open_parts);

        -- (truncate: these tables were made in this transaction, so it empties
        -- their files in place and leaves no dead rows to scan; the pairs'
        -- tables to be written hold what the round before last wrote)
        execute format('truncate _mondrian_cand, _mondrian_halves, _mondrian_chosen, _mondrian_kids, %I, %I',
                       atoms_next, hist_next);
        -- (1) the candidates: every QI with two codes or more in a partition,
        -- its normalized width, its rank (widest first) and where it would
        -- be cut. A tree QI splits into the children of the lowest common
        -- ancestor of its codes. An ordered QI: a strict cut goes after the
        -- median or after the value below it, whichever balances the halves
        -- better (both are non-empty); a relaxed cut is at the median and
        -- sends median atoms low until the low half holds half of the
        -- partition (mid_atom: how many of them).
        execute format(
        'insert into _mondrian_cand (part, dim, kind, lo, hi, level, width, rank, starts, cut, mid_atom, place, n_codes)
        select part, dim, kind, lo, hi, level, width, row_number() over (partition by part order by width desc, dim),
               case when kind = ''tree'' then starts
                    when %1$L = ''relaxed'' then array[median]
                    when below is null then array[median + 1]
                    when at_median = total then array[below + 1]
                    when least(at_median, total - at_median) >= least(cum_below, total - cum_below)
                    then array[median + 1]
                    else array[below + 1] end,
               case when kind <> ''tree'' and %1$L = ''relaxed'' then median end,
               case when kind <> ''tree'' then floor(total / 2) - coalesce(cum_below, 0) end, place, n_codes
          from (select distinct on (m.part, m.dim) m.*, d.kind, x.level, x.starts, d.place, d.n_codes,
                       case d.kind when ''numeric'' then (d.nums[m.hi] - d.nums[m.lo]) / d.span
                                   when ''set'' then (m.hi - m.lo) / d.span
                                   else (x.hi - x.lo) / d.span end as width
                  from (select part, dim, min(code) as lo, max(code) as hi, min(total) as total,
                               min(code) filter (where 2 * cum >= total) as median,
                               min(cum) filter (where 2 * cum >= total) as at_median,
                               max(code) filter (where 2 * cum < total) as below,
                               max(cum) filter (where 2 * cum < total) as cum_below
                          from (select part, dim, code, sum(n) over (partition by part, dim order by code) as cum,
                                       sum(n) over (partition by part, dim) as total
                                  from %2$s h) h
                         group by part, dim
                        having min(code) < max(code)) m
                  join _mondrian_dims d on d.dim = m.dim
                  left join _mondrian_anc x on d.kind = ''tree'' and x.dim = m.dim and x.code = m.lo and x.hi >= m.hi
                 order by m.part, m.dim, x.level) w',
            variant, format(codes_hist, hist));
        if variant = 'relaxed' then
            -- mid_atom held how many median atoms go low; now the last of them.
            execute format(
            'update _mondrian_cand c set mid_atom = coalesce(x.atom, case when c.mid_atom > 0 then 2147483647 else 0 end)
               from (select c.part, c.dim, max(a.atom) filter (where a.rank <= c.mid_atom) as atom
                       from _mondrian_cand c
                       left join (select a.atom, a.part, c.dim,
                                         row_number() over (partition by a.part, c.dim order by a.atom) as rank
                                    from %2$I a join _mondrian_cand c on c.part = a.part
                                   where %1$s = c.cut) a on (a.part, a.dim) = (c.part, c.dim)
                      where c.cut is not null group by c.part, c.dim) x
              where (x.part, x.dim) = (c.part, c.dim)', code_c, atoms);
        end if;

        -- (2) units per half, and per sensitive value when ℓ or t is asked.
        execute format(halves_sql, atoms, hist);

        -- (3) each partition takes its allowable split of best gain: the
        -- information loss it removes on the split QI, Σ over the parts of
        -- units × (width of the partition − width of the part), divided by
        -- the units of the smallest part. Plain widest-first never splits a
        -- skewed categorical QI (race, native_country) while its small
        -- values still reach k; measured on adult k = 10 (NCP, LM metric):
        -- widest-first 21.4 %, gain alone 11.7 %, gain per smallest part 9.5 %.
        -- Its parts get the ids base + side (side 0 or 1 below/above an
        -- ordered cut, 1… for the children of a tree node).
        execute format(
            'insert into _mondrian_chosen (part, dim, starts, cut, mid_atom, base, place, n_codes)
             select part, dim, starts, cut, mid_atom,
                    %s + sum(cardinality(starts) + 1) over (order by part) - cardinality(starts), place, n_codes
               from (select distinct on (c.part) c.part, c.dim, c.starts, c.cut, c.mid_atom, c.place, c.n_codes
                       from _mondrian_cand c
                       left join (select h.part, h.dim, sum(h.n * (c.width - h.width)) / min(h.n) as gain
                                    from (select distinct on (h.part, h.dim, h.side) h.part, h.dim, h.n,
                                                 case d.kind when ''numeric'' then (d.nums[h.hi] - d.nums[h.lo]) / d.span
                                                             when ''set'' then (h.hi - h.lo) / d.span
                                                             else (x.hi - x.lo) / d.span end as width
                                            from _mondrian_halves h
                                            join _mondrian_dims d on d.dim = h.dim
                                            left join _mondrian_anc x on d.kind = ''tree'' and x.dim = h.dim
                                                                     and x.code = h.lo and x.hi >= h.hi
                                           where h.s is null
                                           order by h.part, h.dim, h.side, x.level) h
                                    join _mondrian_cand c on (c.part, c.dim) = (h.part, h.dim)
                                   group by h.part, h.dim) g on (g.part, g.dim) = (c.part, c.dim)
                      where (c.part, c.dim) not in (%s)
                      order by c.part, g.gain desc, c.rank) x', next_part, failing_sql);
        select coalesce(max(base + cardinality(starts)), next_part) into next_part from _mondrian_chosen;

        -- (4) the atoms of split partitions move to their parts; the others are final.
        execute format(
            'insert into _mondrian_done
             select a.* from %I a where not exists (select from _mondrian_chosen ch where ch.part = a.part)', atoms);
        -- Into the other table, not an UPDATE: nothing vacuums a temp table
        -- inside one call, and dead versions would slow every scan.
        execute format(
            'insert into %2$I
             select a.atom, a.unit, a.s, a.w, c.base + %1$s as part, a.key
               from %3$I a join _mondrian_chosen c on c.part = a.part', side_sql, atoms_next, atoms);
        insert into _mondrian_kids (part, parent, largest, final, counted)
        select part, parent, largest, final, not final or bool_or(largest and not final) over (partition by parent)
          from (select ch.base + h.side as part, ch.part as parent,
                       row_number() over (partition by ch.part order by h.n desc, h.side) = 1 as largest,
                       pure and h.n < 2 * k as final
                  from _mondrian_chosen ch
                  join _mondrian_halves h on (h.part, h.dim) = (ch.part, ch.dim) and h.s is null) x;
        select count(*) filter (where not final) into open_parts from _mondrian_kids;
        analyze _mondrian_kids;  -- the plans below size their hash tables from it

        -- (5) the histogram of the new parts, over the QIs their parent varied
        -- in, without reading every atom: on the QI of a strict split, the
        -- parent's counts on each side of the cut; on the others, the atoms
        -- of every part but the largest, and for the largest the parent's
        -- counts minus its siblings'.
        execute format(
            'insert into %2$I
             select ch.base + width_bucket(h.code, ch.starts) as part, h.dim, h.code, h.s, h.n
               from %3$I h join _mondrian_chosen ch on (ch.part, ch.dim) = (h.part, h.dim)
              where ch.cut is null
             union all
             select a.part, c.dim, %1$s, a.s, sum(a.w)::integer
               from %4$I a
               join _mondrian_kids k on k.part = a.part and not k.largest and k.counted
               join _mondrian_chosen ch on ch.part = k.parent
               join _mondrian_cand c on c.part = k.parent and (c.dim <> ch.dim or ch.cut is not null)
              group by 1, 2, 3, 4', code_c, hist_next, hist, atoms_next);
        execute format(
            'insert into %1$I
             select k.part, h.dim, h.code, h.s, h.n - coalesce(o.n, 0)
               from %2$I h
               join _mondrian_kids k on k.parent = h.part and k.largest and not k.final
               join _mondrian_chosen ch on ch.part = h.part
               join _mondrian_cand c on (c.part, c.dim) = (h.part, h.dim) and (c.dim <> ch.dim or ch.cut is not null)
               left join (select k.parent, n.dim, n.code, n.s, sum(n.n) as n
                            from %1$I n join _mondrian_kids k on k.part = n.part and not k.largest
                           group by 1, 2, 3, 4) o on (o.parent, o.dim, o.code, o.s) = (h.part, h.dim, h.code, h.s)
              where h.n > coalesce(o.n, 0)', hist_next, hist);
        -- Final parts need no histogram: without one they are no candidate,
        -- and their atoms go with the next round's final atoms.
        execute format('delete from %I n using _mondrian_kids k where k.part = n.part and k.final', hist_next);
        -- The tables just written are the next round's to read (renaming
        -- them instead cost every round six catalog updates and fresh plans).
        select atoms_next, atoms, hist_next, hist into atoms, atoms_next, hist, hist_next;
    end loop;
    execute format('insert into _mondrian_done select * from %I', atoms);   -- parts final at birth in the last round
    raise notice 'anonproxy progress % of %: %', rounds, rounds, 'mondrian partitions final';

    -- Summaries: one text cell per partition and QI, in columns cell1, …
    -- The final partitions' bounds give every cell but a value set, which
    -- lists the values its atoms hold. A cell is made once per distinct QI
    -- and pair of bounds (fewer than a tenth of the (partition, QI) pairs on
    -- adult), then each partition looks its cells up by its bounds. A tree
    -- cell is the lowest common ancestor: the lowest node over both bounds.
    execute format(
    'create temp table _mondrian_summary as
     with p as materialized (
         select a.part, array[%s] as lo, array[%s] as hi from _mondrian_done a group by a.part),
     r as (select distinct u.dim::integer as dim, u.lo, u.hi from p, unnest(p.lo, p.hi) with ordinality as u(lo, hi, dim)),
     cells as materialized (
         select r.dim, r.lo, r.hi,
                case d.kind when ''numeric'' then case when r.lo = r.hi then d.vals[r.lo]
                                                       else d.vals[r.lo] || ''-'' || d.vals[r.hi] end
                            when ''set'' then case when r.lo = r.hi then d.vals[r.lo] end   -- else the value set
                            else lca.node end as cell
           from r
           join _mondrian_dims d on d.dim = r.dim
           left join (select distinct on (r.dim, r.lo, r.hi) r.dim, r.lo, r.hi, x.node
                        from r join _mondrian_anc x on x.dim = r.dim and x.code = r.lo and x.hi >= r.hi
                       order by r.dim, r.lo, r.hi, x.level) lca on (lca.dim, lca.lo, lca.hi) = (r.dim, r.lo, r.hi)),
     sv as materialized (
         select a.part, d.dim, array_agg(distinct v.txt)::text as vals
           from _mondrian_done a
           join _mondrian_dims d on d.kind = ''set''
           join _mondrian_dom v on (v.dim, v.code) = (d.dim, (div(a.key, d.place) %% d.n_codes + 1)::integer)
          group by a.part, d.dim)
     select p.part, %s
       from p %s',
        (select string_agg(format('min(%s)', code_sql[g]), ', ' order by g) from generate_series(1, dims) g),
        (select string_agg(format('max(%s)', code_sql[g]), ', ' order by g) from generate_series(1, dims) g),
        (select string_agg(format(case kind when 'set' then 'coalesce(c%1$s.cell, s%1$s.vals) as cell%1$s'
                                            else 'c%1$s.cell as cell%1$s' end, dim), ', ' order by dim)
           from _mondrian_dims),
        (select string_agg(format(' join cells c%1$s on (c%1$s.dim, c%1$s.lo, c%1$s.hi) = (%1$s, p.lo[%1$s], p.hi[%1$s])', dim)
                           || case kind when 'set' then format(' left join sv s%1$s on (s%1$s.part, s%1$s.dim) = (p.part, %1$s)', dim)
                                        else '' end, '' order by dim)
           from _mondrian_dims));

    execute format('create temp table %I (_row bigint, %s)', output,
                   (select string_agg(format('%I text', name), ', ' order by dim) from _mondrian_dims));
    execute format(
        'insert into %I select r._row, %s from _mondrian_rows r join _mondrian_done a on %s
           join _mondrian_summary s on s.part = a.part',
        output, (select string_agg(format('s.cell%s', g), ', ' order by g) from generate_series(1, dims) g),
        case when merged then 'a.key = r.key' else '(a.unit, a.key) = (r.unit, r.key)' end);

    select count(*) into open_parts from _mondrian_summary;
    select count(*) into n_atoms from _mondrian_done;
    drop table _mondrian_dims, _mondrian_dom, _mondrian_anc, _mondrian_rows, _mondrian_atoms,
        _mondrian_next, _mondrian_done, _mondrian_kids, _mondrian_cand, _mondrian_hist,
        _mondrian_hist_next, _mondrian_halves, _mondrian_chosen, _mondrian_summary;
    perform anonproxy.drop_scratch_tables(array['_mondrian_sdom', '_mondrian_snodes']);
    return jsonb_build_object(
        'rounds', rounds, 'partitions', open_parts, 'atoms', n_atoms, 'variant', variant,
        'elapsed', round(extract(epoch from clock_timestamp() - started)::numeric, 3),
        'suppressed', 0);
end
$fn$;
