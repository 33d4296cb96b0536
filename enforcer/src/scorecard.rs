//! The maturity scorecard: the eight capabilities of the GPU infrastructure maturity model, each
//! scored 1 to 5 from evidence in the running system, with the evidence behind the score and
//! what would raise it.
//!
//! [`assess`] is the one function that scores: pure, a function of the config and the
//! [`Evidence`] read from the lake (what happened in the 30 days up to the lake's watermark: the
//! enforcer's audit trail as published, the lease events, the signals, the rollups). `gpuwarden
//! assess` and the portal's scorecard page both gather the evidence the same way (the binary's
//! `src/cmd/assess.rs`) and call it, so they print the same scores. The README's "Maturity
//! scorecard" section states each rule; a rule changed here is changed there.
//!
//! Each capability climbs a ladder: a level counts only when every level below it holds, so a
//! score says the weakest step that is missing.

use std::collections::{BTreeMap, BTreeSet};

use gpuwarden_schema::config::{Config, EnforcerMode, OnIdle, Role};
use gpuwarden_schema::Workload;
use serde::Serialize;

/// How far back the evidence looks, from the lake's watermark.
pub const WINDOW_DAYS: i64 = 30;

/// What the lake says happened in the [`WINDOW_DAYS`] up to its watermark.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Evidence {
    /// The lake's watermark (the latest sample or lease event), Unix epoch milliseconds; none
    /// for an empty lake.
    pub as_of_ms: Option<i64>,
    /// Leases held in the window: granted (lease events `granted`) before its end and not
    /// released before its start.
    pub leases_granted: u64,
    /// Of those, leases placed on named GPUs (their `gpu_uuids` listed).
    pub leases_on_named_gpus: u64,
    /// Substrate names that held leases.
    pub substrates_with_leases: BTreeSet<String>,
    /// GPU models leased.
    pub gpu_models_leased: BTreeSet<String>,
    /// Users who held leases.
    pub users_with_leases: BTreeSet<String>,
    /// Teams that held leases.
    pub teams_with_leases: BTreeSet<String>,
    /// Actions with outcome `ok`, by `action:reason` (`reclaim:idle`, `deny:quota_exceeded`).
    pub actions: BTreeMap<String, u64>,
    /// Signals by kind (`lease_utilization`, `team_spend`).
    pub signals: BTreeMap<String, u64>,
    /// Cost of the GPU-hours in the window (`team_hourly`).
    pub cost_usd: f64,
    /// Of which idle.
    pub idle_cost_usd: f64,
}

impl Evidence {
    /// Actions of `kind` (`reclaim`), any reason.
    pub fn actions_of(&self, kind: &str) -> u64 {
        self.actions
            .iter()
            .filter(|(k, _)| k.split(':').next() == Some(kind))
            .map(|(_, n)| n)
            .sum()
    }

    /// Actions `kind:reason`.
    pub fn action(&self, kind: &str, reason: &str) -> u64 {
        self.actions
            .get(&format!("{kind}:{reason}"))
            .copied()
            .unwrap_or(0)
    }

    fn signals_of(&self, kind: &str) -> u64 {
        self.signals.get(kind).copied().unwrap_or(0)
    }
}

/// One capability of the maturity model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Capability {
    /// Placing work on GPUs by model and device.
    GpuAwareProvisioning,
    /// Sizing leases by what they use.
    WorkloadDrivenScaling,
    /// Quotas, budgets and who may ask.
    QuotaAndAccessGovernance,
    /// Acting on running leases (idle reclaim, maximum duration).
    RuntimePolicyEnforcement,
    /// Pricing every GPU-hour and cutting waste.
    CostVisibilityAndOptimization,
    /// People asking for GPUs themselves.
    SelfServiceEnvironments,
    /// More than one kind of substrate under one policy.
    MultiSubstrateOrchestration,
    /// Other systems reading and driving gpuwarden.
    IntegrationExtensibility,
}

impl Capability {
    /// Every capability, in the model's order.
    pub const ALL: [Capability; 8] = [
        Self::GpuAwareProvisioning,
        Self::WorkloadDrivenScaling,
        Self::QuotaAndAccessGovernance,
        Self::RuntimePolicyEnforcement,
        Self::CostVisibilityAndOptimization,
        Self::SelfServiceEnvironments,
        Self::MultiSubstrateOrchestration,
        Self::IntegrationExtensibility,
    ];

    /// Its name for people.
    pub fn title(self) -> &'static str {
        match self {
            Self::GpuAwareProvisioning => "GPU-aware provisioning",
            Self::WorkloadDrivenScaling => "Workload-driven scaling",
            Self::QuotaAndAccessGovernance => "Quota and access governance",
            Self::RuntimePolicyEnforcement => "Runtime policy enforcement",
            Self::CostVisibilityAndOptimization => "Cost visibility and optimization",
            Self::SelfServiceEnvironments => "Self-service environments",
            Self::MultiSubstrateOrchestration => "Multi-substrate orchestration",
            Self::IntegrationExtensibility => "Integration extensibility",
        }
    }
}

/// The average's band.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Band {
    /// Below 3.
    Reactive,
    /// 3 to below 4.
    Transitional,
    /// 4 to below 5.
    Advanced,
    /// 5.
    Optimized,
}

impl Band {
    /// The band of an average score: 1–2 (below 3) reactive, 3 transitional, 4 advanced, 5
    /// optimized, each from its whole number up.
    pub fn of(average: f64) -> Self {
        match average {
            a if a >= 5.0 => Self::Optimized,
            a if a >= 4.0 => Self::Advanced,
            a if a >= 3.0 => Self::Transitional,
            _ => Self::Reactive,
        }
    }

    /// Its name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reactive => "reactive",
            Self::Transitional => "transitional",
            Self::Advanced => "advanced",
            Self::Optimized => "optimized",
        }
    }
}

/// One capability's score.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Score {
    /// The capability.
    pub capability: Capability,
    /// Its title.
    pub title: &'static str,
    /// 1 to 5.
    pub score: u8,
    /// What was found, one line per fact.
    pub evidence: Vec<String>,
    /// What would raise the score by one; none at 5.
    pub next: Option<String>,
}

/// The eight scores, their average and its band.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Scorecard {
    /// The window's end (the lake's watermark), if the lake has data.
    pub as_of_ms: Option<i64>,
    /// One per capability, in the model's order.
    pub scores: Vec<Score>,
    /// Their mean, to two decimals.
    pub average: f64,
    /// The mean's band.
    pub band: Band,
}

/// A ladder being climbed: each `step` that holds raises the score by one from 1, until the
/// first that does not, which becomes `next`.
struct Ladder {
    score: u8,
    evidence: Vec<String>,
    next: Option<String>,
}

impl Ladder {
    fn new() -> Self {
        Self {
            score: 1,
            evidence: Vec::new(),
            next: None,
        }
    }

    /// Level `score + 1` holds when `holds`; `seen` is the evidence line either way, `raise`
    /// what would make it hold.
    fn step(&mut self, holds: bool, seen: String, raise: &str) {
        if self.next.is_some() {
            return;
        }
        self.evidence.push(seen);
        if holds {
            self.score += 1;
        } else {
            self.next = Some(raise.to_owned());
        }
    }

    fn done(self, capability: Capability) -> Score {
        Score {
            capability,
            title: capability.title(),
            score: self.score.min(5),
            evidence: self.evidence,
            next: self.next,
        }
    }
}

fn plural(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// Scores the eight capabilities from `config` and `evidence`. Pure.
pub fn assess(config: &Config, evidence: &Evidence) -> Scorecard {
    let scores: Vec<Score> = Capability::ALL
        .iter()
        .map(|&c| score(c, config, evidence))
        .collect();
    let average = scores.iter().map(|s| f64::from(s.score)).sum::<f64>() / scores.len() as f64;
    let average = (average * 100.0).round() / 100.0;
    Scorecard {
        as_of_ms: evidence.as_of_ms,
        band: Band::of(average),
        average,
        scores,
    }
}

fn score(capability: Capability, config: &Config, e: &Evidence) -> Score {
    let mut l = Ladder::new();
    let days = WINDOW_DAYS;
    // The workloads the config defines: a kind it leaves out has no policy of its own to score
    // (the portal does not offer it, and admission denies it: `workload_not_offered`).
    let policies: Vec<(Workload, _)> = config
        .workloads
        .iter()
        .map(|(&w, p)| (w, p.clone()))
        .collect();
    match capability {
        Capability::GpuAwareProvisioning => {
            l.step(
                !config.substrates.is_empty(),
                plural(config.substrates.len() as u64, "substrate", "substrates") + " configured",
                "configure a [[substrates]] entry so that admission places leases on GPUs",
            );
            l.step(
                e.leases_granted > 0,
                format!(
                    "{} granted through admission and held in the last {days} days",
                    plural(e.leases_granted, "lease", "leases")
                ),
                "ask for GPUs through the admission API (or a substrate's hook) so that leases are granted",
            );
            l.step(
                e.leases_on_named_gpus > 0,
                format!(
                    "{} of them placed on named GPUs (devices chosen by placement)",
                    e.leases_on_named_gpus
                ),
                "use a substrate whose inventory names its GPUs (simulated, local, kubernetes) so placement picks devices",
            );
            let unpriced: Vec<&String> = e
                .gpu_models_leased
                .iter()
                .filter(|m| {
                    !config.pricing.gpu.iter().any(|p| {
                        gpuwarden_schema::config::contains_ignoring_case(m, &p.model_match)
                    })
                })
                .collect();
            l.step(
                e.gpu_models_leased.len() >= 2 && unpriced.is_empty(),
                format!(
                    "{} leased, {} without a [[pricing.gpu]] price",
                    plural(e.gpu_models_leased.len() as u64, "GPU model", "GPU models"),
                    unpriced.len()
                ),
                "lease more than one GPU model, each with its own [[pricing.gpu]] price",
            );
        }
        Capability::WorkloadDrivenScaling => {
            let measured = e.signals_of("lease_utilization");
            l.step(
                measured > 0,
                format!(
                    "{} lease_utilization signals in the last {days} days",
                    measured
                ),
                "run the pipeline's signals ([pipeline.signals]) so each lease's utilization is measured",
            );
            let scaling: Vec<&str> = policies
                .iter()
                .filter(|(w, p)| {
                    (p.on_idle == OnIdle::Resize && p.idle_timeout.is_some())
                        || (*w == Workload::Inference && p.target_util_pct.is_some())
                })
                .map(|(w, _)| w.as_str())
                .collect();
            l.step(
                !scaling.is_empty(),
                format!(
                    "workloads that resize by use: {}",
                    if scaling.is_empty() {
                        "none".to_owned()
                    } else {
                        scaling.join(", ")
                    }
                ),
                "set [workloads.inference] target_util_pct, or on_idle = \"resize\" with an idle_timeout on a workload",
            );
            let resized = e.action("resize", "autoscale") + e.action("resize", "idle");
            l.step(
                resized > 0,
                format!(
                    "{} by autoscale or idleness in the last {days} days",
                    plural(resized, "resize", "resizes")
                ),
                "let the rules resize leases (enforcer.mode = \"enforce\" and leases of a scaling workload)",
            );
            let queueing = config.substrates.iter().any(|s| {
                s.kubernetes.as_ref().is_some_and(|k| k.kueue.is_some()) || s.slurm.is_some()
            });
            l.step(
                queueing,
                format!(
                    "a substrate that queues work (Slurm, or Kubernetes with Kueue): {}",
                    if queueing { "yes" } else { "no" }
                ),
                "add a substrate that queues work rather than refusing it (Slurm, or Kubernetes with [substrates.kubernetes.kueue])",
            );
        }
        Capability::QuotaAndAccessGovernance => {
            l.step(
                !config.teams.is_empty(),
                format!(
                    "{} with GPU quotas and monthly budgets",
                    plural(config.teams.len() as u64, "team", "teams")
                ),
                "configure [[teams]] with gpu_quota and monthly_budget_usd",
            );
            let personal = config
                .tokens
                .iter()
                .filter(|t| matches!(t.role, Role::Member | Role::Viewer))
                .count() as u64;
            l.step(
                personal > 0,
                format!(
                    "{} held by people (member or viewer), of {} in all",
                    plural(personal, "token", "tokens"),
                    config.tokens.len()
                ),
                "give people tokens of their own ([[tokens]] with role = \"member\") instead of sharing an admin's",
            );
            let listed = config.teams.iter().all(|t| !t.members.is_empty());
            let uncapped: Vec<&str> = policies
                .iter()
                .filter(|(_, p)| p.max_gpus.is_none())
                .map(|(w, _)| w.as_str())
                .collect();
            let capped = !policies.is_empty() && uncapped.is_empty();
            l.step(
                listed && capped,
                format!(
                    "every team lists its members: {}; every workload defined caps GPUs per lease: {}",
                    yes(listed),
                    if policies.is_empty() {
                        "no [workloads.*] defined".to_owned()
                    } else if capped {
                        format!(
                            "yes ({})",
                            policies
                                .iter()
                                .map(|(w, _)| w.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        )
                    } else {
                        format!("no ({} without max_gpus)", uncapped.join(", "))
                    }
                ),
                "list each team's members and set max_gpus on every [workloads.*] the config defines",
            );
            let denied = e.actions_of("deny");
            l.step(
                denied > 0,
                format!(
                    "{} refused by policy in the last {days} days",
                    plural(denied, "request", "requests")
                ),
                "the limits have not refused anything in the window: check that they are tight enough to matter",
            );
        }
        Capability::RuntimePolicyEnforcement => {
            let max_duration = policies.iter().any(|(_, p)| p.max_duration.is_some());
            l.step(
                max_duration,
                format!("a workload with max_duration: {}", yes(max_duration)),
                "set max_duration on a [workloads.*] so leases end",
            );
            let idle_timeout = policies.iter().any(|(_, p)| p.idle_timeout.is_some());
            l.step(
                idle_timeout,
                format!("a workload with idle_timeout: {}", yes(idle_timeout)),
                "set idle_timeout on a [workloads.*] so idle leases are noticed",
            );
            let reclaiming = policies
                .iter()
                .any(|(_, p)| p.idle_timeout.is_some() && p.on_idle == OnIdle::Reclaim);
            let enforcing = config.enforcer.mode == EnforcerMode::Enforce;
            l.step(
                reclaiming && enforcing,
                format!(
                    "idle reclaim configured (on_idle = \"reclaim\"): {}; enforcer.mode = \"{}\"",
                    yes(reclaiming),
                    if enforcing { "enforce" } else { "dry_run" }
                ),
                "set on_idle = \"reclaim\" with idle_timeout, and enforcer.mode = \"enforce\"",
            );
            let reclaims = e.action("reclaim", "idle") + e.action("reclaim", "expired");
            l.step(
                reclaims > 0,
                format!(
                    "{} ({} idle, {} expired) in the last {days} days",
                    plural(reclaims, "reclaim", "reclaims"),
                    e.action("reclaim", "idle"),
                    e.action("reclaim", "expired")
                ),
                "no lease was reclaimed in the window: the rules are configured but have not acted (are signals reaching the enforcer?)",
            );
        }
        Capability::CostVisibilityAndOptimization => {
            l.step(
                e.cost_usd > 0.0,
                format!(
                    "{} of GPU-hours priced in the last {days} days",
                    usd(e.cost_usd)
                ),
                "run the pipeline's rollups over the collector's samples so GPU-hours are priced",
            );
            let spend = e.signals_of("team_spend");
            l.step(
                !config.pricing.gpu.is_empty() && spend > 0,
                format!(
                    "{} per model; {} team_spend signals (budgets checked against spend)",
                    plural(config.pricing.gpu.len() as u64, "price", "prices"),
                    spend
                ),
                "price each GPU model ([[pricing.gpu]]) and run the signals so the enforcer checks budgets against spend",
            );
            let alerting = !config.enforcer.alert_webhooks.is_empty();
            l.step(
                alerting,
                format!(
                    "{} for budget and idle alerts",
                    plural(
                        config.enforcer.alert_webhooks.len() as u64,
                        "alert webhook",
                        "alert webhooks"
                    )
                ),
                "set enforcer.alert_webhooks so budget blocks and idle warnings reach people",
            );
            let share = if e.cost_usd > 0.0 {
                100.0 * e.idle_cost_usd / e.cost_usd
            } else {
                100.0
            };
            l.step(
                share < 10.0,
                format!(
                    "idle cost {} of {} ({share:.1} %)",
                    usd(e.idle_cost_usd),
                    usd(e.cost_usd)
                ),
                "bring idle cost under 10 % of cost (idle reclaim, right-sizing: queries/idle_waste_by_lease.sql)",
            );
        }
        Capability::SelfServiceEnvironments => {
            let asking = config
                .tokens
                .iter()
                .filter(|t| matches!(t.role, Role::Member | Role::Service))
                .count() as u64;
            l.step(
                !config.tokens.is_empty(),
                format!(
                    "{} for the API and the portal",
                    plural(config.tokens.len() as u64, "token", "tokens")
                ),
                "configure [[tokens]] so the API and the portal (/ui/) can be used",
            );
            l.step(
                asking > 0,
                format!(
                    "{} that ask for GPUs (member or service)",
                    plural(asking, "token", "tokens")
                ),
                "give people (role = \"member\") or a front-end (role = \"service\") a token so they ask for GPUs themselves",
            );
            let users = e.users_with_leases.len() as u64;
            l.step(
                users >= 2,
                format!(
                    "{} held leases in the last {days} days",
                    plural(users, "user", "users")
                ),
                "have at least two people hold leases through self-service",
            );
            let idle_teams: Vec<&str> = config
                .teams
                .iter()
                .filter(|t| !e.teams_with_leases.contains(&t.name))
                .map(|t| t.name.as_str())
                .collect();
            l.step(
                !config.teams.is_empty() && idle_teams.is_empty(),
                format!(
                    "teams without a lease in the last {days} days: {}",
                    if idle_teams.is_empty() {
                        "none".to_owned()
                    } else {
                        idle_teams.join(", ")
                    }
                ),
                "every team holds leases through self-service (or drop teams that no longer use GPUs)",
            );
        }
        Capability::MultiSubstrateOrchestration => {
            let mut kinds: BTreeSet<&str> = BTreeSet::new();
            for name in &e.substrates_with_leases {
                if let Some(s) = config.substrate(name) {
                    kinds.insert(s.driver.as_str());
                }
            }
            let listed = if kinds.is_empty() {
                "none".to_owned()
            } else {
                kinds.iter().copied().collect::<Vec<_>>().join(", ")
            };
            for n in 1..=4 {
                l.step(
                    kinds.len() >= n,
                    format!("substrate kinds that held leases in the last {days} days: {listed}"),
                    match n {
                        1 => "grant a lease on a substrate",
                        _ => "hold leases on one more kind of substrate (local, slurm, kubernetes, libvirt, webhook) under the same policy",
                    },
                );
            }
            l.evidence.dedup();
        }
        Capability::IntegrationExtensibility => {
            let integrations = integrations(config);
            // Only what is not configured yet is worth suggesting.
            let missing: Vec<&str> = INTEGRATIONS
                .iter()
                .filter(|(_, _, on)| !on(config))
                .map(|(_, add, _)| *add)
                .collect();
            let raise = format!("add one more integration: {}", or_list(&missing));
            for n in 1..=4 {
                l.step(
                    integrations.len() >= n,
                    format!(
                        "integrations configured: {}",
                        if integrations.is_empty() {
                            "none".to_owned()
                        } else {
                            integrations.join(", ")
                        }
                    ),
                    &raise,
                );
            }
            l.evidence.dedup();
        }
    }
    l.done(capability)
}

/// An integration: its name once configured, what to add to configure it, and whether a config
/// does.
type Integration = (&'static str, &'static str, fn(&Config) -> bool);

/// The integrations other systems use to read or drive gpuwarden.
const INTEGRATIONS: [Integration; 6] = [
    (
        "Kafka topics on shared brokers",
        "external Kafka brokers",
        |c| c.kafka.brokers != "embedded",
    ),
    (
        "SQL endpoint users",
        "SQL users for the SQL endpoint",
        |c| !c.pipeline.sql_users.is_empty() || c.pipeline.sql_allow_anonymous,
    ),
    ("alert webhooks", "alert webhooks", |c| {
        !c.enforcer.alert_webhooks.is_empty()
    }),
    ("webhook substrate", "a webhook substrate", |c| {
        has_driver(c, "webhook")
    }),
    ("Slurm submit hook", "a Slurm submit hook", |c| {
        has_driver(c, "slurm")
    }),
    (
        "Kubernetes admission webhook",
        "a Kubernetes admission webhook",
        |c| has_driver(c, "kubernetes"),
    ),
];

fn has_driver(config: &Config, kind: &str) -> bool {
    config.substrates.iter().any(|s| s.driver.as_str() == kind)
}

/// The integrations `config` sets up.
fn integrations(config: &Config) -> Vec<&'static str> {
    INTEGRATIONS
        .iter()
        .filter(|(_, _, on)| on(config))
        .map(|(name, _, _)| *name)
        .collect()
}

/// `a, b or c`.
fn or_list(items: &[&str]) -> String {
    match items {
        [] => String::new(),
        [one] => (*one).to_owned(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    }
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

fn usd(x: f64) -> String {
    format!("${x:.2}")
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use gpuwarden_schema::config::{DriverKind, GpuPrice, TeamConfig, TokenConfig, WorkloadPolicy};

    use super::*;

    /// [`config`] with a token of a person, ada, a member of team ml.
    fn config_with_member_token() -> Config {
        let mut config = config();
        config.tokens.push(TokenConfig {
            name: "ada".into(),
            sha256: "0".repeat(64),
            role: Role::Member,
            teams: vec!["ml".into()],
        });
        config
    }

    fn config() -> Config {
        let mut config = Config::default();
        config.teams.push(TeamConfig {
            name: "ml".into(),
            members: vec!["ada".into()],
            gpu_quota: 8,
            monthly_budget_usd: 100.0,
            allowed_models: Vec::new(),
        });
        config
    }

    fn of(card: &Scorecard, c: Capability) -> &Score {
        card.scores.iter().find(|s| s.capability == c).unwrap()
    }

    #[test]
    fn an_empty_system_scores_ones_and_twos_and_says_what_is_next() {
        let card = assess(&Config::default(), &Evidence::default());
        assert_eq!(card.scores.len(), 8);
        assert!(card.scores.iter().all(|s| s.score == 1 && s.next.is_some()));
        assert_eq!(card.band, Band::Reactive);
        assert_eq!(card.average, 1.0);
    }

    #[test]
    fn runtime_enforcement_reaches_five_only_with_reclaims_in_the_window() {
        let mut config = config();
        config.workloads.insert(
            Workload::Notebook,
            WorkloadPolicy {
                max_duration: Some(Duration::from_secs(3600)),
                idle_timeout: Some(Duration::from_secs(600)),
                on_idle: OnIdle::Reclaim,
                ..WorkloadPolicy::default()
            },
        );
        let mut e = Evidence::default();
        let card = assess(&config, &e);
        let s = of(&card, Capability::RuntimePolicyEnforcement);
        assert_eq!(s.score, 4, "{s:?}");
        assert!(s.next.as_deref().unwrap().contains("reclaimed"));
        e.actions.insert("reclaim:idle".into(), 3);
        let card = assess(&config, &e);
        let s = of(&card, Capability::RuntimePolicyEnforcement);
        assert_eq!(s.score, 5);
        assert_eq!(s.next, None);
        assert!(s
            .evidence
            .last()
            .unwrap()
            .contains("3 reclaims (3 idle, 0 expired)"));
        // Alerting instead of reclaiming stops at 3, whatever happened.
        config
            .workloads
            .get_mut(&Workload::Notebook)
            .unwrap()
            .on_idle = OnIdle::Alert;
        assert_eq!(
            of(&assess(&config, &e), Capability::RuntimePolicyEnforcement).score,
            3
        );
    }

    #[test]
    fn multi_substrate_counts_kinds_that_held_leases_not_names() {
        let mut config = config();
        for (name, driver) in [
            ("a", DriverKind::Simulated),
            ("b", DriverKind::Simulated),
            ("c", DriverKind::Webhook),
        ] {
            let text = format!("name = \"{name}\"\ndriver = \"{}\"", driver.as_str());
            config.substrates.push(toml_substrate(&text));
        }
        let mut e = Evidence {
            substrates_with_leases: ["a".into(), "b".into()].into(),
            ..Evidence::default()
        };
        assert_eq!(
            of(
                &assess(&config, &e),
                Capability::MultiSubstrateOrchestration
            )
            .score,
            2
        );
        e.substrates_with_leases.insert("c".into());
        // A name no longer configured is not counted.
        e.substrates_with_leases.insert("gone".into());
        let card = assess(&config, &e);
        let s = of(&card, Capability::MultiSubstrateOrchestration);
        assert_eq!(s.score, 3);
        assert_eq!(
            s.evidence,
            ["substrate kinds that held leases in the last 30 days: simulated, webhook"]
        );
    }

    fn toml_substrate(text: &str) -> gpuwarden_schema::config::SubstrateConfig {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn cost_needs_a_low_idle_share_for_five_and_the_average_has_its_band() {
        let mut config = config();
        config.pricing.gpu.push(GpuPrice {
            model_match: "H100".into(),
            usd_per_gpu_hour: 4.0,
        });
        config
            .enforcer
            .alert_webhooks
            .push("http://127.0.0.1:1/hook".into());
        let mut e = Evidence {
            cost_usd: 1000.0,
            idle_cost_usd: 150.0,
            ..Evidence::default()
        };
        e.signals.insert("team_spend".into(), 4);
        let s = of(
            &assess(&config, &e),
            Capability::CostVisibilityAndOptimization,
        )
        .clone();
        assert_eq!(s.score, 4);
        assert!(s.evidence.last().unwrap().contains("(15.0 %)"), "{s:?}");
        e.idle_cost_usd = 99.0;
        assert_eq!(
            of(
                &assess(&config, &e),
                Capability::CostVisibilityAndOptimization
            )
            .score,
            5
        );
        assert_eq!(Band::of(2.99), Band::Reactive);
        assert_eq!(Band::of(3.0), Band::Transitional);
        assert_eq!(Band::of(4.5), Band::Advanced);
        assert_eq!(Band::of(5.0), Band::Optimized);
    }

    #[test]
    fn governance_counts_only_the_workloads_the_config_defines() {
        let mut config = config_with_member_token();
        // No [workloads.*] at all: nothing caps a lease.
        let s = of(
            &assess(&config, &Evidence::default()),
            Capability::QuotaAndAccessGovernance,
        )
        .clone();
        assert_eq!(s.score, 3, "{s:?}");
        assert!(s.evidence[2].contains("no [workloads.*] defined"), "{s:?}");
        // Training and inference defined, both capped: the kinds left out do not count.
        for w in [Workload::Training, Workload::Inference] {
            config.workloads.insert(
                w,
                WorkloadPolicy {
                    max_gpus: Some(8),
                    ..WorkloadPolicy::default()
                },
            );
        }
        let s = of(
            &assess(&config, &Evidence::default()),
            Capability::QuotaAndAccessGovernance,
        )
        .clone();
        assert_eq!(s.score, 4, "{s:?}");
        assert!(
            s.evidence[2].ends_with("caps GPUs per lease: yes (training, inference)"),
            "{s:?}"
        );
        // A defined one without a cap is named.
        config
            .workloads
            .insert(Workload::Notebook, WorkloadPolicy::default());
        let s = of(
            &assess(&config, &Evidence::default()),
            Capability::QuotaAndAccessGovernance,
        )
        .clone();
        assert_eq!(s.score, 3);
        assert!(
            s.evidence[2].ends_with("no (notebook without max_gpus)"),
            "{s:?}"
        );
    }

    #[test]
    fn integration_advice_names_only_what_is_not_configured() {
        let mut config = config();
        config.pipeline.sql_allow_anonymous = true;
        config
            .enforcer
            .alert_webhooks
            .push("http://127.0.0.1:1/hook".into());
        let card = assess(&config, &Evidence::default());
        let s = of(&card, Capability::IntegrationExtensibility);
        assert_eq!(s.score, 3);
        assert_eq!(
            s.evidence,
            ["integrations configured: SQL endpoint users, alert webhooks"]
        );
        let next = s.next.as_deref().unwrap();
        assert_eq!(
            next,
            "add one more integration: external Kafka brokers, a webhook substrate, a Slurm \
             submit hook or a Kubernetes admission webhook"
        );
        assert!(!next.contains("SQL") && !next.contains("alert"), "{next}");
    }

    #[test]
    fn self_service_and_governance_read_tokens_and_who_held_leases() {
        let config = config_with_member_token();
        let e = Evidence {
            users_with_leases: ["ada".into(), "bob".into()].into(),
            teams_with_leases: ["ml".into()].into(),
            ..Evidence::default()
        };
        let card = assess(&config, &e);
        assert_eq!(of(&card, Capability::SelfServiceEnvironments).score, 5);
        // Workloads without max_gpus stop governance at 3.
        assert_eq!(of(&card, Capability::QuotaAndAccessGovernance).score, 3);
    }
}
