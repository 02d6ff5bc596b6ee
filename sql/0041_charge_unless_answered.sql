-- Migration 0041: a new dp question without its own lookup round trip (issue 23: first charge <= 2 ms added).
--
-- The proxy looked a question up (lookup_answer: the per-query cost, the answer cached) in one round trip, then sent
-- the check, the charge and the read in a second. For a question it has not seen answered, it now sends the check,
-- charge_unless_answered and the read in one: the function makes the lookup itself, in the charge's transaction,
-- and charges only when the ledger holds no answer for the question and reads the per-query cost the proxy priced
-- it at. Otherwise it charges nothing and returns what the lookup read, and the read that follows in the same round
-- trip stops at its first statement (require_charged): nothing is read uncharged. The proxy then finishes the
-- cached answer, or prices the question again at the cost read, as after a lookup.
--
-- The question's time limit is checked after the lookup and before the charge, as the proxy checked it after its
-- lookup round trip: time_left_ms (0: no limit) is what was left of it when the round trip was sent; past it when
-- the lookup is done, the function fails with 57014 and charges nothing.
--
-- Two sessions asking the same new question at once are charged as before: each charge checks for an answer
-- stored, not for one being computed, so both are charged and store_answer keeps the first measurement, which
-- both release. A question whose answer was stored before its charge runs is never charged.

create function anonproxy.charge_unless_answered(
    role_name name, domain text, tables text[], answer_key text,
    priced_epsilon_per_query numeric, priced_delta_per_query numeric, priced_accounting text,
    epsilon numeric, delta numeric, rho numeric, delta_add numeric, fingerprint text, time_left_ms integer,
    out charged boolean, out epsilon_per_query numeric, out delta_per_query numeric, out per_query_accounting text,
    out data_version text, out answer bytea, out remaining anonproxy.budget_remaining)
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    looked record;
begin
    perform anonproxy.check_ledger_caller(format('charge role "%s"', role_name));
    select l.* into looked from anonproxy.lookup_answer(role_name, domain, tables, answer_key) l;
    epsilon_per_query := looked.epsilon_per_query;
    delta_per_query := looked.delta_per_query;
    per_query_accounting := looked.accounting;
    data_version := looked.data_version;
    answer := looked.answer;
    if time_left_ms > 0
       and pg_catalog.clock_timestamp() >= pg_catalog.statement_timestamp() + time_left_ms * interval '1 ms' then
        raise exception using errcode = '57014', message = 'canceling statement due to statement timeout';
    end if;
    charged := looked.answer is null
        and looked.epsilon_per_query is not distinct from priced_epsilon_per_query
        and looked.delta_per_query is not distinct from priced_delta_per_query
        and looked.accounting is not distinct from priced_accounting;
    if charged then
        remaining := anonproxy.charge(role_name, domain, epsilon, delta, rho, delta_add, fingerprint);
    end if;
    -- what require_charged checks in the read that follows; set in this transaction, so kept only if it commits
    perform pg_catalog.set_config('anonproxy.charged_for', case when charged then answer_key else '' end, false);
end
$$;

-- The first statement of the read sent after charge_unless_answered: it fails, and the server skips the rest of the
-- read, unless the charge just committed on this connection was made for answer_key.
create function anonproxy.require_charged(answer_key text) returns void
language plpgsql stable set search_path = pg_catalog, pg_temp as $$
begin
    if pg_catalog.current_setting('anonproxy.charged_for', true) is distinct from answer_key then
        raise exception using errcode = '55000',
            message = 'no charge was made for this read: the question was answered before, or its cost changed';
    end if;
end
$$;

-- Like anonproxy.charge and lookup_answer, both keep PUBLIC's EXECUTE: the first checks its caller, the second
-- reads a setting of the caller's own session.
