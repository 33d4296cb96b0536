//! Runtime rules: what the enforcer does with the pipeline's signals
//! (docs/src/contributors/enforcer.md#runtime-rules).
//!
//! - `lease_utilization`: a lease whose GPUs have all been idle for its workload's
//!   `idle_timeout` gets `on_idle` — an alert, a reclaim (reason `idle`), or a resize to
//!   `min_gpus` — after a warning alert `warn_before` that deadline. An inference lease with a
//!   `target_util_pct` is resized between `min_gpus` and `max_gpus` toward it (within quota and
//!   capacity, as the policy decides any resize): to ⌈GPUs × util / target⌉ when utilization is
//!   more than [`AUTOSCALE_TOLERANCE`] off the target, once a whole signal window has measured
//!   its current size.
//! - `gpu_unattributed`: an alert, once per GPU per hour.
//! - `clock_skew`: an alert, once per host per UTC day while its clock stays wrong.
//! - A signal refused for its signature (see `kafka::signals`) is never acted on: an
//!   alert `signal_refused`, once per kind (unsigned, badly signed) every 10 minutes.
//! - `team_spend`: recorded for admission's budget check; a team whose month-to-date spend
//!   passes its budget is blocked (admissions then fail with `team_blocked`), with an alert, and
//!   unblocked once it fits again (a new month, or a raised budget). A figure below what the
//!   enforcer had already counted by the signal's time (rollups that lag, a period computed
//!   again) does not lower the spend ([`crate::store::Store::record_team_spend`]), so it never
//!   unblocks a team for the next signal to block again.
//! - Leases past their end are reclaimed with reason `expired` ([`Service::expire_due`]).
//!
//! Every step is an Action in the store's outbox (and so on `gpuwarden.actions` and in the lake).
//! Steps are idempotent: a lease is reclaimed once (a releasing or ended lease is left alone),
//! a warning or alert is recorded once per idle run (marks in the store, so a restart does not
//! repeat it), and a signal no newer than one already handled for its lease (the store keeps
//! that time, so a restart does not forget it), or about a lease that has ended, is ignored; a
//! `lease_utilization` signal dated more than `pipeline.clock.max_skew` ahead of the enforcer's
//! clock is refused (logged, counted in `gpuwarden_enforcer_signals_future_total`, not kept). A
//! reclaim the substrate does not confirm is retried with a doubling backoff; after
//! [`RECLAIM_ATTEMPTS`] the lease is marked failed and an alert raised. With
//! `enforcer.mode = "dry_run"` each step is recorded once with outcome `dry_run` and nothing is
//! changed or sent. A lease an admin exempted is left to run until its exemption ends.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use gpuwarden_schema::calendar::month_of;
use gpuwarden_schema::clock::span;
use gpuwarden_schema::config::{OnIdle, Role, WorkloadPolicy};
use gpuwarden_schema::retry::Backoff;
use gpuwarden_schema::signing::Verdict;
use gpuwarden_schema::{Action, ActionKind, Outcome, ReleaseReason, Signal, SignalBody, Workload};

use crate::alerts::Alerts;
use crate::policy::Principal;
use crate::service::{Service, ServiceError};
use crate::store::audit::Audit;
use crate::store::{Lease, LeaseState};

/// Tries of a reclaim before the lease is marked failed.
pub const RECLAIM_ATTEMPTS: u32 = 4;
/// Wait before the first retry of a reclaim; each later one waits twice as long.
const RECLAIM_BACKOFF: Duration = Duration::from_millis(500);
const HOUR_MS: i64 = 3_600_000;

/// Refused signals raise at most one alert per kind of refusal in this much of the enforcer's
/// time.
pub const REFUSED_SIGNAL_ALERT_MS: i64 = 10 * 60 * 1000;
/// Utilization within this fraction of the target leaves an inference lease as it is (as
/// Kubernetes' horizontal autoscaler does), so noise does not resize it back and forth.
pub const AUTOSCALE_TOLERANCE: f64 = 0.1;

/// How far ahead of the enforcer's clock a `lease_utilization` signal may be dated and still be
/// acted on: `pipeline.clock.max_skew` (default 5 min), the pipeline's own bound on a record's
/// time ahead of its arrival.
pub fn max_ahead_ms(config: &gpuwarden_schema::config::Config) -> i64 {
    i64::try_from(config.pipeline.clock.max_skew.as_millis()).unwrap_or(i64::MAX)
}

/// What a lease's utilization calls for, decided from the signal, the lease and its policy.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Warn that `on_idle` happens at `deadline_ms` unless the lease gets busy.
    IdleWarning {
        /// When the idle run started.
        run_start: i64,
        /// When `on_idle` is due.
        deadline_ms: i64,
    },
    /// `idle_timeout` has passed: carry out `on_idle`.
    Idle {
        /// When the idle run started.
        run_start: i64,
        /// What to do.
        on_idle: OnIdle,
        /// The size a resize goes to.
        min_gpus: u32,
    },
    /// Resize an inference lease to this many GPUs.
    Autoscale {
        /// GPUs wanted.
        gpus: u32,
    },
}

/// The utilization part of a `lease_utilization` signal.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Utilization {
    /// The signal's time.
    pub ts_ms: i64,
    /// Mean utilization over the window, percent.
    pub util_pct: f64,
    /// How long all the lease's GPUs have been idle.
    pub idle_ms: i64,
    /// GPUs the pipeline saw the lease hold.
    pub gpus_total: u32,
}

/// The steps `util` calls for on `lease` under `policy`. Pure, so the rules are tested without
/// a store. `exempt` leaves idleness alone; `autoscale_ready` says the lease's current size has
/// been measured long enough to judge.
pub fn steps(
    lease: &Lease,
    policy: &WorkloadPolicy,
    util: &Utilization,
    exempt: bool,
    autoscale_ready: bool,
) -> Vec<Step> {
    let mut out = Vec::new();
    if let (Some(timeout), false) = (policy.idle_timeout, exempt) {
        let timeout = timeout.as_millis() as i64;
        if util.idle_ms > 0 {
            let run_start = util.ts_ms - util.idle_ms;
            let deadline_ms = run_start + timeout;
            if util.idle_ms >= timeout {
                out.push(Step::Idle {
                    run_start,
                    on_idle: policy.on_idle,
                    min_gpus: policy.min_gpus.unwrap_or(1).max(1),
                });
                return out;
            }
            if let Some(warn) = policy.warn_before {
                if util.idle_ms >= timeout - warn.as_millis() as i64 {
                    out.push(Step::IdleWarning {
                        run_start,
                        deadline_ms,
                    });
                }
            }
        }
    }
    if let (Workload::Inference, Some(target), true) =
        (lease.workload, policy.target_util_pct, autoscale_ready)
    {
        // A signal about another size than the lease's current one is stale for scaling.
        let off_target = (util.util_pct / target - 1.0).abs() > AUTOSCALE_TOLERANCE;
        if target > 0.0 && util.gpus_total == lease.gpu_count && off_target {
            let min = policy.min_gpus.unwrap_or(1).max(1);
            let max = policy.max_gpus.unwrap_or(lease.gpu_count).max(min);
            let wanted = (f64::from(lease.gpu_count) * util.util_pct / target).ceil() as u32;
            let wanted = wanted.clamp(min, max);
            if wanted != lease.gpu_count {
                out.push(Step::Autoscale { gpus: wanted });
            }
        }
    }
    out
}

/// An Action about `lease`, naming its workload's policy.
fn lease_action(
    kind: ActionKind,
    lease: &Lease,
    reason: &str,
    outcome: Outcome,
    detail: String,
    ts_ms: i64,
) -> Action {
    Audit::lease(kind, lease, reason)
        .under_workload_policy(lease.workload)
        .at(ts_ms, outcome, detail)
}

/// An Action about `team`, naming its budget.
fn team_action(
    kind: ActionKind,
    team: &str,
    reason: &str,
    outcome: Outcome,
    detail: String,
    ts_ms: i64,
) -> Action {
    Audit::team(kind, team, reason)
        .under_budget_of(team)
        .at(ts_ms, outcome, detail)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn human(ms: i64) -> String {
    humantime::format_duration(Duration::from_secs((ms.max(0) / 1000) as u64)).to_string()
}

fn at(ms: i64) -> String {
    humantime::format_rfc3339_seconds(
        std::time::UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64),
    )
    .to_string()
}

/// The runtime rules over one enforcer's state. Cheap to clone.
#[derive(Clone)]
pub struct Rules {
    service: Service,
    alerts: Alerts,
    principal: Principal,
    /// Lease → event time its size last changed by autoscale.
    scaled: Arc<Mutex<HashMap<String, i64>>>,
}

impl std::fmt::Debug for Rules {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rules").finish_non_exhaustive()
    }
}

impl Rules {
    /// Rules acting through `service` (its store, drivers, clock and config), alerting through
    /// `alerts`.
    pub fn new(service: Service, alerts: Alerts) -> Self {
        Self {
            service,
            alerts,
            principal: Principal {
                name: "gpuwarden-rules".into(),
                role: Role::Admin,
                teams: Vec::new(),
            },
            scaled: Arc::default(),
        }
    }

    /// The enforcer's counters.
    pub fn metrics(&self) -> &Arc<crate::metrics::Metrics> {
        self.service.metrics()
    }

    /// Alerts on a signal refused for its signature (`verdict` is `Unsigned` or `Invalid`; `detail`
    /// says where it was read) and alerts, at most once per kind of refusal every
    /// [`REFUSED_SIGNAL_ALERT_MS`] of the enforcer's time: someone writes `gpuwarden.signals`
    /// without the key, or a pipeline runs without `[signing] key`.
    pub async fn on_refused_signal(
        &self,
        verdict: Verdict,
        detail: &str,
    ) -> Result<(), ServiceError> {
        let now = self.service.now();
        let why = match verdict {
            Verdict::Unsigned => "unsigned",
            _ => "badly signed",
        };
        let action = Audit::fleet(ActionKind::Alert, "signal_refused").at(
            now,
            self.outcome(),
            format!(
                "refused a {why} signal on {} ({detail}); nothing was done on it. Someone may be \
                 writing the topic without the signing key, or a pipeline runs without \
                 [signing] key; see gpuwarden_enforcer_signals_total",
                gpuwarden_schema::topics::SIGNALS
            ),
        );
        let bucket = now.div_euclid(REFUSED_SIGNAL_ALERT_MS);
        self.alert_once(
            &format!("signal_refused:{}:{bucket}", verdict.as_str()),
            &action,
        )
        .await
    }

    /// Acts on one signal.
    pub async fn on_signal(&self, signal: &Signal) -> Result<(), ServiceError> {
        match &signal.body {
            SignalBody::LeaseUtilization {
                lease_id,
                util_pct,
                idle_ms,
                gpus_total,
                ..
            } => {
                let util = Utilization {
                    ts_ms: signal.ts_ms,
                    util_pct: *util_pct,
                    idle_ms: *idle_ms,
                    gpus_total: *gpus_total,
                };
                self.on_utilization(lease_id, &util, signal.window_ms).await
            }
            SignalBody::GpuUnattributed {
                gpu_uuid,
                host,
                util_pct,
            } => {
                let hour = signal.ts_ms.div_euclid(HOUR_MS);
                let action = Audit::fleet(ActionKind::Alert, "unattributed").at(
                    self.service.now(),
                    self.outcome(),
                    format!(
                        "GPU {gpu_uuid} on {host} is busy ({util_pct:.0} % over the window) and no lease holds it"
                    ),
                );
                self.alert_once(&format!("unattributed:{gpu_uuid}:{hour}"), &action)
                    .await
            }
            SignalBody::TeamSpend {
                team,
                month_to_date_usd,
                burn_usd_per_hour,
            } => {
                self.service
                    .record_team_spend(team, *month_to_date_usd, *burn_usd_per_hour, signal.ts_ms)
                    .await?;
                self.check_budgets().await
            }
            SignalBody::ClockSkew { host, skew_ms } => {
                let day = signal.ts_ms.div_euclid(24 * HOUR_MS);
                let direction = if *skew_ms >= 0 { "ahead of" } else { "behind" };
                let action = Audit::fleet(ActionKind::Alert, "clock_skew").at(
                    self.service.now(),
                    self.outcome(),
                    format!(
                        "the clock of host {host} runs {} {direction} gpuwarden's: its samples are quarantined, not counted, until its time is fixed (NTP); see pipeline.clock and the clock_skew table",
                        span(skew_ms.saturating_abs())
                    ),
                );
                self.alert_once(&format!("clock_skew:{host}:{day}"), &action)
                    .await
            }
        }
    }

    fn outcome(&self) -> Outcome {
        if self.service.dry_run() {
            Outcome::DryRun
        } else {
            Outcome::Ok
        }
    }

    /// Records `action` once under `key` and, when it is new and not a dry run, sends it to the
    /// webhooks.
    async fn alert_once(&self, key: &str, action: &Action) -> Result<(), ServiceError> {
        if self.service.record_once(key, action).await? && action.outcome == Outcome::Ok {
            tracing::info!(reason = %action.reason, lease_id = ?action.lease_id, team = ?action.team, detail = %action.detail, "alert");
            self.alerts.send(action);
        }
        Ok(())
    }

    async fn on_utilization(
        &self,
        lease_id: &str,
        util: &Utilization,
        window_ms: i64,
    ) -> Result<(), ServiceError> {
        let Some(lease) = self.service.stored_lease(lease_id).await? else {
            tracing::debug!(lease_id, "signal about an unknown lease; ignored");
            return Ok(());
        };
        if !matches!(lease.state, LeaseState::Granted | LeaseState::Active) {
            // Ended, or being released: nothing more to do, whatever the signal says.
            return Ok(());
        }
        // A signal dated more than pipeline.clock.max_skew ahead of the enforcer's clock (a
        // clock ahead, a forged time) is refused, neither acted on nor kept as the newest: kept,
        // it would shut out every true signal about the lease until real time caught up.
        let now = self.service.now();
        let ceiling = now.saturating_add(max_ahead_ms(self.service.config()));
        if util.ts_ms > ceiling {
            self.metrics().count_future_signal();
            tracing::warn!(
                lease_id,
                signal_ts_ms = util.ts_ms,
                now_ms = now,
                "refused a lease_utilization signal dated {} ahead of the enforcer's clock (more \
                 than pipeline.clock.max_skew); nothing was done on it",
                span(util.ts_ms - now)
            );
            return Ok(());
        }
        // Only a signal newer than every one handled for this lease, in this run or an earlier
        // one: an old idle signal replayed after a restart must not reclaim a lease busy since.
        if !self
            .service
            .note_utilization_signal(lease_id, util.ts_ms, ceiling)
            .await?
        {
            return Ok(());
        }
        self.service.note_utilization(
            lease_id,
            crate::service::LastUtilization {
                ts_ms: util.ts_ms,
                util_pct: util.util_pct,
                idle_ms: util.idle_ms,
            },
        );
        let config = self.service.config();
        let policy = config.workload(lease.workload);
        let now = self.service.now();
        let exempt = self.service.exempt_until(lease_id).is_some_and(|u| u > now);
        // Judge a size only once a whole window has measured it (and at least two signal
        // periods), so the samples of the size before, and the fleet's lag in following a
        // resize, do not count.
        let every = config.pipeline.signals.every.as_millis() as i64;
        let since = lock(&self.scaled)
            .get(lease_id)
            .copied()
            .unwrap_or(lease.granted_at)
            .max(lease.granted_at);
        let ready = util.ts_ms - since >= window_ms.max(2 * every);
        for step in steps(&lease, &policy, util, exempt, ready) {
            match step {
                Step::IdleWarning {
                    run_start,
                    deadline_ms,
                } => {
                    let what = match policy.on_idle {
                        OnIdle::Alert => "an idle alert is raised".to_string(),
                        OnIdle::Reclaim => "it is reclaimed".to_string(),
                        OnIdle::Resize => format!(
                            "it is resized to {} GPU(s)",
                            policy.min_gpus.unwrap_or(1).max(1)
                        ),
                    };
                    let action = lease_action(
                        ActionKind::Alert,
                        &lease,
                        "idle_warning",
                        self.outcome(),
                        format!(
                            "all {} GPU(s) idle for {}; at {} {what} unless it gets busy",
                            lease.gpu_count,
                            human(util.idle_ms),
                            at(deadline_ms)
                        ),
                        now,
                    );
                    self.alert_once(&format!("idle_warning:{lease_id}:{run_start}"), &action)
                        .await?;
                }
                Step::Idle {
                    run_start,
                    on_idle,
                    min_gpus,
                } => {
                    let idle_for = human(util.idle_ms);
                    match on_idle {
                        OnIdle::Alert => {
                            let action = lease_action(
                                ActionKind::Alert,
                                &lease,
                                "idle",
                                self.outcome(),
                                format!("all {} GPU(s) idle for {idle_for}", lease.gpu_count),
                                now,
                            );
                            self.alert_once(&format!("idle:{lease_id}:{run_start}"), &action)
                                .await?;
                        }
                        OnIdle::Reclaim => {
                            self.reclaim(
                                &lease,
                                ReleaseReason::Idle,
                                &format!("idle for {idle_for}"),
                            )
                            .await?;
                        }
                        OnIdle::Resize if lease.gpu_count > min_gpus => {
                            self.resize(&lease, min_gpus, "idle", &format!("idle for {idle_for}"))
                                .await?;
                        }
                        OnIdle::Resize => {
                            let action = lease_action(
                                ActionKind::Alert,
                                &lease,
                                "idle",
                                self.outcome(),
                                format!("idle for {idle_for} at its minimum of {min_gpus} GPU(s)"),
                                now,
                            );
                            self.alert_once(&format!("idle:{lease_id}:{run_start}"), &action)
                                .await?;
                        }
                    }
                }
                Step::Autoscale { gpus } => {
                    let detail = format!(
                        "utilization {:.0} % on {} GPU(s), target {:.0} %",
                        util.util_pct,
                        lease.gpu_count,
                        policy.target_util_pct.unwrap_or_default()
                    );
                    if self.resize(&lease, gpus, "autoscale", &detail).await? {
                        lock(&self.scaled).insert(lease_id.to_owned(), util.ts_ms);
                    }
                }
            }
        }
        Ok(())
    }

    /// Resizes `lease` to `gpus` through the policy and its driver; true when it changed. A
    /// refusal (no quota, no capacity) or a substrate failure is recorded once per lease size
    /// and target.
    async fn resize(
        &self,
        lease: &Lease,
        gpus: u32,
        reason: &str,
        detail: &str,
    ) -> Result<bool, ServiceError> {
        let now = self.service.now();
        let key = format!(
            "{reason}:{}:{}:{}→{gpus}",
            lease.id, lease.updated_at, lease.gpu_count
        );
        if self.service.dry_run() {
            let action = lease_action(
                ActionKind::Resize,
                lease,
                reason,
                Outcome::DryRun,
                format!("{detail}: would resize {} → {gpus} GPUs", lease.gpu_count),
                now,
            );
            self.service
                .record_once(&format!("dry_run:{key}"), &action)
                .await?;
            return Ok(false);
        }
        match self
            .service
            .resize_for(&self.principal, &lease.id, gpus, reason, detail)
            .await
        {
            Ok(answer) if answer.lease.as_ref().is_some_and(|l| l.gpu_count == gpus) => {
                tracing::info!(lease_id = %lease.id, from = lease.gpu_count, to = gpus, reason, "lease resized");
                Ok(true)
            }
            Ok(answer) => {
                let why: Vec<String> = answer
                    .decision
                    .reasons
                    .iter()
                    .map(|r| r.message.clone())
                    .collect();
                let action = lease_action(
                    ActionKind::Alert,
                    lease,
                    &format!("{reason}_refused"),
                    Outcome::Ok,
                    format!(
                        "{detail}: cannot resize {} → {gpus} GPUs: {}",
                        lease.gpu_count,
                        why.join("; ")
                    ),
                    now,
                );
                self.alert_once(&format!("refused:{key}"), &action).await?;
                Ok(false)
            }
            Err(ServiceError::Substrate(e)) => {
                // The store put the lease back and recorded the failed resize.
                tracing::warn!(lease_id = %lease.id, error = %e, "resize failed on the substrate");
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Reclaims `lease` for `reason`, retrying the substrate with backoff; after
    /// [`RECLAIM_ATTEMPTS`] the lease is marked failed and an alert raised.
    pub async fn reclaim(
        &self,
        lease: &Lease,
        reason: ReleaseReason,
        detail: &str,
    ) -> Result<(), ServiceError> {
        if self.service.dry_run() {
            let action = lease_action(
                ActionKind::Reclaim,
                lease,
                reason.as_str(),
                Outcome::DryRun,
                format!("{detail}; would reclaim {} GPU(s)", lease.gpu_count),
                self.service.now(),
            );
            self.service
                .record_once(&format!("dry_run:reclaim:{}", lease.id), &action)
                .await?;
            return Ok(());
        }
        let mut last = String::new();
        let mut backoff = Backoff::doubling(RECLAIM_BACKOFF);
        for attempt in 0..RECLAIM_ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(backoff.next_pause()).await;
            }
            match self.service.release_for(&lease.id, reason, detail).await {
                Ok(_) => {
                    tracing::info!(lease_id = %lease.id, team = %lease.team, reason = reason.as_str(), detail, "lease reclaimed");
                    return Ok(());
                }
                Err(ServiceError::Substrate(e)) => {
                    tracing::warn!(lease_id = %lease.id, attempt = attempt + 1, error = %e, "reclaim not confirmed by the substrate");
                    last = e;
                }
                // Ended meanwhile (released by its holder, or by another step): nothing to do.
                Err(ServiceError::Conflict(_)) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        let now = self.service.now();
        let why = format!(
            "the substrate did not confirm the reclaim ({}) after {RECLAIM_ATTEMPTS} attempts: {last}",
            reason.as_str()
        );
        self.service.fail(&lease.id, &why).await?;
        let action = lease_action(
            ActionKind::Alert,
            lease,
            "reclaim_failed",
            Outcome::Ok,
            why,
            now,
        );
        self.alert_once(&format!("reclaim_failed:{}", lease.id), &action)
            .await
    }

    /// Blocks each team whose month-to-date spend has passed its budget, and unblocks each
    /// blocked team that fits again. Called on every `team_spend` signal and periodically (a
    /// new month unblocks without a signal).
    pub async fn check_budgets(&self) -> Result<(), ServiceError> {
        let config = self.service.config().clone();
        let now = self.service.now();
        let ledger = self.service.ledger(now)?;
        let (year, month) = month_of(now);
        for team in &config.teams {
            let spend = ledger.spend_usd.get(&team.name).copied().unwrap_or(0.0);
            let over = spend > team.monthly_budget_usd;
            let blocked = ledger.blocked.contains(&team.name);
            let detail = format!(
                "month-to-date spend {spend:.2} of a {:.2} budget",
                team.monthly_budget_usd
            );
            if over && !blocked {
                let month_key = format!("{}:{year}-{month:02}", team.name);
                if self.service.dry_run() {
                    let action = team_action(
                        ActionKind::Block,
                        &team.name,
                        "budget_exceeded",
                        Outcome::DryRun,
                        detail,
                        now,
                    );
                    self.service
                        .record_once(&format!("dry_run:block:{month_key}"), &action)
                        .await?;
                    continue;
                }
                self.service
                    .block_team(&team.name, "budget_exceeded")
                    .await?;
                tracing::warn!(team = %team.name, spend, budget = team.monthly_budget_usd, "team over budget; blocked");
                let action = team_action(
                    ActionKind::Alert,
                    &team.name,
                    "budget_exceeded",
                    Outcome::Ok,
                    format!("{detail}; new admissions are blocked"),
                    now,
                );
                self.alert_once(&format!("budget:{month_key}:{now}"), &action)
                    .await?;
            } else if !over && blocked && !self.service.dry_run() {
                self.service.unblock_team(&team.name).await?;
                tracing::info!(team = %team.name, spend, budget = team.monthly_budget_usd, "team within budget again; unblocked");
            }
        }
        Ok(())
    }
}
