//! The statement filter: the endpoint is read-only. Every statement is judged before
//! datafusion-postgres's own hooks or DataFusion see it ([`ReadOnly`], first of [`hooks`]):
//! queries are planned and refused if any part of the plan writes (25006, as Postgres answers a
//! write in a read-only transaction); the session statements clients send on connect pass or are
//! answered here; everything else is refused.

use std::sync::Arc;

use async_trait::async_trait;
use datafusion::common::ParamValues;
use datafusion::error::DataFusionError;
use datafusion::execution::context::SQLOptions;
use datafusion::logical_expr::{EmptyRelation, LogicalPlan};
use datafusion::prelude::SessionContext;
use datafusion::sql::parser::Statement as DfStatement;
use datafusion::sql::sqlparser::ast::Statement;
use datafusion_postgres::hooks::cursor::CursorStatementHook;
use datafusion_postgres::hooks::set_show::SetShowHook;
use datafusion_postgres::hooks::transactions::TransactionStatementHook;
use datafusion_postgres::hooks::HookClient;
use datafusion_postgres::pgwire::api::results::{Response, Tag};
use datafusion_postgres::pgwire::api::ClientInfo;
use datafusion_postgres::pgwire::error::{ErrorInfo, PgWireError, PgWireResult};
use datafusion_postgres::QueryHook;

use super::settings::{as_of_setting, note_settings, session_time_zone, set_as_of, shared_setting};

/// datafusion-postgres's own hooks (cursors, SET and SHOW, transactions), behind [`ReadOnly`].
pub(super) fn hooks() -> Vec<Arc<dyn QueryHook>> {
    vec![
        Arc::new(ReadOnly),
        Arc::new(CursorStatementHook),
        Arc::new(SetShowHook),
        Arc::new(TransactionStatementHook),
    ]
}

/// What the endpoint does with a statement, before anything else sees it.
#[derive(Debug, PartialEq)]
enum Verdict {
    /// A query: planned, and run only if the plan writes nothing.
    Query,
    /// A cursor over these queries, each checked as a query.
    Cursor(Vec<Statement>),
    /// Handled further on (SHOW, SET, transactions, cursors): none of it writes.
    Pass,
    /// A session statement with nothing to do here, answered with this command tag.
    Done(String),
    /// Refused; says what was refused.
    Refuse(String),
}

/// What the endpoint does with `statement`.
fn verdict(statement: &Statement) -> Verdict {
    match statement {
        Statement::Query(_) | Statement::ExplainTable { .. } => Verdict::Query,
        Statement::Explain {
            statement: inner, ..
        } => match verdict(inner) {
            Verdict::Query => Verdict::Query,
            _ => Verdict::Refuse(kind(inner)),
        },
        Statement::Declare { stmts } => Verdict::Cursor(
            stmts
                .iter()
                .filter_map(|d| d.for_query.clone())
                .map(Statement::Query)
                .collect(),
        ),
        Statement::Set(set) => match shared_setting(set) {
            Some(name) => Verdict::Refuse(format!("SET {name}")),
            None if session_time_zone(set) => Verdict::Done("SET".to_string()),
            None => Verdict::Pass,
        },
        Statement::ShowVariable { .. }
        | Statement::ShowVariables { .. }
        | Statement::ShowStatus { .. }
        | Statement::ShowCatalogs { .. }
        | Statement::ShowDatabases { .. }
        | Statement::ShowSchemas { .. }
        | Statement::ShowTables { .. }
        | Statement::ShowViews { .. }
        | Statement::ShowColumns { .. }
        | Statement::ShowFunctions { .. }
        | Statement::ShowCreate { .. }
        | Statement::StartTransaction { .. }
        | Statement::Commit { .. }
        | Statement::Rollback { .. }
        | Statement::Fetch { .. }
        | Statement::Close { .. } => Verdict::Pass,
        // Nothing is kept between statements that these would release or reset (SQL-level
        // PREPARE is refused; pgwire owns protocol-level prepared statements).
        Statement::Discard { object_type } => Verdict::Done(format!("DISCARD {object_type}")),
        Statement::Deallocate { .. } => Verdict::Done("DEALLOCATE".to_string()),
        Statement::Reset(_) => Verdict::Done("RESET".to_string()),
        Statement::Savepoint { .. } => Verdict::Done("SAVEPOINT".to_string()),
        Statement::ReleaseSavepoint { .. } => Verdict::Done("RELEASE".to_string()),
        other => Verdict::Refuse(kind(other)),
    }
}

/// The statement's leading keywords, as Postgres names a command in its errors.
fn kind(statement: &Statement) -> String {
    let text = statement.to_string();
    let mut words = text.split_whitespace();
    let first = words.next().unwrap_or_default().to_uppercase();
    match first.as_str() {
        "CREATE" | "DROP" | "ALTER" => match words.next() {
            Some(second) => format!("{first} {}", second.to_uppercase()),
            None => first,
        },
        _ => first,
    }
}

/// The error a statement that would write gets.
fn read_only(what: &str) -> PgWireError {
    PgWireError::UserError(Box::new(ErrorInfo::new(
        "ERROR".to_string(),
        // read_only_sql_transaction, as Postgres answers a write in a read-only transaction.
        "25006".to_string(),
        format!(
            "cannot execute {what}: the gpuwarden SQL endpoint is read-only \
             (queries: SELECT, WITH, EXPLAIN, SHOW; session: SET, BEGIN, COMMIT, ROLLBACK)"
        ),
    )))
}

/// Plans `statement` and refuses the plan if any part of it, subqueries included, would write
/// (`SELECT … INTO` creates a table, for instance).
async fn plan_read_only(ctx: &SessionContext, statement: &Statement) -> PgWireResult<LogicalPlan> {
    let plan = ctx
        .state()
        .statement_to_plan(DfStatement::Statement(Box::new(statement.clone())))
        .await
        .map_err(|e| PgWireError::ApiError(Box::new(e)))?;
    SQLOptions::new()
        .with_allow_ddl(false)
        .with_allow_dml(false)
        .with_allow_statements(false)
        .verify_plan(&plan)
        .map_err(|e| {
            let why = match e {
                DataFusionError::Plan(why) => why,
                other => other.strip_backtrace(),
            };
            read_only(&format!("a query that writes ({why})"))
        })?;
    Ok(plan)
}

/// Refuses everything that writes, before datafusion-postgres's own hooks or DataFusion see it.
#[derive(Debug)]
struct ReadOnly;

impl ReadOnly {
    async fn check(
        &self,
        statement: &Statement,
        ctx: &SessionContext,
    ) -> Option<PgWireResult<Response>> {
        if let Some(value) = as_of_setting(statement) {
            return Some(set_as_of(&value));
        }
        match verdict(statement) {
            // datafusion-postgres plans the statement again to run it: planning costs little
            // next to running, and an error found here is the one it would have found.
            Verdict::Query => plan_read_only(ctx, statement).await.err().map(Err),
            Verdict::Cursor(queries) => check_all(ctx, &queries).await.err().map(Err),
            Verdict::Pass => None,
            Verdict::Done(tag) => Some(Ok(Response::Execution(Tag::new(&tag)))),
            Verdict::Refuse(what) => Some(Err(read_only(&what))),
        }
    }
}

/// Plans each of a cursor's queries, refusing the first that writes.
async fn check_all(ctx: &SessionContext, queries: &[Statement]) -> PgWireResult<()> {
    for query in queries {
        plan_read_only(ctx, query).await?;
    }
    Ok(())
}

/// The plan of a statement answered here at parse: it runs nothing.
fn nothing() -> LogicalPlan {
    LogicalPlan::EmptyRelation(EmptyRelation {
        produce_one_row: false,
        schema: Arc::new(datafusion::common::DFSchema::empty()),
    })
}

#[async_trait]
impl QueryHook for ReadOnly {
    async fn handle_simple_query(
        &self,
        statement: &Statement,
        session_context: &SessionContext,
        client: &mut dyn HookClient,
    ) -> Option<PgWireResult<Response>> {
        note_settings(client.metadata());
        self.check(statement, session_context).await
    }

    async fn handle_extended_parse_query(
        &self,
        statement: &Statement,
        session_context: &SessionContext,
        client: &(dyn ClientInfo + Send + Sync),
    ) -> Option<PgWireResult<LogicalPlan>> {
        note_settings(client.metadata());
        match verdict(statement) {
            // The plan checked here is the one that runs: no second planning.
            Verdict::Query => Some(plan_read_only(session_context, statement).await),
            Verdict::Cursor(queries) => check_all(session_context, &queries).await.err().map(Err),
            Verdict::Pass => None,
            Verdict::Done(_) => Some(Ok(nothing())),
            Verdict::Refuse(what) => Some(Err(read_only(&what))),
        }
    }

    async fn handle_extended_query(
        &self,
        statement: &Statement,
        _logical_plan: &LogicalPlan,
        _params: &ParamValues,
        _session_context: &SessionContext,
        _client: &mut dyn HookClient,
    ) -> Option<PgWireResult<Response>> {
        // Checked at parse; only the statements answered here remain.
        match verdict(statement) {
            Verdict::Done(tag) => Some(Ok(Response::Execution(Tag::new(&tag)))),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion_postgres::datafusion_pg_catalog::sql::PostgresCompatibilityParser;
    use datafusion_postgres::pgwire::api::query::ExtendedQueryHandler as _;
    use datafusion_postgres::DfSessionService;

    use crate::endpoint::catalog::prepare;

    fn parse(sql: &str) -> Statement {
        PostgresCompatibilityParser::new()
            .parse(sql)
            .unwrap()
            .remove(0)
    }

    #[test]
    fn queries_and_session_statements_pass_and_writes_are_refused() {
        for sql in [
            "SELECT 1",
            "WITH a AS (SELECT 1) SELECT * FROM a",
            "EXPLAIN SELECT 1",
        ] {
            assert_eq!(verdict(&parse(sql)), Verdict::Query, "{sql}");
        }
        for sql in [
            "SHOW TIME ZONE",
            "SET extra_float_digits = 3",
            "SET application_name = 'x'",
            "BEGIN",
            "COMMIT",
            "ROLLBACK",
        ] {
            assert_eq!(verdict(&parse(sql)), Verdict::Pass, "{sql}");
        }
        assert_eq!(
            verdict(&parse("DISCARD ALL")),
            Verdict::Done("DISCARD ALL".into())
        );
        assert_eq!(
            verdict(&parse("SET timezone = 'Europe/Paris'")),
            Verdict::Done("SET".into())
        );
        for (sql, what) in [
            ("CREATE TABLE t (a INT)", "CREATE TABLE"),
            ("CREATE VIEW v AS SELECT 1", "CREATE VIEW"),
            ("INSERT INTO samples VALUES (1)", "INSERT"),
            ("UPDATE samples SET host = 'x'", "UPDATE"),
            ("DELETE FROM samples", "DELETE"),
            ("DROP TABLE samples", "DROP TABLE"),
            ("COPY samples TO '/tmp/x.csv'", "COPY"),
            ("EXPLAIN INSERT INTO samples VALUES (1)", "INSERT"),
            ("PREPARE p AS SELECT 1", "PREPARE"),
            (
                "SET datafusion.execution.batch_size = 1",
                "SET datafusion.execution.batch_size",
            ),
        ] {
            assert_eq!(verdict(&parse(sql)), Verdict::Refuse(what.into()), "{sql}");
        }
    }

    // psql 15 speaks only the simple protocol; JDBC, DBeaver and Metabase prepare statements.
    #[tokio::test]
    async fn the_extended_protocol_refuses_writes_when_they_are_prepared() {
        use datafusion_postgres::pgwire::api::stmt::QueryParser as _;
        let ctx = Arc::new(SessionContext::new());
        prepare(&ctx).unwrap();
        let service = DfSessionService::new_with_hooks(ctx, hooks());
        let parser = service.query_parser();
        let client = datafusion_postgres::testing::MockClient::new();
        for sql in [
            "CREATE TABLE t (a INT)",
            "INSERT INTO t VALUES (1)",
            "SELECT 1 AS a INTO t",
        ] {
            let err = match parser.parse_sql(&client, sql, &[]).await {
                Err(e) => e,
                Ok(_) => panic!("{sql} was accepted"),
            };
            let info = ErrorInfo::from(err);
            assert_eq!(info.code, "25006", "{sql}: {}", info.message);
        }
        for sql in [
            "SELECT $1::bigint + 1",
            "DISCARD ALL",
            "SET application_name = 'x'",
        ] {
            assert!(parser.parse_sql(&client, sql, &[]).await.is_ok(), "{sql}");
        }
    }

    // pgjdbc binds the patterns of its DatabaseMetaData queries (getColumns: `LIKE ?`) and
    // DBeaver the oids of its lookups, through the extended protocol, which psql 15 cannot
    // speak: each is planned, and its parameters typed as those clients send them.
    #[tokio::test]
    async fn jdbc_metadata_queries_are_planned_with_their_parameters() {
        use datafusion_postgres::pgwire::api::stmt::QueryParser as _;
        use datafusion_postgres::pgwire::api::Type;
        let ctx = Arc::new(SessionContext::new());
        prepare(&ctx).unwrap();
        let service = DfSessionService::new_with_hooks(ctx, hooks());
        let parser = service.query_parser();
        let client = datafusion_postgres::testing::MockClient::new();
        let pgjdbc_columns = "SELECT * FROM (SELECT current_database() AS current_database, \
            n.nspname,c.relname,a.attname,a.atttypid,a.attnotnull  OR (t.typtype = 'd' AND \
            t.typnotnull) AS attnotnull,a.atttypmod,a.attlen,t.typtypmod,row_number() OVER \
            (PARTITION BY a.attrelid ORDER BY a.attnum) AS attnum, nullif(a.attidentity, '') as \
            attidentity,nullif(a.attgenerated, '') as attgenerated,\
            pg_catalog.pg_get_expr(def.adbin, def.adrelid) AS adsrc,dsc.description,\
            t.typbasetype,t.typtype  FROM pg_catalog.pg_namespace n  JOIN pg_catalog.pg_class c \
            ON (c.relnamespace = n.oid)  JOIN pg_catalog.pg_attribute a ON (a.attrelid=c.oid)  \
            JOIN pg_catalog.pg_type t ON (a.atttypid = t.oid)  LEFT JOIN pg_catalog.pg_attrdef def \
            ON (a.attrelid=def.adrelid AND a.attnum = def.adnum)  LEFT JOIN \
            pg_catalog.pg_description dsc ON (c.oid=dsc.objoid AND a.attnum = dsc.objsubid)  LEFT \
            JOIN pg_catalog.pg_class dc ON (dc.oid=dsc.classoid AND dc.relname='pg_class')  LEFT \
            JOIN pg_catalog.pg_namespace dn ON (dc.relnamespace=dn.oid AND dn.nspname='pg_catalog')  \
            WHERE c.relkind in ('r','p','v','f','m') and a.attnum > 0 AND NOT a.attisdropped  AND \
            n.nspname LIKE $1 AND c.relname LIKE $2) c WHERE true  AND attname LIKE $3 ORDER BY \
            nspname,c.relname,attnum ";
        let dbeaver_tables = "SELECT c.oid,c.*,d.description,\
            pg_catalog.pg_get_expr(c.relpartbound, c.oid) as partition_expr,  \
            pg_catalog.pg_get_partkeydef(c.oid) as partition_key \nFROM pg_catalog.pg_class c\n\
            LEFT OUTER JOIN pg_catalog.pg_description d ON d.objoid=c.oid AND d.objsubid=0 AND \
            d.classoid='pg_class'::regclass\nWHERE c.relnamespace=$1 AND c.relkind not in \
            ('i','I','c')";
        for (sql, expected) in [
            (pgjdbc_columns, vec![Type::TEXT, Type::TEXT, Type::TEXT]),
            // An oid, as in Postgres (which names it `oid` rather than `regnamespace`).
            (dbeaver_tables, vec![Type::REGNAMESPACE]),
        ] {
            let statement = match parser.parse_sql(&client, sql, &[]).await {
                Ok(Some(statement)) => statement,
                Ok(None) => panic!("nothing planned for {sql}"),
                Err(e) => panic!("{sql}: {}", ErrorInfo::from(e).message),
            };
            assert_eq!(
                parser.get_parameter_types(&statement).unwrap(),
                expected,
                "{sql}"
            );
        }
    }

    #[tokio::test]
    async fn a_query_whose_plan_writes_is_refused() {
        let ctx = SessionContext::new();
        let err = plan_read_only(&ctx, &parse("SELECT 1 AS a INTO t"))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("read-only"), "{err}");
        plan_read_only(&ctx, &parse("SELECT 1 AS a")).await.unwrap();
    }
}
