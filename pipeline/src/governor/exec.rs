//! How a governed query runs: the planner puts a [`Checkpoint`] above every operator of the
//! plan DataFusion made, and [`Governed`] at its root. `Governed` waits for the query's slot,
//! runs the plan on the governor's threads with a memory pool of its own, and hands its batches
//! to whoever polls it (a connection of the SQL endpoint, `gpuwarden sql`), ending it with a
//! [`QueryError`] when its deadline passes or something cancels it. The checkpoints make a
//! plan stoppable: between two batches of any operator they look at the query's [`Control`]
//! and give the thread back once a [`SLICE`] has passed.

use std::num::NonZeroUsize;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::catalog::Session as DataFusionSession;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::context::QueryPlanner;
use datafusion::execution::memory_pool::{FairSpillPool, TrackConsumersPool};
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::execution::{RecordBatchStream, SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::LogicalPlan;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::explain::ExplainExec;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
};
use datafusion::physical_planner::{DefaultPhysicalPlanner, PhysicalPlanner};
use futures::{Stream, StreamExt};
use tokio::sync::mpsc;

use super::{Control, Governor, Limits, QueryError, Reason, Session, LOCAL_USER};

/// Longest an operator keeps its thread before it yields it to other queries (and looks
/// whether its query was canceled).
pub(crate) const SLICE: Duration = Duration::from_millis(10);

/// Plans as DataFusion does, then governs what it planned.
#[derive(Debug)]
pub(crate) struct GovernedPlanner {
    governor: Arc<Governor>,
}

impl GovernedPlanner {
    pub(crate) fn new(governor: Arc<Governor>) -> Self {
        Self { governor }
    }
}

#[async_trait]
impl QueryPlanner for GovernedPlanner {
    async fn create_physical_plan(
        &self,
        logical_plan: &LogicalPlan,
        session_state: &dyn DataFusionSession,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let plan = DefaultPhysicalPlanner::default()
            .create_physical_plan(logical_plan, session_state)
            .await?;
        // EXPLAIN (without ANALYZE) runs nothing, and shows the plan as DataFusion made it.
        if plan.is::<ExplainExec>() {
            return Ok(plan);
        }
        let session = Session::current();
        let user = match &session {
            // Outside any session: `gpuwarden sql`.
            None => LOCAL_USER.to_string(),
            Some(session) => match session.user() {
                Some(user) => user.to_string(),
                // pgwire goes on reading a connection it refused at startup: nothing runs there.
                None => return Err(QueryError::NotLoggedIn.into()),
            },
        };
        let mut limits = self.governor.limits_of(&user).clone();
        let mut timeout_source = if self.governor.options.users.contains_key(&user) {
            format!("statement_timeout of user \"{user}\"")
        } else {
            self.governor.options.defaults_set_by.clone()
        };
        if let Some(own) = session.as_ref().and_then(|s| s.statement_timeout()) {
            if limits.statement_timeout.is_none_or(|limit| own < limit) {
                limits.statement_timeout = Some(own);
                timeout_source = "SET statement_timeout".to_string();
            }
        }
        let plan = plan
            .transform_up(|node| {
                Ok(Transformed::yes(
                    Arc::new(Checkpoint::new(node)) as Arc<dyn ExecutionPlan>
                ))
            })?
            .data;
        let plan = if plan.output_partitioning().partition_count() > 1 {
            Arc::new(CoalescePartitionsExec::new(plan)) as Arc<dyn ExecutionPlan>
        } else {
            plan
        };
        Ok(Arc::new(Governed {
            properties: Arc::clone(plan.properties()),
            input: plan,
            governor: Arc::clone(&self.governor),
            user,
            limits,
            timeout_source: timeout_source.into(),
            session,
        }))
    }
}

/// The root of a governed plan: one partition, whose stream runs the plan on the governor's
/// threads.
#[derive(Debug)]
struct Governed {
    input: Arc<dyn ExecutionPlan>,
    properties: Arc<PlanProperties>,
    governor: Arc<Governor>,
    user: String,
    limits: Limits,
    timeout_source: Arc<str>,
    session: Option<Arc<Session>>,
}

impl DisplayAs for Governed {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Governed: user={}, memory={}, timeout={}",
            self.user,
            self.limits.query_memory,
            self.limits.statement_timeout.map_or_else(
                || "none".to_string(),
                |t| humantime::format_duration(t).to_string()
            )
        )
    }
}

impl ExecutionPlan for Governed {
    fn name(&self) -> &str {
        "Governed"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    #[allow(deprecated)]
    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let input = only_child(children, "Governed")?;
        Ok(Arc::new(Self {
            properties: Arc::clone(input.properties()),
            input,
            governor: Arc::clone(&self.governor),
            user: self.user.clone(),
            limits: self.limits.clone(),
            timeout_source: Arc::clone(&self.timeout_source),
            session: self.session.clone(),
        }))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        if partition != 0 {
            return Err(DataFusionError::Internal(format!(
                "Governed has one partition, not {partition}"
            )));
        }
        let control = Arc::new(Control::default());
        let started = Instant::now();
        let deadline = self.limits.statement_timeout.map(|t| started + t);
        let id = self.governor.register(&control);
        if let Some(session) = &self.session {
            session.started(&control);
        }
        let context = query_context(&context, self.limits.query_memory, &control);
        let (tx, rx) = mpsc::channel(2);
        let task = {
            let (governor, input, user, limits) = (
                Arc::clone(&self.governor),
                Arc::clone(&self.input),
                self.user.clone(),
                self.limits.clone(),
            );
            let watched = Arc::clone(&control);
            let control = Arc::clone(&control);
            let run = async move {
                let permits = tokio::select! {
                    admitted = governor.admit(&user, &limits) => admitted,
                    reason = control.stopped() => Err(QueryError::from_reason(reason, &limits, "statement_timeout")),
                };
                let _permits = match permits {
                    Ok(permits) => permits,
                    Err(refused) => {
                        tracing::info!(user = %user, error = %refused, "SQL query refused");
                        let _ = tx.send(Err(refused.into())).await;
                        return;
                    }
                };
                let mut batches = match input.execute(0, context) {
                    Ok(batches) => batches,
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                };
                while let Some(batch) = batches.next().await {
                    let failed = batch.is_err();
                    if tx.send(batch).await.is_err() || failed {
                        return;
                    }
                }
            };
            // The query's own end, whether or not anyone reads it (a cursor nobody fetches
            // from, a client that stopped reading): past the deadline or once stopped, it gives
            // its slot back. The reader reports why.
            let control = watched;
            self.governor.executor.spawn(async move {
                let deadline = async {
                    match deadline {
                        Some(at) => tokio::time::sleep_until(at.into()).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = run => {}
                    _ = control.stopped() => {}
                    () = deadline => control.cancel(Reason::Timeout),
                }
            })
        };
        let running = Running {
            rx,
            deadline,
            started,
            user: self.user.clone(),
            limits: self.limits.clone(),
            timeout_source: Arc::clone(&self.timeout_source),
            guard: Guard {
                task,
                ended: false,
                user: self.user.clone(),
                started,
                id,
                governor: Arc::clone(&self.governor),
                session: self.session.clone(),
                control,
            },
        };
        let batches = futures::stream::unfold(Some(running), |running| async move {
            let mut running = running?;
            match running.next().await {
                Ok(Some(batch)) => Some((Ok(batch), Some(running))),
                Ok(None) => None,
                Err(e) => Some((Err(e), None)),
            }
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.schema(),
            batches,
        )))
    }
}

impl QueryError {
    fn from_reason(reason: Reason, limits: &Limits, source: &str) -> Self {
        match reason {
            Reason::Canceled => Self::Canceled,
            Reason::Timeout => Self::Timeout {
                limit: limits.statement_timeout.unwrap_or_default(),
                set_by: source.to_string(),
            },
            Reason::Shutdown => Self::Shutdown,
            Reason::Disconnected => Self::Disconnected,
        }
    }
}

/// A query on its way: the receiving end of its batches, and what stops it.
struct Running {
    rx: mpsc::Receiver<Result<RecordBatch>>,
    deadline: Option<Instant>,
    started: Instant,
    user: String,
    limits: Limits,
    timeout_source: Arc<str>,
    guard: Guard,
}

impl Running {
    async fn next(&mut self) -> Result<Option<RecordBatch>> {
        let deadline = async {
            match self.deadline {
                Some(at) => tokio::time::sleep_until(at.into()).await,
                None => std::future::pending().await,
            }
        };
        let control = Arc::clone(&self.guard.control);
        let stopped = tokio::select! {
            biased;
            reason = control.stopped() => reason,
            () = deadline => {
                // Stops the plan too: its operators see the control at their next batch.
                control.cancel(Reason::Timeout);
                control.reason().unwrap_or(Reason::Timeout)
            }
            batch = self.rx.recv() => {
                if !matches!(batch, Some(Ok(_))) {
                    self.guard.ended = true;
                }
                return match batch {
                    Some(Ok(batch)) => Ok(Some(batch)),
                    Some(Err(e)) => {
                        tracing::debug!(user = %self.user, elapsed_ms = self.elapsed_ms(), error = %e, "SQL query failed");
                        Err(e)
                    }
                    None => match (&mut self.guard.task).await {
                        Ok(()) if self.guard.control.reason().is_none() => {
                            tracing::debug!(user = %self.user, elapsed_ms = self.elapsed_ms(), "SQL query done");
                            Ok(None)
                        }
                        // Stopped while its last batches were on their way: say why.
                        Ok(()) => Err(QueryError::from_reason(
                            self.guard.control.reason().unwrap_or(Reason::Canceled),
                            &self.limits,
                            &self.timeout_source,
                        )
                        .into()),
                        Err(e) => {
                            tracing::error!(user = %self.user, error = %e, "SQL query failed inside its plan");
                            Err(DataFusionError::Execution(format!(
                                "the query failed inside its plan: {e}"
                            )))
                        }
                    },
                };
            }
        };
        self.guard.ended = true;
        let error = QueryError::from_reason(stopped, &self.limits, &self.timeout_source);
        tracing::info!(user = %self.user, elapsed_ms = self.elapsed_ms(), reason = ?stopped, "SQL query stopped");
        Err(error.into())
    }

    fn elapsed_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// Ends a query whichever way its stream goes: stops its plan if it still runs, and gives its
/// place back.
struct Guard {
    task: tokio::task::JoinHandle<()>,
    /// The stream gave its end or its error.
    ended: bool,
    user: String,
    started: Instant,
    id: u64,
    governor: Arc<Governor>,
    session: Option<Arc<Session>>,
    control: Arc<Control>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        if !self.ended && self.control.reason().is_none() {
            // Dropped before its end: its client is gone.
            self.control.cancel(Reason::Disconnected);
            tracing::info!(user = %self.user, elapsed_ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX), reason = ?Reason::Disconnected, "SQL query stopped");
        }
        self.task.abort();
        if let Some(session) = &self.session {
            session.ended(&self.control);
        }
        self.governor.unregister(self.id);
    }
}

/// The task context a query runs with: its own memory pool, and its control for the
/// checkpoints.
fn query_context(context: &TaskContext, memory: usize, control: &Arc<Control>) -> Arc<TaskContext> {
    let runtime = context.runtime_env();
    let pool = TrackConsumersPool::new(
        FairSpillPool::new(memory),
        NonZeroUsize::new(3).expect("3 is not zero"),
    );
    let runtime = RuntimeEnv {
        memory_pool: Arc::new(pool),
        ..RuntimeEnv::clone(&runtime)
    };
    let mut config = context
        .session_config()
        .clone()
        .with_extension(Arc::clone(control));
    // What a sort sets aside to merge what it spilled (10 MiB by default) must leave room for
    // the rows it sorts, or a small pool could not sort at all.
    let execution = &mut config.options_mut().execution;
    execution.sort_spill_reservation_bytes =
        execution.sort_spill_reservation_bytes.min(memory / 16);
    Arc::new(TaskContext::new(
        context.task_id(),
        context.session_id(),
        config,
        context.scalar_functions().clone(),
        context.higher_order_functions().clone(),
        context.aggregate_functions().clone(),
        context.window_functions().clone(),
        Arc::new(runtime),
    ))
}

/// The one child a node of `kind` takes.
fn only_child(
    mut children: Vec<Arc<dyn ExecutionPlan>>,
    kind: &str,
) -> Result<Arc<dyn ExecutionPlan>> {
    match children.len() {
        1 => Ok(children.swap_remove(0)),
        n => Err(DataFusionError::Internal(format!(
            "{kind} takes one child, not {n}"
        ))),
    }
}

/// Passes its operator's batches on, unless its query was stopped; yields the thread once a
/// [`SLICE`] has passed.
#[derive(Debug)]
struct Checkpoint {
    input: Arc<dyn ExecutionPlan>,
}

impl Checkpoint {
    fn new(input: Arc<dyn ExecutionPlan>) -> Self {
        Self { input }
    }
}

impl DisplayAs for Checkpoint {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Checkpoint")
    }
}

impl ExecutionPlan for Checkpoint {
    fn name(&self) -> &str {
        "Checkpoint"
    }

    // Invisible to whatever looks for an operator by its type.
    fn downcast_delegate(&self) -> Option<&dyn ExecutionPlan> {
        Some(self.input.as_ref())
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.input.properties()
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    #[allow(deprecated)]
    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        Ok(Arc::new(Self::new(only_child(children, "Checkpoint")?)))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let control = context.session_config().get_extension::<Control>();
        let input = self.input.execute(partition, context)?;
        Ok(match control {
            Some(control) => Box::pin(CheckpointStream {
                input,
                control,
                slice_started: Instant::now(),
            }),
            None => input,
        })
    }
}

struct CheckpointStream {
    input: SendableRecordBatchStream,
    control: Arc<Control>,
    slice_started: Instant,
}

impl Stream for CheckpointStream {
    type Item = Result<RecordBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Some(reason) = self.control.reason() {
            // The root answers the client with the reason; this only unwinds the plan.
            return Poll::Ready(Some(Err(DataFusionError::External(Box::new(
                QueryError::from_reason(reason, &Limits::unlimited(), ""),
            )))));
        }
        if self.slice_started.elapsed() >= SLICE {
            self.slice_started = Instant::now();
            // Woken while running, the task goes to the back of its thread's queue.
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let polled = self.input.poll_next_unpin(cx);
        if polled.is_pending() {
            // Waiting gives the thread away as well as a yield does.
            self.slice_started = Instant::now();
        }
        polled
    }
}

impl RecordBatchStream for CheckpointStream {
    fn schema(&self) -> SchemaRef {
        self.input.schema()
    }
}

impl Limits {
    fn unlimited() -> Self {
        Self {
            statement_timeout: None,
            query_memory: usize::MAX,
            max_queries: usize::MAX,
        }
    }
}
