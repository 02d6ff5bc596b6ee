import java.sql.*;

/** A reporter's JDBC session through the gated proxy: prints "label|key|value" lines for the test to check. */
public class JdbcReporter {
    public static void main(String[] args) throws Exception {
        String url = "jdbc:postgresql://" + args[0] + ":" + args[1] + "/" + args[2];
        try (Connection conn = DriverManager.getConnection(url, "reporter", "reporter")) {
            // Not autocommit: pgjdbc sends BEGIN in the same batch as the first query.
            conn.setAutoCommit(false);
            String sql = "select sex, count(*) from adult where age > ? group by sex order by sex";
            try (PreparedStatement st = conn.prepareStatement(sql)) {
                // More than 5 executions: pgjdbc switches to a named server-side statement.
                for (int round = 0; round < 7; round++) {
                    st.setInt(1, 20 + 5 * round);
                    try (ResultSet rs = st.executeQuery()) {
                        while (rs.next()) {
                            System.out.println("round" + round + "|" + rs.getString(1) + "|" + rs.getLong(2));
                        }
                    }
                }
            }
            conn.commit();
            try (Statement st = conn.createStatement(); ResultSet rs = st.executeQuery("show anonproxy.k")) {
                rs.next();
                System.out.println("k|k|" + rs.getString(1));
            }
            try (Statement st = conn.createStatement()) {
                st.executeQuery("select * from adult");
                System.out.println("star|refused|no");
            } catch (SQLException e) {
                System.out.println("star|refused|" + e.getSQLState());
            }
            conn.rollback();
        }
    }
}
