// A daily series over a bound range, with node-postgres as a dp role; run by tests/test_dp_bound_time_filters.py.
//
// Connection info from the libpq variables. node-postgres sends every value as text of no declared type: the range
// as strings, then as JavaScript Dates (written with the client's offset). Prints the days of each answer as JSON.
'use strict';

const { Client } = require('pg');

async function main() {
  const client = new Client({ application_name: 'node-pg-bound-range-test' });
  await client.connect();
  const text = "select date_trunc('day', visited_at)::date::text as day, count(*) as n from visits " +
    "where visited_at >= $1 and visited_at < $2 group by date_trunc('day', visited_at) order by 1";
  const out = [];
  try {
    await client.query("set timezone = 'UTC'");
    for (const values of [['2025-03-01', '2025-04-01'],
      [new Date(Date.UTC(2025, 2, 1)), new Date(Date.UTC(2025, 3, 1))]]) {
      out.push((await client.query({ text, values })).rows.map((row) => row.day));
    }
  } finally {
    await client.end();
  }
  process.stdout.write(JSON.stringify(out));
}

main().catch((err) => {
  process.stderr.write(`${err.stack}\n`);
  process.exit(1);
});
