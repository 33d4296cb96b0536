//! A decision's reasons in words a person understands, each with what would make the request
//! pass: built from each reason's stable [`ReasonCode`] and the figures behind it (the team's
//! quota, holdings, spend and budget, the workload's limits, the estimate), never by reading the
//! policy's message text, which stays the API's and may change.

use std::time::Duration;

use gpuwarden_schema::config::Config;

use super::html::usd;
use crate::policy::{AdmissionRequest, Decision, Reason, ReasonCode};
use crate::service::Team;

/// One reason, explained.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Explained {
    /// The reason's code.
    pub(crate) code: ReasonCode,
    /// What stands in the way.
    pub(crate) problem: String,
    /// What would make it pass.
    pub(crate) fix: String,
}

/// What the explanations read besides the decision.
pub(crate) struct Context<'a> {
    pub(crate) config: &'a Config,
    pub(crate) request: &'a AdmissionRequest,
    /// The team as admission saw it (after the decision, for a dry run the same).
    pub(crate) team: Option<&'a Team>,
    /// Teams the person may ask for.
    pub(crate) teams: &'a [String],
}

fn hours(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// Every reason of `decision`, explained.
pub(crate) fn explain(decision: &Decision, ctx: &Context<'_>) -> Vec<Explained> {
    decision
        .reasons
        .iter()
        .map(|r| explain_one(r, decision, ctx))
        .collect()
}

fn explain_one(reason: &Reason, decision: &Decision, ctx: &Context<'_>) -> Explained {
    let req = ctx.request;
    let policy = ctx.config.workload(req.workload);
    let team_name = &req.team;
    let (problem, fix) = match reason.code {
        ReasonCode::NotMember => (
            format!("You cannot ask for GPUs for team {team_name} as {}.", req.user),
            if ctx.teams.is_empty() {
                "Ask an admin to add you to a team.".to_owned()
            } else {
                format!(
                    "Choose one of your teams ({}), or ask an admin to add you to {team_name}.",
                    ctx.teams.join(", ")
                )
            },
        ),
        ReasonCode::WorkloadLimit => match policy.max_gpus.filter(|&m| req.gpus > m) {
            Some(max) => (
                format!(
                    "A {} lease may hold at most {max} GPUs; you asked for {}.",
                    req.workload, req.gpus
                ),
                format!(
                    "Ask for {max} GPUs or fewer, or split the work into several leases."
                ),
            ),
            None => (
                format!("This {} request is outside its workload's limits.", req.workload),
                "Ask without naming a substrate, so placement picks one the workload allows."
                    .to_owned(),
            ),
        },
        ReasonCode::ModelNotAllowed => {
            let allowed = ctx
                .config
                .team(team_name)
                .map(|t| t.allowed_models.join(", "))
                .unwrap_or_default();
            (
                format!(
                    "Team {team_name} may not use {}.",
                    req.gpu_model.as_deref().unwrap_or("that model")
                ),
                format!("Pick one of the models it may use: {allowed}."),
            )
        }
        ReasonCode::DurationLimit => match (req.duration, policy.max_duration) {
            (Some(asked), Some(max)) => (
                format!(
                    "A {} lease may last at most {}; you asked for {}.",
                    req.workload,
                    hours(max),
                    hours(asked)
                ),
                format!(
                    "Ask for {} or less; you can extend the lease later, up to {} in all.",
                    hours(max),
                    hours(max)
                ),
            ),
            _ => (
                format!("The duration is longer than {} leases may last.", req.workload),
                "Ask for a shorter duration.".to_owned(),
            ),
        },
        ReasonCode::QuotaExceeded => match ctx.team {
            Some(t) => {
                let free = t.gpu_quota.saturating_sub(t.gpus_held);
                (
                    format!(
                        "The team has {free} of {} GPUs free ({} held in open leases); you asked for {}.",
                        t.gpu_quota, t.gpus_held, req.gpus
                    ),
                    if free == 0 {
                        "Release a lease of the team's first, or ask an admin for a larger quota."
                            .to_owned()
                    } else {
                        format!(
                            "Ask for {free} GPU{} or fewer, or release a lease first.",
                            if free == 1 { "" } else { "s" }
                        )
                    },
                )
            }
            None => (
                "The team's GPU quota is used up.".to_owned(),
                "Release a lease first.".to_owned(),
            ),
        },
        ReasonCode::BudgetExceeded => {
            let cost = decision
                .estimate
                .max_usd
                .unwrap_or(decision.estimate.usd_per_hour);
            match ctx.team {
                Some(t) => {
                    let left = (t.monthly_budget_usd - t.month_to_date_usd).max(0.0);
                    let rate = decision.estimate.usd_per_hour;
                    let fix = if left <= 0.0 {
                        "The budget is spent for this month: ask an admin to raise it, or wait for the next month.".to_owned()
                    } else if rate > 0.0 {
                        let fits = Duration::from_secs((left / rate * 3600.0).floor() as u64);
                        format!(
                            "Ask for fewer GPUs or a shorter time: at {}/h, {} fit in what is left.",
                            usd(rate),
                            hours(Duration::from_secs(fits.as_secs() / 60 * 60))
                        )
                    } else {
                        "Ask for fewer GPUs or a shorter time.".to_owned()
                    };
                    (
                        format!(
                            "{} of {} left this month; this lease may cost up to {}.",
                            usd(left),
                            usd(t.monthly_budget_usd),
                            usd(cost)
                        ),
                        fix,
                    )
                }
                None => (
                    format!("This lease may cost {}, more than the team has left.", usd(cost)),
                    "Ask for fewer GPUs or a shorter time.".to_owned(),
                ),
            }
        }
        ReasonCode::NoCapacity => (
            format!(
                "No substrate has {} free GPUs of {} together right now.",
                req.gpus,
                req.gpu_model.as_deref().unwrap_or("a model your team may use")
            ),
            "Ask for fewer GPUs or another model, or try again when leases end.".to_owned(),
        ),
        ReasonCode::TeamBlocked => (
            format!("Team {team_name}'s new requests are blocked (over its monthly budget, or by an admin)."),
            "The block lifts when the budget allows again (a new month, or a raised budget); an admin can tell you more.".to_owned(),
        ),
        ReasonCode::AccountUnmapped | ReasonCode::AccountPrivileged => (
            format!("The substrate cannot run work as {}.", req.user),
            "Ask an admin to map your user to an ordinary system account on the substrate."
                .to_owned(),
        ),
        ReasonCode::ProgramNotAllowed => (
            format!("{} leases may not run that program.", req.workload),
            format!(
                "Run one of: {}.",
                policy.programs.join(", ")
            ),
        ),
        ReasonCode::ResizeUnsupported => (
            "The lease's substrate cannot change a running lease's GPUs.".to_owned(),
            "Release it and ask again with the GPUs you want.".to_owned(),
        ),
        ReasonCode::WorkloadNotOffered => (
            format!("{} leases are not offered here.", req.workload),
            format!(
                "Ask for one of: {}.",
                ctx.config
                    .workloads
                    .keys()
                    .map(|w| w.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ),
    };
    Explained {
        code: reason.code,
        problem,
        fix,
    }
}

#[cfg(test)]
mod tests {
    use gpuwarden_schema::config::{TeamConfig, WorkloadPolicy};
    use gpuwarden_schema::Workload;

    use super::*;
    use crate::policy::Estimate;

    fn config() -> Config {
        let mut config = Config::default();
        config.teams.push(TeamConfig {
            name: "ml".into(),
            members: vec!["ada".into()],
            gpu_quota: 16,
            monthly_budget_usd: 5000.0,
            allowed_models: vec!["H100".into(), "A100".into()],
        });
        config.workloads.insert(
            Workload::Notebook,
            WorkloadPolicy {
                max_gpus: Some(2),
                max_duration: Some(Duration::from_secs(8 * 3600)),
                ..WorkloadPolicy::default()
            },
        );
        config
    }

    fn request(gpus: u32, hours: u64) -> AdmissionRequest {
        AdmissionRequest {
            team: "ml".into(),
            user: "ada".into(),
            project: "p".into(),
            workload: Workload::Notebook,
            gpus,
            gpu_model: Some("L40S".into()),
            substrate: None,
            duration: Some(Duration::from_secs(hours * 3600)),
            labels: None,
            dry_run: false,
            command: None,
        }
    }

    fn team(held: u32, spent: f64) -> Team {
        Team {
            name: "ml".into(),
            gpu_quota: 16,
            gpus_held: held,
            month_to_date_usd: spent,
            monthly_budget_usd: 5000.0,
            blocked: false,
            allowed_models: Vec::new(),
        }
    }

    fn decision(codes: &[ReasonCode], usd_per_hour: f64, max_usd: f64) -> Decision {
        Decision {
            reasons: codes
                .iter()
                .map(|&code| Reason {
                    code,
                    message: "the policy's own words, not read here".into(),
                })
                .collect(),
            estimate: Estimate {
                usd_per_hour,
                max_usd: Some(max_usd),
                gpu_model: None,
            },
            placement: None,
            duration: None,
        }
    }

    #[test]
    fn quota_and_budget_say_what_is_left_and_what_would_fit() {
        let config = config();
        let req = request(4, 2);
        let t = team(13, 4588.0);
        let teams = vec!["ml".to_owned()];
        let ctx = Context {
            config: &config,
            request: &req,
            team: Some(&t),
            teams: &teams,
        };
        let got = explain(
            &decision(
                &[ReasonCode::QuotaExceeded, ReasonCode::BudgetExceeded],
                200.0,
                800.0,
            ),
            &ctx,
        );
        assert_eq!(
            got[0].problem,
            "The team has 3 of 16 GPUs free (13 held in open leases); you asked for 4."
        );
        assert_eq!(
            got[0].fix,
            "Ask for 3 GPUs or fewer, or release a lease first."
        );
        assert_eq!(
            got[1].problem,
            "$412.00 of $5,000.00 left this month; this lease may cost up to $800.00."
        );
        // $412 at $200/h: 2 h 3 min 36 s, shown to the minute.
        assert_eq!(
            got[1].fix,
            "Ask for fewer GPUs or a shorter time: at $200.00/h, 2h 3m fit in what is left."
        );
    }

    #[test]
    fn limits_name_the_limit_and_the_ask() {
        let config = config();
        let req = request(3, 12);
        let teams = vec!["ml".to_owned(), "cv".to_owned()];
        let ctx = Context {
            config: &config,
            request: &req,
            team: None,
            teams: &teams,
        };
        let got = explain(
            &decision(
                &[
                    ReasonCode::WorkloadLimit,
                    ReasonCode::DurationLimit,
                    ReasonCode::ModelNotAllowed,
                    ReasonCode::NotMember,
                ],
                1.0,
                1.0,
            ),
            &ctx,
        );
        assert_eq!(
            got[0].problem,
            "A notebook lease may hold at most 2 GPUs; you asked for 3."
        );
        assert_eq!(
            got[1].problem,
            "A notebook lease may last at most 8h; you asked for 12h."
        );
        assert_eq!(got[2].fix, "Pick one of the models it may use: H100, A100.");
        assert!(got[3].fix.contains("ml, cv"), "{}", got[3].fix);
        assert!(got
            .iter()
            .all(|x| !x.problem.contains("policy's own words")));
    }

    #[test]
    fn a_kind_not_offered_names_the_kinds_that_are() {
        let config = config();
        let mut req = request(1, 1);
        req.workload = Workload::Batch;
        let ctx = Context {
            config: &config,
            request: &req,
            team: None,
            teams: &[],
        };
        let got = explain(&decision(&[ReasonCode::WorkloadNotOffered], 1.0, 1.0), &ctx);
        assert_eq!(got[0].problem, "batch leases are not offered here.");
        assert_eq!(got[0].fix, "Ask for one of: notebook.");
    }
}
