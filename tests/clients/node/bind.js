// Parameters decided at Bind, with node-postgres as reporter; run by tests/test_bind_time.py.
//
// Connection info from the libpq variables. A named statement bound with several LIKE patterns (one of them refused)
// and an unnamed one whose date_trunc unit is a parameter; everything observed is printed as one JSON object.
'use strict';

const { Client } = require('pg');

async function outcome(client, query) {
  try {
    return { rows: (await client.query(query)).rows };
  } catch (err) {
    return { error: err.code };
  }
}

async function main() {
  const client = new Client({ application_name: 'node-pg-bind-test' });
  await client.connect();
  const out = { contains: [], monthly: [] };
  try {
    for (const pattern of ['%sales%', 'sales\\', '%tech%', '%sales%']) {
      const named = { name: 'contains', text: 'select count(*) as n from adult where occupation ilike $1', values: [pattern] };
      out.contains.push(await outcome(client, named));
    }
    for (const unit of ['year', 'fortnight', 'quarter']) {
      const text = 'select date_trunc($1::varchar, visited_at)::text as d, count(*) as n from visits ' +
        'group by date_trunc($1::varchar, visited_at) order by 1';
      out.monthly.push(await outcome(client, { text, values: [unit] }));
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
