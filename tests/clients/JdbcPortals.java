import java.sql.*;

/**
 * Two result sets of one statement open at once in a transaction, read with a fetch size (pgjdbc's named portals,
 * Execute with a row limit, PortalSuspended), interleaved. Args: host port database role pattern1 pattern2
 * fetchSize. Prints "value|sex|count" lines, or "error|SQLSTATE|message".
 */
public class JdbcPortals {
    public static void main(String[] args) throws Exception {
        String url = "jdbc:postgresql://" + args[0] + ":" + args[1] + "/" + args[2];
        String sql = "select sex, count(*) from adult where occupation ilike ? group by sex order by 1";
        try (Connection conn = DriverManager.getConnection(url, args[3], args[3])) {
            conn.setAutoCommit(false);  // a fetch size needs a transaction: pgjdbc keeps its portals open
            try (PreparedStatement first = conn.prepareStatement(sql);
                 PreparedStatement second = conn.prepareStatement(sql)) {
                int fetchSize = Integer.parseInt(args[6]);
                first.setFetchSize(fetchSize);
                second.setFetchSize(fetchSize);
                first.setString(1, args[4]);
                second.setString(1, args[5]);
                try (ResultSet a = first.executeQuery(); ResultSet b = second.executeQuery()) {
                    boolean moreA = true, moreB = true;
                    while (moreA || moreB) {
                        if (moreA && (moreA = a.next())) {
                            System.out.println(args[4] + "|" + a.getString(1) + "|" + a.getLong(2));
                        }
                        if (moreB && (moreB = b.next())) {
                            System.out.println(args[5] + "|" + b.getString(1) + "|" + b.getLong(2));
                        }
                    }
                }
            } catch (SQLException e) {
                System.out.println("error|" + e.getSQLState() + "|" + e.getMessage());
            }
            conn.rollback();
        }
    }
}
