-- Migration 0025: one currency -- the zCDP conversion OpenDP uses, and what each answer moved "epsilon spent" by.
--
-- 1. The conversion from rho-zCDP to (epsilon, delta)-DP is now Canonne, Kamath and Steinke's (2020, "The Discrete
--    Gaussian for Differential Privacy", Prop. 12 / Cor. 13), as in OpenDP: rho-zCDP implies (epsilon, delta)-DP
--    with delta = min over alpha > 1 of exp((alpha - 1)(alpha rho - epsilon)) / (alpha - 1) * (1 - 1/alpha)^alpha.
--    Solved for epsilon at each order alpha it reads
--        epsilon_alpha(rho, delta) = alpha rho + (ln(1/delta) + (alpha - 1) ln(1 - 1/alpha) - ln alpha) / (alpha - 1),
--    and every alpha gives a valid epsilon; zcdp_epsilon takes the best (the least), zcdp_rho_max the largest rho
--    with epsilon_alpha(rho, delta) <= epsilon for some alpha. It is never looser than Bun and Steinke's
--    rho + 2 sqrt(rho ln(1/delta)) of 0019 (each epsilon_alpha is below that bound's alpha rho + ln(1/delta)/(alpha-1),
--    and the result is the better of the two): the most rho a budget of epsilon 10 at delta 1e-5 allows goes from
--    1.5504 to 1.7827. So for the same charges "epsilon spent" only goes down: nothing an analyst was told is spent
--    is raised. Stored budgets keep their stored accounting.
--
-- 2. Each charge records what it moved its role's budget's "epsilon spent" by, in the budget's own accounting
--    (budget_ledger.epsilon_spent_after and epsilon_spent_delta; anonproxy.charge returns the delta too), and the
--    audit trail records them for the answer beside the answer's own (epsilon, delta) and (rho, delta_add):
--    audit_trail.budget_domain, accounting, epsilon_spent_delta, epsilon_spent_after. Rows written before this
--    migration have them null. audit_write takes the new keys, and records without them as before.
--
-- 3. default_accounting still counts zCDP's answers with Bun and Steinke's rho_max (bun_steinke_rho_max), so that
--    neither this migration nor a policy applied after it switches a budget's accounting; my_budget shows rho_spent
--    rounded up at 12 decimals, as its other figures.

-- The conversion ------------------------------------------------------------------------------

-- epsilon_alpha(rho, delta) with log = ln(1/delta), at order alpha > 1 (Canonne, Kamath and Steinke 2020, Prop. 12
-- solved for epsilon): alpha rho + (ln(1/delta) + (alpha - 1) ln(1 - 1/alpha) - ln alpha) / (alpha - 1). Every
-- order gives a valid epsilon; 45 decimals.
create function anonproxy.zcdp_epsilon_at(rho numeric, log numeric, alpha numeric) returns numeric
language sql immutable strict set search_path = pg_catalog, pg_temp as $$
    select pg_catalog.round(alpha * rho + (log + (alpha - 1) * pg_catalog.ln(1 - 1 / alpha) - pg_catalog.ln(alpha))
                            / (alpha - 1), 45)
$$;

-- The budget epsilon at which alpha is the best order for rho_max: epsilon_alpha(0, delta)
-- + alpha (ln(1/delta) - ln alpha) / (alpha - 1)^2 (where the derivative in alpha of
-- (epsilon - epsilon_alpha(0, delta)) / alpha vanishes). It falls as alpha grows.
create function anonproxy.zcdp_stationary(log numeric, alpha numeric) returns numeric
language sql immutable strict set search_path = pg_catalog, pg_temp as $$
    select anonproxy.zcdp_epsilon_at(0, log, alpha)
           + pg_catalog.round(alpha * (log - pg_catalog.ln(alpha)) / ((alpha - 1) * (alpha - 1)), 45)
$$;

-- Bun and Steinke's zcdp_rho_max of 0019 under its own name (its body unchanged): the largest rho with
-- rho + 2 sqrt(rho ln(1/delta)) <= epsilon, (epsilon / (sqrt(epsilon + L) + sqrt(L)))^2 with L = ln(1/delta),
-- rounded down; 0 at delta = 0. zcdp_rho_max is never below it, and the default accounting rule still uses it.
create function anonproxy.bun_steinke_rho_max(epsilon numeric, delta numeric) returns numeric
language plpgsql immutable strict set search_path = pg_catalog, pg_temp as $$
declare
    wide constant numeric := 1.000000000000000000000000000000000000000000000;
    l numeric;
    root numeric;
begin
    if delta = 0 or epsilon = 0 then
        return 0;
    end if;
    l := -pg_catalog.ln(delta * wide);
    root := epsilon * wide / (pg_catalog.sqrt(epsilon * wide + l) + pg_catalog.sqrt(l));
    return greatest(pg_catalog.trunc(root * root, 30) - 1e-30, 0);
end
$$;

-- The default accounting of 0019, deciding as it did: with Bun and Steinke's rho_max, so that this migration (and
-- re-applying a policy after it) never switches a budget's accounting -- a switch to zcdp can raise the epsilon
-- spent shown for the answers already charged. Where it says zcdp, zcdp affords even more answers now.
create or replace function anonproxy.default_accounting(epsilon numeric, delta numeric,
                                                        epsilon_per_query numeric default null)
returns text
language plpgsql immutable set search_path = pg_catalog, pg_temp as $$
declare
    q numeric := coalesce(epsilon_per_query, 0.5);
begin
    if epsilon is null or delta is null or not (epsilon > 0 and epsilon < 'Infinity') or not (delta > 0 and delta < 1)
       or not (q > 0 and q < 'Infinity') then
        return 'basic';
    end if;
    return case when anonproxy.bun_steinke_rho_max(epsilon, delta) / (q * q / 4) > epsilon / q
                then 'zcdp' else 'basic' end;
end
$$;

-- The epsilon of the (epsilon, delta)-DP guarantee that rho-zCDP implies: the least epsilon_alpha over alpha > 1,
-- where its derivative's sign, rho (alpha - 1)^2 - ln(1/delta) + ln alpha, turns (Newton's steps, or bisection when
-- a step would leave the bracket, at most 40, as anonproxy.dp.zcdp takes them); and
-- never more than Bun and Steinke's rho + 2 sqrt(rho ln(1/delta)), nor less than 0. Rounded up at 30 decimals, and
-- one unit more; infinite at delta = 0 unless rho = 0.
create or replace function anonproxy.zcdp_epsilon(rho numeric, delta numeric) returns numeric
language plpgsql immutable strict set search_path = pg_catalog, pg_temp as $$
declare
    wide constant numeric := 1.000000000000000000000000000000000000000000000;  -- 45 decimals, kept by ln and sqrt
    r numeric := rho * wide;
    l numeric;
    low numeric := 1;
    high numeric;
    alpha numeric;
    phi numeric;
    following numeric;
    tight numeric;
    loose numeric;
begin
    if not (rho >= 0 and rho < 'Infinity') then
        raise exception using errcode = '22023', message = format('rho must be a finite number >= 0, got %s', rho);
    end if;
    if not (delta >= 0 and delta < 1) then
        raise exception using errcode = '22023', message = format('delta must be in [0, 1), got %s', delta);
    end if;
    if rho = 0 then
        return 0;
    end if;
    if delta = 0 then
        return 'Infinity';
    end if;
    l := -pg_catalog.ln(delta * wide);
    high := 1 + pg_catalog.sqrt(pg_catalog.round(l / r, 45));  -- the derivative is positive there
    alpha := high;
    for step in 1 .. 40 loop  -- Newton's steps on the derivative's sign, phi, kept within [low, high]
        phi := r * (alpha - 1) * (alpha - 1) - l + pg_catalog.ln(alpha);
        if phi < 0 then
            low := alpha;
        else
            high := alpha;
        end if;
        following := pg_catalog.round(alpha - phi / (2 * r * (alpha - 1) + 1 / alpha), 45);
        if abs(following - alpha) < 1e-40 then
            alpha := following;
            exit;
        end if;
        alpha := case when low < following and following < high then following
                      else pg_catalog.round((low + high) / 2, 45) end;
    end loop;
    tight := anonproxy.round_up(anonproxy.zcdp_epsilon_at(r, l, alpha), 30) + 1e-30;
    loose := anonproxy.round_up(r + 2 * pg_catalog.sqrt(r * l), 30) + 1e-30;
    return pg_catalog.trim_scale(greatest(least(tight, loose), 0));  -- a tiny rho at a large delta: below 0
end
$$;
comment on function anonproxy.zcdp_epsilon(numeric, numeric) is
    'The epsilon of the (epsilon, delta)-DP guarantee that rho-zCDP implies (Canonne, Kamath and Steinke 2020, '
    'Prop. 12; never looser than Bun and Steinke 2016, Prop. 1.3), rounded up.';

-- The largest total rho whose conversion at delta stays within epsilon: the greatest
-- (epsilon - epsilon_alpha(0, delta)) / alpha over alpha > 1 (any alpha gives a rho that fits), the best alpha
-- where zcdp_stationary equals epsilon, found by doubling, then Newton's steps within the bracket (at most 40);
-- and never less than Bun and Steinke's
-- (sqrt(epsilon + L) - sqrt(L))^2. Rounded down at 30 decimals, and one unit more; 0 at delta = 0.
create or replace function anonproxy.zcdp_rho_max(epsilon numeric, delta numeric) returns numeric
language plpgsql immutable strict set search_path = pg_catalog, pg_temp as $$
declare
    wide constant numeric := 1.000000000000000000000000000000000000000000000;
    e numeric := epsilon * wide;
    l numeric;
    low numeric;
    high numeric := 2;
    alpha numeric;
    la numeric;
    value numeric;
    rate numeric;
    following numeric;
    tight numeric;
begin
    if not (epsilon >= 0 and epsilon < 'Infinity') then
        raise exception using errcode = '22023', message = format('epsilon must be a finite number >= 0, got %s', epsilon);
    end if;
    if not (delta >= 0 and delta < 1) then
        raise exception using errcode = '22023', message = format('delta must be in [0, 1), got %s', delta);
    end if;
    if delta = 0 or epsilon = 0 then
        return 0;
    end if;
    l := -pg_catalog.ln(delta * wide);
    while anonproxy.zcdp_stationary(l, high) > e loop
        high := high * 2;
    end loop;
    low := case when high = 2 then 1 else high / 2 end;
    alpha := high;
    for step in 1 .. 40 loop  -- Newton's steps on epsilon - zcdp_stationary, kept within [low, high]
        la := pg_catalog.ln(alpha);
        value := e - (pg_catalog.round((l + (alpha - 1) * pg_catalog.ln(1 - 1 / alpha) - la) / (alpha - 1), 45)
                      + pg_catalog.round(alpha * (l - la) / ((alpha - 1) * (alpha - 1)), 45));
        if value < 0 then
            low := alpha;
        else
            high := alpha;
        end if;
        rate := pg_catalog.round(((alpha - 1) + 2 * alpha * (l - la)) / ((alpha - 1) * (alpha - 1) * (alpha - 1)), 45);
        following := case when rate > 0 then pg_catalog.round(alpha - value / rate, 45) else high end;
        if abs(following - alpha) < 1e-40 then
            alpha := following;
            exit;
        end if;
        alpha := case when low < following and following < high then following
                      else pg_catalog.round((low + high) / 2, 45) end;
    end loop;
    tight := pg_catalog.trunc((e - anonproxy.zcdp_epsilon_at(0, l, alpha)) / alpha, 30) - 1e-30;
    return pg_catalog.trim_scale(greatest(tight, anonproxy.bun_steinke_rho_max(epsilon, delta)));
end
$$;
comment on function anonproxy.zcdp_rho_max(numeric, numeric) is
    'The largest rho whose zCDP-to-DP conversion (Canonne, Kamath and Steinke 2020) at delta is at most epsilon, '
    'rounded down.';


-- The ledger: what each charge moved "epsilon spent" by ------------------------------------------------------------

alter table anonproxy.budget_ledger
    add column epsilon_spent_after numeric,  -- the role's budget's epsilon spent right after this charge
    add column epsilon_spent_delta numeric;  -- what this charge moved it by (after - before), under its accounting
comment on column anonproxy.budget_ledger.epsilon is
    'The answer''s own epsilon (its guarantee on its own, for basic composition): what a basic budget adds up.';
comment on column anonproxy.budget_ledger.rho is
    'The answer''s rho (it is delta_add-approximately rho-zCDP): what a zcdp budget adds up.';
comment on column anonproxy.budget_ledger.epsilon_spent_after is
    'The role''s budget''s epsilon spent right after this charge, in its accounting (null: charged before 0025).';
comment on column anonproxy.budget_ledger.epsilon_spent_delta is
    'What this charge moved the role''s budget''s epsilon spent by (after - before; null: charged before 0025).';

alter type anonproxy.budget_remaining
    add attribute epsilon_spent_delta numeric;  -- of a charge: what it moved epsilon_spent by; null otherwise

-- Charge an answer (as in 0019), and record in the ledger, and return, what it moved the role's budget's "epsilon
-- spent" by: the budget's own figure after the charge minus before it (under zcdp the change of the conversion of
-- the sum of rho, not the answer's own epsilon).
create or replace function anonproxy.charge(role_name name, domain text, epsilon numeric, delta numeric, rho numeric,
                                 delta_add numeric, fingerprint text)
returns anonproxy.budget_remaining
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    budget anonproxy.budgets;
    cap anonproxy.shared_budgets;
    as_of timestamptz;
    role_spent anonproxy.budget_spending;
    cap_spent anonproxy.budget_spending;
    before anonproxy.budget_remaining;
    refusing_accounting text;
    by_role boolean;
    limit_detail text;
    remaining_text text;
    needed_text text;
    spent_before numeric;  -- the role's budget's epsilon spent before this charge
    result anonproxy.budget_remaining;
begin
    perform anonproxy.check_ledger_caller('charge a privacy budget');
    if role_name is null or domain is null or epsilon is null or delta is null or rho is null or delta_add is null
       or fingerprint is null then
        raise exception using errcode = '22004', message = 'role_name, domain, epsilon, delta, rho, delta_add and '
            'fingerprint of a charge must not be null';
    end if;
    if not (epsilon >= 0 and epsilon < 'Infinity') then
        raise exception using errcode = '22023',
            message = format('epsilon of a charge must be a finite number >= 0, got %s', epsilon);
    end if;
    if not (delta >= 0 and delta < 1) then
        raise exception using errcode = '22023', message = format('delta of a charge must be in [0, 1), got %s', delta);
    end if;
    if not (rho >= 0 and rho < 'Infinity') then
        raise exception using errcode = '22023',
            message = format('rho of a charge must be a finite number >= 0, got %s', rho);
    end if;
    if not (delta_add >= 0 and delta_add <= delta) then
        raise exception using errcode = '22023',
            message = format('delta_add of a charge must be in [0, delta], got %s with delta %s', delta_add, delta),
            hint = 'delta_add is the part of delta that partition selection adds: it is never more than delta';
    end if;
    -- Every noisy statistic costs in both currencies: one without the other would be free for one accountant.
    if (epsilon = 0) <> (rho = 0) then
        raise exception using errcode = '22023',
            message = format('a charge must cost rho exactly when it costs epsilon, got epsilon %s and rho %s',
                             epsilon, rho);
    end if;
    if epsilon = 0 and delta = 0 then
        raise exception using errcode = '22023', message = 'a charge of epsilon 0 and delta 0 charges nothing',
            hint = 'answers that cost nothing need no charge';
    end if;
    if fingerprint = '' or pg_catalog.octet_length(fingerprint) > 512 then
        raise exception using errcode = '22023',
            message = format('fingerprint of a charge must have 1 to 512 bytes, got %s',
                             pg_catalog.octet_length(fingerprint)),
            hint = 'pass a hash of the canonical query';
    end if;
    -- Under REPEATABLE READ or SERIALIZABLE every statement would read the
    -- snapshot taken before the locks were granted, and miss concurrent charges.
    if pg_catalog.current_setting('transaction_isolation') <> 'read committed' then
        raise exception using errcode = '25000',
            message = format('anonproxy.charge() must run in a READ COMMITTED transaction, not %s',
                             upper(pg_catalog.current_setting('transaction_isolation'))),
            hint = 'charge in a transaction of its own: begin isolation level read committed';
    end if;

    select b.* into budget from anonproxy.budgets b
     where b.role_name = charge.role_name and b.domain = charge.domain
       for update;
    if not found then
        perform anonproxy.no_budget(role_name, domain);
    end if;
    select s.* into cap from anonproxy.shared_budgets s where s.domain = charge.domain for update;

    -- The clock after the locks: a charge that waited is dated when it counts.
    as_of := pg_catalog.clock_timestamp();
    role_spent := anonproxy.role_spending(budget, as_of);
    if cap.domain is not null then
        cap_spent := anonproxy.domain_spending(cap, as_of);
    end if;
    by_role := not (anonproxy.budget_balance(budget.accounting, budget.epsilon, budget.delta,
                                             anonproxy.plus(role_spent, epsilon, delta, rho, delta_add))).fits;
    if by_role or (cap.domain is not null
                   and not (anonproxy.budget_balance(cap.accounting, cap.epsilon, cap.delta,
                                                     anonproxy.plus(cap_spent, epsilon, delta, rho, delta_add))).fits)
    then
        before := anonproxy.budget_state(budget, cap, role_spent, cap_spent);
        refusing_accounting := case when by_role then budget.accounting else cap.accounting end;
        if refusing_accounting = 'basic' then
            remaining_text := format('remaining epsilon %s, delta %s',
                pg_catalog.trim_scale(case when by_role then before.role_epsilon else before.shared_epsilon end),
                pg_catalog.trim_scale(case when by_role then before.role_delta else before.shared_delta end));
            needed_text := format('this query needs epsilon %s, delta %s (basic accounting)',
                                  pg_catalog.trim_scale(epsilon), pg_catalog.trim_scale(delta));
        else
            remaining_text := format('remaining rho %s (epsilon %s), delta %s',
                pg_catalog.trim_scale(case when by_role then before.rho_left else before.shared_rho_left end),
                pg_catalog.trim_scale(case when by_role then before.role_epsilon else before.shared_epsilon end),
                pg_catalog.trim_scale(case when by_role then before.role_delta else before.shared_delta end));
            needed_text := format('this query needs rho %s, delta %s (zCDP accounting)',
                                  pg_catalog.trim_scale(rho), pg_catalog.trim_scale(delta_add));
        end if;
        if by_role then
            limit_detail := format('the budget of role "%s" on %s is epsilon %s, delta %s %s',
                role_name, domain, pg_catalog.trim_scale(budget.epsilon), pg_catalog.trim_scale(budget.delta),
                coalesce('per ' || budget.refresh_period::text, 'in total'));
        else
            limit_detail := format('the shared budget of all roles on %s is epsilon %s, delta %s %s, '
                                   'and epsilon %s, delta %s of it is left',
                domain, pg_catalog.trim_scale(cap.epsilon), pg_catalog.trim_scale(cap.delta),
                coalesce('per ' || cap.refresh_period::text, 'in total'),
                pg_catalog.trim_scale(before.shared_epsilon), pg_catalog.trim_scale(before.shared_delta));
        end if;
        if refusing_accounting = 'zcdp' then
            limit_detail := limit_detail || format('; under zCDP accounting the rho of its answers adds up, and '
                'the total converts to (epsilon, delta) by Canonne, Kamath and Steinke''s bound (the least over alpha > 1 '
                'of alpha rho + (ln(1/delta) + (alpha - 1) ln(1 - 1/alpha) - ln alpha) / (alpha - 1)), at what is '
                'left of delta after partition selection (%s)',
                pg_catalog.trim_scale(case when by_role then before.role_delta else before.shared_delta end));
        end if;
        raise exception using errcode = '53400', schema = 'anonproxy',
            table = case when by_role then 'budgets' else 'shared_budgets' end,
            message = format('privacy budget exhausted for role "%s" on %s: %s; %s',
                             role_name, domain, remaining_text, needed_text),
            detail = limit_detail,
            hint = 'repeat an earlier query (its answer is cached and free), ask with a smaller epsilon, or '
                || case when (case when by_role then budget.refresh_period else cap.refresh_period end) is null
                        then 'ask the policy owner for a larger budget'
                        else 'wait: charges older than the refresh period no longer count' end;
    end if;

    -- What the charge moves the role's "epsilon spent" by, in its accounting: under zcdp not the answer's own epsilon.
    spent_before := (anonproxy.budget_balance(budget.accounting, budget.epsilon, budget.delta, role_spent)).epsilon_spent;
    result := anonproxy.budget_state(budget, cap, anonproxy.plus(role_spent, epsilon, delta, rho, delta_add),
                                     case when cap.domain is not null
                                          then anonproxy.plus(cap_spent, epsilon, delta, rho, delta_add) end);
    result.epsilon_spent_delta := result.epsilon_spent - spent_before;
    insert into anonproxy.budget_ledger (role_name, domain, epsilon, delta, rho, delta_add, fingerprint, charged_at,
                                         epsilon_spent_after, epsilon_spent_delta)
        values (role_name, domain, epsilon, delta, rho, delta_add, fingerprint, as_of, result.epsilon_spent,
                result.epsilon_spent_delta);
    -- A charge must survive a crash of the server once its COMMIT has returned:
    -- with synchronous_commit off (or local, with synchronous standbys) it might not.
    if pg_catalog.current_setting('synchronous_commit') in ('off', 'local') then
        perform pg_catalog.set_config('synchronous_commit', 'on', true);
    end if;
    return result;
end
$$;


-- The audit trail: each answer's cost in the budget's accounting ----------------------------------------------------

alter table anonproxy.audit_trail
    add column budget_domain text,  -- dp: the protected table whose budget the answer was charged to
    add column accounting text,  -- dp: that budget's accounting when charged (basic or zcdp)
    add column epsilon_spent_delta numeric,  -- dp: what this answer moved the budget's epsilon spent by (0: free)
    add column epsilon_spent_after numeric;  -- dp: the budget's epsilon spent right after it (null: not charged)
comment on column anonproxy.audit_trail.epsilon is
    'dp: the answer''s own epsilon (its guarantee on its own; what a basic budget adds up); 0: not charged.';
comment on column anonproxy.audit_trail.delta is 'dp: the answer''s own delta; 0: not charged.';
comment on column anonproxy.audit_trail.rho is
    'dp: the answer''s rho (what a zcdp budget adds up); 0: not charged.';
comment on column anonproxy.audit_trail.delta_add is
    'dp: the delta a zcdp budget adds up for the answer (partition selection); 0: not charged.';
comment on column anonproxy.audit_trail.epsilon_spent_delta is
    'dp: what the answer moved its budget''s epsilon spent by, in the budget''s accounting (the ledger''s figure '
    'after the charge minus before it); these add up to the ledger''s epsilon spent. 0: not charged.';
comment on column anonproxy.audit_trail.epsilon_spent_after is
    'dp: the budget''s epsilon spent right after the charge, as the ledger computed it; null: not charged.';

create or replace function anonproxy.audit_write(records jsonb) returns bigint
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    written bigint;
begin
    perform anonproxy.check_ledger_caller('write the audit trail');
    insert into anonproxy.audit_trail (at, login, database, client_addr, client_port, session_id, mode, statement,
                                       decision, sqlstate, message, relations, epsilon, delta, rho, delta_add,
                                       rows_sent, parameters, statement_sha256, budget_domain, accounting,
                                       epsilon_spent_delta, epsilon_spent_after)
    select pg_catalog.to_timestamp(r.at), r.login, r.database, r.client_addr, r.client_port, r.session_id, r.mode,
           r.statement, r.decision, r.sqlstate, r.message, coalesce(r.relations, '{}'), r.epsilon, r.delta, r.rho,
           r.delta_add, r.rows_sent, r.parameters, r.statement_sha256, r.budget_domain, r.accounting,
           r.epsilon_spent_delta, r.epsilon_spent_after
      from pg_catalog.jsonb_to_recordset(records) as r(at double precision, login name, database name,
                                                        client_addr inet, client_port integer, session_id text,
                                                        mode text, statement text, decision text, sqlstate text,
                                                        message text, relations text[], epsilon numeric,
                                                        delta numeric, rho numeric, delta_add numeric,
                                                        rows_sent bigint, parameters text[],
                                                        statement_sha256 text, budget_domain text, accounting text,
                                                        epsilon_spent_delta numeric, epsilon_spent_after numeric);
    get diagnostics written = row_count;
    return written;
end
$$;

-- The new helpers are arithmetic, as zcdp_epsilon: anyone may call them.
grant execute on function anonproxy.zcdp_epsilon_at(numeric, numeric, numeric),
    anonproxy.zcdp_stationary(numeric, numeric), anonproxy.bun_steinke_rho_max(numeric, numeric) to public;


-- The budget left of whoever asks (0019), with rho_spent rounded up at 12 decimals as the other figures are (the
-- exact sum of the charges' rho stays in the ledger).
create or replace view anonproxy.my_budget as
select r.domain,
       r.accounting,
       r.epsilon_budget,
       r.epsilon_spent,
       r.epsilon as epsilon_left,           -- the lesser of the role's and the shared cap's
       r.delta_budget,
       r.delta as delta_left,
       pg_catalog.trim_scale(anonproxy.round_up(r.rho_spent, 12)) as rho_spent,
       least(r.rho_left, r.shared_rho_left) as rho_left,  -- null when neither budget is zcdp
       r.refresh_period
  from anonproxy.remaining_budgets(session_user) r;
