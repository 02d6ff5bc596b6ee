// pgjdbc through anonproxy; run by tests/test_clients.py as a Java single-file program:
//
//   java -cp postgresql.jar tests/clients/JdbcClient.java HOST PORT DBNAME USER PASSWORD
//
// Prints one "key=value" line per observation; the Python test checks each against
// values it computes with a direct psycopg connection. Any unexpected failure throws,
// which exits non-zero with a stack trace.

import java.io.ByteArrayInputStream;
import java.io.ByteArrayOutputStream;
import java.math.BigDecimal;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.sql.Statement;
import java.util.HexFormat;
import java.util.Properties;
import java.util.concurrent.atomic.AtomicLong;

import org.postgresql.PGConnection;
import org.postgresql.PGStatement;
import org.postgresql.copy.CopyManager;

public class JdbcClient {
    static final String ROW_QUERY =
        "select id, age, workclass, fnlwgt, education, hours_per_week, "
            + "round(capital_gain::numeric / 7, 6) as ratio from adult where id = ?";
    static final String AGG_QUERY =
        "select count(*), sum(fnlwgt), round(avg(hours_per_week), 6) from adult where age = ?";

    static String url;
    static String user;
    static String password;

    public static void main(String[] args) throws Exception {
        url = "jdbc:postgresql://" + args[0] + ":" + args[1] + "/" + args[2];
        user = args[3];
        password = args[4];
        System.out.println("driver=" + org.postgresql.Driver.class.getPackage().getImplementationVersion());
        for (String mode : new String[] {"default", "binary"}) {
            Properties props = credentials();
            if (mode.equals("binary")) {
                props.setProperty("binaryTransfer", "true");
            }
            try (Connection conn = DriverManager.getConnection(url, props)) {
                preparedStatements(conn, mode);
            }
        }
        try (Connection conn = DriverManager.getConnection(url, credentials())) {
            batchInsert(conn);
            copy(conn);
            cancel(conn);
        }
        System.out.println("done=ok");
    }

    static Properties credentials() {
        Properties props = new Properties();
        props.setProperty("user", user);
        props.setProperty("password", password);
        props.setProperty("ApplicationName", "jdbc-client-test");
        props.setProperty("connectTimeout", "10");
        props.setProperty("socketTimeout", "60");
        return props;
    }

    // More executions than prepareThreshold (5): pgjdbc moves from unnamed to named
    // server-side statements (and, with binaryTransfer, to binary results).
    static void preparedStatements(Connection conn, String mode) throws SQLException {
        try (PreparedStatement ps = conn.prepareStatement(ROW_QUERY)) {
            for (int id = 1; id <= 12; id++) {
                ps.setInt(1, id);
                try (ResultSet rs = ps.executeQuery()) {
                    if (!rs.next()) {
                        throw new IllegalStateException("no row for id " + id);
                    }
                    int age = rs.getInt("age");
                    String workclass = rs.getString("workclass");
                    long fnlwgt = rs.getLong("fnlwgt");
                    String education = rs.getString("education");
                    int hours = rs.getInt("hours_per_week");
                    BigDecimal ratio = rs.getBigDecimal("ratio");
                    System.out.println("row." + mode + "." + rs.getInt("id") + "=" + age + "|" + workclass + "|"
                        + fnlwgt + "|" + education + "|" + hours + "|" + ratio.toPlainString());
                }
            }
            System.out.println("server_prepare." + mode + "=" + ps.unwrap(PGStatement.class).isUseServerPrepare());
        }
        try (PreparedStatement ps = conn.prepareStatement(AGG_QUERY)) {
            for (int age = 20; age < 30; age++) {
                ps.setInt(1, age);
                try (ResultSet rs = ps.executeQuery()) {
                    rs.next();
                    System.out.println("agg." + mode + "." + age + "=" + rs.getLong(1) + "|" + rs.getLong(2) + "|"
                        + rs.getBigDecimal(3).toPlainString());
                }
            }
        }
        try (Statement st = conn.createStatement();
             ResultSet rs = st.executeQuery("select count(*) from pg_prepared_statements where not from_sql")) {
            rs.next();
            System.out.println("named_statements." + mode + "=" + rs.getInt(1));
        }
    }

    static void batchInsert(Connection conn) throws SQLException {
        try (Statement st = conn.createStatement()) {
            st.execute("create table jdbc_batch(id int primary key, name text not null, amount numeric not null)");
        }
        int[] counts;
        try (PreparedStatement ps = conn.prepareStatement("insert into jdbc_batch values (?, ?, ?)")) {
            for (int i = 1; i <= 1000; i++) {
                ps.setInt(1, i);
                ps.setString(2, "name " + i);
                ps.setBigDecimal(3, new BigDecimal(i).movePointLeft(2));
                ps.addBatch();
            }
            counts = ps.executeBatch();
        }
        long total = 0;
        for (int c : counts) {
            total += c;
        }
        System.out.println("batch.statements=" + counts.length);
        System.out.println("batch.rows=" + total);
    }

    static void copy(Connection conn) throws Exception {
        CopyManager copy = conn.unwrap(PGConnection.class).getCopyAPI();
        try (Statement st = conn.createStatement()) {
            st.execute("create table jdbc_copy(id int, label text)");
        }
        StringBuilder data = new StringBuilder();
        for (int i = 0; i < 5000; i++) {
            data.append(i).append('\t').append("label ").append(i).append('\n');
        }
        long in = copy.copyIn("copy jdbc_copy from stdin",
            new ByteArrayInputStream(data.toString().getBytes(StandardCharsets.UTF_8)));
        System.out.println("copy_in.rows=" + in);

        ByteArrayOutputStream buffer = new ByteArrayOutputStream();
        long out = copy.copyOut("copy (select id, age, education, income from adult order by id) to stdout", buffer);
        byte[] bytes = buffer.toByteArray();
        System.out.println("copy_out.rows=" + out);
        System.out.println("copy_out.bytes=" + bytes.length);
        System.out.println("copy_out.sha256=" + HexFormat.of().formatHex(MessageDigest.getInstance("SHA-256").digest(bytes)));
    }

    static void cancel(Connection conn) throws Exception {
        conn.setAutoCommit(true);
        AtomicLong cancelledAt = new AtomicLong();
        try (Statement st = conn.createStatement()) {
            Thread canceller = new Thread(() -> {
                try {
                    Thread.sleep(500);
                    cancelledAt.set(System.nanoTime());
                    st.cancel();
                } catch (Exception e) {
                    e.printStackTrace();
                }
            });
            long start = System.nanoTime();
            canceller.start();
            try {
                st.executeQuery("select pg_sleep(10)");
                System.out.println("cancel.sqlstate=none");
            } catch (SQLException e) {
                System.out.println("cancel.sqlstate=" + e.getSQLState());
            }
            long end = System.nanoTime();
            canceller.join();
            System.out.println("cancel.total_ms=" + (end - start) / 1_000_000);
            System.out.println("cancel.after_cancel_ms=" + (end - cancelledAt.get()) / 1_000_000);
        }
        try (Statement st = conn.createStatement(); ResultSet rs = st.executeQuery("select count(*) from adult")) {
            rs.next();
            System.out.println("cancel.then_count=" + rs.getLong(1));
        }
    }
}
