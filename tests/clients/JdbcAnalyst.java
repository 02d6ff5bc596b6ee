import java.sql.*;

/**
 * A dp analyst's JDBC session through the gated proxy: prints "label|key|value..." lines for the test to check.
 * Named server-side statements from the first run (prepareThreshold=1), binary transfer of bigint and numeric,
 * and a fetch size, so pgjdbc reads each portal four rows at a time (Execute with a row limit).
 */
public class JdbcAnalyst {
    public static void main(String[] args) throws Exception {
        String url = "jdbc:postgresql://" + args[0] + ":" + args[1] + "/" + args[2]
                + "?prepareThreshold=1&binaryTransfer=true&binaryTransferEnable=INT8,NUMERIC";
        try (Connection conn = DriverManager.getConnection(url, args[3], args[3])) {
            conn.setAutoCommit(false);  // a fetch size needs a transaction; pgjdbc sends BEGIN with the first query
            String sql = "select education, count(*), sum(age), avg(hours_per_week) from adult group by education";
            try (PreparedStatement st = conn.prepareStatement(sql)) {
                st.setFetchSize(4);
                for (int round = 0; round < 3; round++) {
                    try (ResultSet rs = st.executeQuery()) {
                        ResultSetMetaData meta = rs.getMetaData();
                        System.out.println("types|" + round + "|" + meta.getColumnTypeName(2) + "|"
                                + meta.getColumnTypeName(3) + "|" + meta.getColumnTypeName(4));
                        while (rs.next()) {
                            System.out.println("row|" + round + "|" + rs.getString(1) + "|" + rs.getLong(2) + "|"
                                    + rs.getLong(3) + "|" + rs.getBigDecimal(4).toPlainString());
                        }
                    }
                }
            }
            try (PreparedStatement st = conn.prepareStatement("select count(*) from adult where age > ?")) {
                st.setInt(1, 30);
                try (ResultSet rs = st.executeQuery()) {
                    rs.next();
                    System.out.println("older|30|" + rs.getLong(1));
                }
            }
            conn.commit();
            try (Statement st = conn.createStatement();
                 ResultSet rs = st.executeQuery("show anonproxy.budget")) {
                rs.next();
                System.out.println("budget|left|" + rs.getString(1));
            }
            conn.rollback();
        }
    }
}
